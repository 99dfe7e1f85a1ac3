"""``regen.keep_kv``: rows that go on from one segmented ``generate`` call to the next keep their KV cache.

The static engine in segments (``regen.segment_tokens``, :func:`data_prep.regenerate._generate_segmented`)
gives a row that goes on to the next call as its prompt plus its tokens so far, and ``generate`` prefills all of
it again. Replayed on a real all-turns prepare, those prefills were about 64 % of the regeneration time
(docs/benchmarks.md, "The schedule replayed"). With this carry, each call builds its static KV cache itself:

* a row that goes on copies its keys and values from the cache of the call before (one slice copy per layer:
  its positions move right by the change of the call's padded width, left padding is never read);
* a row new to the batch (a waiting prompt) is prefilled alone with the other new rows, left-padded to the
  longest of *them* (not to the call's width), and its keys and values are copied in;
* a padding copy of the first row (the call's width is a power of two) takes the first row's.

Then ``generate`` runs on that cache from the last position of every row, as it would after its own prefill:
the cache holds each row's tokens but the last (whose keys ``generate``'s first step computes), and the
positions come from the attention mask as in ``generate`` (``cumsum - 1``), so RoPE sees every token at the
position it had. In exact arithmetic the tokens are those of one ``generate`` call to the cap (float32 tests on
CPU: ``tests/unit/test_data_prep.py``). The cache is a ``transformers`` ``StaticCache``, so ``generate``
compiles its decoding step as for ``cache_implementation="static"``.

Memory: while a call's cache is built, the previous call's is still held (the rows that go on are read from
it): two caches at the peak, which :func:`data_prep.regen_memory.fit_regen_memory` counts for ``keep_kv``.
"""
from __future__ import annotations


class KVCarry:
    """The static caches of the last segmented call, by job, and the building of the next call's.

    Use: :meth:`next_call` before each segmented call (its rows may come from the call before), then
    :meth:`build` for each ``generate`` of that call (several when a batch is split after running out of
    memory), :meth:`keep` after it. A build lets go of the rows it copied, so the last call's cache is freed
    before ``generate`` runs unless a later part of a split batch still needs it. ``prefilled_tokens`` counts
    the prompt positions prefilled (padded), the quantity the carry saves.
    """

    def __init__(self):
        self._prev: dict = {}  # job key -> (cache, row, width): the rows of the last call
        self._now: dict = {}
        self.max_len = 0  # the longest cache made so far: later caches are at least as long (fewer shapes)
        self.prefilled_tokens = 0

    def next_call(self, going: set) -> None:
        """Start a call whose rows include the jobs ``going`` (those that go on from the last call): their rows of
        the last call are kept for :meth:`build`, every other row of it is let go (a cache no kept row is in is
        freed), and older calls' rows go."""
        self._prev = {k: v for k, v in self._now.items() if k in going}
        self._now = {}

    def carries(self, key) -> bool:
        """Whether the row of job ``key`` has its keys and values in the last call's cache."""
        return key is not None and key in self._prev

    def fresh_rows(self, keys: list, lengths: list[int]) -> tuple[list[int], int]:
        """``(rows to prefill, P)``: the rows of a call (``keys`` as :meth:`build`'s, ``lengths`` their real
        tokens) whose job the last call did not hold, and the positions they are prefilled over: their longest
        length minus its last token (0 when there is none). Prefilled positions: ``len(rows) * P``."""
        fresh = [b for b, k in enumerate(keys) if k is not None and k not in self._prev]
        return fresh, (max(lengths[b] for b in fresh) - 1 if fresh else 0)

    def build(self, model, input_ids, attention_mask, keys: list, max_new_tokens: int):
        """The static cache for ``generate(input_ids, attention_mask, cache=...)``: every row's positions but the
        last already computed.

        Args:
            model: a ``transformers`` causal LM (its config, dtype and device make the cache).
            input_ids: ``[B, W]`` int64, left-padded rows (a row that goes on: its prompt and tokens so far).
            attention_mask: ``[B, W]`` int64, 0 on the left padding.
            keys: ``B`` job keys; ``None`` marks a padding copy of row 0 (row 0 is never one).
            max_new_tokens: the tokens the call may decode (the cache holds ``W + max_new_tokens`` positions or
                more: at least as many as the longest cache made before).

        Returns:
            a ``StaticCache`` with ``W - 1`` positions filled for every row.

        Raises:
            ValueError: row 0 is a padding copy, or a carried row has more tokens than its width in the last
                call (it is not the row that call left).
        """
        import torch
        from transformers import DynamicCache, StaticCache

        B, W = input_ids.shape
        if keys[0] is None:
            raise ValueError("KVCarry.build: row 0 must be a real row (padding copies repeat it)")
        lengths = attention_mask.sum(-1).tolist()
        self.max_len = max(self.max_len, W + max_new_tokens)
        text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        cache = StaticCache(config=text, max_cache_len=self.max_len)
        if hasattr(cache, "early_initialization"):
            cache.early_initialization(batch_size=B, num_heads=kv_heads, head_dim=head_dim, dtype=model.dtype,
                                       device=model.device)
        else:  # an older transformers 5.x: each layer sizes itself from an empty key/value block
            empty = torch.empty(B, kv_heads, 0, head_dim, dtype=model.dtype, device=model.device)
            for layer in cache.layers:
                layer.lazy_initialization(empty, empty)
        fresh, P = self.fresh_rows(keys, lengths)
        groups: dict[int, tuple] = {}  # id(last call's cache) -> (that cache, its width, [new rows], [its rows])
        for b, k in enumerate(keys):
            if k is not None and k in self._prev:
                old, row, width = self._prev[k]
                if not 1 <= lengths[b] <= width:
                    raise ValueError(f"KVCarry.build: job {k} was {width} positions wide in the last call and has "
                                     f"{lengths[b]} tokens now: not the row that call left")
                g = groups.setdefault(id(old), (old, width, [], []))
                g[2].append(b)
                g[3].append(row)
        with torch.no_grad():
            # a carried row's computed positions end at width - 1 there and at W - 1 here: one shift per source
            # cache (its rows share its width); slots left of a row's tokens are its padding, masked either way
            for old, width, rows, old_rows in groups.values():
                a, c = max(0, width - W), max(0, W - width)
                dst = torch.tensor(rows, device=cache.layers[0].keys.device)
                src = torch.tensor(old_rows, device=old.layers[0].keys.device)
                for layer_new, layer_old in zip(cache.layers, old.layers):
                    layer_new.keys[dst, :, c:W - 1] = layer_old.keys[src, :, a:width - 1]
                    layer_new.values[dst, :, c:W - 1] = layer_old.values[src, :, a:width - 1]
            if fresh:
                if P > 0:
                    ids = input_ids[fresh, W - 1 - P:W - 1]  # [n, P], left-padded to the longest new row
                    mask = attention_mask[fresh, W - 1 - P:W - 1]
                    dyn = DynamicCache()
                    model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          use_cache=True, logits_to_keep=1, **{cache_kwarg(model): dyn})
                    self.prefilled_tokens += len(fresh) * P
                    dst = torch.tensor(fresh, device=cache.layers[0].keys.device)
                    for layer_new, layer_dyn in zip(cache.layers, dyn.layers):
                        layer_new.keys[dst, :, W - 1 - P:W - 1] = layer_dyn.keys
                        layer_new.values[dst, :, W - 1 - P:W - 1] = layer_dyn.values
            pads = [b for b, k in enumerate(keys) if k is None]
            if pads:
                for layer in cache.layers:
                    layer.keys[pads] = layer.keys[0].clone()  # a copy: the write must not alias its source
                    layer.values[pads] = layer.values[0].clone()
            for layer in cache.layers:
                layer.cumulative_length.fill_(W - 1)
        for k in keys:  # copied: the last call's cache is freed once no row still to build is in it
            self._prev.pop(k, None)
        return cache

    def keep(self, cache, keys: list, width: int) -> None:
        """After ``generate``: the rows of ``keys`` (padding copies excepted) are ``width`` positions wide in
        ``cache`` (the call's padded width plus the tokens it decoded), all but their last computed."""
        for b, k in enumerate(keys):
            if k is not None:
                self._now[k] = (cache, b, width)


def cache_kwarg(model) -> str:
    """The cache keyword of ``model``'s forward: ``cache`` in newer transformers 5.x, ``past_key_values`` before."""
    import inspect

    forward = getattr(type(model), "forward", None)  # a stand-in without one (benchmarks/regen_schedule.py)
    return "cache" if forward is not None and "cache" in inspect.signature(forward).parameters else "past_key_values"
