"""Benchmark the full P-EAGLE training step on random inputs of real shapes.

One step = COD sample + grid + block-mask build + partition plan + forward +
chunked KL loss + backward + grad clip + AdamW, timed with CUDA events (wall
clock on CPU): ``--warmup`` untimed steps, then the median and spread of
``--steps`` timed steps. Prints a table and writes JSON.

Trainable parameters (stated in the JSON): everything except the lm_head
(frozen, as vLLM's speculators does); embeddings trainable. bf16 autocast with
fp32 master weights and AdamW state.

FLOP count (per step, stated in the JSON as ``flop_formula``):
    dense = 6 * P_layers * E + 6 * P_fc * N + 4 * P_head * E
    attn  = 3 * 4 * n_heads * head_dim * sum_q keys(q)
where ``E`` is the number of grid elements, ``P_layers`` the decoder-layer
parameters, ``P_fc = 3T*H`` (applied to the N real positions), ``P_head = H*Vd``
(frozen: forward + input-gradient only = 4 FLOP/param/element), and ``keys(q)`` is
the number of keys query ``q`` may attend (depth-0 prefix + own chain); the
attention backward is counted as 2x the forward. Embedding lookups are free.

Distributed (issue: multi-GPU scaling): launch with ``torchrun --nproc_per_node G`` or
``accelerate launch --multi_gpu --num_processes G`` and pass ``--dist ddp`` or ``--dist fsdp2``;
every rank trains its own N-token sequence (global batch = G sequences), gradients are
all-reduced (DDP) or reduce-scattered (FSDP2) every step, and the table reports per-GPU
throughput.

Usage::

    python benchmarks/train_step.py --shape gpt-oss-20b --seq-len 2048 4096 8192 --out bench.json
    python benchmarks/train_step.py --shape tiny --seq-len 256 --steps 3 --warmup 1   # CPU smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import os
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig  # noqa: E402

from peagle_train.drafter import Drafter, make_drafter_config  # noqa: E402
from peagle_train.grid import build_grid, cod_sample, supervised_count  # noqa: E402
from peagle_train.objective import PEagleObjective  # noqa: E402
from peagle_train.partition import plan_partitions  # noqa: E402

SHAPES = {
    # GPT-OSS-20B P-EAGLE drafter: hidden 2880, 64 heads x 64, 8 KV heads, intermediate 7680, vocab 201,088
    "gpt-oss-20b": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=7680, vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072,
                        rope_theta=150000.0, draft_vocab=32000),
    "smollm2-135m": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         rope_theta=100000.0, draft_vocab=49152),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0, draft_vocab=256),
}


def build(shape: str, draft_vocab: int | None, K: int, device, layers: int = 4):
    s = dict(SHAPES[shape])
    vd = draft_vocab or s.pop("draft_vocab")
    s.pop("draft_vocab", None)
    tc = LlamaConfig(num_hidden_layers=36, **s)
    dcfg = make_drafter_config(tc, aux_layer_ids=[2, 18, 33], draft_vocab_size=vd, mask_token_id=s["vocab_size"] - 1,
                               num_layers=layers, K=K)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = Drafter(dcfg)
        head = torch.randn(vd, tc.hidden_size, dtype=torch.bfloat16) * 0.02
    drafter.set_draft_vocab(torch.arange(vd))
    drafter.lm_head.weight.requires_grad_(False)
    return drafter, head, tc


def attention_keys(grid) -> int:
    """Sum over queries of allowed keys: depth-0 prefix (anchor - doc_start + 1) + own chain (depth)."""
    return int((grid.position_ids - grid.depth + 1).sum() + grid.depth.sum())


def flops(drafter: Drafter, grid, n_tokens: int) -> float:
    c = drafter.config
    E = len(grid)
    p_layers = sum(p.numel() for p in drafter.layers.parameters())
    p_fc = drafter.fc.weight.numel()
    p_head = drafter.lm_head.weight.numel()
    attn = 3 * 4 * c.num_attention_heads * c.head_dim * attention_keys(grid)
    return 6 * p_layers * E + 6 * p_fc * n_tokens + 4 * p_head * E + attn


def wrap(obj, dist: str, device):
    """Wrap the objective for data parallelism: ``none``, ``ddp`` or ``fsdp2`` (per-layer + root ``fully_shard``)."""
    if dist == "none":
        return obj
    if dist == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(obj, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in obj.drafter.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(obj, mp_policy=mp)
    return obj


def run_case(drafter, head, tc, N: int, K: int, S: int, r: float, r_min: float, steps: int, warmup: int, device,
             chunk: int, seed: int = 0, dist: str = "none") -> dict:
    cuda = device.type == "cuda"
    rank = torch.distributed.get_rank() if dist != "none" else 0
    seed = seed + 1000 * rank
    A, T = 3, tc.hidden_size
    g = torch.Generator(device="cpu").manual_seed(seed)
    aux = (torch.randn(N, A * T, generator=g) * 0.5).to(device, torch.bfloat16)
    last = torch.randn(N, T, generator=g).to(device, torch.bfloat16)
    argmax = torch.randint(0, tc.vocab_size - 1, (N,), generator=g).to(device)
    input_ids = torch.randint(0, tc.vocab_size - 1, (N,), generator=g).to(device)
    loss_mask = torch.ones(N, dtype=torch.bool, device=device)
    doc_ids = torch.zeros(N, dtype=torch.long, device=device)
    obj = PEagleObjective(drafter, head, loss="kl", chunk_size=chunk,
                          attention="flex" if cuda else "sdpa").to(device)
    obj = wrap(obj, dist, device)
    params = [p for p in obj.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=cuda)
    times, rec = [], {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for it in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        kept = cod_sample(loss_mask, doc_ids, K, r, r_min, generator=torch.Generator().manual_seed(seed + it))
        grid = build_grid(input_ids, loss_mask, doc_ids, kept, drafter.mask_token_id)
        norm = supervised_count(grid)
        segs = plan_partitions(grid, N, S)
        for j, seg in enumerate(segs):
            sync = contextlib.nullcontext() if (dist != "ddp" or j == len(segs) - 1) else obj.no_sync()
            with sync, torch.autocast(device.type, dtype=torch.bfloat16):
                loss, _ = obj(seg.apply(grid), aux, last, argmax, norm)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            dt = time.perf_counter() - t0
        if it == 0:
            rec["first_step_s"] = dt  # includes compilation
        if it >= warmup:
            times.append(dt)
        rec["positions"], rec["flop"] = len(grid), flops(drafter, grid, N)
    med = statistics.median(times)
    rec.update({
        "N": N, "K": K, "S": S, "step_ms": med * 1e3, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
        "positions_per_s": rec["positions"] / med, "tokens_per_s": N / med, "tflops": rec["flop"] / med / 1e12,
        "peak_alloc_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    })
    del obj, opt
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--draft-vocab", type=int, default=None, help="Vd (default: the shape's)")
    ap.add_argument("--seq-len", "--N", dest="n", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--partitions", type=int, nargs="+", default=None,
                    help="S per N (default 1; a single value applies to all N)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192, help="loss chunk (grid elements)")
    ap.add_argument("--out", type=str, default="train_step.json")
    ap.add_argument("--dist", choices=["none", "ddp", "fsdp2"], default="none")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 3 steps of the first N and print the top CUDA kernels")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    world = 1
    if args.dist != "none":
        local = int(os.environ.get("LOCAL_RANK", 0))
        if device.type == "cuda":
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world = torch.distributed.get_world_size()
    drafter, head, tc = build(args.shape, args.draft_vocab, args.K, device)
    S_list = args.partitions or [1]
    if len(S_list) == 1:
        S_list = S_list * len(args.n)
    rows = []
    for N, S in zip(args.n, S_list):
        try:
            rows.append(run_case(drafter, head, tc, N, args.K, S, args.r, args.r_min, args.steps, args.warmup, device,
                                 args.chunk, dist=args.dist))
        except torch.OutOfMemoryError as e:  # report, keep going
            rows.append({"N": N, "S": S, "error": f"OOM: {str(e)[:120]}"})
            torch.cuda.empty_cache()
        if world == 1 or torch.distributed.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if world > 1 and torch.distributed.get_rank() != 0:
        torch.distributed.destroy_process_group()
        return rows
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            run_case(drafter, head, tc, args.n[0], args.K, S_list[0], args.r, args.r_min, 3, 0, device, args.chunk)
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    meta = {
        "shape": args.shape, "draft_vocab": drafter.config.draft_vocab_size, "K": args.K, "r": args.r,
        "r_min": args.r_min, "trainable_params": trainable, "frozen": ["lm_head"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "precision": "bf16 autocast, fp32 master weights, fused AdamW",
        "flop_formula": "6*P_layers*E + 6*P_fc*N + 4*P_head*E + 12*heads*head_dim*sum_q keys(q)",
        "timing": f"median of {args.steps} steps after {args.warmup} warm-up steps",
        "dist": args.dist, "world_size": world,
        "note": "per-GPU numbers: each rank trains its own N-token sequence" if world > 1 else "",
    }
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    hdr = f"{'N':>7} {'S':>2} {'positions':>10} {'step ms':>9} {'(min-max)':>15} {'pos/s':>9} {'TFLOP/s':>8} {'peak GB':>8}"
    print(f"\n{args.shape}, Vd={meta['draft_vocab']}, K={args.K}, {meta['device']}, {meta['timing']}, "
          f"dist={args.dist} x{world}")
    print(hdr)
    for r in rows:
        if "error" in r:
            print(f"{r['N']:>7} {r['S']:>2} {r['error']}")
            continue
        pk = f"{r['peak_alloc_gb']:.1f}" if r["peak_alloc_gb"] is not None else "-"
        print(f"{r['N']:>7} {r['S']:>2} {r['positions']:>10} {r['step_ms']:>9.1f} "
              f"{r['step_ms_min']:>7.1f}-{r['step_ms_max']:<7.1f} {r['positions_per_s']:>9.0f} {r['tflops']:>8.1f} {pk:>8}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
