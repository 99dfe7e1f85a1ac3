"""train.eval_walk_sets: the target's answers to evaluation prompt sets, and the in-training walk on them.

Pins: batched greedy answers equal the decoding loop's single-sequence reference (float64); MT-Bench's second turn
is rendered on the history of the first answer cut at the horizon, as the loop's history; the trainer's
``eval_walk_al_sets`` equals, for every served K, the acceptance length the decoding loop measures with the
trainer's own drafter on the same prompts (float32, P-EAGLE and EAGLE-3); the recipe refuses the key with
cached features; the trackers' flat names.
"""
import pytest
import torch
from test_speculative import AUX, C, _biased, make_target

from peagle_train.core.tracking import flat_metrics
from peagle_train.decoding.speculative import speculative_generate, target_generate
from peagle_train.features.online import OnlineFeatures
from peagle_train.recipe import config_from_dict
from peagle_train.trainer.walk_sets import greedy_answers, reference_sequences

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SETS = {"mt_bench": [["alpha beta gamma", "delta epsilon"], ["zeta eta", "theta iota kappa lambda"],
                     ["mu nu xi omicron", "pi rho"]],
        "humaneval": [["def f(x):"], ["def g(y, z):"], ["def h():"]]}


def fake_loader(name, n):
    return SETS[name][:n]


def fake_encode(messages):
    """A chat template stand-in: a header token per role, then one id per word (ids 6..61, below the mask 63)."""
    ids = []
    for m in messages:
        ids.append(1 if m["role"] == "user" else 3)
        ids += [6 + sum(map(ord, w)) % 56 for w in m["content"].split()]
    return ids + [3]


class WordTokenizer:
    """Decodes ids to space-separated numbers (what fake_encode then hashes back to ids)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_batched_greedy_answers_equal_single_sequence_greedy():
    target = make_target(c_quantile=0.5)
    target.model.double()
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20]]  # left padding of 0, 4 and 6 positions
    eos = [C]  # answers that end early (C is the argmax of about half the contexts) and answers that run to the cap
    got = greedy_answers(target, prompts, 9, eos, batch_size=2)
    for p, a in zip(prompts, got):
        ref, _ = target_generate(target, p, 9, eos_token_id=eos)
        assert a == ref
    assert [len(a) for a in got] == [1, 7, 5] and all(a[-1] == C for a in got)  # each ends at its first C, kept
    with pytest.raises(ValueError, match="empty prompt"):
        greedy_answers(target, [[]], 4, eos)


def test_reference_sequences_render_second_turns_on_the_cut_first_answer():
    target = make_target(c_quantile=0.2)
    target.model.double()
    target.tokenizer = WordTokenizer()
    H, extra = 2, 3
    refs = reference_sequences(target, ["mt_bench", "humaneval"], 2, H, both_turns=True, extra_tokens=extra,
                               load_prompts=fake_loader, encode=fake_encode)
    assert [len(refs["mt_bench"]), len(refs["humaneval"])] == [4, 2]  # two turns each, one turn each
    for (p, a), user in zip(refs["humaneval"], SETS["humaneval"]):
        assert p == fake_encode([{"role": "user", "content": user[0]}])
        assert 1 <= len(a) <= H + extra and a == target_generate(target, p, H + extra, eos_token_id=[2])[0]
    assert any(len(refs["mt_bench"][i][1]) > H for i in range(2))  # a first answer longer than the history's cut
    for i, turns in enumerate(SETS["mt_bench"][:2]):
        _, a1 = refs["mt_bench"][i]
        p2, _ = refs["mt_bench"][2 + i]
        shown = " ".join(str(t) for t in a1[:H] if t != 2)
        assert p2 == fake_encode([{"role": "user", "content": turns[0]}, {"role": "assistant", "content": shown},
                                  {"role": "user", "content": turns[1]}])
    refs1 = reference_sequences(target, ["mt_bench"], 3, H, both_turns=False, extra_tokens=0,
                                load_prompts=fake_loader, encode=fake_encode)
    assert len(refs1["mt_bench"]) == 3 and all(len(a) <= H for _, a in refs1["mt_bench"])


def _trainer(monkeypatch, method):
    from data_prep import eval_prompts, template
    from peagle_train.trainer.trainer import Trainer

    monkeypatch.setattr(eval_prompts, "load_eval_prompts", fake_loader)
    monkeypatch.setattr(template, "build_prompt_ids", lambda tok, messages: fake_encode(messages))
    target = make_target(c_quantile=0.75)
    target.tokenizer = WordTokenizer()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(6, 60, (24,), generator=g).tolist() for _ in range(6)]
    data = {s: {"input_ids": rows[a:b], "loss_mask": [[0] * 8 + [1] * 16 for _ in rows[a:b]]}
            for s, (a, b) in (("train", (0, 4)), ("eval", (4, 6)))}
    feats = {s: OnlineFeatures(target, data[s]["input_ids"]) for s in data}
    cfg = config_from_dict({
        "output_dir": "unused", "target": {"name": "tiny", "path": "unused", "aux_layer_ids": AUX},
        "drafter": {"num_layers": 2, "mask_token_id": 63},
        "train": {"method": method, "K": 4, "features": "online", "attention": "sdpa", "eval_sequences": 2,
                  "eval_walk_sets": ["mt_bench", "humaneval"]},
        "eval": {"num_prompts": 3, "max_new_tokens": 10, "k_max": 4, "both_turns": True}})
    trainer = Trainer(cfg, data, feats, target.config, AUX)
    drafter = trainer.acc.unwrap_model(trainer.model).drafter
    ids = (torch.arange(drafter.config.draft_vocab_size) + drafter.d2t).tolist()
    drafter.lm_head = _biased(drafter.lm_head, ids.index(C), 4.0)  # long acceptances where the target emits C
    return trainer, target, drafter, cfg


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_trainer_walk_on_eval_sets_equals_the_decoding_loop(monkeypatch, method):
    trainer, target, drafter, cfg = _trainer(monkeypatch, method)
    first = trainer.evaluate()
    got = first["eval_walk_al_sets"]
    assert sorted(got) == ["humaneval", "mt_bench"]
    assert first["eval_walk_sets_answers_s"] > 0 and first["eval_walk_sets_s"] >= first["eval_walk_sets_answers_s"]
    again = trainer.evaluate()  # the answers are made once a launch: the next evaluation reuses them
    assert "eval_walk_sets_answers_s" not in again and again["eval_walk_al_sets"] == got
    H = cfg.eval.max_new_tokens
    drafter.eval()
    best = 0
    for name in ("mt_bench", "humaneval"):
        refs = reference_sequences(target, [name], 3, H, True, 0, load_prompts=fake_loader, encode=fake_encode)[name]
        for k in range(1, cfg.train.K + 1):
            accepted = []
            for p, _ in refs:
                _, st = speculative_generate(target, drafter, p, k, H, eos_token_id=[2])  # the eval passes the EOS
                accepted += st.accepted
            best = max([best, *accepted])
            assert got[name][k] == pytest.approx(sum(a + 1 for a in accepted) / len(accepted), abs=1e-12), (name, k)
    assert best >= 2  # multi-token acceptances: the walk is exercised beyond the first draft


def test_recipe_refuses_eval_walk_sets_with_cached_features():
    base = {"output_dir": "o", "target": {"name": "t", "path": "p"}, "drafter": {"num_layers": 1, "mask_token_id": 3}}
    with pytest.raises(ValueError, match="eval_walk_sets.*needs train.features: online"):
        config_from_dict({**base, "train": {"features": "cache", "eval_walk_sets": ["humaneval"]}})
    assert config_from_dict({**base, "train": {"features": "online", "eval_walk_sets": ["humaneval"]}})


def test_flat_metrics_names_each_sets_walk():
    flat = flat_metrics({"eval_walk_al_sets": {"humaneval": {1: 1.5, 2: 1.75}}, "eval_walk_al": {1: 1.2}}, "eval")
    assert flat == {"eval/walk_al_sets_humaneval_k1": 1.5, "eval/walk_al_sets_humaneval_k2": 1.75,
                    "eval/walk_al_k1": 1.2}


def test_real_smollm2_answers_equal_the_eval_stages_references():
    """The real SmolLM2 (float32, CPU), its chat template, the real MT-Bench and HumanEval loaders: the answers
    the trainer walks are the references the eval stage decodes (``target_generate`` on the prompt ids the loop
    renders, turn 2 on turn 1's reference), token for token."""
    from conftest import need_smollm2

    need_smollm2()
    from pathlib import Path

    from data_prep.eval_prompts import load_eval_prompts
    from data_prep.template import build_prompt_ids
    from peagle_train.features.target import eos_ids
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    cfg = load_config(str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"), [])
    target = load_target(cfg.target)
    H, extra = 12, 3
    refs = reference_sequences(target, ["mt_bench", "humaneval"], 2, H, both_turns=True, extra_tokens=extra)
    eos = eos_ids(target)
    for name in ("mt_bench", "humaneval"):
        want = []
        for turns in load_eval_prompts(name, 2):  # the loop's order: turn 1 of every prompt first here
            history = []
            for user in turns[:2]:
                history.append({"role": "user", "content": user})
                ids = build_prompt_ids(target.tokenizer, history)
                ref, _ = target_generate(target, ids, H + extra, eos_token_id=eos)
                want.append((ids, ref))
                shown = [t for t in ref[:H] if t not in eos]
                history.append({"role": "assistant", "content": target.tokenizer.decode(shown, skip_special_tokens=True)})
        order = [0, 2, 1, 3] if name == "mt_bench" else [0, 1]  # reference_sequences: all first turns, then seconds
        assert refs[name] == [want[i] for i in order], name


def test_greedy_answers_ignore_the_targets_generation_config():
    """A target whose generation_config asks for a repetition penalty still gets plain greedy answers (the
    decoding loop takes the logits' argmax)."""
    target = make_target(c_quantile=0.5)
    target.model.double()
    target.model.generation_config.repetition_penalty = 1.5
    target.model.generation_config.no_repeat_ngram_size = 2
    p = [10, 11, 12, 13, 14, 15, 16]
    ref, _ = target_generate(target, p, 9, eos_token_id=[C])
    assert greedy_answers(target, [p], 9, [C]) == [ref] and len(set(ref)) < len(ref)  # repeats: a penalty would bite
    assert target.model.generation_config.repetition_penalty == 1.5  # the target's own config is back


def test_recorded_only_keys_leave_a_run_folder_and_a_portable_state_usable():
    """Keys that change what the in-training eval records, not what is trained, neither change a run folder's
    identity (a folder trained without the walk on eval sets is resumed and evaluated with it) nor a portable
    state's fingerprint."""
    from peagle_train.stages import _NON_IDENTITY_KEYS
    from peagle_train.trainer.portable_state import LAUNCH_ONLY_TRAIN_KEYS

    for k in ("eval_every", "eval_sequences", "eval_walk_sets", "log_every", "save_every", "keep_last", "report_to",
              "profile_steps", "profile_start", "gc_every"):
        assert f"train.{k}" in _NON_IDENTITY_KEYS and k in LAUNCH_ONLY_TRAIN_KEYS, k
