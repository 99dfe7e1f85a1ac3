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
   :class:`~peagle_train.config.ConfigError` naming the recipe or DeepSpeed key (pure).
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

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ConfigError, RunConfig, TrainConfig

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


# -- the Accelerator ------------------------------------------------------------------------------------

def _wandb_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        import netrc

        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def prepare_trackers(report_to: list[str], logging_dir: str | Path) -> list[str]:
    """Trackers for ``Accelerator(log_with=...)``; wandb is imported lazily and runs offline without credentials.

    Sets ``WANDB_MODE=offline`` (unless already set) when neither ``WANDB_API_KEY`` nor a
    ``~/.netrc`` entry for ``api.wandb.ai`` exists, and ``WANDB_DIR`` to ``logging_dir``.

    Raises:
        ConfigError: ``train.report_to`` names wandb and the package is not installed.
    """
    if "wandb" in report_to:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("train.report_to includes 'wandb' but the wandb package is not installed: "
                              "pip install 'peagle-train[wandb]' (or remove wandb from train.report_to)") from None
        if not _wandb_credentials():
            os.environ.setdefault("WANDB_MODE", "offline")
        Path(logging_dir).mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("WANDB_DIR", str(logging_dir))
    return list(report_to)


def make_accelerator(cfg: RunConfig, layout: Layout, project_dir: str | Path):
    """Build the ``Accelerator`` for ``layout`` (mixed precision and trackers from the recipe), then check it.

    On CUDA, accelerate reads the strategy from the launcher's environment itself. On a
    CPU host: DDP/single use ``cpu=True`` (gloo); DeepSpeed uses the gloo backend with
    ``DS_ACCELERATOR=cpu``; FSDP2 is selected as accelerate would select it on GPUs.

    Raises:
        ConfigError: wandb requested but missing (:func:`prepare_trackers`).
        RuntimeError: see :func:`check_accelerator`.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    tc = cfg.train
    # step_scheduler_with_optimizer=False: one scheduler step per optimizer step. accelerate's default steps it
    # num_processes times per call (it assumes a schedule counted in per-process batches), which would run the
    # cosine schedule world-size times too fast here: total_steps already counts global optimizer steps.
    kw = dict(mixed_precision=tc.mixed_precision, log_with=prepare_trackers(tc.report_to, Path(project_dir)),
              project_dir=str(project_dir), step_scheduler_with_optimizer=False)
    if torch.cuda.is_available():
        acc = Accelerator(**kw)
    elif layout.strategy == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        acc = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kw)
    else:
        acc = Accelerator(cpu=True, **kw)
        if layout.strategy == "fsdp2":
            _select_fsdp2(acc)
    if layout.strategy == "fsdp2" and tc.mixed_precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # bf16 compute, fp32 sharded master weights, fp32 gradient reduce-scatter (accelerate defaults to bf16 reduce)
        acc.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                            reduce_dtype=torch.float32)
    check_accelerator(acc, layout)
    return acc


def _select_fsdp2(acc) -> None:
    """Select FSDP2 on a CPU host exactly as accelerate's ``AcceleratorState`` does on GPUs (plugin from env)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_* set by `accelerate launch`
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    # both shared states: AcceleratorState() re-copies PartialState's fields whenever it is constructed
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin


def check_accelerator(acc, layout: Layout) -> None:
    """Refuse an Accelerator that does not realise ``layout`` (e.g. ranks that would each train alone).

    Raises:
        RuntimeError: process count or distributed type differs from what the launcher asked for.
    """
    from accelerate.utils import DistributedType as D

    if acc.num_processes != layout.world_size:
        raise RuntimeError(
            f"the launcher started WORLD_SIZE={layout.world_size} processes but accelerate sees {acc.num_processes}: "
            "each rank would train alone. On a CPU host launch with `torchrun --nproc_per_node N` or "
            "`accelerate launch --multi_gpu --num_processes N` (not `--cpu`, which runs one process); see "
            "launch/README.md")
    # one process may still come up as MULTI_GPU/MULTI_CPU (e.g. torchrun --nproc_per_node 1)
    want = {"single": {D.NO, D.MULTI_GPU, D.MULTI_CPU}, "ddp": {D.MULTI_GPU, D.MULTI_CPU}, "fsdp2": {D.FSDP},
            "deepspeed": {D.DEEPSPEED}}
    if acc.distributed_type not in want[layout.strategy]:
        raise RuntimeError(f"launcher asked for {layout.strategy} but accelerate set up {acc.distributed_type}; "
                           "check the accelerate config (launch/accelerate/) and the environment")
    if layout.strategy == "fsdp2" and not acc.is_fsdp2:
        raise RuntimeError("accelerate set up FSDP1; set fsdp_version: 2 in the accelerate config")


def configure_deepspeed(acc, tc: TrainConfig) -> None:
    """Fill DeepSpeed's ``"auto"`` values from the recipe (call before ``prepare``; no-op otherwise).

    ``train_micro_batch_size_per_gpu`` ← ``train.micro_batch_size``; ``gradient_accumulation_steps`` ← 1
    (the trainer accumulates, see :func:`backward`); ``gradient_clipping`` ← ``train.grad_clip``.
    """
    from accelerate.utils import DistributedType

    if acc.distributed_type != DistributedType.DEEPSPEED:
        return
    c = acc.state.deepspeed_plugin.deepspeed_config
    c["train_micro_batch_size_per_gpu"] = tc.micro_batch_size
    c["gradient_accumulation_steps"] = 1
    c["train_batch_size"] = tc.micro_batch_size * acc.num_processes
    if c.get("gradient_clipping", "auto") == "auto":
        c["gradient_clipping"] = tc.grad_clip


def zero_stage(acc) -> int | None:
    """DeepSpeed ZeRO stage of a prepared accelerator, else ``None``."""
    from accelerate.utils import DistributedType

    if acc.distributed_type != DistributedType.DEEPSPEED:
        return None
    return int(acc.state.deepspeed_plugin.zero_stage)


def after_prepare(acc, model) -> None:
    """ZeRO-3: register the drafter's ``mask_hidden`` (read outside ``Drafter.forward``) as used by the root forward."""
    if zero_stage(acc) == 3:
        import deepspeed

        inner = model.module
        if hasattr(inner.drafter, "mask_hidden"):
            deepspeed.zero.register_external_parameter(inner, inner.drafter.mask_hidden)


# -- per step -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def grad_sync(acc, model, sync: bool):
    """Context for one forward + backward; ``sync=False`` for all but the last backward of an optimizer step.

    DDP/FSDP2: ``no_sync`` (gradients accumulate locally, one all-reduce / reduce-scatter on the
    last backward, spec §3). DeepSpeed: nothing here, the boundary is passed to :func:`backward`.
    """
    from accelerate.utils import DistributedType

    if sync or acc.distributed_type == DistributedType.DEEPSPEED:
        yield
    else:
        with acc.no_sync(model):
            yield


def backward(acc, loss: torch.Tensor, sync: bool) -> None:
    """Backward of one micro-batch segment.

    The loss is already normalised by the global supervised count, so nothing rescales it:
    accelerate runs with ``gradient_accumulation_steps=1``. Under DeepSpeed the engine learns the
    accumulation boundary from ``sync`` and, on the last backward, clips (``gradient_clipping``),
    steps the optimizer and the scheduler, and zeroes the gradients.
    """
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.DEEPSPEED:
        acc.deepspeed_engine_wrapped.backward(loss, sync_gradients=sync)
    else:
        acc.backward(loss)


def reduce_values(acc, values: list, reduction: str, dtype: torch.dtype = torch.float64) -> list:
    """Reduce a short list of host numbers over ranks (``accelerate``'s ``reduce``: ``"sum"`` /
    ``"mean"`` / ``"max"``...) and return them on the host, as Python numbers of ``dtype``'s kind.
    With one process the values come back as they are: no device round trip, no host sync."""
    if acc.num_processes == 1:
        return list(values)
    out = acc.reduce(torch.tensor(values, dtype=dtype, device=acc.device), reduction=reduction)
    return out.tolist()


def end_process_group() -> None:
    """End a successful multi-process run: wait for every rank, then destroy the default process group.

    Without it the process group is torn down during interpreter finalisation, where gloo's
    worker threads can still hold work objects: a rank whose work is done then aborts with
    ``terminate called without an active exception`` (SIGABRT, non-zero exit), at random
    (pytorch issue #190489; torch's "Shutdown" docs ask for ``destroy_process_group`` near the
    end of ``main``). Call it once per process and only on success: a rank that failed must not
    wait at the barrier for ranks that never arrive (torchtitan PR #1342). Uses accelerate's
    ``PartialState.destroy_process_group``. No-op when no process group exists (one process).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from accelerate import PartialState

    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()


def grad_norm_value(norm) -> float:
    """The pre-clip global gradient norm as a float (accepts a tensor, an FSDP2 ``DTensor``, a float or ``None``)."""
    if norm is None:
        return float("nan")
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(acc, model) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of the prepared ``model`` on every rank (CPU tensors, cloned).

    Collective under FSDP2 and ZeRO-3: call it on every rank.
    """
    from torch.distributed.tensor import DTensor

    if zero_stage(acc) == 3:
        import deepspeed

        module = model.module
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    out = {}
    for k, v in acc.unwrap_model(model).state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def shard_target(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2-shard a frozen Hugging Face target: every ``_no_split_modules`` block, then the root.

    Forward passes all-gather one block at a time (``reshard_after_forward=True``), so every rank
    must run the same number of target forwards (the trainer guarantees it).

    Raises:
        ValueError: the model names no ``_no_split_modules`` (nothing to shard per block).
    """
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot shard it per block; "
                         "use train.target_sharding=replicate")
    for block in blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


# -- data per rank --------------------------------------------------------------------------------------

def rank_batches(chunk: list[int], lengths: list[int], world: int, rank: int, micro_batch_size: int,
                 grad_accum: int, balance: bool = True) -> list[list[int]]:
    """This rank's micro-batches (sequence indices) for one optimizer step.

    Args:
        chunk: the step's ``world × grad_accum × micro_batch_size`` sequence indices, in shuffled order.
        lengths: token length of every sequence (indexed by sequence id).
        world, rank: process group. micro_batch_size, grad_accum: per rank.
        balance: deal by length (longest first, each to the rank with the fewest tokens that still has
            room; ties → lower rank) instead of contiguous slices of ``chunk``.

    Returns:
        ``grad_accum`` lists of ``micro_batch_size`` indices. Over all ranks every index of
        ``chunk`` appears exactly once; the result depends only on the arguments.

    Example: chunk ``[0, 1, 2, 3]``, lengths ``[10, 40, 30, 20]``, world 2, one sequence per
    micro-batch, 2 micro-batches: by length 1(40) → r0, 2(30) → r1, 3(20) → r1 (r1 has 30 < 40),
    0(10) → r0; rank 0 gets ``[[1], [0]]`` (50 tokens), rank 1 ``[[2], [3]]`` (50 tokens).
    """
    per_rank = micro_batch_size * grad_accum
    if len(chunk) != per_rank * world:
        raise ValueError(f"chunk has {len(chunk)} indices, expected {per_rank * world}")
    if balance:
        load, mine_of = [0] * world, [[] for _ in range(world)]
        for i in sorted(chunk, key=lambda j: -lengths[j]):  # stable: ties keep the shuffled order
            r = min((r for r in range(world) if len(mine_of[r]) < per_rank), key=lambda r: (load[r], r))
            mine_of[r].append(i)
            load[r] += lengths[i]
        mine = mine_of[rank]
    else:
        mine = chunk[rank * per_rank:(rank + 1) * per_rank]
    return [mine[m * micro_batch_size:(m + 1) * micro_batch_size] for m in range(grad_accum)]
