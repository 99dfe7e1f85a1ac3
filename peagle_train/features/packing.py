"""Packing of sequences into one micro-batch: concatenated tokens, loss masks and document ids,
and their target features moved to the training device.
"""
from __future__ import annotations

import torch

from peagle_train.core.device import to_device


def pack_tokens(input_ids: list[list[int]], loss_masks: list[list[int]]) -> dict:
    """The token side of a packed micro-batch, on the CPU (where the COD sample and the grid are built).

    Returns:
        dict with ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``doc_ids [N]`` int64 (sequence ``i``
        of the list is document ``i``).
    """
    return {
        "input_ids": torch.tensor([t for s in input_ids for t in s], dtype=torch.long),
        "loss_mask": torch.tensor([m for s in loss_masks for m in s], dtype=torch.bool),
        "doc_ids": torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(input_ids)]),
    }


def concat_features(samples: list[dict], tokens: dict, pin: bool = False) -> dict:
    """The features of a micro-batch's sequences concatenated in packing order, where they are (CPU for a
    cache read, the target's device online); ``pin``: CPU tensors go to pinned memory, so the later copy to
    the GPU does not block (the trainer does this ahead, on its worker thread).

    Args:
        samples: per sequence, ``aux``/``last``/``argmax`` (:meth:`CachedFeatures.get` /
            :meth:`OnlineFeatures.get`). tokens: :func:`pack_tokens` of the same sequences.

    Returns:
        ``{"aux": [N, A*T], "last": [N, T], "argmax": [N] int64}``.

    Raises:
        ValueError: the features and the tokens do not hold the same number of tokens (per sequence,
            or in total), naming both counts: features cached for other token lists (re-run
            ``peagle-train cache``).
    """
    n_feat = [s["aux"].shape[0] for s in samples]  # shapes only: no device sync
    n_tok = torch.bincount(tokens["doc_ids"], minlength=len(samples)).tolist()  # the token side is on the CPU
    if n_feat != n_tok or any(s["last"].shape[0] != n or s["argmax"].shape[0] != n for s, n in zip(samples, n_feat)):
        raise ValueError(f"pack: the features hold {sum(n_feat)} tokens (per sequence {n_feat}, aux rows) but the "
                         f"token lists hold {sum(n_tok)} (per sequence {n_tok}), or last/argmax rows differ from aux "
                         "rows; the feature cache does not match the prepared data: re-run `peagle-train cache`")
    out = {k: torch.cat([s[k] for s in samples]) for k in ("aux", "last", "argmax")}
    if pin:
        out = {k: v.pin_memory() if v.device.type == "cpu" else v for k, v in out.items()}
    return out


def pack(samples: list[dict] | dict, tokens: dict, device) -> dict:
    """One packed micro-batch on ``device``: the sequences' features and their :func:`pack_tokens`.

    Args:
        samples: per sequence, ``aux``/``last``/``argmax`` (:meth:`CachedFeatures.get` /
            :meth:`OnlineFeatures.get`), or their :func:`concat_features` already.
        tokens: :func:`pack_tokens` of the same sequences.

    Returns:
        dict with ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``doc_ids [N]`` int64,
        ``aux [N, A*T]``, ``last [N, T]``, ``argmax [N]`` int64, on ``device``, every CPU tensor copied
        without blocking the host (:func:`~peagle_train.core.device.to_device`).

    Raises:
        ValueError: see :func:`concat_features`.
    """
    feats = samples if isinstance(samples, dict) else concat_features(samples, tokens)
    return {k: to_device(v, device, non_blocking=True) for k, v in (tokens | feats).items()}
