"""The eval stage (peagle_train/eval/evaluate.py, report.py) on a tiny target + drafter.

A real (character-level) fast tokenizer with a ChatML template drives the default
``build_prompt_ids`` path; prompt sets come from a fake loader, and once from the real
MT-Bench loader.
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from peagle_train.core.config import EvalConfig
from peagle_train.decoding import speculative
from peagle_train.decoding.speculative import per_position_acceptance, speculative_generate, target_generate
from peagle_train.eval.evaluate import LosslessError, run_eval
from peagle_train.features.target import Target
from peagle_train.model.drafter import Drafter, make_drafter_config

V, C, MASK = 64, 5, 3
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = [["what is two plus two?", "now explain it to a child."],
           ["write a haiku about rain.", "make it rhyme."],
           ["name three colors.", "which one is warmest?"]]


pytestmark = pytest.mark.usefixtures("torch_single_thread")


def tiny_tokenizer():
    """Character-level WordLevel tokenizer, ``V`` ids: specials 0-3 (``<|im_end|>`` = 2 = EOS,
    ``<mask>`` = 3), lowercase text characters, filler tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "<mask>"] + list("abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!'")
    vocab += [f"<x{i}>" for i in range(V - len(vocab))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>", "<mask>"])
    fast.chat_template = CHATML
    return fast


def tiny_pair(K=3, parallel=True):
    """Target leaning towards token C (so drafts get accepted) and a drafter leaning towards it too."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                      bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        lg = m(input_ids=torch.randint(4, V, (1, 200))).logits[0]
        beta = float((lg.max(-1).values - lg[:, C]).quantile(0.75))
        head = nn.Linear(32, V, bias=True)
        head.weight.copy_(m.lm_head.weight)
        head.bias.zero_()
        head.bias[C] = beta
        m.lm_head = head
    target = Target(model=m, tokenizer=tiny_tokenizer(), aux_layer_ids=[1, 2, 3], path="")
    dcfg = make_drafter_config(cfg, aux_layer_ids=[1, 2, 3], draft_vocab_size=V, mask_token_id=MASK, K=K,
                               num_layers=2, parallel_drafting=parallel)
    torch.manual_seed(1)
    d = Drafter(dcfg).eval().requires_grad_(False)
    d.reset_parameters(0.1)
    with torch.no_grad():
        dh = nn.Linear(32, V, bias=True)
        dh.weight.copy_(d.lm_head.weight)
        dh.bias.zero_()
        dh.bias[C] = 2.0
        d.lm_head = dh
    return target, d


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_run_eval_writes_report_and_pools_stats(tmp_path):
    from data_prep.template import build_prompt_ids

    target, drafter = tiny_pair(K=3)
    calls, encoded = [], []

    def loader(name, n):
        calls.append((name, n))
        return PROMPTS[:n]

    def encode(messages):
        ids = build_prompt_ids(target.tokenizer, messages)
        encoded.append(([dict(m) for m in messages], ids))
        return ids

    cfg = EvalConfig(datasets=["mt_bench", "humaneval"], num_prompts=2, max_new_tokens=12, k_max=3, both_turns=True)
    res = run_eval(target, drafter, cfg, tmp_path, target_name="tiny-llama", drafter_name="tiny-peagle",
                   trained_K=3, load_prompts=loader, encode=encode)

    assert calls == [("mt_bench", 2), ("humaneval", 2)]
    on_disk = json.loads((tmp_path / "eval.json").read_text())
    assert on_disk["k_values"] == [1, 2, 3] and on_disk["trained_K"] == 3 and on_disk["method"] == "peagle"
    assert on_disk["lossless"] == {"checked": 2 * 4 * 3, "mismatches": [], "passed": True}
    assert {"device", "device_name", "torch", "transformers"} <= set(on_disk["hardware"])
    for name in ("mt_bench", "humaneval"):
        ds = on_disk["datasets"][name]
        assert ds["num_prompts"] == 2 and ds["num_sequences"] == 4  # both turns of both prompts
        assert [r["K"] for r in ds["by_K"]] == [1, 2, 3]
        for r in ds["by_K"]:
            assert len(r["per_position_acceptance"]) == r["K"]
            assert 1.0 <= r["acceptance_length"] <= r["K"] + 1
            assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["draft_ms_per_round"] > 0
            assert r["mismatches"] == 0

    # turn 2 is asked after the target's own greedy turn-1 answer
    (m1, ids1), (m2, _) = encoded[0], encoded[1]
    assert [m["role"] for m in m2] == ["user", "assistant", "user"] and m2[0] == m1[0]
    ans, _ = target_generate(target, ids1, 12, eos_token_id=2)
    assert m2[1]["content"] == target.tokenizer.decode([t for t in ans if t != 2], skip_special_tokens=True)

    # pooled AL / per-position acceptance equal a recomputation from the loop itself (greedy = deterministic)
    seqs = [ids for _, ids in encoded[:4]]  # mt_bench: 2 prompts x 2 turns
    for row in on_disk["datasets"]["mt_bench"]["by_K"]:
        acc = [a for ids in seqs for a in speculative_generate(target, drafter, ids, row["K"], 12, eos_token_id=2)[1].accepted]
        assert row["rounds"] == len(acc)
        assert row["acceptance_length"] == pytest.approx(sum(a + 1 for a in acc) / len(acc))
        assert row["per_position_acceptance"] == pytest.approx(per_position_acceptance(acc, row["K"]), nan_ok=True)
    assert any(r["acceptance_length"] > 1.0 for r in on_disk["datasets"]["mt_bench"]["by_K"])

    md = (tmp_path / "eval.md").read_text()
    for s in ("tiny-llama", "tiny-peagle", "mt_bench", "humaneval", "Served K: 1..3", "2 prompts / 4 sequences",
              f"torch {torch.__version__}", "PASSED", "acc@3", "speedup"):
        assert s in md, s
    assert _is_png(tmp_path / "acceptance_by_position.png") and _is_png(tmp_path / "al_speedup_vs_k.png")
    assert res["datasets"]["mt_bench"]["by_K"][0]["K"] == 1


def test_run_eval_fails_loudly_when_not_lossless(tmp_path, monkeypatch):
    """A broken verifier that accepts every draft, with a drafter that always drafts a token the
    target does not emit: outputs diverge, the report is still written (FAILED, mismatches listed)
    and run_eval raises."""
    target, drafter = tiny_pair(K=3)
    with torch.no_grad():
        drafter.lm_head.bias.zero_()
        drafter.lm_head.bias[40] = 1e3

    def accept_all(draft_ids, target_logits):
        return draft_ids.numel(), int(target_logits[-1].argmax())

    monkeypatch.setattr(speculative, "verify_greedy", accept_all)
    cfg = EvalConfig(datasets=["mt_bench"], num_prompts=1, max_new_tokens=10, k_max=2, both_turns=False)
    with pytest.raises(LosslessError, match="differ from target-alone greedy"):
        run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=lambda name, n: PROMPTS[:n])
    res = json.loads((tmp_path / "eval.json").read_text())
    assert res["lossless"]["passed"] is False and res["lossless"]["checked"] == 2
    bad = res["lossless"]["mismatches"]
    assert len(bad) >= 1 and {"dataset", "prompt", "turn", "K", "position", "target_token"} <= set(bad[0])
    assert bad[0]["target_token"] != bad[0]["speculative_token"]
    assert "FAILED" in (tmp_path / "eval.md").read_text()


def test_k_max_above_trained_K_is_refused(tmp_path):
    target, drafter = tiny_pair(K=3)
    cfg = EvalConfig(datasets=["mt_bench"], num_prompts=1, max_new_tokens=4, k_max=4)
    with pytest.raises(ValueError, match="trained K"):
        run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=lambda name, n: PROMPTS[:n])
    assert not (tmp_path / "eval.json").exists()


def test_real_mt_bench_prompts_and_eagle3(tmp_path):
    """Default wiring: data_prep.eval_prompts + build_prompt_ids + tokenizer.decode, EAGLE-3 drafter."""
    target, drafter = tiny_pair(K=2, parallel=False)
    cfg = EvalConfig(datasets=["mt_bench"], num_prompts=1, max_new_tokens=4, k_max=2, both_turns=True)
    res = run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=2)
    assert res["method"] == "eagle3"
    assert res["datasets"]["mt_bench"]["num_sequences"] == 2 and res["lossless"]["passed"]


def test_token_prompts_are_used_verbatim_and_heldout_loader(tmp_path):
    """``heldout``: prompts given as token ids (the prepared eval split's) run as one turn, unchanged."""
    from peagle_train.eval.evaluate import TokenPrompt
    from peagle_train.stages import eval_prompt_ids, heldout_prompts

    target, drafter = tiny_pair(K=3)
    rows = [{"input_ids": [1, 7, 8, 9, 5, 5, 2], "loss_mask": [0, 0, 0, 0, 1, 1, 1]},
            {"input_ids": [1, 4, 6, 5, 2], "loss_mask": [0, 0, 1, 1, 1]}]
    assert eval_prompt_ids(rows) == [[1, 7, 8, 9], [1, 4]]
    (tmp_path / "data").mkdir()
    with pytest.raises(FileNotFoundError, match="eval_prompts.json"):
        heldout_prompts(tmp_path, 1)
    (tmp_path / "data" / "eval_prompts.json").write_text(json.dumps(eval_prompt_ids(rows)))
    prompts = heldout_prompts(tmp_path, 5)
    assert prompts == [TokenPrompt((1, 7, 8, 9)), TokenPrompt((1, 4))]

    def no_encode(messages):
        raise AssertionError("token prompts must not be re-templated")

    cfg = EvalConfig(datasets=["heldout"], num_prompts=2, max_new_tokens=10, k_max=3, both_turns=True)
    res = run_eval(target, drafter, cfg, tmp_path / "eval", target_name="t", drafter_name="d", trained_K=3,
                   load_prompts=lambda name, n: prompts[:n], encode=no_encode)
    ds = res["datasets"]["heldout"]
    assert ds["num_sequences"] == 2 and res["lossless"]["passed"]
    for row in ds["by_K"]:  # the rounds are exactly the loop's on those ids
        acc = [a for p in prompts for a in
               speculative_generate(target, drafter, list(p.ids), row["K"], 10, eos_token_id=2)[1].accepted]
        assert row["rounds"] == len(acc)


def test_run_eval_shows_a_bar_per_dataset_and_K_unless_quiet(tmp_path, capsys):
    """The eval prints progress while it decodes: one tqdm bar for target-alone decoding and one per
    served K of each dataset, counting the dataset's sequences, with generated tokens/s; none with
    ``progress=False``."""
    target, drafter = tiny_pair(K=2)
    cfg = EvalConfig(datasets=["mt_bench"], num_prompts=2, max_new_tokens=4, k_max=2, both_turns=True)
    run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=2,
             load_prompts=lambda name, n: PROMPTS[:n])
    err = capsys.readouterr().err
    for desc in ("eval[mt_bench] target alone", "eval[mt_bench] K=1", "eval[mt_bench] K=2"):
        assert f"{desc}: 100%" in err and f"{desc}:" in err, desc
    assert "4/4" in err and "tok_s=" in err  # 2 prompts x 2 turns
    run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=2,
             load_prompts=lambda name, n: PROMPTS[:n], progress=False)
    assert "eval[" not in capsys.readouterr().err


def _five_prompts_one_process(tmp_path):
    """The workers' tests' setting: ``(target, drafter, prompts, loader, cfg, one)``, ``one`` the report of one
    process over 5 prompts of two sets, both turns, K <= 3 (written under ``tmp_path / "one"``)."""
    target, drafter = tiny_pair(K=3)
    prompts = PROMPTS + [["count to five."], ["say hi."]]
    loader = lambda name, n: prompts[:n]  # noqa: E731
    cfg = EvalConfig(datasets=["mt_bench", "humaneval"], num_prompts=5, max_new_tokens=10, k_max=3, both_turns=True)
    one = run_eval(target, drafter, cfg, tmp_path / "one", target_name="t", drafter_name="d", trained_K=3,
                   load_prompts=loader, progress=False)
    return target, drafter, prompts, loader, cfg, one


def test_eval_workers_merge_into_the_single_process_report(tmp_path):
    """``run_eval(worker=(r, n))`` decodes every n-th prompt and writes its raw statistics to ``parts/``;
    ``merge_eval`` pools the n parts into the report one process writes: the same sequences, rounds, acceptance
    lengths, per-position acceptance and lossless check (timings differ); a missing part or one made with other
    settings is named, and a mismatch found by a worker is raised by the merge."""
    from peagle_train.eval.evaluate import merge_eval

    target, drafter, prompts, loader, cfg, one = _five_prompts_one_process(tmp_path)
    for r in range(2):
        part = run_eval(target, drafter, cfg, tmp_path / "two", target_name="t", drafter_name="d", trained_K=3,
                        load_prompts=loader, progress=False, worker=(r, 2))
        assert part["worker"] == [r, 2] and not (tmp_path / "two" / "eval.json").exists()
    with pytest.raises(FileNotFoundError, match="1 of 3 worker parts are missing.*worker-2-of-3.json"):
        (tmp_path / "two" / "parts" / "worker-0-of-3.json").write_text((tmp_path / "two" / "parts" / "worker-0-of-2.json").read_text())
        (tmp_path / "two" / "parts" / "worker-1-of-3.json").write_text((tmp_path / "two" / "parts" / "worker-1-of-2.json").read_text())
        merge_eval(tmp_path / "two", 3)
    two = merge_eval(tmp_path / "two", 2)
    assert json.loads((tmp_path / "two" / "eval.json").read_text())["workers"] == 2 and one["workers"] == 1
    assert "partial" not in two and "worker_devices" not in two  # one kind of device: nothing to say
    # each worker's loops: its share of the sequences' tokens (all served K and target alone) and their seconds
    loops = two["worker_loops"]
    assert [w["worker"] for w in loops] == [0, 1] and all(w["seconds"] > 0 and w["new_tokens"] > 0 for w in loops)
    every = sum(one["datasets"][n]["target_alone"]["new_tokens"] + sum(r["new_tokens"] for r in one["datasets"][n]["by_K"])
                for n in ("mt_bench", "humaneval"))
    assert sum(w["new_tokens"] for w in loops) == every
    assert loops[0]["tokens_per_s"] == pytest.approx(loops[0]["new_tokens"] / loops[0]["seconds"])
    assert two["lossless"] == one["lossless"] and two["lossless"]["checked"] == 2 * 8 * 3
    # workers on different devices (CPU workers beside a GPU's): the report names each worker's
    p1 = tmp_path / "two" / "parts" / "worker-1-of-2.json"
    saved = p1.read_text()
    p1.write_text(json.dumps(json.loads(saved) | {"hardware": {"device": "cuda", "device_name": "NVIDIA H100"}}))
    assert merge_eval(tmp_path / "two", 2)["worker_devices"] == [one["hardware"]["device_name"], "NVIDIA H100"]
    p1.write_text(saved)
    for name in ("mt_bench", "humaneval"):
        a, b = one["datasets"][name], two["datasets"][name]
        assert (a["num_prompts"], a["num_sequences"]) == (b["num_prompts"], b["num_sequences"]) == (5, 8)
        assert a["target_alone"]["new_tokens"] == b["target_alone"]["new_tokens"]
        for x, y in zip(a["by_K"], b["by_K"]):
            same = ("K", "rounds", "acceptance_length", "per_position_acceptance", "new_tokens", "mismatches")
            assert {k: x[k] for k in same} == {k: y[k] for k in same}
    # a part made with another K range is refused by name
    bad = json.loads((tmp_path / "two" / "parts" / "worker-1-of-2.json").read_text())
    bad["k_values"] = [1, 2]
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="worker 1/2 was run with other settings.*k_values"):
        merge_eval(tmp_path / "two", 2)
    good = (tmp_path / "two" / "parts" / "worker-1-of-2.json").read_text()
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(good[: len(good) // 2])  # a damaged part
    with pytest.raises(ValueError, match="worker-1-of-2.json is not a worker part.*run that worker again"):
        merge_eval(tmp_path / "two", 2)
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(good)
    with pytest.raises(ValueError, match="need 0 <= rank < world"):
        run_eval(target, drafter, cfg, tmp_path / "x", target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=loader, progress=False, worker=(2, 2))
    # a worker that finds a mismatch only records it; the merge raises after writing the report
    part = json.loads((tmp_path / "two" / "parts" / "worker-0-of-2.json").read_text())
    rec = {"dataset": "mt_bench", "prompt": 0, "turn": 1, "K": 2, "position": 3, "target_token": 5,
           "speculative_token": 6, "target_len": 10, "speculative_len": 10, "target_top2_margin": 0.1}
    part["datasets"]["mt_bench"]["found"] = [rec]
    part["datasets"]["mt_bench"]["bad_k"]["2"] = 1
    (tmp_path / "two" / "parts" / "worker-0-of-2.json").write_text(json.dumps(part))
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(json.dumps({**bad, "k_values": [1, 2, 3]}))
    with pytest.raises(LosslessError, match="1 of 48 speculative outputs differ"):
        merge_eval(tmp_path / "two", 2)
    assert json.loads((tmp_path / "two" / "eval.json").read_text())["lossless"]["mismatches"] == [rec]


def test_a_worker_stopped_early_leaves_the_sets_it_finished_and_a_partial_merge_reports_them(tmp_path):
    """A worker writes its part after every set: one stopped during its second set (a job's time limit; here its
    prompt loader fails) leaves the first, marked incomplete. The merge refuses incomplete parts by worker and
    set; ``partial=True`` reports the sets every worker finished, each the same as one process's report of
    that set, and names the others in ``partial``. A set no worker finished everywhere is refused."""
    from peagle_train.eval.evaluate import merge_eval

    target, drafter = tiny_pair(K=3)
    prompts = PROMPTS + [["count to five."], ["say hi."]]
    cfg = EvalConfig(datasets=["mt_bench", "humaneval"], num_prompts=4, max_new_tokens=10, k_max=3, both_turns=True)
    one = run_eval(target, drafter, cfg, tmp_path / "one", target_name="t", drafter_name="d", trained_K=3,
                   load_prompts=lambda name, n: prompts[:n], progress=False)

    def stops_at_humaneval(name, n):
        if name == "humaneval":
            raise TimeoutError("the job's time is up")
        return prompts[:n]

    part = run_eval(target, drafter, cfg, tmp_path / "two", target_name="t", drafter_name="d", trained_K=3,
                    load_prompts=lambda name, n: prompts[:n], progress=False, worker=(0, 2))
    assert part["complete"] is True and part["datasets_planned"] == ["mt_bench", "humaneval"]
    with pytest.raises(TimeoutError):
        run_eval(target, drafter, cfg, tmp_path / "two", target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=stops_at_humaneval, progress=False, worker=(1, 2))
    left = json.loads((tmp_path / "two" / "parts" / "worker-1-of-2.json").read_text())
    assert left["complete"] is False and list(left["datasets"]) == ["mt_bench"]
    with pytest.raises(ValueError, match=r"1 of 2 workers stopped before their last set: 1 \(finished: mt_bench\)"):
        merge_eval(tmp_path / "two", 2)
    got = merge_eval(tmp_path / "two", 2, partial=True)
    assert list(got["datasets"]) == ["mt_bench"] and got["partial"] == {"sets_left_out": ["humaneval"]}
    assert json.loads((tmp_path / "two" / "eval.json").read_text())["partial"] == {"sets_left_out": ["humaneval"]}
    a, b = one["datasets"]["mt_bench"], got["datasets"]["mt_bench"]
    assert (a["num_sequences"], a["target_alone"]["new_tokens"]) == (b["num_sequences"], b["target_alone"]["new_tokens"])
    for x, y in zip(a["by_K"], b["by_K"]):
        same = ("K", "rounds", "acceptance_length", "per_position_acceptance", "new_tokens", "mismatches")
        assert {k: x[k] for k in same} == {k: y[k] for k in same}
    left["datasets"] = {}
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(json.dumps(left))
    with pytest.raises(ValueError, match="no set was finished by all 2 workers"):
        merge_eval(tmp_path / "two", 2, partial=True)
    # a worker stopped before its first set leaves no part, not an earlier run's
    (tmp_path / "two" / "parts" / "worker-1-of-2.json").write_text(json.dumps(part))

    def stops_at_once(name, n):
        raise TimeoutError("the job's time is up")

    with pytest.raises(TimeoutError):
        run_eval(target, drafter, cfg, tmp_path / "two", target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=stops_at_once, progress=False, worker=(1, 2))
    assert not (tmp_path / "two" / "parts" / "worker-1-of-2.json").exists()


def test_claiming_workers_take_the_next_untaken_prompt_and_merge_into_the_single_process_report(tmp_path):
    """``run_eval(worker=..., claim=NAME)``: each prompt goes to the worker whose claim file for it was created first
    (``claim_prompt``: exclusive creation), so the shares follow the workers' speed, not ``i % world``. Two workers at
    once (threads) and two one after the other (the first takes every prompt, the second none) both merge into the
    one-process report; a worker stopped in its second set is covered by one that took that set's prompts, so even
    the partial merge has both sets; parts of two claim names, or one prompt in two parts, are refused."""
    import threading

    from peagle_train.eval.evaluate import claim_prompt, merge_eval

    assert claim_prompt(tmp_path / "c", "a", "mt_bench", 3, 0) is True
    assert claim_prompt(tmp_path / "c", "a", "mt_bench", 3, 1) is False
    assert claim_prompt(tmp_path / "c", "b", "mt_bench", 3, 1) is True  # another evaluation's name: its own claims
    assert (tmp_path / "c" / "parts" / "claims-a" / "mt_bench.3").read_text() == "0"

    target, drafter, prompts, loader, cfg, one = _five_prompts_one_process(tmp_path)
    same = ("K", "rounds", "acceptance_length", "per_position_acceptance", "new_tokens", "mismatches")

    def agrees(rep):
        for name in ("mt_bench", "humaneval"):
            a, b = one["datasets"][name], rep["datasets"][name]
            assert (a["num_sequences"], a["target_alone"]["new_tokens"]) == (b["num_sequences"],
                                                                               b["target_alone"]["new_tokens"])
            for x, y in zip(a["by_K"], b["by_K"]):
                assert {k: x[k] for k in same} == {k: y[k] for k in same}

    def work(out, r, claim, load=loader, errors=None, pair=(target, drafter)):
        try:
            run_eval(*pair, cfg, out, target_name="t", drafter_name="d", trained_K=3, load_prompts=load,
                     progress=False, worker=(r, 2), claim=claim)
        except Exception as e:  # noqa: BLE001 -- re-raised by the test's thread below
            errors.append(e)

    errors: list = []
    # two processes' worth: each thread its own (identical, seeded) target and drafter, as each worker process has
    pairs = [(target, drafter), tiny_pair(K=3)]
    threads = [threading.Thread(target=work, args=(tmp_path / "two", r, "run1", loader, errors, pairs[r]))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    parts = [json.loads((tmp_path / "two" / "parts" / f"worker-{r}-of-2.json").read_text()) for r in range(2)]
    for name in ("mt_bench", "humaneval"):
        held = [pi for p in parts for pi in p["prompts"][name]]
        assert sorted(held) == list(range(5)), held  # every prompt once, whichever worker took it
    agrees(merge_eval(tmp_path / "two", 2))
    # one after the other: the first takes every prompt, the second's sets are empty shares
    for r in range(2):
        work(tmp_path / "seq", r, "run2", errors=errors)
    second = json.loads((tmp_path / "seq" / "parts" / "worker-1-of-2.json").read_text())
    assert second["prompts"] == {"mt_bench": [], "humaneval": []} and second["complete"] is True
    rep = merge_eval(tmp_path / "seq", 2)
    agrees(rep)
    assert rep["worker_loops"][1]["new_tokens"] == 0
    # the first worker stopped in its second set: the second took that set's prompts, so both sets are whole
    def stops_at_humaneval(name, n):
        if name == "humaneval":
            raise TimeoutError("the job's time is up")
        return prompts[:n]

    work(tmp_path / "cut", 0, "run3", stops_at_humaneval, errors)
    assert isinstance(errors.pop(), TimeoutError)
    work(tmp_path / "cut", 1, "run3", errors=errors)
    assert not errors
    with pytest.raises(ValueError, match="stopped before their last set"):
        merge_eval(tmp_path / "cut", 2)
    got = merge_eval(tmp_path / "cut", 2, partial=True)
    assert "partial" not in got
    agrees(got)
    # parts of two evaluations, or one prompt twice, are refused
    p1 = tmp_path / "seq" / "parts" / "worker-1-of-2.json"
    p1.write_text(json.dumps(second | {"claim": "other"}))
    with pytest.raises(ValueError, match="different evaluations"):
        merge_eval(tmp_path / "seq", 2)
    p1.write_text(json.dumps(second | {"prompts": {"mt_bench": [0], "humaneval": []}}))
    with pytest.raises(ValueError, match="prompt 0 of mt_bench is in two of the 2 parts"):
        merge_eval(tmp_path / "seq", 2)
    with pytest.raises(ValueError, match="give it with worker"):
        run_eval(target, drafter, cfg, tmp_path / "x", target_name="t", drafter_name="d", trained_K=3,
                 load_prompts=loader, progress=False, claim="run4")


def test_a_claiming_worker_run_again_continues_from_its_part_and_a_merge_refuses_undecoded_prompts(tmp_path):
    """A claiming worker stopped in its second set, run again under the same claim name, keeps the prompts its part
    holds (not decoded again), takes back the prompt it was decoding when it stopped (its claim file without a
    result: released) and finishes; the merge then equals one process's report. Parts that all say complete but leave
    a prompt undecoded are refused by the plain merge, naming it; under another claim name nothing is continued."""
    from peagle_train.eval.evaluate import merge_eval, release_claims

    target, drafter, prompts, loader, cfg, one = _five_prompts_one_process(tmp_path)
    out = tmp_path / "two"
    seen = []

    def counting(name, n):
        seen.append(name)
        return prompts[:n]

    def stops_at_humaneval(name, n):
        if name == "humaneval":
            raise TimeoutError("the job's time is up")
        return prompts[:n]

    run = lambda r, load, claim="c1": run_eval(target, drafter, cfg, out, target_name="t", drafter_name="d",  # noqa: E731
                                               trained_K=3, load_prompts=load, progress=False, worker=(r, 2),
                                               claim=claim)
    with pytest.raises(TimeoutError):
        run(0, stops_at_humaneval)
    first = json.loads((out / "parts" / "worker-0-of-2.json").read_text())
    assert first["prompts"] == {"mt_bench": [0, 1, 2, 3, 4]} and first["complete"] is False
    (out / "parts" / "claims-c1" / "humaneval.2").write_text("0")  # the prompt it was decoding when it stopped
    assert release_claims(out, "c1", "humaneval", 1, keep=[]) == []  # another worker's claims are not released
    part = run(0, counting)  # the same name: continues
    assert part["complete"] is True and part["prompts"]["mt_bench"] == [0, 1, 2, 3, 4]
    assert part["prompts"]["humaneval"] == [0, 1, 2, 3, 4]  # prompt 2 released and taken back
    assert part["datasets"]["mt_bench"] == first["datasets"]["mt_bench"]  # kept as it was, not decoded again
    run(1, loader)
    rep = merge_eval(out, 2)
    for name in ("mt_bench", "humaneval"):
        a, b = one["datasets"][name], rep["datasets"][name]
        assert (a["num_sequences"], a["target_alone"]["new_tokens"]) == (b["num_sequences"], b["target_alone"]["new_tokens"])
        assert [x["acceptance_length"] for x in a["by_K"]] == [y["acceptance_length"] for y in b["by_K"]]
    # complete parts that leave a prompt undecoded (a claims folder reused): the plain merge names it
    p0 = out / "parts" / "worker-0-of-2.json"
    held = json.loads(p0.read_text())
    held["prompts"]["humaneval"] = [0, 1, 3, 4]
    p0.write_text(json.dumps(held))
    with pytest.raises(ValueError, match=r"leave prompts undecoded \({'humaneval': \[2\]}\)"):
        merge_eval(out, 2)
    assert list(merge_eval(out, 2, partial=True)["datasets"]) == ["mt_bench"]
    # another claim name: the part is not continued (a new evaluation)
    part = run(0, loader, claim="c2")
    assert part["prompts"] == {"mt_bench": [0, 1, 2, 3, 4], "humaneval": [0, 1, 2, 3, 4]} and part["claim"] == "c2"


def test_eval_worker_flags_are_checked_before_anything_loads(tmp_path, capsys):
    """``peagle-train eval RECIPE --eval-worker R/W`` / ``--eval-merge W``: a malformed or out-of-range worker, both
    flags at once, or a merge of fewer than one worker exit 2 with the fix, before the target loads."""
    from pathlib import Path

    from peagle_train.cli import main

    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml")
    out = f"output_dir={tmp_path / 'run'}"
    for flags, said in ((["--eval-worker", "2/2"], "need 0 <= rank < world"),
                        (["--eval-worker", "one/2"], "expected RANK/WORLD"),
                        (["--eval-worker", "0/2", "--eval-merge", "2"], "not both"),
                        (["--eval-merge", "0"], "give the number of workers"),
                        (["--eval-partial"], "--eval-partial goes with --eval-merge"),
                        (["--eval-claim", "x"], "--eval-claim goes with --eval-worker"),
                        (["--eval-worker", "0/2", "--eval-claim", "a b"], "one plain word")):
        assert main(["eval", recipe, out, *flags, "--quiet"]) == 2, flags
        assert said in capsys.readouterr().err, flags
    assert not (tmp_path / "run").exists()


def test_k_values_evaluates_only_those_served_k(tmp_path):
    """``eval.k_values``: only those served K are decoded (ascending), each checked against the target; values
    outside ``1..k_max``, repeated or none are refused naming the key."""
    target, drafter = tiny_pair(K=3)
    cfg = EvalConfig(datasets=["humaneval"], num_prompts=2, max_new_tokens=8, k_max=3, k_values=[3, 1])
    res = run_eval(target, drafter, cfg, tmp_path, target_name="t", drafter_name="d", trained_K=3,
                   load_prompts=lambda name, n: PROMPTS[:n], progress=False)
    assert res["k_values"] == [1, 3] and [r["K"] for r in res["datasets"]["humaneval"]["by_K"]] == [1, 3]
    assert res["lossless"]["checked"] == 4 * 2  # 2 prompts x 2 turns, 2 served K
    for bad in ([0, 1], [4], [1, 1], []):
        with pytest.raises(ValueError, match="eval.k_values"):
            EvalConfig(k_max=3, k_values=bad)


def test_eval_reports_the_copyable_share_of_the_targets_output(monkeypatch, tmp_path):
    """``target_alone.copyable``: the share of the target's new tokens a 4-token lookup in their context predicts,
    summed over sequences (and over eval workers' shares)."""
    import peagle_train.eval.evaluate as ev
    from peagle_train.peagle.spec_stats import SpecStats, TargetStats

    refs = {(1, 2): [5, 6, 7, 8] * 4 + [0],  # a 4-token loop, then EOS (0, not counted): answer tokens 9-16 are
            (3, 4): list(range(20, 36))}     # copyable (8 of 16; the first repeat is not); 16 fresh tokens: none
    monkeypatch.setattr(ev, "target_generate", lambda t, ids, n, eos_token_id=None, runner=None: (
        refs[tuple(ids)], TargetStats(0.0, 1.0, 16)))
    monkeypatch.setattr(ev, "speculative_generate", lambda t, d, ids, k, n, eos_token_id=None, runner=None: (
        refs[tuple(ids)], SpecStats(K=k, accepted=[0], draft_s=[0.0], verify_s=[0.0], total_s=1.0, new_tokens=16)))
    cfg = EvalConfig(datasets=["humaneval"], num_prompts=2, max_new_tokens=16, k_max=1, both_turns=False)
    prompts = [ev.TokenPrompt([1, 2]), ev.TokenPrompt([3, 4])]
    one = ev._decode_set(None, None, "humaneval", prompts, [0, 1], cfg, [1], [0], None, None, [True], False, None)
    assert one.copyable == [8, 32]
    # the copyable count of data_prep.loops on the answer after its prompt: 4 tokens of context, then the loop
    shares = [ev._decode_set(None, None, "humaneval", prompts, [i], cfg, [1], [0], None, None, [True], False, None)
              for i in (0, 1)]
    merged = ev._RawSet.from_dict(shares[0].to_dict()).add(ev._RawSet.from_dict(shares[1].to_dict()))
    assert merged.copyable == [8, 32] and [s.copyable for s in shares] == [[8, 16], [0, 16]]
    head = {"target": "t", "drafter": "d", "method": "peagle", "trained_K": 1, "k_values": [1], "max_new_tokens": 16,
            "both_turns": False, "decoding": "greedy",
            "hardware": {"device": "cpu", "device_name": "cpu", "cpu_cores": 2, "torch": "x", "transformers": "x"}}
    rep = ev._report(head, {"humaneval": merged}, [1], tmp_path, workers=2)
    assert rep["datasets"]["humaneval"]["target_alone"]["copyable"] == 0.25
    assert "copyable by a 4-token lookup in their context: 0.25" in (tmp_path / "eval.md").read_text()
    # a worker part written before the field: the merged share is unknown (None), not a share of some workers
    old = shares[1].to_dict()
    del old["copyable"]
    partial = ev._RawSet.from_dict(shares[0].to_dict()).add(ev._RawSet.from_dict(old))
    assert partial.copyable is None
    rep = ev._report(head, {"humaneval": partial}, [1], tmp_path / "old", workers=2)
    assert rep["datasets"]["humaneval"]["target_alone"]["copyable"] is None


def test_eval_compile_target_decodes_as_the_default_and_says_which_forward_ran(tmp_path):
    """eval.compile_target: the target's forwards through one static KV cache (compiled with CUDA graphs on a GPU,
    eager on this CPU) give the default's acceptance lengths, per-position acceptance, tokens and lossless check;
    eval.json names the kind of forward that ran, also after a merge of workers."""
    from peagle_train.eval.evaluate import merge_eval

    target, drafter = tiny_pair(K=3)
    loader = lambda name, n: PROMPTS[:n]  # noqa: E731
    base = dict(datasets=["mt_bench"], num_prompts=2, max_new_tokens=12, k_max=3, both_turns=True)
    dyn = run_eval(target, drafter, EvalConfig(**base), tmp_path / "dyn", target_name="t", drafter_name="d",
                   trained_K=3, load_prompts=loader, progress=False)
    sta = run_eval(target, drafter, EvalConfig(**base, compile_target=True), tmp_path / "sta", target_name="t",
                   drafter_name="d", trained_K=3, load_prompts=loader, progress=False)
    assert (dyn["target_runner"], sta["target_runner"]) == ("dynamic", "static")
    assert sta["target_runner_fallback"] is None and sta["lossless"] == dyn["lossless"]
    same = ("K", "rounds", "acceptance_length", "per_position_acceptance", "new_tokens", "mismatches")
    for x, y in zip(dyn["datasets"]["mt_bench"]["by_K"], sta["datasets"]["mt_bench"]["by_K"]):
        assert {k: x[k] for k in same} == {k: y[k] for k in same}
    for r in range(2):
        run_eval(target, drafter, EvalConfig(**base, compile_target=True), tmp_path / "two", target_name="t",
                 drafter_name="d", trained_K=3, load_prompts=loader, progress=False, worker=(r, 2))
    merged = merge_eval(tmp_path / "two", 2)
    assert merged["target_runner"] == "static" and merged["target_runner_cudagraph_skips"] == []
    assert sta["target_runner_cudagraph_skips"] == [] == dyn["target_runner_cudagraph_skips"]
    # a worker whose compiled forward ran without CUDA graphs: the merged report lists each reason once
    for r in range(2):
        p = tmp_path / "two" / "parts" / f"worker-{r}-of-2.json"
        part = json.loads(p.read_text()) | {"target_runner_cudagraph_skips": ["skipping cudagraphs due to X"]}
        p.write_text(json.dumps(part))
    assert merge_eval(tmp_path / "two", 2)["target_runner_cudagraph_skips"] == ["skipping cudagraphs due to X"]
