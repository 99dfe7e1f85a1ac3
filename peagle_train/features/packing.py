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


def pack(samples: list[dict], tokens: dict, device) -> dict:
    """One packed micro-batch on ``device``: the sequences' features and their :func:`pack_tokens`.

    Args:
        samples: per sequence, ``aux``/``last``/``argmax`` (:meth:`CachedFeatures.get` /
            :meth:`OnlineFeatures.get`). tokens: :func:`pack_tokens` of the same sequences.

    Returns:
        dict with ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``doc_ids [N]`` int64,
        ``aux [N, A*T]``, ``last [N, T]``, ``argmax [N]`` int64, on ``device`` (the token tensors
        copied without blocking the host, see :meth:`~peagle_train.peagle.grid.Grid.to`).

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
    return {k: to_device(v, device, non_blocking=True) for k, v in tokens.items()} | {
        "aux": torch.cat([s["aux"] for s in samples]).to(device),
        "last": torch.cat([s["last"] for s in samples]).to(device),
        "argmax": torch.cat([s["argmax"] for s in samples]).to(device),
    }
