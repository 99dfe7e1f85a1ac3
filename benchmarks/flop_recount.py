"""Recount the FLOPs of committed ``benchmarks/train_step.py`` rows with every drafter layer's attention.

Usage::

    python benchmarks/flop_recount.py docs/data/train_step_s9_trainer_gptoss_8192.json \\
        --out docs/data/flop_recount_gptoss_8192.json

Rows written before the fix counted the attention of ONE decoder layer
(``12 * heads * head_dim * sum_q keys(q)``) where each of the drafter's ``L`` layers attends over the
whole grid (``L * 12 * ...``, ``train_step.attention_flops``). A row keeps ``flop``, ``positions`` (``E``)
and the real positions (``tokens``; ``N`` in rows written before that field existed), which is enough
to recount it exactly: the drafter of the file's shape is built on the ``meta`` device (no memory; the
lm_head frozen where ``meta.frozen`` says so), its matrix part is :func:`train_step.dense_flops`, the
rest of the recorded count is one layer's attention, and ``L`` times that replaces it. The drafter built
must have the file's ``meta.trainable_params`` (what decides the matrix part: a trained or frozen head,
the shape), and the pair count ``sum_q keys(q)`` that falls out must be a whole number between ``E`` and
``E * N`` (a weak check on its own: this shape's parameter counts are multiples of large powers of two,
so a wrong matrix part can still leave a whole number; the parameter check is the one that tells). TFLOP/s and the fraction of the bf16 matmul rate measured in the same
run (``meta.bf16_matmul_tflops``) follow from the row's own median step time.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import AUX_LAYER_IDS, DRAFTER_LAYERS, attention_flops, dense_flops, provenance, target_config  # noqa: E402

from peagle_train.model.drafter import Drafter, make_drafter_config  # noqa: E402


def meta_drafter(shape: str, draft_vocab: int, frozen: list[str]) -> Drafter:
    """The benchmark's drafter of ``shape`` (``DRAFTER_LAYERS`` layers, mask token ``V - 1``) on the ``meta``
    device, with the parameters or modules named in ``frozen`` (a row's ``meta.frozen``, e.g. ``["lm_head"]``)
    not trainable."""
    tc = target_config(shape)
    with torch.device("meta"):
        d = Drafter(make_drafter_config(tc, aux_layer_ids=AUX_LAYER_IDS, draft_vocab_size=draft_vocab,
                                        mask_token_id=tc.vocab_size - 1, num_layers=DRAFTER_LAYERS))
    for name, p in d.named_parameters():
        if any(name == f or name.startswith(f + ".") for f in frozen):  # "lm_head" freezes "lm_head.weight"
            p.requires_grad_(False)
    return d


def recount_row(drafter: Drafter, row: dict, matmul_tflops: float | None) -> dict:
    """One row → its recount: ``flop_recorded``, ``flop`` (every layer's attention), ``attention_pairs``,
    ``tflops_recorded``, ``tflops``, ``fraction_of_matmul_rate`` (None without a measured rate).

    Raises:
        ValueError: the recorded count leaves a pair count outside ``[E, E * N]`` or not a whole number (the
            file was counted with another drafter or formula: names the row's N).
    """
    E, n_tokens, flop = row["positions"], row.get("tokens", row["N"]), row["flop"]
    dense = dense_flops(drafter, E, n_tokens)
    per_pair = attention_flops(drafter, 1) / len(drafter.layers)  # one layer's FLOPs per (query, key) pair
    pairs = (flop - dense) / per_pair
    if not E <= pairs <= E * row["N"] or abs(pairs - round(pairs)) > 1e-3 * max(pairs, 1) ** 0.5:
        raise ValueError(f"row N = {row['N']}: the recorded {flop:.6e} FLOP leave {pairs:.3f} attention pairs "
                         "after the matrix part; not a row of this shape's one-layer count")
    new = dense + attention_flops(drafter, round(pairs))
    step_s = row["step_ms"] / 1e3
    out = {"N": row["N"], "S": row.get("S"), "positions": E, "tokens": n_tokens, "step_ms": row["step_ms"],
           "attention_pairs": round(pairs), "flop_recorded": flop, "flop": new,
           "attention_share": attention_flops(drafter, round(pairs)) / new,
           "tflops_recorded": flop / step_s / 1e12, "tflops": new / step_s / 1e12}
    out["fraction_of_matmul_rate"] = out["tflops"] / matmul_tflops if matmul_tflops else None
    return out


def main(argv=None) -> dict:
    """Command line (module docstring): recounts every timed row of each file, prints, writes ``--out``.

    Raises:
        SystemExit: a file whose ``meta.trainable_params`` differs from the rebuilt drafter's (names both).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="train_step.py JSON files (meta + rows)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = {"meta": {**provenance(sys.argv[1:] if argv is None else argv, "benchmarks/flop_recount.py"),
                       "formula": "6*P_layers*E + 6*P_fc*N + c_head*P_head*E + L*12*heads*head_dim*sum_q keys(q)"},
              "files": {}}
    for f in args.files:
        data = json.loads(Path(f).read_text())
        m = data["meta"]
        drafter = meta_drafter(m["shape"], m["draft_vocab"], m.get("frozen") or [])
        trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        if m.get("trainable_params") is not None and m["trainable_params"] != trainable:
            raise SystemExit(f"flop_recount.py: {f}: the file trained {m['trainable_params']:,} parameters, the "
                             f"drafter rebuilt from its meta (shape {m['shape']}, frozen {m.get('frozen')}) "
                             f"{trainable:,}; not a file this script can recount")
        rows = [recount_row(drafter, r, m.get("bf16_matmul_tflops")) for r in data["rows"] if "flop" in r]
        result["files"][f] = {"commit": m.get("commit"), "device": m.get("device"),
                              "bf16_matmul_tflops": m.get("bf16_matmul_tflops"), "rows": rows}
        for r in rows:
            frac = f", {r['fraction_of_matmul_rate']:.1%} of the matmul rate" if r["fraction_of_matmul_rate"] else ""
            print(f"{f}: N = {r['N']}: {r['tflops_recorded']:.1f} -> {r['tflops']:.1f} TFLOP/s{frac} "
                  f"(attention {r['attention_share']:.0%} of {r['flop'] / 1e15:.3f} PFLOP)")
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
