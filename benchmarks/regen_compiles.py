"""What the static regeneration engine pays per batch shape: wall time of each batch and how many frames
TorchDynamo has compiled after it, through the engine's own batch call
(:func:`data_prep.regenerate._generate_batch`, prompts left-padded to ``STATIC_PROMPT_BUCKET`` tokens, a static
KV cache whose decoding step transformers compiles).

Why: ``peagle-train prepare`` of the GPT-OSS-20B-shaped target on an H200 took 424.7 s for 256 answers of 256
tokens at batches of ~50 (docs/real_shapes.md), far above the decoding step's weight-read bound. A batch of a new
size recompiles the decoding step once (after the second size TorchDynamo makes the batch dimension dynamic);
a new prompt bucket does not (tiny GPT-OSS on a CPU, below). On a GPU each compile of the 20B decoding step
costs about a minute and a half, so the number of distinct batch sizes of a run (the last partial batch of a
split, the eval split) is part of its wall time.

The target: a model configuration with RANDOM weights (``--config``, a ``target.random_init_from_config`` spec),
eager attention (GPT-OSS's only non-flex path). ``--batches`` lists ``BxL`` batches of ``B`` random prompts of
about ``L`` tokens, generated in order with ``--new-tokens`` each. On a GPU transformers compiles as
``peagle-train prepare`` does (inductor, ``reduce-overhead``); ``--backend eager`` (the default on a CPU, where
transformers compiles only when told to) traces with TorchDynamo alone, which is what decides recompiles.

GPU::

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/regen_compiles.py --config pkg:peagle_train/gpt-oss-20b.json \\
        --dtype bfloat16 --batches 48x2048 48x1800 35x1500 13x1200 --new-tokens 64 --out $OUT/regen_compiles.json

CPU smoke (CI, ``tests/integration/test_benchmarks.py``): ``--smoke --out x.json`` (tiny GPT-OSS, float32).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="pkg:peagle_train/gpt-oss-20b-tiny.json",
                   help="target.random_init_from_config spec of the random-weight target")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batches", nargs="+", default=["4x300", "4x200", "3x60", "2x60"],
                   help="BxL: B prompts of ~L tokens (L - row index, so rows differ in length)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--backend", default=None, choices=["inductor", "eager"],
                   help="torch.compile backend (default: inductor on CUDA, eager elsewhere)")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny GPT-OSS and the default batches")
    p.add_argument("--out", required=True, help="JSON file")
    return p.parse_args(argv)


def parse_batch(spec: str) -> tuple[int, int]:
    """``"48x2048"`` → ``(48, 2048)``.

    Raises:
        ValueError: not ``BxL`` with positive integers.
    """
    try:
        b, n = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"--batches {spec!r}: expected BxL, e.g. 48x2048") from None
    if b < 1 or n < 2:
        raise ValueError(f"--batches {spec!r}: B >= 1 and L >= 2 needed")
    return b, n


def main(argv=None) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM
    from transformers.generation.configuration_utils import CompileConfig

    from benchmarks.train_step import provenance
    from data_prep.regen_memory import STATIC_PROMPT_BUCKET, bucketed
    from data_prep.regenerate import _generate_batch
    from peagle_train.features.target import random_target_config

    args = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(args)
    batches = [parse_batch(b) for b in a.batches]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = a.backend or ("inductor" if device.type == "cuda" else "eager")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(random_target_config(a.config), dtype=getattr(torch, a.dtype),
                                                 attn_implementation="eager").eval()
    cc = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
    cc._compile_all_devices = True  # transformers compiles the static cache's step on CUDA only otherwise
    model.generation_config.compile_config = cc
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    gen = {"max_new_tokens": a.new_tokens, "do_sample": False, "cache_implementation": "static"}
    out = {"meta": {**provenance(args, "benchmarks/regen_compiles.py"),
                    "config": a.config, "dtype": a.dtype, "device": str(device), "backend": backend,
                    "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "random_weights": True,
                    "prompt_bucket": STATIC_PROMPT_BUCKET, "new_tokens": a.new_tokens}, "batches": []}
    for B, n in batches:
        prompts = [torch.randint(10, vocab - 1000, (max(1, n - i),), generator=g).tolist() for i in range(B)]
        before = counters["frames"]["ok"]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _generate_batch(model, prompts, 0, [vocab - 1], gen, STATIC_PROMPT_BUCKET)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row = {"batch": B, "prompt_tokens": n, "bucket": bucketed(n, STATIC_PROMPT_BUCKET),
               "seconds": time.perf_counter() - t0, "frames_compiled": counters["frames"]["ok"] - before,
               "frames_total": counters["frames"]["ok"]}
        out["batches"].append(row)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(row), flush=True)
    return out


if __name__ == "__main__":
    main()
