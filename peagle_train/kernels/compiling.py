"""``torch.compile`` with a safe fallback, for the opt-in ``train.compile`` knob (issue #7).

:class:`SafeCompiled` wraps a function or module so that

1. the first call tries ``torch.compile(fn, fullgraph=True, dynamic=False)`` (``fullgraph=False`` where asked);
2. if compiling raises (an unsupported op, no C compiler, an old Triton, ...), it
   retries once with ``fullgraph=False`` (graph breaks allowed);
3. if that raises too, it warns and runs ``fn`` eagerly from then on.

Out-of-memory errors and ``torch.utils.checkpoint``'s early-stop signal are never swallowed. Any other exception raised by the compiled
call (also on a later recompile for a new shape) triggers steps 2-3; an error that is
not the compiler's then simply re-raises from the eager call, so nothing is hidden.

Grids are padded to multiples of 1024 elements (:func:`~peagle_train.peagle.grid.pad_grid`),
so ``dynamic=False`` compiles one graph per bucket (``train.dynamic_shapes: true`` compiles with
torch's automatic dynamic shapes instead: :data:`DYNAMIC`); :func:`raise_recompile_limits`
lifts Dynamo's per-code-object recompile limit so a run with many buckets (or S
partitions of different lengths) does not silently drop back to eager after 8.
"""
from __future__ import annotations

import warnings

import torch

RECOMPILE_LIMIT = 64
#: ``dynamic=`` of every compile this module makes (and of the compiled FlexAttention): False = one graph
#: per bucketed grid length; None = torch's automatic dynamic shapes (the first length is compiled
#: static, the next new one recompiles once with symbolic lengths, which then serves every length).
#: Set per run from ``train.dynamic_shapes`` by :func:`set_dynamic_shapes`.
DYNAMIC: bool | None = False


def set_dynamic_shapes(on: bool) -> None:
    """``train.dynamic_shapes``: compile for any grid length (``True``: ``dynamic=None``, torch's
    automatic dynamic shapes) or one graph per bucketed length (``False``). Applies to compiles made
    after the call."""
    global DYNAMIC
    DYNAMIC = None if on else False
AUTOTUNE = "max-autotune"  # train.compile: max-autotune → Inductor options AUTOTUNE_OPTIONS
# Inductor's max-autotune for the Triton templates (FlexAttention's forward and backward kernels: block
# sizes, warps, stages benchmarked at the first compile of each shape); GEMMs stay on cuBLAS (ATEN), so
# the first step does not spend minutes benchmarking Triton GEMMs; no coordinate-descent tuning of
# pointwise kernels, no CUDA graphs (grids change shape).
AUTOTUNE_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN", "coordinate_descent_tuning": False}


def inductor_mode(compile) -> str | None:
    """The compile mode label for a ``train.compile`` value: ``"max-autotune"`` → ``"max-autotune"``
    (:data:`AUTOTUNE_OPTIONS`), ``True`` → None (Inductor's defaults). See :func:`compile_kwargs`."""
    return AUTOTUNE if compile == AUTOTUNE else None


def compile_kwargs(mode: str | None) -> dict:
    """``torch.compile`` keyword arguments for a mode label of :func:`inductor_mode`.

    Raises:
        ValueError: an unknown label.
    """
    if mode is None:
        return {}
    if mode == AUTOTUNE:
        return {"options": dict(AUTOTUNE_OPTIONS)}
    raise ValueError(f"unknown compile mode {mode!r}: use None or {AUTOTUNE!r}")


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
        inductor_mode: compile mode label (None = Inductor's defaults; see :func:`compile_kwargs`).
        dynamic: ``torch.compile``'s ``dynamic=`` (default: the run's :data:`DYNAMIC`); ``True`` for inputs
            whose every dimension changes from call to call (the online target's padded batches).
        fullgraph: the first attempt's ``fullgraph=`` (False: graph breaks allowed from the start, for a function
            that breaks by design; a failure then falls back to eager).
        graph_breaks: whether a failed ``fullgraph=True`` compile retries with graph breaks allowed (False: straight
            to eager with the warning; for a function whose graph breaks would leave nothing compiled, such as a
            ``torch.utils.checkpoint`` region, which Dynamo skips whole when it cannot trace it in one graph).

    Attributes:
        mode: ``"pending"`` (not called yet), ``"fullgraph"``, ``"graph-breaks"`` or ``"eager"``.

    Limitation: only the forward's compilation is guarded. Inductor compiles the backward graph
    lazily, inside ``loss.backward()``; a failure there propagates to the caller (the benchmark
    records it as that variant's error row; in training, set ``train.compile: false``).
    """

    def __init__(self, fn, name: str, inductor_mode: str | None = None, dynamic: bool | None | str = "run",
                 fullgraph: bool = True, graph_breaks: bool = True):
        self.fn, self.name = fn, name
        self.fullgraph = fullgraph
        self.graph_breaks = graph_breaks  # False: a failed fullgraph compile goes straight to eager
        self.dynamic = dynamic
        self.mode = "pending"
        self.inductor_mode = inductor_mode
        self._compiled = None

    def _make(self, fullgraph: bool):
        raise_recompile_limits()
        self._compiled = torch.compile(self.fn, fullgraph=fullgraph, dynamic=DYNAMIC if self.dynamic == "run" else self.dynamic,
                                       **compile_kwargs(self.inductor_mode))
        self.mode = "fullgraph" if fullgraph else "graph-breaks"

    def __call__(self, *args, **kwargs):
        if self.mode == "eager":
            return self.fn(*args, **kwargs)
        if self.mode == "pending":
            self._make(self.fullgraph)
        try:
            return self._compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - any compile failure falls back, see module docstring
            if _passthrough(e):
                raise
            first = self.mode
            if self.mode == "fullgraph" and self.graph_breaks:
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


class BatchedOnly:
    """A decoder layer's forward that runs its compiled version for batches of two or more sequences
    and the eager one for a batch of one: torch specialises size 1, so a single-sequence call (the
    in-training evaluation's) would compile a second graph that costs more than it saves.

    Args:
        eager: the layer's own ``forward``. compiled: :class:`SafeCompiled` of it.
    """

    def __init__(self, eager, compiled: SafeCompiled):
        self.eager, self.compiled = eager, compiled

    def __call__(self, hidden_states, *args, **kwargs):
        fn = self.compiled if hidden_states.shape[0] > 1 else self.eager
        return fn(hidden_states, *args, **kwargs)


def compile_decoder_layers(model: torch.nn.Module, name: str = "target layer") -> list[SafeCompiled]:
    """Regional compilation of a transformers model: every decoder layer's ``forward`` becomes a
    :class:`SafeCompiled` (dynamic shapes), the rest of the model (embedding, masks, the loop over
    layers, hidden-state recording, head) stays eager. The layers share one code object, so torch
    compiles it once for all of them (PyTorch's regional-compilation recipe); a whole-model compile of
    a transformers model breaks on its output recording (a lock context manager) and compiles for
    minutes. Used for ``train.compile_target`` (the online target's eager forward is host-bound:
    docs/benchmarks.md).

    Args:
        model: a transformers causal LM whose ``get_decoder().layers`` is the stack of decoder layers.

    Returns:
        the :class:`SafeCompiled` of each layer (their ``mode`` says whether it compiled).

    Raises:
        ValueError: the model has no ``get_decoder().layers``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"compile_decoder_layers: {type(model).__name__} has no get_decoder().layers; "
                         "set train.compile_target: false")
    out = []
    for layer in layers:
        compiled = SafeCompiled(layer.forward, name, dynamic=True)
        layer.forward = BatchedOnly(layer.forward, compiled)
        out.append(compiled)
    return out
