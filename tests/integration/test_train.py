"""Integration: cache → train → resume on a tiny random Llama target (CPU).

Pins: the trainer learns (loss falls on a learnable sequence set), the feature
cache round-trips and detects corruption, exact resume after a checkpoint, and the
global-count loss normalisation (micro-batches × segments sum to one step's loss).
"""
import json
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_target
from peagle_train.core.config import ConfigError
from peagle_train.recipe import config_from_dict
from peagle_train.features.cache import CacheError, CachedFeatures
from peagle_train.stages import run_cache
from peagle_train.features.tokenized import save_tokenized
from peagle_train.model.checkpoint import load_drafter_dir
from peagle_train.features.tokenized import load_prepared
from peagle_train.trainer.trainer import Trainer, run_train


def _prepared(out: Path, n=12, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        # a learnable, repetitive sequence: arithmetic progressions mod 60 (token 63 = mask never appears)
        start, stride = int(torch.randint(0, 60, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        ids = [(start + stride * j) % 60 for j in range(length)]
        rows.append({"input_ids": ids, "loss_mask": [0] * 8 + [1] * (length - 8)})
    save_tokenized(rows[: n - 2], out / "data" / "train.safetensors")
    save_tokenized(rows[n - 2:], out / "data" / "eval.safetensors")


def _cfg(tmp_path, **train):
    t = dict(method="peagle", K=4, epochs=3, lr=3e-3, warmup_ratio=0.0, features="cache", log_every=1,
             eval_sequences=2, attention="sdpa", loss_chunk_size=64)
    t.update(train)
    return config_from_dict({
        "output_dir": str(tmp_path / "run"),
        "target": {"name": "tiny", "path": str(tmp_path / "target"), "aux_layer_ids": [1, 3, 4]},
        "drafter": {"num_layers": 2, "draft_vocab_size": 48, "mask_token_id": 63},
        "train": t, "eval": {"k_max": 3},
    })


def _cached_inputs(run_dir):
    """Cache the tiny run's features once; returns ``(data, feats, target_config)`` for :class:`Trainer`."""
    from transformers import AutoConfig

    cfg0 = _cfg(run_dir, max_steps=1)
    run_cache(cfg0, progress=False)
    out = Path(cfg0.output_dir)
    feats = {"train": CachedFeatures(out / "features" / "train"), "eval": CachedFeatures(out / "features" / "eval")}
    return load_prepared(out), feats, AutoConfig.from_pretrained(str(run_dir / "target"))


def fake_clock(monkeypatch) -> None:
    """``time.perf_counter`` as the trainer sees it: every read advances 1 s."""
    import peagle_train.trainer.trainer as train_mod

    clock = {"t": 0.0}

    def tick():
        clock["t"] += 1.0
        return clock["t"]

    monkeypatch.setattr(train_mod.time, "perf_counter", tick)


@pytest.fixture()
def run_dir(tmp_path):
    save_tiny_target(tmp_path / "target")
    _prepared(tmp_path / "run")
    return tmp_path


def test_cache_train_learns_and_saves(run_dir):
    cfg = _cfg(run_dir, epochs=6, loss="ce")
    run_cache(cfg, progress=False)
    metrics = run_train(cfg, progress=False)
    losses = [h["loss"] for h in metrics["history"]]
    assert len(losses) == 60  # 10 sequences x 6 epochs
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5, losses
    d = load_drafter_dir(Path(cfg.output_dir) / "drafter")
    assert d.config.parallel_drafting and d.lm_head.weight.shape == (48, 32)
    final = json.loads((Path(cfg.output_dir) / "train_metrics.json").read_text())["final"]
    assert final["eval_sim_al"]["1"] >= 1.0
    for key in ("eval_walk_al", "eval_walk_al_heldout"):  # loop-equivalent simulated AL, K = 1..train.K
        assert sorted(final[key], key=int) == [str(k) for k in range(1, cfg.train.K + 1)]
        assert all(1.0 <= v <= int(k) + 1 for k, v in final[key].items()), final[key]


def test_cache_detects_corruption(run_dir):
    cfg = _cfg(run_dir)
    root = run_cache(cfg, progress=False)
    shard = sorted((root / "train").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        CachedFeatures(root / "train").get([0])


def test_exact_resume(run_dir):
    cfg_a = _cfg(run_dir, epochs=1, save_every=2)
    run_cache(cfg_a, progress=False)
    straight = [h["loss"] for h in run_train(cfg_a, progress=False)["history"]]
    # second run in a fresh output dir: stop after 2 steps (checkpoint), then resume to the end
    out_b = run_dir / "run_b"
    import shutil
    shutil.copytree(run_dir / "run" / "data", out_b / "data")
    shutil.copytree(run_dir / "run" / "features", out_b / "features")
    cfg_b = cfg_a.model_copy(update={"output_dir": str(out_b)})
    first = [h["loss"] for h in run_train(cfg_b, progress=False, stop_at=2)["history"]]
    resumed = [h["loss"] for h in run_train(cfg_b, progress=False)["history"]]
    assert first == straight[:2]
    assert resumed == pytest.approx(straight, abs=1e-6)


def test_grad_accum_equals_bigger_micro_batch_layouts(run_dir):
    """One optimizer step over 2 sequences: (mbs=2, ga=1) and (mbs=1, ga=2, S=3) give the same update."""
    data, feats, tconf = _cached_inputs(run_dir)
    results = []
    for kw in ({"micro_batch_size": 2, "grad_accum": 1}, {"micro_batch_size": 1, "grad_accum": 2, "partitions": 3}):
        cfg = _cfg(run_dir, max_steps=1, cod_r=1.0, cod_r_min=1.0, **kw)
        tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
        rec = tr.train_step()
        w = tr.acc.unwrap_model(tr.model).drafter.fc.weight.detach().clone()
        results.append((rec["loss"], w))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_time_schedule_anneals_within_the_time_budget(run_dir, monkeypatch):
    """schedule: time — a run stopped by max_minutes long before its planned steps still ends near
    min_lr (the step schedule would still be at its peak); a missing max_minutes is refused."""
    with pytest.raises(ConfigError, match="schedule=time needs train.max_minutes"):
        _cfg(run_dir, schedule="time")
    fake_clock(monkeypatch)  # every read advances 1 s, so the budget is hit after ~10 steps
    cfg = _cfg(run_dir, epochs=200, features="online", max_minutes=0.5, schedule="time", min_lr_ratio=0.1)
    m = run_train(cfg, progress=False)
    lrs = [h["lr"] for h in m["history"]]
    assert 3 <= len(lrs) < 200 * 10
    assert lrs[0] == pytest.approx(3e-3, rel=0.05)
    assert lrs[-1] < 0.35 * 3e-3 and lrs == sorted(lrs, reverse=True), lrs


def test_auto_partitions_follow_the_planner(run_dir, monkeypatch):
    """train.partitions: auto — one S per micro-batch from peagle_train.peagle.planner.partitions_for
    (here forced to 3 and given each micro-batch's packed length): the step equals an explicit
    S = 3 step; without a GPU the planner's answer is S = 1."""
    import peagle_train.peagle.planner as planner

    with pytest.raises(ConfigError, match="only defined for method 'peagle'"):
        _cfg(run_dir, method="eagle3", partitions="auto")
    data, feats, tconf = _cached_inputs(run_dir)

    auto = Trainer(_cfg(run_dir, max_steps=1, partitions="auto", fused_loss=False), data, feats, tconf, [1, 3, 4])
    assert auto.partitions([40, 80]) == [1, 1]  # CPU: no GPU memory to plan against
    seen = []

    def fake(N, K, r, r_min, shape, gpu_bytes, **kw):
        seen.append((N, gpu_bytes, shape.hidden_size, kw["fused_loss"], kw["grads_resident"]))
        return 3

    monkeypatch.setattr(planner, "partitions_for", fake)
    rec_auto = auto.train_step()
    # one micro-batch: the planner decides when gradients are resident (S > 1); the config's loss path
    assert seen and all(s == (40, None, 32, False, None) for s in seen), seen
    seen.clear()
    assert auto.partitions([40, 80]) == [3, 3]  # several micro-batches: gradients resident after the first
    assert [s[0] for s in seen] == [40, 80] and all(s[4] is True for s in seen)

    def no_fit(*a, **k):
        raise ValueError("no plan fits N=40")

    monkeypatch.setattr(planner, "partitions_for", no_fit)
    with pytest.raises(ConfigError, match="train.partitions=auto found no plan for a micro-batch of 40 tokens"):
        auto.partitions([40])
    fixed = Trainer(_cfg(run_dir, max_steps=1, partitions=3, fused_loss=False), data, feats, tconf, [1, 3, 4])
    rec_fixed = fixed.train_step()
    assert rec_auto["loss"] == pytest.approx(rec_fixed["loss"], rel=1e-6)
    wa = auto.acc.unwrap_model(auto.model).drafter.fc.weight
    wf = fixed.acc.unwrap_model(fixed.model).drafter.fc.weight
    assert torch.allclose(wa, wf, atol=1e-6)


def test_time_schedule_continues_after_resume(run_dir, monkeypatch):
    """A resumed schedule: time run keeps its elapsed time: elapsed_s and the LR continue where the
    checkpoint left them (the LR does not jump back to its step-schedule value)."""
    fake_clock(monkeypatch)
    cfg = _cfg(run_dir, epochs=200, features="online", max_minutes=1.0, schedule="time", min_lr_ratio=0.1)
    first = run_train(cfg, progress=False, stop_at=8)["history"]
    full = run_train(cfg, progress=False)["history"]
    assert full[:8] == first
    elapsed = [h["elapsed_s"] for h in full]
    lrs = [h["lr"] for h in full]
    assert elapsed == sorted(elapsed) and elapsed[8] > elapsed[7]
    assert lrs == sorted(lrs, reverse=True), lrs  # no jump back up at the resume (step 9)
    assert lrs[-1] < 0.35 * 3e-3 and len(full) < 200 * 10


def test_heldout_rank_matches_eval_prompts_order():
    """The walk's heldout subset is the order of data/eval_prompts.json (rows whose first token is
    supervised have no prompt and are skipped by both)."""
    from types import SimpleNamespace

    from peagle_train.stages import eval_prompt_ids

    masks = [[0, 1, 1], [1, 1, 0], [0, 0, 1], [0, 1, 0]]
    rows = [{"input_ids": [7, 8, 9], "loss_mask": m} for m in masks]
    fake = SimpleNamespace(eval_masks=masks, _ranks=None)
    ranks = [Trainer._heldout_rank(fake, i) for i in range(4)]
    assert ranks[0] == 0 and ranks[2] == 1 and ranks[3] == 2 and ranks[1] > 10**9
    assert len(eval_prompt_ids(rows)) == 3


def test_eagle3_ttt_shapes_are_static_per_run(run_dir):
    """EAGLE-3 TTT pads every micro-batch's steps as for the longest possible micro-batch
    (``micro_batch_size ×`` longest sequence), so a compiled attention kernel set is built once per run
    instead of once per (bucket, step) — the compile stalls that left EAGLE-3 with 43 steps in a
    3.5-minute H200 run (docs/results.md)."""
    data, feats, tconf = _cached_inputs(run_dir)
    t = Trainer(_cfg(run_dir, method="eagle3", K=3, max_steps=1, micro_batch_size=2), data, feats, tconf, [1, 3, 4])
    obj = t.acc.unwrap_model(t.model)
    longest = max(len(x) for x in data["train"]["input_ids"])
    assert obj.static_tokens == 2 * longest
    obj.pad_multiple = 16  # as flex would pad (CPU tests use sdpa: exact lengths)
    sums = {sum(t.lengths[i] for i in mb) for s in range(t.steps_per_epoch) for mb in t.micro_batches(s)}
    sums |= {1, 17, obj.static_tokens - 1, obj.static_tokens}  # any micro-batch up to the bound
    assert len({tuple(obj.step_lengths(n, 3)) for n in sums}) == 1


def test_train_sequences_trains_on_a_prefix_of_the_split(run_dir):
    """train.train_sequences (data-size ablation): only the first n prepared sequences are dealt
    to micro-batches; more than the split holds is a ConfigError."""

    data, feats, tconf = _cached_inputs(run_dir)
    n_all = len(data["train"]["input_ids"])
    t = Trainer(_cfg(run_dir, max_steps=1, train_sequences=3), data, feats, tconf, [1, 3, 4])
    assert len(t.train_ids) == 3 and t.steps_per_epoch == 3
    used = {i for s in range(t.steps_per_epoch) for mb in t.micro_batches(s) for i in mb}
    assert used == {0, 1, 2}
    assert torch.isfinite(torch.tensor(t.train_step()["loss"]))
    with pytest.raises(ConfigError, match=f"train.train_sequences={n_all + 1} but the prepared train split"):
        Trainer(_cfg(run_dir, max_steps=1, train_sequences=n_all + 1), data, feats, tconf, [1, 3, 4])


def test_chain_kernel_is_resolved_at_set_up(run_dir, monkeypatch):
    """train.chain_kernel is resolved once when the trainer is built: ``auto`` on CPU runs the PyTorch
    chain part, and ``triton`` where Triton cannot run is a ConfigError naming the key, before any step."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    data, feats, tconf = _cached_inputs(run_dir)
    t = Trainer(_cfg(run_dir, max_steps=1), data, feats, tconf, [1, 3, 4])
    assert t.chain_kernel == "torch"
    with pytest.raises(ConfigError, match="train.chain_kernel: .*set chain_kernel: auto or torch"):
        Trainer(_cfg(run_dir, max_steps=1, chain_kernel="triton"), data, feats, tconf, [1, 3, 4])


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_fused_loss_trains_like_the_recompute_path(run_dir, method):
    """train.fused_loss reaches the objective (P-EAGLE, partitioned, and the EAGLE-3 baseline) and two
    optimizer steps give the same losses and weights as the checkpoint + recompute path."""
    data, feats, tconf = _cached_inputs(run_dir)
    results = {}
    for fused in (True, False):
        cfg = _cfg(run_dir, max_steps=2, method=method, partitions=2 if method == "peagle" else 1,
                   fused_loss=fused)
        tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
        assert tr.acc.unwrap_model(tr.model).fused_loss is fused
        recs = [tr.train_step()["loss"] for _ in range(2)]
        results[fused] = (recs, {k: v.detach().clone() for k, v in tr.acc.unwrap_model(tr.model).state_dict().items()})
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for k, v in results[True][1].items():
        torch.testing.assert_close(v, results[False][1][k], atol=1e-5, rtol=1e-4, msg=k)
