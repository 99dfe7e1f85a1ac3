"""Where the time of one round of the reference decoding loop goes: the target's forward over ``L`` new tokens
(1 for the target alone, ``K + 1`` for a verification) through each kind of
:class:`peagle_train.decoding.target_runner.TargetRunner` the evaluation can use, timed with device syncs, and a
profile of the compiled kind's calls (``torch.profiler``: CPU ops and, on a GPU, kernels).

Why: run 6 (docs/results.md) measured 16 ms a token for the compiled SmolLM2-135M target alone and 18-21 ms a
verification on an H100, where the GPU work of a 135M forward is near a millisecond; the full evaluation did
not fit a lease. This says whether the compiled forward replays one CUDA graph (``cudagraph_skips``: inductor's
reasons when it does not), how much of a call is the device's work (``device_ms_per_call`` from the profile)
and what the host does in the rest. The kinds: ``dynamic`` (eager, ``DynamicCache``), ``static`` (eager, one static
cache), ``inductor`` (the static forward compiled, inductor's kernels launched without CUDA graphs: no graph replay
and none of cudagraph trees' per-call bookkeeping) and ``compiled`` (the same with CUDA graphs, what
``eval.compile_target: true`` runs); the last kind is profiled.

Each kind: a random prompt of ``--prompt-tokens`` is prefilled (eager, as the loop does), then per length ``L``
``--warmup`` calls and ``--calls`` timed calls of ``forward(L tokens, want_aux=True)`` each followed by
``drop(L - 1)`` (the cache one position longer after each, as a round that rejects every draft); the median and
p10/p90 per call, and what Dynamo did meanwhile (``dynamo``: graphs made, graph breaks).

``--attn NAME ...`` (``target.attn_implementation`` values, e.g. ``sdpa eager``): every kind again per attention
implementation of the target, each a fresh load of the same weights. Why: the H100 profile of the compiled
SmolLM2 forward spent ~13 ms of its ~20 ms in SDPA's float32 memory-efficient kernel (9 heads, batch 1, a query
of 1-8 tokens: next to no parallelism), where eager attention is a matmul and a softmax that inductor fuses.
The entries of the attention the recipe loads by itself (its ``target.attn_implementation``, else transformers'
choice: ``meta["attn_default"]``) keep the plain kind names (``compiled``), the others are ``KIND@ATTN``
(``compiled@eager``); every entry records its ``attn`` (the model's ``config._attn_implementation``). Without
``--attn``: the recipe's own attention alone, as before.

GPU (the evaluation's target: the recipe's GGUF in float32)::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/decode_profile.py recipes/smollm2-135m-peagle-gpu.yaml \\
        target.dtype=float32 [target.gguf_file=... target.gguf_package=null] --out $OUT/decode_profile.json

CPU smoke (CI, ``tests/integration/test_benchmarks.py``): ``--smoke [--attn sdpa eager] --out x.json`` (the tiny
Llama configuration, float32; the compiled kind runs eagerly on a CPU, as in the evaluation).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = ["recipes/smollm2-135m.yaml", "target.gguf_package=null", "target.gguf_file=null", "target.gguf_sha256=null",
         "target.device=cpu", "target.dtype=float32",
         "target.random_init_from_config=pkg:peagle_train/llama-3.1-8b-tiny.json"]
KINDS = {"dynamic": dict(static=False, compile=False), "static": dict(static=True, compile=False),
         "inductor": dict(static=True, compile="inductor"), "compiled": dict(static=True, compile=True)}


def parse_args(argv):
    """The command line (module docstring) as an ``argparse.Namespace``; ``--smoke`` fills in the tiny CPU
    recipe and few calls; ``attn``: the ``--attn`` names without repeats (None: the recipe's own). Raises SystemExit
    (argparse's message) without a recipe or with a length, call count or prompt length below 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", nargs="?", help="recipe YAML (then key=value overrides)")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value")
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 8], help="new tokens per forward (1; K + 1)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="cached positions before the timed calls")
    p.add_argument("--calls", type=int, default=30, help="timed calls per kind and length")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (the compiles happen here)")
    p.add_argument("--profile-calls", type=int, default=10, help="profiled calls of the compiled kind, longest L")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--attn", nargs="+", default=None, metavar="NAME",
                   help="attention implementations to time each kind with (target.attn_implementation, e.g. sdpa "
                        "eager); default: the recipe's own")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny Llama configuration, a few calls")
    p.add_argument("--out", help="JSON file")
    a = p.parse_args(argv)
    if a.smoke:
        a.recipe, a.overrides = SMOKE[0], SMOKE[1:] + a.overrides
        a.prompt_tokens, a.calls, a.warmup, a.profile_calls = 16, 3, 1, 2
    if a.recipe is None:
        p.error("give a recipe (or --smoke)")
    if min(a.lengths) < 1 or a.calls < 1 or a.prompt_tokens < 1:
        p.error("--lengths, --calls and --prompt-tokens must be >= 1")
    if a.attn is not None:
        a.attn = list(dict.fromkeys(a.attn))
    return a


def default_attn(target_cfg) -> str:
    """The attention implementation the target of ``target_cfg`` (a ``TargetConfig``) gets when loaded as the
    recipe says (no override): its ``attn_implementation`` as transformers resolves it, or transformers' own choice
    where that is None (``sdpa`` where the architecture supports it, else ``eager``). Read from the model built
    on the meta device (no weights, no memory); where that build fails, the recipe's name (or ``sdpa``).
    Raises what :func:`peagle_train.features.target.materialise_target` raises (TargetLoadError)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from peagle_train.features.target import materialise_target

    config = AutoConfig.from_pretrained(str(materialise_target(target_cfg)))
    name = target_cfg.attn_implementation
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **({} if name is None else {"attn_implementation": name}))
        return model.config._attn_implementation
    except Exception:  # noqa: BLE001 -- the real load says what is wrong with the name; here only a label
        return name or "sdpa"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(runner, ids, lengths: list[int], calls: int, warmup: int) -> dict:
    """Per length ``L``: ms per ``forward(ids[:L], want_aux=True)`` + ``drop(L - 1)`` (median, p10, p90 of ``calls``
    after ``warmup``): each call leaves the cache one position longer, as a round of the decoding loop that
    accepts no draft, so a forward specialised on the position would show here. ``ids``: ``[>= max(lengths)]``
    on the device; the runner must hold ``(warmup + calls) * len(lengths)`` positions more than it has."""
    dev = ids.device
    out = {}
    for L in lengths:
        new = ids[:L]
        for _ in range(warmup):
            runner.forward(new, want_aux=True)
            runner.drop(L - 1)
        ms = []
        for _ in range(calls):
            _sync(dev)
            t = time.perf_counter()
            runner.forward(new, want_aux=True)
            runner.drop(L - 1)
            _sync(dev)
            ms.append((time.perf_counter() - t) * 1e3)
        q = statistics.quantiles(ms, n=10) if len(ms) > 1 else [ms[0]] * 9
        out[str(L)] = {"median_ms": statistics.median(ms), "p10_ms": q[0], "p90_ms": q[-1]}
    return out


def profile_calls(runner, ids, L: int, calls: int, top: int = 15) -> dict:
    """``torch.profiler`` over ``calls`` forward + drop of ``L`` tokens: the ops by self CPU time and, on a GPU,
    the kernels by self device time (top ``top`` each), and the device's busy time per call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ids.device.type == "cuda" else [])
    _sync(ids.device)
    with profile(activities=acts) as prof:
        for _ in range(calls):
            runner.forward(ids[:L], want_aux=True)
            runner.drop(L - 1)
        _sync(ids.device)
    ev = prof.key_averages()

    def dev_us(e):  # torch renamed cuda -> device time
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    rows = lambda key: [{"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,  # noqa: E731
                         "self_device_ms": dev_us(e) / 1e3} for e in sorted(ev, key=key, reverse=True)[:top]]
    device_ms = sum(dev_us(e) for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 \
        if ids.device.type == "cuda" else None
    return {"length": L, "calls": calls, "by_self_cpu": rows(lambda e: e.self_cpu_time_total),
            "by_self_device": rows(dev_us) if ids.device.type == "cuda" else [],
            "device_ms_per_call": device_ms / calls if device_ms is not None else None}


def main(argv=None) -> dict:
    """Run the profile (module docstring) and return its JSON dict, also written to ``--out``: ``meta`` (command,
    commit, device, versions, ``attn_default`` and the ``attn`` implementations timed, in order) and per kind and
    attention implementation (``KIND``, or ``KIND@ATTN`` for one other than the recipe's own) ``per_length``
    (milliseconds per call), ``attn``, ``runner``, ``fallback``, ``cudagraph_skips`` and, for the last kind of each
    attention implementation, ``profile``. An ``--attn`` name that loads as an implementation already timed is
    skipped (said on stdout). Raises what loading the recipe or target raises (ConfigError, TargetLoadError: an
    attention implementation transformers refuses)."""
    import torch

    from benchmarks.train_step import provenance
    from peagle_train.decoding.target_runner import TargetRunner
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    args = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(args)
    cfg = load_config(a.recipe, a.overrides)
    attn_default = default_attn(cfg.target)
    import transformers
    from torch._dynamo.utils import counters

    out, prompt, new = None, None, None
    grows = (a.warmup + a.calls) * len(a.lengths) + a.profile_calls + max(a.lengths)  # one position a call
    for n, name in enumerate(a.attn or [None]):
        tcfg = cfg.target if name is None else cfg.target.model_copy(update={"attn_implementation": name})
        t0 = time.perf_counter()
        target = load_target(tcfg, with_tokenizer=False)
        load_s = time.perf_counter() - t0
        attn = target.config._attn_implementation
        if out is None:  # the same prompt and tokens for every attention implementation (the same weights)
            g = torch.Generator().manual_seed(0)
            V = target.config.vocab_size
            prompt = torch.randint(0, V, (a.prompt_tokens,), generator=g).to(target.device)
            new = torch.randint(0, V, (max(a.lengths),), generator=g).to(target.device)
            out = {"meta": {**provenance(args, "benchmarks/decode_profile.py"),
                            "recipe": a.recipe, "overrides": a.overrides, "dtype": cfg.target.dtype,
                            "device": str(target.device),
                            "gpu": torch.cuda.get_device_name() if target.device.type == "cuda" else None,
                            "torch": torch.__version__, "transformers": transformers.__version__,
                            "layers": target.config.num_hidden_layers, "prompt_tokens": a.prompt_tokens,
                            "load_s": load_s, "attn_default": attn_default, "attn": [],
                            "timing": f"median of {a.calls} calls of forward(L, want_aux=True) + drop(L - 1) after "
                                      f"{a.warmup}, device synced around each"}, "kinds": {}}
        if attn in out["meta"]["attn"]:
            print(f"--attn {name}: loads as {attn}, timed already; skipped", flush=True)
            del target
            continue
        out["meta"]["attn"].append(attn)
        suffix = "" if attn == attn_default else f"@{attn}"
        if n:  # the next implementation compiles from nothing, as the first did (no cache entries of the last)
            torch._dynamo.reset()
        with torch.no_grad():
            for kind in a.kinds:
                with TargetRunner(target, **KINDS[kind]) as runner:
                    runner.start(a.prompt_tokens + grows)
                    runner.forward(prompt, want_aux=False, prefill=True)
                    stats0, breaks0 = dict(counters["stats"]), dict(counters["graph_break"])
                    t = time.perf_counter()
                    row = {"attn": attn, "per_length": time_calls(runner, new, a.lengths, a.calls, a.warmup),
                           "seconds_with_warmup": time.perf_counter() - t}
                    if kind == a.kinds[-1] and a.profile_calls > 0:
                        row["profile"] = profile_calls(runner, new, max(a.lengths), a.profile_calls)
                    # what Dynamo did meanwhile: graphs made (one per query length expected), graph breaks (none)
                    row["dynamo"] = {"stats": {k: v - stats0.get(k, 0) for k, v in counters["stats"].items()
                                               if v != stats0.get(k, 0)},
                                     "graph_breaks": {k: v - breaks0.get(k, 0)
                                                      for k, v in counters["graph_break"].items()
                                                      if v != breaks0.get(k, 0)}}
                    row |= {"runner": runner.kind, "fallback": runner.fallback,
                            "cudagraph_skips": runner.cudagraph_skips}
                    out["kinds"][kind + suffix] = row
                per = ", ".join(f"L={L}: {r['median_ms']:.2f} ms" for L, r in row["per_length"].items())
                print(f"{kind + suffix:>9} ({row['runner']}, {attn}): {per}"
                      + (f"; cudagraph skips: {row['cudagraph_skips']}" if row["cudagraph_skips"] else ""), flush=True)
        del target  # the next implementation's load: one target in memory at a time
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
