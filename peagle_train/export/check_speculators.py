"""Speculators-format rules of the vLLM export contract check (spec §5).

A speculators-format ``config.json`` (``speculators_model_type``) is checked for
the structure vLLM requires (:func:`check_speculators`), then flattened the way
vLLM flattens it (:func:`flatten_speculators_config`) so that
:mod:`peagle_train.export.check` can hold it to the vLLM-format rules. Split out of
:mod:`peagle_train.export.check`, which re-exports the public names.

Public API: :func:`flatten_speculators_config`, :func:`is_hub_repo_id`,
:func:`check_speculators`.
"""
from __future__ import annotations

from pathlib import Path

from peagle_train.export.contract import CONFIG_FILE, is_int


def flatten_speculators_config(cfg: dict) -> dict:
    """The flat drafter config vLLM derives from a speculators-format ``config.json``.

    Mirrors ``SpeculatorsConfig.extract_transformers_pre_trained_config`` and
    ``update_eagle3`` / ``update_peagle`` (``vllm/transformers_utils/configs/speculators/``):
    start from ``transformer_layer_config``, add ``draft_vocab_size``,
    ``target_hidden_size``, ``norm_before_residual`` (default False for peagle, True
    for eagle3), aux ids, and for peagle ``pard_token = mask_token_id``. To reuse
    the vLLM-format rules, the result also carries ``ptd_token_id`` (= pard_token),
    ``parallel_drafting`` and ``num_parallel_depths`` (= ``speculative_tokens``),
    and the architecture vLLM resolves (``PeagleLlamaForCausalLM`` /
    ``Eagle3LlamaForCausalLM`` both load ``llama_eagle3``) is written as
    ``LlamaForCausalLMEagle3``. Without ``eagle_config`` vLLM assumes 3 aux states,
    which is what is reproduced here.

    Raises:
        ValueError: ``speculators_model_type`` is neither ``peagle`` nor ``eagle3``.
    """
    kind = cfg.get("speculators_model_type")
    if kind not in ("peagle", "eagle3"):
        raise ValueError(f"speculators_model_type {kind!r} is not 'peagle' or 'eagle3'")
    flat = dict(cfg.get("transformer_layer_config") or {})
    flat["draft_vocab_size"] = cfg.get("draft_vocab_size")
    if cfg.get("target_hidden_size") is not None:
        flat["target_hidden_size"] = cfg["target_hidden_size"]
    else:
        flat.setdefault("target_hidden_size", flat.get("hidden_size"))
    flat["norm_before_residual"] = cfg.get("norm_before_residual", kind == "eagle3")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_aux_hidden_state_layer_ids"] = ids
    if "eagle_config" not in flat and isinstance(ids, list) and len(ids) == 3:
        flat["eagle_config"] = {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(ids)}
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    flat.setdefault("model_type", "llama")
    if kind == "peagle":
        flat["pard_token"] = cfg.get("mask_token_id")
        flat["ptd_token_id"] = cfg.get("mask_token_id")
        flat["parallel_drafting"] = True
        methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
        flat["num_parallel_depths"] = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    return flat


def is_hub_repo_id(name) -> bool:
    """What ``maybe_override_with_speculators`` (``vllm/transformers_utils/config.py``) accepts as verifier:
    a valid Hub repo id that is not an existing local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(name, str) or not name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return not (Path(name).exists() or Path(name).is_symlink())


def check_speculators(cfg: dict, problems: list[str]) -> None:
    """Structure vLLM's ``SpeculatorsConfig.validate_speculators_config`` requires, plus P-EAGLE's mask token."""
    P = problems.append
    f = CONFIG_FILE
    if cfg.get("speculators_model_type") not in ("peagle", "eagle3"):
        P(f"{f}: speculators_model_type {cfg.get('speculators_model_type')!r} is not 'peagle' or 'eagle3'")
        return
    if not isinstance(cfg.get("transformer_layer_config"), dict):
        P(f"{f}: 'transformer_layer_config' must be a dict of the drafter's Llama fields (vLLM raises without it)")
    sc = cfg.get("speculators_config")
    try:
        k = sc["proposal_methods"][0]["speculative_tokens"]
        if not is_int(k) or k < 1:
            P(f"{f}: speculators_config.proposal_methods[0].speculative_tokens must be an integer >= 1 (got {k!r})")
    except (KeyError, IndexError, TypeError):
        P(f"{f}: speculators_config.proposal_methods[0].speculative_tokens missing; vLLM raises 'Invalid "
          f"speculators config structure'. Write the trained K there")
    try:
        v = sc["verifier"]["name_or_path"]
        if not is_hub_repo_id(v):
            P(f"{f}: speculators_config.verifier.name_or_path must be the target's Hub repo id (got {v!r}); vLLM "
              f"0.33 refuses local verifier paths there ('Speculators verifier must name a remote model "
              f"repository'). Record the Hub id and pass a local target with --model instead")
    except (KeyError, TypeError):
        P(f"{f}: speculators_config.verifier.name_or_path missing; vLLM needs the verifier path")
    if cfg.get("speculators_model_type") == "peagle":
        m = cfg.get("mask_token_id")
        if not is_int(m):
            P(f"{f}: top-level 'mask_token_id' must be the trained mask token id for peagle (got {m!r}); vLLM maps "
              f"it to pard_token and raises KeyError without it")
    if "norm_before_residual" not in cfg:
        P(f"{f}: write 'norm_before_residual: false' explicitly; the speculators default differs between eagle3 "
          f"(True) and peagle (False)")


__all__ = ["check_speculators", "flatten_speculators_config", "is_hub_repo_id"]
