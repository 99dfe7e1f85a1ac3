"""Benchmark the trainer's own P-EAGLE training step on synthetic inputs of real shapes.

Every timed step is :meth:`peagle_train.trainer.trainer.Trainer.train_step` -- the step
``peagle-train train`` runs, unchanged -- on a :class:`~peagle_train.trainer.trainer.Trainer` built
directly (as ``tests/integration/test_train.py`` does) from a validated recipe
(``config_from_dict``) whose ``train`` section carries what the flags set (``K``, ``cod_r``,
``cod_r_min``, ``partitions``, ``compile``, ``attention``, ``chain_kernel``, ``fused_loss``,
``prefix_kernel_options``, ``prefix_compiled_apart``, ``loss_chunk_size``, ``activation_checkpointing``,
``mixed_precision``, ``lr``;
micro-batch 1, grad_accum 1, no evaluation, no checkpoints, no trackers). One step is therefore what a training
run pays per optimizer step: the sequence's token lists packed, the COD sample, grid, supervised
count and partition plan built on the CPU (``"host_inputs": "in-step (the trainer's own)"``: the
host work is inside the timed step, as users get it), the features packed onto the device, the
block masks, forward + chunked KL loss + backward per partition segment, grad clip, AdamW, the
LR schedule, and the step's one reduction and device-to-host copy of its statistics. Timed with
CUDA events (wall clock on CPU) around ``trainer.train_step()``: ``--warmup`` untimed steps, then
the median and spread of ``--steps`` timed steps (``first_step_s`` keeps the first step,
compilation included). Prints a table and writes JSON.

Inputs (random, of real shapes; nothing read from disk):

* data: one sequence of ``N`` tokens per rank per step (``micro_batch_size`` 1), token ids uniform
  in ``[0, V - 1)`` (never the mask token ``V - 1``), every token supervised (``loss_mask`` all 1);
* features: :class:`synthetic_features.SyntheticFeatures` (the interface of ``CachedFeatures`` /
  ``OnlineFeatures``: ``aux [N, 3T]``, ``last [N, T]`` bfloat16, ``argmax [N]`` int64, head and
  embeddings ``[V, T]``), drawn once before timing; ``--feature-placement device`` (default) keeps
  them on the GPU as online features are, ``host`` on the CPU as the cache returns them (then the
  step's host-to-device copy is timed). The JSON's ``meta.features`` says which;
* target: a ``transformers.LlamaConfig`` of the :data:`SHAPES` entry (36 layers, aux layers
  ``2, 18, 33``); drafter: 4 layers, ``Vd`` = the shape's draft vocab, mask token ``V - 1``.

What trains is what the trainer trains (the JSON states ``trainable_params`` and ``frozen``): every
drafter parameter, the lm_head included, fp32 master weights, ``train.mixed_precision`` (bf16
autocast by default, ``--mixed-precision``), the trainer's AdamW (torch's default implementation).
``positions_per_s`` / ``tokens_per_s`` come from the step records ``train_step()`` returns
(the trainer's own clock; per GPU), as do ``loss``, ``grad_norm``, ``loss_path`` and
``peak_alloc_gb`` (``peak_mem_gb``: CUDA max allocated since the case's set-up).

FLOP count (per step, stated in the JSON as ``flop_formula``):
    dense = 6 * P_layers * E + 6 * P_fc * N + c_head * P_head * E
    attn  = L * 3 * 4 * n_heads * head_dim * sum_q keys(q)
where ``E`` is the number of grid elements of the step, ``P_layers`` the decoder-layer
parameters, ``P_fc = 3T*H`` (applied to the N real positions), ``P_head = H*Vd`` (``c_head`` = 6
when the lm_head trains, as in the trainer; 4 = forward + input gradient when it is frozen), and
``keys(q)`` is the number of keys query ``q`` may attend (depth-0 prefix + own chain), ``L`` the
drafter's decoder layers (4: each attends over the whole grid); the attention backward is counted as
2x the forward. (Rows written before e77a08a counted the attention of one layer only:
``benchmarks/flop_recount.py`` recounts a committed row.) Embedding lookups are free. The grid is the one
the timed step trained on: a forward pre-hook on the trainer's objective keeps references to the
grids it is called with (:class:`GridProbe`; no device work, no sync); the union of the partition
segments is the step's grid, and their count is the row's ``S``.

Distributed (issue: multi-GPU scaling): launch with ``torchrun --nproc_per_node G`` or
``accelerate launch --multi_gpu --num_processes G`` and pass ``--dist ddp`` or ``--dist fsdp2``.
The Trainer takes its strategy from the launcher's environment
(:func:`peagle_train.distributed.layout.requested_layout`); ``--dist fsdp2`` exports FSDP2's
variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION=2``, one unit per ``DrafterLayer``) where the
launcher did not, and a ``--dist`` that does not match the launch is refused. Every rank trains
its own N-token sequence (global batch = G sequences), gradients are all-reduced (DDP) or
reduce-scattered (FSDP2) once per step, and the table reports per-GPU throughput.

Usage::

    python benchmarks/train_step.py --shape gpt-oss-20b --seq-len 2048 4096 8192 --out bench.json
    python benchmarks/train_step.py --shape tiny --seq-len 256 --steps 3 --warmup 1   # CPU smoke run
    python benchmarks/train_step.py --seq-len 8192 --compile both          # eager vs compiled, same process
    python benchmarks/train_step.py --seq-len 65536 --partitions auto      # S from the trainer (planner)
    python benchmarks/train_step.py --seq-len 8192 --attention both        # split vs joint flex, same process
    python benchmarks/train_step.py --check-grads                          # split ≡ joint flex, fp32 grads

Variants (issue #7): ``--compile off|on|both|autotune|on+autotune`` times each configuration side
by side for every N (``train.compile``: compiled decoder layers + compiled loss chunk; ``autotune``:
``train.compile: max-autotune``, Inductor's autotuning of the kernel configs); each variant is a
fresh Trainer, so ``first_step_s`` includes its compilation (Inductor's caches may be warm from an
earlier variant), and ``compile_modes`` says whether each compiled piece ran fullgraph, with graph
breaks, or fell back to eager. ``--partitions auto`` is ``train.partitions: auto``: the trainer
asks :func:`peagle_train.peagle.planner.partitions_for` for S given the GPU's memory (1 on CPU;
it never turns activation checkpointing on: ``--checkpointing`` does, and ``auto`` then plans with it); the row's ``plan`` records
the trainer's S and the planner's predicted peak, and an out-of-memory step under ``auto`` retries
once with S + 1. ``--profile`` writes the top-25 kernels (name, ms per step, % of step) to the
JSON, and on CUDA the GPU's busy and idle time per profiled step and the kernel time by category
(:func:`timeline_summary`; ``--trace`` also saves the Chrome trace); ``--sync-debug`` counts the
host syncs of one extra trainer step (CUDA only).

Attention (``train.attention``): ``--attention flex`` (default) is the split form (FlexAttention
over the depth-0 prefix + a gathered chain of <= K-1 keys, merged by log-sum-exp), ``flex_joint``
the single-BlockMask kernel of the whole rule, ``flex_flash`` that kernel run by FlashAttention-4 (FlexAttention's
``BACKEND: FLASH``; the ``flash-attn-4`` package; static shapes, as the trainer compiles it), ``both`` times each row with both kinds (joint
first) and adds ``speedup_vs_joint = joint step_ms / split step_ms`` to the split row. Every row
records the ``attention`` it ran: on CPU that is ``sdpa`` whatever was asked (FlexAttention has
no CPU backward). ``--check-grads`` times nothing: on a small grid of the chosen shape (N =
``--check-n``, float32, two documents + padding, bucket-padded) it compares the loss and every
parameter gradient of the split form against the joint kernel (max relative error, per tensor
relative to its largest entry), once per ``--compile`` variant, calling the package's
``PEagleObjective`` directly on the drafter a Trainer built; on CPU the prefix part is computed
densely and the joint side is dense SDPA (no flex backward there).

Prefix kernel options (``train.prefix_kernel_options``): without ``--prefix-kernel-options`` the trainer's
default ``auto`` applies (:func:`peagle_train.kernels.attention.prefix_kernel_options_for`: a tuned forward block on
H100 / H200, FlexAttention's own choice elsewhere); ``--prefix-kernel-options null`` is FlexAttention's own choice
(the baseline), a JSON object sets the options. Rows (and ``--check-grads`` results) record the options that ran,
resolved for the GPU, where the split form's FlexAttention ran; None elsewhere (``flex_joint``, SDPA, CPU).
``--prefix-compiled-apart`` (``train.prefix_compiled_apart``) runs the prefix FlexAttention of compiled rows as its
own compiled kernel behind a graph break; rows record ``prefix_compiled_apart``.

Shapes: ``--dynamic-shapes on`` (``train.dynamic_shapes``, the trainer's default) compiles for any grid length,
``off`` one graph per 1,024-element bucket; ``--divisible-hint off`` times the step without the ``IS_DIVISIBLE``
kernel option the trainer gives FlexAttention on grids whose lengths are multiples of 128
(:func:`peagle_train.kernels.attention.divisible_options`), the reference for what it does under dynamic shapes. Rows
record ``dynamic_shapes`` and ``divisible_hint``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # synthetic_features, speculators_ref

from gpu_clocks import ClockSampler, cuda_device_index, nvidia_smi_index  # noqa: E402
from synthetic_features import PLACEMENTS, SyntheticFeatures  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

import peagle_train.kernels.attention as attention_mod  # noqa: E402
import peagle_train.kernels.loss as loss_mod  # noqa: E402
from peagle_train.core.config import TrainConfig
from peagle_train.core.gc_control import manual_collection  # noqa: E402
from peagle_train.distributed.layout import requested_layout  # noqa: E402
from peagle_train.kernels.attention import (  # noqa: E402
    dense_attention_with_lse,
    device_capability,
    prefix_breaks_layer_graph,
    prefix_kernel_options_for,
    prefix_options_to_run,
)
from peagle_train.kernels.chain_kernel import TILING as CHAIN_TILING  # noqa: E402
from peagle_train.kernels.chain_kernel import resolve as resolve_chain_kernel
from peagle_train.methods.peagle import PEagleObjective  # noqa: E402
from peagle_train.peagle.grid import build_grid, cod_sample, supervised_count  # noqa: E402
from peagle_train.peagle.planner import ShapeParams, predict_peak_bytes  # noqa: E402
from peagle_train.trainer.profiling import (  # noqa: E402,F401  (re-exported: tests/integration/test_benchmarks.py)
    KERNEL_CATEGORIES, device_kernels, kernel_category, kernel_table, timeline_summary)
from peagle_train.trainer.setup import dynamic_shapes_for
from peagle_train.trainer.trainer import Trainer  # noqa: E402

try:  # the recipe's home (RunConfig, config_from_dict); earlier: peagle_train.core.config
    from peagle_train.recipe import config_from_dict  # noqa: E402
except ImportError:  # pragma: no cover - older layout
    from peagle_train.core.config import config_from_dict  # noqa: E402

PROFILED_STEPS = 3  # --profile records this many steps after PROFILE_WAIT skipped and PROFILE_WARMUP warm-up ones
PROFILE_WAIT, PROFILE_WARMUP = 1, 1
TARGET_LAYERS, AUX_LAYER_IDS, DRAFTER_LAYERS = 36, [2, 18, 33], 4
HOST_INPUTS = "in-step (the trainer's own)"
# --dist fsdp2 without `accelerate launch --config_file launch/accelerate/fsdp2.yaml`: what that config exports
FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
             "FSDP_TRANSFORMER_CLS_TO_WRAP": "DrafterLayer"}
DIST_STRATEGY = {"none": "single", "ddp": "ddp", "fsdp2": "fsdp2"}  # --dist → Layout.strategy

SHAPES = {
    # GPT-OSS-20B P-EAGLE drafter: hidden 2880, 64 heads x 64, 8 KV heads, intermediate 7680, vocab 201,088
    "gpt-oss-20b": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        intermediate_size=7680, vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072,
                        rope_theta=150000.0, draft_vocab=32000),
    # the drafters recipes/gpt-oss-20b.yaml and recipes/llama-3.1-8b.yaml build from the shipped real configurations
    # (make_drafter_config: the target's widths, its per-expert intermediate 2,880 for GPT-OSS, Vd = V): the
    # drafter-only step beside the online trainer of benchmarks/real_shape_experiment.sh (issue 22); the tiny one
    # ones are its CPU smoke's (pkg:peagle_train/*-tiny.json, drafter.draft_vocab_size=1024)
    "gpt-oss-20b-recipe": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                               intermediate_size=2880, vocab_size=201088, rms_norm_eps=1e-5,
                               max_position_embeddings=131072, rope_theta=150000.0, draft_vocab=201088),
    "llama-3.1-8b-recipe": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5,
                                max_position_embeddings=131072, rope_theta=500000.0, draft_vocab=128256),
    "gpt-oss-20b-tiny-recipe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    intermediate_size=64, vocab_size=201088, rms_norm_eps=1e-5,
                                    max_position_embeddings=131072, rope_theta=150000.0, draft_vocab=1024),
    "llama-3.1-8b-tiny-recipe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                     intermediate_size=224, vocab_size=128256, rms_norm_eps=1e-5,
                                     max_position_embeddings=131072, rope_theta=500000.0, draft_vocab=1024),
    "smollm2-135m": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         intermediate_size=1536, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         rope_theta=100000.0, draft_vocab=49152),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0, draft_vocab=256),
}


def target_config(shape: str) -> LlamaConfig:
    """The target's HF config of a :data:`SHAPES` entry (``TARGET_LAYERS`` layers; ``draft_vocab`` is the drafter's)."""
    return LlamaConfig(num_hidden_layers=TARGET_LAYERS, **{k: v for k, v in SHAPES[shape].items() if k != "draft_vocab"})


def draft_vocab(args) -> int:
    """``Vd``: ``--draft-vocab``, else the shape's."""
    return args.draft_vocab or SHAPES[args.shape]["draft_vocab"]


def effective_attention(kind: str, device) -> str:
    """The attention a row really runs: ``kind`` on CUDA, ``sdpa`` on CPU (flex has no CPU backward)."""
    return kind if device.type == "cuda" else "sdpa"


#: ``train.prefix_kernel_options`` where ``--prefix-kernel-options`` is not given: the trainer's own default.
DEFAULT_PREFIX_KERNEL_OPTIONS = TrainConfig.model_fields["prefix_kernel_options"].default


def prefix_kernel_options_ran(value: str | dict | None, attention: str, capability: tuple[int, int] | None,
                              head_dim: int, dtype: torch.dtype) -> dict | None:
    """What a row records as ``prefix_kernel_options``: ``value`` (``train.prefix_kernel_options``: ``"auto"``, a
    mapping or None) resolved for a GPU of compute ``capability`` (``(major, minor)``, None off CUDA;
    :func:`~peagle_train.kernels.attention.prefix_kernel_options_for`) where ``attention`` (the kind that ran) is
    the split form's ``flex``; ``auto``'s block only at a ``head_dim`` and attention ``dtype`` that
    :func:`~peagle_train.kernels.attention.auto_block_fits` (the rule the split attention applies,
    :func:`~peagle_train.kernels.attention.prefix_options_to_run`); None for ``flex_joint`` and ``sdpa``, which do not take
    them. Raises ValueError for a string other than ``"auto"``."""
    if attention != "flex":
        return None
    return prefix_options_to_run(prefix_kernel_options_for(value, capability), value == "auto", head_dim, dtype)


def prefix_compiled_apart_ran(value: bool, attention: str, compile: bool | str) -> bool:
    """What a row records as ``prefix_compiled_apart``: ``value`` (``train.prefix_compiled_apart``) where it changes
    how the step runs, i.e. the attention that ran is the split form (``"flex"``) and the layers are compiled
    (``compile`` True or a mode); False elsewhere (an eager layer has no graph to break, SDPA and ``flex_joint`` no
    prefix part; :func:`~peagle_train.kernels.attention.prefix_breaks_layer_graph`). Raises nothing."""
    return bool(compile) and prefix_breaks_layer_graph(attention, value)


def shape_head_dim(shape: str) -> int:
    """The attention head dimension of ``SHAPES[shape]`` (every shape names its ``head_dim``)."""
    return SHAPES[shape]["head_dim"]


def divisible_hint_ran(flag: bool, attention: str, device) -> bool:
    """What a row records as ``divisible_hint``: ``flag`` (``--divisible-hint``, i.e.
    ``peagle_train.kernels.attention.DIVISIBLE_HINT``) where FlexAttention ran on a CUDA device (``attention`` ``flex``
    or ``flex_joint``; :func:`peagle_train.kernels.attention.divisible_options` gives the option there only), else
    False (SDPA, ``flex_flash``'s FlashAttention-4 kernels, a CPU). The grids' lengths are always multiples of 1,024 here. Raises nothing."""
    return bool(flag) and attention in ("flex", "flex_joint") and torch.device(device).type == "cuda"


def train_section(args, *, partitions: int | str, compile: bool | str = False, attention: str = "sdpa",
                  chain_kernel: str = "auto", fused_loss: bool = True, max_steps: int = 1) -> dict:
    """The recipe's ``train`` section of one configuration: the flags' ``train.*`` keys, one
    sequence per micro-batch and per step (``micro_batch_size`` = ``grad_accum`` = 1), no
    evaluation, checkpoints or trackers, ``max_steps`` optimizer steps planned (the LR schedule's length)."""
    return {"method": "peagle", "K": args.K, "cod_r": args.r, "cod_r_min": args.r_min, "partitions": partitions,
            "compile": compile, "attention": attention, "chain_kernel": chain_kernel, "fused_loss": fused_loss,
            "loss_chunk_size": args.chunk, "activation_checkpointing": args.checkpointing,
            "mixed_precision": args.mixed_precision, "lr": args.lr, "features": "cache",
            "micro_batch_size": args.micro_batch, "grad_accum": 1, "max_steps": max_steps, "eval_every": None,
            "save_every": None, "report_to": [], "seed": 0,
            "prefix_kernel_options": getattr(args, "prefix_kernel_options", DEFAULT_PREFIX_KERNEL_OPTIONS),
            "prefix_compiled_apart": getattr(args, "prefix_compiled_apart", False),
            "dynamic_shapes": getattr(args, "dynamic_shapes", "on") == "on"}


def synthetic_data(N: int, vocab_size: int, n_sequences: int, seed: int = 0) -> dict:
    """The trainer's ``data``: ``{"train"|"eval": {"input_ids", "loss_mask"}}`` lists per sequence;
    ``n_sequences`` sequences of ``N`` token ids uniform in ``[0, V - 1)`` (never the mask token
    ``V - 1``), every token supervised; eval holds the first one (never evaluated here)."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab_size - 1, (N,), generator=g).tolist() for _ in range(n_sequences)]
    masks = [[1] * N for _ in range(n_sequences)]
    return {"train": {"input_ids": ids, "loss_mask": masks}, "eval": {"input_ids": ids[:1], "loss_mask": masks[:1]}}


def reset_accelerate_state() -> None:
    """Forget accelerate's process-wide ``AcceleratorState`` / ``GradientState`` (mixed precision, the
    FSDP plugin), keeping ``PartialState`` (device, process group): each Trainer this process builds
    then gets an ``Accelerator`` of its own recipe, and none is left behind for the next user of the
    process (a test session). Call only while no Trainer is in use."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def build_trainer(args, N: int, train: dict, device, out_dir: str) -> Trainer:
    """A :class:`Trainer` of ``--shape`` for sequences of ``N`` tokens: recipe validated by
    ``config_from_dict``, :func:`synthetic_data` (one sequence per rank of the launch) and
    :class:`SyntheticFeatures` (seeded per rank), built as ``run_train`` builds it (strategy from
    the launcher's environment). ``train``: :func:`train_section`."""
    tconf = target_config(args.shape)
    V = tconf.vocab_size
    cfg = config_from_dict({
        "output_dir": out_dir,
        "target": {"name": f"synthetic {args.shape}", "path": "<synthetic: benchmarks/train_step.py>",
                   "aux_layer_ids": AUX_LAYER_IDS},
        "drafter": {"num_layers": DRAFTER_LAYERS, "draft_vocab_size": draft_vocab(args), "mask_token_id": V - 1,
                    "embeddings": args.embeddings, "lm_head": args.lm_head},
        "train": train, "eval": {"k_max": min(args.K, 7)}}, "benchmarks/train_step.py")
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if args.data_from:  # real prepared sequences: the same micro-batches, lengths and COD samples as the trainer's
        data = args.prepared  # read once, in parse_args
        lengths = [len(x) for x in data["train"]["input_ids"]]
        feats = SyntheticFeatures(max(lengths), tconf.hidden_size, V, device, args.feature_placement,
                                  seed=1000 * rank, lengths=lengths)
    else:
        data = synthetic_data(N, V, world * args.micro_batch)
        feats = SyntheticFeatures(N, tconf.hidden_size, V, device, args.feature_placement, seed=1000 * rank)
    reset_accelerate_state()
    with warnings.catch_warnings():  # train.report_to: [] is meant: no trackers
        warnings.filterwarnings("ignore", message="`log_with=", category=UserWarning)
        return Trainer(cfg, data, {"train": feats, "eval": feats}, tconf, AUX_LAYER_IDS)


def prepared_data(run_dir: str, vocab_size: int) -> dict:
    """``--data-from``: the prepared ``data/{train,eval}.safetensors`` of a run folder (token ids and
    loss masks, :func:`peagle_train.features.tokenized.load_prepared`).

    Raises:
        SystemExit: a token id at or above ``vocab_size - 1`` (the shape's vocabulary, whose last id is
            the benchmark's mask token): the data were prepared for a target of another vocabulary
            (names the folder, the largest id and the shape's vocabulary).
    """
    from peagle_train.features.tokenized import load_prepared

    data = load_prepared(Path(run_dir))
    top = max((max(x, default=-1) for split in data.values() for x in split["input_ids"]), default=-1)
    if top >= vocab_size - 1:
        raise SystemExit(f"--data-from {run_dir}: token id {top} in data/ but --shape has a vocabulary of "
                         f"{vocab_size} (id {vocab_size - 1} is the mask token): prepare the data with a target of "
                         "this shape's tokenizer, or pick the matching --shape")
    return data


class GridProbe:
    """The grids a trainer step feeds its objective: a forward pre-hook on the (unwrapped) objective
    keeps a reference to each call's ``grid`` argument (no copy, no device work, no sync).

    With one micro-batch per step, ``len(grids)`` after a step is its number of partition segments S,
    and the union of the segments' elements is the step's grid (:func:`grid_counts`).
    """

    def __init__(self, objective: torch.nn.Module):
        self.grids: list = []
        self._handle = objective.register_forward_pre_hook(lambda module, args: self.grids.append(args[0]))

    def close(self) -> None:
        self._handle.remove()
        self.grids = []


def grid_counts(grids: list, K: int) -> tuple[int, int]:
    """``(E, sum_q keys(q))`` of one micro-batch's grid from the grids its forwards received (the
    whole grid, or its partition segments: an element ``(anchor, depth)`` met in several segments,
    a depth-0 key/value context copy, counts once). ``keys(q)`` = depth-0 prefix
    ``position - depth + 1`` + own chain ``depth`` = ``position + 1`` keys."""
    key = torch.cat([g.anchor * K + g.depth for g in grids]).cpu()
    pos = torch.cat([g.position_ids for g in grids]).cpu()
    uniq, inverse = torch.unique(key, return_inverse=True)
    pos_u = torch.zeros(len(uniq), dtype=pos.dtype).scatter_(0, inverse, pos)  # copies share their position
    depth_u = uniq % K
    return len(uniq), int((pos_u - depth_u + 1).sum() + depth_u.sum())


def alloc_retries(cuda: bool) -> int | None:
    """The CUDA caching allocator's ``num_alloc_retries`` so far (an allocation that failed, freed the
    cached blocks and synchronised, then tried again: a step near the memory limit pays this), ``None``
    without CUDA."""
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0)) if cuda else None


def dense_flops(drafter, E: int, n_tokens: int) -> float:
    """The matrix part of the module docstring's FLOP count (no attention scores), in FLOP (a float):
    ``6 * P_layers * E + 6 * P_fc * n_tokens + c_head * P_head * E`` for ``E`` grid elements and ``n_tokens``
    real positions (``c_head`` 6 with a trainable lm_head, 4 frozen: read from ``requires_grad``)."""
    p_layers = sum(p.numel() for p in drafter.layers.parameters())
    p_fc = drafter.fc.weight.numel()
    p_head = drafter.lm_head.weight.numel()
    c_head = 6 if drafter.lm_head.weight.requires_grad else 4
    return 6 * p_layers * E + 6 * p_fc * n_tokens + c_head * p_head * E


def attention_flops(drafter, keys: int) -> float:
    """The attention part of the module docstring's FLOP count, in FLOP: ``L * 12 * n_heads * head_dim * keys``
    with ``keys`` = sum_q keys(q) and ``L`` = ``len(drafter.layers)`` (every layer attends over the grid;
    forward ``4 * n_heads * head_dim`` per pair, backward twice that)."""
    c = drafter.config
    return len(drafter.layers) * 3 * 4 * c.num_attention_heads * c.head_dim * keys


def flops(drafter, E: int, keys: int, n_tokens: int) -> float:
    """The module docstring's FLOP count of one step over ``E`` grid elements with ``keys`` = sum_q keys(q):
    :func:`dense_flops` + :func:`attention_flops`."""
    return dense_flops(drafter, E, n_tokens) + attention_flops(drafter, keys)


def auto_plan(trainer: Trainer, N: int, args) -> dict:
    """``train.partitions: auto``: the trainer's own S for an ``N``-token micro-batch
    (:meth:`Trainer.partitions`, as its step asks it) and the planner's predicted peak for it."""
    tc = trainer.cfg.train
    S = int(trainer.partitions([N])[0])
    drafter = trainer.acc.unwrap_model(trainer.model).drafter
    peak = predict_peak_bytes(N, S, ShapeParams.from_config(drafter.config), tc.K, tc.cod_r, tc.cod_r_min,
                              **trainer._plan_kwargs(1))  # the trainer's (train.activation_checkpointing included)
    gpu = torch.cuda.get_device_properties(trainer.device).total_memory if trainer.device.type == "cuda" else None
    return {"S": S, "decided_by": "Trainer.partitions (peagle_train.peagle.planner.partitions_for)",
            "checkpointing": tc.activation_checkpointing, "predicted_peak_gb": peak / 2**30,
            "gpu_gb": gpu / 2**30 if gpu else None, "oom_retry": False}


def time_steps(trainer: Trainer, N: int, steps: int, warmup: int, on_step=None, sync_debug: bool = False) -> dict:
    """Time ``warmup + steps`` calls of ``trainer.train_step()`` (one ``N``-token sequence per rank
    and step) → the measured fields of a row.

    Each call is timed with CUDA events recorded just before and after it (synchronised before
    reading), or the wall clock on CPU. The row keeps every timed step (``step_ms_all``), Python's
    garbage-collector time in each (``gc_ms_all``) and its number of full (generation-2)
    collections (``gc_full_all``), from :data:`gc.callbacks`, and the CUDA allocator's retries in each
    (``alloc_retries_all``, :func:`alloc_retries`; ``None`` entries on CPU), so a slow step can be told apart from
    a collection pause, and on CUDA the GPU's clocks, power and throttle reasons over the timed steps
    (``gpu_clocks``, :class:`gpu_clocks.ClockSampler`; None without ``nvidia-smi``), so a slow step can also be told
    apart from a card that slowed down; ``first_step_s`` is the first call (compilation included). ``on_step``:
    called after every step (e.g. ``torch.profiler.profile.step``). ``sync_debug`` (CUDA): one more
    step under :func:`count_syncs`. The step's grid comes from a :class:`GridProbe`.
    """
    gc_now = {"ms": 0.0, "full": 0, "t0": None}

    def gc_clock(phase, info):
        if phase == "start":
            gc_now["t0"] = time.perf_counter()
        elif gc_now["t0"] is not None:
            gc_now["ms"] += (time.perf_counter() - gc_now["t0"]) * 1e3
            gc_now["full"] += info["generation"] == 2
            gc_now["t0"] = None

    cuda = trainer.device.type == "cuda"
    tc = trainer.cfg.train
    objective = trainer.acc.unwrap_model(trainer.model)
    probe = GridProbe(objective)
    gc.callbacks.append(gc_clock)
    collector = manual_collection(tc.gc_every)  # the collector as fit() runs it (train.gc_every)
    collector.__enter__()
    # nvidia-smi samples the card over the timed steps (started at the first of them, so compiling is not in it)
    clocks = ClockSampler(nvidia_smi_index(cuda_device_index(trainer.device))) if cuda else None
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, gc_ms, gc_full, retries, recs, first = [], [], [], [], [], None
        for it in range(warmup + steps):
            if it == warmup and clocks is not None:
                clocks.__enter__()
            r0 = alloc_retries(cuda)
            probe.grids = []
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            gc_now.update(ms=0.0, full=0)
            rec = trainer.train_step()
            if cuda:
                end.record()
                torch.cuda.synchronize()
                dt = start.elapsed_time(end) / 1e3
            else:
                dt = time.perf_counter() - t0
            if it == 0:
                first = dt  # includes compilation
            # progress as it goes (stderr): a run stopped at a time limit still tells how far its steps got
            print(f"train_step.py: N = {N}, step {it + 1} of {warmup + steps}"
                  f"{' (warm-up)' if it < warmup else ''}: {dt:.3f} s", file=sys.stderr, flush=True)
            if it >= warmup:
                times.append(dt)
                gc_ms.append(gc_now["ms"])
                gc_full.append(gc_now["full"])
                retries.append(None if r0 is None else alloc_retries(cuda) - r0)
                recs.append(rec)
            if on_step is not None:
                on_step()
        E, keys = grid_counts(probe.grids, tc.K)  # the last step's grid
        S = len(probe.grids)
    finally:
        if clocks is not None:
            clocks.__exit__(None, None, None)
        collector.__exit__(None, None, None)
        probe.close()
        gc.callbacks.remove(gc_clock)
    drafter = objective.drafter
    world = trainer.acc.num_processes
    n_tokens = recs[-1]["tokens"] // world if "tokens" in recs[-1] else N  # this rank's tokens in the last step
    med, attn = statistics.median(times), attention_flops(drafter, keys)
    flop = dense_flops(drafter, E, n_tokens) + attn  # = flops(drafter, E, keys, n_tokens)
    row = {
        "S": S, "first_step_s": first, "positions": E, "flop": flop, "attention_pairs": keys, "attention_flop": attn,
        "tokens": n_tokens, "step_ms": med * 1e3, "step_ms_min": min(times) * 1e3, "step_ms_max": max(times) * 1e3,
        "step_ms_all": [t * 1e3 for t in times], "gc_ms_all": gc_ms, "gc_full_all": gc_full,
        "alloc_retries_all": retries,  # the caching allocator's retries (freed its cache and tried again) per step
        "gpu_clocks": None if clocks is None else clocks.summary(),  # over the timed steps (CUDA, nvidia-smi)
        # the trainer's own rates (global over ranks, its clock) → per GPU
        "positions_per_s": statistics.median(r["positions_per_s"] for r in recs) / world,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in recs) / world,
        "tflops": flop / med / 1e12,
        "peak_alloc_gb": recs[-1].get("peak_mem_gb"),
        # the loss path the steps took: fused_loss falls back to recompute where the head is sharded (fsdp2)
        "loss_path": recs[-1]["loss_path"], "loss": recs[-1]["loss"], "grad_norm": recs[-1]["grad_norm"],
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "frozen": [n for n, p in drafter.named_parameters() if not p.requires_grad],
    }
    if tc.compile:
        from peagle_train.kernels.compiling import inductor_mode

        row["compile_modes"] = {"layers": [c.mode for c in drafter.compiled_calls()],
                                "loss_chunk": loss_mod.compiled_chunk_loss(
                                    inductor_mode(tc.compile), fused=row["loss_path"] == "fused").mode}
    if sync_debug and cuda:
        row["host_syncs"] = count_syncs(trainer.train_step)
    return row


def bench_case(args, N: int, partitions: int | str, device, *, compile: bool | str = False, attention: str = "flex",
               chain_kernel: str = "auto", fused_loss: bool = True, steps: int | None = None,
               warmup: int | None = None, on_step=None, sync_debug: bool = False, out_dir: str) -> dict:
    """One row: a fresh :class:`Trainer` of this configuration, timed by :func:`time_steps`.

    ``partitions``: ``train.partitions`` (an int or ``"auto"``; ``auto`` rows carry a ``plan``,
    :func:`auto_plan`). ``attention``: as asked (the row records :func:`effective_attention`).
    ``chain_kernel``: ``train.chain_kernel`` of the split form (the row records the one that ran;
    None for ``flex_joint`` and ``sdpa``, which have no chain part). ``fused_loss``:
    ``train.fused_loss``. ``steps`` / ``warmup``: default ``--steps`` / ``--warmup``. An error
    (out of memory included) is recorded in the row (``"error"``) rather than raised, so one
    broken variant does not lose the others' numbers; the trainer is released either way.
    """
    steps = args.steps if steps is None else steps
    warmup = args.warmup if warmup is None else warmup
    ran = effective_attention(attention, device)
    row = {"N": N, "K": args.K, "S": partitions, "compile": compile, "checkpointing": args.checkpointing,
           "attention": ran, "chain_kernel": None, "fused_loss": fused_loss, "host_inputs": HOST_INPUTS,
           # the split form's prefix part takes them (resolved for this GPU); flex_joint and SDPA do not
           "prefix_kernel_options": prefix_kernel_options_ran(
               getattr(args, "prefix_kernel_options", DEFAULT_PREFIX_KERNEL_OPTIONS), ran, device_capability(device),
               shape_head_dim(args.shape), torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32),
           "prefix_compiled_apart": prefix_compiled_apart_ran(getattr(args, "prefix_compiled_apart", False), ran,
                                                              compile),
           "dynamic_shapes": dynamic_shapes_for(ran, getattr(args, "dynamic_shapes", "on") == "on"),
           "divisible_hint": divisible_hint_ran(attention_mod.DIVISIBLE_HINT, ran, device)}
    trainer = None
    try:
        if ran == "flex":
            row["chain_kernel"] = resolve_chain_kernel(chain_kernel, device)  # RuntimeError: triton where it cannot run
        train = train_section(args, partitions=partitions, compile=compile, attention=ran, chain_kernel=chain_kernel,
                              fused_loss=fused_loss, max_steps=warmup + steps + 1)  # + 1: --sync-debug's step
        trainer = build_trainer(args, N, train, device, out_dir)
        if partitions == "auto":
            row["plan"] = auto_plan(trainer, N, args)
            row["S"] = row["plan"]["S"]
        row.update(time_steps(trainer, N, steps, warmup, on_step=on_step, sync_debug=sync_debug))
    except torch.OutOfMemoryError as e:  # report, keep going (auto: the caller retries with S + 1)
        row["error"] = f"OOM: {str(e)[:120]}"
    except Exception as e:  # noqa: BLE001 - one broken variant must not lose the others' numbers
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        trainer = None  # noqa: F841 - release the drafter, optimizer state and features before the next case
        gc.collect()
        reset_accelerate_state()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def launch_layout(dist: str):
    """``--dist`` → the launch layout the Trainer reads from the environment
    (:func:`~peagle_train.distributed.layout.requested_layout`). ``fsdp2`` first exports
    :data:`FSDP2_ENV` where the launcher did not set it.

    Raises:
        SystemExit: the launch is not what ``--dist`` says (e.g. ``--dist ddp`` without ``torchrun``,
            or several processes with ``--dist none``).
    """
    if dist == "fsdp2":
        for k, v in FSDP2_ENV.items():
            os.environ.setdefault(k, v)
    layout = requested_layout()
    if layout.strategy != DIST_STRATEGY[dist]:
        raise SystemExit(f"--dist {dist}: this launch is {layout.strategy} (WORLD_SIZE={layout.world_size}); the "
                         "Trainer takes its strategy from the launcher: use `torchrun --nproc_per_node G ... --dist "
                         "ddp|fsdp2` for several processes, --dist none for one")
    return layout


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


def _dense_prefix(q, k, v, prefix_mask, kernel_options=None):
    """CPU stand-in for the flex prefix part (no flex backward on CPU): dense attention under the
    prefix BlockMask's ``mask_mod`` at every pair → ``(out, lse)`` (``kernel_options``: ignored, as eager
    FlexAttention ignores them)."""
    from torch.nn.attention.flex_attention import create_mask

    mask = create_mask(prefix_mask.mask_mod, 1, 1, q.shape[2], k.shape[2], device=q.device)[0, 0]
    return dense_attention_with_lse(q, k, v, mask)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (0 when both are 0): the error relative to the tensor's scale."""
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def check_grads(drafter, head, tc, N: int, K: int, r: float, r_min: float, device, chunk: int,
                compile: bool = False, seed: int = 0, chain_kernel: str = "auto",
                prefix_kernel_options: str | dict | None = None, prefix_compiled_apart: bool = False) -> dict:
    """Loss and parameter gradients of the split attention vs the joint kernel (float32, no autocast).
    ``chain_kernel``: the split side's chain part (``train.chain_kernel``; recorded as run).
    ``prefix_kernel_options``: the split side's ``train.prefix_kernel_options`` (``"auto"``, a mapping or None;
    CUDA: recorded resolved for the GPU as ``prefix_kernel_options``; the CPU's dense stand-in runs no FlexAttention,
    so None is recorded there). ``prefix_compiled_apart``: the split side's ``train.prefix_compiled_apart`` (recorded
    true only where it ran: a compiled split side, :func:`prefix_compiled_apart_ran`).

    The grid: ``N`` tokens in two documents (60 % / the rest, minus 16 padding tokens), loss mask
    random (p = 0.8), COD with ``r``/``r_min``, padded to the 1024 bucket (padding rows present).
    On CUDA: ``flex`` vs ``flex_joint``. On CPU (no flex backward): split with the prefix part
    computed densely vs ``sdpa`` on the unpadded grid. Returns a JSON-able dict with
    ``loss_rel_err``, ``grad_max_rel_err`` (max over parameters of :func:`max_rel_err`),
    ``worst_param``, ``grads_finite``, ``chain_kernel`` and ``prefix_kernel_options`` (as run).
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
    saved = attention_mod._flex_with_lse
    head32 = head.float()
    try:
        for side, (kind, pad) in sides.items():
            # CPU has no flex backward: the split side's prefix part runs dense; the reference side
            # (SDPA) never calls _flex_with_lse, and the finally restores it
            if side == "split" and not cuda:
                attention_mod._flex_with_lse = _dense_prefix
            obj = PEagleObjective(drafter, head32, loss="kl", chunk_size=chunk, attention=kind,
                                  pad_multiple=pad, compile=compile, chain_kernel=chain_kernel,
                                  prefix_kernel_options=prefix_kernel_options if side == "split" else None,
                                  prefix_compiled_apart=prefix_compiled_apart and side == "split").to(device)
            loss, _ = obj(grid, aux, last, argmax, norm)
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            res[side] = (loss.detach(), grads)
    finally:
        attention_mod._flex_with_lse = saved
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
            "params_compared": len(errs), "chain_kernel": resolve_chain_kernel(chain_kernel, device),
            # the split side's FlexAttention ran on CUDA only (CPU: the dense stand-in)
            "prefix_kernel_options": prefix_kernel_options_ran(
                prefix_kernel_options, "flex", device_capability(device), drafter.config.head_dim, torch.float32)
            if cuda else None,
            "prefix_compiled_apart": prefix_compiled_apart_ran(prefix_compiled_apart, "flex", compile)}


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




def _kernel_options(text: str) -> str | dict | None:
    """``--prefix-kernel-options``: ``auto``, JSON ``null`` (None: FlexAttention's own choice) or a JSON object (the
    recipe validates its values). Raises ``argparse.ArgumentTypeError`` for anything else."""
    if text == "auto":
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not auto nor JSON ({e}): give auto, null or an object such as "
                                         "'{\"fwd_BLOCK_M\": 64}'") from None
    if value is not None and not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, null nor a JSON object of kernel options")
    return value


def _checkpointing_mode(value: str) -> bool | str:
    """``--checkpointing [MODE]``: the values of ``train.activation_checkpointing`` it can turn on: ``true`` (also
    the flag alone) -> True, ``selective``. Raises argparse.ArgumentTypeError for anything else."""
    if value == "true":
        return True
    if value == "selective":
        return value
    raise argparse.ArgumentTypeError(f"--checkpointing takes 'selective' or 'true' (or nothing), not {value!r}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--draft-vocab", type=int, default=None, help="drafter.draft_vocab_size Vd (default: the shape's)")
    ap.add_argument("--seq-len", "--N", dest="n", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--K", type=int, default=8, help="train.K")
    ap.add_argument("--embeddings", choices=["trainable", "frozen"], default="trainable", help="drafter.embeddings")
    ap.add_argument("--lm-head", choices=["trainable", "frozen"], default="trainable",
                    help="drafter.lm_head (frozen: the trainable set of speculators' P-EAGLE reference step)")
    ap.add_argument("--r", type=float, default=0.7, help="train.cod_r")
    ap.add_argument("--r-min", type=float, default=0.2, help="train.cod_r_min")
    ap.add_argument("--partitions", type=str, nargs="+", default=None,
                    help="train.partitions per N: S, or 'auto' (the trainer asks peagle_train.peagle.planner; "
                         "default 1; a single value applies to all N)")
    ap.add_argument("--checkpointing", nargs="?", const=True, default=False, type=_checkpointing_mode,
                    help="train.activation_checkpointing of the decoder layers: --checkpointing (or "
                         "--checkpointing true), --checkpointing selective (the attention kernels' outputs kept, "
                         "peagle_train.kernels.selective_checkpoint)")
    ap.add_argument("--mixed-precision", choices=["bf16", "no"], default="bf16", help="train.mixed_precision")
    ap.add_argument("--lr", type=float, default=1e-4, help="train.lr")
    ap.add_argument("--feature-placement", choices=sorted(PLACEMENTS), default="device",
                    help="where the synthetic features live: device = on the GPU (as online features), host = "
                         "bf16 CPU tensors (as the feature cache returns them; the step's copy to the GPU is timed)")
    ap.add_argument("--compile", choices=["off", "on", "both", "autotune", "on+autotune"], default="off",
                    help="train.compile variants to time side by side (both = eager then compiled; autotune = "
                         "train.compile: max-autotune; on+autotune = compiled then autotuned)")
    ap.add_argument("--attention", choices=["flex", "flex_joint", "flex_flash", "both"], default="flex",
                    help="train.attention on CUDA: flex = split form (prefix kernel + gathered chain), flex_joint = "
                         "one kernel of the whole rule, flex_flash = that kernel run by FlashAttention-4 (BACKEND: "
                         "FLASH; the flash-attn-4 package), both = each row with flex_joint and flex (joint first); "
                         "CPU runs sdpa")
    ap.add_argument("--chain-kernel", choices=["auto", "triton", "torch"], nargs="+", default=["auto"],
                    help="train.chain_kernel of the split form; several = one row each, same process "
                         "(--profile and --check-grads use the last)")
    ap.add_argument("--prefix-kernel-options", type=_kernel_options, default=DEFAULT_PREFIX_KERNEL_OPTIONS,
                    metavar="auto|null|JSON",
                    help="train.prefix_kernel_options: FlexAttention kernel_options of the prefix part: auto (the "
                         "trainer's default: a tuned forward block on H100/H200, FlexAttention's own choice "
                         "elsewhere), null (FlexAttention's own choice: the baseline) or a JSON object such as "
                         "'{\"fwd_BLOCK_M\": 64, \"fwd_BLOCK_N\": 128}'; rows record the options that ran")
    ap.add_argument("--prefix-compiled-apart", action="store_true",
                    help="train.prefix_compiled_apart: with --compile, the prefix FlexAttention runs as its own "
                         "compiled kernel behind a graph break instead of inside each layer's graph; rows record "
                         "prefix_compiled_apart (true only where a compiled split form ran)")
    ap.add_argument("--dynamic-shapes", choices=["on", "off"], default="on",
                    help="train.dynamic_shapes: on (the trainer's default) = compiled for any grid length, off = one "
                         "graph per 1,024-element bucket; rows record dynamic_shapes")
    ap.add_argument("--divisible-hint", choices=["on", "off"], default="on",
                    help="off: FlexAttention without the IS_DIVISIBLE option the trainer gives it on grids whose "
                         "lengths are multiples of 128 (peagle_train.kernels.attention.DIVISIBLE_HINT), to time "
                         "the step without it; rows record divisible_hint")
    ap.add_argument("--fused-loss", choices=["on", "off"], nargs="+", default=["on"],
                    help="train.fused_loss: on = lm_head + loss gradients computed in the loss forward, off = "
                         "checkpoint + recompute; several = one row each, same process (--profile uses the last)")
    ap.add_argument("--chain-tiling", default=None, help="JSON of benchmarks/chain_kernel.py: apply its "
                    "best_tiling to the Triton chain kernels (peagle_train.kernels.chain_kernel.TILING)")
    ap.add_argument("--check-grads", action="store_true",
                    help="time nothing: compare the split form's loss and fp32 parameter gradients with the joint "
                         "kernel's on a small grid (--check-n tokens) of --shape, per --compile variant")
    ap.add_argument("--check-n", type=int, default=512, help="tokens of the --check-grads grid")
    ap.add_argument("--micro-batch", type=int, default=1, help="train.micro_batch_size: sequences packed per "
                    "micro-batch (of --seq-len tokens each, or of the --data-from sequences)")
    ap.add_argument("--data-from", default=None, help="a run folder (output_dir) whose prepared data/ the steps train "
                    "on: the real sequences, lengths and loss masks in the trainer's order, synthetic features; "
                    "--seq-len is then the longest sequence (set automatically)")
    ap.add_argument("--steps", type=int, default=10, help="timed trainer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed trainer steps before them")
    ap.add_argument("--chunk", type=int, default=8192, help="train.loss_chunk_size (grid elements)")
    ap.add_argument("--out", type=str, default="train_step.json")
    ap.add_argument("--dist", choices=sorted(DIST_STRATEGY), default="none",
                    help="the launch's strategy (the Trainer reads it from the launcher's environment; fsdp2 "
                         "exports FSDP2's variables where the launcher did not)")
    ap.add_argument("--trace", type=str, default=None,
                    help="with --profile: also write the profiled steps' Chrome trace to this path")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 3 steps of the first N (last variant) and report the top-25 kernels")
    ap.add_argument("--sync-debug", action="store_true", help="count host syncs of one extra step (CUDA)")
    ap.add_argument("--reference", choices=["none", "speculators"], default="none",
                    help="also time vLLM speculators' P-EAGLE step for every N in this process "
                         "(benchmarks/speculators_ref.py; needs its wheels) and add the ratio to each row")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as run: recorded in the JSON (provenance)
    args.prepared = None
    if args.data_from:  # one row: the prepared sequences decide the lengths
        args.prepared = prepared_data(args.data_from, SHAPES[args.shape]["vocab_size"])
        args.n = [max(len(x) for x in args.prepared["train"]["input_ids"])]
    return args


def apply_chain_tiling(path: str | None) -> None:
    """``--chain-tiling``: the ``best_tiling`` of a ``benchmarks/chain_kernel.py`` JSON into :data:`CHAIN_TILING`.

    Raises:
        SystemExit: the file has no ``best_tiling`` of known kernels (names the file).
    """
    if not path:
        return
    best = json.loads(Path(path).read_text()).get("best_tiling")
    if not isinstance(best, dict) or not set(best) <= set(CHAIN_TILING):
        raise SystemExit(f"--chain-tiling {path}: no 'best_tiling' of kernels {sorted(CHAIN_TILING)} "
                         "in it; pass the JSON that benchmarks/chain_kernel.py --out wrote")
    CHAIN_TILING.update({kern: tuple(t) for kern, t in best.items()})


def run_rows(args, device, variants, attentions, S_list, lead: bool, out_dir: str) -> list[dict]:
    """One row per (N, compile variant, attention, chain kernel, fused loss), each a fresh Trainer;
    an out-of-memory row under ``--partitions auto`` is retried once with the trainer's S + 1."""
    rows = []
    for N, S_spec in zip(args.n, S_list):
        partitions = S_spec if S_spec == "auto" else int(S_spec)
        cases = [(c, a, ck, fl == "on") for c in variants for a in attentions
                 for ck in (args.chain_kernel if effective_attention(a, device) == "flex" else ["auto"])
                 for fl in args.fused_loss]
        for comp, attn, ck, fused in cases:
            kw = dict(compile=comp, attention=attn, chain_kernel=ck, fused_loss=fused, sync_debug=args.sync_debug,
                      out_dir=out_dir)
            row = bench_case(args, N, partitions, device, **kw)
            plan = row.get("plan")
            if row.get("error", "").startswith("OOM") and plan is not None and plan["S"] < N:
                if lead:
                    print(json.dumps(row), flush=True)
                row = bench_case(args, N, plan["S"] + 1, device, **kw)
                row["plan"] = dict(plan, oom_retry=True)
            rows.append(row)
            if lead:
                print(json.dumps(row), flush=True)
    return attach_joint_speedup(rows)


def run_profile(args, device, rows, variants, attentions, S_list, out_dir: str) -> dict:
    """``--profile``: :data:`PROFILED_STEPS` trainer steps of the first N and the last variant under
    ``torch.profiler`` (a fresh Trainer; the schedule skips its set-up and first step, warms up on the
    second); the top-25 kernels and, on CUDA, the GPU timeline (:func:`timeline_summary`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    N0, spec = args.n[0], S_list[0]
    attn = effective_attention(attentions[-1], device)
    ok = [r for r in rows if r["N"] == N0 and "error" not in r and r["compile"] == variants[-1]
          and r.get("attention") == attn]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sched = torch.profiler.schedule(wait=PROFILE_WAIT, warmup=PROFILE_WARMUP, active=PROFILED_STEPS)
    with torch_profile(activities=acts, schedule=sched) as prof:
        prow = bench_case(args, N0, spec if spec == "auto" else int(spec), device, compile=variants[-1],
                          attention=attentions[-1], chain_kernel=args.chain_kernel[-1],
                          fused_loss=args.fused_loss[-1] == "on", steps=PROFILED_STEPS,
                          warmup=PROFILE_WAIT + PROFILE_WARMUP, on_step=prof.step, out_dir=out_dir)
    step_ms = ok[0]["step_ms"] if ok else None
    profile = {"N": N0, "S": prow["S"], "compile": variants[-1], "attention": attn, "step_ms": step_ms,
               "kind": "cuda kernels" if device.type == "cuda" else "cpu ops"}
    if "error" in prow:
        print(f"\nprofile (N={N0}, compile={variants[-1]}): {prow['error']}")
        return dict(profile, error=prow["error"])
    table = kernel_table(prof, step_ms or 0.0, PROFILED_STEPS)
    profile.update(top=table, timeline=timeline_summary(device_kernels(prof), PROFILED_STEPS)
                   if device.type == "cuda" else None)
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
    return profile


def run_references(args, device, rows) -> None:
    """``--reference speculators``: speculators' step for every N (this process), ratios into ``rows``."""
    from speculators_ref import run_reference  # benchmarks/ is on sys.path

    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "draft_vocab"}
    refs = {}
    for N in dict.fromkeys(args.n):
        refs[N] = run_reference(shape, N, args.K, args.r, args.r_min, args.steps, args.warmup, str(device),
                                draft_vocab(args))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps({"reference": "speculators", **refs[N]}), flush=True)
    attach_reference(rows, refs)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def print_table(args, meta: dict, rows: list[dict]) -> None:
    """The rows as a table (per-GPU numbers), with the compile modes, GC, plan and reference lines."""
    world, tf = meta["world_size"], meta["bf16_matmul_tflops"]
    hdr = (f"{'N':>7} {'S':>2} {'ckpt':>4} {'compile':>7} {'attn/chain':>12} {'positions':>10} {'step ms':>9} "
           f"{'(min-max)':>15} {'first s':>8} {'pos/s':>9} {'TFLOP/s':>8} {'peak GB':>8}")
    print(f"\n{args.shape}, Vd={meta['draft_vocab']}, K={args.K}, {meta['device']}, {meta['timing']}, "
          f"dist={meta['dist']} x{world}" + (f", bf16 matmul {tf:.0f} TFLOP/s (8192^3, same run)" if tf else ""))
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
        ck = {True: "yes", False: "no"}.get(r["checkpointing"], "sel")
        print(f"{r['N']:>7} {r['S']:>2} {ck:>4} {comp:>7} {attn:>12} "
              f"{r['positions']:>10} {r['step_ms']:>9.1f} {r['step_ms_min']:>7.1f}-{r['step_ms_max']:<7.1f} "
              f"{r['first_step_s']:>8.1f} {r['positions_per_s']:>9.0f} {r['tflops']:>8.1f} {pk:>8}{sp}")
        if r.get("compile_modes"):
            print(f"{'':>24} compile modes: {r['compile_modes']}")
        if r.get("gc_ms_all"):
            print(f"{'':>24} garbage collector: {sum(r['gc_full_all'])} full collections in "
                  f"{len(r['gc_ms_all'])} timed steps, {max(r['gc_ms_all']):.1f} ms at most in one step")
        if any(r.get("alloc_retries_all") or []):
            print(f"{'':>24} allocator retries per timed step: {r['alloc_retries_all']}")
        if r.get("plan"):
            print(f"{'':>24} plan: {r['plan']}")
        if "ref_status" in r:
            gb = f", {r['ref_peak_gb']:.1f} GB" if r.get("ref_peak_gb") is not None else ""
            ref = (f"{r['ref_step_ms']:.1f} ms{gb}, speedup {r['speedup']:.2f}x (theirs / ours)"
                   if r["speedup"] is not None else r["ref_status"])
            print(f"{'':>24} speculators: {ref}")


def provenance(argv: list[str], script: str = "benchmarks/train_step.py") -> dict:
    """``{"command", "commit"}`` of this run for the JSON: the command line as run (``python SCRIPT ARGV``;
    ``script``: the benchmark's path in the repository, this one by default), and the project's
    commit: ``$PEAGLE_COMMIT`` when set (a tree copied to a GPU machine may carry a stale git folder:
    there the caller names the commit it sent), else ``git rev-parse HEAD`` of the checkout, else None."""
    import subprocess

    commit = os.environ.get("PEAGLE_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                    capture_output=True, text=True, timeout=10, check=True).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"command": " ".join(["python", script, *argv]), "commit": commit}


def main(argv=None):
    """CLI (module docstring): time the trainer's step per configuration; returns the rows
    (``--check-grads``: the gradient-check results)."""
    args = parse_args(argv)
    apply_chain_tiling(args.chain_tiling)
    attention_mod.DIVISIBLE_HINT = args.divisible_hint == "on"  # before any FlexAttention is traced
    layout = launch_layout(args.dist)
    world, lead = layout.world_size, int(os.environ.get("RANK", 0)) == 0
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    S_list = args.partitions or ["1"]
    if len(S_list) == 1:
        S_list = S_list * len(args.n)
    variants = {"off": [False], "on": [True], "both": [False, True], "autotune": ["max-autotune"],
                "on+autotune": [True, "max-autotune"]}[args.compile]
    attentions = {"flex": ["flex"], "flex_joint": ["flex_joint"], "flex_flash": ["flex_flash"],
                  "both": ["flex_joint", "flex"]}[args.attention]
    if device.type != "cuda" and len(attentions) > 1:  # both kinds would run the same dense SDPA
        print("--attention both on CPU: one sdpa row per N (FlexAttention has no CPU backward)")
        attentions = attentions[-1:]
    out_dir = tempfile.mkdtemp(prefix="peagle-train-step-")  # the Trainer's output_dir: nothing is saved there
    try:
        if args.check_grads:
            return run_check_grads(args, device, variants, out_dir)
        matmul_tflops = matmul_rate(device)
        rows = run_rows(args, device, variants, attentions, S_list, lead, out_dir)
        profile = run_profile(args, device, rows, variants, attentions, S_list, out_dir) if args.profile else None
        if not lead:
            return rows
        if args.reference == "speculators":
            run_references(args, device, rows)
        ok = [r for r in rows if "trainable_params" in r]
        meta = {
            **provenance(args.argv),
            "shape": args.shape, "draft_vocab": draft_vocab(args), "K": args.K, "r": args.r, "r_min": args.r_min,
            "micro_batch": args.micro_batch, "data_from": args.data_from,
            "trainable_params": ok[0]["trainable_params"] if ok else None,
            "frozen": ok[0]["frozen"] if ok else None,
            "device": device_name(device), "torch": torch.__version__,
            "step": "peagle_train.trainer.trainer.Trainer.train_step (the trainer's own step, unchanged)",
            "host_inputs": HOST_INPUTS, "features": PLACEMENTS[args.feature_placement],
            "precision": f"train.mixed_precision={args.mixed_precision} (accelerate autocast), fp32 master "
                         "weights, the trainer's AdamW (torch default implementation)",
            "flop_formula": "6*P_layers*E + 6*P_fc*N + c_head*P_head*E + L*12*heads*head_dim*sum_q keys(q) "
                            "(c_head = 6 with a trainable lm_head, 4 frozen)",
            "timing": f"median of {args.steps} steps after {args.warmup} warm-up steps",
            "dist": layout.strategy, "world_size": world, "compile_variants": variants,
            "attention_variants": [effective_attention(a, device) for a in attentions],
            "chain_tiling": {kern: list(t) for kern, t in CHAIN_TILING.items()},
            "bf16_matmul_tflops": matmul_tflops,
            "note": "per-GPU numbers: each rank trains its own N-token sequence" if world > 1 else "",
        }
        out = {"meta": meta, "rows": rows}
        if profile is not None:
            out["profile"] = profile
        Path(args.out).write_text(json.dumps(out, indent=1))
        print_table(args, meta, rows)
        return rows
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        if world > 1:
            from peagle_train.distributed.accelerator import end_process_group

            end_process_group()


def run_check_grads(args, device, variants, out_dir: str) -> list[dict]:
    """``--check-grads``: :func:`check_grads` per ``--compile`` variant (eager only on CPU, where the
    compiled flex has no lse) on the drafter and fp32 target head of a Trainer of ``--shape`` (the
    trainer's own drafter build, untrained); prints a line each and writes ``{"meta", "grad_check"}`` to ``--out``."""
    if device.type != "cuda" and any(variants):
        print("--check-grads on CPU: compiled variants skipped (CPU Inductor has no flex lse); eager only")
        variants = [False]
    train = train_section(args, partitions=1, attention=effective_attention("flex", device))
    trainer = build_trainer(args, args.check_n, train, device, out_dir)
    objective = trainer.acc.unwrap_model(trainer.model)
    drafter, head, tc = objective.drafter, objective.target_head, target_config(args.shape)
    trainer = None  # only its drafter and head are used
    reset_accelerate_state()
    results = []
    for comp in variants:
        try:
            res = check_grads(drafter, head, tc, args.check_n, args.K, args.r, args.r_min, device, args.chunk,
                              compile=comp, chain_kernel=args.chain_kernel[-1],
                              prefix_kernel_options=args.prefix_kernel_options,
                              prefix_compiled_apart=args.prefix_compiled_apart)
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
    meta = {**provenance(args.argv), "shape": args.shape, "K": args.K, "r": args.r, "r_min": args.r_min,
            "torch": torch.__version__, "device": device_name(device),
            "note": "per parameter: max|g_split - g_ref| / max|g_ref|; float32, no autocast"}
    Path(args.out).write_text(json.dumps({"meta": meta, "grad_check": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
