"""data_prep.loops: copyable tokens and the looping tails data.loop_tail takes out of the loss (pure rules,
worked examples from the docstrings, edge cases)."""
import pytest

from data_prep.loops import copyable_flags, unsupervise_loop_tails


def test_copyable_flags_worked_example_and_positions_per_span():
    assert copyable_flags([9, 5, 6, 5, 6, 5, 6], [0, 1, 1, 1, 1, 1, 1], n=2) == [
        (0, False), (1, False), (2, False), (3, False), (4, True), (5, True)]
    assert [p for p, _ in copyable_flags([1, 2, 3, 4, 5], [1, 1, 0, 1, 1], n=1)] == [0, 1, 0, 1]
    # the prompt counts as context: an answer repeating the prompt is copyable
    assert [c for _, c in copyable_flags([1, 2, 3, 1, 2, 3], [0, 0, 0, 1, 1, 1], n=1)] == [False, True, True]
    with pytest.raises(ValueError, match="one length"):
        copyable_flags([1, 2], [1], n=2)
    with pytest.raises(ValueError, match="n \\(0\\)"):
        copyable_flags([1], [1], n=0)


def test_unsupervise_loop_tails_worked_example():
    ids, mask = [9, 1, 2, 1, 2, 1, 2, 1], [0, 1, 1, 1, 1, 1, 1, 1]
    assert unsupervise_loop_tails(ids, mask, n=1, min_tail=4, fraction=0.9, keep=1, window=2) == (
        [9, 1, 2, 1, 2], [0, 1, 1, 1, 1], 3)
    assert mask == [0, 1, 1, 1, 1, 1, 1, 1]  # inputs unchanged


def test_an_earlier_turns_tail_stays_as_context_and_fresh_answers_are_untouched():
    loop = [5, 6, 7] * 40  # 120 tokens, copyable from the 7th on (n = 4)
    fresh = list(range(100, 200))
    ids = [1] + loop + [2] + fresh
    mask = [0] + [1] * len(loop) + [0] + [1] * len(fresh)
    new_ids, new_mask, off = unsupervise_loop_tails(ids, mask)
    assert new_ids == ids  # the later turn keeps its context, and nothing after the last supervised token
    # copyable from the loop's 8th token on (113 of 120): the first suffix >= 90 % copyable starts at its
    # 1st token, moved to its 7th, the first 16-token window >= 90 % copyable (15 of 16); 32 more stay supervised
    assert new_mask[1:1 + 6 + 32] == [1] * 38 and new_mask[1 + 38:1 + len(loop)] == [0] * (len(loop) - 38)
    assert off == len(loop) - 38 and new_mask[-len(fresh):] == [1] * len(fresh)
    same = unsupervise_loop_tails([1] + fresh, [0] + [1] * len(fresh))
    assert same == ([1] + fresh, [0] + [1] * len(fresh), 0)
    short = [5, 6, 7] * 10  # a loop shorter than min_tail (64): kept
    assert unsupervise_loop_tails([1] + short, [0] + [1] * 30)[2] == 0
    with pytest.raises(ValueError, match="fraction"):
        unsupervise_loop_tails([1], [1], fraction=0)


def test_fresh_text_before_a_long_loop_stays_supervised():
    """A long loop outweighs the fresh text before it in the suffix rule (200 fresh + 1,800 looping tokens are
    >= 90 % copyable from token 14 on); the tail starts at the first 16-token window that is >= 90 % copyable,
    i.e. where the loop does, so every fresh token keeps its supervision."""
    fresh = list(range(1000, 1200))
    loop = [5, 6, 7, 8, 9] * 360
    ids, mask = [1] + fresh + loop, [0] + [1] * (len(fresh) + len(loop))
    new_ids, new_mask, off = unsupervise_loop_tails(ids, mask)
    # kept: the prompt, all fresh tokens, the loop up to where it becomes copyable (its 9th token: a 4-token
    # context seen before needs one period of 5 and 4 more) and 32 of the tail; the rest is removed
    assert new_ids == ids[:1 + len(fresh) + 8 + 32] and new_mask == [0] + [1] * (len(fresh) + 8 + 32)
    assert off == len(ids) - len(new_ids)


def test_ends_in_loop_worked_examples_and_errors():
    from data_prep.loops import ends_in_loop

    assert ends_in_loop([5, 6, 7, 1, 2, 1, 2, 1, 2, 1, 2], n=1, tail=4, window=8)
    assert not ends_in_loop([5, 6, 7, 1, 2, 1, 2, 1, 2], n=1, tail=4, window=8)  # 3 of 4: not yet
    assert not ends_in_loop([1, 2, 1, 2, 3, 4, 5, 6], n=1, tail=4, window=8)
    assert not ends_in_loop([1, 2, 1], n=1, tail=4, window=8)
    # only the window counts: a loop whose period is longer than the window is not seen
    period = list(range(10, 30))  # 20 distinct tokens, repeated
    assert ends_in_loop(period * 6, n=4, tail=64, window=256)
    assert not ends_in_loop(period * 6, n=4, tail=16, window=24)
    # the defaults: 64 tokens, 90 %, the 4-token lookup of data.loop_tail
    assert ends_in_loop(list(range(100)) + [7, 8, 9] * 40) and not ends_in_loop(list(range(200)))
    for bad in ({"tail": 0}, {"tail": 8, "window": 4}, {"fraction": 0.0}, {"fraction": 1.5}):
        with pytest.raises(ValueError):
            ends_in_loop([1] * 300, **bad)
