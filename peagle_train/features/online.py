"""Online features: the live target computes each micro-batch's aux hidden states, final hidden
state and greedy token in the trainer (``train.features: online``); same interface as the cache.
"""
from __future__ import annotations

import torch

from peagle_train.core.device import to_device


@torch.no_grad()
def iter_target_features(target, sequences: list[list[int]], batch_size: int):
    """Yield per-sequence feature dicts by running the target in right-padded batches.

    The target runs causally with no attention mask: with the padding on the right, a real position
    attends only to earlier positions, all real, so its features are those of the sequence alone (the
    padded positions' outputs are dropped). Without a mask, SDPA takes its flash kernel and grouped
    key/value heads as they are; transformers' masked SDPA path expands them and takes the
    memory-efficient kernel with a mask (25 ms of a 335-ms SmolLM2 step at micro-batch 64,
    docs/benchmarks.md). Position ids are 0, 1, ... per row either way.

    The ids go to the device through pinned memory without blocking: a copy from pageable memory makes
    PyTorch synchronise the stream first, so the host would wait for all queued work (the trainer's
    prefetched forward launches right after the backward is queued, and its three forwards of a SmolLM2
    micro-batch would each wait for the one before: the H200 profile of b04ed9d showed the GPU idle
    121 of 290 ms per step, docs/benchmarks.md "Where the online step's time goes"). Holds for attention whose
    output at a position depends only on earlier positions (causal, sliding-window) and per-token
    layers (MLP, mixture of experts without capacity limits), i.e. every decoder-only target here.

    Yields:
        ``{"aux": [n, A*T], "last": [n, T], "argmax": [n] int64}`` per sequence (target dtype,
        target device), in input order.
    """
    dev = target.device
    for s in range(0, len(sequences), batch_size):
        batch = sequences[s:s + batch_size]
        n = max(len(x) for x in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
        f = target.features(to_device(ids, dev, non_blocking=True), None)  # right padding: no mask (docstring)
        for i, x in enumerate(batch):
            yield {"aux": f["aux"][i, : len(x)], "last": f["last"][i, : len(x)], "argmax": f["argmax"][i, : len(x)]}


def length_batches(lengths: list[int], batch_tokens: int, max_batch: int = 64) -> list[list[int]]:
    """Group sequences into the target's padded forwards: longest first, each batch as many sequences as
    fit ``batch_tokens`` padded tokens (``len(batch) × its longest``) and at most ``max_batch``.

    Sorting first keeps the padding small (a micro-batch mixes 50- and 1,000-token sequences), and the
    token budget makes a micro-batch of short sequences one forward instead of many. A sequence longer
    than the budget gets a batch of its own. Pure; the result depends on ``lengths`` alone.

    Example: ``length_batches([5, 100, 7, 90], 200)`` → ``[[1, 3], [2, 0]]`` (2 × 100 ≤ 200, then 7 and 5).

    Returns:
        lists of indices into ``lengths``; every index exactly once.

    Raises:
        ValueError: ``batch_tokens`` or ``max_batch`` below 1.
    """
    if batch_tokens < 1 or max_batch < 1:
        raise ValueError(f"length_batches: batch_tokens={batch_tokens} and max_batch={max_batch} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:  # descending: the first member of a batch is its longest
        if out and len(out[-1]) < max_batch and (len(out[-1]) + 1) * lengths[out[-1][0]] <= batch_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class OnlineFeatures:
    """The frozen target runs inside the trainer (no grad), behind the cache's interface.

    Args:
        target: :class:`~peagle_train.features.target.Target`. sequences: token id lists.
        batch_tokens: padded tokens per target forward inside one ``get`` (:func:`length_batches`); a
            micro-batch of 32 ShareGPT answers (~14K tokens) is one or two forwards.
    """

    #: ``get`` runs the target on its device: the trainer calls it in the step, not on its worker thread
    reads_on_host = False

    def __init__(self, target, sequences: list[list[int]], batch_tokens: int = 16384):
        self.target, self.sequences, self.batch_tokens = target, sequences, batch_tokens

    def __len__(self) -> int:
        return len(self.sequences)

    def get(self, indices: list[int]) -> list[dict]:
        """Features of ``indices`` computed now, in the order asked: dicts as :meth:`CachedFeatures.get`
        (target dtype/device). The target runs on :func:`length_batches` of them (right-padded, masked:
        a sequence's features do not depend on its batch)."""
        seqs = [self.sequences[i] for i in indices]
        out: list[dict | None] = [None] * len(seqs)
        for batch in length_batches([len(x) for x in seqs], self.batch_tokens):
            for j, f in zip(batch, iter_target_features(self.target, [seqs[j] for j in batch], len(batch))):
                out[j] = f
        return out

    def target_head(self) -> torch.Tensor:
        """The target head ``[V, T]`` (target dtype)."""
        return self.target.lm_head_weight().detach()

    def target_embeddings(self) -> torch.Tensor:
        """The target input embeddings ``[V, T]`` (target dtype)."""
        return self.target.model.get_input_embeddings().weight.detach()
