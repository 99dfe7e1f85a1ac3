"""benchmarks/quality_report.py: the P-EAGLE vs EAGLE-3 comparison tables from the experiment's files."""
import json
from pathlib import Path

import pytest
import quality_report  # benchmarks/ is on sys.path (conftest)

ROOT = Path(__file__).resolve().parents[2]


def _eval(al7: float, draft_ms: list[float]) -> dict:
    rows = [{"K": k, "acceptance_length": 1 + (al7 - 1) * k / 7, "draft_ms_per_round": draft_ms[k - 1],
             "speedup": 1.0 + 0.01 * k} for k in range(1, 8)]
    return {"datasets": {d: {"by_K": rows} for d in ("mt_bench", "humaneval", "heldout")}}


def test_comparison_tables(tmp_path):
    names = quality_report.NAMES
    (tmp_path / f"{names['peagle']}-eval.json").write_text(json.dumps(_eval(2.4, [4.0] * 6 + [4.4])))
    (tmp_path / f"{names['eagle3']}-eval.json").write_text(json.dumps(_eval(2.0, [1.0 * k for k in range(1, 8)])))
    final = {"eval_walk_al_heldout": {"7": 2.5}, "eval_sim_al": {"7": 2.9}, "eval_loss": 1.5}
    (tmp_path / f"{names['peagle']}-train-metrics.json").write_text(json.dumps({"steps": 10, "final": final}))
    md, data = quality_report.build(tmp_path)
    assert data["acceptance_length"]["mt_bench/K7"]["ratio"] == pytest.approx(1.2)
    assert data["draft_ms"]["peagle"]["K7_over_K1"] == pytest.approx(1.1)
    assert data["draft_ms"]["eagle3"]["K7_over_K1"] == pytest.approx(7.0)
    gap = data["sim_vs_measured"]["peagle/K7"]
    assert gap["measured"] == pytest.approx(2.4) and gap["relative_gap"] == pytest.approx(2.4 / 2.5 - 1)
    assert data["sim_vs_measured"]["eagle3/K7"]["simulated"] is None  # no train metrics: shown as a dash
    assert "| mt_bench | 7 | 2.40 | 2.00 | 1.20 |" in md and "-4.0 %" in md
    assert quality_report.main([str(tmp_path)]) == 0 and (tmp_path / "comparison.json").exists()
    png = tmp_path / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_comparison_of_arms_from_two_folders(tmp_path):
    """--eagle3: the EAGLE-3 arm's files from a folder of their own (a lease of its own), the tables and plot written
    to --out; the committed run 8 comparison is this build of run 7 and run 8."""
    names = quality_report.NAMES
    pe, e3, out = (tmp_path / n for n in ("pe", "e3", "out"))
    for d in (pe, e3, out):
        d.mkdir()
    (pe / f"{names['peagle']}-eval.json").write_text(json.dumps(_eval(2.4, [4.0] * 7)))
    (e3 / f"{names['eagle3']}-eval.json").write_text(json.dumps(_eval(2.0, [1.0 * k for k in range(1, 8)])))
    (e3 / f"{names['eagle3']}-train-metrics.json").write_text(json.dumps({"steps": 3, "final": {"eval_loss": 0.5}}))
    md, data = quality_report.build(pe, eagle3=e3)
    assert data["acceptance_length"]["mt_bench/K7"]["ratio"] == pytest.approx(1.2) and data["train"]["eagle3"]["steps"] == 3
    assert quality_report.main([str(pe), "--eagle3", str(e3), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["comparison.json", "comparison.md", "comparison.png"]
    assert not (pe / "comparison.md").exists()
    run7, run8 = (ROOT / "docs" / "data" / "quality" / r for r in ("run7", "run8"))
    md8, data8 = quality_report.build(run7, eagle3=run8)
    assert md8 == (run8 / "comparison.md").read_text()
    assert data8["acceptance_length"]["mt_bench/K7"]["ratio"] == pytest.approx(1.128, abs=1e-3)


def test_missing_reports_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="eval step"):
        quality_report.build(tmp_path)


def test_must_show_record_of_the_committed_run3(tmp_path):
    """benchmarks/must_show_quality.py on run3's raw files: the issue's shape, figures read from the right rows,
    and checks that fail where run3 fell short (5 prompts, AL 1.41, no fourth draft accepted)."""
    import must_show_quality as ms

    run3 = ROOT / "docs" / "data" / "quality" / "run3"
    out = tmp_path / "quality.json"
    assert ms.main([str(run3), str(out), "--commit", "abc", "--sources-prefix", "docs/data/quality/run3"]) == 0
    rec = json.loads(out.read_text())
    assert rec["commit"] == "abc" and rec["prompts_per_set"] == 5 and rec["lossless"] is True
    assert rec["al"]["mt_bench"]["peagle"]["7"] == pytest.approx(1.4116, abs=1e-4)
    assert rec["al"]["humaneval"]["eagle3"]["7"] == pytest.approx(1.1932, abs=1e-4)
    assert rec["acc_by_position"]["mt_bench"]["peagle"][:4] == pytest.approx([0.3311, 0.1959, 0.2414, 0.0], abs=1e-4)
    # the last step's elapsed_s (210.17 s), not train_seconds (214.96 s, which a resumed run counts from its last leg)
    assert rec["train_tokens"] == 3653597 and rec["gpu_minutes"]["peagle"] == pytest.approx(210.166 / 60, abs=1e-3)
    assert rec["sim_vs_measured_rel_err"] == pytest.approx(abs(1.4744 - 1.4953) / 1.4953, abs=1e-3)
    assert rec["draft_cost_k7_over_k1"] == pytest.approx(1.1165, abs=1e-4)
    c = rec["checks"]
    assert c["draft_cost_k7_over_k1_le_1.3"]["holds"] and c["sim_vs_measured_within_5pct"]["holds"]
    assert rec["eval_workers"] == 1 and rec["target_copyable"]["mt_bench"] is None  # run3 predates both fields
    # timings of several eval processes sharing the GPU are not the loop's: the cost check cannot hold on them
    for name in ("peagle", "eagle3"):
        f = f"smollm2-135m-{name}-gpu-eval.json"
        (tmp_path / "r8").mkdir(exist_ok=True)
        (tmp_path / "r8" / f).write_text(json.dumps(json.loads((run3 / f).read_text()) | {"workers": 8}))
    for f in ("data_meta.json", "smollm2-135m-peagle-gpu-train-metrics.json", "smollm2-135m-eagle3-gpu-train-metrics.json"):
        (tmp_path / "r8" / f).write_text((run3 / f).read_text())
    c8 = ms.build(tmp_path / "r8", "abc", "x")["checks"]["draft_cost_k7_over_k1_le_1.3"]
    assert c8["eval_workers"] == 8 and not c8["holds"]
    # the eval step's single-process cost pass (NAME-cost-eval.json, K = 1 and 7 on MT-Bench) is read instead
    pe3 = json.loads((run3 / "smollm2-135m-peagle-gpu-eval.json").read_text())
    rows = [r for r in pe3["datasets"]["mt_bench"]["by_K"] if r["K"] in (1, 7)]
    rows[0] = rows[0] | {"draft_ms_per_round": 4.0}
    rows[1] = rows[1] | {"draft_ms_per_round": 4.8}
    (tmp_path / "r8" / "smollm2-135m-peagle-gpu-cost-eval.json").write_text(
        json.dumps(pe3 | {"workers": 1, "datasets": {"mt_bench": pe3["datasets"]["mt_bench"] | {"by_K": rows}}}))
    r8 = ms.build(tmp_path / "r8", "abc", "x")
    c8 = r8["checks"]["draft_cost_k7_over_k1_le_1.3"]
    assert c8["eval_workers"] == 1 and c8["value"] == pytest.approx(1.2) and c8["holds"]
    assert r8["sources"]["draft_cost_k7_over_k1"] == "x/smollm2-135m-peagle-gpu-cost-eval.json"
    assert r8["al"]["mt_bench"]["peagle"]["7"] == pytest.approx(1.4116, abs=1e-4)  # the AL still from the main eval
    assert not c["prompts_per_set_ge_20"]["holds"] and not c["al7_mt_bench_ge_2.0"]["holds"]
    assert not c["acc4_humaneval_gt_0"]["holds"] and c["al7_minus_al3_mt_bench_ge_0.15"]["value"] == 0.0
    assert rec["all_hold"] is False
    assert rec["sources"]["train_tokens"] == "docs/data/quality/run3/data_meta.json"
    for s in rec["sources"].values():  # every cited file exists in the repository
        assert all((ROOT / p.strip()).is_file() for p in s.split(",")), s


def test_must_show_record_of_run7_without_an_eagle3_arm(tmp_path):
    """Run 7 trained P-EAGLE alone (DRAFTERS=peagle): the record holds its figures, EAGLE-3's are null and the ratio
    checks short ("not measured"); a cost pass of one process gives the drafting cost."""
    import must_show_quality as ms

    run7 = ROOT / "docs" / "data" / "quality" / "run7"
    rec = ms.build(run7, "fe7bad0", "docs/data/quality/run7")
    assert rec["al"]["mt_bench"]["peagle"]["7"] == pytest.approx(2.2309, abs=1e-4)
    assert rec["al"]["humaneval"]["peagle"]["3"] == pytest.approx(1.6936, abs=1e-3)
    assert rec["al"]["mt_bench"]["eagle3"] is None and rec["gpu_minutes"]["eagle3"] is None
    assert rec["gpu_minutes"]["peagle"] == pytest.approx(12.0, abs=0.05)
    c = rec["checks"]
    assert c["ratio_k7_mt_bench_ge_1.2"] == {"value": None, "holds": False, "why": "EAGLE-3 not measured in this run"}
    assert c["al7_mt_bench_ge_2.0"]["holds"] and not c["al7_humaneval_ge_2.2"]["holds"]
    assert c["draft_cost_k7_over_k1_le_1.3"]["eval_workers"] == 1 and c["draft_cost_k7_over_k1_le_1.3"]["holds"]
    assert rec["all_hold"] is False and rec["prompts_per_set"] == 20 and rec["lossless"] is True
    assert "eagle3" not in rec["sources"]["al.mt_bench"]
    assert "arms_equal_gpu_minutes_and_device" not in c and rec["eagle3_commit"] is None
    for s in rec["sources"].values():
        assert all((ROOT / p.strip()).is_file() for p in s.split(",")), s


def test_must_show_record_of_run7_with_run8s_eagle3_arm(tmp_path):
    """The EAGLE-3 arm trained in a lease of its own (run 8, same data and minutes): its folder is read beside run 7's
    P-EAGLE files, its files cited by their path, the ratio measured (1.13, short of 1.2); arms on different data are
    refused, arms of unequal minutes or devices do not count for the ratio; the committed quality.json is this build."""
    import must_show_quality as ms

    run7, run8 = (ROOT / "docs" / "data" / "quality" / r for r in ("run7", "run8"))
    rec = ms.build(run7, "fe7bad0", "docs/data/quality/run7", run8, "ae7ff49")
    assert rec["al"]["mt_bench"]["eagle3"]["7"] == pytest.approx(1.9775, abs=1e-3)
    assert rec["al"]["humaneval"]["eagle3"]["7"] == pytest.approx(1.5451, abs=1e-3)
    assert rec["gpu_minutes"]["eagle3"] == pytest.approx(12.01, abs=0.01) and rec["tokens_seen"]["eagle3"] == 29737372
    c = rec["checks"]
    assert c["arms_equal_gpu_minutes_and_device"]["holds"] and c["arms_equal_gpu_minutes_and_device"]["value"] < 0.002
    for d in ("mt_bench", "humaneval"):
        r = c[f"ratio_k7_{d}_ge_1.2"]
        assert r["value"] == pytest.approx(rec["al"][d]["peagle"]["7"] / rec["al"][d]["eagle3"]["7"])
        assert 1.1 < r["value"] < 1.2 and not r["holds"]
    assert rec["commit"] == "fe7bad0" and rec["eagle3_commit"] == "ae7ff49"
    assert str(run8) + "/smollm2-135m-eagle3-gpu-eval.json" in rec["sources"]["al.mt_bench"]
    # the committed record: built with repository paths (python benchmarks/must_show_quality.py docs/data/quality/run7
    # docs/data/must_show/quality.json --commit fe7bad0 --sources-prefix docs/data/quality/run7 --eagle3
    # docs/data/quality/run8 --eagle3-commit ae7ff49, run from the repository root)
    committed = json.loads((ROOT / "docs" / "data" / "must_show" / "quality.json").read_text())
    rel = json.loads(json.dumps(rec).replace(str(run8), "docs/data/quality/run8"))
    assert committed == rel
    for s in committed["sources"].values():
        assert all((ROOT / p.strip()).is_file() for p in s.split(",")), s
    # an EAGLE-3 arm on other data is refused, naming both files; nothing is built
    other = tmp_path / "e3"
    other.mkdir()
    for f in run8.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    meta = json.loads((run8 / "data_meta.json").read_text())
    (other / "data_meta.json").write_text(json.dumps(meta | {"seconds": 1.0}))  # prepared again: same data, other time
    assert ms.build(run7, "a", "x", other, "b")["al"]["mt_bench"]["eagle3"] is not None
    (other / "data_meta.json").write_text(json.dumps(meta | {"splits": meta["splits"] | {"train": {"tokens": 1}}}))
    with pytest.raises(ValueError, match="data_meta.json differs"):
        ms.build(run7, "a", "x", other, "b")
    with pytest.raises(SystemExit, match="differs"):
        ms.main([str(run7), str(tmp_path / "q.json"), "--eagle3", str(other)])
    assert not (tmp_path / "q.json").exists()
    # unequal minutes: the arms check and so the ratio checks fail, whatever the ratio
    (other / "data_meta.json").write_bytes((run8 / "data_meta.json").read_bytes())
    curve = json.loads((run8 / "smollm2-135m-eagle3-gpu-curve.json").read_text())
    (other / "smollm2-135m-eagle3-gpu-curve.json").write_text(json.dumps(curve | {"gpu_minutes": 6.0}))
    ev = json.loads((run8 / "smollm2-135m-eagle3-gpu-eval.json").read_text())
    for d in ev["datasets"].values():
        for row in d["by_K"]:
            row["acceptance_length"] = 1.01
    (other / "smollm2-135m-eagle3-gpu-eval.json").write_text(json.dumps(ev))
    c2 = ms.build(run7, "a", "x", other, "b")["checks"]
    assert not c2["arms_equal_gpu_minutes_and_device"]["holds"] and c2["ratio_k7_mt_bench_ge_1.2"]["value"] > 2
    assert not c2["ratio_k7_mt_bench_ge_1.2"]["holds"]


def test_must_show_record_names_a_missing_report(tmp_path):
    import must_show_quality as ms

    with pytest.raises(FileNotFoundError, match="peagle-gpu-eval.json: missing"):
        ms.build(tmp_path, "abc", "x")


def test_eval_repetition_counts_the_targets_copyable_answers():
    """benchmarks/eval_repetition.py: the target's answers (a looping one and a fresh one) counted by the rule of
    data_prep.loops, the prompt as context; EOS not counted; turn 2 asked after the target's own turn-1 answer."""
    import eval_repetition as er

    seen = []

    def encode(history):
        seen.append([m["role"] for m in history])
        return [1, 2, 3] if len(history) == 1 else [1, 2, 3, 9, 9, 4]

    answers = iter([[5, 6, 7, 8] * 4 + [0], list(range(20, 36))])  # loop then EOS (0); 16 fresh tokens at the cap
    rep = er.answers_report([["q1", "q2"]], encode, lambda ids: next(answers), lambda ids: "answer", [0], True)
    assert seen == [["user"], ["user", "assistant", "user"]]
    assert rep["sequences"] == 2 and rep["supervised_tokens"] == 32 and rep["ended_at_eos"] == 1
    assert rep["copyable"] == pytest.approx(8 / 32) and rep["mean_answer_tokens"] == 16.0
    assert rep["by_position"]["[0, 64)"] == {"tokens": 32, "copyable": 0.25}


def test_eval_repetition_keeps_the_answer_ids_in_decoding_order():
    """``answers_report(..., keep=[])`` records each answer's prompt and token ids (EOS included), prompt index and
    turn from 0, in the order the eval stage decodes them (benchmarks/acceptance_by_copyable.py relies on it)."""
    import eval_repetition as er

    answers = iter([[5, 0], [6, 7], [8, 0]])
    kept: list = []
    er.answers_report([["a1", "a2"], ["b1", "b2"]], lambda h: [len(h)], lambda ids: next(answers),
                      lambda ids: "x", [0], False, kept)
    assert kept == [{"prompt": 0, "turn": 0, "prompt_ids": [1], "answer_ids": [5, 0]},
                    {"prompt": 1, "turn": 0, "prompt_ids": [1], "answer_ids": [6, 7]}]


def test_acceptance_by_copyable_classes_each_round_by_the_token_it_drafts(tmp_path):
    """Rounds are placed on the answer from their accepted counts (the prefill gives position 0) and classed by the
    copyable flag of the token they draft first; workers' prompts are matched by ``i % N == r`` (claiming workers':
    by the prompts their parts list); a sequence of
    another length is skipped and counted; a missing rank or a sequence count that does not match is refused."""
    import acceptance_by_copyable as abc

    assert abc.round_starts([0, 2, 1]) == [1, 2, 5]
    loop = [5, 6, 7, 8] * 3 + [0]  # positions 8..11 copyable (5,6,7,8 seen after 5,6,7,8), EOS at 12 is not
    fresh = list(range(20, 33))     # 13 fresh tokens
    answers = {"eos": [0], "sets": {"mt_bench": [
        {"prompt": 0, "turn": 0, "prompt_ids": [1, 2], "answer_ids": loop},
        {"prompt": 1, "turn": 0, "prompt_ids": [1, 2], "answer_ids": fresh},
        {"prompt": 2, "turn": 0, "prompt_ids": [1, 2], "answer_ids": fresh[:5]}]}}
    assert abc.classify([1, 2], loop, [0]) == [False] * 8 + [True] * 4 + [False]
    # loop: round starts 1,2,3,4,5,6,7 (a=0 each), then 8 (a=3 -> next 12), 12 (a=0): copyable round at 8 only
    spec = lambda acc, n: {"accepted": acc, "new_tokens": n}  # noqa: E731
    w0 = {"datasets": {"mt_bench": {"sequences": 2, "per_k": {"3": [spec([0] * 7 + [3, 0], 13), spec([0] * 4, 5)]}}}}
    # worker 1: prompt 1, fresh: starts 1, 3 (a=1 each) ... every round fresh
    w1 = {"datasets": {"mt_bench": {"sequences": 1, "per_k": {"3": [spec([1] * 6, 13)]}}}}
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "worker-0-of-2.json").write_text(json.dumps(w0))
    (parts / "worker-1-of-2.json").write_text(json.dumps(w1))
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    res = abc.main([str(parts), str(tmp_path / "answers.json"), "--out", str(tmp_path / "r.json")])
    s = res["sets"]["mt_bench"]
    # prompt 2's answer has 5 tokens and its eval sequence 5: used; all 3 sequences are used
    assert (s["sequences"], s["skipped"]) == (3, 0)
    row = s["per_k"]["3"]
    assert row["copyable"] == {"rounds": 1, "acc1": 1.0, "mean_accepted": 3.0}
    # fresh rounds: loop seq 8 (7 before + the one at 12), prompt 2: 4 (starts 1..4), prompt 1: 6 (starts 1,3,..,11)
    assert row["fresh"]["rounds"] == 18 and row["fresh"]["acc1"] == pytest.approx(6 / 18, abs=1e-4)
    assert json.loads((tmp_path / "r.json").read_text())["sets"]["mt_bench"]["per_k"]["3"] == row
    # the weightless prompt-lookup drafter on the same answers, K = 3: the loop answer [5,6,7,8]*3 + EOS walks
    # 1 (draft [] -> 0), 2, 3, 4 (0 each; no earlier 6/7/8), 5: [5,6,7,8] seen before -> drafts 6,7,8: 3
    # accepted -> 9: drafts 6,7,8 -> 3 -> 13 = end; fresh answers accept nothing
    assert abc.lookup_draft([1, 2, 3, 1, 2], 2) == [3, 1] and abc.lookup_draft([4, 5], 3) == []
    assert abc.lookup_walk([1, 2], loop, 3) == [0, 0, 0, 0, 3, 3]
    walks = [[0, 0, 0, 0, 3, 3], [0] * 12, [0] * 4]
    assert row["lookup_al"] == pytest.approx(sum(a + 1 for w in walks for a in w) / 22, abs=1e-4)
    # claiming workers (peagle-train eval --eval-claim): each part lists its prompts; here worker 0 took prompt 1 and
    # worker 1 prompts 0 and 2: the same rounds, the same classes
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / "worker-0-of-2.json").write_text(json.dumps({"claim": "x", "prompts": {"mt_bench": [1]}, **w1}))
    (claimed / "worker-1-of-2.json").write_text(json.dumps({"claim": "x", "prompts": {"mt_bench": [0, 2]}, **w0}))
    assert abc.main([str(claimed), str(tmp_path / "answers.json")])["sets"]["mt_bench"]["per_k"]["3"] == row
    w1["datasets"]["mt_bench"]["per_k"]["3"][0]["new_tokens"] = 12  # decoded differently there: left out
    (parts / "worker-1-of-2.json").write_text(json.dumps(w1))
    assert abc.main([str(parts), str(tmp_path / "answers.json")])["sets"]["mt_bench"]["skipped"] == 1
    w1["datasets"]["mt_bench"]["sequences"] = 2
    (parts / "worker-1-of-2.json").write_text(json.dumps(w1))
    with pytest.raises(SystemExit, match="worker 1/2: 2 sequences in the eval, 1 in the answers file"):
        abc.main([str(parts), str(tmp_path / "answers.json")])
    (parts / "worker-1-of-2.json").unlink()
    (parts / "worker-0-of-3.json").write_text(json.dumps(w0))
    with pytest.raises(SystemExit, match="several worker counts or a missing rank"):
        abc.main([str(parts), str(tmp_path / "answers.json")])
