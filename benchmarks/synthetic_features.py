"""Random target features of real shapes behind the trainer's feature-source interface.

:class:`SyntheticFeatures` stands in for :class:`peagle_train.features.cache.CachedFeatures` /
:class:`peagle_train.features.online.OnlineFeatures` in benchmarks: ``get(indices) -> list[dict]``
with, per sequence of ``n`` tokens, ``aux [n, A*T]``, ``last [n, T]`` and ``argmax [n]`` int64;
``target_head() -> [V, T]`` and ``target_embeddings() -> [V, T]``. The tensors are drawn once, at
construction, and every ``get`` hands out the same ones (every sequence of a benchmark has the
same length), so a timed training step pays neither a disk read nor a target forward, only what
the trainer does with the features (packing them onto the training device).

Where the tensors live (``placement``):

* ``"device"``: on the training device, as ``OnlineFeatures`` hands a bf16 target's features
  (target dtype, target device): ``pack`` concatenates them on the device.
* ``"host"``: bfloat16 on the CPU, as ``CachedFeatures`` returns them (memory-mapped rows):
  ``pack`` copies them to the device inside every step, as a cached run does (no disk read here).
"""
from __future__ import annotations

import torch

PLACEMENTS = {
    "device": "synthetic, drawn once on the training device (as OnlineFeatures hands a bf16 target's): "
              "no disk read or target forward in the step; the trainer's packing on the device is timed",
    "host": "synthetic, drawn once as bf16 CPU tensors (as CachedFeatures returns them): no disk read in "
            "the step; the trainer's host-to-device copy of them is timed",
}


class SyntheticFeatures:
    """Random features for sequences of ``n_tokens`` tokens (see the module docstring).

    Args:
        n_tokens: tokens of every sequence (``n``).
        hidden_size: the target's hidden size ``T``.
        vocab_size: the target vocab ``V``; ``argmax`` is drawn from ``[0, V - 1)`` (never the last
            id, the benchmark's mask token).
        device: the training device (where ``placement="device"`` puts the tensors).
        placement: ``"device"`` or ``"host"`` (:data:`PLACEMENTS`).
        aux_layers: ``A``, tapped target layers (3).
        seed: seed of the draws (the head and embeddings are drawn on each call, from the same seed).
        lengths: tokens of each sequence index (real prepared data, ``benchmarks/train_step.py --data-from``);
            ``get`` then hands out the first ``lengths[i]`` rows. None: every sequence has ``n_tokens``.

    Raises:
        ValueError: an unknown ``placement``.
    """

    def __init__(self, n_tokens: int, hidden_size: int, vocab_size: int, device, placement: str = "device",
                 aux_layers: int = 3, seed: int = 0, lengths: list[int] | None = None):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement {placement!r} is not one of {sorted(PLACEMENTS)}")
        self.n, self.T, self.V, self.seed = n_tokens, hidden_size, vocab_size, seed
        self.lengths = lengths  # per sequence index (prepared data); None: every sequence has n_tokens
        if lengths is not None and max(lengths, default=0) > n_tokens:
            raise ValueError(f"a sequence of {max(lengths)} tokens is longer than n_tokens={n_tokens}")
        self.device = torch.device(device) if placement == "device" else torch.device("cpu")
        self.reads_on_host = placement == "host"  # as CachedFeatures: the trainer reads host features ahead
        self.dtype = torch.bfloat16  # a bf16 cache (the default train.features: cache) or a bf16 target
        g = self._generator(seed)
        self.aux = self._randn((n_tokens, aux_layers * hidden_size), 0.5, g)  # [n, A*T]
        self.last = self._randn((n_tokens, hidden_size), 1.0, g)  # [n, T]
        self.argmax = torch.randint(0, vocab_size - 1, (n_tokens,), generator=g, device=self.device)  # [n] int64

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _randn(self, shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=self.device, dtype=self.dtype).mul_(std)

    def get(self, indices: list[int]) -> list[dict]:
        """Per index ``{"aux": [n, A*T], "last": [n, T], "argmax": [n] int64}``: the same tensors each time
        (with ``lengths``, their first ``lengths[i]`` rows: views, no copy)."""
        if self.lengths is None:
            return [{"aux": self.aux, "last": self.last, "argmax": self.argmax} for _ in indices]
        return [{"aux": self.aux[:n], "last": self.last[:n], "argmax": self.argmax[:n]}
                for n in (self.lengths[i] for i in indices)]

    def target_head(self) -> torch.Tensor:
        """A random target head ``[V, T]`` (std 0.02, bfloat16), drawn anew on each call (the trainer reads it once)."""
        return self._randn((self.V, self.T), 0.02, self._generator(self.seed + 1))

    def target_embeddings(self) -> torch.Tensor:
        """Random target input embeddings ``[V, T]`` (std 0.02, bfloat16), drawn anew on each call."""
        return self._randn((self.V, self.T), 0.02, self._generator(self.seed + 2))
