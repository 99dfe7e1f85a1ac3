"""What a training run is built from: the drafter of the recipe's shape, the attention kind for the
device, and the deterministic data order and COD generators (same on every launch of a run)."""
from __future__ import annotations

import functools

import torch

from peagle_train.core.config import ConfigError
from peagle_train.kernels.attention import flash_unavailable_reason
from peagle_train.methods import get_method
from peagle_train.model.drafter import Drafter, make_drafter_config
from peagle_train.recipe import RunConfig


def resolve_attention(kind: str, device: torch.device) -> str:
    """``auto`` → ``flex`` (the split form) on CUDA, ``sdpa`` elsewhere (FlexAttention has no CPU
    backward); ``flex`` / ``flex_joint`` / ``flex_flash`` / ``sdpa`` are returned as given.

    Raises:
        ConfigError: ``flex_flash`` where FlashAttention-4's kernels cannot run on ``device`` (not CUDA, a GPU of
            another generation, the ``flash-attn-4`` package missing:
            :func:`~peagle_train.kernels.attention.flash_unavailable_reason`), naming ``train.attention`` and what
            to do, before anything is compiled."""
    if kind == "flex_flash":
        why = flash_unavailable_reason(device)
        if why is not None:
            raise ConfigError(f"train.attention: flex_flash cannot run here: {why}. Install flash-attn-4 on a "
                              "Hopper or Blackwell GPU, or set train.attention: flex (the default on CUDA)")
    if kind != "auto":
        return kind
    return "flex" if device.type == "cuda" else "sdpa"


def dynamic_shapes_for(attention: str, requested: bool) -> bool:
    """Whether the run compiles for any grid length: ``train.dynamic_shapes`` (``requested``), except that
    ``attention`` ``flex_flash`` compiles one graph per grid bucket (static shapes) whatever it says, with a warning
    where that overrides ``true``: a precaution, since torch's FlashAttention-4 path through FlexAttention
    (``torch/_inductor/kernel/flex/flex_flash_attention.py``) marks its dynamic-shape support as still to be
    confirmed and no dynamic-shape run of it has been measured here. Raises nothing."""
    if attention != "flex_flash" or not requested:
        return requested
    import warnings

    warnings.warn("train.attention=flex_flash compiles one graph per 1,024-element grid bucket (static shapes) "
                  "although train.dynamic_shapes is true: each new bucket length costs a compile; set "
                  "train.dynamic_shapes: false to silence this", stacklevel=2)
    return False


def build_drafter(cfg: RunConfig, target_config, aux_layer_ids, draft_ids, embed, head, target_model=None) -> Drafter:
    """A drafter of the recipe's shape, initialised from the target's embeddings and head rows, and with
    ``drafter.init_layers: target`` its layers from the target's last ones (:func:`init_layers_from_target`;
    ``target_model``: the loaded target, read where its weights are not on disk); the draft method
    (``train.method``) sets its own fields (:meth:`~peagle_train.methods.base.DraftMethod.drafter_fields`).

    Raises:
        ConfigError: ``drafter.init_layers: target`` with target layers that cannot start this drafter."""
    shape = cfg.drafter.shape_fields()
    dcfg = make_drafter_config(target_config, aux_layer_ids=aux_layer_ids, draft_vocab_size=int(draft_ids.numel()),
                               K=cfg.train.K, **shape, **get_method(cfg.train.method).drafter_fields(cfg))
    torch.manual_seed(cfg.train.seed)
    drafter = Drafter(dcfg)
    if embed.shape[1] == dcfg.hidden_size:
        drafter.init_from_target(embed.float(), head.float(), draft_ids)
    else:
        drafter.set_draft_vocab(draft_ids)
    if cfg.drafter.init_layers == "target":
        init_layers_from_target(drafter, cfg, target_config, target_model)
    return drafter


def init_layers_from_target(drafter: Drafter, cfg: RunConfig, target_config, model=None) -> None:
    """``drafter.init_layers: target``: start drafter layer ``i`` from the target's decoder layer ``L - n + i``
    (its last ``n = drafter.num_layers``), ``fc`` and ``norm`` as
    :meth:`~peagle_train.model.drafter.Drafter.init_layers_from_target` says. Weights are read from the
    target's files, or from ``model`` (the loaded target) for a random-weight target. SmolLM2-135M (30 layers)
    and a 4-layer drafter: target layers 26, 27, 28, 29.

    Raises:
        ConfigError: the target's tensors cannot start this drafter (naming the recipe, the layer and the key).
    """
    from peagle_train.core.config import ConfigError
    from peagle_train.features.target import load_target_config, target_layer_tensors

    L, n = target_config.num_hidden_layers, cfg.drafter.num_layers
    ids = list(range(L - n, L))
    try:
        layers, norm = target_layer_tensors(load_target_config(cfg.target)[0], ids, model)
        drafter.init_layers_from_target(layers, norm)
    except ValueError as e:
        raise ConfigError(f"{cfg.source_file}: drafter.init_layers: target: {e}") from None


def adamw_implementation(device_type: str, strategy: str) -> dict:
    """``torch.optim.AdamW`` keyword for its implementation: ``{"fused": True}`` (one kernel over all
    parameters) on CUDA for a single process or DDP, whose parameters are plain CUDA tensors; ``{}``
    (torch's default, the multi-tensor ``foreach`` kernels) elsewhere: FSDP2's sharded parameters and
    DeepSpeed's own partitions. The same update up to rounding. The drafter's AdamW covers every trainable
    parameter, the V x H embedding table included (1.08B parameters at the GPT-OSS-20B shape), so the
    implementation is part of the step's time; speculators' reference step uses the fused one
    (``benchmarks/speculators_ref.py``).

    Example: ``adamw_implementation("cuda", "ddp")`` → ``{"fused": True}``; ``("cpu", "single")`` → ``{}``.
    """
    return {"fused": True} if device_type == "cuda" and strategy in ("single", "ddp") else {}


def step_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """Deterministic per-(step, rank, micro-batch) CPU generator for COD sampling."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + rank) * 101 + micro)


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Deterministic shuffle of ``range(n)`` for an epoch. Cached (every step asks for it, the trainer
    twice with online features: its own micro-batches and the next step's): callers only read it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
