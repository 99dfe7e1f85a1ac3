"""Selective activation checkpointing of a drafter layer (``train.activation_checkpointing: selective``).

Full activation checkpointing (``true``) keeps a layer's inputs only and runs the whole layer again in the
backward, its attention kernels included. At long contexts the attention kernels are most of the step: at
N = 131,072 on an H100 the prefix attention's forward, run a second time under checkpointing, is about 5.9 s of a
33.7 s step (docs/benchmarks.md, "FlexAttention told its grids are divisible"). Selective checkpointing keeps the
outputs of the attention kernels through the backward and recomputes everything else (projections, norms, RoPE,
the MLP, the chain part and the log-sum-exp merge): torch's selective activation checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``), with a policy that saves the outputs of
:func:`attention_ops` and prefers recomputing the rest. Inside ``torch.compile`` (``train.compile``) the checkpoint
is traced into each layer's compiled graph (:meth:`~peagle_train.model.drafter.Drafter._selective_calls`) and
AOTAutograd's partitioner keeps what the policy saves. Eagerly it keeps SDPA's outputs; FlexAttention's eager call
is itself a compiled region the policy cannot see, so without ``train.compile`` its forward runs again as under
full checkpointing (:func:`warn_flex_not_kept` says so once). Not with ``train.prefix_compiled_apart``, whose
graph break inside the checkpoint would leave the layer uncompiled. On one H100 (3026d29, GPT-OSS-20B-shaped
benchmark drafter, N = 131,072, ``benchmarks/train_step.py --checkpointing selective``) every layer compiled as one
graph with FlexAttention kept, 30.1 s a step at S = 3 against 33.6 s under full checkpointing at S = 2
(docs/benchmarks.md).

Memory: per grid element and layer, the attention's q, k, v and output (in the compute dtype) and its log-sum-exp
(``num_heads`` fp32) more than full checkpointing, as the planner counts it after the measured peak
(:meth:`peagle_train.peagle.planner.ShapeParams.act_bytes_per_element`). The gradients are those of full
checkpointing: the saved tensors are the ones the recompute would produce (tests/unit/test_selective_checkpoint.py,
float64).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


@functools.cache
def attention_ops() -> frozenset:
    """The attention kernels whose outputs selective checkpointing keeps: FlexAttention (its higher-order op) and
    the fused SDPA kernels (flash, memory-efficient, cuDNN, the CPU flash kernel), those this torch has.

    Returns:
        A frozenset of ``torch._ops.OpOverload`` / ``HigherOrderOperator``. Raises nothing.
    """
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save what the attention kernels return; let everything else be recomputed."""
    return CheckpointPolicy.MUST_SAVE if func in attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


_CONTEXT_FN = functools.partial(create_selective_checkpoint_contexts, _policy)


def selective_checkpoint(layer, *args):
    """``layer(*args)`` under selective activation checkpointing (module docstring).

    Args:
        layer: a callable module (a drafter decoder layer, or a compiled one), ``args`` its positional inputs.

    Returns:
        what ``layer(*args)`` returns. Raises what it raises.
    """
    return checkpoint(layer, *args, use_reentrant=False, context_fn=_CONTEXT_FN)


@functools.cache
def warn_flex_not_kept() -> None:
    """Warn once per process (the cache) that selective checkpointing without ``train.compile`` recomputes
    FlexAttention (module docstring). Raises nothing."""
    import warnings

    warnings.warn("train.activation_checkpointing=selective without train.compile: FlexAttention's eager call is "
                  "a compiled region the checkpoint policy cannot see, so its forward runs again in the backward "
                  "as with true, while the planner counts its tensors as kept; set train.compile: true",
                  stacklevel=3)


def checkpointing_mode(mode) -> bool | str:
    """``train.activation_checkpointing`` as the drafter takes it: False, True or ``"selective"``.

    Raises:
        ValueError: any other value (names the value and the choices).
    """
    if mode is False or mode is True or mode == "selective":
        return mode
    raise ValueError(f"activation checkpointing must be one of false, true, 'selective'; got {mode!r}")
