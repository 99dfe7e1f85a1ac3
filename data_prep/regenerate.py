"""Regenerate every assistant turn with the target (Hugging Face backend; ``regen.backend: vllm``
is dispatched to :mod:`data_prep.regenerate_vllm`).

Three HF engines (``regen.engine``, :func:`resolve_engine`): ``continuous`` -- transformers' continuous
batching with a paged KV cache (:mod:`data_prep.regenerate_cb`), the default on CUDA where a flash
attention implementation is installed; ``static`` -- ``model.generate`` with a static KV cache, whose
decoding step transformers compiles (CUDA graphs) on CUDA, the default on CUDA without flash
attention; and ``generate``, plain ``model.generate`` on left-padded batches, the default elsewhere and
the reference the others are tested against (greedy outputs token-identical). Why not continuous
batching everywhere: without flash attention transformers runs it through SDPA over the keys of the
*whole* running batch with a dense block-diagonal mask (``[queries of all requests, keys of all
requests]`` per layer and step), so its cost grows with the square of the batch. The report's ``engine`` says
which ran; :func:`check_regen_memory` checks the cap and batch against free memory first.

Drafters learn the target's own distribution best when trained on the target's own
responses (EAGLE-3 / P-EAGLE recipes regenerate UltraChat/ShareGPT answers with the
target). Turns are regenerated in rounds: round ``r`` builds, for every conversation
still alive, the prompt ``system? + (user_1, regenerated_1, ..., user_r)`` with the
target's chat template (:func:`data_prep.template.build_prompt_ids`), so turn ``r``
conditions on the *regenerated* history. Engine ``generate``: within a round prompts are sorted
by length (longest first, ties by conversation index) and generated in left-padded batches of
``RegenConfig.batch_size``; engine ``continuous``: the whole round is submitted and answers come back
as they finish; engine ``static`` in segments (``regen.segment_tokens``) *streams* turns instead of rounds: a
conversation's next turn joins the batch at the next segment after its previous turn is answered, the deepest
conversations first (:func:`data_prep.rounds.stream_turns`), so a round's few long answers do not leave the batch nearly empty. The
report's ``turns`` says which (``rounds`` / ``streamed``); its ``engine_profile`` (engines ``generate`` and
``static``) how many ``generate`` calls ran, the shapes they met and the seconds of those meeting a new shape
(with a compiled decoding step: the compiles).

A conversation whose round-``r`` prompt exceeds ``max_prompt_tokens``, or whose
response is empty, ends there: it keeps turns ``< r`` or, at ``r = 0``, is dropped; both
are counted in the report, never raised.

Reasoning models (Qwen3): ``generate`` writes the reasoning block into the text
(``<think>\\n…\\n</think>\\n\\nanswer``); it is decoded with its markers kept and
:func:`data_prep.rounds.run_rounds` splits it into the message's ``reasoning`` and answer
``content`` with the markers of the target's own chat template; a response cut inside its
reasoning ends its conversation (``unfinished_reasoning``).
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
import weakref

from data_prep.config import RegenConfig
from data_prep.gqa_decode_attention import decode_attention, resolve_kernel
from data_prep.kv_carry import KVCarry, cache_kwarg
from data_prep.kv_carry import unsupported_reason as kv_carry_unsupported
from data_prep.loops import ends_in_loop
from data_prep.regen_memory import (STATIC_PROMPT_BUCKET, bucketed, fit_regen_memory, free_memory_bytes, segment_bucket,
                                   segment_width, static_row_tokens)
from data_prep.regenerate_cb import continuous_generate, unsupported_reason
from data_prep.regenerate_vllm import regenerate_vllm
from data_prep.rounds import Completion, Job, Message, harmony_splitter, reasoning_markers, regen_report, run_rounds


def _eos_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the model's ``generation_config.eos_token_id`` (int or list) plus the tokenizer's eos."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("neither model.generation_config nor the tokenizer defines an eos token id")
    return ids


def _decoder(tokenizer):
    """``ids -> text`` for a generated turn: ``decode(skip_special_tokens=True)``, stripped, except
    that the chat template's reasoning markers (:func:`data_prep.rounds.reasoning_markers`) are kept
    when the tokenizer makes them special tokens, so the reasoning can be split from the answer
    (Qwen3's ``<think>``/``</think>`` are plain added tokens and survive either way)."""
    special = set(tokenizer.all_special_ids)
    vocab = tokenizer.get_vocab()
    keep = {vocab[m] for m in reasoning_markers(tokenizer) or () if m in vocab} & special
    if not keep:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()
    return lambda ids: tokenizer.decode([t for t in ids if t not in special or t in keep]).strip()


class _EndsWhenShareDone:
    """A ``transformers`` stopping criterion (``generate(stopping_criteria=StoppingCriteriaList([...]))``; it
    has ``StoppingCriteria``'s call signature) that ends the whole call once
    ``share`` of its first ``len(tokens_left)`` rows are done: a row is done once it has produced an end-of-turn
    token or ``tokens_left[b]`` tokens (its cap). Rows after those (a segmented call's padding copies) are not
    counted. Called once per decoding step with the ids so far ``[B, L + t]``; returns ``[B]`` bool, all True once
    the share is reached, else all False (the end-of-turn stop per row is generate's own). State lives on the
    device: no host synchronisation beyond generate's own per-step check. One instance per ``generate`` call.
    """

    def __init__(self, share: float, tokens_left: list[int], eos_ids: list[int]):
        self.tokens_left, self.eos_ids = tokens_left, eos_ids
        self.need = max(1, math.ceil(round(share * len(tokens_left), 9)))  # 0.3 x 10 rows: 3, not 4
        self.step, self.done = 0, None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        rows = len(self.tokens_left)
        if self.done is None:
            self.eos = torch.tensor(self.eos_ids, device=input_ids.device)
            self.left = torch.tensor(self.tokens_left, device=input_ids.device)
            self.done = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
        self.step += 1
        self.done |= torch.isin(input_ids[:rows, -1], self.eos) | (self.left <= self.step)
        return (self.done.sum() >= self.need).expand(input_ids.shape[0])


def _generate_batch(model, prompts: list[list[int]], pad_id: int, eos_ids: list[int], gen_kwargs: dict,
                    bucket: int = 1, refill_at: float | None = None, tokens_left: list[int] | None = None,
                    carry: KVCarry | None = None, keys: list | None = None, conversations: list | None = None):
    """Left-pad ``prompts`` (to a multiple of ``bucket`` tokens) and generate.

    With ``refill_at`` (``regen.refill_at``; needs ``tokens_left``, the tokens each of the first rows may still
    produce, the rest being padding copies) the call ends once that share of those rows is done
    (:class:`_EndsWhenShareDone`); a row cut there has no end-of-turn token and goes on in the caller's next call.
    With ``carry`` (``regen.keep_kv``; ``keys``: each row's job, None for a padding copy; ``conversations``: each
    row's conversation or None) the call's static cache is built by :meth:`data_prep.kv_carry.KVCarry.build` (rows
    of the call before keep their keys and values, a next turn reuses its previous turn's, the rest is prefilled)
    instead of ``generate``'s prefill, and kept for the next call.

    Returns:
        list of (new token ids up to and including the first eos, finished: bool) per prompt.
    """
    import torch

    B, L = len(prompts), bucketed(max(len(p) for p in prompts), bucket)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros((B, L), dtype=torch.long)  # (B, L), 0 on left padding
    for b, p in enumerate(prompts):
        input_ids[b, L - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[b, L - len(p):] = 1
    if refill_at is not None:
        from transformers import StoppingCriteriaList

        gen_kwargs = {**gen_kwargs, "stopping_criteria": StoppingCriteriaList(
            [_EndsWhenShareDone(refill_at, tokens_left, eos_ids)])}
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    cache = None
    if carry is not None:
        cache = carry.build(model, input_ids, attention_mask, keys, gen_kwargs["max_new_tokens"])
        gen_kwargs = {**{k: v for k, v in gen_kwargs.items() if k != "cache_implementation"},
                      cache_kwarg(model): cache}
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        pad_token_id=pad_id,
        eos_token_id=eos_ids,
        **gen_kwargs,
    )  # (B, L + T_new), T_new <= max_new_tokens
    results = []
    eos = set(eos_ids)
    for row in out[:, L:].tolist():
        stop = next((t for t, tok in enumerate(row) if tok in eos), None)
        results.append((row if stop is None else row[: stop + 1], stop is not None))
    if carry is not None:
        carry.keep(cache, keys, [L - len(p) for p in prompts], [p + new for p, (new, _) in zip(prompts, results)],
                   conversations or [None] * B)
    return results


#: engine ``static``: the compiled decoding step may be compiled again for this many new shapes (batch rows x
#: cache length) before torch.compile gives up and runs the rest eagerly (torch's default ``recompile_limit``
#: is 8: a run in segments meets more, e.g. 8 lengths at two widths)
STATIC_RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def _static_step(model, kernel: str):
    """The static engine's ``generate`` calls: the decoding attention of :func:`decode_attention` with ``kernel``,
    and room for :data:`STATIC_RECOMPILE_LIMIT` compiled shapes (torch's limit is restored after)."""
    import torch

    limit = max(torch._dynamo.config.recompile_limit, STATIC_RECOMPILE_LIMIT)
    with torch._dynamo.config.patch(recompile_limit=limit), decode_attention(model, kernel):
        yield


class _FittingRows:
    """:func:`_generate_batch` in calls of at most ``limit`` rows, halving ``limit`` (for this call and every
    later one) when ``generate`` runs out of accelerator memory.

    The memory check before the first shard (:func:`check_regen_memory`) counts the KV cache, logits and a
    model of the prefill's transient tensors; what an attention kernel allocates in a long prefill (e.g. PyTorch
    falling back to its math SDPA kernel, which materialises ``[B, heads, P, L]`` scores) can exceed that
    model. Such a batch is then generated in halves (same rows, same outputs in exact arithmetic: rows do not
    interact) with a message saying which size ran out and what to set, instead of failing the run.
    ``limit`` stays a power of two when it starts as one (the compiled decoding step meets few batch shapes).
    """

    def __init__(self, limit: int, log=None, seen: set | None = None, progress_every_s: float | None = None):
        self.limit = max(1, int(limit))
        #: ``regen.progress_every_s``: a progress line (:meth:`progress_line`) through ``log`` after a call ending at
        #: least this long after the last one (None: none)
        self.progress_every_s = progress_every_s
        self._t_start: float | None = None  # perf_counter at the first call
        self._t_line = 0.0  # perf_counter of the last progress line (or the first call)
        self.log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        #: the shapes met before, by this object and by earlier ones given the same set (``hf_engine`` gives one
        #: set per model and decoding kernel, :func:`_shapes_seen`: the compiled step outlives a shard)
        self._seen: set[tuple] = set() if seen is None else seen
        self._mine: set[tuple] = set()
        #: where the engine's time goes (the regeneration report's ``engine_profile``): ``calls`` to
        #: ``generate``, the distinct ``shapes`` (rows x padded prompt length x new tokens) they met, the
        #: ``seconds`` inside them, and ``new_shape_seconds``: the part spent in calls meeting a shape for the
        #: first time in this process's model -- with a compiled decoding step (engine ``static`` on CUDA)
        #: those calls compile it; a later shard meeting the same shapes counts 0 there
        #: ``compiles``: graphs torch.compile made during the calls, ``compile_seconds``: its time compiling
        #: them (tracing and code generation; CUDA-graph recording is not in it), :func:`_compile_stats`
        #: ``decode_steps``: the decoding steps the calls ran (each call: its longest answer's tokens), and
        #: ``row_steps``: those steps times the call's rows (padding copies included): generated tokens over
        #: ``row_steps`` is the share of places that produced a token
        #: ``prefill_tokens``: prompt positions prefilled, padding included (``generate``'s prefill: rows x padded
        #: length; with ``regen.keep_kv`` only what :class:`data_prep.kv_carry.KVCarry` computes) and
        #: ``prefix_reused_tokens`` (keep_kv: positions of a next turn copied from its previous turn's row)
        #: ``generated_tokens``: the new tokens the calls returned (through each row's end-of-turn token)
        self.profile = {"calls": 0, "shapes": 0, "seconds": 0.0, "new_shape_seconds": 0.0, "compiles": 0,
                        "compile_seconds": 0.0, "decode_steps": 0, "row_steps": 0, "prefill_tokens": 0,
                        "prefix_reused_tokens": 0, "generated_tokens": 0}

    def __call__(self, model, prompts: list[list[int]], pad_id: int, eos_ids: list[int], gen_kwargs: dict,
                 bucket: int = 1, refill_at: float | None = None, tokens_left: list[int] | None = None,
                 carry: KVCarry | None = None, keys: list | None = None,
                 conversations: list | None = None) -> list[tuple[list[int], bool]]:
        """:func:`_generate_batch`'s arguments and result, over ``prompts`` in calls of at most ``limit`` rows.
        With ``tokens_left`` (its first rows are the real ones), a call that would hold only rows after them
        (padding copies, after a halving) is not made: the result then ends with the last real row's.

        Raises:
            torch.OutOfMemoryError: one row alone does not fit (re-raised with what to lower).
        """
        import torch

        out, s = [], 0
        if self._t_start is None:
            self._t_start = self._t_line = time.perf_counter()
        while s < len(prompts) and (tokens_left is None or s < len(tokens_left)):
            chunk = prompts[s : s + self.limit]
            left = None if tokens_left is None else tokens_left[s : s + self.limit]
            t0, c0 = time.perf_counter(), _compile_stats()
            p0, r0 = (carry.prefilled_tokens, carry.reused_tokens) if carry is not None else (0, 0)
            try:
                got = _generate_batch(model, chunk, pad_id, eos_ids, gen_kwargs, bucket, refill_at, left, carry,
                                      None if keys is None else keys[s : s + self.limit],
                                      None if conversations is None else conversations[s : s + self.limit])
                out += got
                c1 = _compile_stats()
                width = bucketed(max(len(p) for p in chunk), bucket)
                self._count((len(chunk), width, gen_kwargs.get("max_new_tokens")), time.perf_counter() - t0,
                            c1[0] - c0[0], c1[1] - c0[1], max((len(new) for new, _ in got), default=0),
                            carry.prefilled_tokens - p0 if carry is not None else len(chunk) * width,
                            carry.reused_tokens - r0 if carry is not None else 0,
                            sum(len(new) for new, _ in got))
                now = time.perf_counter()
                if self.progress_every_s is not None and now - self._t_line >= self.progress_every_s:
                    self._t_line = now
                    self.log(self.progress_line(now - self._t_start))
            except torch.OutOfMemoryError as e:
                longest = max(len(p) for p in chunk)
                if len(chunk) == 1:
                    raise torch.OutOfMemoryError(
                        f"regeneration: one row of {longest} prompt tokens does not fit the "
                        f"accelerator's memory in generate: lower data.max_prompt_tokens or regen.max_new_tokens "
                        f"({e})") from e
                self.limit = max(1, len(chunk) // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.log(f"prepare: generate ran out of accelerator memory on {len(chunk)} rows of up to "
                         f"{longest} prompt tokens; continuing with at most {self.limit} rows per "
                         f"call (set regen.batch_size: {self.limit} to start there)")
                continue
            s += len(chunk)
        return out

    def progress_line(self, elapsed_s: float) -> str:
        """One line of where the engine stands, ``elapsed_s`` seconds (wall) after its first call: e.g.
        ``regen: 12 calls in 300 s, 1,234,567 tokens (4,115 tokens/s), 2,345,678 positions prefilled, 1,536
        decoding steps, 3 compiles (95 s), 512 rows per call``."""
        p = self.profile
        rate = p["generated_tokens"] / elapsed_s if elapsed_s > 0 else 0.0
        return (f"regen: {p['calls']} calls in {elapsed_s:.0f} s, {p['generated_tokens']:,} tokens ({rate:,.0f} "
                f"tokens/s), {p['prefill_tokens']:,} positions prefilled, {p['decode_steps']:,} decoding steps, "
                f"{p['compiles']} compiles ({p['compile_seconds']:.0f} s), {self.limit} rows per call")

    def _count(self, shape: tuple, seconds: float, compiles: int = 0, compile_seconds: float = 0.0,
               steps: int = 0, prefilled: int = 0, reused: int = 0, generated: int = 0) -> None:
        """Add one finished ``generate`` call of ``shape`` (rows, padded prompt length, new tokens), ``seconds``
        (wall time), the ``compiles`` / ``compile_seconds`` made in it, its decoding ``steps``, the prompt
        positions it ``prefilled``, those it ``reused`` from a previous turn (``regen.keep_kv``) and the tokens it
        ``generated`` to :attr:`profile`."""
        new = shape not in self._seen
        self._seen.add(shape)
        self._mine.add(shape)
        p = self.profile
        p.update(calls=p["calls"] + 1, shapes=len(self._mine), seconds=round(p["seconds"] + seconds, 3),
                 new_shape_seconds=round(p["new_shape_seconds"] + new * seconds, 3),
                 compiles=p["compiles"] + compiles, compile_seconds=round(p["compile_seconds"] + compile_seconds, 3),
                 decode_steps=p["decode_steps"] + steps, row_steps=p["row_steps"] + shape[0] * steps,
                 prefill_tokens=p["prefill_tokens"] + prefilled, prefix_reused_tokens=p["prefix_reused_tokens"] + reused,
                 generated_tokens=p["generated_tokens"] + generated)


def _compile_stats() -> tuple[int, float]:
    """``(graphs compiled, seconds compiling)`` by torch.compile in this process so far: dynamo's
    ``counters["stats"]["unique_graphs"]`` and the sum of its ``_compile.compile_inner`` times (both private
    torch counters: ``(0, 0.0)`` where they are missing)."""
    try:
        from torch._dynamo import utils
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0, 0.0
    graphs = int(utils.counters.get("stats", {}).get("unique_graphs", 0))
    return graphs, float(sum(getattr(utils, "compilation_time_metrics", {}).get("_compile.compile_inner", [])))


#: model -> {decoding kernel -> the generate shapes it met} (:func:`_shapes_seen`); weak: a freed model leaves
_SHAPES_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


#: model -> ``{"max_len": n}``: the longest static cache ``regen.keep_kv`` made for it in this process (later ones are
#: at least as long, as ``generate`` keeps its ``_previous_max_cache_length``: fewer shapes to compile)
_KV_LENGTHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _kv_lengths(model) -> dict:
    """The dict :class:`data_prep.kv_carry.KVCarry` keeps its longest cache length in, one per model."""
    return _KV_LENGTHS.setdefault(model, {})


def _shapes_seen(model, kernel: str | None) -> set[tuple]:
    """The set of ``generate`` shapes ``model`` met with decoding ``kernel`` in this process, for
    :class:`_FittingRows`' ``new_shape_seconds``: transformers keeps the compiled decoding step on the model, so a
    shape met in an earlier shard (an earlier :func:`hf_engine`) is not compiled again."""
    return _SHAPES_SEEN.setdefault(model, {}).setdefault(kernel, set())


def _generate_segmented(model, prompts: list[list[int]], order: list[int], pad_id: int, eos_ids: list[int],
                        gen_kwargs: dict, bucket: int, batch_size: int, cap: int, segment: int,
                        attention=contextlib.nullcontext, generate_rows=None, stop_loops: bool = False,
                        looped: list | None = None, refill_at: float | None = None, carry: KVCarry | None = None):
    """Static-cache generation in segments of at most ``segment`` new tokens, the batch refilled between them.

    Up to ``batch_size`` rows decode together; after each ``generate`` call a row that reached an end-of-turn
    token or the cap leaves (yielded), and the next prompts of ``order`` take the free places. A row that goes
    on is given again as its prompt plus its tokens so far (prefilled again, left-padded), so the static cache of a
    call holds that length plus one segment, not the whole cap, and no row decodes past its answer while others
    finish. In exact arithmetic greedy decoding gives the tokens one ``generate`` call to the cap gives (tests:
    token-identical on the real SmolLM2 in float32).
    So that a compiled decoding step meets few shapes over a whole run (each new one is compiled again): a
    call's batch is padded to a power of two (:func:`data_prep.regen_memory.segment_width`: at most
    ``batch_size``, at least an eighth of it) with copies of its first row, whose outputs are dropped; its rows
    are left-padded to a multiple of :func:`data_prep.regen_memory.segment_bucket` tokens; and every call
    decodes up to ``min(segment, cap)`` tokens (a row past its cap is cut to it). With ``refill_at``
    (``regen.refill_at``) a call ends as soon as that share of its rows is done (end-of-turn token or cap,
    :class:`_EndsWhenShareDone`), so the places of finished rows are refilled without waiting for the segment's
    end: rows that ran on are continued in the next call like any row that goes on (same greedy tokens).

    Args:
        prompts: token ids per job (a sequence indexed by job index). order: the job indices in the order to
            start them (each once); a ``collections.deque`` is used as it is, so the caller may append jobs (and
            extend ``prompts``) while it consumes the answers: a multi-turn conversation's next turn, once its
            turn before is yielded (:func:`data_prep.rounds.stream_turns`), joins at the next free place.
        gen_kwargs: ``generate`` keywords (``max_new_tokens`` is set per call to ``min(segment, cap)``).
            cap: ``regen.max_new_tokens``.
        generate_rows: :func:`_generate_batch` or a :class:`_FittingRows` (the default: one of ``batch_size``).
        stop_loops: ``regen.stop_loops``: a row that goes on but whose tokens so far end in a repetition loop
            (:func:`data_prep.loops.ends_in_loop`) leaves as unfinished, its job index appended to ``looped``.
        refill_at: ``regen.refill_at``, a share in (0, 1], or None: every call decodes the whole segment.
        carry: ``regen.keep_kv``: a :class:`data_prep.kv_carry.KVCarry`; a row that goes on keeps its keys and values
            for the next call instead of being prefilled again (only rows new to the batch are prefilled).

    Yields:
        ``(job index, new token ids through the first end-of-turn token, finished)`` as rows leave; a row cut by
        the cap has exactly ``cap`` tokens and ``finished`` False (an end-of-turn token after the cap is not
        counted, as in one call to the cap).
    """
    from collections import deque

    generate_rows = generate_rows or _FittingRows(batch_size)
    queue = order if isinstance(order, deque) else deque(order)
    active = []  # (job index, tokens so far)
    while queue or active:
        if carry is not None:  # after running out of memory, calls of the halved limit: each call one part, so
            # keep_kv goes on from its buffer (a part of a split call is prefilled whole, data_prep.kv_carry)
            batch_size = min(batch_size, getattr(generate_rows, "limit", batch_size))
            carry.rows = batch_size
        while queue and len(active) < batch_size:
            active.append((queue.popleft(), []))
        rows = len(active)
        width = segment_width(rows, batch_size)  # a power of two, not below batch_size / 8: few batch shapes
        inputs = [prompts[i] + g for i, g in active] + [prompts[active[0][0]] + active[0][1]] * (width - rows)
        # every call decodes the same number of tokens (a row past its cap is cut below): one more shape fewer
        extra = {}
        if carry is not None:  # each row's job (the next call finds the rows that go on by it) and conversation
            conv = getattr(prompts, "conversation", lambda i: None)  # a streamed next turn reuses its previous turn
            # a row that goes on (tokens so far) is found by its job; only a new row's tokens are compared
            carry.next_call([(i, conv(i), None if g else prompts[i]) for i, g in active], {i for i, g in active if g})
            extra = {"carry": carry, "keys": [i for i, _ in active] + [None] * (width - rows),
                     "conversations": [conv(i) for i, _ in active] + [None] * (width - rows)}
        with attention():
            out = generate_rows(model, inputs, pad_id, eos_ids, {**gen_kwargs, "max_new_tokens": min(segment, cap)},
                                segment_bucket(bucket, segment), refill_at, [cap - len(g) for _, g in active],
                                **extra)
        going = []
        for (i, g), (new, finished) in zip(active, out):  # the padding rows' outputs are dropped
            g = g + new
            if len(g) > cap:  # this row had less of its cap left than the call decoded
                yield i, g[:cap], False
            elif finished:
                yield i, g, True
            elif len(g) == cap:
                yield i, g, False
            elif stop_loops and ends_in_loop(g):
                if looped is not None:
                    looped.append(i)
                yield i, g, False
            else:
                going.append((i, g))
        active = going


def regenerate(
    model,
    tokenizer,
    conversations: list[list[Message]],
    cfg: RegenConfig,
    max_prompt_tokens: int,
    progress: bool = True,
    parts: list[int] | None = None,
    on_part=None,
) -> tuple[list[list[Message]], dict] | list[tuple[list[list[Message]], dict]]:
    """Replace every assistant turn by the target's own response to the regenerated history.

    Args:
        model: a Hugging Face causal LM (put in eval mode here); inputs go to ``model.device``.
        tokenizer: its tokenizer, with a chat template.
        conversations: normal-form conversations (:mod:`data_prep.sources`): an optional
            system message, then alternating user/assistant messages starting with a user
            message. Assistant contents are ignored; a trailing user message is answered too.
        cfg: backend, ``engine`` (:func:`resolve_engine`), ``max_new_tokens`` (per turn),
            ``do_sample``, ``temperature``, ``top_p`` (sampling uses only these: HF's default top-k
            of 50 is disabled), ``batch_size``, ``seed`` (``transformers.set_seed`` once at the
            start, and continuous batching's seed; sampled output is reproducible for the same
            inputs, engine, batch size and device), the continuous engine's ``kv_blocks``,
            ``kv_memory_fraction``, ``max_batch_tokens``. Memory is not checked here
            (:func:`check_regen_memory`).
        max_prompt_tokens: a prompt (tokens, including the assistant header) longer than
            this ends its conversation (counted, not raised).
        progress: show a tqdm bar (turns, with generated tokens/s).
        parts: HF backend only: sizes of consecutive slices of ``conversations`` (``regen.shards_per_call``
            shards of a prepare) answered by one engine run and reported apart
            (:func:`data_prep.rounds.run_rounds`).
        on_part: with ``parts``: ``on_part(i, conversations, report)`` as soon as slice ``i`` has ended (its
            result, as in the returned list), while the run goes on with the other slices.

    Returns:
        ``(conversations, report)``: the surviving conversations in input order, each turn's
        content decoded with ``skip_special_tokens=True`` and stripped -- with a reasoning
        template (Qwen3 ``<think>``) only the answer, the reasoning in the message's
        ``reasoning`` (module docstring); the report has
        counts (``conversations_in/out/dropped/cut``, ``turns_requested/generated``,
        ``prompts_too_long``, ``empty_responses``, ``unfinished_responses`` -- stopped by
        ``max_new_tokens``, ``unfinished_reasoning`` -- stopped inside the reasoning, turn not
        kept), ``generated_tokens`` (including each end-of-turn token),
        ``generate_seconds``, ``tokens_per_s``, the ``engine`` that ran and the ``sampling`` settings.
        With ``parts``: one such pair per slice; each report counts its slice (``generate_seconds``: the engine
        time from the previous slice's end to its own, so the slices' add up to the run's until the last one
        ended) and has ``group``: the run's ``parts`` and ``conversations``, its ``part`` index and
        ``engine_profile_so_far`` (the run's
        engine profile when the slice ended; the last slice's is the whole run's). No report of a slice has
        ``engine_profile`` of its own.

    ``cfg.backend == "vllm"`` dispatches to :func:`data_prep.regenerate_vllm.regenerate_vllm`
    (OpenAI-compatible server at ``regen.server_url``, or offline ``vllm.LLM``), which
    returns a report with the same keys (and raises its own errors, documented there).

    Raises:
        ValueError: ``cfg.enabled`` is false; a conversation not in normal form; ``engine: continuous``
            where continuous batching cannot run the model or its generation settings; ``parts`` with
            ``regen.backend: vllm``, or ``parts`` that do not add up to the conversations.
        RuntimeError: continuous batching failed on a request (:mod:`data_prep.regenerate_cb`).
    """
    if cfg.backend == "vllm":
        if parts is not None:
            raise ValueError("regenerate: parts (regen.shards_per_call) is a setting of regen.backend: hf")
        return regenerate_vllm(model, tokenizer, conversations, cfg, max_prompt_tokens, progress)
    if not cfg.enabled:
        raise ValueError("regen.enabled is false: skip regenerate() and keep the source responses")
    complete, engine = hf_engine(model, tokenizer, cfg, max_prompt_tokens)
    eos_ids = _eos_ids(model, tokenizer)

    def report_of(stats: dict) -> dict:
        # looped_responses (regen.stop_loops): also in unfinished_responses
        report = regen_report(cfg, {"backend": "hf", "engine": engine},
                              **{**stats, "looped": stats["looped"] if cfg.stop_loops else None},
                              max_prompt_tokens=max_prompt_tokens, eos_ids=eos_ids)
        report["turns"] = "streamed" if complete.streaming else "rounds"
        return report

    if parts is None:
        kept, stats = run_rounds(complete, tokenizer, conversations, max_prompt_tokens, progress)
        report = report_of(stats)
        if complete.profile is not None:
            report["engine_profile"] = dict(complete.profile)
        return kept, report
    results: dict[int, tuple] = {}

    def part_done(i: int, kept: list, stats: dict) -> None:
        group = {"parts": len(parts), "part": i, "conversations": len(conversations)}
        if complete.profile is not None:  # the run's engine profile so far (the last part's: the whole run's)
            group["engine_profile_so_far"] = dict(complete.profile)
        results[i] = (kept, {**report_of(stats), "group": group})
        if on_part is not None:
            on_part(i, *results[i])

    run_rounds(complete, tokenizer, conversations, max_prompt_tokens, progress, parts=parts, on_part=part_done)
    return [results[i] for i in range(len(parts))]


def resolve_engine(model, cfg: RegenConfig) -> str:
    """The HF engine ``regen.engine`` names: ``auto`` is ``continuous`` on CUDA when continuous batching
    supports the model (:func:`data_prep.regenerate_cb.unsupported_reason`), else ``generate``.

    Raises:
        ValueError: ``continuous`` asked for where it cannot run (says why and what to set).
    """
    why = unsupported_reason(model)
    if cfg.engine == "continuous" and why is not None:
        raise ValueError(f"regen.engine: continuous: {why}; use regen.engine: static or generate (or auto)")
    if cfg.engine == "auto":
        import torch

        if torch.device(model.device).type != "cuda":
            return "generate"
        return "continuous" if why is None and flash_attention_available(model) else "static"
    return cfg.engine


def flash_attention_available(model) -> bool:
    """Whether continuous batching would run ``model`` on a flash attention kernel (its own implementation is
    one, or transformers can switch it to FlashAttention 2 / 3 from an installed package): the condition
    for ``regen.engine: auto`` to pick ``continuous`` (module docstring)."""
    impl = str(getattr(model.config, "_attn_implementation", "") or "")
    if "flash" in impl:
        return True
    from transformers.utils import import_utils

    return any(bool(getattr(import_utils, name, lambda: False)())
               for name in ("is_flash_attn_3_available", "is_flash_attn_2_available"))


def check_regen_memory(model, cfg: RegenConfig, max_prompt_tokens: int,
                       free_bytes: int | None = None) -> tuple[RegenConfig, str | None]:
    """:func:`data_prep.regen_memory.fit_regen_memory` for ``model`` with the engine ``cfg`` resolves to
    (:func:`resolve_engine`): the KV bytes per token from its config and dtype, its attention implementation
    (the prefill's transient bytes), the free memory of its
    device unless ``free_bytes`` is given (tests). Run once before the first shard is generated.

    Returns / Raises: as :func:`~data_prep.regen_memory.fit_regen_memory` (``RegenMemoryError``, a ValueError).
    """
    engine = resolve_engine(model, cfg)
    if free_bytes is None:
        free_bytes = free_memory_bytes(model.device)
    return fit_regen_memory(cfg, model.config, model.dtype.itemsize, engine, max_prompt_tokens, free_bytes,
                            where=str(model.device), attn_implementation=getattr(model.config, "_attn_implementation", None))


def hf_engine(model, tokenizer, cfg: RegenConfig, max_prompt_tokens: int | None = None):
    """The HF backend's engine for :func:`data_prep.rounds.run_rounds`: ``(complete, engine name)``.

    ``complete(jobs)`` yields ``(job position, Completion)`` with the generated ``token_ids`` (through the
    first end-of-turn token) as they are ready: ``generate`` answers longest prompts first (ties by
    conversation index) in left-padded batches of ``batch_size``; ``static`` the same with a static KV cache
    and prompts left-padded to a multiple of :data:`STATIC_PROMPT_BUCKET` tokens (with ``regen.segment_tokens``:
    in segments, the batch refilled between them, :func:`_generate_segmented`); ``continuous``
    (:func:`data_prep.regenerate_cb.continuous_generate`) submits the whole round and yields each answer
    when it finishes. The text keeps any reasoning block (``reasoning=None``): ``run_rounds`` splits it.
    ``transformers.set_seed(cfg.seed)`` runs once here; the model is put in eval mode. ``max_prompt_tokens``
    (``data.max_prompt_tokens``): with ``regen.keep_kv``, every static cache is made as long as the memory check
    counts a row from the first call (:func:`data_prep.regen_memory.static_row_tokens`), so the compiled decoding
    step meets one cache length and the buffer is never made anew for a longer call (the Triton decoding kernel
    reads only filled positions; SDPA reads the whole cache); None: caches grow to the longest call so far.

    ``complete`` carries ``streaming`` (static in segments: :func:`data_prep.rounds.run_rounds` then streams
    turns), ``profile`` (:attr:`_FittingRows.profile`; None for continuous), ``looped`` (the job indices
    ``regen.stop_loops`` stopped; None for continuous) and ``decode_kernel`` (the static engine's decoding
    attention, :func:`data_prep.gqa_decode_attention.resolve_kernel`; None for the other engines).

    Raises:
        ValueError: ``regen.stop_loops``, ``regen.refill_at`` or ``regen.keep_kv`` where the engine is not static
            in segments, ``regen.keep_kv`` for a target it cannot carry (:func:`data_prep.kv_carry.unsupported_reason`:
            sliding-window layers),
            ``regen.compile_dynamic`` where it is not static; see :func:`resolve_engine`.
    """
    import transformers

    engine = resolve_engine(model, cfg)
    segmented = engine == "static" and cfg.segment_tokens is not None
    if cfg.compile_dynamic and engine != "static":
        raise ValueError(f"regen.compile_dynamic is a setting of the static engine; this run's engine is {engine}: "
                         "set regen.engine: static")
    for key in ("stop_loops", "refill_at", "keep_kv"):  # e.g. auto resolving to continuous with flash attention
        if getattr(cfg, key) not in (None, False) and not segmented:
            raise ValueError(f"regen.{key} needs the static engine in segments (regen.segment_tokens); this run's "
                             f"engine is {engine}: set regen.engine: static")
    if cfg.keep_kv and (why := kv_carry_unsupported(model)) is not None:
        raise ValueError(f"regen.keep_kv: {why}; set regen.keep_kv: false")
    transformers.set_seed(cfg.seed)
    model.eval()
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    decode = _decoder(tokenizer)

    harmony = harmony_splitter(tokenizer)  # GPT-OSS: channels split on the special ids, not on decoded text

    def answer(i: int, new: list[int], finished: bool, looped: bool = False) -> tuple[int, Completion]:
        split = harmony(new) if harmony is not None else None
        if split is not None:  # run_rounds ends a turn cut in its reasoning, or with no answer, as for <think>
            reasoning, text = split
            return i, Completion(text, reasoning, len(new), finished, new, looped)
        return i, Completion(decode(new), None, len(new), finished, new, looped)

    if engine == "continuous":
        def complete(jobs: list[Job]):
            for i, new, finished in continuous_generate(model, [j[3] for j in jobs], cfg, eos_ids, pad_id):
                yield answer(i, new, finished)

        complete.streaming, complete.profile, complete.looped, complete.decode_kernel = False, None, None, None
        return complete, engine

    gen_kwargs = {"max_new_tokens": cfg.max_new_tokens, "do_sample": cfg.do_sample}
    if cfg.do_sample:
        gen_kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=0)
    bucket = 1
    if engine == "static":  # transformers compiles the decoding step for a static cache on CUDA
        gen_kwargs["cache_implementation"] = "static"
        bucket = STATIC_PROMPT_BUCKET
        if cfg.compile_dynamic:  # one graph for all shapes (regen.compile_dynamic)
            from transformers import CompileConfig

            gen_kwargs["compile_config"] = CompileConfig(dynamic=True)

    # static: decoding steps attend over the grouped KV heads without expanding them (data_prep.gqa_decode_attention)
    # (regen.decode_kernel: PyTorch's masked SDPA or the split-K Triton kernel of data_prep.decode_attention_kernel)
    kernel = resolve_kernel(cfg.decode_kernel, model.device) if engine == "static" else None
    if cfg.keep_kv and max_prompt_tokens is not None:
        # one cache length for the whole run, the memory check's (fewer compiles, and no buffer made anew beside
        # the old one for a longer call); this run's, not an earlier run's longer one
        _kv_lengths(model)["max_len"] = static_row_tokens(cfg, max_prompt_tokens)[1]
    attention = (lambda: _static_step(model, kernel)) if engine == "static" else contextlib.nullcontext

    # halves its calls, for the rest of the run, on running out of memory; counts compiles over the process's shards
    generate_rows = _FittingRows(cfg.batch_size, seen=_shapes_seen(model, kernel),
                                 progress_every_s=cfg.progress_every_s)

    looped: list[int] = []  # job indices stopped in a loop (regen.stop_loops)

    def complete(jobs: list[Job], waiting=None):
        # longest prompt first; a streaming caller's ``waiting`` (data_prep.rounds.run_rounds) grows as turns are answered
        order = waiting if waiting is not None else sorted(range(len(jobs)), key=lambda i: -len(jobs[i][3]))
        if segmented:
            for i, new, finished in _generate_segmented(model, _JobPrompts(jobs), order, pad_id, eos_ids,
                                                        gen_kwargs, bucket, cfg.batch_size, cfg.max_new_tokens,
                                                        cfg.segment_tokens, attention, generate_rows,
                                                        cfg.stop_loops, looped, cfg.refill_at,
                                                        KVCarry(_kv_lengths(model), cfg.batch_size, cfg.keep_kv_frames)
                                                        if cfg.keep_kv else None):
                yield answer(i, new, finished, bool(looped) and looped[-1] == i)  # stopped in a loop just now
            return
        for s in range(0, len(order), cfg.batch_size):
            idx = order[s : s + cfg.batch_size]
            with attention():
                batch = generate_rows(model, [jobs[i][3] for i in idx], pad_id, eos_ids, gen_kwargs, bucket)
            for i, (new, finished) in zip(idx, batch):
                yield answer(i, new, finished)

    complete.streaming = segmented  # a row leaves at every segment: a conversation's next turn can join then
    complete.profile = generate_rows.profile
    complete.looped = looped
    complete.decode_kernel = kernel
    return complete, engine


class _JobPrompts:
    """The prompt ids of ``jobs`` by job index, seeing jobs appended later (a streaming engine's prompts)."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def __getitem__(self, i: int) -> list[int]:
        return self.jobs[i][3]

    def conversation(self, i: int) -> int:
        """The conversation of job ``i`` (``regen.keep_kv``: its next turn starts from this turn's KV cache)."""
        return self.jobs[i][0]

    def __len__(self) -> int:
        return len(self.jobs)
