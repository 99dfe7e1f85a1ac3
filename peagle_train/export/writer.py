"""Export a trained drafter as the checkpoint vLLM loads (spec §5), and load it back.

This is the only module that knows vLLM's checkpoint layout. The drafter's
module names already equal vLLM's keys (see :mod:`peagle_train.model.drafter`), so
the key map is the identity restricted to :func:`peagle_train.export.check.expected_weights`
(``t2d`` added, ``d2t`` dropped when ``Vd == V``, RoPE buffers never exported).

Two formats:

* :func:`export_vllm` — ``config.json`` + ``model.safetensors`` + tokenizer +
  README.md, served with ``--speculative-config '{"method": "eagle3", "model":
  DIR, "num_speculative_tokens": K, "parallel_drafting": true}'``.
* :func:`export_speculators` — vLLM's ``speculators`` format
  (``speculators_model_type: "peagle"``), read by
  ``vllm/transformers_utils/configs/speculators/`` (same weights, config nested
  under ``transformer_layer_config`` with ``speculators_config``).

Both write into a temporary directory next to ``out_dir``, run the contract
check (:mod:`peagle_train.export.check`) on it, and only then rename it into place, so
a failed export never leaves a partial directory behind. Every file is written
``0644`` and every folder ``0755`` (safetensors and ``mkdtemp`` create ``0600`` /
``0700``), so a serving process running as another user can read the export.

Beside the files vLLM reads, an export holds the hidden :data:`CARD_SOURCE_FILE`: the
arguments of the model card's serve block, so that
:func:`peagle_train.export.hub.push_to_hub` can re-render that block with the Hub repo id
(hidden files are never uploaded).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from peagle_train.core.config import ConfigError
from peagle_train.core.dtypes import FLOAT_EXPORT_DTYPES, SAFETENSORS_DTYPES, dtype_name
from peagle_train.export.check import ExportCheckError, assert_export_ok, check_against_target, expected_weights
from peagle_train.export.check_speculators import flatten_speculators_config, is_hub_repo_id
from peagle_train.export.contract import CONFIG_FILE, WEIGHTS_FILE, not_a_drafter_message
from peagle_train.export.model_card import is_local_path, render_model_card
from peagle_train.methods import method_of_config
from peagle_train.model.drafter import Drafter

EXPORT_ARCHITECTURE = "LlamaForCausalLMEagle3"
README_FILE = "README.md"
#: hidden file of an export: the model card's serve-block arguments (:func:`card_source`), read by
#: :func:`peagle_train.export.hub.hub_readme`; never uploaded (hidden).
CARD_SOURCE_FILE = ".peagle-card.json"
#: modes of every exported file and folder (readable by a serving process of another user).
FILE_MODE, DIR_MODE = 0o644, 0o755
#: torch dtypes an export may be written in (``config.json`` names them with :func:`~peagle_train.core.dtypes.dtype_name`).
EXPORT_DTYPES = tuple(SAFETENSORS_DTYPES[code] for code in FLOAT_EXPORT_DTYPES)


class ExportError(RuntimeError):
    """The drafter (or the requested export) cannot produce a valid vLLM checkpoint; the message says why."""


class TargetMismatchError(ExportError):
    """The drafter does not fit the target it is exported for (bad input, not a bug: the recipe names
    another target than the one it was trained on); the message lists every differing field."""


# --------------------------------------------------------------------------- config


def _rope_fields(cfg) -> dict:
    """``rope_theta``, ``rope_scaling`` (legacy names vLLM/older transformers read) and ``rope_parameters``."""
    rp = getattr(cfg, "rope_parameters", None)
    if rp:
        rp = dict(rp)
        theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rp["rope_theta"] = theta
        scaling = None if rp.get("rope_type", "default") == "default" else {
            k: v for k, v in rp.items() if k != "rope_theta"}
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_parameters": rp}
    theta = getattr(cfg, "rope_theta", 10000.0)
    scaling = getattr(cfg, "rope_scaling", None)
    rp = {"rope_type": "default", **(dict(scaling) if scaling else {}), "rope_theta": theta}
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None, "rope_parameters": rp}


def _target_dict(target_config) -> dict:
    """A target config (a transformers config or its ``config.json`` dict) as a dict."""
    return dict(target_config) if isinstance(target_config, dict) else target_config.to_dict()


def _validate_against_target(cfg, target_config) -> None:
    """Raise :class:`ExportError` listing every field the drafter config does not share with its target
    (:func:`~peagle_train.export.check.check_against_target`, plus ``max_position_embeddings`` and the
    draft method's own rule)."""
    flat = {"eagle_aux_hidden_state_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids),
            "target_hidden_size": cfg.target_hidden_size, "vocab_size": cfg.vocab_size}
    target = _target_dict(target_config)
    problems = check_against_target(flat, target)
    tmax = target.get("max_position_embeddings")
    if tmax is not None and cfg.max_position_embeddings != tmax:
        problems.append(f"drafter config max_position_embeddings = {cfg.max_position_embeddings} but the target's "
                        f"max_position_embeddings = {tmax} (spec §5: must equal the target's)")
    if problems:
        raise TargetMismatchError("the drafter does not fit the target it is exported for:\n"
                          + "\n".join(f"  - {p}" for p in problems))
    try:
        if target.get("vocab_size") is not None:
            method_of_config(cfg).check_target(cfg, target["vocab_size"])
    except ValueError as e:
        raise TargetMismatchError(str(e)) from None


def build_vllm_config(drafter_config, *, target_config=None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The ``config.json`` dict of spec §5 for a drafter config.

    Args:
        drafter_config: the drafter's ``LlamaConfig`` with the P-EAGLE extras of
            :func:`peagle_train.model.drafter.make_drafter_config`.
        target_config: the target's transformers config; when given, vocab size,
            hidden size and ``max_position_embeddings`` are cross-checked and its
            ``bos_token_id`` / ``eos_token_id`` are copied. Nothing else is copied
            from it (never ``layer_types``, ``sliding_window``, ... spec §5).
        dtype: the dtype the weights are written in (recorded as ``dtype``/``torch_dtype``).

    Returns:
        A JSON-ready dict: ``model_type: llama``, ``architectures:
        ["LlamaForCausalLMEagle3"]``, the drafter's Llama fields with
        ``attention_bias``/``mlp_bias``/``tie_word_embeddings`` false and
        ``hidden_act: silu``, rope fields, ``draft_vocab_size``,
        ``target_hidden_size``, ``norm_before_residual: false``, aux ids at top
        level and in ``eagle_config``; for P-EAGLE ``parallel_drafting: true``,
        ``ptd_token_id`` = ``pard_token`` = mask token and ``num_parallel_depths`` (K).
        With H != T, ``allow_hidden_size_mismatch: true``.

    Raises:
        ExportError: a P-EAGLE config without a mask token, a non-silu MLP, biases
            or tied embeddings, H != T without the opt-in, or a mismatch with
            ``target_config``.
    """
    c = drafter_config
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype must be one of {[dtype_name(d) for d in EXPORT_DTYPES]}, got {dtype}")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ExportError(f"drafter hidden_act is {c.hidden_act!r}; vLLM's drafter MLP is SwiGLU ('silu')")
    for k in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if getattr(c, k, False):
            raise ExportError(f"drafter config has {k}=true; this exporter (and spec §5) requires it false")
    H, T = c.hidden_size, c.target_hidden_size
    if H != T and not getattr(c, "allow_hidden_size_mismatch", False):
        raise ExportError(f"drafter hidden_size {H} != target hidden size {T} without allow_hidden_size_mismatch "
                          f"(spec §5 decision)")
    if target_config is not None:
        _validate_against_target(c, target_config)
    ids = [int(i) for i in c.eagle_aux_hidden_state_layer_ids]
    out = {
        "architectures": [EXPORT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": H,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        **_rope_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": T,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": ids,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(ids)},
        "dtype": dtype_name(dtype),
        "torch_dtype": dtype_name(dtype),
    }
    if target_config is not None:
        target = _target_dict(target_config)
        for k in ("bos_token_id", "eos_token_id"):
            if target.get(k) is not None:
                out[k] = target[k]
    if H != T:
        out["allow_hidden_size_mismatch"] = True
    try:  # the draft method's own fields (P-EAGLE: parallel_drafting, ptd_token_id, pard_token, K)
        out.update(method_of_config(c).vllm_fields(c))
    except ValueError as e:
        raise ExportError(str(e)) from None
    return out


# --------------------------------------------------------------------------- weights


def export_state_dict(drafter: Drafter, config: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of the export: every key of :func:`~peagle_train.export.check.expected_weights` plus ``t2d``.

    Floats are cast to ``dtype``, ``d2t`` is int64 (only when ``Vd < V``), ``t2d``
    bool; all on CPU, contiguous, unshared (safetensors needs that). Pass the
    unwrapped drafter (not a DDP/FSDP wrapper, whose keys carry ``module.``).

    Raises:
        ExportError: a tensor vLLM needs is missing, has the wrong shape, a
            trained parameter has no place in the vLLM key map (it would be lost),
            or ``Vd == V`` with a non-zero ``d2t``.
    """
    sd = drafter.state_dict()
    if "mask_embedding" in sd:  # drafter.embeddings: frozen: the trained mask row joins the shipped table
        sd["embed_tokens.weight"] = drafter.merged_embeddings()
        del sd["mask_embedding"]
    required, optional = expected_weights(config)
    out: dict[str, torch.Tensor] = {}
    for key, (shape, kind) in required.items():
        if key not in sd:
            raise ExportError(f"drafter has no tensor '{key}' (needed by vLLM, shape {list(shape)})")
        t = sd[key].detach().to("cpu")
        if tuple(t.shape) != shape:
            raise ExportError(f"drafter tensor '{key}' has shape {list(t.shape)}, vLLM expects {list(shape)}")
        t = t.to(dtype) if kind == "float" else t.to(torch.int64 if kind == "int64" else torch.bool)
        out[key] = t.contiguous().clone()
    if "t2d" in sd:
        out["t2d"] = sd["t2d"].detach().to("cpu", torch.bool).contiguous().clone()
    V, Vd = config["vocab_size"], config["draft_vocab_size"]
    if Vd == V and "d2t" in sd and bool(sd["d2t"].ne(0).any()):
        raise ExportError("draft vocab == target vocab but d2t is not all zeros; the draft ids are a permutation "
                          "vLLM cannot express without d2t (and vLLM 0.33 rejects d2t when Vd == V)")
    skipped = {k for k in sd if k not in out and k != "d2t" and "rotary_emb" not in k and k not in optional}
    if skipped:
        raise ExportError(f"drafter tensors {sorted(skipped)} have no key in vLLM's checkpoint layout; exporting "
                          f"would silently drop trained weights")
    return out


# --------------------------------------------------------------------------- atomic directory


def _prepare_target_dir(out_dir: str | Path, overwrite: bool) -> Path:
    out = Path(out_dir).absolute()
    if out.exists():
        if not out.is_dir():
            raise FileExistsError(f"export target '{out}' exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"export target '{out}' exists and is not empty; choose a new directory or pass "
                                  f"overwrite=True")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def _atomic_dir(out: Path, overwrite: bool):
    """Yield a temp dir next to ``out``; on success rename it to ``out``, on any error remove it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _set_modes(tmp)
        if out.exists():
            if any(out.iterdir()) and not overwrite:
                raise FileExistsError(f"export target '{out}' was filled while exporting; not overwriting")
            backup = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, backup)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(backup, out)
                raise
            shutil.rmtree(backup, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _set_modes(root: Path) -> None:
    """``chmod`` every file under ``root`` to :data:`FILE_MODE` and every folder (``root`` too) to
    :data:`DIR_MODE`: ``mkdtemp`` makes ``0700`` and safetensors' ``save_file`` ``0600``."""
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames:
            os.chmod(os.path.join(dirpath, n), DIR_MODE)
        for n in filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                os.chmod(p, FILE_MODE)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# --------------------------------------------------------------------------- vLLM format


def export_vllm(
    drafter: Drafter,
    out_dir: str | Path,
    *,
    tokenizer=None,
    target_name: str,
    target_config=None,
    dtype: torch.dtype = torch.bfloat16,
    card: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the drafter as a vLLM-loadable EAGLE-3 / P-EAGLE checkpoint (spec §5).

    Files: ``config.json`` (:func:`build_vllm_config`), ``model.safetensors``
    (:func:`export_state_dict`: floats in ``dtype``, ``d2t`` int64 iff ``Vd < V``,
    ``t2d`` bool, ``mask_hidden`` for P-EAGLE, ``embed_tokens`` and ``lm_head``
    always, no ``model.`` prefix, no RoPE buffers), the tokenizer's files
    (``tokenizer.save_pretrained``) when given, and ``README.md``
    (:func:`peagle_train.export.model_card.render_model_card`).

    The directory is written to a temp dir beside ``out_dir``, checked with
    :func:`peagle_train.export.check.assert_export_ok`, then renamed into place.

    Args:
        drafter: the trained :class:`~peagle_train.model.drafter.Drafter` (unwrapped).
        out_dir: destination directory; must not exist or be empty unless ``overwrite``.
        tokenizer: the target's tokenizer (its files are saved alongside), or None.
        target_name: the target's name, used in the model card (its serve command names
            ``card['serve_target']``, default ``target_name``).
        target_config: the target's transformers config (or its ``config.json`` dict),
            cross-checked (optional): aux ids inside its layers, hidden size, vocab,
            ``max_position_embeddings``; its bos/eos ids are copied.
        dtype: float dtype of the weights (bfloat16 for serving; float32 for exact round trips).
        card: optional model-card sections (see :mod:`peagle_train.export.model_card`); the
            serve command names the drafter by ``card['model_id']`` (a Hub id) or else by the
            absolute ``out_dir``.
        overwrite: replace a non-empty ``out_dir``.

    Returns:
        ``out_dir`` as an absolute :class:`~pathlib.Path`.

    Raises:
        FileExistsError: ``out_dir`` is non-empty and ``overwrite`` is False.
        ExportError: the drafter cannot be expressed in vLLM's format, or does not fit ``target_config``.
        ExportCheckError: the written files fail the contract check (nothing is left behind).
        ValueError: malformed ``card``.
    """
    out = _prepare_target_dir(out_dir, overwrite)
    config = build_vllm_config(drafter.config, target_config=target_config, dtype=dtype)
    tensors = export_state_dict(drafter, config, dtype)
    card = {"drafter_path": str(out), **(card or {})}
    readme = render_model_card(config, target_name=target_name, model_ref=str(out), card=card)
    _write_export(out, overwrite, tokenizer, config, tensors, readme, card_source(config, target_name, card))
    return out


def card_source(config: dict, target_name: str, card: dict | None) -> dict:
    """What :data:`CARD_SOURCE_FILE` records: the arguments of the card's serve block
    (:func:`~peagle_train.export.model_card.serve_section`) as rendered locally, and the target's
    Hub id for the published card (``card['target_hub_id']``, else ``serve_target`` when it is a
    Hub id, else None: the pushed card then asks the reader to fill it in)."""
    card = card or {}
    parallel = config.get("parallel_drafting") is True
    target_ref = card.get("serve_target") or target_name
    hub_id = card.get("target_hub_id") or (None if is_local_path(target_ref) else target_ref)
    return {"target_ref": target_ref, "target_name": target_name, "target_hub_id": hub_id,
            "drafter_ref": card.get("model_id") or card.get("drafter_path"),
            "drafter_on_hub": bool(card.get("model_id")),
            "K": int(config.get("num_parallel_depths") or 1) if parallel else 3, "parallel_drafting": parallel}


def load_drafter_folder(path: str | Path) -> Drafter:
    """:func:`peagle_train.model.checkpoint.load_drafter_dir`, refusing first a folder that is not a drafter.

    Raises:
        FileNotFoundError: no ``model.safetensors`` / ``config.json`` (says to train first).
        ConfigError: ``config.json`` is not JSON or has none of the drafter fields (a target or
            base model folder): names the folder and the missing fields.
    """
    from peagle_train.model.checkpoint import load_drafter_dir

    p = Path(path)
    if (p / CONFIG_FILE).is_file():
        try:
            raw = json.loads((p / CONFIG_FILE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{p / CONFIG_FILE}: not valid JSON ({e}); re-run `peagle-train train RECIPE`") from None
        msg = not_a_drafter_message(p, raw) if isinstance(raw, dict) else f"{p / CONFIG_FILE}: not a JSON object"
        if msg:
            raise ConfigError(msg)
    elif (p / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{p / CONFIG_FILE} not found: the drafter folder is incomplete; re-run "
                                f"`peagle-train train RECIPE`")
    return load_drafter_dir(p)


def _llama_config_from_flat(cfg: dict) -> LlamaConfig:
    kw = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                              "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act",
                              "max_position_embeddings", "vocab_size", "attention_bias", "mlp_bias",
                              "tie_word_embeddings") if k in cfg}
    if cfg.get("rope_parameters"):
        kw["rope_parameters"] = dict(cfg["rope_parameters"])
    else:
        kw["rope_theta"] = cfg.get("rope_theta", 10000.0)
        if cfg.get("rope_scaling"):
            kw["rope_scaling"] = dict(cfg["rope_scaling"])
    c = LlamaConfig(**kw)
    c.target_hidden_size = cfg["target_hidden_size"]
    c.draft_vocab_size = cfg["draft_vocab_size"]
    c.eagle_aux_hidden_state_layer_ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    for k, v in method_of_config(cfg).drafter_fields_from_export(cfg).items():
        setattr(c, k, v)
    c.num_parallel_depths = int(cfg.get("num_parallel_depths") or 1)
    c.allow_hidden_size_mismatch = bool(cfg.get("allow_hidden_size_mismatch", False))
    return c


def load_exported(path: str | Path, *, check: bool = True) -> Drafter:
    """Rebuild a :class:`~peagle_train.model.drafter.Drafter` from an export (either format), in float32.

    The drafter config comes from ``config.json`` only (``transformers.LlamaConfig``
    plus the P-EAGLE extras; for the speculators format the config is first
    flattened the way vLLM does). ``d2t`` absent means ``Vd == V`` (zeros);
    ``t2d`` absent is rebuilt from ``d2t``.

    Args:
        path: export directory.
        check: run the contract check first (raises on a broken export).

    Returns:
        The drafter in ``eval()`` mode, float32 parameters, on CPU.

    Raises:
        ExportCheckError: ``check`` and the export fails the contract check.
        RuntimeError: weights do not fit the rebuilt drafter (``load_state_dict`` strict).
    """
    d = Path(path)
    if check:
        assert_export_ok(d)
    raw = json.loads((d / CONFIG_FILE).read_text())
    cfg = flatten_speculators_config(raw) if "speculators_model_type" in raw else raw
    drafter = Drafter(_llama_config_from_flat(cfg))
    sd: dict[str, torch.Tensor] = {}
    for fp in sorted(d.glob("*.safetensors")):
        sd.update(load_file(str(fp)))
    sd = {k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()
          if not (k.startswith("layers.") and k.endswith("hidden_norm.weight") and not k.startswith("layers.0."))}
    Vd, V = cfg["draft_vocab_size"], cfg["vocab_size"]
    if "d2t" not in sd:
        sd["d2t"] = torch.zeros(Vd, dtype=torch.int64)
    if "t2d" not in sd:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[sd["d2t"] + torch.arange(Vd)] = True
        sd["t2d"] = t2d
    drafter.load_state_dict(sd, strict=True)
    return drafter.float().eval()


# --------------------------------------------------------------------------- speculators format


def build_speculators_config(drafter_config, *, verifier_name_or_path: str, verifier_architectures=None,
                             target_config=None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``config.json`` of vLLM's speculators format (``speculators_model_type: "peagle"``).

    Layout (vllm-project/speculators ``SpeculatorModelConfig`` / ``PEagleSpeculatorConfig``,
    read by ``vllm/transformers_utils/configs/speculators/{base,algos}.py``):
    ``transformer_layer_config`` (the drafter's Llama fields plus ``eagle_config``),
    top-level ``draft_vocab_size``, ``target_hidden_size``, ``norm_before_residual:
    false`` (written explicitly: speculators defaults it to True for eagle3),
    ``eagle_aux_hidden_state_layer_ids``, ``mask_token_id`` (P-EAGLE; vLLM maps it
    to ``pard_token``), and ``speculators_config`` with
    ``proposal_methods[0].speculative_tokens`` = K and the verifier path; the verifier's
    ``architectures`` are ``verifier_architectures``, by default the target config's
    ``architectures`` (empty without a target config).

    Raises:
        ExportError: as :func:`build_vllm_config`.
    """
    flat = build_vllm_config(drafter_config, target_config=target_config, dtype=dtype)
    if verifier_architectures is None and target_config is not None:
        verifier_architectures = _target_dict(target_config).get("architectures")
    method = method_of_config(flat)
    layer_keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "max_position_embeddings",
                  "vocab_size", "attention_bias", "mlp_bias", "tie_word_embeddings", "rope_theta", "rope_scaling",
                  "rope_parameters", "bos_token_id", "eos_token_id", "eagle_config", "allow_hidden_size_mismatch")
    tlc = {k: flat[k] for k in layer_keys if k in flat}
    tlc["architectures"] = ["LlamaForCausalLM"]
    fields = method.speculators_fields(flat, drafter_config)
    kind = fields["kind"]
    out = {
        "architectures": [fields["architecture"]],
        "speculators_model_type": kind,
        "transformer_layer_config": tlc,
        "draft_vocab_size": flat["draft_vocab_size"],
        "target_hidden_size": flat["target_hidden_size"],
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": flat["eagle_aux_hidden_state_layer_ids"],
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": fields["K"], "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(verifier_architectures or [])},
        },
        "dtype": flat["dtype"],
        "torch_dtype": flat["dtype"],
    }
    out.update(fields["extra"])
    return out


def export_speculators(
    drafter: Drafter,
    out_dir: str | Path,
    *,
    tokenizer=None,
    target_name: str,
    verifier_name_or_path: str | None = None,
    target_config=None,
    dtype: torch.dtype = torch.bfloat16,
    card: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the drafter in vLLM's speculators format (config of :func:`build_speculators_config`).

    Weights are the same ``model.safetensors`` as :func:`export_vllm` (vLLM loads
    both through ``Eagle3LlamaForCausalLM.load_weights``). Serve with
    ``vllm serve DIR`` (the verifier path comes from the config) or pass DIR as
    the speculative ``model``. Atomic and checked like :func:`export_vllm`.

    Args:
        verifier_name_or_path: the verifier's Hub repo id recorded in
            ``speculators_config.verifier.name_or_path``; default ``target_name``.
            vLLM 0.33 refuses a local path there (``maybe_override_with_speculators``).
        Others: as :func:`export_vllm`.

    Returns:
        ``out_dir`` as an absolute path.

    Raises:
        ExportError: as :func:`export_vllm`, or the verifier is not a Hub repo id.
        FileExistsError, ExportCheckError, ValueError: as :func:`export_vllm`.
    """
    verifier = verifier_name_or_path or target_name
    if not is_hub_repo_id(verifier):
        raise ExportError(f"speculators verifier {verifier!r} is not a Hub repo id; vLLM 0.33 refuses local verifier "
                          f"paths in a speculators config. Pass verifier_name_or_path='owner/name' (serve a local "
                          f"target with --model PATH --speculative-config), or use export_vllm")
    out = _prepare_target_dir(out_dir, overwrite)
    config = build_speculators_config(drafter.config, verifier_name_or_path=verifier,
                                      target_config=target_config, dtype=dtype)
    flat = flatten_speculators_config(config)
    tensors = export_state_dict(drafter, flat, dtype)
    card = {"drafter_path": str(out), "target_hub_id": verifier, **(card or {})}
    readme = render_model_card(flat, target_name=target_name, model_ref=str(out), card=card)
    ref = card.get("model_id") or card["drafter_path"]
    readme += ("\nThis directory is in vLLM's *speculators* format (`speculators_model_type: "
               f"\"{config['speculators_model_type']}\"`): `vllm serve {ref}` reads the verifier from "
               "`speculators_config.verifier.name_or_path`.\n")
    _write_export(out, overwrite, tokenizer, config, tensors, readme, card_source(flat, target_name, card))
    return out


def _write_export(out: Path, overwrite: bool, tokenizer, config: dict, tensors: dict, readme: str,
                  source: dict) -> None:
    """Write tokenizer, config, weights, card and :data:`CARD_SOURCE_FILE` into a temp dir, contract-check it,
    then give every file mode 0644 (folders 0755) and rename it to ``out``."""
    with _atomic_dir(out, overwrite) as tmp:
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        _write_json(tmp / CONFIG_FILE, config)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / README_FILE).write_text(readme)
        _write_json(tmp / CARD_SOURCE_FILE, source)
        assert_export_ok(tmp)


__all__ = ["CARD_SOURCE_FILE", "DIR_MODE", "EXPORT_ARCHITECTURE", "ExportCheckError", "ExportError", "FILE_MODE",
           "TargetMismatchError", "build_speculators_config", "build_vllm_config", "card_source",
           "export_speculators", "export_state_dict", "export_vllm", "load_drafter_folder", "load_exported"]
