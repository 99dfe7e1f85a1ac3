"""The ``accelerate.Accelerator`` of a run: built for the launch layout, checked against it, and
the process group ended cleanly at exit.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from peagle_train.core.tracking import prepare_trackers
from peagle_train.distributed.layout import Layout
from peagle_train.recipe import RunConfig


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
    import gc

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    from accelerate import PartialState

    # objects of the run left in reference cycles (trainers, FSDP2-sharded modules and the process groups and work
    # objects they hold) are collected now, while the process group and the interpreter are whole, not during
    # finalisation, where a gloo thread still owned by one of them aborts the process (seen with a sharded online
    # target: "terminate called without an active exception" after the last line of main, about 1 run in 10)
    gc.collect()
    state = PartialState()
    state.wait_for_everyone()
    state.destroy_process_group()
    gc.collect()
