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
* ``model_id``: the drafter's Hub repo id, named in the serve command (set by
  :func:`peagle_train.export.hub.push_to_hub`); default: ``drafter_path``.
* ``drafter_path``: the export's absolute local path, named in the serve command when
  there is no ``model_id``; default: the ``model_ref`` argument (the writer passes the
  absolute export directory).
* ``serve_target``: the target as ``vllm serve`` takes it (a Hub id or a local model
  directory); default: ``target_name``. ``target_hub_id``: the target's Hub id, used
  instead of a local ``serve_target`` in the card that is pushed to the Hub.
* ``license``: SPDX id for the front matter. ``notes``: free text appended.
* ``random_weights``: the configuration a random-weight target was built from
  (``target.random_init_from_config``); the card then opens with a warning that its acceptance means nothing.

The serve command is runnable as written: it names the target's Hub id or path and the
drafter's Hub repo id or absolute path, and the card says which each is. Everything else
(``data``, ``training``, ``train``, ``recipe``, ``eval``, ``notes``) is published as
it is, so local paths, home folders and tokens in them are redacted
(:func:`redact_local_paths`); :func:`data_summary` keeps only a dataset's name and counts.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from peagle_train.methods import method_of_config
from peagle_train.peagle.metrics import simulated_acceptance_lengths

CARD_KEYS = ("data", "metrics", "eval", "training", "train", "recipe", "model_id", "drafter_path", "serve_target",
             "target_hub_id", "license", "notes", "random_weights")

#: the target in a published serve command when only a local folder of it was known (the card says to fill it in).
TARGET_PLACEHOLDER = "<TARGET_HUB_ID_OR_PATH>"
#: what stands in the published card for a redacted local path, home folder or token.
REDACTED = "<local path>"
# an absolute POSIX path (/root, /home/user/x) or a home-relative one (~/x), not part of a URL or a
# relative path (a/b), nor a lone slash between words ("H / T")
_ABS_PATH = re.compile(r"(?<![\w.:/~-])(?:~(?=/)|~[A-Za-z_][\w.-]*(?=/)|)/(?:[\w.@+-]+/?)+")
_WIN_PATH = re.compile(r"(?<![\w])[A-Za-z]:\\[^\s`'\"|)]*")
_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def _floats(xs) -> list[float]:
    """Floats of a per-depth list read back from strict JSON, where ``null`` stands for NaN (a depth
    without supervised elements, or one no chain reached: :func:`~peagle_train.core.atomic.finite_or_none`)."""
    return [float("nan") if x is None else float(x) for x in xs]


def redact_local_paths(text: str) -> str:
    """``text`` with absolute and home-relative paths, Windows paths and Hub tokens (``hf_...``, and
    the value of ``$HF_TOKEN``) replaced by :data:`REDACTED`: what a published card must never hold."""
    tok = os.environ.get("HF_TOKEN")
    if tok:
        text = text.replace(tok, "<token>")
    text = _TOKEN.sub("<token>", text)
    text = _WIN_PATH.sub(REDACTED, text)
    return _ABS_PATH.sub(REDACTED, text)


def public_value(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, scalars) with :func:`redact_local_paths` applied to every string."""
    if isinstance(obj, str):
        return redact_local_paths(obj)
    if isinstance(obj, dict):
        return {public_value(k) if isinstance(k, str) else k: public_value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [public_value(v) for v in obj]
    return obj


def is_local_path(ref: str) -> bool:
    """Whether a model reference names a local folder (absolute, ``~``, ``./``, or existing) rather than a Hub id."""
    return (os.path.isabs(ref) or ref.startswith(("~", "./", "../")) or Path(ref).exists()) if ref else False


def dataset_name(source: str, path: str | None) -> str:
    """How a dataset is named in a published card: the Hub dataset id or ``pkg:`` file as given, a
    local file by its file name only (never its folders), or the source's default."""
    if not path:
        return f"{source} (the source's default dataset)"
    if is_local_path(path) or "\\" in path:
        return f"{source}: {Path(path.replace(chr(92), '/')).name} (local file)"
    return f"{source}: {path}"


def target_refs(path: str | None, name: str, hub_id: str | None = None) -> tuple[str, str | None]:
    """``(serve_target, target_hub_id)`` of a recipe's target (card keys of the same names).

    Args:
        path: ``target.path`` (a local model directory or a Hub id), None for a GGUF target.
        name: ``target.name``: what a GGUF target is served as.
        hub_id: the target's Hub id when the recipe knows it (``export.verifier``).

    Returns:
        The target as the local card's serve command names it (a local directory made
        absolute, else the Hub id, else the name) and its Hub id for the published card
        (None when only a local folder is known).
    """
    if path:
        if is_local_path(path):
            return str(Path(path).expanduser().absolute()), hub_id
        return path, hub_id or path
    return name, hub_id or name


def _counts(d: Any) -> dict:
    """The integer / float leaves of ``d`` (nested dicts kept), every string dropped."""
    out = {}
    for k, v in (d or {}).items() if isinstance(d, dict) else ():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, dict) and (sub := _counts(v)):
            out[k] = sub
    return out


def data_summary(meta: dict, source: str, path: str | None, mix: list[tuple[str, str | None]] = ()) -> dict:
    """The training-data section of a card: the datasets' names and counts only.

    Args:
        meta: ``data/meta.json`` of a run (``source`` report, with ``mix`` when the recipe mixes; ``splits``).
        source: the recipe's ``data.source``. path: its ``data.path`` (a local file, Hub name or None).
        mix: ``(source, path)`` of each ``data.mix`` entry, in order.

    Returns:
        ``{"dataset": name, "source": {counts}, "splits": {split: {counts}}}``, and with ``mix``
        ``"mixed_with": {name: {counts}}``: numbers only besides the names, so no local path, user name or
        token can leak from the report.
    """
    out: dict = {"dataset": dataset_name(source, path)}
    if (src := _counts(meta.get("source"))):
        out["source"] = src
    reports = (meta.get("source") or {}).get("mix") or []
    if mix:
        out["mixed_with"] = {f"{i + 1}. {dataset_name(s, p)}": _counts(reports[i]) if i < len(reports) else {}
                             for i, (s, p) in enumerate(mix)}
    splits = {name: _counts({k: v for k, v in sp.items() if k not in ("regeneration", "reasoning")})
              for name, sp in (meta.get("splits") or {}).items() if isinstance(sp, dict)}
    if splits:
        out["splits"] = splits
    return out


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


def drafter_ref_note(drafter_ref: str, on_hub: bool) -> str:
    """The card's sentence saying what the serve command's ``model`` is."""
    if on_hub:
        return f"- `model` is the drafter's Hub repo id `{drafter_ref}`."
    return (f"- `model` is this export's absolute local path `{drafter_ref}` (on this machine only); "
            f"`peagle-train push` re-renders this card with the Hub repo id.")


def target_ref_note(target_ref: str, target_name: str) -> str:
    """The card's sentence saying what the serve command's target is (Hub id, local path, or to fill in)."""
    if target_ref == TARGET_PLACEHOLDER:
        return (f"- Replace `{target_ref}` with the Hub id or a local directory of the target {target_name} "
                f"(it was a local folder when the drafter was trained).")
    if is_local_path(target_ref):
        return f"- The target `{target_ref}` is a local model directory (on this machine only)."
    return f"- The target `{target_ref}` is a Hub id (or a name the serving machine resolves)."


def serve_section(target_ref: str, target_name: str, drafter_ref: str, drafter_on_hub: bool, K: int,
                  parallel_drafting: bool) -> list[str]:
    """The lines of the card's serve block: the command and what its target and ``model`` are.

    :func:`peagle_train.export.hub.hub_readme` swaps this block for the one with the Hub repo id,
    so it is one function of these arguments."""
    return ["```bash", serve_command(target_ref, drafter_ref, K, parallel_drafting), "```", "",
            target_ref_note(target_ref, target_name), drafter_ref_note(drafter_ref, drafter_on_hub)]


def render_model_card(config: dict, *, target_name: str, model_ref: str, card: dict | None = None) -> str:
    """Markdown model card for an export.

    Args:
        config: the export's ``config.json`` dict (source of K, H, T, vocab sizes, aux ids).
        target_name: the target model's name (title, front matter); the serve command uses
            ``card['serve_target']`` when given.
        model_ref: how the drafter is named in the serve command: its absolute local path
            (overridden by ``card['drafter_path']``, then by the Hub id ``card['model_id']``).
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
    on_hub = bool(card.get("model_id"))
    ref = card.get("model_id") or card.get("drafter_path") or model_ref
    target_ref = card.get("serve_target") or target_name
    card = {k: (public_value(v) if k in ("data", "training", "train", "recipe", "eval", "notes") else v)
            for k, v in card.items()}
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
    if card.get("random_weights"):
        out += ["", f"> **Random-weight target.** This drafter was trained on a target built from "
                f"`{card['random_weights']}` with random weights (`target.random_init_from_config`): its shapes, "
                "memory figures and times are the real model's, its acceptance lengths mean nothing. Do not serve it."]
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

    out += ["", "## Serve with vLLM (>= 0.33)", ""]
    out += serve_section(target_ref, target_name, ref, on_hub, K if parallel_drafting else 3, parallel_drafting)
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


__all__ = ["CARD_KEYS", "REDACTED", "TARGET_PLACEHOLDER", "data_summary", "dataset_name", "drafter_ref_note",
           "is_local_path", "public_value", "redact_local_paths", "render_model_card", "serve_command", "serve_section",
           "simulated_acceptance_lengths", "target_ref_note", "target_refs"]
