"""Issue 19's must-show record: ``docs/data/must_show/throughput.json``, every figure read from a raw file.

Each key of the issue's record names the committed raw JSON it is read from and where in it (``FIGURES``); the
builder reads the value (nothing is typed in by hand), records each source's commit and GPU, and checks each
must-show criterion of issue 19 against its figure (``checks``, ``all_hold``). A figure no committed file holds is
``null`` with the reason in ``missing``. When a new run is committed, point its keys at the new raw file and build
again; the test checks that the committed record equals what this script builds.

Usage::

    python benchmarks/must_show_throughput.py [OUT.json]    # default docs/data/must_show/throughput.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from must_show_quality import write_record  # noqa: E402  (the record written and its checks printed, one way)

DATA = "docs/data"
# key -> (raw file under docs/data, path into its JSON: keys and list indices; a dict {"key": k, "is": v} picks
# the list item whose k equals v), or (None, why no committed file holds it)
FIGURES: dict[str, tuple[str | None, list | str]] = {
    # the real trainer on cached features and the benchmark's step on the same sequences, one run (H200, 4224d80)
    "trainer_step_ms": ("trainer_throughput_4224d80_mb64_cache.json", ["trainer_runs", 0, "step_ms"]),
    "benchmark_step_ms": ("trainer_throughput_4224d80_mb64_cache.json", ["benchmark", "rows", 0, "step_ms"]),
    "smollm2_trainer_tokens_per_s_cached": ("trainer_throughput_4224d80_mb64_cache.json",
                                            ["trainer_runs", 0, "tokens_per_s"]),
    "smollm2_trainer_tokens_per_s_online": ("trainer_throughput_8074df3_mb64_online.json",
                                            ["summary", 0, "tokens_per_s"]),
    # the trainer's own step (Trainer.train_step) at N = 8,192 compiled max-autotune with the prefix attention's
    # forward block that train.prefix_kernel_options "auto" takes on an H100 or H200 and FlexAttention's IS_DIVISIBLE
    # hint (attention.divisible_options), speculators 0.9.0's step of the same shape and trainable set in the same
    # process (H100, ceaa944, the last commit measured; without the hint 290.0 ms in the same plan:
    # train_step_ceaa944_h100_gptoss_8192_nohint.json; c050930's 294.4 ms: train_step_c050930_h100_gptoss_8192.json)
    "gptoss_8k_ms": ("train_step_ceaa944_h100_gptoss_8192.json",
                     ["rows", {"key": "compile", "is": "max-autotune"}, "step_ms"]),
    "speculators_8k_ms": ("train_step_ceaa944_h100_gptoss_8192.json",
                          ["rows", {"key": "compile", "is": "max-autotune"}, "ref_step_ms"]),
    # N = 131,072 on an 80 GB card with train.activation_checkpointing: selective (the attention kernels' outputs
    # kept through the backward): S = 3 as the planner chose, the prefix attention's forward block of
    # train.prefix_kernel_options' default (auto) and FlexAttention's IS_DIVISIBLE hint, at 3026d29, the last commit
    # measured (30.13 s; full checkpointing, S = 2, in the same plan 33.55 s: train_step_3026d29_h100_131072.json;
    # ceaa944 33.73 s, without the hint 41.06 s: train_step_ceaa944_h100_131072_nohint.json)
    "n131072_step_ms": ("train_step_3026d29_h100_131072_selective.json",
                        ["rows", {"key": "N", "is": 131072}, "step_ms"]),
    "n262144_step_s": (None, "a run at b8c873c (H200, activation checkpointing) was stopped by its time limit "
                             "after 365 s, before it wrote its row (long_steps_b8c873c_h200_progress.txt); the "
                             "plans of 7a2a50b, 47e0feb, 8b83765 and c050930 run it only on an H200 and got H100s "
                             "(plan_7a2a50b_h100_progress.txt, plan_47e0feb_h100_progress.txt, "
                             "plan_8b83765_h100_progress.txt, plan_c050930_h100_progress.txt); at 8b83765, "
                             "c050930, ceaa944 and 3026d29 an H200 was asked for alone and none could be started "
                             "(docs/benchmarks.md)"),
    # the steady engine run of an all-turns prepare of the real SmolLM2 with regen.keep_kv (one H100)
    "regen_tokens_per_s": ("regen_prepare_6980de8_h100_keep_kv_shards.json", ["steady_tokens_per_s"]),
    # ZeRO-2 and FSDP2 against plain at the GPU recipes' scale (micro-batch 64, compiled), each ratio against the
    # plain run of its own machine: ZeRO-2 since configure_deepspeed's bf16 change (90547d1), FSDP2 at f5b8066
    "zero2_tokens_per_s": ("strategies_90547d1_h100_mb64_zero2.json",
                           ["runs", {"key": "name", "is": "zero2"}, "tokens_per_s"]),
    "plain_for_zero2_tokens_per_s": ("strategies_90547d1_h100_mb64_zero2.json",
                                     ["runs", {"key": "name", "is": "plain"}, "tokens_per_s"]),
    "fsdp2_tokens_per_s": ("strategies_f5b8066_h100_mb64.json",
                           ["runs", {"key": "name", "is": "fsdp2"}, "tokens_per_s"]),
    "plain_for_fsdp2_tokens_per_s": ("strategies_f5b8066_h100_mb64.json",
                                     ["runs", {"key": "name", "is": "plain"}, "tokens_per_s"]),
    # for gptoss_8k_fraction_of_peak: the step's TFLOP/s (every drafter layer's attention counted, train_step.flops
    # since e77a08a) and the bf16 matmul rate measured in the same run
    "gptoss_8k_tflops": ("train_step_ceaa944_h100_gptoss_8192.json",
                         ["rows", {"key": "compile", "is": "max-autotune"}, "tflops"]),
    "gptoss_8k_peak_tflops": ("train_step_ceaa944_h100_gptoss_8192.json", ["meta", "bf16_matmul_tflops"]),
    # 64 of 64 identical to generate on the real SmolLM2 (float32); the 92788d0 prepare above made no count
    "regen_identical": ("regen_throughput_f473247_real_smollm2_fp32.json", None),
}


def dig(obj, path: list, where: str):
    """The value at ``path`` in ``obj`` (see FIGURES). Raises KeyError naming ``where`` and the missing step."""
    for step in path:
        if isinstance(step, dict):
            hits = [x for x in obj if isinstance(x, dict) and x.get(step["key"]) == step["is"]]
            if len(hits) != 1:
                raise KeyError(f"{where}: {len(hits)} items with {step['key']} = {step['is']!r} (need exactly one)")
            obj = hits[0]
        else:
            try:
                obj = obj[step]
            except (KeyError, IndexError, TypeError):
                raise KeyError(f"{where}: no {step!r} on the path {path}") from None
    return obj


def _meta(raw: dict | list, path: list | None = None) -> dict:
    """``{"commit", "gpu"}`` of a raw file, wherever its writer put them (top level, ``meta``, or list rows); for a
    path into a recount's ``files`` (``flop_recount.py``), those of the run it recounts."""
    if path and path[0] == "files" and isinstance(raw, dict):
        raw = raw["files"][path[1]]
    if isinstance(raw, list):
        raw = raw[0] if raw else {}
    m = raw.get("meta", {}) if isinstance(raw.get("meta"), dict) else {}
    commit = raw.get("commit") or m.get("commit")
    gpu = raw.get("gpu") or raw.get("device") or m.get("gpu") or m.get("device")
    return {"commit": commit[:7] if isinstance(commit, str) else None, "gpu": gpu}


def _identical(raw: dict, where: str) -> bool:
    """True when every identity count of a regen_throughput.py file is whole (``runs[].identical.*``)."""
    counts = [c for r in raw.get("runs", []) for c in (r.get("identical") or {}).values()]
    if not counts:
        raise KeyError(f"{where}: no runs[].identical counts")
    return all(c["identical"] == c["compared"] for c in counts)


def build(data: Path = ROOT / DATA) -> dict:
    """Issue 19's record from the raw files under ``data`` (module docstring).

    Raises:
        FileNotFoundError: a raw file FIGURES names is not under ``data``. KeyError: its JSON lacks the path.
    """
    val: dict = {}
    src: dict = {}
    of: dict = {}
    missing: dict = {}
    for key, (name, path) in FIGURES.items():
        if name is None:
            val[key], missing[key] = None, path
            continue
        f = data / name
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (FIGURES[{key!r}] in benchmarks/must_show_throughput.py)")
        raw = json.loads(f.read_text())
        val[key] = _identical(raw, str(f)) if key == "regen_identical" else dig(raw, path, str(f))
        src[key] = f"{DATA}/{name}"
        of[key] = _meta(raw, path)
    ratio = lambda a, b: None if a is None or b is None else a / b  # noqa: E731
    rec = {
        "commit": "several (commits: the commit of each figure's run)", "gpu": "see gpus",
        "trainer_step_ms": val["trainer_step_ms"], "benchmark_step_ms": val["benchmark_step_ms"],
        "smollm2_trainer_tokens_per_s_online": val["smollm2_trainer_tokens_per_s_online"],
        "smollm2_trainer_tokens_per_s_cached": val["smollm2_trainer_tokens_per_s_cached"],
        "gptoss_8k_ms": val["gptoss_8k_ms"], "speculators_8k_ms": val["speculators_8k_ms"],
        "gptoss_8k_fraction_of_peak": ratio(val["gptoss_8k_tflops"], val["gptoss_8k_peak_tflops"]),
        "n131072_step_s": None if val["n131072_step_ms"] is None else val["n131072_step_ms"] / 1e3,
        "n262144_step_s": val["n262144_step_s"],
        "regen_tokens_per_s": val["regen_tokens_per_s"], "regen_identical_to_generate": val["regen_identical"],
        "zero2_vs_plain": ratio(val["zero2_tokens_per_s"], val["plain_for_zero2_tokens_per_s"]),
        "fsdp2_vs_plain": ratio(val["fsdp2_tokens_per_s"], val["plain_for_fsdp2_tokens_per_s"]),
    }
    derived = {"gptoss_8k_fraction_of_peak": ("gptoss_8k_tflops",), "n131072_step_s": ("n131072_step_ms",),
               "regen_identical_to_generate": ("regen_identical",), "zero2_vs_plain": ("zero2_tokens_per_s",),
               "fsdp2_vs_plain": ("fsdp2_tokens_per_s",)}
    key_of = {k: derived.get(k, (k,))[0] for k in rec if k not in ("commit", "gpu")}
    rec["sources"] = {k: src[s] for k, s in key_of.items() if s in src}
    rec["commits"] = {k: of[s]["commit"] for k, s in key_of.items() if s in of}
    rec["gpus"] = {k: of[s]["gpu"] for k, s in key_of.items() if s in of}
    rec["missing"] = missing
    t, b = rec["trainer_step_ms"], rec["benchmark_step_ms"]
    sp, g8 = rec["speculators_8k_ms"], rec["gptoss_8k_ms"]
    checks = {  # issue 19's must-show criteria
        "trainer_within_10pct_of_benchmark": (abs(t - b) / b, abs(t - b) / b <= 0.10),
        "online_ge_120k": (rec["smollm2_trainer_tokens_per_s_online"], rec["smollm2_trainer_tokens_per_s_online"] >= 120e3),
        "cached_ge_120k": (rec["smollm2_trainer_tokens_per_s_cached"], rec["smollm2_trainer_tokens_per_s_cached"] >= 120e3),
        "gptoss_8k_ge_1.8x_speculators": (sp / g8, sp / g8 >= 1.8),
        "gptoss_8k_ge_45pct_of_peak": (rec["gptoss_8k_fraction_of_peak"], rec["gptoss_8k_fraction_of_peak"] >= 0.45),
        "n131072_le_15s": (rec["n131072_step_s"], rec["n131072_step_s"] is not None and rec["n131072_step_s"] <= 15),
        "n262144_trains": (rec["n262144_step_s"], rec["n262144_step_s"] is not None),
        "regen_ge_40k": (rec["regen_tokens_per_s"], rec["regen_tokens_per_s"] >= 40e3),
        "regen_identical_to_generate": (rec["regen_identical_to_generate"], rec["regen_identical_to_generate"] is True),
        "zero2_ge_0.9": (rec["zero2_vs_plain"], rec["zero2_vs_plain"] >= 0.9),
        "fsdp2_ge_0.9": (rec["fsdp2_vs_plain"], rec["fsdp2_vs_plain"] >= 0.9),
    }
    rec["checks"] = {k: {"value": v, "holds": h} for k, (v, h) in checks.items()}
    rec["all_hold"] = all(h for _, h in checks.values())
    return rec


def main(argv: list[str] | None = None) -> int:
    """Write the record atomically and print each check; returns 0 (the record is written whatever they say)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=ROOT / "docs/data/must_show/throughput.json")
    a = ap.parse_args(argv)
    try:
        rec = build()
    except (FileNotFoundError, KeyError) as e:  # the message names the file and the missing key; nothing is written
        sys.exit(f"must_show_throughput: {e.args[0] if e.args else e}")
    write_record(a.out, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
