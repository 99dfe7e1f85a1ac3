"""P-EAGLE variants on the real SmolLM2-135M-Instruct target, on a CPU: same data, same steps, simulated AL.

A small ablation that needs no GPU. The training data is the target's own regenerated conversations
(the committed all-turns shards, ``docs/data/quality/regen_92788d0``: SmolLM2's greedy answers to
ShareGPT, every turn), written as a chat JSONL so that ``prepare`` tokenises them without regenerating
(``regen.enabled: false``). ``prepare`` and ``cache`` run once; every variant then trains with
``peagle-train train`` (the command users run) from a copy of that prepared data and feature cache,
for the same optimizer steps, and its in-training evaluation on the same eval split gives the
loop-equivalent simulated acceptance length (``eval_walk_al``, which agreed with the measured one
within 1.4 % on the GPU runs, ``docs/results.md``) and the accuracy by depth.

    python benchmarks/cpu_ablation.py --out docs/data/quality/cpu_ablation_init_layers.json \\
        --variants random= target=drafter.init_layers=target

What it does not say: the GPU recipe trains 4 layers on the full vocabulary with sequences up to 4,096
tokens for minutes of an H200; this runs the CPU recipe's shape (draft vocab 8,192, sequences cut at
``--max-length``) for a few hundred steps, so it compares early training only.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from train_step import provenance  # benchmarks/ is on the path: this script's folder
from variants import parse_variant

from peagle_train.core.atomic import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m.yaml"
SHARDS = ROOT / "docs" / "data" / "quality" / "regen_92788d0"


def cli(*args: str, log: Path) -> None:
    """``python -m peagle_train.cli ARGS --quiet``; stdout+stderr to ``log``; raises with its tail on failure."""
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "peagle_train.cli", *args, "--quiet"], cwd=ROOT, stdout=f,
                           stderr=subprocess.STDOUT)
    if r.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {r.returncode}); the end of {log}:\n"
                         + log.read_text()[-2000:])


def conversations(shards: Path, work: Path, n: int) -> list:
    """The first ``n`` conversations of the regeneration shards (``train-*.json``, in order), unpacking a
    ferry pack (``pack-*`` files) into ``work/regen`` first when ``shards`` holds one."""
    if list(shards.glob("pack-*")):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ferry.py"), "unpack", str(shards),
                            str(work / "regen")], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"ferry.py unpack {shards}: {r.stderr[-1000:]}")
        shards = work / "regen"
    out: list = []
    for f in sorted(shards.glob("train-*.json")):
        out += json.loads(f.read_text())["conversations"]
        if len(out) >= n:
            return out[:n]
    raise SystemExit(f"{shards}: {len(out)} conversations in its train-*.json shards, fewer than --conversations {n}")


def summary(run: Path) -> dict:
    """The variant's steps, seconds, final eval and its eval curve (``train_metrics.json``): at every eval
    step the eval loss, ``eval_walk_al`` and ``eval_sim_al`` at K = 7 and the accuracy and conditional
    accuracy by depth."""
    m = json.loads((run / "train_metrics.json").read_text())
    final = m["final"]
    curve = [{"step": h["step"], "eval_loss": h["eval_loss"], "walk_al_k7": h["eval_walk_al"].get("7"),
              "sim_al_k7": h["eval_sim_al"].get("7"), "eval_acc": h["eval_acc"], "eval_cond_acc": h["eval_cond_acc"]}
             for h in m["history"] if "eval_loss" in h]
    return {"steps": m["steps"], "train_seconds": round(m["train_seconds"], 1), "eval_loss": final["eval_loss"],
            "eval_walk_al": final["eval_walk_al"], "eval_walk_al_heldout": final.get("eval_walk_al_heldout"),
            "eval_acc": final["eval_acc"], "eval_cond_acc": final["eval_cond_acc"], "eval_curve": curve}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON written here")
    p.add_argument("--variants", nargs="+", default=["random=", "target=drafter.init_layers=target"],
                   help="NAME=override,override (NAME= alone: the base settings; a list value such as "
                        "train.depth_weights=[2,1,1,1,1,1,1,1] is one override, benchmarks/variants.py)")
    p.add_argument("--shards", default=str(SHARDS), help="regeneration shards (train-*.json) or a ferry pack of them")
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--max-length", type=int, default=768,
                   help="data.max_length (a conversation is cut after its last turn that fits; none fits: dropped)")
    p.add_argument("--eval-fraction", type=float, default=0.05, help="data.eval_fraction")
    p.add_argument("--steps", type=int, default=300, help="train.max_steps of every variant")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--work", default="/tmp/peagle_cpu_ablation")
    p.add_argument("--override", nargs="*", default=[], help="more overrides for every variant (and the data)")
    args = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(args)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    jsonl = work / "conversations.jsonl"
    convs = conversations(Path(a.shards), work, a.conversations)
    jsonl.write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in convs))
    base = ["data.source=jsonl", f"data.path={jsonl}", f"data.num_conversations={a.conversations}",
            "data.max_turns=64", "data.max_prompt_tokens=100000", f"data.max_length={a.max_length}",
            f"data.eval_fraction={a.eval_fraction}", "data.loop_tail=unsupervise", "regen.enabled=false",
            f"train.max_steps={a.steps}", "train.epochs=100", f"train.eval_every={a.eval_every}",
            "train.eval_sequences=20", "train.warmup_ratio=0.02", *a.override]
    data_dir = work / "data_run"
    t0 = time.perf_counter()
    if not (data_dir / "features" / "eval").exists():
        cli("prepare", str(RECIPE), *base, f"output_dir={data_dir}", log=work / "prepare.log")
        cli("cache", str(RECIPE), *base, f"output_dir={data_dir}", log=work / "cache.log")
    meta = json.loads((data_dir / "data" / "meta.json").read_text())
    prep_s = time.perf_counter() - t0
    results = {}
    for v in a.variants:
        name, ovr_list = parse_variant(v)
        run = work / f"v_{name}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        for sub in ("data", "features"):  # the same prepared tokens and cached features for every variant
            shutil.copytree(data_dir / sub, run / sub, copy_function=os.link)
        t = time.perf_counter()
        cli("train", str(RECIPE), *base, *ovr_list, f"output_dir={run}", log=work / f"train_{name}.log")
        results[name] = {"overrides": ovr_list, "wall_s": round(time.perf_counter() - t, 1), **summary(run)}
        r = results[name]
        print(f"{name}: {r['steps']} steps, walk AL(7) {r['eval_walk_al']['7']}, eval loss {r['eval_loss']:.4f}, "
              f"acc by depth {r['eval_acc'][:4]}", flush=True)
    out = {"what": "P-EAGLE variants, same data and steps, real SmolLM2-135M-Instruct target on a CPU "
                   "(benchmarks/cpu_ablation.py)",
           **provenance(args, "benchmarks/cpu_ablation.py"),
           "recipe": str(RECIPE.relative_to(ROOT)), "data_overrides": base, "threads": os.environ.get("OMP_NUM_THREADS"),
           "data": {k: meta["splits"][k] for k in meta["splits"]}, "prepare_and_cache_s": round(prep_s, 1),
           "variants": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(a.out), out, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
