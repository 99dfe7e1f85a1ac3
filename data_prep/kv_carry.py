"""``regen.keep_kv``: the segmented static engine keeps the KV cache it has already computed.

The static engine in segments (``regen.segment_tokens``, :func:`data_prep.regenerate._generate_segmented`)
gives a row that goes on to the next call as its prompt plus its tokens so far, and ``generate`` prefills all of
it again; a conversation's next turn (streamed into the batch at the next call) is a new prompt holding the whole
regenerated history, prefilled from its first token. Replayed on a real all-turns prepare, those prefills were
about 64 % of the regeneration time (docs/benchmarks.md, "The schedule replayed"). With this carry, each call
builds its static KV cache itself:

* a row that goes on copies its keys and values from the last call's cache (one slice copy per layer and source
  cache: the rows of a call all moved by the same number of positions);
* a new turn whose conversation's previous turn ended in the last call copies the keys and values of the
  tokens it shares with that turn's row (the history, the previous answer: their longest common prefix of token
  ids) and only the rest of its prompt is computed, attending to them;
* any other new row (a first turn) is prefilled with the other such rows, left-padded to the longest of them;
* a padding copy of the first row (the call's width is a power of two) takes the first row's (in a part of a
  split call that does not hold the call's first row, it is prefilled like a new row).

Then ``generate`` runs on that cache from the last position of every row, as it would after its own prefill:
the cache holds each row's tokens but the last, positions counted from the row's first token as ``generate``
does (``cumsum`` of the attention mask ``- 1``), so RoPE sees every token where it was. In exact arithmetic the
tokens are those of one ``generate`` call per turn (float32 tests on CPU: ``tests/unit/test_data_prep.py``). The
cache is a ``transformers`` ``StaticCache``, so ``generate`` compiles its decoding step as for
``cache_implementation="static"``.

Memory: the calls of one engine run share one buffer of keys and values (per layer ``[rows, kv heads, length,
head dim]``, allocated at the run's first call, again only for a wider or longer call); a call's cache is a view of
its first rows, rebuilt in place from the last call's (every read of a layer is a copy made before that layer is
written; the frames of continued turns, at most ``regen.keep_kv_frames`` of the call's positions (default
:data:`FRAME_SHARE`, an eighth), are copied before anything is written; a continued turn beyond that budget is
prefilled instead). A prefill forward holds at most ``B //`` :data:`PREFILL_ROWS_DIVISOR` rows' keys and values. At
the peak: one cache, an eighth for a prefill forward, the frames' share, and two layers (a layer's carried rows while they move, a layer that
transformers allocates while it initialises the call's cache); :func:`memory_caches` is that count, which
:func:`data_prep.regen_memory.fit_regen_memory` uses for ``keep_kv``. A call split into parts after running out of
memory is prefilled whole, each part in a cache of its own, the buffer let go first (its rows may hold another
part's sources); the engine then makes calls of the halved size, one part each
(:func:`data_prep.regenerate._generate_segmented`). Targets with
sliding-window layers are refused (:func:`unsupported_reason`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Row:
    """A row of a finished call: its cache, its index there, the slot of its first token, its tokens (prompt and
    generated, through the end-of-turn token): the keys and values of all but the last are in the cache."""

    cache: object
    row: int
    start: int
    tokens: list[int]
    conversation: object = None


#: a prefill group takes rows down to this share of its longest row's length: at most twice the computed positions
#: of the rows themselves, in at most ~log2(longest / shortest) forwards
GROUP_SHARE = 0.5

#: a prefill forward takes at most ``B // PREFILL_ROWS_DIVISOR`` rows of a ``B``-row call (at least one), so what it
#: holds while it runs (its rows' keys and values, its activations) is bounded by that share of the call
#: (:func:`memory_caches`)
PREFILL_ROWS_DIVISOR = 8

#: the frames copied for the continued turns of a call (copied before the buffer is rewritten in place) hold at most
#: this share of a ``B``-row call's ``B * length`` positions (at least ``length``: one row); a continued turn beyond
#: it is prefilled. ``regen.keep_kv_frames`` sets it; this is its default
FRAME_SHARE = 0.125


def memory_caches(num_layers: int, rows: int, frame_share: float = FRAME_SHARE) -> float:
    """The peak memory of ``regen.keep_kv``'s builds in caches of ``rows`` rows (the engine's rows per call; module
    docstring): one cache, a prefill forward's rows (an eighth of the call, or one row of fewer than 8), the frames
    (``frame_share`` of the call, ``regen.keep_kv_frames``, or one row), and two layers. E.g. 30 layers (SmolLM2),
    512 rows: ``1.3167`` (frames an eighth), ``1.6917`` (frames half of the call)."""
    one = 1 / max(1, rows)
    return 1 + max(1 / PREFILL_ROWS_DIVISOR, one) + max(frame_share, one) + 2 / max(1, num_layers)


def has_sliding_window(config) -> bool:
    """Whether a target config (a ``transformers`` config; its text config is not looked up here) has
    sliding-window attention layers: a ``layer_types`` entry naming sliding attention (GPT-OSS), or a
    ``sliding_window`` size that ``use_sliding_window`` (default true) switches on (Mistral). A static KV cache of
    such a layer holds only the window."""
    types = getattr(config, "layer_types", None) or []
    return any("sliding" in str(t) for t in types) or bool(getattr(config, "sliding_window", None)
                                                            and getattr(config, "use_sliding_window", True))


def unsupported_reason(model) -> str | None:
    """Why :class:`KVCarry` cannot build ``model``'s caches (None when it can): a target with sliding-window
    attention layers (their static cache holds only the window, which a copied row would not fit: GPT-OSS), or a
    transformers whose ``StaticLayer`` has no ``cumulative_length`` (the write position the carry sets)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if has_sliding_window(config):
        return "the target has sliding-window attention layers (a static cache of those holds only the window)"
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return "this transformers has no transformers.cache_utils.StaticLayer"
    if not hasattr(StaticLayer(max_cache_len=1), "cumulative_length"):
        return "this transformers' StaticLayer has no cumulative_length (transformers 5.17 or later has it)"
    return None


def length_groups(rows: list, length, share: float = GROUP_SHARE) -> list[list]:
    """``rows`` in groups computed together, each padded to its first (longest) row.

    Args:
        rows: any items. length: ``item -> int >= 0``, the positions the item needs computed.
        share: a row joins the current group while its length is at least this share of the group's first.

    Returns:
        the groups, rows sorted by length (longest first, ties in the given order), a new group whenever a row is
        shorter than ``share`` times its group's first; the rows of length 0 (nothing to compute) are one last
        group of their own.

    Example (``share`` 0.5): lengths 900, 700, 460, 440, 120, 3, 0 → groups [900, 700, 460], [440], [120], [3], [0]:
    3 × 900 + 440 + 120 + 3 = 3,263 positions computed instead of 6 × 900 = 5,400 for one group padded to the
    longest.
    """
    groups: list[list] = []
    for r in sorted(rows, key=lambda r: -length(r)):
        n = length(r)
        if groups and (n >= share * length(groups[-1][0]) if n else length(groups[-1][0]) == 0):
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


@dataclass
class Layout:
    """How a call's cache is made (:meth:`KVCarry.layout`), by row index of the call.

    Attributes:
        carried: rows that go on ``(new row, _Row)``.
        fresh: groups of new rows prefilled from their first token (:func:`length_groups` of their lengths but
            the last token); each group is one forward, padded to its longest row.
        prefixed: groups of new rows with a parent ``(new row, _Row, m)``: the first ``m`` positions copied from
            it, the rest (their suffix) computed; one forward per group, padded to its longest suffix.
        lengths: every row's real tokens.
        pads: padding copies of row 0.
    """

    carried: list = field(default_factory=list)
    fresh: list = field(default_factory=list)
    prefixed: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    pads: list = field(default_factory=list)

    def fresh_len(self, group: list[int]) -> int:
        """Positions a group of fresh rows is prefilled over: its longest row's length minus the last token."""
        return max(self.lengths[b] - 1 for b in group)

    def suffix_len(self, group: list[tuple]) -> int:
        """Positions computed for a group of continued turns: its longest suffix (length - 1 - copied prefix)."""
        return max(self.lengths[b] - 1 - m for b, _, m in group)

    def frame_len(self, group: list[tuple]) -> int:
        """A group of continued turns' frame: its longest row's length minus the last token."""
        return max(self.lengths[b] - 1 for b, _, _ in group)

    def frame_positions(self) -> int:
        """Positions the continued turns' frames hold (per layer): each group's rows times its copied columns."""
        return sum(len(g) * (self.frame_len(g) - self.suffix_len(g)) for g in self.prefixed)

    def prefilled(self) -> int:
        """Positions a build computes, padding included: each group's rows times its computed length."""
        return (sum(len(g) * self.fresh_len(g) for g in self.fresh)
                + sum(len(g) * self.suffix_len(g) for g in self.prefixed))

    def reused(self) -> int:
        """Positions copied from a previous turn's row: of each continued turn, those before its group's computed
        columns (``length - 1 - suffix_len`` of the group; at most its common prefix ``m``)."""
        return sum(max(0, self.lengths[b] - 1 - self.suffix_len(g)) for g in self.prefixed for b, _, _ in g)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token id lists (an int, 0 when their first ids differ)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCarry:
    """The rows of the last segmented call, and the building of the next call's static cache from them.

    Use: :meth:`next_call` before each segmented call with its real rows, then :meth:`build` for each
    ``generate`` of that call (several when a batch is split after running out of memory), :meth:`keep` after
    each. A build lets go of the rows it copied, so the last call's cache is freed before ``generate`` runs unless
    a later part of a split batch still needs it. ``prefilled_tokens`` counts the positions computed by builds
    (padding included) and ``reused_tokens`` those copied from a previous turn.
    """

    def __init__(self, lengths: dict | None = None, rows: int = 0, frame_share: float = FRAME_SHARE):
        if not 0 < frame_share <= 1:
            raise ValueError(f"KVCarry: frame_share must be in (0, 1] (regen.keep_kv_frames), got {frame_share}")
        #: the share of a call's positions the continued turns' frames may hold (:meth:`frame_budget`)
        self.frame_share = frame_share
        self._now: dict = {}  # job -> _Row: the rows of the calls since the last next_call
        self._plan: dict = {}  # job -> ("carry", _Row) or ("prefix", _Row, m): this call's sources
        #: ``{"max_len": n}``, the longest cache made so far: later caches are at least as long (fewer shapes to
        #: compile); pass one dict per model to share it across the engine runs of a process, as ``generate`` does
        self.lengths = lengths if lengths is not None else {}
        self.prefilled_tokens = 0
        self.reused_tokens = 0
        #: per layer ``(keys, values)``, ``[rows, kv heads, length, head dim]``: the engine run's calls' caches are
        #: views of their first rows (None before the first build, and after a split call)
        self._buffer: list | None = None
        #: the buffer's rows at least (the engine's rows per call, lowered by it after running out of memory): a
        #: wider call never makes the buffer anew
        self.rows = rows
        self._call_jobs: set = set()  # the real rows' jobs of the current call (a build of fewer: a split call)

    def next_call(self, rows: list[tuple], going: set) -> None:
        """Start a call. ``rows``: its real rows ``(job, conversation or None, token ids)`` (the ids may be None for a
        job in ``going``: it is found by its job); ``going``: the jobs that go on from the last call. A row that goes on is continued from its row there; a new row whose conversation
        had a turn end in the last call starts from that turn's tokens, as far as their ids agree (at least one
        position); every other row of the last call is let go (a cache no kept row is in is freed)."""
        finished = {}
        for k, r in self._now.items():
            if k not in going and r.conversation is not None:
                finished[r.conversation] = r
        plan = {}
        for job, conv, tokens in rows:
            if job in going and job in self._now:
                plan[job] = ("carry", self._now[job])
            elif conv is not None and conv in finished:
                parent = finished[conv]
                m = min(common_prefix(parent.tokens, tokens), len(parent.tokens) - 1, len(tokens) - 1)
                if m > 0:
                    plan[job] = ("prefix", parent, m)
        self._plan, self._now = plan, {}
        self._call_jobs = {job for job, _, _ in rows}

    def frame_budget(self, B: int, L: int) -> int:
        """The most positions the continued turns' frames of a call of ``B`` rows and ``L`` cache positions may
        hold: :attr:`frame_share` of ``B * L``, at least ``L`` (one row)."""
        return max(int(B * L * self.frame_share), L)

    @staticmethod
    def padding_keys(input_ids, keys: list) -> list:
        """``keys`` with each padding copy (None) that does not repeat row 0 named ``("padding", b)``, so that it is
        prefilled like a new row: a padding copy repeats the call's row 0, which a later part of a call split after
        running out of memory does not hold. ``input_ids``: ``[B, W]``. One host synchronisation when there are
        padding copies."""
        pads = [b for b, k in enumerate(keys) if k is None]
        if not pads:
            return keys
        same = dict(zip(pads, (input_ids[pads] == input_ids[0]).all(dim=1).tolist()))
        return [("padding", b) if b in same and not same[b] else k for b, k in enumerate(keys)]

    def layout(self, keys: list, lengths: list[int], frame_budget: int | None = None) -> Layout:
        """Which rows of a call (``keys``: each row's job, None for a padding copy; ``lengths``: their real
        tokens) are carried, prefixed or prefilled, and over how many positions. ``frame_budget``: the most
        positions the prefixed groups' frames (copied columns, :meth:`Layout.frame_positions`) may hold; the group
        with the largest frame is prefilled instead until they fit (None: no limit)."""
        out = self._layout(keys, lengths, set())
        demoted: set = set()
        while frame_budget is not None and out.prefixed and out.frame_positions() > frame_budget:
            largest = max(out.prefixed, key=lambda g: len(g) * (out.frame_len(g) - out.suffix_len(g)))
            demoted |= {b for b, _, _ in largest}
            out = self._layout(keys, lengths, demoted)
        return out

    def _layout(self, keys: list, lengths: list[int], demoted: set) -> Layout:
        """:meth:`layout` with the rows in ``demoted`` prefilled whatever their source."""
        out = Layout(lengths=list(lengths))
        fresh, prefixed = [], []
        for b, k in enumerate(keys):
            src = self._plan.get(k) if k is not None else None
            if src is not None and src[0] == "prefix" and b in demoted:
                src = None
            if k is None:
                out.pads.append(b)
            elif src is None:
                fresh.append(b)
            elif src[0] == "carry":
                out.carried.append((b, src[1]))
            else:
                prefixed.append((b, src[1], src[2]))
        out.fresh = length_groups(fresh, lambda b: lengths[b] - 1)
        out.prefixed = length_groups(prefixed, lambda r: lengths[r[0]] - 1 - r[2])
        return out

    def build(self, model, input_ids, attention_mask, keys: list, max_new_tokens: int):
        """The static cache for ``generate(input_ids, attention_mask, cache=...)``: every row's positions but the
        last already computed.

        Args:
            model: a ``transformers`` causal LM (its config, dtype and device make the cache).
            input_ids: ``[B, W]`` int64 on the model's device, left-padded rows (a row that goes on: its prompt
                and tokens so far).
            attention_mask: ``[B, W]`` int64, 0 on the left padding.
            keys: ``B`` job keys; ``None`` marks a padding copy of row 0 (row 0 is never one).
            max_new_tokens: the tokens the call may decode (the cache holds ``W + max_new_tokens`` positions or
                more: at least as many as the longest cache made before, ``lengths["max_len"]``).

        Returns:
            a ``StaticCache`` with ``W - 1`` positions filled for every row: a view of the first ``B`` rows of the
            engine run's buffer, whose rows the last call's cache also views (rewritten in place: that cache is
            not valid after this build), or, for a part of a call split after running out of memory, a cache of
            its own.

        Raises:
            ValueError: row 0 is a padding copy; a carried row has another length than the last call left it with,
                or the rows of one source cache would move by different numbers of slots (not rows of one call).

        Order (nothing is read from the buffer after it is written): the continued turns' frames are copied,
        then each layer's carried rows (copied, then written), then new rows are prefilled and continued turns
        computed from their frames, then padding copies take row 0's. A build lets go of its rows' sources before
        it writes; if it or ``generate`` then runs out of memory and the batch is split
        (:class:`data_prep.regenerate._FittingRows`), those rows are prefilled from their first token in the
        retry: the same tokens, more work.
        """
        import torch

        B, W = input_ids.shape
        if keys[0] is None:
            raise ValueError("KVCarry.build: row 0 must be a real row (padding copies repeat it)")
        lengths = attention_mask.sum(-1).tolist()
        keys = self.padding_keys(input_ids, keys)
        split = not {k for k in keys if k is not None and not isinstance(k, tuple)} >= self._call_jobs
        if split:  # a part of a call split after running out of memory: the buffer's rows may be another part's
            # sources, and a cache of its own beside the buffer would hold two caches: every row of the call is
            # prefilled, each part in a cache of its own, the buffer let go before anything is allocated
            self._plan, self._buffer = {}, None
        cache, L = self._call_cache(model, B, W + max_new_tokens, whole=not split)
        plan = self.layout(keys, lengths, self.frame_budget(B, L))
        step = max(1, B // PREFILL_ROWS_DIVISOR)
        with torch.no_grad():
            frames = [self._gather_frame(cache, g, plan.frame_len(g), plan.suffix_len(g), lengths)
                      for g in plan.prefixed]
            # from here the buffer is rewritten: a retry of these rows after an error (out of memory in a prefill
            # forward: data_prep.regenerate._FittingRows) must not copy from it, so they are let go first
            for k in keys:
                self._plan.pop(k, None)
            self._copy_carried(cache, plan, input_ids, lengths, W)
            for group in plan.fresh:
                P = plan.fresh_len(group)
                for i in range(0, len(group) if P > 0 else 0, step):
                    self._prefill_fresh(model, cache, group[i:i + step], P, input_ids, attention_mask, W)
            for group, frame in zip(plan.prefixed, frames):
                D, S = plan.frame_len(group), plan.suffix_len(group)
                for i in range(0, len(group), step):
                    part = [(k[i:i + step], v[i:i + step]) for k, v in frame]
                    self._prefill_prefixed(model, cache, group[i:i + step], D, S, part, input_ids, lengths, W)
            frames = None
            for layer in cache.layers:
                if plan.pads:
                    layer.keys[plan.pads] = layer.keys[0].clone()  # a copy: the write must not alias its source
                    layer.values[plan.pads] = layer.values[0].clone()
                layer.cumulative_length.fill_(W - 1)
        self.prefilled_tokens += plan.prefilled()
        self.reused_tokens += plan.reused()
        return cache

    def keep(self, cache, keys: list, start: list[int], tokens: list[list[int]], conversations: list) -> None:
        """After ``generate``: row ``b`` of ``cache`` holds job ``keys[b]`` (None: a padding copy, not kept), its
        first token at slot ``start[b]``, ``tokens[b]`` its prompt and generated ids (through the end-of-turn
        token); ``conversations[b]``: its conversation (None: no next turn can continue it)."""
        for b, k in enumerate(keys):
            if k is not None:
                self._now[k] = _Row(cache, b, start[b], tokens[b], conversations[b])

    # ------------------------------------------------------------------ the parts of a build

    def _call_cache(self, model, B: int, need: int, whole: bool):
        """``(cache, length)`` for a call of ``B`` rows needing ``need`` positions: a view of the buffer's first
        ``B`` rows (``whole``: the build holds every real row of the call), the buffer made anew when it is
        narrower or shorter (the last call's cache keeps the old one readable until this build ends); a cache of
        its own for a part of a split call (the buffer is let go: its rows may be another part's sources)."""
        self.lengths["max_len"] = L = max(self.lengths.get("max_len", 0), need)
        if not whole:
            self._buffer = None
            return self._view_cache(model, self._allocate(model, B, L), B, L), L
        buf = self._buffer
        if buf is None or buf[0][0].shape[0] < B or buf[0][0].shape[2] < L:
            rows = max(B, self.rows, buf[0][0].shape[0] if buf is not None else 0)
            self._buffer = buf = self._allocate(model, rows, L)  # (the last call's cache still views the old one)
        return self._view_cache(model, buf, B, buf[0][0].shape[2]), buf[0][0].shape[2]

    @staticmethod
    def _allocate(model, rows: int, L: int) -> list:
        """Per layer ``(keys, values)`` zeros ``[rows, kv heads, L, head dim]`` in the model's dtype and device."""
        import torch

        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        shape = (rows, kv_heads, L, head_dim)
        return [(torch.zeros(shape, dtype=model.dtype, device=model.device),
                 torch.zeros(shape, dtype=model.dtype, device=model.device)) for _ in range(text.num_hidden_layers)]

    @staticmethod
    def _view_cache(model, buf: list, B: int, L: int):
        """A ``StaticCache`` of ``B`` rows and ``L`` positions whose layers' keys and values are ``buf``'s first
        ``B`` rows (the same addresses for every call of ``B`` rows: a compiled decoding step's CUDA graph replays).
        Each layer is initialised by transformers (which allocates its own tensors, one layer at a time) and then
        given the views."""
        import inspect

        import torch
        from transformers import StaticCache

        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        cache = StaticCache(config=text, max_cache_len=L)
        for layer, (k, v) in zip(cache.layers, buf):
            empty = torch.empty(B, k.shape[1], 0, k.shape[3], dtype=k.dtype, device=k.device)
            takes = len(inspect.signature(layer.lazy_initialization).parameters)
            layer.lazy_initialization(*([empty] * max(1, min(2, takes))))
            layer.keys, layer.values = k[:B], v[:B]
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
        return cache

    @staticmethod
    def _copy_carried(cache, plan: Layout, input_ids, lengths: list[int], W: int) -> None:
        """Rows that go on: their ``n - 1`` computed positions, one block per source cache (its rows decoded the
        same steps, so they all move by the same number of slots)."""
        import torch

        groups: dict[int, list] = {}
        for b, src in plan.carried:
            n = lengths[b]
            if len(src.tokens) != n:
                raise ValueError(f"KVCarry.build: row {b} has {n} tokens where the last call left {len(src.tokens)}: "
                                 "not the row that call left")
            groups.setdefault(id(src.cache), []).append((b, src))
        for rows in groups.values():
            old = rows[0][1].cache
            shift = {(W - lengths[b]) - src.start for b, src in rows}
            if len(shift) != 1:
                raise ValueError(f"KVCarry.build: rows of one call moved by different shifts {sorted(shift)}")
            d = shift.pop()
            lo = max(0, -d)  # source slots below it would land left of slot 0: padding of every row
            dst = torch.tensor([b for b, _ in rows], device=cache.layers[0].keys.device)
            src = torch.tensor([s.row for _, s in rows], device=old.layers[0].keys.device)
            for new_l, old_l in zip(cache.layers, old.layers):
                new_l.keys[dst, :, lo + d:W - 1] = old_l.keys[src, :, lo:W - 1 - d]
                new_l.values[dst, :, lo + d:W - 1] = old_l.values[src, :, lo:W - 1 - d]

    @staticmethod
    def _prefill_fresh(model, cache, rows: list[int], P: int, input_ids, attention_mask, W: int) -> None:
        """A group of new rows without a previous turn, prefilled together over their last ``P`` positions but
        the last (the left padding of the shorter ones masked)."""
        import torch
        from transformers import DynamicCache

        ids = input_ids[rows, W - 1 - P:W - 1]  # [n, P]
        mask = attention_mask[rows, W - 1 - P:W - 1]
        dyn = DynamicCache()
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
              logits_to_keep=1, **{cache_kwarg(model): dyn})
        dst = torch.tensor(rows, device=cache.layers[0].keys.device)
        for new_l, dyn_l in zip(cache.layers, dyn.layers):
            new_l.keys[dst, :, W - 1 - P:W - 1] = dyn_l.keys
            new_l.values[dst, :, W - 1 - P:W - 1] = dyn_l.values

    @staticmethod
    def _gather_frame(cache, group: list[tuple], D: int, S: int, lengths: list[int]) -> list:
        """The copied columns of a group of continued turns (:meth:`_prefill_prefixed`): per layer ``(keys,
        values)`` ``[R, kv heads, D - S, head dim]``, each row right-aligned in a frame of ``D`` positions (its
        longest length minus the last token), its tokens before the computed columns copied from its previous
        turn's row (all within the common prefix), zeros on its left padding. Copies: read before the buffer is
        rewritten."""
        import torch

        first = [D - (lengths[b] - 1) for b, _, _ in group]  # frame column of each row's first token
        ref = cache.layers[0].keys
        frame = []
        for li, old_layers in enumerate(zip(*(p.cache.layers for _, p, _ in group))):
            k = torch.zeros(len(group), ref.shape[1], D - S, ref.shape[3], dtype=ref.dtype, device=ref.device)
            v = torch.zeros_like(k)
            for i, ((b, p, m), old_l) in enumerate(zip(group, old_layers)):
                c = D - S - first[i]  # of this row's tokens, those left of the computed columns (all < m)
                if c > 0:
                    k[i, :, first[i]:D - S] = old_l.keys[p.row, :, p.start:p.start + c]
                    v[i, :, first[i]:D - S] = old_l.values[p.row, :, p.start:p.start + c]
            frame.append((k, v))
        return frame

    @staticmethod
    def _prefill_prefixed(model, cache, group: list[tuple], D: int, S: int, frame: list, input_ids,
                          lengths: list[int], W: int) -> None:
        """A group of new turns with a previous turn in the last call, in a frame of ``D`` positions (their longest
        length minus its last token), each row right-aligned: the first ``D - S`` columns are ``frame``
        (:meth:`_gather_frame`, the group's rows), the last ``S`` are computed attending to them (none when ``S``
        is 0). The frame is then one block of the new cache."""
        import torch
        from transformers import DynamicCache

        rows = [b for b, _, _ in group]
        first = [D - (lengths[b] - 1) for b in rows]  # frame column of each row's first token
        dev = cache.layers[0].keys.device
        if S > 0:
            dyn = DynamicCache()
            if D - S > 0:
                for li, (k, v) in enumerate(frame):
                    dyn.update(k, v, li)
            frame = None  # the cache holds them now: the forward's concatenation frees them
            mask = torch.zeros(len(rows), D, dtype=torch.long, device=dev)
            for i, f in enumerate(first):
                mask[i, f:] = 1
            ids = input_ids[rows, W - 1 - S:W - 1]  # the computed columns: each row's last S positions but its last
            positions = (torch.arange(D - S, D, device=dev).expand(len(rows), S)
                         - torch.tensor(first, device=dev)[:, None])
            model(input_ids=ids, attention_mask=mask, position_ids=positions.clamp(min=0), use_cache=True,
                  logits_to_keep=1, **{cache_kwarg(model): dyn})
            frame = [(layer.keys, layer.values) for layer in dyn.layers]
        dst = torch.tensor(rows, device=dev)
        for new_l, (k, v) in zip(cache.layers, frame):
            new_l.keys[dst, :, W - 1 - D:W - 1] = k
            new_l.values[dst, :, W - 1 - D:W - 1] = v


def cache_kwarg(model) -> str:
    """The cache keyword of ``model``'s forward: ``cache`` in newer transformers 5.x, ``past_key_values`` before."""
    import inspect

    forward = getattr(type(model), "forward", None)  # a stand-in without one (benchmarks/regen_schedule.py)
    return "cache" if forward is not None and "cache" in inspect.signature(forward).parameters else "past_key_values"
