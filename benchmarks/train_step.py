"""Benchmark the full P-EAGLE training step on random inputs of real shapes.

One step = COD sample + grid + block-mask build + partition plan + forward +
chunked KL loss + backward + grad clip + AdamW, timed with CUDA events (wall
clock on CPU): ``--warmup`` untimed steps, then the median and spread of
``--steps`` timed steps. Prints a table and writes JSON. The COD sample, grid,
supervised count and partition plan are built on the CPU one step ahead, while
the previous step's kernels run (as a data-loader worker would; the row says
``"host_inputs": "prefetched"``); ``peagle_train``'s Trainer builds them on the CPU
at the start of its own step, so its GPU waits for that CPU work.

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
    python benchmarks/train_step.py --seq-len 8192 --compile both          # eager vs compiled, same process
    python benchmarks/train_step.py --seq-len 65536 --partitions auto      # S from peagle_train.planner
    python benchmarks/train_step.py --seq-len 8192 --attention both        # split vs joint flex, same process
    python benchmarks/train_step.py --check-grads                          # split ≡ joint flex, fp32 grads

Variants (issue #7): ``--compile off|on|both|autotune|on+autotune`` times each configuration side
by side for every N (``train.compile``: compiled decoder layers + compiled loss chunk; ``autotune``:
``train.compile: max-autotune``, Inductor's autotuning of the kernel configs); ``first_step_s``
is the first step (compilation included) and ``compile_modes`` says whether each compiled
piece ran fullgraph, with graph breaks, or fell back to eager. ``--partitions auto`` asks
:func:`peagle_train.planner.plan_step` for S (and activation checkpointing) given the GPU's
memory; an out-of-memory step under ``auto`` retries once with S + 1. ``--profile`` writes the
top-25 kernels (name, ms per step, % of step) to the JSON, and on CUDA the GPU's busy and idle
time per profiled step and the kernel time by category (:func:`timeline_summary`; ``--trace``
also saves the Chrome trace); ``--sync-debug`` counts the host
syncs of one extra step (CUDA only).

Attention (``train.attention``): ``--attention flex`` (default) is the split form (FlexAttention
over the depth-0 prefix + a gathered chain of <= K-1 keys, merged by log-sum-exp), ``flex_joint``
the single-BlockMask kernel of the whole rule, ``both`` times each row with both kinds (joint
first) and adds ``speedup_vs_joint = joint step_ms / split step_ms`` to the split row. Every row
records the ``attention`` it ran: on CPU that is ``sdpa`` whatever was asked (FlexAttention has
no CPU backward). ``--check-grads`` times nothing: on a small grid of the chosen shape (N =
``--check-n``, float32, two documents + padding, bucket-padded) it compares the loss and every
parameter gradient of the split form against the joint kernel (max relative error, per tensor
relative to its largest entry), once per ``--compile`` variant; on CPU the prefix part is computed
densely and the joint side is dense SDPA (no flex backward there).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import LlamaConfig  # noqa: E402

import peagle_train.model.drafter as drafter_mod  # noqa: E402
import peagle_train.kernels.loss as loss_mod  # noqa: E402
from peagle_train.kernels.attention import dense_attention_with_lse  # noqa: E402
from peagle_train.kernels.chain_kernel import TILING as CHAIN_TILING, resolve as resolve_chain_kernel  # noqa: E402
from peagle_train.model.drafter import Drafter, make_drafter_config  # noqa: E402
from peagle_train.peagle.grid import build_grid, cod_sample, supervised_count  # noqa: E402
from peagle_train.methods.objectives import PEagleObjective  # noqa: E402
from peagle_train.peagle.partition import plan_partitions  # noqa: E402
from peagle_train.peagle.planner import ShapeParams, plan_step  # noqa: E402

PROFILED_STEPS = 3  # --profile records this many steps after PROFILE_WAIT skipped and PROFILE_WARMUP warm-up ones
PROFILE_WAIT, PROFILE_WARMUP = 1, 1

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


def effective_attention(kind: str, device) -> str:
    """The attention a row really runs: ``kind`` on CUDA, ``sdpa`` on CPU (flex has no CPU backward)."""
    return kind if device.type == "cuda" else "sdpa"


def run_case(drafter, head, tc, N: int, K: int, S: int, r: float, r_min: float, steps: int, warmup: int, device,
             chunk: int, seed: int = 0, dist: str = "none", compile: bool = False, checkpointing: bool = False,
             sync_debug: bool = False, attention: str = "flex", on_step=None, chain_kernel: str = "auto",
             fused_loss: bool = True) -> dict:
    """Time ``warmup + steps`` full training steps of one configuration; returns the JSON row.

    Each step builds the next step's COD sample, grid, normaliser and partition plan on the CPU
    after its own kernels are queued, as a data-loader worker would, so that CPU work overlaps the
    GPU; the first step builds its own. The grid and segments go to the GPU through pinned memory.
    ``on_step``: called after every step (e.g. ``torch.profiler.profile.step``).

    ``attention``: ``flex`` (split form) or ``flex_joint`` on CUDA (see :func:`effective_attention`).
    ``chain_kernel``: ``train.chain_kernel`` of the split form (``auto``/``triton``/``torch``); the row
    records the one that ran (None for ``flex_joint`` and ``sdpa``, which have no chain part).
    ``fused_loss``: ``train.fused_loss`` (lm_head + loss gradients computed in the loss forward, or
    checkpoint + recompute).
    The row records every timed step (``step_ms_all``), and Python's garbage-collector time in each
    (``gc_ms_all``) with its number of full (generation-2) collections (``gc_full_all``), from
    :data:`gc.callbacks`, so a slow step can be told apart from a collection pause.
    ``compile``: ``train.compile`` (compiled decoder layers + loss chunk). ``checkpointing``:
    activation checkpointing of the decoder layers. ``sync_debug`` (CUDA): run one more step
    under ``torch.cuda.set_sync_debug_mode("warn")`` and record the number of host syncs
    and their top call sites. Raises whatever the step raises (the caller records it); the
    drafter is back to eager, without checkpointing, either way.
    """
    gc_now = {"ms": 0.0, "full": 0, "t0": None}

    def gc_clock(phase, info):
        if phase == "start":
            gc_now["t0"] = time.perf_counter()
        elif gc_now["t0"] is not None:
            gc_now["ms"] += (time.perf_counter() - gc_now["t0"]) * 1e3
            gc_now["full"] += info["generation"] == 2
            gc_now["t0"] = None

    gc.callbacks.append(gc_clock)
    try:
        cuda = device.type == "cuda"
        rank = torch.distributed.get_rank() if dist != "none" else 0
        seed = seed + 1000 * rank
        A, T = 3, tc.hidden_size
        g = torch.Generator(device="cpu").manual_seed(seed)
        aux = (torch.randn(N, A * T, generator=g) * 0.5).to(device, torch.bfloat16)
        last = torch.randn(N, T, generator=g).to(device, torch.bfloat16)
        argmax = torch.randint(0, tc.vocab_size - 1, (N,), generator=g).to(device)
        # the token side stays on the CPU, as a data loader has it: COD and the grid are built there
        input_ids = torch.randint(0, tc.vocab_size - 1, (N,), generator=g)
        loss_mask = torch.ones(N, dtype=torch.bool)
        doc_ids = torch.zeros(N, dtype=torch.long)
        drafter.gradient_checkpointing = checkpointing
        drafter.train()
        attention = effective_attention(attention, device)
        obj = PEagleObjective(drafter, head, loss="kl", chunk_size=chunk, attention=attention,
                              compile=compile, chain_kernel=chain_kernel, fused_loss=fused_loss).to(device)
        obj = wrap(obj, dist, device)
        params = [p for p in obj.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=cuda)
        times, rec = [], {}

        def host_inputs(it: int):
            """Step ``it``'s COD sample, grid, normaliser and partition plan, on the CPU."""
            kept = cod_sample(loss_mask, doc_ids, K, r, r_min, generator=torch.Generator().manual_seed(seed + it))
            host_grid = build_grid(input_ids, loss_mask, doc_ids, kept, drafter.mask_token_id)
            return host_grid, supervised_count(host_grid), plan_partitions(host_grid, N, S)

        ahead = None  # (step index, host_inputs of it), built during the previous step

        def step(it: int):
            nonlocal ahead
            host_grid, norm, host_segs = ahead[1] if ahead and ahead[0] == it else host_inputs(it)
            segs = [seg.to(device, non_blocking=True) for seg in host_segs]
            grid = host_grid.to(device, non_blocking=True)  # no host sync before the forward
            for j, seg in enumerate(segs):
                sync = contextlib.nullcontext() if (dist != "ddp" or j == len(segs) - 1) else obj.no_sync()
                with sync, torch.autocast(device.type, dtype=torch.bfloat16):
                    loss, _ = obj(seg.apply(grid), aux, last, argmax, norm)
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ahead = (it + 1, host_inputs(it + 1))  # while this step's kernels run
            return grid

        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        gc_ms, gc_full = [], []
        for it in range(warmup + steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            gc_now.update(ms=0.0, full=0)
            grid = step(it)
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
                gc_ms.append(gc_now["ms"])
                gc_full.append(gc_now["full"])
            if on_step is not None:
                on_step()
        rec["positions"], rec["flop"] = len(grid), flops(drafter, grid, N)  # the last step's grid
        med = statistics.median(times)
        rec.update({
            "N": N, "K": K, "S": S, "compile": compile, "checkpointing": checkpointing, "attention": attention,
            "chain_kernel": resolve_chain_kernel(chain_kernel, device) if attention == "flex" else None,
            "fused_loss": fused_loss, "host_inputs": "prefetched",
            "step_ms": med * 1e3, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
            "step_ms_all": [t * 1e3 for t in times],
            "gc_ms_all": gc_ms, "gc_full_all": gc_full,
            "positions_per_s": rec["positions"] / med, "tokens_per_s": N / med, "tflops": rec["flop"] / med / 1e12,
            "peak_alloc_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            # the loss path the steps took: fused_loss falls back to recompute where the head is sharded (fsdp2)
            "loss_path": loss_mod.last_path,
        })
        if compile:
            from peagle_train.kernels.compiling import inductor_mode

            rec["compile_modes"] = {"layers": [c.mode for c in drafter._compiled_layers or []],
                                    "loss_chunk": loss_mod.compiled_chunk_loss(
                                        inductor_mode(compile), fused=rec["loss_path"] == "fused").mode}
        if sync_debug and cuda:
            rec["host_syncs"] = count_syncs(lambda: step(warmup + steps))
        return rec
    finally:
        drafter.set_compile(False)
        drafter.gradient_checkpointing = False
        if gc_clock in gc.callbacks:
            gc.callbacks.remove(gc_clock)


def count_syncs(fn) -> dict:
    """Run ``fn`` under ``torch.cuda.set_sync_debug_mode("warn")``; count the synchronising calls.

    Returns ``{"count": int, "sites": [[file:line in peagle_train/benchmarks, count], ...]}`` (top 15).
    """
    import collections
    import traceback
    import warnings

    sites = collections.Counter()
    n = 0
    orig = warnings.showwarning

    def hook(message, category, filename, lineno, file=None, line=None):
        nonlocal n
        if "synchroniz" not in str(message):
            return orig(message, category, filename, lineno, file, line)
        n += 1
        ours = [f for f in traceback.extract_stack() if "peagle_train" in f.filename or "benchmarks" in f.filename]
        ours = [f for f in ours if not f.filename.endswith("train_step.py") or f.name != "hook"]
        site = f"{Path(ours[-1].filename).name}:{ours[-1].lineno} ({ours[-1].line})" if ours else filename
        sites[site] += 1

    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
            warnings.showwarning = orig
    return {"count": n, "sites": [[k, v] for k, v in sites.most_common(15)]}


def _is_device_kernel(e) -> bool:
    """A profiler event that is a CUDA kernel or copy, not an annotated range (``Optimizer.step#...``,
    Inductor's ``## Call CompiledFxGraph ##``), which the profiler also lists on the device."""
    from torch.autograd import DeviceType

    return getattr(e, "device_type", None) == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def kernel_table(prof, step_ms: float, n_steps: int, top: int = 25) -> list[dict]:
    """Top ``top`` CUDA kernels of a profile (CPU ops when there are no kernels): name, ms per step
    (total / ``n_steps``), % of the measured step time ``step_ms``, calls per step."""
    events = prof.key_averages()
    gpu = [e for e in events if _is_device_kernel(e)]

    def dev_us(e):
        for k in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
            v = getattr(e, k, None)
            if v:
                return float(v)
        return 0.0

    if gpu:
        rows = [(e.key, dev_us(e), e.count) for e in gpu]
    else:
        rows = [(e.key, float(e.self_cpu_time_total), e.count) for e in events]
    rows.sort(key=lambda x: -x[1])
    out = []
    for name, us, count in rows[:top]:
        ms = us / 1e3 / n_steps
        out.append({"name": name[:120], "ms_per_step": round(ms, 3),
                    "pct_of_step": round(100 * ms / step_ms, 2) if step_ms else None,
                    "calls_per_step": round(count / n_steps, 1)})
    return out


KERNEL_CATEGORIES = (  # first match wins; names as the CUDA profiler reports them (torch 2.11, H200)
    ("flex attention backward", ("flex_attention_backward",)),
    ("flex attention forward", ("flex_attention",)),
    ("GEMM (cuBLAS / CUTLASS)", ("nvjet", "gemm", "cutlass", "magma", "sm90_xmma")),
    ("optimizer (fused multi-tensor)", ("multi_tensor_apply",)),
    ("copies", ("memcpy", "memset", "direct_copy", "copy_kernel")),
    ("chain part (Triton kernels, train.chain_kernel)", ("_chain_",)),
    ("Inductor fused (norms, RoPE, loss, chain part, ...)", ("triton_",)),  # the chain part: chain_kernel torch
)


def kernel_category(name: str) -> str:
    """Coarse category of a CUDA kernel name (:data:`KERNEL_CATEGORIES`; anything else: ``other``)."""
    low = name.lower()
    for cat, keys in KERNEL_CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def timeline_summary(kernels: list[tuple[str, float, float]], n_steps: int) -> dict:
    """GPU busy and idle time of a profiled window, from kernel intervals.

    Args:
        kernels: ``(name, start_us, end_us)`` of every device kernel / copy of ``n_steps`` steps.
        n_steps: steps in the window (``>= 1``).

    Returns:
        ``{"window_ms", "busy_ms", "idle_ms"}`` per step (the window spans the first start to the
        last end; busy is the union of the intervals, so overlapping kernels on several streams
        count once; idle = window - busy) and ``"by_category"``: ``{category: ms per step}`` of
        summed kernel time (:func:`kernel_category`), largest first. Empty input gives zeros.

    Raises:
        ValueError: ``n_steps < 1`` or an interval that ends before it starts.
    """
    if n_steps < 1:
        raise ValueError(f"timeline_summary: n_steps must be >= 1, got {n_steps}")
    if any(e < b for _, b, e in kernels):
        raise ValueError("timeline_summary: an interval ends before it starts")
    cats: dict[str, float] = {}
    busy, cur_b, cur_e = 0.0, None, None
    for name, b, e in sorted(kernels, key=lambda x: x[1]):
        cat = kernel_category(name)
        cats[cat] = cats.get(cat, 0.0) + (e - b)
        if cur_e is None or b > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_b
            cur_b, cur_e = b, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_b
    window = (max(e for _, _, e in kernels) - min(b for _, b, _ in kernels)) if kernels else 0.0
    per = 1e3 * n_steps
    return {"window_ms": round(window / per, 3), "busy_ms": round(busy / per, 3),
            "idle_ms": round((window - busy) / per, 3),
            "by_category": {k: round(v / per, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}}


def device_kernels(prof) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the device kernels and copies in a ``torch.profiler`` run
    (empty on CPU-only runs)."""
    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
            if _is_device_kernel(e) and e.time_range.end > e.time_range.start]


def _dense_prefix(q, k, v, prefix_mask):
    """CPU stand-in for the flex prefix part (no flex backward on CPU): dense attention under the
    prefix BlockMask's ``mask_mod`` at every pair → ``(out, lse)``."""
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(prefix_mask.mask_mod, 1, 1, q.shape[2], k.shape[2], device=q.device)[0, 0]
    return dense_attention_with_lse(q, k, v, mask)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 when both are 0): the error relative to the tensor's scale."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_grads(drafter, head, tc, N: int, K: int, r: float, r_min: float, device, chunk: int,
                compile: bool = False, seed: int = 0, chain_kernel: str = "auto") -> dict:
    """Loss and parameter gradients of the split attention vs the joint kernel (float32, no autocast).
    ``chain_kernel``: the split side's chain part (``train.chain_kernel``; recorded as run).

    The grid: ``N`` tokens in two documents (60 % / the rest, minus 16 padding tokens), loss mask
    random (p = 0.8), COD with ``r``/``r_min``, padded to the 1024 bucket (padding rows present).
    On CUDA: ``flex`` vs ``flex_joint``. On CPU (no flex backward): split with the prefix part
    computed densely vs ``sdpa`` on the unpadded grid. Returns a JSON-able dict with
    ``loss_rel_err``, ``grad_max_rel_err`` (max over parameters of :func:`max_rel_err`),
    ``worst_param`` and ``grads_finite``.
    """
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(seed)
    A, T = 3, tc.hidden_size
    doc_ids = torch.zeros(N, dtype=torch.long)
    doc_ids[int(0.6 * N):] = 1
    doc_ids[N - 16:] = -1
    loss_mask = (torch.rand(N, generator=g) < 0.8) & (doc_ids >= 0)
    input_ids = torch.randint(0, tc.vocab_size - 1, (N,), generator=g)
    kept = cod_sample(loss_mask, doc_ids, K, r, r_min, generator=g)
    grid = build_grid(input_ids, loss_mask, doc_ids, kept, drafter.mask_token_id).to(device)
    aux = (torch.randn(N, A * T, generator=g) * 0.5).to(device)
    last = torch.randn(N, T, generator=g).to(device)
    argmax = torch.randint(0, tc.vocab_size - 1, (N,), generator=g).to(device)
    norm = supervised_count(grid)
    drafter.train()
    params = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    sides = {"split": ("flex", 1024), "reference": ("flex_joint", 1024) if cuda else ("sdpa", 1)}
    res = {}
    saved = drafter_mod._flex_with_lse
    head32 = head.float()
    try:
        for side, (kind, pad) in sides.items():
            # CPU has no flex backward: the split side's prefix part runs dense; the reference side
            # (SDPA) never calls _flex_with_lse, and the finally restores it
            if side == "split" and not cuda:
                drafter_mod._flex_with_lse = _dense_prefix
            obj = PEagleObjective(drafter, head32, loss="kl", chunk_size=chunk, attention=kind,
                                  pad_multiple=pad, compile=compile, chain_kernel=chain_kernel).to(device)
            loss, _ = obj(grid, aux, last, argmax, norm)
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            res[side] = (loss.detach(), grads)
    finally:
        drafter_mod._flex_with_lse = saved
        drafter.set_compile(False)
    (l_s, g_s), (l_r, g_r) = res["split"], res["reference"]
    errs = {}
    finite = True
    for (name, _), a, b in zip(params, g_s, g_r):
        if a is None or b is None:
            continue
        finite &= bool(torch.isfinite(a).all())
        errs[name] = max_rel_err(a, b)
    worst = max(errs, key=errs.get)
    return {"N": N, "K": K, "E": len(grid), "dtype": "float32", "compile": compile, "device": str(device),
            "compared": "flex (split) vs flex_joint" if cuda else
                        "split (prefix part dense: no flex backward on CPU) vs sdpa",
            "loss_split": l_s.item(), "loss_reference": l_r.item(),
            "loss_rel_err": abs(l_s.item() - l_r.item()) / max(abs(l_r.item()), 1e-30),
            "grad_max_rel_err": errs[worst], "worst_param": worst, "grads_finite": finite,
            "params_compared": len(errs), "chain_kernel": resolve_chain_kernel(chain_kernel, device)}


def attach_joint_speedup(rows: list[dict]) -> list[dict]:
    """``speedup_vs_joint = joint step_ms / split step_ms`` on each split row (``attention == "flex"``)
    that has a successful ``flex_joint`` row of the same N, S, compile and fused_loss (in place; returns ``rows``)."""
    def key(r):
        return r["N"], r["S"], r["compile"], r.get("fused_loss", True)

    joint = {key(r): r for r in rows if r.get("attention") == "flex_joint" and "step_ms" in r}
    for r in rows:
        j = joint.get(key(r))
        if r.get("attention") == "flex" and "step_ms" in r and j is not None:
            r["speedup_vs_joint"] = j["step_ms"] / r["step_ms"]
    return rows


def resolve_partitions(spec: str, N: int, args, drafter, device) -> tuple[int, bool, dict | None]:
    """``spec`` is an int or ``"auto"`` → ``(S, checkpointing, plan record or None)``."""
    if spec != "auto":
        return int(spec), args.checkpointing, None
    if device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    else:  # CPU smoke runs: pretend an 80 GiB device
        gpu_bytes = 80 * 2**30
    plan = plan_step(N, args.K, args.r, args.r_min, ShapeParams.from_config(drafter.config), gpu_bytes,
                     chunk=args.chunk, headroom=args.headroom,
                     fused_loss="off" not in args.fused_loss,  # one S for every row of this N: the larger need
                     grads_resident=True if args.dist != "none" else None)  # DDP's gradient buckets always exist
    return plan.partitions, plan.checkpointing, {
        "predicted_peak_gb": plan.predicted_peak_bytes / 2**30, "budget_gb": plan.budget_bytes / 2**30,
        "gpu_gb": gpu_bytes / 2**30}


def attach_reference(rows: list[dict], refs: dict[int, dict]) -> list[dict]:
    """Add the reference framework's numbers to our rows of the same N (in place; returns ``rows``).

    ``refs``: ``{N: run_reference(...) result}`` (``benchmarks/speculators_ref.py``). Each row gets
    ``ref_step_ms``, ``ref_peak_gb``, ``ref_status`` and ``speedup = ref_step_ms / step_ms``
    (> 1: we are faster); a row or reference that failed (OOM, error) gets ``speedup = None``.
    """
    for r in rows:
        ref = refs.get(r["N"])
        if ref is None:
            continue
        ok = ref.get("status") == "ok"
        r["ref_step_ms"] = ref.get("step_ms_median") if ok else None
        r["ref_peak_gb"] = ref.get("peak_alloc_gb") if ok else None
        r["ref_positions"] = ref.get("grid_positions") if ok else None
        r["ref_status"] = ref.get("status")
        r["speedup"] = r["ref_step_ms"] / r["step_ms"] if ok and "step_ms" in r else None
    return rows


def matmul_rate(device, n: int = 8192, reps: int = 10) -> float | None:
    """bf16 dense matmul rate on this GPU (TFLOP/s): ``n x n x n`` products on random data, mean of
    ``reps`` timed after 3 warm-ups (CUDA events). The yardstick for each row's achieved TFLOP/s;
    None on CPU."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--draft-vocab", type=int, default=None, help="Vd (default: the shape's)")
    ap.add_argument("--seq-len", "--N", dest="n", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--partitions", type=str, nargs="+", default=None,
                    help="S per N, or 'auto' (peagle_train.planner; default 1; a single value applies to all N)")
    ap.add_argument("--headroom", type=float, default=0.9, help="usable fraction of GPU memory for --partitions auto")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the decoder layers "
                    "(with --partitions auto the planner decides)")
    ap.add_argument("--compile", choices=["off", "on", "both", "autotune", "on+autotune"], default="off",
                    help="train.compile variants to time side by side (both = eager then compiled; autotune = "
                         "train.compile: max-autotune; on+autotune = compiled then autotuned)")
    ap.add_argument("--attention", choices=["flex", "flex_joint", "both"], default="flex",
                    help="train.attention on CUDA: flex = split form (prefix kernel + gathered chain), flex_joint = "
                         "one kernel of the whole rule, both = each row with both (joint first); CPU runs sdpa")
    ap.add_argument("--chain-kernel", choices=["auto", "triton", "torch"], nargs="+", default=["auto"],
                    help="train.chain_kernel of the split form; several = one row each, same process "
                         "(--profile and --check-grads use the last)")
    ap.add_argument("--fused-loss", choices=["on", "off"], nargs="+", default=["on"],
                    help="train.fused_loss: on = lm_head + loss gradients computed in the loss forward, off = "
                         "checkpoint + recompute; several = one row each, same process (--profile uses the last)")
    ap.add_argument("--chain-tiling", default=None, help="JSON of benchmarks/chain_kernel.py: apply its "
                    "best_tiling to the Triton chain kernels (peagle_train.chain_kernel.TILING)")
    ap.add_argument("--check-grads", action="store_true",
                    help="time nothing: compare the split form's loss and fp32 parameter gradients with the joint "
                         "kernel's on a small grid (--check-n tokens) of --shape, per --compile variant")
    ap.add_argument("--check-n", type=int, default=512, help="tokens of the --check-grads grid")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192, help="loss chunk (grid elements)")
    ap.add_argument("--out", type=str, default="train_step.json")
    ap.add_argument("--dist", choices=["none", "ddp", "fsdp2"], default="none")
    ap.add_argument("--trace", type=str, default=None,
                    help="with --profile: also write the profiled steps' Chrome trace to this path")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 3 steps of the first N (last variant) and report the top-25 kernels")
    ap.add_argument("--sync-debug", action="store_true", help="count host syncs of one extra step (CUDA)")
    ap.add_argument("--reference", choices=["none", "speculators"], default="none",
                    help="also time vLLM speculators' P-EAGLE step for every N in this process "
                         "(benchmarks/speculators_ref.py; needs its wheels) and add the ratio to each row")
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
    matmul_tflops = matmul_rate(device)
    drafter, head, tc = build(args.shape, args.draft_vocab, args.K, device)
    if args.chain_tiling:
        best = json.loads(Path(args.chain_tiling).read_text()).get("best_tiling")
        if not isinstance(best, dict) or not set(best) <= set(CHAIN_TILING):
            raise SystemExit(f"--chain-tiling {args.chain_tiling}: no 'best_tiling' of kernels {sorted(CHAIN_TILING)} "
                             "in it; pass the JSON that benchmarks/chain_kernel.py --out wrote")
        CHAIN_TILING.update({kern: tuple(t) for kern, t in best.items()})
    S_list = args.partitions or ["1"]
    if len(S_list) == 1:
        S_list = S_list * len(args.n)
    variants = {"off": [False], "on": [True], "both": [False, True], "autotune": ["max-autotune"],
                "on+autotune": [True, "max-autotune"]}[args.compile]
    attentions = {"flex": ["flex"], "flex_joint": ["flex_joint"], "both": ["flex_joint", "flex"]}[args.attention]
    if device.type != "cuda" and len(attentions) > 1:  # both kinds would run the same dense SDPA
        print("--attention both on CPU: one sdpa row per N (FlexAttention has no CPU backward)")
        attentions = attentions[-1:]
    if args.check_grads:
        return run_check_grads(args, drafter, head, tc, device, variants)
    rows = []
    lead = world == 1 or torch.distributed.get_rank() == 0
    for N, S_spec in zip(args.n, S_list):
        S, ckpt, plan = resolve_partitions(S_spec, N, args, drafter, device)
        cases = [(c, a, ck, fl == "on") for c in variants for a in attentions
                 for ck in (args.chain_kernel if effective_attention(a, device) == "flex" else ["auto"])
                 for fl in args.fused_loss]
        for comp, attn, ck, fused in cases:
            S_try = S
            ran = effective_attention(attn, device)
            for attempt in range(2 if S_spec == "auto" else 1):
                try:
                    row = run_case(drafter, head, tc, N, args.K, S_try, args.r, args.r_min, args.steps, args.warmup,
                                   device, args.chunk, dist=args.dist, compile=comp, checkpointing=ckpt,
                                   sync_debug=args.sync_debug, attention=attn, chain_kernel=ck, fused_loss=fused)
                except torch.OutOfMemoryError as e:  # report, keep going (auto: one retry with S + 1)
                    row = {"N": N, "S": S_try, "compile": comp, "attention": ran, "fused_loss": fused,
                           "error": f"OOM: {str(e)[:120]}"}
                except Exception as e:  # noqa: BLE001 - one broken variant must not lose the others' numbers
                    row = {"N": N, "S": S_try, "compile": comp, "attention": ran, "fused_loss": fused,
                           "error": f"{type(e).__name__}: {str(e)[:300]}"}
                drafter.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if plan is not None:
                    row["plan"] = dict(plan, S=S, checkpointing=ckpt, oom_retry=attempt > 0)
                if not row.get("error", "").startswith("OOM") or S_spec != "auto" or S_try >= N:
                    break
                if lead:
                    print(json.dumps(row), flush=True)
                S_try += 1
            rows.append(row)
            if lead:
                print(json.dumps(rows[-1]), flush=True)
    attach_joint_speedup(rows)
    if world > 1 and torch.distributed.get_rank() != 0:
        torch.distributed.destroy_process_group()
        return rows
    if args.reference == "speculators":
        from speculators_ref import run_reference  # benchmarks/ is on sys.path when run as a script

        shape = {k: v for k, v in SHAPES[args.shape].items() if k != "draft_vocab"}
        refs = {}
        for N in dict.fromkeys(args.n):
            refs[N] = run_reference(shape, N, args.K, args.r, args.r_min, args.steps, args.warmup, str(device),
                                    drafter.config.draft_vocab_size)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            print(json.dumps({"reference": "speculators", **refs[N]}), flush=True)
        attach_reference(rows, refs)
    profile = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        N0 = args.n[0]
        S0, ck0, _ = resolve_partitions(S_list[0], N0, args, drafter, device)
        ok = [r for r in rows if r["N"] == N0 and "error" not in r and r["compile"] == variants[-1]
              and r.get("attention") == effective_attention(attentions[-1], device)]
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # compile caches are warm from the timed run; the schedule skips the set-up (inputs, optimizer state)
        # and the first step, warms up on the second, and records the next PROFILED_STEPS steps only
        sched = torch.profiler.schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILED_STEPS)
        with torch_profile(activities=acts, schedule=sched) as prof:
            run_case(drafter, head, tc, N0, args.K, S0, args.r, args.r_min, PROFILED_STEPS,
                     PROFILE_WAIT + PROFILE_WARMUP, device, args.chunk, compile=variants[-1], checkpointing=ck0,
                     attention=attentions[-1], on_step=prof.step, chain_kernel=args.chain_kernel[-1],
                     fused_loss=args.fused_loss[-1] == "on")
        step_ms = ok[0]["step_ms"] if ok else None
        table = kernel_table(prof, step_ms or 0.0, PROFILED_STEPS)
        profile = {"N": N0, "S": S0, "compile": variants[-1], "attention": effective_attention(attentions[-1], device),
                   "step_ms": step_ms,
                   "kind": "cuda kernels" if device.type == "cuda" else "cpu ops", "top": table,
                   "timeline": timeline_summary(device_kernels(prof), PROFILED_STEPS) if device.type == "cuda" else None}
        if args.trace:
            prof.export_chrome_trace(args.trace)
        print(f"\ntop {len(table)} {profile['kind']} (N={N0}, compile={variants[-1]}; ms per step, % of the "
              f"timed median step {step_ms and round(step_ms, 1)} ms):")
        for t in table:
            print(f"{t['ms_per_step']:>10.2f} ms {t['pct_of_step'] if t['pct_of_step'] is not None else '-':>7}% "
                  f"{t['calls_per_step']:>8} x  {t['name'][:90]}")
        tl = profile["timeline"]
        if tl:
            print(f"GPU per profiled step: window {tl['window_ms']:.1f} ms, busy {tl['busy_ms']:.1f} ms, "
                  f"idle {tl['idle_ms']:.1f} ms (profiler overhead included)")
            for cat, ms in tl["by_category"].items():
                print(f"{ms:>10.2f} ms  {cat}")
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    meta = {
        "shape": args.shape, "draft_vocab": drafter.config.draft_vocab_size, "K": args.K, "r": args.r,
        "r_min": args.r_min, "trainable_params": trainable, "frozen": ["lm_head"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "precision": "bf16 autocast, fp32 master weights, fused AdamW",
        "flop_formula": "6*P_layers*E + 6*P_fc*N + 4*P_head*E + 12*heads*head_dim*sum_q keys(q)",
        "timing": f"median of {args.steps} steps after {args.warmup} warm-up steps",
        "dist": args.dist, "world_size": world, "compile_variants": variants,
        "attention_variants": [effective_attention(a, device) for a in attentions],
        "chain_tiling": {kern: list(t) for kern, t in CHAIN_TILING.items()},
        "bf16_matmul_tflops": matmul_tflops,
        "note": "per-GPU numbers: each rank trains its own N-token sequence" if world > 1 else "",
    }
    out = {"meta": meta, "rows": rows}
    if profile is not None:
        out["profile"] = profile
    Path(args.out).write_text(json.dumps(out, indent=1))
    hdr = (f"{'N':>7} {'S':>2} {'ckpt':>4} {'compile':>7} {'attn/chain':>12} {'positions':>10} {'step ms':>9} "
           f"{'(min-max)':>15} {'first s':>8} {'pos/s':>9} {'TFLOP/s':>8} {'peak GB':>8}")
    print(f"\n{args.shape}, Vd={meta['draft_vocab']}, K={args.K}, {meta['device']}, {meta['timing']}, "
          f"dist={args.dist} x{world}" + (f", bf16 matmul {matmul_tflops:.0f} TFLOP/s (8192^3, same run)"
                                           if matmul_tflops else ""))
    print(hdr)
    for r in rows:
        comp = {True: "on", False: "off", None: "off"}.get(r.get("compile"), "autotune")
        attn = (r.get("attention", "-") + ("/" + r["chain_kernel"] if r.get("chain_kernel") else "")
                + ("" if r.get("fused_loss", True) else "/recompute"))
        if "error" in r:
            print(f"{r['N']:>7} {r['S']:>2} {'':>4} {comp:>7} {attn:>12} {r['error']}")
            continue
        pk = f"{r['peak_alloc_gb']:.1f}" if r["peak_alloc_gb"] is not None else "-"
        sp = f"  {r['speedup_vs_joint']:.2f}x vs joint" if "speedup_vs_joint" in r else ""
        print(f"{r['N']:>7} {r['S']:>2} {'yes' if r['checkpointing'] else 'no':>4} {comp:>7} {attn:>12} "
              f"{r['positions']:>10} {r['step_ms']:>9.1f} {r['step_ms_min']:>7.1f}-{r['step_ms_max']:<7.1f} "
              f"{r['first_step_s']:>8.1f} {r['positions_per_s']:>9.0f} {r['tflops']:>8.1f} {pk:>8}{sp}")
        if r.get("compile_modes"):
            print(f"{'':>24} compile modes: {r['compile_modes']}")
        if r.get("gc_ms_all"):
            print(f"{'':>24} garbage collector: {sum(r['gc_full_all'])} full collections in "
                  f"{len(r['gc_ms_all'])} timed steps, {max(r['gc_ms_all']):.1f} ms at most in one step")
        if r.get("plan"):
            print(f"{'':>24} plan: {r['plan']}")
        if "ref_status" in r:
            gb = f", {r['ref_peak_gb']:.1f} GB" if r.get("ref_peak_gb") is not None else ""
            ref = (f"{r['ref_step_ms']:.1f} ms{gb}, speedup {r['speedup']:.2f}x (theirs / ours)"
                   if r["speedup"] is not None else r["ref_status"])
            print(f"{'':>24} speculators: {ref}")
    if world > 1:
        torch.distributed.destroy_process_group()
    return rows


def run_check_grads(args, drafter, head, tc, device, variants) -> list[dict]:
    """``--check-grads``: :func:`check_grads` per ``--compile`` variant (eager only on CPU, where the
    compiled flex has no lse); prints a line each and writes ``{"meta", "grad_check"}`` to ``--out``."""
    if device.type != "cuda" and any(variants):
        print("--check-grads on CPU: compiled variants skipped (CPU Inductor has no flex lse); eager only")
        variants = [False]
    results = []
    for comp in variants:
        try:
            res = check_grads(drafter, head, tc, args.check_n, args.K, args.r, args.r_min, device, args.chunk,
                              compile=comp, chain_kernel=args.chain_kernel[-1])
        except Exception as e:  # noqa: BLE001 - report the failing variant, keep the others
            res = {"N": args.check_n, "K": args.K, "compile": comp, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        drafter.zero_grad(set_to_none=True)
        results.append(res)
        if "error" in res:
            print(f"check-grads compile={comp}: {res['error']}")
        else:
            print(f"check-grads {res['compared']} (chain {res['chain_kernel']}), N={res['N']} K={res['K']} E={res['E']} {res['dtype']} "
                  f"compile={comp}: loss rel err {res['loss_rel_err']:.2e}, max grad rel err "
                  f"{res['grad_max_rel_err']:.2e} ({res['worst_param']}), grads finite: {res['grads_finite']}")
    meta = {"shape": args.shape, "K": args.K, "r": args.r, "r_min": args.r_min, "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "note": "per parameter: max|g_split - g_ref| / max|g_ref|; float32, no autocast"}
    Path(args.out).write_text(json.dumps({"meta": meta, "grad_check": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
