"""Hooks the trainer calls so one loop serves DDP, FSDP2 and DeepSpeed ZeRO: DeepSpeed's
config, gradient synchronisation on the last backward only, collectives, gathered state dicts
and a sharded online target.
"""
from __future__ import annotations

import contextlib

import torch

from peagle_train.core.config import TrainConfig


def configure_deepspeed(acc, tc: TrainConfig, file_config: dict) -> None:
    """Fill DeepSpeed's ``"auto"`` values from the recipe (call before ``prepare``; no-op otherwise).

    ``train_micro_batch_size_per_gpu`` ← ``train.micro_batch_size``; ``gradient_accumulation_steps`` ← 1
    (the trainer accumulates, see :func:`backward`); ``gradient_clipping`` ← ``train.grad_clip``.

    ``train.mixed_precision: bf16`` with the file's ``bf16.enabled`` left ``"auto"`` (or absent) and no
    ``torch_autocast`` section (``file_config``: the JSON as written, :attr:`Layout.ds_config`; accelerate has
    already turned the live config's ``"auto"`` into ``true`` when this runs): the run gets the single process's
    numerics, fp32 parameters, optimizer and gradient reduction with the forward under bf16 autocast
    (DeepSpeed's ``torch_autocast``, entered by its engine's forward; ``lower_precision_safe_modules: []`` keeps
    the gradients' all-reduce in fp32, as FSDP2's policy here does), instead of DeepSpeed's bf16 mode.
    accelerate turns its own autocast off under DeepSpeed, so in bf16 mode the drafter runs in bf16 weights and
    every matmul on other tensors in fp32, e.g. the loss's target logits (``[tokens, H] x [H, V]`` per chunk)
    as an fp32 GEMM; ZeRO-2 in bf16 mode made 0.69x the plain run's tokens/s at micro-batch 64 on an H100
    (docs/benchmarks.md, f5b8066). A file that sets ``bf16.enabled: true`` keeps DeepSpeed's bf16 mode; one with
    its own ``torch_autocast`` section is left as written (with ``bf16.enabled: "auto"``, accelerate's ``true``:
    bf16 weights under that autocast).
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
    bf16_as_written = str((file_config.get("bf16") or {}).get("enabled", "auto")).lower()
    if tc.mixed_precision == "bf16" and bf16_as_written == "auto" and "torch_autocast" not in file_config:
        c["bf16"] = {**(c.get("bf16") or {}), "enabled": False}
        c["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}


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
