"""The target's side of the reference decoding loop: its forward over new tokens, its KV cache, and
dropping the KV of rejected drafts.

Two kinds, the same results:

* **dynamic** (the default): a fresh ``transformers`` ``DynamicCache`` per request, the target eager.
  Cropping rejected drafts shortens the cache.
* **static** (``eval.compile_target``): one ``StaticCache`` of ``max_len`` positions kept for every request
  of the run, so that the target's forward has the same shapes in every round; on CUDA each query
  length (1 for the target alone, ``K + 1`` for a verification) is compiled once by ``torch.compile`` with
  mode ``"reduce-overhead"`` (CUDA graphs; ``compile="cuda-graphs"`` or ``True``) or, with
  ``compile="inductor"``, with inductor's fused kernels launched one by one (no CUDA-graph replay and none of
  its per-call bookkeeping); the prompt's prefill stays eager. Rejected drafts are
  dropped by moving the cache's write position back; their stale keys are overwritten by the next
  forward before anything attends to them, and the causal mask (built from the positions) never lets
  a query see a key past its own position. This is how vLLM and ``transformers``' compiled
  ``generate`` run small models: a 135M target's eager forward is ~30 layers of launch overhead.

Sliding-window targets (GPT-OSS) keep the dynamic kind (see :func:`_new_dynamic_cache`).

Both kinds take the aux states by forward hooks on the tapped layers (:meth:`Target.tap_modules`), kept for the
runner's life, not through ``output_hidden_states``: with it, transformers installs output-recording hooks at
the first call that asks for hidden states (inside a compiled call, graph breaks: transformers 5.17 and 5.25)
and returns every layer's output, and a forward with and one without aux states are two compiled graphs; with
the hooks they are one.
"""
from __future__ import annotations

import functools
import inspect
import logging
import weakref

import torch

from data_prep.kv_carry import has_sliding_window  # one rule for the static runner and regen.keep_kv
from peagle_train.features.target import Target, keep_output


@functools.lru_cache(maxsize=None)
def cache_kwarg(model_cls) -> str:
    """``cache`` (newer transformers 5.x renamed it) or the older ``past_key_values``."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_dynamic_cache():
    """An empty ``DynamicCache`` that keeps every position of every layer, sliding-window layers included.

    Built without the model's configuration on purpose: with it, transformers gives a sliding-window layer
    (GPT-OSS) a ``DynamicSlidingWindowLayer`` that keeps only the last ``sliding_window - 1`` keys, refuses to
    ``crop`` rejected drafts once the window is full unless it records past states, and, when it records
    them, returns every recorded key while the attention mask covers ``sliding_window - 1 + q`` keys in
    transformers 5.17 (``RuntimeError: The size of tensor a (377) must match the size of tensor b (131)`` at
    the first verification after a prompt longer than the window, GPT-OSS-20B, window 128). A full layer
    crops by a negative count in every 5.x release, and the sliding-window mask
    (``create_sliding_window_causal_mask``) still limits each query to its window, so the attention is
    the same; the price is the KV of the whole context in the sliding layers, small at evaluation lengths."""
    from transformers import DynamicCache

    return DynamicCache()


class TargetRunner:
    """The target's forward and KV cache for one decoding loop at a time (see the module docstring).

    Args:
        target: the loaded target.
        static: one ``StaticCache`` reused by every request (``False``: a ``DynamicCache`` per request).
        compile: static only: compile the forward of each query length (CUDA devices only; on a CPU the static
            forward runs eagerly, which the tests use to check it equals the dynamic one): ``True`` or
            ``"cuda-graphs"`` replays a CUDA graph per call (``mode="reduce-overhead"``), ``"inductor"`` runs
            inductor's kernels without CUDA graphs; ``False`` eager.
        block: static only: the cache holds a multiple of this many positions, grown (and the compiled
            forwards recompiled, once per new size) when a request needs more. The default holds every
            evaluation prompt of this project in one size, so each query length compiles once per run.

    Raises:
        ValueError: ``static`` for a target with sliding-window layers; ``compile`` without ``static``; a
            ``compile`` that is none of the above.
    """

    #: ``compile`` values and the ``torch.compile`` keywords of each
    COMPILE_MODES = {"cuda-graphs": {"mode": "reduce-overhead"}, "inductor": {}}

    #: compiled shapes allowed before torch.compile gives up (query lengths x cache sizes x aux on/off; torch's
    #: default of 8 would run the rest eagerly without a word)
    RECOMPILE_LIMIT = 64

    def __init__(self, target: Target, *, static: bool = False, compile: bool | str = False, block: int = 4096):
        mode = "cuda-graphs" if compile is True else compile or None
        if mode is not None and mode not in self.COMPILE_MODES:
            raise ValueError(f"TargetRunner: compile={compile!r}; give True, 'cuda-graphs', 'inductor' or False")
        if compile and not static:
            raise ValueError("TargetRunner: compile needs static=True (CUDA graphs need a static KV cache)")
        if static and has_sliding_window(target.config):
            raise ValueError("TargetRunner: a static KV cache is not supported for sliding-window targets "
                             "(GPT-OSS); set eval.compile_target: false")
        self.target, self.static, self.block = target, static, block
        #: how the compiled forward runs (``COMPILE_MODES``); None: eager (no compile asked, or not on CUDA)
        self.compile_mode = mode if static and target.device.type == "cuda" else None
        self._kw = cache_kwarg(type(target.model))
        self._cache = None
        self._len = 0  # committed positions, counted on the host (no device sync per round)
        self._max_len = 0
        self._step = None  # the compiled forward (static + compile on CUDA)
        self.fallback: str | None = None  # why the compiled forward was given up for the eager one, if it was
        # the tapped layers' outputs of the last forward, by aux layer id; the hooks hold the dict, not the
        # runner, so a runner nobody closes is collected and its hooks removed (weakref.finalize)
        self._got: dict = {}
        handles = [m.register_forward_hook(keep_output(self._got, i)) for i, m in target.tap_modules().items()]
        #: why torch.compile ran a compiled forward without CUDA graphs, each reason once (inductor's
        #: "skipping cudagraphs due to ..."); empty: every compiled forward so far replays a CUDA graph
        self.cudagraph_skips: list[str] = []
        self._skip_log = _SkipLog(self.cudagraph_skips)
        self._close = weakref.finalize(self, _remove_hooks, handles, self._skip_log)

    @property
    def compile(self) -> bool:
        """Whether the forwards (not the prefill) run compiled: :attr:`compile_mode` is set."""
        return self.compile_mode is not None

    def close(self) -> None:
        """Remove the runner's hooks from the target (also done when the runner is garbage-collected)."""
        self._close()

    def __enter__(self) -> "TargetRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, need: int) -> None:
        """Begin a request that will hold at most ``need`` positions (prompt + new tokens + one round's drafts)."""
        self._len = 0
        if not self.static:
            self._cache = _new_dynamic_cache()
            return
        if need > self._max_len or self._cache is None:
            from transformers import StaticCache

            self._max_len = -(-need // self.block) * self.block
            self._cache = StaticCache(config=self.target.config, max_cache_len=self._max_len)
            if self.compile and self.fallback is None:  # a new cache size is a new shape: compile again
                self._step = torch.compile(self.target.model, dynamic=False, **self.COMPILE_MODES[self.compile_mode])
        else:
            self._set_length(0)

    @property
    def length(self) -> int:
        """Positions whose KV the cache holds (the request's committed tokens and its last round's drafts
        until :meth:`drop`)."""
        return self._len

    def _set_length(self, n: int) -> None:
        for layer in self._cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(n)  # in place: the compiled forward reads this tensor

    def forward(self, ids: torch.Tensor, want_aux: bool, *, prefill: bool = False):
        """The target over ``ids [n]`` int64 after the cached positions, appending their KV.

        Args:
            ids: ``[n]`` token ids on the target's device.
            want_aux: also return the aux states (spec §1's tapped layers, concatenated).
            prefill: the request's prompt (static kind: run eagerly, whatever ``n``).

        Returns:
            ``(logits [n, V], aux [n, A*T] or None)``, tensors the next forward does not overwrite.

        Raises:
            ValueError: the static cache would overflow (``start`` was told too few positions).
        """
        if self.static and self.length + ids.numel() > self._max_len:
            raise ValueError(f"TargetRunner: {self.length} + {ids.numel()} positions exceed the static cache's "
                             f"{self._max_len}; pass start() the request's whole length")
        if not self._close.alive:
            raise RuntimeError("TargetRunner: closed (its aux hooks are removed); make a new runner")
        kw = dict(input_ids=ids[None], use_cache=True, **{self._kw: self._cache})
        out = None
        if self._step is not None and not prefill:
            try:
                self._skip_log.attach()
                with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit,
                                                                    self.RECOMPILE_LIMIT)):
                    if self.compile_mode == "cuda-graphs":
                        torch.compiler.cudagraph_mark_step_begin()
                    out = self._step(**kw)
                logits = out.logits[0].clone()  # the next replay overwrites the graph's output buffers
            except Exception as e:  # noqa: BLE001 -- a compile failure must not lose the evaluation: eager from here
                self.fallback = f"{type(e).__name__}: {str(e)[:300]}"
                self._step, out = None, None
                self._set_length(self._len)  # the failed call may have moved the write position
        if out is None:
            out = self.target.model(**kw)
            logits = out.logits[0]
        self._len += ids.numel()
        # cat copies out of the CUDA graph's buffers, which the next replay overwrites
        aux = torch.cat([self._got[i][0] for i in self.target.aux_layer_ids], dim=-1) if want_aux else None
        self._got.clear()
        return logits, aux

    @property
    def kind(self) -> str:
        """``dynamic``, ``static``, ``static+cuda-graphs``, ``static+inductor`` (``compile="inductor"``), or
        ``static+compiled`` when inductor ran a CUDA-graph forward without its graphs (:attr:`cudagraph_skips` says
        why): what the forwards of the next rounds use."""
        if not self.static:
            return "dynamic"
        if self._step is None:
            return "static"
        if self.compile_mode == "inductor":
            return "static+inductor"
        return "static+compiled" if self.cudagraph_skips else "static+cuda-graphs"

    def drop(self, n: int) -> None:
        """Forget the KV of the last ``n`` positions (rejected drafts); ``n = 0`` keeps everything."""
        if n <= 0:
            return
        self._len -= n
        if self.static:
            self._set_length(self._len)
        else:
            self._cache.crop(-n)


def _cudagraph_logger() -> logging.Logger:
    """The logger inductor reports a skipped CUDA graph on (``log_cudagraph_skip_and_bump_counter``)."""
    try:
        from torch._inductor import cudagraph_utils

        return cudagraph_utils.cudagraphs_log
    except (ImportError, AttributeError):  # another torch: the artifact logger's name
        return logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs")


class _SkipLog(logging.Handler):
    """Collects inductor's reasons for running a compiled graph without CUDA graphs into a list, each once."""

    def __init__(self, into: list[str]):
        super().__init__(logging.DEBUG)
        self.into, self._on = into, False

    def attach(self) -> None:
        if not self._on:
            _cudagraph_logger().addHandler(self)
            self._on = True

    def detach(self) -> None:
        if self._on:
            _cudagraph_logger().removeHandler(self)
            self._on = False

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()[:300]
        if msg not in self.into:
            self.into.append(msg)


def _remove_hooks(handles, skip_log: _SkipLog) -> None:
    for h in handles:
        h.remove()
    skip_log.detach()


__all__ = ["TargetRunner", "cache_kwarg", "has_sliding_window"]
