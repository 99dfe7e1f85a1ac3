"""``torch.compile`` with a safe fallback, for the opt-in ``train.compile`` knob (issue #7).

:class:`SafeCompiled` wraps a function or module so that

1. the first call tries ``torch.compile(fn, fullgraph=True, dynamic=False)``;
2. if compiling raises (an unsupported op, no C compiler, an old Triton, ...), it
   retries once with ``fullgraph=False`` (graph breaks allowed);
3. if that raises too, it warns and runs ``fn`` eagerly from then on.

Out-of-memory errors and ``torch.utils.checkpoint``'s early-stop signal are never swallowed. Any other exception raised by the compiled
call (also on a later recompile for a new shape) triggers steps 2-3; an error that is
not the compiler's then simply re-raises from the eager call, so nothing is hidden.

Grids are padded to multiples of 1024 elements (:func:`~peagle_train.grid.pad_grid`),
so ``dynamic=False`` compiles one graph per bucket; :func:`raise_recompile_limits`
lifts Dynamo's per-code-object recompile limit so a run with many buckets (or S
partitions of different lengths) does not silently drop back to eager after 8.
"""
from __future__ import annotations

import warnings

import torch

RECOMPILE_LIMIT = 64
AUTOTUNE = "max-autotune"  # train.compile: max-autotune → Inductor's "max-autotune-no-cudagraphs" mode


def inductor_mode(compile) -> str | None:
    """``torch.compile`` ``mode`` for a ``train.compile`` value: ``"max-autotune"`` →
    ``"max-autotune-no-cudagraphs"`` (Inductor benchmarks several kernel configs, the
    FlexAttention and GEMM templates included, at the first compile of each shape; longer
    first step, possibly faster steps; no CUDA graphs: grids change shape); ``True`` → None
    (Inductor's default)."""
    return "max-autotune-no-cudagraphs" if compile == AUTOTUNE else None


def raise_recompile_limits(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's recompile limits to at least ``limit`` per code object (8x that in total).

    Works across torch versions (``cache_size_limit`` was renamed ``recompile_limit``).
    """
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 8 * limit))


class SafeCompiled:
    """Callable: ``fn`` compiled on first use, falling back as described in the module docstring.

    Args:
        fn: a function or ``nn.Module`` (a module is compiled through its ``__call__``, so its
            hooks run; it is *not* registered as a submodule of anything, so ``state_dict``
            keys do not change).
        name: label for the warning.
        inductor_mode: ``torch.compile``'s ``mode`` (None = default; see :func:`inductor_mode`).

    Attributes:
        mode: ``"pending"`` (not called yet), ``"fullgraph"``, ``"graph-breaks"`` or ``"eager"``.

    Limitation: only the forward's compilation is guarded. Inductor compiles the backward graph
    lazily, inside ``loss.backward()``; a failure there propagates to the caller (the benchmark
    records it as that variant's error row; in training, set ``train.compile: false``).
    """

    def __init__(self, fn, name: str, inductor_mode: str | None = None):
        self.fn, self.name = fn, name
        self.mode = "pending"
        self.inductor_mode = inductor_mode
        self._compiled = None

    def _make(self, fullgraph: bool):
        raise_recompile_limits()
        self._compiled = torch.compile(self.fn, fullgraph=fullgraph, dynamic=False, mode=self.inductor_mode)
        self.mode = "fullgraph" if fullgraph else "graph-breaks"

    def __call__(self, *args, **kwargs):
        if self.mode == "eager":
            return self.fn(*args, **kwargs)
        if self.mode == "pending":
            self._make(True)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure falls back, see module docstring
            if _passthrough(e):
                raise
            first = self.mode
            if self.mode == "fullgraph":
                warnings.warn(f"torch.compile({self.name}, fullgraph=True) failed ({type(e).__name__}: "
                              f"{str(e)[:300]}); retrying with graph breaks allowed", stacklevel=2)
                self._make(False)
                try:
                    return self._compiled(*args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    if _passthrough(e2):
                        raise
                    e = e2
            warnings.warn(f"torch.compile({self.name}) failed after {first} ({type(e).__name__}: {str(e)[:300]}); "
                          "running it eagerly", stacklevel=2)
            self.mode = "eager"
            return self.fn(*args, **kwargs)



def _passthrough(e: Exception) -> bool:
    """Exceptions that are not compile failures and must propagate untouched: out-of-memory, and the
    control-flow exception non-reentrant ``torch.utils.checkpoint`` raises to stop a recompute early."""
    return isinstance(e, torch.OutOfMemoryError) or type(e).__name__ == "_StopRecomputationError"
