"""The target's feature forward (what the online trainer and ``peagle-train cache`` run every step) under each
attention and mixture-of-experts implementation transformers offers, on ONE loaded target: time, peak memory,
and agreement of the features with the first variant's.

The target is loaded by :func:`peagle_train.features.target.load_target` from a recipe and overrides (the same
loader as the trainer, so ``target.random_init_from_config`` gives a real architecture with random weights),
then each ``--variants`` entry ``ATTN/EXPERTS`` is switched on the same weights with transformers' own
``set_attn_implementation`` / ``set_experts_implementation`` (``eager``, ``flex_attention``, ``sdpa`` /
``eager``, ``grouped_mm``, ``batched_mm``; ``keep`` keeps what the model was loaded with) and timed through
:meth:`peagle_train.features.target.Target.features` on ``--batch`` right-padded rows of ``--length`` random
token ids (the online trainer's padded forward): median of ``--steps`` after ``--warmup``, peak allocated
bytes of one call, and against the first variant the largest absolute difference of ``aux`` and ``last``
relative to the reference's largest magnitude, and the fraction of equal greedy tokens (a random-weight
target's logits are near ties, so bf16 rounding flips some of them: read it as a check for gross errors, not
as exactness; ``tests/unit/test_target_architectures.py`` holds the float64 equality of the captured
features with the transformers reference forward).

GPU (issue 22: the cost of the GPT-OSS-20B-shaped target inside the online step)::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/target_forward.py recipes/gpt-oss-20b.yaml \\
        target.path=null target.random_init_from_config=pkg:peagle_train/gpt-oss-20b.json \\
        --batch 3 --length 3439 --variants keep/keep eager/eager eager/grouped_mm flex_attention/grouped_mm \\
        --out $OUT/target_forward.json

CPU smoke (CI, ``tests/integration/test_benchmarks.py``): ``--smoke --out x.json`` (the tiny GPT-OSS
configuration, float32).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = ["recipes/gpt-oss-20b.yaml", "target.path=null", "target.device=cpu", "target.dtype=float32",
         "target.random_init_from_config=pkg:peagle_train/gpt-oss-20b-tiny.json", "target.attn_implementation=eager"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", nargs="?", help="recipe YAML (then key=value overrides)")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    p.add_argument("--batch", type=int, default=3, help="rows per forward")
    p.add_argument("--length", type=int, default=2048, help="tokens per row")
    p.add_argument("--variants", nargs="+", default=["keep/keep", "eager/eager", "eager/grouped_mm"],
                   help="ATTN/EXPERTS pairs; 'keep' keeps the loaded model's; the first is the reference")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny GPT-OSS configuration, 2 x 64 tokens")
    p.add_argument("--out", required=True, help="JSON file")
    a = p.parse_args(argv)
    if a.smoke:
        a.recipe, a.overrides = SMOKE[0], SMOKE[1:] + a.overrides
        a.batch, a.length, a.steps, a.warmup = 2, 64, 2, 1
    if a.recipe is None:
        p.error("give a recipe (or --smoke)")
    bad = [v for v in a.variants if v.count("/") != 1 or "" in v.split("/")]
    if bad:
        p.error(f"--variants {' '.join(bad)}: each is ATTN/EXPERTS, e.g. eager/grouped_mm or flex_attention/keep")
    return a


def implementations(model) -> dict:
    """The attention and experts implementations the model runs now (transformers' config fields)."""
    c = model.config
    return {"attn": getattr(c, "_attn_implementation", None), "experts": getattr(c, "_experts_implementation", None)}


def switch(model, attn: str, experts: str) -> None:
    """Switch the loaded model to ``attn`` / ``experts`` (``keep`` = leave) through transformers' setters.

    Raises:
        ValueError: transformers refuses the implementation, or this transformers has no experts setter.
    """
    if attn != "keep":
        model.set_attn_implementation(attn)
    if experts != "keep":
        if not hasattr(model, "set_experts_implementation"):
            raise ValueError("this transformers has no set_experts_implementation")
        model.set_experts_implementation(experts)


def time_variant(target, ids, steps: int, warmup: int) -> tuple[dict, dict]:
    """Median wall ms of ``target.features(ids)`` (device-synchronised) and the last call's features."""
    import torch

    dev = ids.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        target.features(ids)
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        f = target.features(ids)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if dev.type == "cuda" else None
    return {"step_ms": statistics.median(ms), "step_ms_all": ms, "transient_peak_bytes": peak}, f


def _rel(a, b) -> float:
    """Largest |a - b| over the largest |b| (float32)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def agreement(f: dict, ref: dict, num_aux: int) -> dict:
    """``aux`` / ``last`` largest |difference| over the reference's largest |value|, the same per tapped layer
    (``aux_rel_max_diff_by_layer``, low to high: a wrong attention kernel shows at the first tapped layer
    already, rounding grows with depth), and the fraction of equal greedy tokens."""
    by_layer = [_rel(a, b) for a, b in zip(f["aux"].chunk(num_aux, -1), ref["aux"].chunk(num_aux, -1))]
    return {"aux_rel_max_diff": _rel(f["aux"], ref["aux"]), "aux_rel_max_diff_by_layer": by_layer,
            "last_rel_max_diff": _rel(f["last"], ref["last"]),
            "argmax_equal": float((f["argmax"] == ref["argmax"]).float().mean())}


def main(argv=None) -> dict:
    import torch

    from benchmarks.train_step import provenance
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    args = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(args)
    cfg = load_config(a.recipe, a.overrides)
    t0 = time.perf_counter()
    target = load_target(cfg.target, with_tokenizer=False)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (a.batch, a.length), generator=g).to(target.device)
    out = {"meta": {**provenance(args), "command": " ".join(["python", "benchmarks/target_forward.py", *args]),
                    "recipe": a.recipe, "overrides": a.overrides, "batch": a.batch, "length": a.length,
                    "tokens": a.batch * a.length, "dtype": cfg.target.dtype, "device": str(target.device),
                    "gpu": torch.cuda.get_device_name() if target.device.type == "cuda" else None,
                    "random_weights": cfg.target.random_init_from_config is not None, "load_s": load_s,
                    "loaded_with": implementations(target.model),
                    "timing": f"median of {a.steps} calls of Target.features after {a.warmup}"}, "rows": []}
    ref = None
    for v in a.variants:
        attn, experts = v.split("/")
        row = {"variant": v}
        try:
            switch(target.model, attn, experts)
            row["runs_with"] = implementations(target.model)
            timing, f = time_variant(target, ids, a.steps, a.warmup)
            row.update(timing)
            row["tokens_per_s"] = a.batch * a.length / (timing["step_ms"] / 1e3)
            if ref is None:
                ref = f
            else:
                row.update(agreement(f, ref, len(target.aux_layer_ids)))
        except Exception as e:  # noqa: BLE001 -- one refused variant must not lose the others' rows
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
        out["rows"].append(row)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(json.dumps({k: row.get(k) for k in ("variant", "runs_with", "step_ms", "tokens_per_s",
                                                   "aux_rel_max_diff", "argmax_equal", "error")}), flush=True)
    return out


if __name__ == "__main__":
    main()
