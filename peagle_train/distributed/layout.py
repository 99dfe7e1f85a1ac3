"""The distributed strategy, applied in one place: launcher environment → validated layout → Accelerator.

The *strategy* comes from the launcher, never from the recipe; the recipe fixes the
numerics (batch, precision, clipping, schedule), so one recipe runs unchanged on 1 GPU
or 64. ``accelerate launch --config_file launch/accelerate/<x>.yaml`` exports the
strategy as environment variables, which :func:`requested_layout` reads:

=====================================================================  ===============
environment                                                            strategy
=====================================================================  ===============
``ACCELERATE_USE_DEEPSPEED=true`` (+ ``ACCELERATE_DEEPSPEED_CONFIG_FILE``)  ``deepspeed``
``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION=2``                      ``fsdp2``
``WORLD_SIZE > 1`` otherwise (torchrun, srun, ``accelerate --multi_gpu``)  ``ddp``
nothing                                                                ``single``
=====================================================================  ===============

Order of application (the trainer calls these, in this order):

1. :func:`requested_layout` — what the launcher asked for (pure).
2. :func:`validate_layout` — impossible layouts fail before any heavy work, with a
   :class:`~peagle_train.core.config.ConfigError` naming the recipe or DeepSpeed key (pure).
3. :func:`make_accelerator` — the ``Accelerator``, then :func:`check_accelerator`
   refuses a run whose processes do not form one group (ranks that would silently
   train alone, see ``../shared/REAL_INPUTS.md``).
4. :func:`configure_deepspeed` — DeepSpeed's ``"auto"`` values filled from the recipe
   (before ``prepare``); :func:`after_prepare` — ZeRO-3 external parameters.
5. Every step: :func:`grad_sync` + :func:`backward` (gradients synchronised only on the
   last backward of an optimizer step, spec §3), :func:`grad_norm_value`.
6. :func:`full_state_dict` gathers unsharded weights (export, tests);
   :func:`shard_target` FSDP2-shards the frozen target in online mode.
7. :func:`end_process_group` — once, at the end of a process's successful ``main``
   (the ``peagle-train`` console script does it).

CPU hosts (tests; gloo backend): accelerate selects FSDP and DeepSpeed only for
accelerator devices. torch's FSDP2 and DeepSpeed (``DS_ACCELERATOR=cpu``) both run on
CPU, so :func:`make_accelerator` selects them there the way accelerate does on GPUs,
and from ``prepare`` on the code path is accelerate's own on both kinds of host.

Rank data: :func:`rank_batches` deals each optimizer step's sequences to ranks by
length (longest first, each to the least-loaded rank), deterministic for a seed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from peagle_train.core.config import ConfigError, TrainConfig
from peagle_train.recipe import RunConfig

STRATEGIES = ("single", "ddp", "fsdp2", "deepspeed")


@dataclass(frozen=True)
class Layout:
    """What the launcher asked for.

    Attributes:
        strategy: one of :data:`STRATEGIES`.
        world_size: processes in the job (``WORLD_SIZE``).
        zero_stage: DeepSpeed ZeRO stage (0-3), ``None`` for other strategies.
        ds_config: the DeepSpeed JSON as loaded (DeepSpeed only).
        ds_config_file: where it came from (for error messages).
        fsdp_activation_checkpointing: the accelerate config turned on FSDP's own checkpointing.
    """

    strategy: str
    world_size: int = 1
    zero_stage: int | None = None
    ds_config: dict = field(default_factory=dict)
    ds_config_file: str | None = None
    fsdp_activation_checkpointing: bool = False


def _flag(env, key: str) -> bool:
    return str(env.get(key, "false")).lower() in ("1", "true", "yes")


def requested_layout(env=None) -> Layout:
    """Read the strategy the launcher exported (see the module table).

    Args:
        env: mapping of environment variables (default ``os.environ``).

    Raises:
        ConfigError: FSDP version 1 requested; DeepSpeed config file missing or not JSON.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        path = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if path and path.lower() != "none":
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"DeepSpeed config '{path}' (deepspeed_config_file in the accelerate config, "
                                  "env ACCELERATE_DEEPSPEED_CONFIG_FILE) not found")
            try:
                ds = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"DeepSpeed config '{path}': not valid JSON ({e})") from e
            stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        else:  # accelerate config with deepspeed_config.zero_stage and no JSON
            stage = int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
            ds = {"gradient_accumulation_steps": env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")}
            path = "accelerate config (deepspeed_config)"
        return Layout("deepspeed", world, zero_stage=stage, ds_config=ds, ds_config_file=path)
    if _flag(env, "ACCELERATE_USE_FSDP"):
        version = int(env.get("FSDP_VERSION", "1"))
        if version != 2:
            raise ConfigError(f"accelerate config: fsdp_config.fsdp_version={version} (env FSDP_VERSION); peagle_train "
                              "supports FSDP2 only: set fsdp_version: 2 (see launch/accelerate/fsdp2.yaml)")
        return Layout("fsdp2", world, fsdp_activation_checkpointing=_flag(env, "FSDP_ACTIVATION_CHECKPOINTING"))
    return Layout("ddp" if world > 1 else "single", world)


def effective_grad_accum(tc: TrainConfig, world_size: int, source: str = "<recipe>") -> int:
    """Micro-batches per rank per optimizer step: ``train.grad_accum``, or derived from ``train.global_batch_size``.

    Raises:
        ConfigError: ``global_batch_size`` not divisible by ``micro_batch_size × world_size``, or a
            ``grad_accum`` other than 1 that contradicts it.
    """
    if tc.global_batch_size is None:
        return tc.grad_accum
    per = tc.micro_batch_size * world_size
    if tc.global_batch_size % per:
        raise ConfigError(
            f"{source}: train.global_batch_size={tc.global_batch_size} is not divisible by train.micro_batch_size "
            f"({tc.micro_batch_size}) x world size ({world_size}) = {per}: choose a multiple of {per}, or launch a "
            "number of processes that divides it")
    ga = tc.global_batch_size // per
    if tc.grad_accum not in (1, ga):  # 1 = the default, left alone when the global batch is given
        raise ConfigError(
            f"{source}: train.grad_accum={tc.grad_accum} contradicts train.global_batch_size={tc.global_batch_size} "
            f"(= grad_accum {ga} at micro_batch_size {tc.micro_batch_size} x world size {world_size}); set only one")
    return ga


def validate_layout(cfg: RunConfig, layout: Layout, n_train: int | None = None) -> int:
    """Refuse layouts that cannot run as asked, before any heavy work.

    Args:
        cfg: the run. layout: from :func:`requested_layout`.
        n_train: training sequences (``None`` = not known yet, skip that check).

    Returns:
        the effective ``grad_accum`` (see :func:`effective_grad_accum`).

    Raises:
        ConfigError: naming the recipe key (``train.*``) or the DeepSpeed JSON key, and what to do.
    """
    tc, src = cfg.train, cfg.source_file or "<recipe>"
    if layout.strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {layout.strategy!r}; expected one of {STRATEGIES}")
    ga = effective_grad_accum(tc, layout.world_size, src)
    per_step = tc.micro_batch_size * ga * layout.world_size
    if n_train is not None and n_train < per_step:
        raise ConfigError(
            f"{src}: {n_train} training sequences cannot fill one optimizer step of {per_step} (train.micro_batch_size="
            f"{tc.micro_batch_size} x grad_accum {ga} x world size {layout.world_size}); add data "
            "(data.num_conversations) or lower train.micro_batch_size / train.grad_accum / train.global_batch_size")
    if tc.target_sharding == "shard" and layout.strategy != "fsdp2":
        if layout.strategy == "deepspeed" and layout.zero_stage == 3:
            raise ConfigError(
                f"{src}: train.features=online with train.target_sharding=shard under DeepSpeed ZeRO-3 "
                f"({layout.ds_config_file}): the frozen target is not a DeepSpeed engine, so ZeRO-3 cannot partition "
                "it; use train.target_sharding=replicate (every rank holds the target), train.features=cache "
                "(precomputed features), or an FSDP2 launch (launch/accelerate/fsdp2.yaml), which shards it")
        raise ConfigError(f"{src}: train.target_sharding=shard needs an FSDP2 launch (launch/accelerate/fsdp2.yaml); "
                          f"this launch is {layout.strategy}: use train.target_sharding=replicate")
    if layout.strategy == "fsdp2" and layout.fsdp_activation_checkpointing:
        raise ConfigError("accelerate config: fsdp_activation_checkpointing=true (env FSDP_ACTIVATION_CHECKPOINTING) "
                          "would checkpoint the drafter twice; set it to false and use train.activation_checkpointing")
    if layout.strategy == "deepspeed":
        _validate_deepspeed(tc, layout, src, ga)
    return ga


def _validate_deepspeed(tc: TrainConfig, layout: Layout, src: str, ga: int) -> None:
    ds, f = layout.ds_config, layout.ds_config_file
    gas = ds.get("gradient_accumulation_steps", "auto")
    if gas not in ("auto", 1, "1"):
        raise ConfigError(
            f"{f}: gradient_accumulation_steps={gas}: DeepSpeed's own accumulation rescales the loss and steps at "
            f"its own boundaries, but peagle_train accumulates micro-batches x partition segments itself "
            f"(train.grad_accum={ga} x train.partitions={tc.partitions}) under one global loss normalisation; "
            "set it to \"auto\" (or 1) and use train.grad_accum / train.global_batch_size")
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ConfigError(f"{f}: remove the '{key}' section: peagle_train builds AdamW from train.lr/betas/"
                              "weight_decay and the cosine schedule from train.warmup_ratio/min_lr_ratio")
    clip = ds.get("gradient_clipping", "auto")
    if clip != "auto" and float(clip) != tc.grad_clip:
        raise ConfigError(f"{f}: gradient_clipping={clip} differs from {src}: train.grad_clip={tc.grad_clip}; "
                          "set it to \"auto\" (filled from train.grad_clip)")
    mb = ds.get("train_micro_batch_size_per_gpu", "auto")
    if mb != "auto" and int(mb) != tc.micro_batch_size:
        raise ConfigError(f"{f}: train_micro_batch_size_per_gpu={mb} differs from {src}: train.micro_batch_size="
                          f"{tc.micro_batch_size}; set it to \"auto\"")
    if str(ds.get("fp16", {}).get("enabled", False)).lower() == "true":
        raise ConfigError(f"{f}: fp16.enabled=true is not supported; use bf16 via train.mixed_precision=bf16")
    bf16 = str(ds.get("bf16", {}).get("enabled", "auto")).lower()
    if bf16 != "auto" and (bf16 == "true") != (tc.mixed_precision == "bf16"):
        raise ConfigError(f"{f}: bf16.enabled={bf16} contradicts {src}: train.mixed_precision={tc.mixed_precision}; "
                          "set bf16.enabled to \"auto\" (filled from train.mixed_precision)")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"{f}: zero_optimization.stage={layout.zero_stage} must be 0..3")
    # 'auto' may split a sequence: count it as more than one backward (partitions > 1 is peagle-only, TrainConfig)
    auto = tc.partitions == "auto"
    backwards = ga * (2 if auto else tc.partitions)
    if layout.zero_stage == 3 and backwards > 1 and layout.world_size > 1:
        raise ConfigError(
            f"{f}: ZeRO-3 with {'more than one backward pass' if auto else f'{backwards} backward passes'} per "
            "optimizer step "
            f"(train.grad_accum={ga} x "
            f"train.partitions={tc.partitions}): ZeRO-3 partitions gradients at every backward and deadlocked "
            "with accumulation boundaries set by the trainer (2 ranks, DeepSpeed 0.19); use one backward per step "
            "(grow train.micro_batch_size instead, train.partitions=1), or ZeRO-2 / FSDP2 for partitioned "
            "sequences")
