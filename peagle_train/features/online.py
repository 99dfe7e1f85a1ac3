"""Online features: the live target computes each micro-batch's aux hidden states, final hidden
state and greedy token in the trainer (``train.features: online``); same interface as the cache.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def iter_target_features(target, sequences: list[list[int]], batch_size: int):
    """Yield per-sequence feature dicts by running the target in right-padded batches.

    Yields:
        ``{"aux": [n, A*T], "last": [n, T], "argmax": [n] int64}`` per sequence (target dtype,
        target device), in input order.
    """
    dev = target.device
    for s in range(0, len(sequences), batch_size):
        batch = sequences[s:s + batch_size]
        n = max(len(x) for x in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        att = torch.zeros(len(batch), n, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            att[i, : len(x)] = 1
        f = target.features(ids.to(dev), att.to(dev))
        for i, x in enumerate(batch):
            yield {"aux": f["aux"][i, : len(x)], "last": f["last"][i, : len(x)], "argmax": f["argmax"][i, : len(x)]}


class OnlineFeatures:
    """The frozen target runs inside the trainer (no grad), behind the cache's interface.

    Args:
        target: :class:`~peagle_train.features.target.Target`. sequences: token id lists.
        batch_size: sequences per target forward inside one ``get``.
    """

    def __init__(self, target, sequences: list[list[int]], batch_size: int = 8):
        self.target, self.sequences, self.batch_size = target, sequences, batch_size

    def __len__(self) -> int:
        return len(self.sequences)

    def get(self, indices: list[int]) -> list[dict]:
        """Features of ``indices`` computed now: dicts as :meth:`CachedFeatures.get` (target dtype/device)."""
        return list(iter_target_features(self.target, [self.sequences[i] for i in indices], self.batch_size))

    def target_head(self) -> torch.Tensor:
        """The target head ``[V, T]`` (target dtype)."""
        return self.target.lm_head_weight().detach()

    def target_embeddings(self) -> torch.Tensor:
        """The target input embeddings ``[V, T]`` (target dtype)."""
        return self.target.model.get_input_embeddings().weight.detach()
