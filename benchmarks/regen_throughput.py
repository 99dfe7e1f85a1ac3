"""Regeneration throughput: plain HF ``generate`` vs the fast engines (static cache, continuous batching), on
the same prompts, through
the engine ``peagle-train prepare`` uses (:func:`data_prep.regenerate.hf_engine`, after its memory
check :func:`data_prep.regenerate.check_regen_memory`).

The prompts are ShareGPT first turns read from the recipe's source (``data_prep.sources``), rendered
with the target's chat template; those over ``data.max_prompt_tokens`` are skipped. Per target dtype:

(a) each engine of ``--engines`` (default ``static continuous``; ``regen.batch_size = --engine-batch``, cap
    ``--cap``) on all ``--prompts`` prompts;
(b) ``generate`` (left-padded batches of ``--batch``, cap ``--generate-cap``, default ``--cap``) on the
    first ``--subset`` prompts;

each timed (generated tokens incl. end-of-turn tokens / wall seconds of the engine), with its
unfinished count (stopped by the cap); then how many of the subset's greedy outputs are
token-identical between (b) and each of (a) (over (b)'s cap: (a)'s answer cut there). One JSON (``--out``,
rewritten after every engine run, so a run stopped by a time limit keeps what it measured) with the
command and commit (``train_step.provenance``), one summary line printed last.

The target is the recipe's (a GGUF with ``--gguf``) or, with ``--random-init-from-config SPEC
--tokenizer DIR``, a real model's architecture with RANDOM weights (``target.random_init_from_config``,
loaded by the same :func:`peagle_train.features.target.load_target` as ``prepare``). A random target
almost never emits its end-of-turn token, so every answer runs to the cap: tokens/s is then the
engine's full-batch decode rate and the unfinished counts mean nothing; the JSON says
``"random_weights": true`` and so does the summary line. Token identity stays meaningful (greedy
decoding of the same weights by both engines).

GPU, random-weight SmolLM2 (tokenizer and prompts as ``benchmarks/throughput_experiment.sh stage``
leaves them in ``.gpu/``): ``bash benchmarks/throughput_experiment.sh regen OUT.json`` (its ``regen)``
case has the command line). GPU, the real SmolLM2 (GGUF and prompts as
``benchmarks/quality_experiment.sh setup`` leaves them)::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/regen_throughput.py \\
        --gguf /tmp/peagle_quality/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts-file /tmp/peagle_quality/sharegpt_prompts.json --prompts 512 --subset 128 --batch 128 \\
        --cb-batch 512 --cap 2048 --dtypes float32 bfloat16 --max-seconds 60 --out $OUT/regen_throughput.json

CPU smoke (CI, ``tests/integration/test_benchmarks.py``): ``--smoke --out x.json`` (the CPU demo
recipe, its packaged GGUF and ShareGPT file, 4 prompts, 12 new tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
#: the reference run (plain generate) leaves out what only the static engine's segments do: an --override of
#: regen.keep_kv / stop_loops / refill_at sets the engines under test, not the reference they are counted against
GENERATE_RESETS = {"keep_kv": False, "stop_loops": False, "refill_at": None}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "smollm2-135m-peagle-gpu.yaml"))
    p.add_argument("--gguf", help="target GGUF file (sets target.gguf_package=null target.gguf_file=...)")
    p.add_argument("--random-init-from-config", metavar="SPEC", help="a model configuration JSON or "
                   "pkg:peagle_train/<file>: the target with RANDOM weights (target.random_init_from_config; needs "
                   "--tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder of the random-weight target (target.tokenizer)")
    p.add_argument("--prompts-file", help="ShareGPT JSON (sets data.path)")
    p.add_argument("--prompts", type=int, default=1024, help="prompts for the continuous engine")
    p.add_argument("--subset", type=int, default=256, help="first prompts also run through plain generate")
    p.add_argument("--cap", type=int, default=2048, help="regen.max_new_tokens")
    p.add_argument("--generate-cap", type=int, default=None, help="plain generate's regen.max_new_tokens "
                   "(default --cap; the identity count compares continuous answers cut at this length)")
    p.add_argument("--batch", type=int, default=256, help="plain generate's batch (regen.batch_size)")
    p.add_argument("--engines", nargs="+", choices=["static", "continuous"], default=["static", "continuous"],
                   help="the fast engines to time (regen.engine), in this order")
    p.add_argument("--engine-batch", "--cb-batch", dest="cb_batch", type=int, default=512,
                   help="regen.batch_size of the fast engines")
    p.add_argument("--kv-memory-fraction", type=float, default=None, help="regen.kv_memory_fraction")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="regen.max_batch_tokens")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="target dtypes, one run each")
    p.add_argument("--max-seconds", type=float, default=150.0, help="per engine run: abandon what is unfinished")
    p.add_argument("--attn", default=None, help="model attention implementation to set before the runs (e.g. "
                   "flash_attention_2 where flash-attn is installed; continuous batching pages it); default: as loaded")
    p.add_argument("--warmup", action="store_true",
                   help="before each timed fast-engine or variant run, the same settings once on its first batch "
                        "of prompts (untimed, key 'warmup_seconds'): the timed run then meets compiled decoding "
                        "steps, as a long prepare does after its first batches, instead of counting their "
                        "compilation (tens of seconds per new shape on an H200)")
    p.add_argument("--skip-generate", action="store_true", help="only the fast engines (no identity count)")
    p.add_argument("--profile-cap", type=int, default=0, metavar="T",
                   help="after the timed runs, run the first engine again on the same prompts with a T-token cap "
                        "under torch.profiler: per decoding step the GPU's busy/idle ms, the top kernels and the "
                        "top host ops (key 'profile'); 0 = off")
    p.add_argument("--override", nargs="*", default=[], help="further recipe overrides key=value")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=regen.KEY=VALUE[,regen.KEY=VALUE]",
                   help="after the engines (and generate): the first engine again per variant, with these regen "
                   "settings, on the same prompts and target, side by side (e.g. b1024=regen.batch_size=1024 "
                   "seg512=regen.segment_tokens=512); with generate, each variant's identity count too")
    p.add_argument("--smoke", action="store_true", help="CPU smoke: the CPU demo recipe, tiny sizes")
    p.add_argument("--out", required=True, help="JSON output path")
    args = p.parse_args(argv)
    try:
        args.variant_settings = parse_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    if args.random_init_from_config and (args.gguf or not args.tokenizer):
        p.error("--random-init-from-config needs --tokenizer and excludes --gguf")
    if args.smoke:
        args.recipe = str(ROOT / "recipes" / "smollm2-135m.yaml")
        args.prompts, args.subset, args.cap, args.batch, args.cb_batch = 4, 4, 12, 4, 4
        args.dtypes = ["float32"]
    args.subset = min(args.subset, args.prompts)
    args.generate_cap = min(args.generate_cap or args.cap, args.cap)
    return args


def parse_variants(specs: list[str]) -> dict[str, dict]:
    """``["NAME=regen.KEY=VALUE[,regen.KEY=VALUE]", ...]`` -> ``{NAME: {KEY: value}}`` (values read as YAML:
    ``null``, numbers, booleans).

    Raises:
        ValueError: a spec without ``NAME=``, a repeated name, a setting outside ``regen`` (the target would have
            to be loaded again: run the script again instead) or without ``=VALUE``.
    """
    import yaml

    out: dict[str, dict] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--variants {spec!r}: expected NAME=regen.KEY=VALUE[,regen.KEY=VALUE]")
        if name in out:
            raise ValueError(f"--variants: the name {name!r} is given twice")
        upd = {}
        for item in rest.split(","):
            key, sep, value = item.partition("=")
            if not key.startswith("regen.") or not sep:
                raise ValueError(f"--variants {spec!r}: {item!r} is not regen.KEY=VALUE (a variant changes only "
                                 "the regen section: other settings need another run of this script)")
            upd[key.removeprefix("regen.")] = yaml.safe_load(value)
        out[name] = upd
    return out


def load_prompts(tokenizer, cfg, n: int) -> list[list[int]]:
    """The first ``n`` ShareGPT first turns (chat-templated ids) no longer than ``data.max_prompt_tokens``."""
    from data_prep.sources import load_conversations
    from data_prep.template import build_prompt_ids

    convs, _ = load_conversations(cfg.data.model_copy(update={"num_conversations": 2 * n + 16}))
    prompts = []
    for c in convs:
        head = [m for m in c[:1] if m["role"] == "system"]
        user = next(m for m in c if m["role"] == "user")
        ids = build_prompt_ids(tokenizer, [*head, {"role": "user", "content": user["content"]}])
        if len(ids) <= cfg.data.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def agreement(generate_ids: list, engine_ids: list, cap: int) -> list[bool]:
    """Per prompt answered by both (``None``: not answered), whether plain generate's answer (at most ``cap``
    tokens, ended by the cap or an end-of-turn token) equals the engine's answer cut at ``cap``: equal iff
    greedy decoding agrees up to there."""
    return [a == b[:cap] for a, b in zip(generate_ids, engine_ids) if a is not None and b is not None]


def collect_answers(answers, max_seconds: float, t0: float, clock=time.perf_counter, gap: float = 0.5) -> tuple[dict, float]:
    """Read ``(index, Completion)`` pairs from an engine until ``max_seconds`` after ``t0``.

    The static and generate engines answer a whole batch in one call and then hand its answers out at
    once: the answers that arrive within ``gap`` seconds of the previous one belong to a batch already
    decoded and are all counted, even past the limit; the first answer after the limit that took longer
    (a new batch decoded past the limit) is left out with its time. A hard stop at twice the limit ends a
    stream of continuous-batching answers.

    Returns:
        ``({index: Completion}, seconds from t0 to the last answer counted)``.
    """
    out, last = {}, t0
    for i, c in answers:
        now = clock()
        past = now - t0 > max_seconds
        if out and past and (now - last > gap or now - t0 > 2 * max_seconds):
            break
        out[i], last = c, now
        if past and now - t0 > 2 * max_seconds:
            break
    return out, last - t0


def run_engine(target, regen_cfg, max_prompt_tokens: int, prompts: list[list[int]], max_seconds: float) -> dict:
    """Regenerate ``prompts`` with the engine ``regen_cfg`` names, as prepare does; timed. Answers past
    ``max_seconds`` are counted only where their batch was already decoded (:func:`collect_answers`);
    the rest are abandoned (``timed_out``; tokens/s counts the answers read, over the time to the last)."""
    import torch

    from data_prep.regenerate import check_regen_memory, hf_engine

    regen_cfg, note = check_regen_memory(target.model, regen_cfg, max_prompt_tokens)
    complete, engine = hf_engine(target.model, target.tokenizer, regen_cfg, max_prompt_tokens)
    jobs = [(k, 0, [], p) for k, p in enumerate(prompts)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    answers = complete(jobs)
    out, secs = collect_answers(answers, max_seconds, t0)
    answers.close()  # stops the engine at once if answers are still in flight
    sync()
    tokens = sum(c.tokens for c in out.values())
    return {"engine": engine, "decode_kernel": complete.decode_kernel, "batch_size": regen_cfg.batch_size, "memory_note": note,
            "prompts": len(prompts),
            "answered": len(out), "timed_out": len(out) < len(prompts),
            "generated_tokens": tokens, "seconds": round(secs, 3), "tokens_per_s": round(tokens / max(secs, 1e-9), 1),
            "unfinished": sum(not c.finished for c in out.values()),
            # generate calls, shapes met, and the seconds of calls meeting a shape first (the compiles)
            "engine_profile": dict(complete.profile) if complete.profile is not None else None,
            "ids": [out[k].token_ids if k in out else None for k in range(len(prompts))]}


def timed_engine(target, regen_cfg, max_prompt_tokens: int, prompts: list[list[int]], max_seconds: float,
                 warmup: bool) -> dict:
    """:func:`run_engine`, after (``warmup``, ``--warmup``) an untimed run of the same settings on the first
    ``batch_size`` prompts: the shapes of the timed run's first batch, whose compiled decoding steps are then
    cached. Adds ``warmup_seconds``: that run's seconds (compilation included), None without it."""
    warm = None
    if warmup:
        first = prompts[: regen_cfg.batch_size]
        warm = run_engine(target, regen_cfg, max_prompt_tokens, first, float("inf"))["seconds"]
    return {**run_engine(target, regen_cfg, max_prompt_tokens, prompts, max_seconds), "warmup_seconds": warm}


def profile_engine(target, regen_cfg, max_prompt_tokens: int, prompts: list[list[int]]) -> dict:
    """One more run of ``regen_cfg``'s engine on ``prompts`` (one batch, ``regen_cfg.max_new_tokens`` tokens
    each) under ``torch.profiler``, after an unprofiled warm-up run of the same shape (compilation, CUDA
    graph capture). Figures are per decoding step, taken as the longest answer's token count.

    Returns:
        ``{"decode_steps", "wall_ms_per_step", "timeline": {window_ms, busy_ms, idle_ms, by_category},
        "top_kernels": [...], "top_host_ops": [...]}`` (host ops by self CPU time per step: where the host
        spends a step, e.g. graph launches, mask building, recompilation).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    from peagle_train.trainer.profiling import device_kernels, kernel_table, timeline_summary

    run_engine(target, regen_cfg, max_prompt_tokens, prompts, max_seconds=1e9)  # warm-up: compile, capture
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        res = run_engine(target, regen_cfg, max_prompt_tokens, prompts, max_seconds=1e9)
    wall = time.perf_counter() - t0
    steps = max((len(i) for i in res["ids"] if i is not None), default=1) or 1
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    return {"engine": res["engine"], "batch": len(prompts), "decode_steps": steps,
            "wall_ms_per_step": round(1e3 * wall / steps, 3),
            "timeline": timeline_summary(device_kernels(prof), steps) if torch.cuda.is_available() else None,
            "top_kernels": kernel_table(prof, 1e3 * wall / steps, steps),
            "top_host_ops": [{"name": e.key[:120], "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                              "calls_per_step": round(e.count / steps, 2)} for e in host]}


def main(argv=None) -> dict:
    import torch
    import transformers

    from peagle_train.features.target import is_random_target, load_target
    from peagle_train.recipe import load_config
    from train_step import provenance

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # whole greedy answers, or the identity count against generate would compare prefixes (a recipe's
    # regen.stop_loops cuts looping answers); --override regen.stop_loops=true measures with it
    overrides = [f"regen.max_new_tokens={args.cap}", "regen.stop_loops=false", *args.override]
    if args.gguf:
        overrides += ["target.gguf_package=null", f"target.gguf_file={args.gguf}"]
    if args.random_init_from_config:
        overrides += ["target.gguf_package=null", "target.gguf_file=null", "target.gguf_sha256=null", "target.path=null",
                      f"target.random_init_from_config={args.random_init_from_config}",
                      f"target.tokenizer={args.tokenizer}"]
    if args.prompts_file:
        overrides.append(f"data.path={args.prompts_file}")
    result = {"meta": {**provenance(argv, "benchmarks/regen_throughput.py"),
                       "torch": torch.__version__, "transformers": transformers.__version__,
                       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                       "recipe": args.recipe, "overrides": overrides, "cap": args.cap,
                       "generate_cap": args.generate_cap}, "random_weights": False, "runs": []}
    summary = []
    for dtype in args.dtypes:
        cfg = load_config(args.recipe, [*overrides, f"target.dtype={dtype}"])
        target = load_target(cfg.target)
        result["random_weights"] = is_random_target(target.path)
        if args.attn:
            target.model.set_attn_implementation(args.attn)
        prompts = load_prompts(target.tokenizer, cfg, args.prompts)
        knobs = {"kv_memory_fraction": args.kv_memory_fraction, "max_batch_tokens": args.max_batch_tokens}
        run = {"dtype": dtype, "prompts": len(prompts), "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
               "attn_implementation": target.model.config._attn_implementation}
        result["runs"].append(run)
        fast, parts = {}, []
        for name in args.engines:
            ecfg = cfg.regen.model_copy(update={"engine": name, "batch_size": args.cb_batch, **knobs})
            res = timed_engine(target, ecfg, cfg.data.max_prompt_tokens, prompts, args.max_seconds, args.warmup)
            fast[name] = res
            run[name] = {k: v for k, v in res.items() if k != "ids"}
            parts.append(f"{name} {res['tokens_per_s']:,.0f} tok/s ({res['answered']}/{res['prompts']} prompts, "
                         f"{res['unfinished']} unfinished)")
            _write(args.out, result)
        line = f"{dtype}: " + ", ".join(parts)
        if not args.skip_generate:
            gen = run_engine(target, cfg.regen.model_copy(update={"engine": "generate", "batch_size": args.batch,
                                                                  "max_new_tokens": args.generate_cap,
                                                                  **GENERATE_RESETS}),
                             cfg.data.max_prompt_tokens, prompts[: args.subset], args.max_seconds)
            run["generate"] = {k: v for k, v in gen.items() if k != "ids"}
            line += f", generate {gen['tokens_per_s']:,.0f} tok/s ({gen['answered']}/{gen['prompts']} prompts)"
            run["identical"] = {}
            for name, res in fast.items():
                same = agreement(gen["ids"], res["ids"], args.generate_cap)
                first_diff = next((i for i, x in enumerate(same) if not x), None)
                run["identical"][name] = {"compared": len(same), "identical": sum(same), "all": all(same),
                                          "first_differing_prompt": first_diff}
                line += f", {name} identical to generate {sum(same)}/{len(same)}"
            _write(args.out, result)
        for vname, upd in args.variant_settings.items():
            vcfg = type(cfg.regen).model_validate({**cfg.regen.model_dump(), "engine": args.engines[0],
                                                   "batch_size": args.cb_batch, **knobs, **upd})
            res = timed_engine(target, vcfg, cfg.data.max_prompt_tokens, prompts, args.max_seconds, args.warmup)
            rec = {"settings": upd, **{k: v for k, v in res.items() if k != "ids"}}
            line += f", {vname} {res['tokens_per_s']:,.0f} tok/s"
            if "generate" in run:
                same = agreement(gen["ids"], res["ids"], args.generate_cap)
                rec["identical"] = {"compared": len(same), "identical": sum(same), "all": all(same)}
                line += f" ({sum(same)}/{len(same)} identical)"
            run.setdefault("variants", {})[vname] = rec
            _write(args.out, result)
        if args.profile_cap:
            run["profile"] = profile_engine(target, cfg.regen.model_copy(update={
                "engine": args.engines[0], "batch_size": args.cb_batch, "max_new_tokens": args.profile_cap, **knobs}),
                cfg.data.max_prompt_tokens, prompts[: args.cb_batch])
            tl = run["profile"]["timeline"]
            if tl:
                line += f", profile: {tl['window_ms']:.1f} ms per decoding step ({tl['idle_ms']:.1f} ms GPU idle)"
            _write(args.out, result)
        summary.append(line)
        del target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    caps = f"cap {args.cap}" + (f", generate cap {args.generate_cap}" if args.generate_cap != args.cap else "")
    if result["random_weights"]:
        caps += (", random_weights: true (answers run to the cap: tokens/s = full-batch decode rate, "
                 "unfinished counts meaningless)")
    result["summary"] = f"regen_throughput ({caps}): " + "; ".join(summary)
    _write(args.out, result)
    print(result["summary"])
    return result


def _write(out: str, result: dict) -> None:
    """Write ``result`` to ``out`` (again after every engine run: what a time limit stops keeps what it measured)."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
