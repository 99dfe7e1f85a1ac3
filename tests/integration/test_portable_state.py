"""Integration: the portable training state (train.state_out / train.state_in) on the tiny random Llama (CPU).

Pins: a run stopped at step 4 with ``train.state_out`` continues in a FRESH run folder (prepared data
only: online features, no cache, no checkpoints) from that one file, with the uninterrupted run's losses
(fp32 moments: to 1e-6; bf16 moments: a small, bounded drift) and its history; the file holds only the
trainable weights, moments and RNG (no target tensor); a state of another recipe, target or data is
refused naming the differences; a corrupted file fails its checksum; a split state reassembles
byte-identically and a missing part is named.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_target
from test_train import _cfg, _prepared

from peagle_train.trainer import portable_state as ps
from peagle_train.trainer.trainer import run_train

STOP = 4


def _fresh(run_dir: Path, name: str) -> Path:
    """A fresh run folder holding only the prepared data (what a new machine is given)."""
    out = run_dir / name
    shutil.copytree(run_dir / "run" / "data", out / "data")
    return out


def _cfg_at(run_dir, out: Path, **train):
    return _cfg(run_dir, epochs=1, features="online", **train).model_copy(update={"output_dir": str(out)})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted run, and runs stopped at STEP 4 writing fp32 and bf16 portable states."""
    run_dir = tmp_path_factory.mktemp("portable")
    save_tiny_target(run_dir / "target")
    _prepared(run_dir / "run")
    straight = run_train(_cfg_at(run_dir, run_dir / "run"), progress=False)["history"]
    states = {}
    for moments in ("fp32", "bf16"):
        state = run_dir / f"state-{moments}.pst"
        cfg = _cfg_at(run_dir, _fresh(run_dir, f"stop_{moments}"), state_out=str(state), state_moments=moments)
        first = run_train(cfg, progress=False, stop_at=STOP)["history"]
        assert [h["loss"] for h in first] == [h["loss"] for h in straight[:STOP]]
        states[moments] = state
        rec = json.loads((Path(cfg.output_dir) / "logs" / "state_out.json").read_text())  # recorded for the job's log
        assert rec["step"] == STOP and rec["bytes"] == state.stat().st_size and rec["parts"] == []
    return run_dir, straight, states


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_resume_from_portable_state_in_a_fresh_folder(runs, moments):
    run_dir, straight, states = runs
    header, tensors = ps.read_state_file(states[moments])
    assert header["step"] == STOP and header["moments"] == moments and len(header["history"]) == STOP
    kinds = {k.split("/")[0] for k in tensors}
    assert kinds == {"param", "exp_avg", "exp_avg_sq", "rng"}, kinds  # never the target or features
    assert all(t.dtype == torch.float32 for k, t in tensors.items() if k.startswith("param/"))
    want = torch.bfloat16 if moments == "bf16" else torch.float32
    assert all(t.dtype == want for k, t in tensors.items() if k.startswith("exp_avg"))
    n = sum(t.numel() for k, t in tensors.items() if k.startswith("param/"))
    size = states[moments].stat().st_size
    est = ps.recipe_state_size(_cfg_at(run_dir, run_dir / "run"))  # from the recipe and the target's config alone
    assert est["trainable"] == n and est["bytes"][moments] == ps.state_size_bytes(n, moments)
    assert ps.state_size_bytes(n, moments) < size < ps.state_size_bytes(n, moments) + 200_000
    print(f"\n{moments}: {n} trainable params, state file {size} bytes")

    out = _fresh(run_dir, f"resume_{moments}")  # prepared data only
    resumed = run_train(_cfg_at(run_dir, out, state_in=str(states[moments])), progress=False)["history"]
    assert [h["step"] for h in resumed] == list(range(1, len(straight) + 1))  # the curve continues
    assert [h["loss"] for h in resumed[:STOP]] == [h["loss"] for h in straight[:STOP]]
    assert resumed[-1]["elapsed_s"] > resumed[STOP - 1]["elapsed_s"]
    logged = [json.loads(x) for x in (out / "logs" / "steps.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged] == list(range(1, len(straight) + 1))
    a = torch.tensor([h["loss"] for h in resumed[STOP:]], dtype=torch.float64)
    b = torch.tensor([h["loss"] for h in straight[STOP:]], dtype=torch.float64)
    dev = float((a - b).abs().max())
    print(f"{moments}: max |resumed - uninterrupted| loss over steps {STOP + 1}-{len(straight)}: {dev:.3e}")
    if moments == "fp32":
        assert dev <= 1e-6
        assert [h["lr"] for h in resumed] == pytest.approx([h["lr"] for h in straight], abs=0)
    else:
        assert dev <= 5e-3 * float(b.abs().max())


def test_state_of_another_run_is_refused(runs):
    """Another drafter shape, target layers, lr or prepared data: refused before training, naming each difference."""
    run_dir, _, states = runs
    state = str(states["fp32"])
    for i, (changes, expect) in enumerate([
        ({"drafter": {"num_layers": 3}}, ["drafter.num_layers: state 2, this run 3"]),
        ({"target": {"aux_layer_ids": [0, 3, 4]}, "train": {"lr": 1e-3}},
         ["target.aux_layer_ids: state [1, 3, 4], this run [0, 3, 4]", "train.lr: state 0.003, this run 0.001"]),
    ]):
        cfg = _cfg_at(run_dir, _fresh(run_dir, f"other{i}"), state_in=state)
        cfg = cfg.model_copy(update={sec: getattr(cfg, sec).model_copy(update=kv) for sec, kv in changes.items()})
        with pytest.raises(ps.StateError, match="written by another run") as err:
            run_train(cfg, progress=False)
        for e in expect:
            assert e in str(err.value), str(err.value)
        assert not (Path(cfg.output_dir) / "drafter").exists()
    other_data = run_dir / "other_data"
    _prepared(other_data, seed=1)  # same counts, other tokens
    with pytest.raises(ps.StateError, match=r"data\.train_sha256: state '[0-9a-f]+', this run '[0-9a-f]+'"):
        run_train(_cfg_at(run_dir, other_data, state_in=state), progress=False)
    big = run_dir / "target_big"  # another target: its shape is compared, not its path
    from transformers import AutoConfig, LlamaForCausalLM

    tc = AutoConfig.from_pretrained(str(run_dir / "target"))
    tc.num_hidden_layers = 7
    torch.manual_seed(0)
    LlamaForCausalLM(tc).save_pretrained(big)
    cfg = _cfg_at(run_dir, _fresh(run_dir, "other_target"), state_in=state)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"path": str(big)})})
    with pytest.raises(ps.StateError, match="target_config.num_hidden_layers: state 6, this run 7"):
        run_train(cfg, progress=False)


def test_state_older_than_a_recipe_key_resumes_at_its_default(runs, tmp_path):
    """A state written before a recipe key existed (its fingerprint lacks ``train.depth_weights``) resumes where this
    run leaves the key at its default (what the state was trained with), and is refused naming the key where the
    run sets it otherwise."""
    run_dir, straight, states = runs
    header, tensors = ps.read_state_file(states["fp32"])
    keys = header["fingerprint"]["keys"]
    assert keys.pop("train.depth_weights") is None
    old = tmp_path / "older.pst"
    ps.write_state_file(old, {k: v for k, v in header.items() if not k.startswith("payload_")}, tensors)
    resumed = run_train(_cfg_at(run_dir, _fresh(run_dir, "older"), state_in=str(old)), progress=False)["history"]
    assert [h["loss"] for h in resumed[:STOP]] == [h["loss"] for h in straight[:STOP]] and len(resumed) == len(straight)
    cfg = _cfg_at(run_dir, _fresh(run_dir, "older_weighted"), state_in=str(old), depth_weights=[1.0, 0.5, 0.5, 0.5])
    with pytest.raises(ps.StateError, match=r"train\.depth_weights: state '<absent>', this run \[1\.0, 0\.5"):
        run_train(cfg, progress=False)


def test_corrupted_state_is_refused(runs, tmp_path):
    run_dir, _, states = runs
    bad = tmp_path / "bad.pst"
    data = bytearray(states["fp32"].read_bytes())
    data[-100] ^= 0xFF  # inside the tensors
    bad.write_bytes(bytes(data))
    with pytest.raises(ps.StateError, match="checksum mismatch"):
        ps.read_state_file(bad)
    bad.write_bytes(bytes(data[: len(data) // 2]))  # truncated copy
    with pytest.raises(ps.StateError, match="checksum mismatch"):
        run_train(_cfg_at(run_dir, _fresh(run_dir, "corrupt"), state_in=str(bad)), progress=False)


def test_split_state_reassembles(runs, tmp_path):
    """state_part_mib: pieces of at most that size plus a manifest; read and joined byte-identically;
    rewriting removes the old pieces; a missing or damaged piece is named."""
    _, _, states = runs
    header, tensors = ps.read_state_file(states["fp32"])
    header = {k: v for k, v in header.items() if k not in ("payload_sha256", "payload_bytes")}
    whole = tmp_path / "whole.pst"
    single = ps.write_state_file(whole, header, tensors)
    split = tmp_path / "out" / "state.pst"
    limit_mib = 0.25
    res = ps.write_state_file(split, header, tensors, max_part_mib=limit_mib)
    assert res["sha256"] == single["sha256"] and len(res["parts"]) == -(-single["bytes"] // int(limit_mib * 2**20))
    assert all(Path(p).stat().st_size <= limit_mib * 2**20 for p in res["parts"])
    assert json.loads(split.read_text())["format"] == ps.PARTS_FORMAT and ps.peek_step(split) == STOP
    assert ps.join_parts(split, tmp_path / "joined.pst").read_bytes() == whole.read_bytes()
    h2, t2 = ps.read_state_file(split)
    assert h2["step"] == STOP and all(torch.equal(t2[k], v) for k, v in tensors.items())
    header2 = {**header, "step": STOP + 1}  # a later write replaces the pieces
    res2 = ps.write_state_file(split, header2, tensors, max_part_mib=limit_mib)
    assert sorted(p.name for p in split.parent.glob("state.pst.*.part*")) == sorted(Path(p).name for p in res2["parts"])
    Path(res2["parts"][1]).write_bytes(b"x" * 10)
    with pytest.raises(ps.StateError, match="part1 fails its checksum"):
        ps.read_state_file(split)
    Path(res2["parts"][1]).unlink()
    with pytest.raises(ps.StateError, match="is missing"):
        ps.read_state_file(split)


def test_cli_chain_of_two_launches(runs, capsys):
    """`peagle-train train RECIPE train.state_out=S --stop-at N` in one folder, then in a fresh folder with
    train.state_in: the second launch's history is the uninterrupted run's first steps (fp32 moments: equal).
    In a folder with a checkpoint of the same step the checkpoint is loaded; a state of a later step wins."""
    from peagle_train.cli import main
    from peagle_train.recipe import dump_config

    run_dir, straight, _ = runs
    recipe = run_dir / "recipe.yaml"
    dump_config(_cfg_at(run_dir, run_dir / "cli_a"), recipe)
    shutil.copytree(run_dir / "run" / "data", run_dir / "cli_a" / "data")
    s1, s2 = run_dir / "cli-1.pst", run_dir / "cli-2.pst"
    assert main(["train", str(recipe), f"train.state_out={s1}", "train.state_moments=fp32", "--stop-at", "2",
                 "--quiet"]) == 0
    assert f"portable state: {s1} (step 2" in capsys.readouterr().out
    b = _fresh(run_dir, "cli_b")
    assert main(["train", str(recipe), f"output_dir={b}", f"train.state_in={s1}", f"train.state_out={s2}",
                 "train.state_moments=fp32", "--stop-at", "4", "--quiet"]) == 0
    header, _ = ps.read_state_file(s2)
    assert header["step"] == 4 and [h["loss"] for h in header["history"]] == [h["loss"] for h in straight[:4]]
    # a run folder with its own checkpoint: train.state_in wins only when it holds a later step
    a = run_dir / "cli_a"
    run_train(_cfg_at(run_dir, a, state_in=str(s1)), progress=False, stop_at=3)
    assert f"resumed from {a / 'checkpoints' / 'step-00000002'} (step 2)" in capsys.readouterr().out
    run_train(_cfg_at(run_dir, a, state_in=str(s2)), progress=False, stop_at=5)
    assert f"resumed from portable state {s2} (step 4" in capsys.readouterr().out


def test_a_launch_limit_met_with_the_time_budget_spent_finishes_the_run(runs, monkeypatch, capsys):
    """``--stop-after`` met on the step that also spends ``train.max_minutes``: the budget wins, the run finishes
    (train_metrics.json, the drafter saved for export) instead of stopping unfinished for a launch that would train
    nothing (quality_experiment.sh ``leg M`` with ``train.max_minutes=M`` lost its export that way)."""
    from peagle_train.trainer.trainer import Trainer

    run_dir, _, _ = runs
    out = _fresh(run_dir, "budget_and_launch")
    calls = []

    def fraction(self, t_start):  # the budget is spent once the first step has run
        calls.append(self.step)
        return 0.0 if self.step == 0 else 1.5

    monkeypatch.setattr(Trainer, "_time_fraction", fraction)
    cfg = _cfg_at(run_dir, out).model_copy(deep=True)
    cfg.train.max_minutes = 5.0
    run_train(cfg, progress=False, stop_after_minutes=1e-6)
    assert "stopped after" not in capsys.readouterr().out
    assert (out / "train_metrics.json").is_file() and (out / "drafter").is_dir()
    assert json.loads((out / "train_metrics.json").read_text())["steps"] == 1 and 1 in calls


def test_cli_stop_after_minutes(runs, capsys):
    """`peagle-train train ... --stop-after MINUTES`: a launch that has trained that long checkpoints, writes
    train.state_out and exits (here: the first step outlasts 1e-6 minutes); the next launch, in a fresh folder,
    continues from the state to the end, with the uninterrupted run's losses (fp32 moments). A limit that is
    not a positive number of minutes is refused before anything runs."""
    from peagle_train.cli import main
    from peagle_train.recipe import dump_config

    run_dir, straight, _ = runs
    recipe = run_dir / "recipe-stop-after.yaml"
    a = _fresh(run_dir, "after_a")
    dump_config(_cfg_at(run_dir, a), recipe)
    s1 = run_dir / "after-1.pst"
    assert main(["train", str(recipe), f"train.state_out={s1}", "train.state_moments=fp32", "--stop-after", "1e-6",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "stopped after 1e-06 minutes of this launch at step 1 of" in out and ps.peek_step(s1) == 1
    assert not (a / "train_metrics.json").exists()  # not finished: the next launch continues
    b = _fresh(run_dir, "after_b")
    assert main(["train", str(recipe), f"output_dir={b}", f"train.state_in={s1}", "train.state_moments=fp32",
                 "--stop-after", "60", "--quiet"]) == 0
    done = json.loads((b / "train_metrics.json").read_text())
    assert done["steps"] == len(straight)
    assert [h["loss"] for h in done["history"]] == pytest.approx([h["loss"] for h in straight], rel=1e-6, abs=1e-7)
    assert main(["train", str(recipe), "--stop-after", "0", "--quiet"]) == 2
    assert "--stop-after 0.0: give the minutes of this launch" in capsys.readouterr().err
