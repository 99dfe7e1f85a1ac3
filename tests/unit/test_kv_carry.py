"""``data_prep.kv_carry.KVCarry`` (``regen.keep_kv``) against a plain prefill, float64: every row of a built cache
holds exactly the keys and values a forward over that row's tokens alone gives, whichever way it got them
(carried from the last call, continued from a previous turn, prefilled, or a padding copy)."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from data_prep.kv_carry import KVCarry, cache_kwarg, common_prefix

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval().double()


def alone(model, tokens):
    """Keys and values per layer of a forward over ``tokens[:-1]`` alone (no padding): ``[(k, v)]``, each
    ``[heads, n - 1, d]``."""
    dyn = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens[:-1]]), use_cache=True, **{cache_kwarg(model): dyn})
    return [(layer.keys[0], layer.values[0]) for layer in dyn.layers]


def batch(rows, W):
    ids = torch.zeros(len(rows), W, dtype=torch.long)
    mask = torch.zeros(len(rows), W, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, W - len(r):] = torch.tensor(r)
        mask[b, W - len(r):] = 1
    return ids, mask


def check_rows(model, cache, rows, W):
    for b, r in enumerate(rows):
        for (k, v), layer in zip(alone(model, r), cache.layers):
            n = len(r) - 1
            torch.testing.assert_close(layer.keys[b, :, W - 1 - n:W - 1], k, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer.values[b, :, W - 1 - n:W - 1], v, rtol=1e-12, atol=1e-12)
        assert int(cache.layers[0].cumulative_length) == W - 1


def test_every_way_into_a_built_cache_gives_the_keys_of_a_plain_prefill(model):
    """Two calls. The first: conversations 0 and 1 prefilled, decoded 5 tokens by ``generate``. The second: job 1
    goes on (carried, moved to a wider call), conversation 0's next turn starts from its first turn's tokens
    (continued: its history and answer copied, the new user turn computed), conversation 2 is new (prefilled),
    one padding copy. Each row equals a forward over its own tokens."""
    g = torch.Generator().manual_seed(1)
    p0, p1 = torch.randint(3, 50, (9,), generator=g).tolist(), torch.randint(3, 50, (4,), generator=g).tolist()
    carry = KVCarry()
    W1 = 12
    carry.next_call([(0, 0, p0), (1, 1, p1)], going=set())
    ids, mask = batch([p0, p1], W1)
    cache1 = carry.build(model, ids, mask, [0, 1], 5)
    check_rows(model, cache1, [p0, p1], W1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                         eos_token_id=[1], **{cache_kwarg(model): cache1})
    new = out[:, W1:].tolist()
    seqs = [p0 + new[0], p1 + new[1]]
    carry.keep(cache1, [0, 1], [W1 - len(p0), W1 - len(p1)], seqs, [0, 1])
    first = (len(p0) - 1) + (len(p1) - 1)  # 8 and 3 positions: two length groups, no padding
    assert carry.prefilled_tokens == first and carry.reused_tokens == 0

    turn2 = seqs[0] + torch.randint(3, 50, (6,), generator=g).tolist()  # history + answer, then a new user turn
    p2 = torch.randint(3, 50, (3,), generator=g).tolist()
    rows = [seqs[1], turn2, p2]
    W2 = 24
    carry.next_call([(1, 1, seqs[1]), (5, 0, turn2), (6, 2, p2)], going={1})
    ids, mask = batch(rows + [seqs[1]], W2)  # a padding copy of row 0 last
    cache2 = carry.build(model, ids, mask, [1, 5, 6, None], 4)
    check_rows(model, cache2, rows + [seqs[1]], W2)
    assert carry.reused_tokens == len(seqs[0]) - 1  # the whole first turn but its last token
    plan_prefilled = (len(p2) - 1) + (len(turn2) - 1 - (len(seqs[0]) - 1))
    assert carry.prefilled_tokens - first == plan_prefilled
    assert carry._plan == {}  # every source copied: the first call's cache is no longer held


def test_a_next_turn_shares_only_its_common_prefix_and_a_shorter_call_drops_padding(model):
    """A next turn whose history differs from its previous turn's tokens after some position (a re-tokenised
    answer) copies only the common prefix; a row that goes on into a call narrower than its last one (its left
    padding dropped) keeps its keys."""
    g = torch.Generator().manual_seed(2)
    a, b_ = torch.randint(3, 50, (5,), generator=g).tolist(), torch.randint(3, 50, (14,), generator=g).tolist()
    carry = KVCarry()
    carry.next_call([(0, 0, a), (1, 1, b_)], going=set())
    ids, mask = batch([a, b_], 16)
    cache = carry.build(model, ids, mask, [0, 1], 3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         eos_token_id=[1], **{cache_kwarg(model): cache})
    new = out[:, 16:].tolist()
    seqs = [a + new[0], b_ + new[1]]
    carry.keep(cache, [0, 1], [16 - len(a), 16 - len(b_)], seqs, [0, 1])
    turn = seqs[1][:10] + [(seqs[1][10] + 1) % 47 + 3, 7, 8]  # differs from token 10 on
    assert common_prefix(seqs[1], turn) == 10 and len(seqs[0]) == 8
    carry.next_call([(0, 0, seqs[0]), (4, 1, turn)], going={0})
    W = 13  # row 0 had its first token at slot 11 of 19; here at 5: six slots of its left padding go
    ids, mask = batch([seqs[0], turn], W)
    before = carry.reused_tokens
    cache2 = carry.build(model, ids, mask, [0, 4], 2)
    check_rows(model, cache2, [seqs[0], turn], W)
    assert carry.reused_tokens - before == 10


def test_a_carried_row_of_another_length_is_refused(model):
    carry = KVCarry()
    carry.next_call([(0, None, [5, 6, 7])], going=set())
    ids, mask = batch([[5, 6, 7]], 4)
    cache = carry.build(model, ids, mask, [0], 2)
    carry.keep(cache, [0], [1], [[5, 6, 7, 8, 9]], [None])
    carry.next_call([(0, None, [5, 6, 7, 8])], going={0})
    ids, mask = batch([[5, 6, 7, 8]], 8)
    with pytest.raises(ValueError, match="row 0 has 4 tokens where the last call left 5"):
        carry.build(model, ids, mask, [0], 2)
    with pytest.raises(ValueError, match="row 0 must be a real row"):
        carry.build(model, ids, mask, [None], 2)


def test_length_groups_bound_the_padding():
    from data_prep.kv_carry import length_groups

    rows = [(0, 3), (1, 900), (2, 440), (3, 700), (4, 120), (5, 460), (6, 0)]
    groups = length_groups(rows, lambda r: r[1])
    assert [[r[1] for r in g] for g in groups] == [[900, 700, 460], [440], [120], [3], [0]]
    assert sum(len(g) * g[0][1] for g in groups) == 2700 + 440 + 120 + 3  # padded positions computed
    assert all(r[1] >= 0.5 * g[0][1] for g in groups for r in g if r[1])  # each row at least half its group's first
    assert length_groups([], lambda r: r) == []


def test_a_next_turn_inside_its_previous_turn_computes_nothing(model):
    """A new row whose tokens its conversation's previous row already holds (all but its last copied): its group
    runs no forward, and its keys still equal a plain prefill."""
    carry = KVCarry()
    a = [5, 9, 13, 17, 21, 25]
    carry.next_call([(0, 0, a)], going=set())
    ids, mask = batch([a], 8)
    cache = carry.build(model, ids, mask, [0], 3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         eos_token_id=[1], **{cache_kwarg(model): cache})
    seq = a + out[0, 8:].tolist()
    carry.keep(cache, [0], [2], [seq], [0])
    carry.next_call([(3, 0, seq[:5])], going=set())
    ids, mask = batch([seq[:5]], 8)
    before = carry.prefilled_tokens
    cache2 = carry.build(model, ids, mask, [3], 2)
    check_rows(model, cache2, [seq[:5]], 8)
    assert carry.prefilled_tokens == before and carry.reused_tokens == 4


def test_a_padding_copy_unlike_row_0_of_its_part_is_prefilled(model):
    """In a part of a call split after running out of memory, row 0 is not the call's row 0 that the padding copies
    repeat: such a padding row is prefilled from its own tokens, and equals a plain prefill."""
    carry = KVCarry()
    rows = [[7, 8, 9, 10], [11, 12, 13, 14, 15], [7, 8, 9, 10]]  # the last: a copy of another part's row 0
    rows[2] = [20, 21, 22]
    carry.next_call([(4, None, rows[0]), (5, None, rows[1])], going=set())
    ids, mask = batch(rows, 6)
    assert KVCarry.padding_keys(ids, [4, 5, None]) == [4, 5, ("padding", 2)]
    assert KVCarry.padding_keys(ids, [4, 5]) == [4, 5]
    cache = carry.build(model, ids, mask, [4, 5, None], 2)
    check_rows(model, cache, rows, 6)
    ids, mask = batch([rows[0], rows[1], rows[0]], 6)  # a real copy of row 0 takes row 0's keys
    assert KVCarry.padding_keys(ids, [4, 5, None]) == [4, 5, None]


def test_prefill_forwards_take_at_most_an_eighth_of_the_call(model, monkeypatch):
    """A group of new rows is prefilled in forwards of at most ``B // 8`` rows (what the memory check counts), with
    the same keys as one forward."""
    import data_prep.kv_carry as kv

    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 50, (6 + i % 3,), generator=g).tolist() for i in range(16)]
    calls = []
    real = model.forward

    def counting(*a, **k):
        calls.append(k["input_ids"].shape[0])
        return real(*a, **k)

    monkeypatch.setattr(model, "forward", counting)
    carry = KVCarry()
    carry.next_call([(i, None, r) for i, r in enumerate(rows)], going=set())
    ids, mask = batch(rows, 10)
    cache = carry.build(model, ids, mask, list(range(16)), 2)
    monkeypatch.setattr(model, "forward", real)
    check_rows(model, cache, rows, 10)
    assert calls and max(calls) <= 16 // kv.PREFILL_ROWS_DIVISOR and sum(calls) == 16


def test_the_longest_cache_is_shared_through_the_lengths_dict(model):
    """Caches are at least as long as the longest made before with the same ``lengths`` dict (one per model in the
    engine), as ``generate`` keeps its longest cache length: fewer shapes to compile across engine runs."""
    shared = {}
    first = KVCarry(shared)
    first.next_call([(0, None, [5, 6, 7])], going=set())
    ids, mask = batch([[5, 6, 7]], 8)
    assert first.build(model, ids, mask, [0], 24).layers[0].keys.shape[2] == 32 and shared == {"max_len": 32}
    later = KVCarry(shared)
    later.next_call([(0, None, [5, 6, 7])], going=set())
    ids, mask = batch([[5, 6, 7]], 4)
    assert later.build(model, ids, mask, [0], 4).layers[0].keys.shape[2] == 32


def test_generate_would_compile_its_decoding_step_on_a_built_cache(model, monkeypatch):
    """On a GPU ``generate`` compiles its decoding step (CUDA graphs) only for a compileable static cache, as with
    ``cache_implementation="static"``: a built cache qualifies by transformers' own test (the model's device taken as
    CUDA here), so ``keep_kv`` does not fall back to eager decoding; a dynamic cache does not."""
    import copy

    if not hasattr(model, "_valid_auto_compile_criteria"):
        pytest.skip("this transformers decides compilation elsewhere")
    carry = KVCarry()
    carry.next_call([(0, None, [5, 6, 7])], going=set())
    ids, mask = batch([[5, 6, 7]], 4)
    cache = carry.build(model, ids, mask, [0], 4)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    gen = copy.deepcopy(model.generation_config)
    assert model._valid_auto_compile_criteria({cache_kwarg(model): cache}, gen)
    assert not model._valid_auto_compile_criteria({cache_kwarg(model): DynamicCache()}, gen)


def _first_call(model, carry, rows, W, new_tokens):
    """A first call of ``rows`` (jobs 0, 1, ...; conversation = job), ``generate`` ``new_tokens``; kept. Returns
    ``(cache, sequences)``."""
    carry.next_call([(j, j, r) for j, r in enumerate(rows)], going=set())
    ids, mask = batch(rows, W)
    cache = carry.build(model, ids, mask, list(range(len(rows))), new_tokens)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=[1], **{cache_kwarg(model): cache})
    seqs = [r + out[b, W:].tolist() for b, r in enumerate(rows)]
    carry.keep(cache, list(range(len(rows))), [W - len(r) for r in rows], seqs, list(range(len(rows))))
    return cache, seqs


def test_a_call_is_rebuilt_in_place_where_rows_swap_places(model):
    """The calls of an engine run share one buffer: the next call's cache is the same memory. Job 0 goes on from
    row 0 to row 1, and conversation 1's next turn takes row 0 from its previous turn in row 1: each row's write
    lands on the other's source, and both rows still equal a plain prefill (every source is read before it is
    written)."""
    g = torch.Generator().manual_seed(7)
    a, b_ = torch.randint(3, 50, (7,), generator=g).tolist(), torch.randint(3, 50, (9,), generator=g).tolist()
    carry = KVCarry({"max_len": 24})  # as the engine seeds it (data_prep.regen_memory.static_row_tokens)
    cache1, seqs = _first_call(model, carry, [a, b_], 10, 3)
    turn = seqs[1] + torch.randint(3, 50, (4,), generator=g).tolist()
    carry.next_call([(7, 1, turn), (0, 0, seqs[0])], going={0})
    ids, mask = batch([turn, seqs[0]], 18)
    cache2 = carry.build(model, ids, mask, [7, 0], 2)
    assert cache2.layers[0].keys.data_ptr() == cache1.layers[0].keys.data_ptr()  # the same buffer, rewritten
    check_rows(model, cache2, [turn, seqs[0]], 18)
    assert carry.reused_tokens == len(seqs[1]) - 1


def test_continued_turns_beyond_the_frame_budget_are_prefilled(model):
    """The frames of continued turns are copied before the buffer is rewritten, at most ``frame_share`` of the
    call's ``B * length`` positions (``regen.keep_kv_frames``; at least one row's length): two continued turns with
    39 frame positions keep them under a budget of the whole call (share 1: 56 positions) and are prefilled under
    one row's (28) -- nothing reused, the same keys. A share outside (0, 1] is refused."""
    g = torch.Generator().manual_seed(8)
    rows = [torch.randint(3, 50, (17,), generator=g).tolist(), torch.randint(3, 50, (18,), generator=g).tolist()]
    results = {}
    for share in (1.0, 1e-6):
        carry = KVCarry(frame_share=share)
        assert carry.frame_budget(2, 28) == (56 if share == 1.0 else 28)
        _, seqs = _first_call(model, carry, rows, 20, 3)
        turns = [s + [5, 6, 7, 8] for s in seqs]
        carry.next_call([(5, 0, turns[0]), (6, 1, turns[1])], going=set())
        ids, mask = batch(turns, 26)
        cache = carry.build(model, ids, mask, [5, 6], 2)
        check_rows(model, cache, turns, 26)
        results[share] = carry.reused_tokens
    assert results[1.0] == sum(len(s) - 1 for s in seqs) == 39 and results[1e-6] == 0
    assert KVCarry().frame_budget(512, 4096) == 512 * 4096 // 8  # the default: an eighth
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="frame_share must be in"):
            KVCarry(frame_share=bad)


def test_memory_caches_counts_the_frames_share():
    """``memory_caches``: one cache, the prefill forward's eighth, the frames' share, two layers (of 30)."""
    from data_prep.kv_carry import memory_caches

    assert memory_caches(30, 512) == pytest.approx(1 + 1 / 8 + 1 / 8 + 2 / 30)
    assert memory_caches(30, 512, 0.5) == pytest.approx(1 + 1 / 8 + 1 / 2 + 2 / 30)
    assert memory_caches(30, 4, 0.125) == pytest.approx(1 + 1 / 4 + 1 / 4 + 2 / 30)  # fewer than 8 rows: one row


def test_a_part_of_a_split_call_gets_a_cache_of_its_own(model):
    """A build holding only some of the call's rows (a call split after running out of memory) must not rewrite
    the buffer, whose rows may be another part's sources: each part gets a cache of its own, and both parts' rows
    equal a plain prefill."""
    g = torch.Generator().manual_seed(9)
    rows = [torch.randint(3, 50, (5 + i,), generator=g).tolist() for i in range(2)]
    carry = KVCarry({"max_len": 16})  # long enough for both calls: only the split makes another cache
    cache1, seqs = _first_call(model, carry, rows, 8, 2)
    carry.next_call([(0, 0, seqs[0]), (1, 1, seqs[1])], going={0, 1})
    parts = []
    for b in (1, 0):  # the second row first: the first part's writes would land on its sources in the buffer
        ids, mask = batch([seqs[b]], 12)
        cache = carry.build(model, ids, mask, [b], 2)
        assert cache.layers[0].keys.data_ptr() != cache1.layers[0].keys.data_ptr()
        check_rows(model, cache, [seqs[b]], 12)
        parts.append(cache)
    assert carry._buffer is None


def test_running_out_of_memory_inside_a_build_leaves_no_stale_source(model, monkeypatch):
    """A build that fails after it began rewriting the buffer (out of memory in a prefill forward) has let go of its
    rows' sources first: the retry, in parts of their own (``_FittingRows`` halves the call), prefills them, and
    every row equals a plain prefill. (Found in review: without it the retry copied the half-rewritten buffer.)"""
    g = torch.Generator().manual_seed(10)
    rows = [torch.randint(3, 50, (5 + i,), generator=g).tolist() for i in range(4)]
    carry = KVCarry({"max_len": 24})
    _, seqs = _first_call(model, carry, rows, 10, 3)
    fresh = torch.randint(3, 50, (6,), generator=g).tolist()
    call = [seqs[1], seqs[0], fresh]  # jobs 0 and 1 swap places: each write lands on the other's source
    carry.next_call([(1, 1, seqs[1]), (0, 0, seqs[0]), (9, 9, fresh)], going={0, 1})
    real = KVCarry._prefill_fresh
    state = {"raised": False}

    def oom_once(*a, **k):
        if not state["raised"]:
            state["raised"] = True
            raise torch.OutOfMemoryError("test: out of memory")
        return real(*a, **k)

    monkeypatch.setattr(KVCarry, "_prefill_fresh", staticmethod(oom_once))
    ids, mask = batch(call + [seqs[1]], 16)
    with pytest.raises(torch.OutOfMemoryError):
        carry.build(model, ids, mask, [1, 0, 9, None], 2)
    for part, keys in (([seqs[1], seqs[0]], [1, 0]), ([fresh, fresh], [9, None])):  # the halves of the retry
        ids, mask = batch(part, 16)
        check_rows(model, carry.build(model, ids, mask, keys, 2), part, 16)
