"""``benchmarks/quality_experiment.sh``: ``ablate`` (variant parsing, GPU waves, resume and summary) and ``leg``
/ ``state-out`` / ``ferry-groups`` / ``state-in`` (one long run in legs, its state ferried between machines).

The training command is replaced by a fake (``PEAGLE_CLI``) that records its arguments and writes what
the real ``train`` writes, so the shell logic runs in seconds on CPU. The fourth session's device run
lost its ablation to a quoting bug this test catches (the default variant list was one word).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ablation_report  # benchmarks/ is on sys.path (conftest)
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "quality_experiment.sh"

#: the fakes' common start: arguments, overrides, output_dir, one line per call in FAKE_LOG
FAKE_HEAD = r'''#!{python}
import json, os, sys, time
from pathlib import Path
args = sys.argv[1:]
over = dict(a.split("=", 1) for a in args[2:] if "=" in a)
out = Path(over["output_dir"])
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"args": args, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                         "start": time.time()}}) + "\n")
'''

FAKE_CLI = FAKE_HEAD + r'''
if out.name == "{fail}":
    print("boom: no GPU memory left", file=sys.stderr)
    sys.exit(3)
time.sleep(0.3)
K = int(over.get("train.K", 8))
per_k = lambda step: {{str(k): 1.0 + step * k for k in range(1, K + 1)}}  # walk / heldout / sim differ
evals = {{s: {{"eval_loss": 5.0, "eval_walk_al": {{str(k): 1.0 + s / 100 + k / 1000 for k in range(1, K + 1)}},
             "eval_acc1_copyable": 0.3 + s / 100, "eval_acc1_fresh": 0.2 + s / 100}}
         for s in ((5, 10) if K == 8 else (5, 8))}}
# as Trainer.fit logs: one record per step, an eval step's record also holding the eval; a 2 s stall
# (a compile) before step 7
steps = [{{"step": s, "loss": 9.0 - s / 10, "lr": 1e-4 * (11 - s), "elapsed_s": 1.0 + 0.05 * s + (2.0 if s >= 7 else 0.0),
          **evals.get(s, {{}})}} for s in range(1, 11)]
(out / "train_metrics.json").write_text(json.dumps({{
    "method": "peagle", "K": K, "steps": 10, "train_seconds": 1.5,
    "history": steps,
    "final": {{"eval_loss": 4.0, "eval_walk_al": per_k(0.01), "eval_walk_al_heldout": per_k(0.02),
              "eval_sim_al": per_k(0.03), "eval_acc": [0.4, 0.2, 0.1, 0.05],
              "eval_acc1_copyable": 0.45, "eval_acc1_fresh": 0.25, "eval_copyable_share": 0.6}}}}))
print(json.dumps({{"steps": 10}}))
'''


def _setup(tmp_path: Path, fail: str = "-") -> dict:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    work = tmp_path / "work"
    data = work / "peagle" / "data"
    data.mkdir(parents=True)
    (data / "meta.json").write_text(json.dumps({"splits": {"train": {"sequences": 100}}}))
    for f in ("train.safetensors", "eval.safetensors", "eval_prompts.json"):
        (data / f).write_text("x")
    fake = tmp_path / "fake_cli.py"
    fake.write_text(FAKE_CLI.format(python=sys.executable, fail=fail))
    fake.chmod(0o755)
    env = os.environ | {"WORK": str(work), "PEAGLE_CLI": str(fake), "FAKE_LOG": str(tmp_path / "calls.jsonl"),
                        "NGPU": "2", "ABLATE_MINUTES": "0.5",
                        # the script's python3 is the test's interpreter (run_curve.py, plot_curves.py' matplotlib)
                        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("OUT", None)
    return env


def _run(env: dict, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "ablate"], cwd=ROOT, env=env | extra, capture_output=True,
                          text=True, timeout=120)


def _calls(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_ablate_default_variants_waves_and_summary(tmp_path):
    env = _setup(tmp_path)
    r = _run(env)
    assert r.returncode == 0, r.stderr
    calls = _calls(tmp_path)
    by_name = {Path(dict(a.split("=", 1) for a in c["args"] if "=" in a)["output_dir"]).name: c for c in calls}
    assert sorted(by_name) == ["K4", "base", "cod_r05", "cod_r09", "data_half", "data_quarter"]
    assert "train.K=4" in by_name["K4"]["args"] and "eval.k_max=4" in by_name["K4"]["args"]
    assert "train.cod_r=0.5" in by_name["cod_r05"]["args"]
    assert "train.train_sequences=50" in by_name["data_half"]["args"]
    assert "train.train_sequences=25" in by_name["data_quarter"]["args"]
    assert all("train.max_minutes=0.5" in c["args"] for c in calls)
    assert not any(a.startswith("train.") for a in by_name["base"]["args"] if a != "train.max_minutes=0.5")
    # one variant per GPU at a time: GPUs alternate, and each wave of two starts after the last one ended
    assert [sorted(c["gpu"] for c in calls[w:w + 2]) for w in (0, 2, 4)] == [["0", "1"]] * 3
    starts = sorted(c["start"] for c in calls)
    assert starts[2] - starts[0] >= 0.25 and starts[4] - starts[2] >= 0.25
    summary = json.loads((tmp_path / "work" / "results" / "ablation.json").read_text())
    assert summary["variants_per_gpu_this_call"] == 1 and summary["minutes_this_call"] == 0.5
    rows = {r["variant"]: r for r in summary["rows"]}
    assert set(rows) == set(by_name)
    assert rows["K4"]["al_at_K"] == 4 and rows["K4"]["walk_al_heldout"] == pytest.approx(1.08)
    assert rows["K4"]["walk_al"] == pytest.approx(1.04) and rows["K4"]["sim_al"] == pytest.approx(1.12)
    assert rows["K4"]["settings"] == "minutes=0.5 overrides=train.K=4,eval.k_max=4"
    assert rows["base"]["al_at_K"] == 7 and rows["base"]["sim_al"] == pytest.approx(1.21)
    assert rows["base"]["walk_al_heldout"] == pytest.approx(1.14) and rows["base"]["walk_al"] == pytest.approx(1.07)
    # step timing: 50 ms per step, one 2 s stall (a compile) between steps 6 and 7, first step at 1.05 s
    assert (rows["base"]["median_step_ms"], rows["base"]["slow_s"], rows["base"]["first_step_s"]) == (50.0, 2.0, 1.1)
    # eval curves at the served K; the equal-steps table holds the steps every variant reached
    assert rows["base"]["eval_curve"] == [
        {"step": 5, "elapsed_s": 1.2, "lr": pytest.approx(6e-4), "walk_al": pytest.approx(1.057),
         "acc1_copyable": pytest.approx(0.35), "acc1_fresh": pytest.approx(0.25)},
        {"step": 10, "elapsed_s": 3.5, "lr": pytest.approx(1e-4), "walk_al": pytest.approx(1.107),
         "acc1_copyable": pytest.approx(0.4), "acc1_fresh": pytest.approx(0.3)}]
    assert rows["K4"]["eval_curve"][-1] == {"step": 8, "elapsed_s": 3.4, "lr": pytest.approx(3e-4),
                                            "walk_al": pytest.approx(1.084), "acc1_copyable": pytest.approx(0.38),
                                            "acc1_fresh": pytest.approx(0.28)}
    assert (rows["base"]["acc1_copyable"], rows["base"]["acc1_fresh"], rows["base"]["copyable_share"]) == (0.45, 0.25, 0.6)
    assert rows["base"]["eval_acc"] == [0.4, 0.2, 0.1, 0.05] and rows["base"]["steps_per_s"] == pytest.approx(6.67)
    md = (tmp_path / "work" / "results" / "ablation.md").read_text()
    assert ("| base | minutes=0.5 overrides= | 8 (7) | 10 | 50.0 | 1.1 | 2.0 | 1.140 | 1.070 | 1.210 | "
            "0.40 / 0.20 / 0.10 / 0.05 | 0.450 / 0.250 |") in md
    # step 10 is reached by the four K = 8 variants, step 8 by K4 alone (not shown), step 5 by all
    assert "| variant | step 5 | step 10 |\n" in md and "| K4 | 1.054 (6.0) | - |" in md
    assert "| base | 1.057 (6.0) | 1.107 (1.0) |" in md and "step 8" not in md
    assert md in r.stdout
    # each variant's learning curve (run_curve.py on its folder) and one PNG of all of them
    base_curve = json.loads((tmp_path / "work" / "results" / "ablate-base-curve.json").read_text())
    assert [(c["step"], c["acc1_copyable"]) for c in base_curve["curve"]] == [(5, pytest.approx(0.35)),
                                                                             (10, pytest.approx(0.4))]
    assert (tmp_path / "work" / "results" / "ablation_curves.png").stat().st_size > 0


def test_ablate_resumes_and_reports_a_failed_variant(tmp_path):
    env = _setup(tmp_path, fail="cod_r09")
    r = _run(env, ABLATE="base= cod_r09=train.cod_r=0.9", ABLATE_PER_GPU="2")
    assert r.returncode == 0, r.stderr
    assert "ablation cod_r09 failed" in r.stdout and "boom" in r.stdout
    rows = {r["variant"]: r for r in json.loads((tmp_path / "work" / "results" / "ablation.json").read_text())["rows"]}
    assert "error" in rows["cod_r09"] and "boom" in rows["cod_r09"]["error"] and rows["base"]["steps"] == 10
    md = (tmp_path / "work" / "results" / "ablation.md").read_text()
    assert "| cod_r09 | not finished: " in md and "boom" in md and "| base | 1.057 (6.0) | 1.107 (1.0) |" in md
    n_before = len(_calls(tmp_path))
    r = _run(env, ABLATE="base= K4=train.K=4")  # a second call: base is kept, K4 is added
    assert r.returncode == 0, r.stderr
    assert "base: finished in an earlier call, kept" in r.stdout
    new = _calls(tmp_path)[n_before:]
    assert len(new) == 1 and "train.K=4" in new[0]["args"]
    rows = {r["variant"] for r in json.loads((tmp_path / "work" / "results" / "ablation.json").read_text())["rows"]}
    assert rows == {"base", "cod_r09", "K4"}
    r = _run(env, ABLATE="base=train.K=4")  # same name, other settings: refused, not silently reused
    assert r.returncode == 0 and "base: finished earlier with other settings" in r.stdout
    assert len(_calls(tmp_path)) == n_before + 1
    r = _run(env, ABLATE_PER_GPU="0")
    assert r.returncode == 2 and "ABLATE_PER_GPU must be" in r.stderr


def test_ablate_prepares_a_data_variant_again_from_the_regeneration_shards(tmp_path):
    """A variant with a data.* override (data.loop_tail) gets its own `prepare` on a copy of the regeneration
    shards before it trains (a copy of the prepared tokens would ignore the override); without the shards it
    is skipped with the reason, and the other variants run."""
    env = _setup(tmp_path)
    r = _run(env, ABLATE="base= loop=data.loop_tail=unsupervise")
    assert r.returncode == 0 and "loop: a data variant needs the regeneration shards" in r.stdout, r.stdout + r.stderr
    assert [Path(dict(a.split("=", 1) for a in c["args"] if "=" in a)["output_dir"]).name for c in _calls(tmp_path)] == ["base"]
    regen = tmp_path / "work" / "peagle" / "data" / "regen"
    regen.mkdir()
    (regen / "train-00000.json").write_text("{}")
    r = _run(env, ABLATE="base= loop=data.loop_tail=unsupervise")
    assert r.returncode == 0, r.stdout + r.stderr
    loop = [c["args"] for c in _calls(tmp_path) if "ablate/loop" in " ".join(c["args"])]
    assert [a[0] for a in loop] == ["prepare", "train"] and all("data.loop_tail=unsupervise" in a for a in loop)
    assert (tmp_path / "work" / "ablate" / "loop" / "data" / "regen" / "train-00000.json").is_file()
    assert not (tmp_path / "work" / "ablate" / "loop" / "data" / "train.safetensors").exists()  # not the shared tokens


def test_ablation_report_bad_files_become_error_rows(tmp_path):
    for name in ("v1", "v2", "v3", "v4"):
        (tmp_path / name).mkdir()
    (tmp_path / "v1" / "train_metrics.json").write_text(json.dumps({"K": 8, "steps": 3}))
    (tmp_path / "v2" / "train_metrics.json").write_text("{truncated")
    (tmp_path / "v3.err").write_text("CUDA out of memory")
    # a K = 2 run whose history has no elapsed_s (no step timing) and an eval on its own record
    (tmp_path / "v4" / "train_metrics.json").write_text(json.dumps({
        "K": 2, "steps": 4, "train_seconds": 2.0,
        "history": [{"step": 1, "loss": 3.0}, {"step": 2, "eval_walk_al": {"1": 1.1, "2": 1.2}}],
        "final": {"eval_walk_al": {"2": 1.25}}}))
    rows = {r["variant"]: r for r in ablation_report.summarize(tmp_path)}
    assert "v1/train_metrics.json: missing ['train_seconds', 'final']" in rows["v1"]["error"]
    assert "v2/train_metrics.json: not JSON" in rows["v2"]["error"]
    assert rows["v3"] == {"variant": "v3", "error": "CUDA out of memory"}
    v4 = rows["v4"]
    assert v4["walk_al"] == 1.25 and v4["walk_al_heldout"] is None and v4["al_at_K"] == 2
    assert (v4["first_step_s"], v4["median_step_ms"], v4["slow_s"]) == (None, None, None)
    assert v4["eval_curve"] == [{"step": 2, "elapsed_s": None, "lr": None, "walk_al": 1.2, "acc1_copyable": None,
                                 "acc1_fresh": None}]
    assert v4["acc1_copyable"] is None and v4["copyable_share"] is None  # a run from before the copy metrics
    assert ablation_report._at({2: 1.5}, 2) == 1.5 and ablation_report._at(None, 2) is None
    md = ablation_report.markdown(list(rows.values()))
    assert "| v4 | 1.200 |" in md and "| v1 | not finished:" in md
    assert ablation_report.shared_eval_steps([rows["v1"]]) == []
    with pytest.raises(FileNotFoundError, match="no ablation folder"):
        ablation_report.summarize(tmp_path / "nope")


# -- leg / state-out / ferry-groups / state-in: one long run per drafter in legs on machines lent for a short
# time, its portable state brought back in batches a device call can carry. The fake does what the real
# train does at the seams the script relies on (tested for real in test_portable_state.py): --stop-after
# ends a leg, the state is written to train.state_out as a manifest and pieces, train.state_in continues
# from it, the whole history is in logs/steps.jsonl, and the run ends (train_metrics.json) once its time
# is spent.

FAKE_LEGS = FAKE_HEAD + r'''
if args[0] == "export":
    (out / "export").mkdir(parents=True, exist_ok=True)
    sys.exit(0)
assert args[0] == "train" and "--stop-after" in args
history = []
if "train.state_in" in over:
    man = json.loads(Path(over["train.state_in"]).read_text())
    for p in man["parts"]:  # as the real loader: every piece must be there
        assert (Path(over["train.state_in"]).parent / p).is_file(), p
    history = man["history"]
step0 = len(history)
for s in range(step0 + 1, step0 + 6):  # a leg: 5 steps, an evaluation every 5, 100 tokens a step, 6 s a step
    rec = {{"step": s, "loss": 10.0 - s, "tokens": 100, "elapsed_s": 6.0 * s}}
    if s % 5 == 0:
        rec.update({{"eval_loss": 5.0 - s / 10, "eval_walk_al": {{"7": 1.0 + s / 10}}, "eval_sim_al": {{"7": 1.1 + s / 10}},
                    "eval_walk_al_heldout": {{"7": 0.9 + s / 10}}, "eval_walk_al_sets": {{"humaneval": {{"7": 0.8 + s / 10}}}},
                    "eval_acc1_copyable": 0.4, "eval_acc1_fresh": 0.3, "eval_acc_copyable": [0.4, 0.2],
                    "eval_acc_fresh": [0.3, 0.1]}})
    history.append(rec)
(out / "logs").mkdir(parents=True, exist_ok=True)
(out / "logs" / "steps.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
st = Path(over["train.state_out"])
parts = [f"{{st.name}}.abcd{{len(history)}}.part{{i}}" for i in range(5)]  # 5 pieces of 1 KiB
for p in st.parent.glob(st.name + ".*.part*"):
    p.unlink()
for p in parts:
    (st.parent / p).write_bytes(os.urandom(1024))
st.write_text(json.dumps({{"parts": parts, "history": history}}))
(out / "logs" / "state_out.json").write_text(json.dumps({{"path": str(st), "step": len(history), "parts": parts}}))
if len(history) >= 10:  # the run's time is spent: it ends
    (out / "train_metrics.json").write_text(json.dumps({{"steps": len(history), "history": history,
        "train_seconds": 6.0 * len(history), "final": {{"eval_loss": 3.9, "eval_walk_al_heldout": {{"7": 2.05}}}}}}))
print(json.dumps({{"stopped_at": len(history)}}))
'''


def _machine(tmp_path: Path, name: str, fake: Path) -> dict:
    """A fresh machine: its WORK holds the prepared data only."""
    work = tmp_path / name
    data = work / "peagle" / "data"
    data.mkdir(parents=True)
    for f in ("train.safetensors", "eval.safetensors", "eval_prompts.json", "meta.json"):
        (data / f).write_text("{}")
    env = os.environ | {"WORK": str(work), "PEAGLE_CLI": str(fake), "FAKE_LOG": str(tmp_path / "calls.jsonl"),
                        "NGPU": "1", "FERRY": str(tmp_path / "ferry")}
    env.pop("OUT", None)
    return env


def _step(env: dict, *step: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *step], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def _trains(tmp_path: Path) -> list[dict]:
    calls = [json.loads(x)["args"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    return [dict(a.split("=", 1) for a in c if "=" in a) | {"_args": c} for c in calls if c[0] == "train"]


def _legs_cli(tmp_path: Path) -> Path:
    """The fake trainer of the leg tests (FAKE_LEGS), executable; skips without bash."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "fake_cli.py"
    fake.write_text(FAKE_LEGS.format(python=sys.executable))
    fake.chmod(0o755)
    return fake


def test_two_legs_on_two_machines_with_the_state_ferried_between(tmp_path):
    fake = _legs_cli(tmp_path)
    one = _machine(tmp_path, "one", fake)
    r = _step(one, "leg", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    first = _trains(tmp_path)
    assert [Path(c["output_dir"]).name for c in first] == ["peagle", "eagle3"]
    for c, name in zip(first, ("smollm2-135m-peagle-gpu", "smollm2-135m-eagle3-gpu")):
        assert c["train.state_out"] == str(tmp_path / "one" / "state" / f"{name}.pst") and "train.state_in" not in c
        assert c["train.state_part_mib"] == "14" and c["_args"][-3:] == ["--stop-after", "0.5", "--quiet"]
    assert (tmp_path / "one" / "eagle3" / "data" / "meta.json").is_file()  # the baseline trains on the same data
    curve = json.loads((tmp_path / "one" / "results" / "smollm2-135m-peagle-gpu-curve.json").read_text())
    assert (curve["steps"], curve["gpu_minutes"], curve["tokens_seen"], curve["finished"]) == (5, 0.5, 500, False)
    assert curve["curve"] == [{"step": 5, "gpu_minutes": 0.5, "tokens_seen": 500, "eval_loss": 4.5, "walk_al": 1.5,
                               "sim_al": 1.6, "walk_al_heldout": 1.4, "walk_al_humaneval": 1.3, "acc1_copyable": 0.4, "acc1_fresh": 0.3, "acc_copyable": [0.4, 0.2],
                               "acc_fresh": [0.3, 0.1]}]
    # back from the machine: 2 states x (manifest + 5 pieces) = 12 files, 8 a call
    back = tmp_path / "back"
    for i in (0, 1):
        r = _step(one | {"OUT": str(back / str(i))}, "state-out", str(i))
        assert r.returncode == 0 and f"batch {i} of 2" in r.stdout, r.stdout + r.stderr
    assert [len(list((back / str(i)).iterdir())) for i in (0, 1)] == [8, 4]
    r = _step(one | {"OUT": str(back / "2")}, "state-out", "2")
    assert r.returncode != 0 and "batch 2 does not exist" in r.stderr and "2 batches" in r.stderr
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for f in back.glob("*/*"):
        shutil.copy2(f, gathered / f.name)
    r = _step(one, "ferry-groups", str(gathered), str(tmp_path / "ferry"))
    assert r.returncode == 0 and "2 groups" in r.stdout, r.stdout + r.stderr
    again = _step(one, "ferry-groups", str(gathered), str(tmp_path / "ferry"))  # pieces must not mix with a leg's
    assert again.returncode != 0 and "is not empty" in again.stderr
    # a fresh machine: the carried groups, then the second leg continues both runs, which end and are exported
    two = _machine(tmp_path, "two", fake)
    nothing = _step(two | {"FERRY": str(tmp_path / "nothing")}, "state-in")  # a leg would restart from step 0
    assert nothing.returncode == 2 and "no file under" in nothing.stderr
    r = _step(two, "state-in")
    assert r.returncode == 0 and "state-in: 12 files" in r.stdout, r.stdout + r.stderr
    r = _step(two, "leg", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    second = _trains(tmp_path)[2:]
    assert [c["train.state_in"] for c in second] == [c["train.state_out"] for c in second]
    assert all(str(tmp_path / "two") in c["train.state_in"] for c in second)
    assert "smollm2-135m-peagle-gpu: the run is finished and exported" in r.stdout
    assert (tmp_path / "two" / "peagle" / "export").is_dir() and (tmp_path / "two" / "eagle3" / "export").is_dir()
    curve = json.loads((tmp_path / "two" / "results" / "smollm2-135m-eagle3-gpu-curve.json").read_text())
    assert (curve["steps"], curve["gpu_minutes"], curve["tokens_seen"], curve["finished"]) == (10, 1.0, 1000, True)
    assert [c["step"] for c in curve["curve"]] == [5, 10] and curve["curve"][-1]["walk_al"] == 2.0
    assert curve["curve"][-1]["walk_al_humaneval"] == 1.8  # train.eval_walk_sets: the walk per set
    # the finished run's summary, its end-of-run eval included (what must_show_quality.py reads)
    m = json.loads((tmp_path / "two" / "results" / "smollm2-135m-peagle-gpu-train-metrics.json").read_text())
    assert m["final"]["eval_walk_al_heldout"]["7"] == 2.05 and "history" not in m
    assert [c["step"] for c in m["eval_curve"]] == [5, 10] and m["eval_curve"][-1]["walk_al_k7"] == 2.0
    assert not (tmp_path / "one" / "results" / "smollm2-135m-peagle-gpu-train-metrics.json").exists()  # unfinished


def test_ferry_plan_limits(tmp_path):
    """benchmarks/ferry.py: consecutive groups within the file count and byte limits; a file too large for one
    call is refused with its name and the key that splits the state."""
    import ferry  # benchmarks/ is on sys.path (conftest)

    files = []
    for i, n in enumerate([10, 10, 10, 25, 5, 5]):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"x" * n)
        files.append(f)
    groups = ferry.plan(files, max_files=3, max_file_bytes=30, max_group_bytes=30)
    assert [[f.name for f in g] for g in groups] == [["f0", "f1", "f2"], ["f3", "f4"], ["f5"]]
    assert ferry.plan([]) == []
    with pytest.raises(ValueError, match="f3: .* train.state_part_mib=14"):
        ferry.plan(files, max_file_bytes=20)
    # the command line: a missing folder and a piece too large are named, and nothing is copied
    with pytest.raises(SystemExit, match="is not a folder"):
        ferry.main(["carry", str(tmp_path / "missing"), str(tmp_path / "dest")])
    (tmp_path / "f3").write_bytes(b"x" * (ferry.MAX_FILE_BYTES + 1))
    with pytest.raises(SystemExit, match="f3: .* train.state_part_mib=14"):
        ferry.main(["out", str(tmp_path), "0", str(tmp_path / "dest")])
    assert not (tmp_path / "dest").exists()


def test_plot_curves_draws_both_drafters_and_names_a_bad_file(tmp_path):
    """``plot_curves.py`` writes one PNG from two run_curve JSONs (labels from the file names or ``--label``);
    a file without curve rows or a label count that does not match is refused, naming it."""
    import plot_curves  # benchmarks/ is on sys.path (conftest)

    def curve(name: str, al: list[float]) -> Path:
        rows = [{"step": 100 * (i + 1), "gpu_minutes": 1.5 * (i + 1), "tokens_seen": 4_000_000 * (i + 1),
                 "eval_loss": 5.0 - i, "walk_al": a, "sim_al": a + 0.05 if i else None} for i, a in enumerate(al)]
        p = tmp_path / f"{name}-curve.json"
        p.write_text(json.dumps({"K": 7, "curve": rows}))
        return p

    pe, e3 = curve("smollm2-135m-peagle-gpu", [1.37, 1.46, 1.69]), curve("smollm2-135m-eagle3-gpu", [1.3, 1.4])
    out = plot_curves.main([str(tmp_path / "lc.png"), str(pe), str(e3)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    plot_curves.main([str(tmp_path / "lc2.png"), str(pe), "--label", "P-EAGLE"])
    assert (tmp_path / "lc2.png").is_file()
    # train.eval_walk_sets: a series per set where the rows have it (held-out is its own series)
    rows = [{"walk_al_humaneval": 1.2, "walk_al_heldout": 1.4}, {}, {"walk_al_humaneval": 1.5, "walk_al_mt_bench": 1.7}]
    assert plot_curves.set_series(rows) == {"humaneval": [(0, 1.2), (2, 1.5)], "mt_bench": [(2, 1.7)]}
    data = json.loads(pe.read_text())
    for i, r in enumerate(data["curve"]):
        r["walk_al_humaneval"] = 1.1 + i / 10
    pe.write_text(json.dumps(data))
    plot_curves.main([str(tmp_path / "lc3.png"), str(pe)])
    assert (tmp_path / "lc3.png").stat().st_size > 10_000
    bad = tmp_path / "bad-curve.json"
    bad.write_text(json.dumps({"K": 7, "curve": []}))
    with pytest.raises(SystemExit, match="bad-curve.json: no curve rows"):
        plot_curves.main([str(tmp_path / "x.png"), str(pe), str(bad)])
    with pytest.raises(SystemExit, match="1 --label for 2 curves"):
        plot_curves.main([str(tmp_path / "x.png"), str(pe), str(e3), "--label", "P-EAGLE"])
    assert not (tmp_path / "x.png").exists()


def test_run_curve_without_a_step_log_names_the_folder(tmp_path):
    import run_curve  # benchmarks/ is on sys.path (conftest)

    with pytest.raises(SystemExit, match=r"steps\.jsonl: no step log"):
        run_curve.main([str(tmp_path / "never_trained"), str(tmp_path / "curve.json")])


def test_run_curve_reads_train_metrics_history_without_a_step_log(tmp_path):
    """An ablation variant's folder brought back without logs/: the curve comes from train_metrics.json's history
    (the same per-step records), its end-of-run eval the last row; a train_metrics.json without a history is
    no step log either."""
    import run_curve  # benchmarks/ is on sys.path (conftest)

    run = tmp_path / "init_target"
    run.mkdir()
    hist = [{"step": s, "loss": 5.0 - s / 10, "tokens": 1000, "elapsed_s": 30.0 * s} for s in range(1, 5)]
    hist[1].update(eval_loss=4.0, eval_walk_al={"7": 1.5}, eval_sim_al={"7": 1.6}, eval_acc1_copyable=0.6,
                   eval_acc1_fresh=0.4)
    (run / "train_metrics.json").write_text(json.dumps({"history": hist, "final": {
        "eval_loss": 3.5, "eval_walk_al": {"7": 1.9}, "eval_sim_al": {"7": 2.1}}}))
    res = run_curve.main([str(run), str(tmp_path / "curve.json"), "--every", "2"])
    assert res["finished"] and res["steps"] == 4 and res["tokens_seen"] == 4000 and res["gpu_minutes"] == 2.0
    assert [(r["step"], r["tokens_seen"], r["walk_al"], r["acc1_copyable"]) for r in res["curve"]] == [
        (2, 2000, 1.5, 0.6), (4, 4000, 1.9, None)]
    assert res["loss"] == [[2, 1.0, 4.8], [4, 2.0, 4.6]]
    (run / "train_metrics.json").write_text(json.dumps({"final": {}}))
    with pytest.raises(SystemExit, match=r"steps\.jsonl: no step log"):
        run_curve.main([str(run), str(tmp_path / "curve.json")])


def test_repetition_report_counts_copyable_tokens_by_answer_position(tmp_path):
    """benchmarks/repetition_report.py: a looping answer's later tokens are copyable and its tail counts as a
    loop, a prompt's tokens are never counted (the rule itself: tests/unit/test_loops.py)."""
    import repetition_report as rr  # benchmarks/ is on sys.path (conftest)

    from peagle_train.features.tokenized import save_tokenized

    loop = list(range(100, 110)) * 30  # 300 tokens, a 10-token loop: all copyable from the 15th on (n = 4)
    fresh = list(range(1000, 1300))  # 300 distinct tokens: none copyable
    rows = [{"input_ids": [7, 7, 7, *loop], "loss_mask": [0, 0, 0, *[1] * 300]},
            {"input_ids": [7, *fresh], "loss_mask": [0, *[1] * 300]}]
    save_tokenized(rows, tmp_path / "data" / "eval.safetensors")
    res = rr.main([str(tmp_path), "--out", str(tmp_path / "rep.json")])
    ev = res["splits"]["eval"]
    assert ev["sequences"] == 2 and ev["supervised_tokens"] == 600 and ev["looping_tail"] == 0.5
    assert ev["copyable"] == pytest.approx((300 - 14) / 600, abs=1e-4)
    assert ev["by_position"]["[0, 64)"] == {"tokens": 128, "copyable": pytest.approx(50 / 128, abs=1e-4)}
    assert ev["by_position"]["[256, inf)"] == {"tokens": 88, "copyable": 0.5}
    assert json.loads((tmp_path / "rep.json").read_text())["n"] == 4
    with pytest.raises(SystemExit, match="holds no train.safetensors"):
        rr.main([str(tmp_path / "nothing")])
    # the regeneration shards' answers, each alone: a looping answer and a fresh one, one id per word
    regen = tmp_path / "data" / "regen"
    regen.mkdir()
    words = lambda text: [int(w) for w in text.split()]  # noqa: E731
    convs = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": " ".join(map(str, loop))},
              {"role": "user", "content": "q2"}, {"role": "assistant", "content": " ".join(map(str, fresh))}]]
    (regen / "train-00000.json").write_text(json.dumps({"conversations": convs, "report": {}}))
    ans = rr.split_report(rr.shard_split(regen, words))
    assert {k: ans[k] for k in ("sequences", "supervised_tokens", "looping_tail")} == {
        "sequences": 2, "supervised_tokens": 600, "looping_tail": 0.5}
    assert ans["copyable"] == pytest.approx((300 - 14) / 600, abs=1e-4)
    with pytest.raises(SystemExit, match="--answers: .*holds no regeneration shard"):
        rr.main([str(tmp_path / "nothing"), "--answers", "recipes/smollm2-135m.yaml"])
    (regen / "train-00001.json").write_text(json.dumps({"report": {}}))  # not a shard: named, nothing counted
    with pytest.raises(ValueError, match="train-00001.json: not a regeneration shard.*data/regen"):
        rr.shard_split(regen, words)


def test_stage_builds_the_carried_inputs(tmp_path):
    """``stage`` (CPU side): the SmolLM2 GGUF in three thirds that join to the checked file (each with the tree
    under one call's carry), and ShareGPT with every user turn of every conversation the loader keeps, the assistant
    turns placeholders (regeneration writes them), readable by the loader with several turns; no answer
    text of ShareGPT travels."""
    import hashlib
    import lzma

    from data_prep.config import DataConfig
    from data_prep.sources import load_conversations

    env = {**os.environ, "STAGE_DIR": str(tmp_path), "STAGE_WHEELS": "0", "WORK": str(tmp_path / "work")}
    r = subprocess.run(["bash", str(SCRIPT), "stage"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    parts = [tmp_path / ".gguf1" / "gguf.partaa", tmp_path / ".gguf2" / "gguf.partab", tmp_path / ".gguf3" / "gguf.partac"]
    sizes = [p.stat().st_size for p in parts]
    assert max(sizes) - min(sizes) <= 2 and max(sizes) < 32 * 2**20  # thirds: each carry leaves room for the tree
    sha = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    assert sha == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    # the device side, from the staged folders as the carries bring them: part1, part3, then setup joins and checks
    r = subprocess.run(["bash", str(SCRIPT), "setup"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "run part3 first" in r.stderr  # a missing carry is named before anything is joined
    for step in ("part1", "part3", "setup"):
        r = subprocess.run(["bash", str(SCRIPT), step], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (step, r.stdout[-2000:] + r.stderr[-2000:])
    assert "SmolLM2-135M-Instruct.Q4_1.gguf: OK" in r.stdout
    assert (tmp_path / "work" / "sharegpt_prompts.json").stat().st_size > 1000
    plain = tmp_path / "sharegpt_prompts.json"
    with lzma.open(tmp_path / ".gguf3" / "sharegpt_prompts.json.xz") as f:
        plain.write_bytes(f.read())
    rows = json.loads(plain.read_text())
    gpt = [m["value"] for row in rows for m in row["conversations"] if m["from"] == "gpt"]
    assert len(rows) > 16000 and len(gpt) > 50000 and set(gpt) == {"(regenerated)"}
    convs, _ = load_conversations(DataConfig(source="sharegpt", path=str(plain), num_conversations=200, max_turns=4))
    assert len(convs) == 200 and max(sum(m["role"] == "assistant" for m in c) for c in convs) > 1


FAKE_PREPARE = r'''#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
over = dict(a.split("=", 1) for a in args[2:] if "=" in a)
regen = Path(over["output_dir"]) / "data" / "regen"
regen.mkdir(parents=True, exist_ok=True)
rank, world = map(int, args[args.index("--regen-worker") + 1].split("/")) if "--regen-worker" in args else (0, 1)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"args": args, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\n")
for i in range(rank, 3, world):  # three shards; a plain prepare is then killed by its time limit before tokenising
    convs = [[{{"role": "user", "content": f"q{{i}}-{{j}}"}}, {{"role": "assistant", "content": "word " * (50 + j)}}]
             for j in range(40)]
    report = {{"generated_tokens": 1000 + i, "unfinished_responses": i, "sampling": {{"batch_size": 512}}}}
    (regen / f"train-{{i:05d}}.json").write_text(json.dumps({{"conversations": convs, "report": report,
                                                             "inputs_sha256": str(i)}}))
sys.exit(0 if world > 1 else 124)
'''


def _fake_prepare(tmp_path: Path) -> Path:
    """FAKE_PREPARE as an executable in ``tmp_path`` (skips without bash)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "fake_prepare.py"
    fake.write_text(FAKE_PREPARE.format(python=sys.executable))
    fake.chmod(0o755)
    return fake


def test_unfinished_regeneration_comes_back_and_a_fresh_machine_continues_from_it(tmp_path):
    """A prepare stopped by its time limit sends the shards finished so far back (pieces and manifest of
    ``regen-out``); ``regen-in`` on a fresh machine writes them where prepare resumes, checked, keeping a shard
    that machine already has; a damaged or missing piece is refused, naming it, and nothing is written."""
    fake = _fake_prepare(tmp_path)
    back = tmp_path / "back"
    # NGPU 0: a machine without a GPU (the CPU side) runs one prepare process, counted as one worker
    one = os.environ | {"WORK": str(tmp_path / "one"), "PEAGLE_CLI": str(fake), "NGPU": "0", "BUDGET": "60",
                        "OUT": str(back), "FAKE_LOG": str(tmp_path / "calls.jsonl")}
    r = _step(one, "prepare")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prepare not finished" in r.stdout and "out: batch 0 of 1" in r.stdout, r.stdout
    assert sorted(p.name for p in back.iterdir()) == ["pack-000.tar", "pack-manifest.json", "regen_rate.json"]
    rate = json.loads((back / "regen_rate.json").read_text())
    assert (rate["shards_written"], rate["workers"], rate["generated_tokens"], rate["unfinished_responses"]) == (3, 1, 3003, 3)
    assert rate["tokens_per_s_wall"] > 0 and rate["sampling"] == {"batch_size": 512}
    assert "3,003 generated tokens in 3 shards by 1 worker," in r.stdout
    shards = tmp_path / "one" / "peagle" / "data" / "regen"
    # a fresh machine that has finished shard 0 itself: it is kept, the other two are written, byte-identical
    two_regen = tmp_path / "two" / "peagle" / "data" / "regen"
    two_regen.mkdir(parents=True)
    (two_regen / "train-00000.json").write_text("finished here")
    two = one | {"WORK": str(tmp_path / "two"), "REGEN_IN": str(back)}
    two.pop("OUT")
    r = _step(two, "regen-in")
    assert r.returncode == 0 and "2 files written" in r.stdout and "1 already there kept" in r.stdout, r.stdout + r.stderr
    assert (two_regen / "train-00000.json").read_text() == "finished here"
    for i in (1, 2):
        assert (two_regen / f"train-{i:05d}.json").read_bytes() == (shards / f"train-{i:05d}.json").read_bytes()
    # a damaged piece: refused before anything is written
    three = two | {"WORK": str(tmp_path / "three")}
    piece = back / "pack-000.tar"
    blob = bytearray(piece.read_bytes())
    blob[600] ^= 0xFF
    piece.write_bytes(bytes(blob))
    r = _step(three, "regen-in")
    assert r.returncode != 0 and "pack-000.tar is damaged" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "three" / "peagle" / "data" / "regen").exists()
    r = _step(three | {"REGEN_IN": str(tmp_path / "nothing")}, "regen-in")
    assert r.returncode == 2 and "no pack-* file" in r.stderr


def test_ferry_pack_splits_into_pieces_and_unpack_needs_them_all(tmp_path):
    """``ferry.py pack`` keeps every piece under its limit (files compressed one by one, in name order) and
    ``unpack`` restores the files exactly; a piece not carried is named; a file too large for a piece is named."""
    import ferry  # benchmarks/ is on sys.path (conftest)
    import random

    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(0)
    for i in range(6):  # incompressible: each compresses to ~20 KB
        (src / f"train-{i:05d}.json").write_bytes(bytes(rng.getrandbits(8) for _ in range(20_000)))
    m = ferry.pack(src, tmp_path / "pack", max_piece_bytes=45_000)
    assert list(m["pieces"]) == ["pack-000.tar", "pack-001.tar", "pack-002.tar"] and len(m["files"]) == 6
    assert json.loads((tmp_path / "pack" / "pack-manifest.json").read_text()) == m
    written, kept = ferry.unpack(tmp_path / "pack", tmp_path / "dest")
    assert (sorted(written), kept) == (sorted(m["files"]), [])
    assert all((tmp_path / "dest" / n).read_bytes() == (src / n).read_bytes() for n in m["files"])
    (tmp_path / "pack" / "pack-001.tar").unlink()
    with pytest.raises(ValueError, match="pack-001.tar is missing"):
        ferry.unpack(tmp_path / "pack", tmp_path / "dest2")
    assert not (tmp_path / "dest2").exists()
    with pytest.raises(ValueError, match=r"train-00000.json is 0.0 MiB compressed, more than one piece holds"):
        ferry.pack(src, tmp_path / "pack", max_piece_bytes=1_000)


def test_prepare_runs_several_regeneration_workers_on_one_gpu(tmp_path):
    """``WORKERS_PER_GPU=2`` on one GPU: two workers on GPU 0 with disjoint shards (``--regen-worker 0/2``,
    ``1/2``), then the plain prepare that tokenises; the rate counts every shard the call wrote."""
    fake = _fake_prepare(tmp_path)
    env = os.environ | {"WORK": str(tmp_path / "w"), "PEAGLE_CLI": str(fake), "NGPU": "1", "WORKERS_PER_GPU": "2",
                        "BUDGET": "90", "FAKE_LOG": str(tmp_path / "calls.jsonl")}
    env.pop("OUT", None)
    r = _step(env, "prepare")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    workers = sorted((c["args"][c["args"].index("--regen-worker") + 1], c["gpu"]) for c in calls
                     if "--regen-worker" in c["args"])
    assert workers == [("0/2", "0"), ("1/2", "0")]
    assert len(calls) == 3 and "--regen-worker" not in calls[-1]["args"]  # then the plain prepare
    assert all(f"output_dir={tmp_path / 'w' / 'peagle'}" in c["args"] for c in calls)
    rate = json.loads((tmp_path / "w" / "results" / "regen_rate.json").read_text())
    assert (rate["shards_written"], rate["workers"], rate["generated_tokens"]) == (3, 2, 3003)


def test_regen_rate_names_a_damaged_shard(tmp_path):
    import regen_rate

    (tmp_path / "train-00000.json").write_text("{not json")
    with pytest.raises(ValueError, match="train-00000.json: not a regeneration shard"):
        regen_rate.regen_rate(tmp_path, 0.0, 1)
    assert regen_rate.regen_rate(tmp_path / "absent", 0.0, 1, now=10.0)["shards_written"] == 0


def test_regen_rate_does_not_count_a_shard_carried_in_the_same_second(tmp_path):
    """A shard ``regen-in`` unpacked 0.3 s before prepare started (the same whole second) is not counted as
    generated in the call: the 2026-12-05 lease's regen_rate.json counted the carried eval split (113,406 tokens)
    that way while prepare ran ``date +%s``; the step now passes the start with its fraction."""
    import regen_rate

    shard = tmp_path / "eval-00000.json"
    shard.write_text(json.dumps({"report": {"generated_tokens": 113406}}))
    t = float(int(shard.stat().st_mtime)) + 0.5  # a start half a second into the second
    os.utime(shard, (t - 0.3, t - 0.3))
    assert regen_rate.regen_rate(tmp_path, t, 1, now=t + 10)["shards_written"] == 0
    assert regen_rate.regen_rate(tmp_path, float(int(t)), 1, now=t + 10)["generated_tokens"] == 113406
    out = tmp_path / "rate.json"
    regen_rate.main([str(tmp_path), f"{t:.9f}", "1", str(out)])  # the step's `date +%s.%N` form parses
    assert json.loads(out.read_text())["shards_written"] == 0


def test_regen_rate_counts_only_the_appended_part_of_a_grown_shard(tmp_path):
    """A shard prepare grew in the call (a data.mix entry appended conversations to a partial shard) counts only
    what the call generated: run 10's regen_rate.json counted shard 15's earlier 893,602 tokens too."""
    import regen_rate

    (tmp_path / "train-00015.json").write_text(json.dumps({"report": {
        "generated_tokens": 942026, "unfinished_responses": 1385,
        "grown_from": {"generated_tokens": 893602, "unfinished_responses": 1330}}}))
    (tmp_path / "train-00016.json").write_text(json.dumps({"report": {"generated_tokens": 251555,
                                                                      "unfinished_responses": 300}}))
    rate = regen_rate.regen_rate(tmp_path, 0.0, 1, now=time.time() + 1)
    assert (rate["generated_tokens"], rate["unfinished_responses"]) == (48424 + 251555, 55 + 300)


def test_lease_runs_the_steps_in_the_background_and_wait_brings_back_what_they_made(tmp_path):
    """``lease prepare nonsense`` runs both steps in the background from a copy of the repository (a failed step is
    logged, the plan goes on); ``wait`` follows the log and sends back the log, the small results and, with
    prepare unfinished, the regeneration shards so far (pieces for ``regen-in``)."""
    fake = _fake_prepare(tmp_path)
    env = os.environ | {"WORK": str(tmp_path / "w"), "PEAGLE_CLI": str(fake), "NGPU": "1", "BUDGET": "60",
                        "FAKE_LOG": str(tmp_path / "calls.jsonl"), "WAIT_POLL": "1"}
    env.pop("OUT", None)
    r = _step(env, "lease")
    assert r.returncode == 2 and "name the steps" in r.stderr
    r = _step(env, "lease", "prepare", "nonsense")
    assert r.returncode == 0 and "started in the background" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "w" / "repo" / "benchmarks" / "quality_experiment.sh").is_file()
    back = tmp_path / "back"
    r = _step(env | {"OUT": str(back)}, "wait", "100")
    assert r.returncode == 0 and "wait: the plan finished" in r.stdout, r.stdout + r.stderr
    log = (back / "plan.log").read_text()
    assert "plan: prepare" in log and "plan: FAILED: nonsense" in log and "plan: finished" in log
    assert sorted(p.name for p in back.iterdir()) == ["pack-000.tar", "pack-manifest.json", "plan.log",
                                                      "results.tar.xz"]
    import tarfile

    with tarfile.open(back / "results.tar.xz") as t:
        assert json.load(t.extractfile("./regen_rate.json"))["shards_written"] == 3
    assert (tmp_path / "w" / "plan.done").is_file() and not (tmp_path / "w" / "results" / "data_meta.json").exists()
    # prepared data: back beside the shards when it fits one returned file, else only the shards
    results = tmp_path / "w" / "results"
    for size, back_too in ((16 * 2**20 + 1, False), (1000, True)):
        (results / "prepared.tar.xz").write_bytes(b"x" * size)
        (results / "prepared.tar.xz.sha256").write_text("sum")
        shutil.rmtree(back)
        r = _step(env | {"OUT": str(back)}, "wait", "1")
        names = sorted(p.name for p in back.iterdir())
        assert {"pack-000.tar", "pack-manifest.json"} <= set(names), r.stdout + r.stderr
        assert ("prepared.tar.xz" in names) == back_too and ("over 16 MiB" in r.stdout) != back_too


def test_regen_bench_runs_regen_throughput_on_the_real_target_and_keeps_its_json_in_results(tmp_path):
    """``regen-bench NAME.json [flags]``: regen_throughput.py on the staged GGUF and prompts, the GPU recipe, one
    batch of 512 with a warm-up and plain generate on 64 prompts, the caller's flags passed on; a bare file name
    lands in $RESULTS (so ``wait`` brings it back), an absolute path stays where it is."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    fake = bin_ / "python3"  # records the regen_throughput.py command instead of running it
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path / 'args.txt'}\n")
    fake.chmod(0o755)
    env = os.environ | {"WORK": str(tmp_path / "w"), "PATH": f"{bin_}:{os.environ['PATH']}"}
    r = _step(env, "regen-bench", "regen_real.json", "--dtypes", "float32", "bfloat16")
    assert r.returncode == 0, r.stdout + r.stderr
    args = (tmp_path / "args.txt").read_text().splitlines()
    assert args[0] == "benchmarks/regen_throughput.py"
    opt = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert opt["--out"] == str(tmp_path / "w" / "results" / "regen_real.json")
    assert opt["--gguf"] == str(tmp_path / "w" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert opt["--recipe"] == "recipes/smollm2-135m-peagle-gpu.yaml" and opt["--prompts"] == "512"
    assert "--warmup" in args and args[-3:] == ["--dtypes", "float32", "bfloat16"]
    r = _step(env, "regen-bench", str(tmp_path / "elsewhere.json"))
    assert r.returncode == 0 and str(tmp_path / "elsewhere.json") in (tmp_path / "args.txt").read_text()
    assert _step(env, "regen-bench").returncode != 0  # no output named


FAKE_TRAIN_EVAL = FAKE_HEAD + r'''
out.mkdir(parents=True, exist_ok=True)
if args[0] == "train":
    h = [{{"step": s, "loss": 5.0 - s / 10, "elapsed_s": float(s), "eval_loss": 4.0, "eval_walk_al": {{"7": 1.2}},
          "eval_sim_al": {{"7": 1.25}}}} for s in range(1, 11)]
    (out / "train_metrics.json").write_text(json.dumps({{"steps": 10, "train_seconds": 10.0, "history": h,
                                                          "final": {{"eval_walk_al": {{"7": 1.2}}}}}}))
elif args[0] == "eval":
    (out / "eval").mkdir(parents=True, exist_ok=True)
    extra = {{"datasets": over["eval.datasets"], "k_values": over["eval.k_values"]}} if "eval.datasets" in over else {{}}
    compiled = over.get("eval.compile_target") == "true"
    if os.environ.get("FAKE_REAL_EVAL") and "eval.datasets" in over:  # a cost pass in eval.json's shape
        # compiled: twice as fast, unless FAKE_NO_GRAPHS names this run's folder (its compile fell back to eager)
        no_graphs = compiled and out.name == os.environ.get("FAKE_NO_GRAPHS")
        sec = 1.0 if compiled else 2.0
        extra = {{"datasets": {{"mt_bench": {{"target_alone": {{"seconds": sec}}, "by_K": [
            {{"K": k, "rounds": 10, "acceptance_length": 1.5, "seconds": sec}} for k in (1, 7)]}}}},
            "lossless": {{"passed": True}},
            "target_runner": "static" if no_graphs else "static+cuda-graphs" if compiled else "dynamic",
            "target_runner_fallback": "RuntimeError: no graphs" if no_graphs else None}}
    (out / "eval" / "eval.json").write_text(json.dumps({{"dtype": over["target.dtype"], "output_dir": str(out),
                                                        "compile_target": over.get("eval.compile_target"), **extra}}))
'''


def _fake_eval_env(tmp_path: Path, work: Path | None = None, **extra: str) -> dict:
    """The environment of a ``quality_experiment.sh`` step run against ``FAKE_TRAIN_EVAL`` (written to
    ``tmp_path/fake_cli.py``): one GPU, calls logged to ``tmp_path/calls.jsonl``, ``WORK`` ``work`` (default
    ``tmp_path/w``), no ``OUT``; ``extra`` added."""
    fake = tmp_path / "fake_cli.py"
    fake.write_text(FAKE_TRAIN_EVAL.format(python=sys.executable))
    fake.chmod(0o755)
    env = os.environ | {"WORK": str(work or tmp_path / "w"), "PEAGLE_CLI": str(fake), "NGPU": "1",
                        "FAKE_LOG": str(tmp_path / "calls.jsonl")} | extra
    env.pop("OUT", None)
    return env


def test_train_and_eval_use_the_run_folders_under_work_and_eval_runs_the_target_in_float32(tmp_path):
    """``train`` and ``eval`` work in $WORK/peagle and $WORK/eagle3 (where prepare and restore put the data), not
    the recipes' fixed output_dir, so another WORK works; eval runs the target in float32 (EVAL_DTYPE) whatever
    dtype the drafters trained with (e.g. EXTRA_OVERRIDES=target.dtype=bfloat16 for a faster prepare)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    work = tmp_path / "elsewhere"
    env = _fake_eval_env(tmp_path, work, EXTRA_OVERRIDES="target.dtype=bfloat16")
    for step in ("train", "eval"):
        r = _step(env, step)
        assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x)["args"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert [c[0] for c in calls] == ["train", "export", "train", "export", "eval", "eval"]
    for c in calls:
        name = "eagle3" if "eagle3" in c[1] else "peagle"
        assert f"output_dir={work / name}" in c, c
    for c in calls[-2:]:  # the last target.dtype wins
        assert [a for a in c if a.startswith("target.dtype=")] == ["target.dtype=bfloat16", "target.dtype=float32"]
    results = work / "results"
    assert json.loads((results / "smollm2-135m-peagle-gpu-train-metrics.json").read_text())["steps"] == 10
    ev = json.loads((results / "smollm2-135m-eagle3-gpu-eval.json").read_text())
    assert ev == {"dtype": "float32", "output_dir": str(work / "eagle3"), "compile_target": "true"}  # EVAL_COMPILE=1


def test_eval_workers_share_the_gpu_then_each_drafter_is_merged(tmp_path):
    """``EVAL_WORKERS=3``: three eval processes per drafter (``--eval-worker r/3``, both drafters' at once on one
    GPU), then one ``--eval-merge 3`` per drafter after its workers, then one process alone per drafter for the
    drafting cost (``NAME-cost-eval.json``); a bad count is refused."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = _fake_eval_env(tmp_path, EVAL_WORKERS="3")
    r = _step(env, "eval")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    for name in ("peagle", "eagle3"):
        mine = [c["args"] for c in calls if f"output_dir={tmp_path / 'w' / name}" in c["args"]]
        workers = sorted(a[a.index("--eval-worker") + 1] for a in mine if "--eval-worker" in a)
        assert workers == ["0/3", "1/3", "2/3"], mine
        # the workers of one evaluation claim prompts under one name, the other drafter's under its own
        claims = {a[a.index("--eval-claim") + 1] for a in mine if "--eval-worker" in a}
        assert len(claims) == 1 and next(iter(claims)).startswith(f"smollm2-135m-{name}-gpu-"), mine
        merge = [a for a in mine if "--eval-merge" in a]
        assert len(merge) == 1 and merge[0][merge[0].index("--eval-merge") + 1] == "3"
        assert mine.index(merge[0]) > max(i for i, a in enumerate(mine) if "--eval-worker" in a)
        # then one process alone times the drafting cost (K = 1, 7 on 4 MT-Bench prompts): its own report, and
        # the merged report stays where it was
        cost = [a for a in mine if "eval.k_values=[1,7]" in a]
        assert len(cost) == 1 and "eval.num_prompts=4" in cost[0] and "--eval-worker" not in cost[0]
        assert mine.index(cost[0]) > mine.index(merge[0])
        res = tmp_path / "w" / "results"
        assert json.loads((res / f"smollm2-135m-{name}-gpu-cost-eval.json").read_text())["datasets"] == "[mt_bench]"
        assert "datasets" not in json.loads((res / f"smollm2-135m-{name}-gpu-eval.json").read_text())
        run = tmp_path / "w" / name
        assert "datasets" not in json.loads((run / "eval" / "eval.json").read_text())
        assert (run / "eval-cost" / "eval.json").is_file() and not (run / "eval-all").exists()
    assert {c["gpu"] for c in calls} == {"0"}
    (tmp_path / "calls.jsonl").unlink()
    r = _step(env | {"EVAL_CLAIM": "0"}, "eval")  # every world-th prompt, as before claims
    assert r.returncode == 0 and not [c for c in (tmp_path / "calls.jsonl").read_text().splitlines()
                                      if "--eval-claim" in c]
    r = _step(env | {"EVAL_WORKERS": "0"}, "eval")
    assert r.returncode == 2 and "EVAL_WORKERS must be a whole number >= 1" in r.stderr
    # EVAL_CPU_WORKERS=2: two more workers per drafter with no GPU visible and the target's forward eager; the
    # world is 3 + 2 and the merge counts all five
    (tmp_path / "calls.jsonl").unlink()
    r = _step(env | {"EVAL_CPU_WORKERS": "2", "EVAL_COMPILE": "1"}, "eval")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    for name in ("peagle", "eagle3"):
        mine = [c for c in calls if f"output_dir={tmp_path / 'w' / name}" in c["args"]]
        wk = {c["args"][c["args"].index("--eval-worker") + 1]: c for c in mine if "--eval-worker" in c["args"]}
        assert sorted(wk) == ["0/5", "1/5", "2/5", "3/5", "4/5"]
        for r_, c in wk.items():
            on_cpu = int(r_.split("/")[0]) >= 3
            assert c["gpu"] == ("" if on_cpu else "0")
            assert [a for a in c["args"] if a.startswith("eval.compile_target=")] == [
                f"eval.compile_target={'false' if on_cpu else 'true'}"]
        merge = [c["args"] for c in mine if "--eval-merge" in c["args"]]
        assert len(merge) == 1 and merge[0][merge[0].index("--eval-merge") + 1] == "5"
    r = _step(env | {"EVAL_CPU_WORKERS": "x"}, "eval")
    assert r.returncode == 2 and "EVAL_CPU_WORKERS must be a whole number >= 0" in r.stderr


def test_eval_compile_auto_times_both_forwards_first_and_compiles_where_it_pays(tmp_path):
    """``EVAL_COMPILE=auto``: before any worker, each drafter's one-process cost pass runs eager then compiled
    (``NAME-cost-eval.json``, ``NAME-cost-eval-compiled.json``); benchmarks/compile_choice.py decides, per drafter,
    whether its workers run ``eval.compile_target=true`` (P-EAGLE here: same rounds, twice as fast) or not (EAGLE-3
    here: its compiled run fell back to eager), and says why; no cost pass after the workers. ``EVAL_COMPILE=1``
    (the default, as the GPU recipes' ``eval.compile_target``) compiles every run, ``0`` none; a bad value is
    refused."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = _fake_eval_env(tmp_path, FAKE_REAL_EVAL="1", FAKE_NO_GRAPHS="eagle3", EVAL_WORKERS="2", EVAL_COMPILE="auto",
                         PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    r = _step(env, "eval")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "eval of smollm2-135m-peagle-gpu: compiled target forward: true (same rounds and acceptance, 2.0x" in r.stdout
    assert "eval of smollm2-135m-eagle3-gpu: compiled target forward: false (the compiled run's target forward was " \
           "'static' (RuntimeError: no graphs))" in r.stdout
    calls = [json.loads(x)["args"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    cost = [c for c in calls if "eval.k_values=[1,7]" in c]
    first_worker = min(i for i, c in enumerate(calls) if "--eval-worker" in c)
    assert len(cost) == 4 and all(calls.index(c) < first_worker for c in cost)  # both drafters, both ways, first
    res = tmp_path / "w" / "results"
    for name, flag in (("peagle", "true"), ("eagle3", "false")):
        mine = [c for c in calls if f"output_dir={tmp_path / 'w' / name}" in c and "eval.k_values=[1,7]" not in c]
        assert mine and all(f"eval.compile_target={flag}" in c for c in mine), (name, mine)
        choice = json.loads((res / f"smollm2-135m-{name}-gpu-compile-choice.json").read_text())
        assert choice["use_compiled"] is (flag == "true")
        assert json.loads((res / f"smollm2-135m-{name}-gpu-cost-eval.json").read_text())["compile_target"] == "false"
        assert json.loads((res / f"smollm2-135m-{name}-gpu-cost-eval-compiled.json").read_text())["compile_target"] == "true"
        run = tmp_path / "w" / name
        assert (run / "eval-cost" / "eval.json").is_file() and (run / "eval-cost-compiled" / "eval.json").is_file()
        assert "datasets" not in json.loads((run / "eval" / "eval.json").read_text())  # the merged report
    for setting, want in (("1", "true"), (None, "true"), ("0", "false"), ("inductor", "inductor")):  # unset: the GPU recipes' own default
        (tmp_path / "calls.jsonl").unlink()
        e = {k: v for k, v in env.items() if k != "EVAL_COMPILE"} | {"EVAL_WORKERS": "1"}
        r = _step(e if setting is None else e | {"EVAL_COMPILE": setting}, "eval")
        calls = [json.loads(x)["args"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
        assert r.returncode == 0 and len(calls) == 2 and all(f"eval.compile_target={want}" in c for c in calls)
    r = _step(env | {"EVAL_COMPILE": "yes"}, "eval")
    assert r.returncode == 2 and "EVAL_COMPILE must be 0, 1, inductor, profile or auto" in r.stderr
    # EVAL_COMPILE=profile: the fastest kind of the lease's decode-profile, for every drafter; without one, CUDA graphs
    e = {k: v for k, v in env.items() if k != "EVAL_COMPILE"} | {"EVAL_WORKERS": "1", "EVAL_COMPILE": "profile"}
    res.mkdir(parents=True, exist_ok=True)
    for profile, want in ((None, "true"), ({"inductor": 3.0, "compiled": 9.0, "dynamic": 20.0}, "inductor"),
                          ({"inductor": 30.0, "compiled": 9.0, "dynamic": 20.0}, "true"),
                          ({"inductor": 30.0, "compiled": 29.0, "dynamic": 20.0}, "false")):
        (res / "decode_profile.json").unlink(missing_ok=True)
        if profile is not None:
            runner = {"dynamic": "dynamic", "inductor": "static+inductor", "compiled": "static+cuda-graphs"}
            (res / "decode_profile.json").write_text(json.dumps({"kinds": {
                k: {"per_length": {"1": {"median_ms": ms}}, "runner": runner[k], "fallback": None}
                for k, ms in profile.items()}}))
        (tmp_path / "calls.jsonl").unlink(missing_ok=True)
        r = _step(e, "eval")
        calls = [json.loads(x)["args"] for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
        assert r.returncode == 0 and calls and all(f"eval.compile_target={want}" in c for c in calls), r.stdout
        assert ("without" in r.stdout) if profile is None else (f"from decode-profile: {want}" in r.stdout)


def test_compile_choice_from_a_decode_profile_takes_the_fastest_kind_that_ran_as_named(tmp_path):
    """``compile_choice.py --profile``: the least summed milliseconds among static / inductor / compiled, counting a
    compiled kind only when its runner shows it compiled (not a fallback to eager); none such: eager; a file
    without kinds is refused."""
    import compile_choice  # benchmarks/ is on sys.path (conftest)

    def kind(ms1, ms8, runner, fallback=None):
        return {"per_length": {"1": {"median_ms": ms1}, "8": {"median_ms": ms8}}, "runner": runner, "fallback": fallback}

    prof = {"kinds": {"dynamic": kind(15.0, 18.0, "dynamic"), "static": kind(1.0, 1.0, "static"),
                      "inductor": kind(2.0, 2.5, "static+inductor"), "compiled": kind(14.0, 16.0, "static+cuda-graphs")}}
    value, reason, figures, attention = compile_choice.choose_from_profile(prof)
    assert value == "inductor" and reason.startswith("inductor 4.5 ms") and "compiled 30.0 ms" in reason
    # a profile made before decode_profile.py --attn: the recipe's own attention, no override
    assert attention == {"entry": "inductor", "attn_implementation": None, "attn_override": None}
    assert "static" not in figures  # eager with a static cache is no compile_target setting (false runs dynamic)
    prof["kinds"]["inductor"] = kind(2.0, 2.5, "static", fallback="RuntimeError: x")  # fell back: not counted
    assert compile_choice.choose_from_profile(prof)[0] == "true"
    prof["kinds"]["compiled"] = kind(1.0, 1.0, "static")  # did not compile: not counted either
    assert compile_choice.choose_from_profile(prof)[0] == "false"
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert compile_choice.main(["--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "c.json")]) == "false"
    assert json.loads((tmp_path / "c.json").read_text())["compile_target"] == "false"
    assert json.loads((tmp_path / "c.json").read_text())["attn_override"] is None
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit, match="no 'kinds'"):
        compile_choice.main(["--profile", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit):
        compile_choice.main([])


def test_compile_choice_from_a_decode_profile_takes_the_fastest_attention_implementation_too(tmp_path, capsys):
    """``compile_choice.py --profile`` on a profile of ``decode_profile.py --attn sdpa eager``: the fastest entry over
    every kind and attention implementation; a ``KIND@ATTN`` entry (not the recipe's own attention) gives the
    third line ``attn=NAME`` and ``attn_override`` in ``--out``, the recipe's own too (``attn=sdpa``: the evaluation
    loads what was timed);
    an eager-attention entry that fell back to eager forward is not counted."""
    import compile_choice  # benchmarks/ is on sys.path (conftest)

    def kind(ms, runner, attn, fallback=None):
        return {"attn": attn, "per_length": {"1": {"median_ms": ms}, "8": {"median_ms": ms}}, "runner": runner,
                "fallback": fallback}

    # H100, SmolLM2-135M float32: SDPA's memory-efficient kernel dominates the compiled forward
    prof = {"meta": {"attn_default": "sdpa", "attn": ["sdpa", "eager"]}, "kinds": {
        "dynamic": kind(21.0, "dynamic", "sdpa"), "static": kind(20.0, "static", "sdpa"),
        "inductor": kind(19.0, "static+inductor", "sdpa"), "compiled": kind(19.7, "static+cuda-graphs", "sdpa"),
        "dynamic@eager": kind(9.0, "dynamic", "eager"), "static@eager": kind(1.0, "static", "eager"),
        "inductor@eager": kind(6.0, "static+inductor", "eager"),
        "compiled@eager": kind(4.0, "static+cuda-graphs", "eager")}}
    value, reason, figures, attention = compile_choice.choose_from_profile(prof)
    assert value == "true" and attention == {"entry": "compiled@eager", "attn_implementation": "eager",
                                             "attn_override": "eager"}
    assert reason.startswith("compiled (eager attention) 8.0 ms") and "compiled (sdpa attention) 39.4 ms" in reason
    assert "static@eager" not in figures and figures["inductor@eager"]["attn"] == "eager"
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert compile_choice.main(["--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "c.json")]) == "true"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "true" and lines[2] == "attn=eager"
    got = json.loads((tmp_path / "c.json").read_text())
    assert (got["compile_target"], got["attn_implementation"], got["attn_override"]) == ("true", "eager", "eager")
    # the eager entries' compiles fell back: the inductor one is still the fastest eager forward that compiled...
    prof["kinds"]["compiled@eager"] = kind(4.0, "static", "eager", fallback="RuntimeError: x")
    value, _, _, attention = compile_choice.choose_from_profile(prof)
    assert (value, attention["attn_override"]) == ("inductor", "eager")
    # ... and with none of them faster, the recipe's own attention, named all the same
    for k in ("dynamic@eager", "inductor@eager"):
        prof["kinds"][k]["per_length"] = {"1": {"median_ms": 50.0}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert compile_choice.main(["--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "c.json")]) == "inductor"
    assert capsys.readouterr().out.splitlines()[2] == "attn=sdpa"
    got = json.loads((tmp_path / "c.json").read_text())
    assert (got["entry"], got["attn_implementation"], got["attn_override"]) == ("inductor", "sdpa", "sdpa")


def test_eval_compile_profile_loads_the_target_with_the_attention_the_profile_chose(tmp_path):
    """``EVAL_COMPILE=profile`` with a decode profile whose fastest entry is ``compiled@eager``: the GPU workers, the
    merge and the cost pass run ``target.attn_implementation=eager`` with ``eval.compile_target=true``; the CPU
    workers keep the recipe's attention (the profile timed the GPU's forward) and their eager forward. The fastest
    entry on the recipe's own attention: that one named (``sdpa``); an older profile (no ``attn``): no override."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = _fake_eval_env(tmp_path, EVAL_WORKERS="2", EVAL_CPU_WORKERS="1", EVAL_COMPILE="profile",
                         PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    res = tmp_path / "w" / "results"
    res.mkdir(parents=True)
    runner = {"dynamic": "dynamic", "inductor": "static+inductor", "compiled": "static+cuda-graphs"}

    def profile(ms: dict, old: bool = False) -> None:
        (res / "decode_profile.json").write_text(json.dumps({"kinds": {
            k: {**({} if old else {"attn": "eager" if "@" in k else "sdpa"}), "per_length": {"1": {"median_ms": v}},
                "runner": runner[k.partition("@")[0]], "fallback": None} for k, v in ms.items()}}))

    for ms, attn, old in (
            ({"dynamic": 21.0, "compiled": 19.7, "dynamic@eager": 9.0, "compiled@eager": 4.0}, "eager", False),
            ({"dynamic": 21.0, "compiled": 3.0, "dynamic@eager": 9.0, "compiled@eager": 4.0}, "sdpa", False),
            ({"dynamic": 21.0, "compiled": 3.0}, None, True)):
        profile(ms, old)
        (tmp_path / "calls.jsonl").unlink(missing_ok=True)
        r = _step(env, "eval")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "eval: target forward from decode-profile: true (compiled " in r.stdout
        calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
        for name in ("peagle", "eagle3"):
            mine = [c for c in calls if f"output_dir={tmp_path / 'w' / name}" in c["args"]]
            cpu = [c for c in mine if c["gpu"] == ""]
            gpu = [c for c in mine if c["gpu"] != ""]
            assert len(cpu) == 1 and len(gpu) == 4  # 2 GPU workers, the merge, the cost pass
            assert any("--eval-merge" in c["args"] for c in gpu)
            assert any("eval.k_values=[1,7]" in c["args"] for c in gpu)
            for c in gpu:
                assert [a for a in c["args"] if a.startswith("target.attn_implementation=")] == (
                    [f"target.attn_implementation={attn}"] if attn else []), c["args"]
                assert "eval.compile_target=true" in c["args"]
            assert not any(a.startswith("target.attn_implementation=") for a in cpu[0]["args"])
            assert "eval.compile_target=false" in cpu[0]["args"]
        choice = json.loads((res / "compile-choice-profile.json").read_text())
        assert choice["attn_override"] == attn


def test_compile_choice_refuses_other_rounds_slower_runs_and_bad_files(tmp_path):
    import compile_choice  # benchmarks/ is on sys.path (conftest)

    def rep(sec, rounds=10, runner="static+cuda-graphs", passed=True):
        return {"lossless": {"passed": passed}, "target_runner": runner, "datasets": {"mt_bench": {
            "target_alone": {"seconds": sec}, "by_K": [{"K": 7, "rounds": rounds, "acceptance_length": 1.5,
                                                        "seconds": sec}]}}}
    eager = rep(2.0, runner="dynamic")
    assert compile_choice.choose(eager, rep(1.0))[0] is True
    assert compile_choice.choose(eager, rep(1.0, rounds=11))[1] == "mt_bench K=7: the compiled run decoded other rounds"
    assert compile_choice.choose(eager, rep(2.5))[1] == "not faster: 5.0 s compiled against 4.0 s eager"
    assert compile_choice.choose(eager, rep(1.0, passed=False))[1] == "a run failed the lossless check"
    assert not compile_choice.choose(eager, rep(1.0, runner="static"))[0]
    without_graphs = rep(1.0, runner="static+compiled") | {"target_runner_cudagraph_skips": ["mutated inputs"]}
    use, _, figures = compile_choice.choose(eager, without_graphs)  # compiled without CUDA graphs: still faster
    assert use is True and figures["cudagraph_skips"] == ["mutated inputs"]
    (tmp_path / "a.json").write_text(json.dumps(eager))
    (tmp_path / "b.json").write_text("{}")
    with pytest.raises(SystemExit, match="b.json: not a peagle-train eval.json"):
        compile_choice.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")])


def test_drafters_picks_which_drafters_train_leg_and_eval_run(tmp_path):
    """``DRAFTERS=peagle``: ``train``, ``leg`` and ``eval`` run the P-EAGLE recipe alone (a short lease); an unknown
    name or an empty list is refused before anything runs."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "fake_train_eval.py"
    fake.write_text(FAKE_TRAIN_EVAL.format(python=sys.executable))
    fake.chmod(0o755)
    env = _setup(tmp_path) | {"NGPU": "1", "DRAFTERS": "peagle", "PEAGLE_CLI": str(fake)}
    for step in (["train"], ["leg", "0.1"], ["eval"]):
        r = _step(env, *step)
        assert r.returncode == 0, r.stdout + r.stderr
    calls = [c["args"] for c in _calls(tmp_path)]
    assert calls and all("smollm2-135m-peagle-gpu.yaml" in c[1] for c in calls), calls
    assert [c[0] for c in calls if c[0] in ("train", "eval")] == ["train", "train", "eval"]
    for bad in ("medusa", " "):
        r = _step(env | {"DRAFTERS": bad}, "eval")
        assert r.returncode == 2 and "DRAFTERS" in r.stderr, r.stderr
    assert len(_calls(tmp_path)) == len(calls)


def test_ablate_passes_a_list_value_as_one_override(tmp_path):
    """``ABLATE`` entries split at the commas outside brackets (``benchmarks/variants.py``): a per-depth weight
    list reaches the trainer as one override beside the next one; a variant that does not parse is skipped
    with its reason and the others still run."""
    from variants import parse_variant, split_overrides

    env = _setup(tmp_path)
    r = _run(env, ABLATE="dw=train.depth_weights=[2,1,1,1,1,1,1,1],train.cod_r=0.9 bad=train.x=[1 base=",
             ABLATE_PER_GPU="3")
    assert r.returncode == 0, r.stderr
    args = {Path(dict(a.split("=", 1) for a in c["args"] if "=" in a)["output_dir"]).name: c["args"]
            for c in _calls(tmp_path)}
    assert sorted(args) == ["base", "dw"]
    assert args["dw"][-3:] == ["train.max_minutes=0.5", "train.depth_weights=[2,1,1,1,1,1,1,1]", "train.cod_r=0.9"]
    assert args["base"][-1] == "train.max_minutes=0.5"
    assert "unbalanced brackets" in r.stderr and "ablation bad: skipped" in r.stdout
    assert split_overrides("a=1,b=[1,2],c={x: 1, y: 2},") == ["a=1", "b=[1,2]", "c={x: 1, y: 2}"]
    assert parse_variant("base=") == ("base", [])
    for bad in ("noequals", "=a=1", "x=a=[1", "x=a=1]"):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_pack_then_restore_on_a_fresh_machine_moves_the_prepared_data_checked(tmp_path):
    """``pack`` turns a finished prepare (here: one made on the CPU side) into ``prepared.tar.xz`` and its sha256;
    ``restore`` on another machine (``PREPARED_IN``) checks the sum and unpacks the same bytes into both run folders;
    a damaged pack is refused before anything is written, and a folder with no prepared data is named."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    env = _setup(tmp_path)  # $WORK/peagle/data with meta.json, train/eval safetensors, eval_prompts.json
    data = Path(env["WORK"]) / "peagle" / "data"
    (data / "regen").mkdir()
    (data / "regen" / "train-00000.json").write_text('{"conversations": []}')
    (data / "train.safetensors").write_bytes(os.urandom(5000))
    made = env["WORK"]  # the pack's paths name the WORK it was made in; restore moves them to its own
    (Path(made) / "peagle" / "run_config.yaml").write_text(
        f"output_dir: x\ntarget:\n  gguf_file: {made}/t.gguf\ndata:\n  path: {made}/p.json\n")
    (data / "meta.json").write_text(json.dumps({"splits": {"train": {"sequences": 100}}, "path": f"{made}/p.json"}))
    r = _step(env | {"RESULTS": str(tmp_path / "carried")}, "pack")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in (tmp_path / "carried").iterdir()) == ["prepared.tar.xz", "prepared.tar.xz.sha256"]

    fresh = env | {"WORK": str(tmp_path / "fresh"), "PREPARED_IN": str(tmp_path / "carried")}
    r = _step(fresh, "restore")
    assert r.returncode == 0 and "restore: 100 train sequences" in r.stdout, r.stdout + r.stderr
    for run in ("peagle", "eagle3"):
        got = tmp_path / "fresh" / run / "data"
        assert (got / "train.safetensors").read_bytes() == (data / "train.safetensors").read_bytes()
    assert (tmp_path / "fresh" / "peagle" / "data" / "regen" / "train-00000.json").exists()
    fresh_work = tmp_path / "fresh"
    stamp = yaml.safe_load((fresh_work / "peagle" / "run_config.yaml").read_text())
    assert stamp["target"]["gguf_file"] == f"{fresh_work}/t.gguf" and stamp["data"]["path"] == f"{fresh_work}/p.json"
    assert json.loads((fresh_work / "peagle" / "data" / "meta.json").read_text())["path"] == f"{fresh_work}/p.json"
    assert f"the pack's paths under {made}/ now name {fresh_work}/" in r.stdout
    # data restored before the paths were moved (or a restore cut between the two files) is moved the next time
    (fresh_work / "peagle" / "run_config.yaml").write_text(f"target:\n  gguf_file: {made}/t.gguf\n")
    r = _step(fresh, "restore")
    assert r.returncode == 0 and "keeping it" in r.stdout, r.stdout + r.stderr
    assert yaml.safe_load((fresh_work / "peagle" / "run_config.yaml").read_text())["target"]["gguf_file"] == \
        f"{fresh_work}/t.gguf"
    # the restored shards count as carried: `wait` does not pack them again
    digest = hashlib.sha256(b'{"conversations": []}').hexdigest()
    assert (tmp_path / "fresh" / "regen-carried.list").read_text() == f"{digest}  train-00000.json\n"

    blob = bytearray((tmp_path / "carried" / "prepared.tar.xz").read_bytes())
    blob[100] ^= 0xFF
    (tmp_path / "carried" / "prepared.tar.xz").write_bytes(bytes(blob))
    r = _step(fresh | {"WORK": str(tmp_path / "third")}, "restore")
    assert r.returncode == 2 and "checksum mismatch" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "third" / "peagle").exists()
    r = _step(fresh | {"WORK": str(tmp_path / "empty")}, "pack")
    assert r.returncode == 2 and "no prepared data" in r.stderr, r.stdout + r.stderr


def test_regen_in_takes_several_carried_folders(tmp_path):
    """``REGEN_IN`` may name several folders (the committed train shards and the eval split's): each folder's pieces
    are checked against its own manifest and all its shards written where prepare resumes; a folder without pieces
    is named before anything is written."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    import ferry

    for name, shards in (("train_pack", ("train-00000.json", "train-00001.json")), ("eval_pack", ("eval-00000.json",))):
        src = tmp_path / f"{name}_src"
        src.mkdir()
        for s in shards:
            (src / s).write_text(json.dumps({"conversations": [[s]]}))
        ferry.pack(src, tmp_path / name)
    env = os.environ | {"WORK": str(tmp_path / "work"), "REGEN_IN": f"{tmp_path / 'train_pack'} {tmp_path / 'eval_pack'}"}
    env.pop("OUT", None)
    r = _step(env, "regen-in")
    assert r.returncode == 0, r.stdout + r.stderr
    regen = tmp_path / "work" / "peagle" / "data" / "regen"
    assert sorted(p.name for p in regen.iterdir()) == ["eval-00000.json", "train-00000.json", "train-00001.json"]
    assert json.loads((regen / "eval-00000.json").read_text()) == {"conversations": [["eval-00000.json"]]}
    # `wait` does not send carried shards back; one this machine regenerated goes back (with them: one pack)
    (tmp_path / "work" / "plan.log").write_text("plan: finished\n")
    (tmp_path / "work" / "plan.done").write_text("")
    back = tmp_path / "back"
    r = _step(env | {"OUT": str(back)}, "wait", "1")
    assert r.returncode == 0 and sorted(p.name for p in back.iterdir()) == ["plan.log", "results.tar.xz"], r.stdout
    # a carried shard that prepare grew (same name, new content: a data.mix entry appended conversations) goes back
    carried = (regen / "train-00001.json").read_text()
    (regen / "train-00001.json").write_text(json.dumps({"conversations": [["train-00001.json"], ["grown here"]]}))
    shutil.rmtree(back)
    r = _step(env | {"OUT": str(back)}, "wait", "1")
    assert r.returncode == 0 and {"pack-000.tar", "pack-manifest.json"} <= {p.name for p in back.iterdir()}, r.stdout
    (regen / "train-00001.json").write_text(carried)
    (regen / "train-00002.json").write_text(json.dumps({"conversations": [["made here"]]}))
    shutil.rmtree(back)
    r = _step(env | {"OUT": str(back)}, "wait", "1")
    assert r.returncode == 0 and {"pack-000.tar", "pack-manifest.json"} <= {p.name for p in back.iterdir()}, r.stdout
    r = _step(env | {"WORK": str(tmp_path / "w2"), "REGEN_IN": f"{tmp_path / 'train_pack'} {tmp_path / 'none'}"},
              "regen-in")
    assert r.returncode == 2 and "no pack-* file in" in r.stderr and "none" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "w2" / "peagle").exists()


def test_decode_profile_step_profiles_the_recipes_target_and_ships_the_json(tmp_path):
    """``decode-profile``: benchmarks/decode_profile.py on the P-EAGLE recipe's target with the script's overrides
    (here a tiny random Llama on the CPU instead of the GGUF), in float32 unless EVAL_DTYPE says otherwise, with
    SDPA and eager attention (the step's ``--attn sdpa eager``), its JSON in $RESULTS and $OUT."""
    env = _setup(tmp_path) | {
        "OUT": str(tmp_path / "out"),
        "EXTRA_OVERRIDES": "target.gguf_file=null target.gguf_package=null target.gguf_sha256=null target.device=cpu "
                           "target.random_init_from_config=pkg:peagle_train/llama-3.1-8b-tiny.json",
        "DP_FLAGS": "--calls 2 --warmup 1 --prompt-tokens 8 --profile-calls 1 --kinds dynamic compiled"}
    r = _step(env, "decode-profile")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads((tmp_path / "out" / "decode_profile.json").read_text())
    assert got == json.loads((tmp_path / "work" / "results" / "decode_profile.json").read_text())
    assert got["meta"]["recipe"] == "recipes/smollm2-135m-peagle-gpu.yaml" and got["meta"]["dtype"] == "float32"
    # SDPA (the recipe's own) and eager attention, each kind and the profile of each
    assert list(got["kinds"]) == ["dynamic", "compiled", "dynamic@eager", "compiled@eager"]
    assert got["kinds"]["compiled"]["profile"]["calls"] == 1 and got["kinds"]["compiled@eager"]["profile"]["calls"] == 1
    assert got["meta"]["attn"] == ["sdpa", "eager"]


def test_wait_reports_the_sets_the_eval_workers_finished_when_the_evaluation_is_cut(tmp_path):
    """``wait`` while an evaluation runs (or after a lease ended it): the workers' parts so far go into
    $RESULTS/NAME-eval-partial/ with the report of the sets every worker finished, inside results.tar.xz; an
    evaluation whose report exists is left alone."""
    import importlib.util
    import tarfile

    from peagle_train.core.config import EvalConfig
    from peagle_train.eval.evaluate import run_eval

    spec = importlib.util.spec_from_file_location("te", Path(__file__).with_name("test_evaluate.py"))
    te = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(te)
    target, drafter = te.tiny_pair(K=3)
    cfg = EvalConfig(datasets=["mt_bench", "humaneval"], num_prompts=2, max_new_tokens=6, k_max=3, both_turns=True)
    env = _setup(tmp_path) | {"OUT": str(tmp_path / "out"), "DRAFTERS": "peagle"}
    evals = tmp_path / "work" / "peagle" / "eval"
    run_eval(target, drafter, cfg, evals, target_name="t", drafter_name="d", trained_K=3,
             load_prompts=lambda name, n: te.PROMPTS[:n], progress=False, worker=(0, 2))

    def cut(name, n):
        if name == "humaneval":
            raise TimeoutError("lease over")
        return te.PROMPTS[:n]

    with pytest.raises(TimeoutError):
        run_eval(target, drafter, cfg, evals, target_name="t", drafter_name="d", trained_K=3, load_prompts=cut,
                 progress=False, worker=(1, 2))
    (tmp_path / "work" / "plan.done").write_text("")
    (tmp_path / "work" / "plan.log").write_text("plan: eval\n")
    r = _step(env, "wait", "1")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the sets every worker finished: mt_bench" in r.stdout, r.stdout
    with tarfile.open(tmp_path / "out" / "results.tar.xz") as t:
        names = t.getnames()
        rep = json.load(t.extractfile("./smollm2-135m-peagle-gpu-eval-partial/eval.json"))
    assert "./smollm2-135m-peagle-gpu-eval-partial/parts/worker-1-of-2.json" in names
    assert list(rep["datasets"]) == ["mt_bench"] and rep["partial"] == {"sets_left_out": ["humaneval"]}
    (evals / "eval.json").write_text("{}")  # merged since: nothing partial is made
    r = _step(env, "wait", "1")
    assert r.returncode == 0 and "eval-partial" not in r.stdout
    with tarfile.open(tmp_path / "out" / "results.tar.xz") as t:
        assert not [n for n in t.getnames() if "eval-partial" in n]


def test_leg_with_compile_cache_keeps_the_compiled_code_beside_the_state(tmp_path):
    """``COMPILE_CACHE=1 … leg``: each drafter's run reads and writes train.compile_cache in $WORK/state (what
    state-out ferries to the next machine); without it no compile cache is asked for."""
    env = _machine(tmp_path, "one", _legs_cli(tmp_path))
    r = _step(env | {"COMPILE_CACHE": "1"}, "leg", "0.5")
    assert r.returncode == 0, r.stdout + r.stderr
    for c, name in zip(_trains(tmp_path), ("smollm2-135m-peagle-gpu", "smollm2-135m-eagle3-gpu")):
        assert c["train.compile_cache"] == str(tmp_path / "one" / "state" / f"{name}.compile")
    (tmp_path / "calls.jsonl").unlink()
    r = _step(env, "leg", "0.5")
    assert r.returncode == 0 and all("train.compile_cache" not in c for c in _trains(tmp_path))


def test_the_tracked_tree_leaves_room_for_the_largest_carry():
    """Every device call carries the tracked tree beside its inputs, 64 MiB together; the largest carry is
    ``.gguf3`` (a third of the 98 MB GGUF, ~31.3 MiB, and the ShareGPT prompts and wheels, ~7.7 MiB). Committed
    data (regeneration shards, packs) must leave the tree under 21 MiB (``ferry.MAX_TREE_BYTES``), or the GPU experiments
    stop starting and the state's carry groups stop fitting."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    total = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    import ferry  # benchmarks/ is on sys.path (conftest)

    assert total < ferry.MAX_TREE_BYTES, f"tracked tree {total / 2**20:.1f} MiB: move large data out of the repository"
    # a state carry group (ferry-groups) beside the tree fits one call, with three 14 MiB pieces and their manifests
    assert ferry.MAX_TREE_BYTES + ferry.MAX_CARRY_BYTES <= 64 * 2**20
    assert ferry.MAX_CARRY_BYTES >= 3 * 14 * 2**20 + 2**20


def test_ferry_split_and_join_move_a_file_larger_than_a_piece(tmp_path):
    """``ferry.py split`` cuts each file into byte pieces under the limit (a drafter's weights: larger than one
    returned file) and ``join`` puts them back byte-identical; a missing or damaged piece, or a file of another run
    where the joined one would go, is refused, naming it."""
    import ferry  # benchmarks/ is on sys.path (conftest)

    exp = tmp_path / "export"
    exp.mkdir()
    weights = os.urandom(250_000)
    (exp / "model.safetensors").write_bytes(weights)
    (exp / "config.json").write_text('{"a": 1}')
    (exp / "empty.txt").write_text("")
    m = ferry.split({"peagle": exp}, tmp_path / "pieces", max_piece_bytes=100_000)
    assert m["files"]["peagle/model.safetensors"]["pieces"] == [f"peagle.model.safetensors.p00{i}" for i in range(3)]
    assert all((tmp_path / "pieces" / p).stat().st_size <= 100_000 for p in m["pieces"])
    assert len(m["files"]["peagle/empty.txt"]["pieces"]) == 1
    assert ferry.join(tmp_path / "pieces", tmp_path / "back") == ["peagle/config.json", "peagle/empty.txt",
                                                                    "peagle/model.safetensors"]
    assert (tmp_path / "back" / "peagle" / "model.safetensors").read_bytes() == weights
    assert (tmp_path / "back" / "peagle" / "empty.txt").read_bytes() == b""
    assert ferry.join(tmp_path / "pieces", tmp_path / "back") == []  # the same content: left as it is
    (tmp_path / "back" / "peagle" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="exists with other content"):
        ferry.join(tmp_path / "pieces", tmp_path / "back")
    piece = tmp_path / "pieces" / "peagle.model.safetensors.p001"
    piece.write_bytes(b"x" + piece.read_bytes()[1:])
    with pytest.raises(ValueError, match="p001 is damaged"):
        ferry.join(tmp_path / "pieces", tmp_path / "other")
    piece.unlink()
    with pytest.raises(ValueError, match="1 pieces missing .*p001"):
        ferry.join(tmp_path / "pieces", tmp_path / "other")
    assert not (tmp_path / "other").exists()  # nothing written before every piece is checked
    with pytest.raises(ValueError, match="not a folder with files"):
        ferry.split({"eagle3": tmp_path / "nowhere"}, tmp_path / "p2")


def test_ferry_split_is_current_sees_a_file_rewritten_while_it_was_cut(tmp_path):
    """``ferry.split_is_current``: the same files and sizes, none modified since the split began: current; a file
    rewritten after the split began (the evaluation's merge rewriting the card while the export is cut), even at the
    same size and before the manifest was written: not current, so the next ``wait`` cuts it again."""
    import ferry

    exp, dest = tmp_path / "export", tmp_path / "pieces"
    exp.mkdir()
    (exp / "README.md").write_text("card A\n")
    (exp / "model.safetensors").write_bytes(b"w" * 100)
    ferry.split({"d": exp}, dest)
    assert ferry.split_is_current({"d": exp}, dest)
    started = json.loads((dest / ferry.SPLIT_MANIFEST).read_text())["started"]
    (exp / "README.md").write_text("card B\n")  # same size
    made = (dest / ferry.SPLIT_MANIFEST).stat().st_mtime_ns
    mid = (int(started * 1e9) + made) // 2  # after the split began, before its manifest was written
    os.utime(exp / "README.md", ns=(mid, mid))
    assert started < (exp / "README.md").stat().st_mtime <= (dest / ferry.SPLIT_MANIFEST).stat().st_mtime
    assert not ferry.split_is_current({"d": exp}, dest)
    ferry.split({"d": exp}, dest)
    assert ferry.split_is_current({"d": exp}, dest)
    (dest / ferry.SPLIT_MANIFEST).write_text("[1, 2]")  # not split's JSON: cut again
    assert not ferry.split_is_current({"d": exp}, dest)


def test_export_out_brings_a_finished_drafters_export_back_in_batches(tmp_path):
    """``quality_experiment.sh export-out I``: the export of each drafter in DRAFTERS, cut in 14 MiB pieces once,
    sent in batches under a call's limits; the gathered batches join into the same files. A drafter whose run has
    not finished (no export) is named; an export rewritten later is cut again."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    work = tmp_path / "work"
    exp = work / "peagle" / "export"
    exp.mkdir(parents=True)
    weights = os.urandom(20 * 2**20)  # two pieces of at most 14 MiB
    (exp / "model.safetensors").write_bytes(weights)
    (exp / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    env = os.environ | {"WORK": str(work), "DRAFTERS": "peagle",
                        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("OUT", None)
    back = tmp_path / "back"
    r = _step(env | {"OUT": str(back / "0")}, "export-out", "0")
    assert r.returncode == 0 and "split: 2 files in 3 pieces" in r.stdout and "batch 0 of 1" in r.stdout, r.stdout + r.stderr
    assert sorted(f.name for f in (back / "0").iterdir()) == [
        "smollm2-135m-peagle-gpu.config.json.p000", "smollm2-135m-peagle-gpu.model.safetensors.p000",
        "smollm2-135m-peagle-gpu.model.safetensors.p001", "split-manifest.json"]
    r = _step(env | {"OUT": str(back / "0b")}, "export-out", "0")  # the pieces are kept while the export is unchanged
    assert r.returncode == 0 and "split:" not in r.stdout, r.stdout + r.stderr
    import ferry

    assert ferry.join(back / "0", tmp_path / "joined") == ["smollm2-135m-peagle-gpu/config.json",
                                                           "smollm2-135m-peagle-gpu/model.safetensors"]
    assert (tmp_path / "joined" / "smollm2-135m-peagle-gpu" / "model.safetensors").read_bytes() == weights
    os.utime(exp / "config.json", (os.path.getmtime(work / "export-pieces" / "split-manifest.json") + 5,) * 2)
    r = _step(env | {"OUT": str(back / "1")}, "export-out", "0")
    assert r.returncode == 0 and "split: 2 files" in r.stdout, r.stdout + r.stderr
    r = _step(env | {"OUT": str(back / "2"), "DRAFTERS": "peagle eagle3"}, "export-out", "0")
    assert r.returncode == 2 and "no export in" in r.stderr and "eagle3/export" in r.stderr


def test_ferry_out_next_sends_what_fits_beside_the_calls_files_once(tmp_path):
    """``ferry.out_next``: the split manifest first, then the pieces in name order, as many as fit beside the files
    the call returns already (file count and bytes); what was sent is not sent again with the same content: a new
    manifest and a changed piece go again, the unchanged pieces do not; the record itself never travels."""
    import ferry

    src, d1, d2, d3 = (tmp_path / n for n in ("src", "d1", "d2", "d3"))
    src.mkdir()
    for name, n in (("a.p000", 40), ("a.p001", 40), ("b.p000", 10)):
        (src / name).write_bytes(b"x" * n)
    (src / ferry.SPLIT_MANIFEST).write_text('{"cut": 1}')
    d1.mkdir()
    (d1 / "plan.log").write_bytes(b"l" * 10)
    assert ferry.out_next(src, d1, max_files=8, max_bytes=99) == [ferry.SPLIT_MANIFEST, "a.p000"]  # 10+10+40+40 > 99
    assert ferry.out_next(src, d2, max_files=2, max_bytes=1000) == ["a.p001", "b.p000"]
    assert ferry.out_next(src, d3) == [] and not (d3 / ferry.SENT).exists()
    assert ferry.unsent(src) == []
    (src / ferry.SPLIT_MANIFEST).write_text('{"cut": 2}')  # cut again, one piece changed: those two go again
    (src / "b.p000").write_bytes(b"y" * 12)
    assert ferry.unsent(src) == ["b.p000", ferry.SPLIT_MANIFEST]
    assert ferry.out_next(src, tmp_path / "d4") == [ferry.SPLIT_MANIFEST, "b.p000"]
    (src / ferry.SENT).write_text('{"cut": "x", "sent": ["a.p000"]}')  # an older record (names only): all again
    assert ferry.out_next(src, tmp_path / "d5") == [ferry.SPLIT_MANIFEST, "a.p000", "a.p001", "b.p000"]
    with pytest.raises(ValueError, match="not a folder"):
        ferry.out_next(tmp_path / "nowhere", d3)


def test_wait_brings_a_finished_drafters_export_back_over_its_calls(tmp_path):
    """``wait`` after the drafter's run finished: each call returns, beside the log and the results, the export's
    pieces not returned before (a 70 MiB export: 4 pieces in the first call, the last one in the second, none in
    the third); the gathered calls join into the export. EXPORT_BACK=0 returns none."""
    env = _setup(tmp_path) | {"DRAFTERS": "peagle"}
    work = tmp_path / "work"
    exp = work / "peagle" / "export"
    exp.mkdir(parents=True)
    weights = os.urandom(70 * 2**20)  # five 14 MiB pieces: more than one call returns
    (exp / "model.safetensors").write_bytes(weights)
    (exp / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (work / "plan.done").write_text("")
    (work / "plan.log").write_text("plan: eval\n")
    r = _step(env | {"OUT": str(tmp_path / "c0"), "EXPORT_BACK": "0"}, "wait", "1")
    assert r.returncode == 0 and not [f for f in (tmp_path / "c0").iterdir() if ".p0" in f.name], r.stdout + r.stderr
    (exp / "README.md").write_text("the card before the evaluation\n")
    names = []
    for i in range(3):
        if i == 1:  # the evaluation's merge rewrites the card after the first cut (run 9): the weights stay sent
            time.sleep(0.05)
            (exp / "README.md").write_text("the card with the evaluation's table\n")
        out = tmp_path / f"c{i + 1}"
        r = _step(env | {"OUT": str(out)}, "wait", "1")
        assert r.returncode == 0, r.stdout + r.stderr
        files = list(out.iterdir())
        assert len(files) <= 8 and sum(f.stat().st_size for f in files) <= 62 * 2**20
        names.append(sorted(f.name for f in files if f.name not in ("plan.log", "results.tar.xz")))
    assert names[0] == ["smollm2-135m-peagle-gpu.README.md.p000", "smollm2-135m-peagle-gpu.config.json.p000"] + [
        f"smollm2-135m-peagle-gpu.model.safetensors.p00{i}" for i in range(3)] + ["split-manifest.json"]
    assert names[1] == ["smollm2-135m-peagle-gpu.README.md.p000"] + [
        f"smollm2-135m-peagle-gpu.model.safetensors.p00{i}" for i in (3, 4)] + ["split-manifest.json"]
    assert names[2] == []
    assert "all of them sent" in r.stdout
    # DRAFTERS of two, the plan still running: nothing is cut until both exports are there (cutting again later
    # would send the first one's pieces twice); once the plan ended, what there is
    (work / "plan.done").unlink()
    both = env | {"DRAFTERS": "peagle eagle3"}
    r = _step(both | {"OUT": str(tmp_path / "two")}, "wait", "1")
    assert r.returncode == 0 and "out-next" not in r.stdout, r.stdout + r.stderr
    (work / "plan.done").write_text("")
    r = _step(both | {"OUT": str(tmp_path / "three")}, "wait", "1")
    assert r.returncode == 0 and "all of them sent" in r.stdout, r.stdout + r.stderr  # the same cut: nothing again
    gathered = tmp_path / "gathered"
    gathered.mkdir()
    for i in (1, 2):
        for f in (tmp_path / f"c{i}").glob("*"):
            if f.name not in ("plan.log", "results.tar.xz"):
                shutil.copy(f, gathered / f.name)
    import ferry

    ferry.join(gathered, tmp_path / "joined")
    assert (tmp_path / "joined" / "smollm2-135m-peagle-gpu" / "model.safetensors").read_bytes() == weights
    assert "evaluation's table" in (tmp_path / "joined" / "smollm2-135m-peagle-gpu" / "README.md").read_text()


FAKE_EVAL_CPU = """#!{python}
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if "--eval-merge" in args:
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("output_dir=")))
    (out / "eval").mkdir(exist_ok=True)
    (out / "eval" / "eval.json").write_text("{{}}")
"""


def test_eval_cpu_runs_claiming_workers_on_the_export_then_merges_them(tmp_path):
    """``benchmarks/eval_cpu.sh RUN``: W workers of the fp32 eager loop claim prompts under one name in RUN (the
    GGUF and prompts named), then one merge of W parts; a RUN without an export is refused before any work."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "fake_cli.py"
    fake.write_text(FAKE_EVAL_CPU.format(python=sys.executable))
    fake.chmod(0o755)
    run = tmp_path / "run12"
    env = os.environ | {"PEAGLE_CLI": str(fake), "FAKE_LOG": str(tmp_path / "calls.jsonl"), "W": "3",
                        "GGUF": "/g/t.gguf", "PROMPTS": "/g/p.json"}
    script = ROOT / "benchmarks" / "eval_cpu.sh"
    r = subprocess.run(["bash", str(script), str(run)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "export/config.json missing" in r.stderr and not (tmp_path / "calls.jsonl").exists()
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text("{}")
    r = subprocess.run(["bash", str(script), "run12/"], env=env, capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)  # relative to the caller, trailing slash: the same folder
    assert r.returncode == 0 and f"({run}/eval/eval.json)" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "run12.eval-0.err").exists()
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    workers, merge = calls[:3], calls[3]
    assert sorted(c[c.index("--eval-worker") + 1] for c in workers) == ["0/3", "1/3", "2/3"]
    assert {c[c.index("--eval-claim") + 1] for c in workers} == {"run12-cpu"}
    for c in calls:
        assert c[:2] == ["eval", "recipes/smollm2-135m-peagle-gpu.yaml"]
        assert {f"output_dir={run}", "target.dtype=float32", "eval.compile_target=false", "target.gguf_file=/g/t.gguf",
                "data.path=/g/p.json", "eval.datasets=[mt_bench,humaneval]"} <= set(c)
    assert merge[merge.index("--eval-merge") + 1] == "3" and "--eval-worker" not in merge
