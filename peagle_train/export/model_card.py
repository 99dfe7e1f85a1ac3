"""Model card (README.md) for an exported drafter (spec §5 "model card", §4 served K).

The card states what vLLM cannot check by itself: which target the drafter
belongs to, the maximum servable K (vLLM never compares ``num_speculative_tokens``
with the trained K, spec §4), the exact serve command, and the serving notes of
spec §5 for vLLM 0.33. Optional sections come from the ``card`` dict passed to
:func:`peagle_train.export.writer.export_vllm`.

``card`` keys (all optional; unknown keys raise ``ValueError`` to catch typos):

* ``data``: str, list of str, or dict (e.g. ``data/meta.json``): the training data
  (sources, sizes, regeneration).
* ``metrics``: per-depth results, either a :class:`peagle_train.peagle.metrics.DepthStats`
  or a dict ``{"accuracy": [K floats], "conditional_accuracy": [K floats]}``
  (the latter optional). Rendered as a table with the simulated acceptance
  length ``AL(k) = 1 + sum_{j=1..k} prod_{i<j} acc_cond(i)`` (spec §3).
* ``eval``: list of row dicts (e.g. ``{"dataset": "mt_bench", "K": 5,
  "acceptance_length": 3.1}``), rendered as a table with the union of keys.
* ``training``: dict of hyper-parameters (lr, steps, ...), rendered as a list.
* ``train``: the summary :func:`peagle_train.trainer.trainer.run_train` returns / writes to
  ``train_metrics.json`` (``method``, ``K``, ``steps``, ``final`` eval metrics...);
  its scalars are listed under Training and, when ``metrics`` is not given, its
  ``final.eval_acc`` / ``final.eval_cond_acc`` give the per-depth table.
* ``recipe``: the resolved run config (dict), shown in a collapsed YAML block.
* ``model_id``: how the drafter is named in the serve command (a Hub id);
  default: the export directory's name.
* ``license``: SPDX id for the front matter. ``notes``: free text appended.
"""
from __future__ import annotations

import json
from typing import Any

from peagle_train.methods import method_of_config
from peagle_train.peagle.metrics import simulated_acceptance_lengths

CARD_KEYS = ("data", "metrics", "eval", "training", "train", "recipe", "model_id", "license", "notes")


def _floats(xs) -> list[float]:
    """Floats of a per-depth list read back from strict JSON, where ``null`` stands for NaN (a depth
    without supervised elements, or one no chain reached: :func:`~peagle_train.core.atomic.finite_or_none`)."""
    return [float("nan") if x is None else float(x) for x in xs]


def _per_depth(metrics: Any) -> tuple[list[float], list[float] | None]:
    """``(accuracy, conditional_accuracy or None)`` from a DepthStats-like object or a dict."""
    if hasattr(metrics, "accuracy") and callable(metrics.accuracy):
        return list(metrics.accuracy()), list(metrics.conditional_accuracy())
    if not isinstance(metrics, dict) or "accuracy" not in metrics:
        raise ValueError("card['metrics'] must be a DepthStats or a dict with an 'accuracy' list (one per depth)")
    acc = _floats(metrics["accuracy"])
    cond = metrics.get("conditional_accuracy")
    if cond is not None:
        cond = _floats(cond)
        if len(cond) != len(acc):
            raise ValueError(f"card['metrics']: {len(acc)} accuracies but {len(cond)} conditional accuracies")
    return acc, cond


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return "n/a" if x != x else f"{x:.4g}"
    return str(x)


def _table(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _bullets(d: dict) -> list[str]:
    """``- `key`: value`` lines; nested values as compact JSON."""
    return [f"- `{k}`: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else _fmt(v)}"
            for k, v in d.items()]


def serve_command(target_name: str, model_ref: str, K: int, parallel_drafting: bool) -> str:
    """The ``vllm serve`` command line for this drafter (spec §5; vLLM's speculative method is ``eagle3``
    for both layouts, P-EAGLE adds ``parallel_drafting``)."""
    spec = {"method": "eagle3", "model": model_ref, "num_speculative_tokens": K}
    if parallel_drafting:
        spec["parallel_drafting"] = True
    return f"vllm serve {target_name} --speculative-config '{json.dumps(spec)}'"


def render_model_card(config: dict, *, target_name: str, model_ref: str, card: dict | None = None) -> str:
    """Markdown model card for an export.

    Args:
        config: the export's ``config.json`` dict (source of K, H, T, vocab sizes, aux ids).
        target_name: the target model (Hub id or path) the drafter serves.
        model_ref: how the drafter is named in the serve command (overridden by ``card['model_id']``).
        card: optional sections, see the module docstring.

    Returns:
        README.md text with YAML front matter.

    Raises:
        ValueError: unknown ``card`` keys or malformed ``metrics``.
    """
    card = dict(card or {})
    unknown = sorted(set(card) - set(CARD_KEYS))
    if unknown:
        raise ValueError(f"unknown model card keys {unknown}; allowed: {list(CARD_KEYS)}")
    parallel_drafting = config.get("parallel_drafting") is True
    K = int(config.get("num_parallel_depths") or 1) if parallel_drafting else None
    ref = card.get("model_id") or model_ref
    H, T = config.get("hidden_size"), config.get("target_hidden_size")
    V, Vd = config.get("vocab_size"), config.get("draft_vocab_size")
    method = method_of_config(config).title

    fm = ["---", f"base_model: {target_name}", "library_name: vllm",
          "tags: [speculative-decoding, eagle3" + (", p-eagle, parallel-drafting]" if parallel_drafting else "]")]
    if card.get("license"):
        fm.append(f"license: {card['license']}")
    fm.append("---")
    out = ["\n".join(fm), "", f"# {method} drafter for {target_name}", ""]
    out.append(f"A {config.get('num_hidden_layers')}-layer {method} draft model for speculative decoding of "
               f"**{target_name}** in vLLM, trained with peagle_train.")
    out += ["", "| property | value |", "|---|---|", f"| target | `{target_name}` |", f"| method | {method} |"]
    if parallel_drafting:
        out.append(f"| K trained (max servable `num_speculative_tokens`) | **{K}** |")
        out.append(f"| mask token (`ptd_token_id` = `pard_token`) | {config.get('ptd_token_id')} |")
    out += [f"| drafter hidden H / target hidden T | {H} / {T} |",
            f"| draft vocab Vd / target vocab V | {Vd} / {V} |",
            f"| aux target layers | {config.get('eagle_aux_hidden_state_layer_ids')} |",
            f"| layers, heads, KV heads, head dim | {config.get('num_hidden_layers')}, "
            f"{config.get('num_attention_heads')}, {config.get('num_key_value_heads')}, {config.get('head_dim')} |",
            f"| weights dtype | {config.get('dtype', 'n/a')} |"]

    out += ["", "## Serve with vLLM (>= 0.33)", "", "```bash",
            serve_command(target_name, ref, K if parallel_drafting else 3, parallel_drafting), "```", ""]
    if parallel_drafting:
        out += [f"- `num_speculative_tokens` may be any K <= **{K}** (the K trained). vLLM does not check this: "
                f"a larger K drafts depths the model never learned.",
                "- Parallel drafting runs on the V1 model runner only; vLLM raises with "
                "`VLLM_USE_V2_MODEL_RUNNER=1`.",
                "- Keep `disable_padded_drafter_batch` false (the default): parallel drafting needs the padded "
                "drafter batch.",
                "- Do not combine with a batch-size-dependent number of speculative tokens.",
                "- M-RoPE drafters are rejected by vLLM; this drafter uses plain RoPE."]
    else:
        out += ["- EAGLE-3 drafts autoregressively: pick `num_speculative_tokens` by measurement (typically 3-5)."]
    if isinstance(H, int) and isinstance(T, int) and H != T:
        out += [f"- **H != T opt-in**: this drafter has hidden size {H} while the target's is {T}. It was exported "
                f"with `allow_hidden_size_mismatch`; it needs vLLM >= 0.33 (which sizes `mask_hidden` as A*T) and "
                f"relies on the shipped `embed_tokens` (without them vLLM leaves embeddings uninitialised)."]
    if V != Vd:
        out += [f"- Draft vocabulary: {Vd} of the target's {V} tokens; `d2t` maps draft ids to target ids."]

    if card.get("data"):
        data = card["data"]
        out += ["", "## Training data", ""]
        if isinstance(data, dict):
            out += _bullets(data)
        else:
            out += [f"- {x}" for x in data] if isinstance(data, (list, tuple)) else [str(data)]
    train = card.get("train") or {}
    if not isinstance(train, dict):
        raise ValueError("card['train'] must be the dict run_train returns (train_metrics.json)")
    if card.get("training") or train:
        scalars = {k: v for k, v in train.items() if not isinstance(v, (dict, list))}
        out += ["", "## Training", ""] + _bullets({**(card.get("training") or {}), **scalars})
    metrics = card.get("metrics")
    final = train.get("final") if isinstance(train.get("final"), dict) else {}
    if metrics is None and final.get("eval_acc"):
        metrics = {"accuracy": final["eval_acc"], "conditional_accuracy": final.get("eval_cond_acc")}
    if metrics is not None:
        acc, cond = _per_depth(metrics)
        als = simulated_acceptance_lengths(cond) if cond is not None else None
        rows = []
        for d, a in enumerate(acc):
            row = {"depth": d, "top-1 accuracy": a}
            if cond is not None:
                row["conditional accuracy"] = cond[d]
                row["simulated AL at K = depth + 1"] = als[d]
            rows.append(row)
        out += ["", "## Per-depth acceptance", "",
                "Depth 0 is the next token; depth d predicts d tokens further. Conditional accuracy is "
                "the accuracy at depth d given every shallower depth of the chain was correct; the simulated "
                "acceptance length is `AL(K) = 1 + sum_k prod_{j<k} acc_cond(j)`.", "", _table(rows)]
    if card.get("eval"):
        rows = card["eval"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError("card['eval'] must be a list of row dicts")
        out += ["", "## Evaluation", "", _table(rows)]
    if card.get("recipe"):
        import yaml

        out += ["", "<details><summary>Resolved recipe</summary>", "", "```yaml",
                yaml.safe_dump(card["recipe"], sort_keys=False).rstrip(), "```", "", "</details>"]
    if card.get("notes"):
        out += ["", "## Notes", "", str(card["notes"])]
    out += ["", "## Files", "",
            "`config.json` (Llama drafter config read by vLLM's `Eagle3LlamaForCausalLM`), `model.safetensors` "
            "(keys without the `model.` prefix"
            + ("; `mask_hidden` is the learned pre-fc hidden state of the mask slots" if parallel_drafting else "")
            + "), plus the target's tokenizer files when they were exported with it.", ""]
    return "\n".join(out)


__all__ = ["CARD_KEYS", "render_model_card", "serve_command", "simulated_acceptance_lengths"]
