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
from peagle_train.core.errors import SkippedStepsError
from peagle_train.features.cache import CachedFeatures, CacheError
from peagle_train.features.tokenized import load_prepared, save_tokenized
from peagle_train.model.checkpoint import load_drafter_dir
from peagle_train.recipe import config_from_dict
from peagle_train.stages import run_cache
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
    # the first drafted position's accuracy on copyable and on fresh labels, and the copyable share (issue 20)
    s, cp, fr = final["eval_copyable_share"], final["eval_acc1_copyable"], final["eval_acc1_fresh"]
    assert 0.0 <= s <= 1.0 and 0.0 <= fr <= 1.0 and (cp != cp if s == 0 else 0.0 <= cp <= 1.0)
    # the same split at every depth; depth 1's entries are the two above
    assert len(final["eval_acc_copyable"]) == len(final["eval_acc_fresh"]) == cfg.train.K
    assert final["eval_acc_fresh"][0] == fr and (final["eval_acc_copyable"][0] == cp or cp != cp)


def test_cache_detects_corruption(run_dir):
    cfg = _cfg(run_dir)
    root = run_cache(cfg, progress=False)
    shard = sorted((root / "train").glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="checksum"):
        CachedFeatures(root / "train").get([0])


def test_train_refuses_a_cache_made_for_another_recipe(run_dir):
    """train.features: cache compares each split's manifest with the recipe, the target config and the
    prepared data before training: other aux layers and cache dtype (recipe changed after caching),
    another target's hidden size and identity (manifest), other token ids (same counts) and other
    counts each stop the run with a CacheError naming the cache folder, both values and what to do."""
    cfg = _cfg(run_dir, max_steps=1)
    root = run_cache(cfg, progress=False)
    out = Path(cfg.output_dir)

    def refused(c) -> str:
        with pytest.raises(CacheError) as err:
            run_train(c, progress=False)
        assert not [w for w in ("checkpoints", "drafter", "resolved_config.yaml") if (out / w).exists()]
        msg = str(err.value)
        assert "re-run `peagle-train cache RECIPE` with this recipe, or fix the recipe" in msg, msg
        return msg

    other = cfg.model_copy(update={"target": cfg.target.model_copy(update={"aux_layer_ids": [2, 3, 4]}),
                                   "data": cfg.data.model_copy(update={"cache_dtype": "fp8"})})
    msg = refused(other)
    for part in (f"{root / 'train'}: ", f"{root / 'eval'}: ", "aux_layer_ids: cache [1, 3, 4], this run [2, 3, 4]",
                 "dtype: cache 'bfloat16', this run 'fp8'", "target.aux_layer_ids, data.cache_dtype"):
        assert part in msg, (part, msg)

    man_path = root / "train" / "manifest.json"
    good_manifest = man_path.read_text()
    man = json.loads(good_manifest)
    man.update(hidden_size=64, target="/models/another-target")
    man_path.write_text(json.dumps(man))
    msg = refused(cfg)
    assert "hidden_size: cache 64, this run 32" in msg and f"{root / 'eval'}" not in msg, msg
    assert f"target: cache '/models/another-target', this run '{run_dir / 'target'}'" in msg, msg
    man_path.write_text(good_manifest)

    _prepared(out, seed=1)  # the prepared data changed after caching: same counts, other token ids
    msg = refused(cfg)
    assert "token ids (fingerprint): cache" in msg and "the prepared data (data/)" in msg, msg
    _prepared(out, n=13)
    assert "num_sequences: cache 10, this run 11, total_tokens: cache 400, this run 440" in refused(cfg)


def test_cache_rebuilds_damaged_shards_and_removes_orphan_temp_files(run_dir, monkeypatch, capsys):
    """`peagle-train cache` on a split marked complete verifies every listed shard: a deleted, a
    truncated and a bit-flipped shard are rebuilt (only those, byte-identical, named in its output),
    after which training reads the cache; an intact cache is skipped without loading the target, and
    temp files a kill left are deleted (others kept)."""
    import functools

    import peagle_train.features.cache as F
    import peagle_train.features.target as T

    monkeypatch.setattr(F, "write_cache", functools.partial(F.write_cache, shard_size=4))  # train: 3 shards
    cfg = _cfg(run_dir)
    root = run_cache(cfg, progress=False)
    files = {split: {p.name: p.read_bytes() for p in (root / split).iterdir()} for split in ("train", "eval")}
    train = sorted((root / "train").glob("shard-*.safetensors"))
    assert len(train) == 3
    train[0].unlink()
    train[2].write_bytes(train[2].read_bytes()[:-7])
    eval_shard = root / "eval" / "shard-00000.safetensors"
    flipped = bytearray(eval_shard.read_bytes())
    flipped[-10] ^= 0xFF
    eval_shard.write_bytes(bytes(flipped))
    with pytest.raises(CacheError, match="checksum mismatch"):
        CachedFeatures(root / "eval").get([0])
    capsys.readouterr()
    recomputed = []
    real_iter = F.iter_target_features
    monkeypatch.setattr(F, "iter_target_features", lambda t, c, b: (recomputed.append(len(c)), real_iter(t, c, b))[1])
    run_cache(cfg, progress=False)
    assert recomputed == [4, 2, 2]  # train shards 0 and 2, eval shard 0
    said = capsys.readouterr().out
    assert f"{root / 'train'}: rebuilt shard-00000.safetensors, shard-00002.safetensors" in said, said
    assert f"{root / 'eval'}: rebuilt shard-00000.safetensors" in said and "checksum mismatch" in said, said
    assert {split: {p.name: p.read_bytes() for p in (root / split).iterdir()} for split in files} == files
    assert len(CachedFeatures(root / "eval").get([0, 1])) == 2

    monkeypatch.setattr(T, "load_target", lambda *a, **k: pytest.fail("an intact cache needs no target"))
    for name in ("shard-00001.safetensors.tmp", ".manifest.json.tmp99999", "notes.tmp"):
        (root / "train" / name).write_bytes(b"partial" * 100)
    run_cache(cfg, progress=False)
    assert "removed 2 temp file(s) left by an interrupted run" in capsys.readouterr().out
    assert sorted(p.name for p in (root / "train").iterdir()) == sorted([*files["train"], "notes.tmp"])


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
    step_log = out_b / "logs" / "steps.jsonl"
    assert [json.loads(x)["loss"] for x in step_log.read_text().splitlines()] == first  # written step by step
    with step_log.open("a") as f:  # a step trained after the checkpoint, then the job was killed
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
    resumed = [h["loss"] for h in run_train(cfg_b, progress=False)["history"]]
    assert first == straight[:2]
    assert resumed == pytest.approx(straight, abs=1e-6)
    # the log was rewritten from the restored history at the resume: the killed step's line is gone
    logged = [json.loads(x) for x in step_log.read_text().splitlines()]
    assert [h["step"] for h in logged] == list(range(1, len(straight) + 1))
    assert [h["loss"] for h in logged] == pytest.approx(resumed, abs=0) and "elapsed_s" in logged[-1]


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


def _online_trainer(run_dir, **train):
    """A Trainer on the tiny run with online features (the tiny float32 target runs in the step)."""
    from transformers import AutoConfig

    from peagle_train.features.online import OnlineFeatures
    from peagle_train.features.target import load_target

    cfg = _cfg(run_dir, features="online", **train)
    data = load_prepared(run_dir / "run")
    target = load_target(cfg.target, with_tokenizer=False)
    feats = {s: OnlineFeatures(target, data[s]["input_ids"]) for s in ("train", "eval")}
    return Trainer(cfg, data, feats, AutoConfig.from_pretrained(str(run_dir / "target")), [1, 3, 4])


def test_auto_partitions_plan_with_the_recipes_checkpointing(run_dir, monkeypatch):
    """The planner is asked with ``train.activation_checkpointing`` as the recipe sets it; a refusal suggests
    turning it on only where it is off."""
    import peagle_train.peagle.planner as planner

    data, feats, tconf = _cached_inputs(run_dir)
    seen = []

    def fake(N, K, r, r_min, shape, gpu_bytes, **kw):
        seen.append(kw["checkpointing"])
        return 1

    def no_fit(*a, **k):
        raise ValueError("no plan fits N=40")

    for ckpt in (False, True):
        tr = Trainer(_cfg(run_dir, max_steps=1, partitions="auto", activation_checkpointing=ckpt), data, feats,
                     tconf, [1, 3, 4])
        tr._plan_inputs = (tr._planner_inputs()[0], 10**12)  # a GPU's memory, stubbed
        monkeypatch.setattr(planner, "partitions_for", fake)
        assert tr.partitions([40]) == [1] and seen[-1] is ckpt
        monkeypatch.setattr(planner, "partitions_for", no_fit)
        with pytest.raises(ConfigError, match="found no plan") as e:
            tr.partitions([40])
        assert ("turn on train.activation_checkpointing" in str(e.value)) is not ckpt


def test_auto_partitions_count_the_online_target(run_dir, monkeypatch):
    """train.partitions: auto with online features: the planner gets the whole GPU and the online target
    (its weights on this device, float32; the forwards OnlineFeatures runs for the micro-batch; the prefetch
    of the next step's forward), with cached features none. With a GPU (its memory query stubbed) that
    fits the cached run's micro-batch at S = 1 with 5 % to spare, the online run's prediction (the target's
    weights, forward and features besides) does not fit: the budget left to the drafter is smaller."""
    import peagle_train.peagle.planner as planner

    data, feats, tconf = _cached_inputs(run_dir)
    cached = Trainer(_cfg(run_dir, max_steps=1, partitions="auto"), data, feats, tconf, [1, 3, 4])
    online = _online_trainer(run_dir, max_steps=1, partitions="auto")
    ix = online.micro_batches(0)[0]
    n = sum(online.lengths[i] for i in ix)
    seen = {}

    def fake(N, K, r, r_min, shape, gpu_bytes, **kw):
        seen[kw["online"] is not None] = (gpu_bytes, kw)
        return 1

    for tr in (cached, online):
        tr._plan_inputs = (planner.ShapeParams.from_config(tr.acc.unwrap_model(tr.model).drafter.config), 10**12)
    monkeypatch.setattr(planner, "partitions_for", fake)
    assert cached.partitions([n], [ix]) == online.partitions([n], [ix]) == [1]
    (gpu_c, kw_c), (gpu_o, kw_o) = seen[False], seen[True]
    assert gpu_c == gpu_o == 10**12  # the whole GPU: the online target is inside the prediction
    step = kw_o["online"]
    weights = sum(p.numel() * 4 for p in online.features.target.model.parameters())
    assert step.target.weight_bytes == weights and step.target.dtype_bytes == 4 and step.prefetch
    assert step.forwards == planner.target_forwards([online.lengths[i] for i in ix], online.features.batch_tokens)
    assert kw_o["lm_head_trainable"] and kw_o["target_head_bytes"] == 4 and kw_c["target_head_bytes"] == 4
    monkeypatch.undo()

    shape = cached._plan_inputs[0]
    fits_cached = int(1.05 * planner.predict_peak_bytes(n, 1, shape, 4, 0.7, 0.2, **{
        k: v for k, v in kw_c.items() if k != "online"}) / 0.9)
    for tr in (cached, online):
        tr._plan_inputs = (shape, fits_cached)
    assert cached.partitions([n], [ix]) == [1]
    with pytest.raises(ConfigError, match="train.partitions=auto found no plan"):
        online.partitions([n], [ix])


def test_trainer_records_the_predicted_peak(run_dir):
    """Each step keeps the largest predicted peak of the launch (Trainer.predicted_peak): the planner's online
    prediction for the micro-batch it trained, with the recipe's fixed S and activation checkpointing; the
    train stage writes it to logs/stages.jsonl beside the measured peak (None without CUDA)."""
    from peagle_train import stages
    from peagle_train.peagle.planner import predict_online_peak_bytes

    tr = _online_trainer(run_dir, max_steps=2, partitions=2, activation_checkpointing=True)
    tr.train_step()
    ix = tr.micro_batches(0)[0]
    n = sum(tr.lengths[i] for i in ix)
    online, shape = tr._online_step(ix, n), tr._planner_inputs()[0]
    want = predict_online_peak_bytes(n, 2, shape, online, 4, 0.7, 0.2, **tr._plan_kwargs(1))  # checkpointing=True
    assert tr.predicted_peak == {"bytes": want, "tokens": n, "partitions": 2,
                                 "target_forwards": [list(f) for f in online.forwards]}
    assert want < predict_online_peak_bytes(n, 2, shape, online, 4, 0.7, 0.2,
                                            **(tr._plan_kwargs(1) | {"checkpointing": False}))  # no ckpt: more
    tr._stop_prefetch()

    cfg = _cfg(run_dir, features="online", max_steps=2, partitions=2)
    metrics = stages.run_train(cfg, progress=False)
    rec = [json.loads(x) for x in (run_dir / "run" / "logs" / "stages.jsonl").read_text().splitlines()][-1]
    assert rec["stage"] == "train" and not rec["reused"] and rec["peak_gpu_bytes"] is None
    assert rec["predicted_peak_bytes"] == metrics["predicted_peak"]["bytes"] > 0
    assert rec["predicted_peak_for"]["partitions"] == 2 and rec["predicted_peak_for"]["target_forwards"]
    stages.run_train(cfg, progress=False)  # a finished run, reused: nothing predicted
    rec = [json.loads(x) for x in (run_dir / "run" / "logs" / "stages.jsonl").read_text().splitlines()][-1]
    assert rec["reused"] and "predicted_peak_bytes" not in rec


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


class _NaNFeatures(CachedFeatures):
    """A feature cache whose sequences ``bad`` read back with NaN aux features (as a damaged cache would)."""

    def __init__(self, cache_dir, bad):
        super().__init__(cache_dir)
        self.bad = set(bad)

    def get(self, indices, with_input_ids=False):
        out = super().get(indices, with_input_ids)
        for i, f in zip(indices, out):
            if i in self.bad:
                f["aux"] = torch.full_like(f["aux"], float("nan"))
        return out


def test_nonfinite_step_is_skipped_with_a_warning_naming_its_sequences(run_dir, capsys):
    """NaN features in one sequence: its step is skipped (weights unchanged) and one warning line names
    the step, the non-finite values, the train-split sequence, its cache shard file and that sequence as
    the one with non-finite cached features; the finite step before prints nothing."""
    data, feats, tconf = _cached_inputs(run_dir)
    tr = Trainer(_cfg(run_dir, max_steps=3), data, feats, tconf, [1, 3, 4])
    [[bad]] = tr.micro_batches(1)  # step 2 trains one sequence (micro_batch_size 1, grad_accum 1)
    tr.features = _NaNFeatures(feats["train"].dir, [bad])
    first = tr.train_step()
    fc = tr.acc.unwrap_model(tr.model).drafter.fc.weight
    before = fc.detach().clone()
    rec = tr.train_step()
    assert not first["skipped"] and rec["skipped"]
    assert torch.equal(fc.detach(), before)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("warning: step 2: non-finite loss and grad norm (loss=nan, grad_norm=nan)"), line
    assert "optimizer step skipped (1 skipped in this run, train.max_skipped_steps=10)" in line, line
    assert f"train-split sequences [{bad}]" in line, line
    shard = feats["train"].shard_file(bad)
    assert f"feature cache {shard.parent}, shard files {shard.name}" in line, line
    assert line.endswith(f"sequences with non-finite cached features: [{bad}]"), line


def test_more_skipped_steps_than_max_skipped_steps_stop_the_run(run_dir):
    """train.max_skipped_steps: 0 stops at the first non-finite step with an error naming the key; the
    count spans a resume (one skip before the checkpoint + one after > max_skipped_steps: 1)."""
    data, feats, tconf = _cached_inputs(run_dir)
    tr = Trainer(_cfg(run_dir, max_steps=4, max_skipped_steps=0), data, feats, tconf, [1, 3, 4])
    bad = [i for s in (1, 2) for mb in tr.micro_batches(s) for i in mb]  # the sequences of steps 2 and 3
    tr.features = _NaNFeatures(feats["train"].dir, bad)
    with pytest.raises(SkippedStepsError, match=r"1 optimizer steps of this run were skipped .*\(steps 2\), "
                                                r"more than train.max_skipped_steps=0 allows: check the training data"):
        tr.fit(progress=False)
    assert tr.step == 2 and [h["skipped"] for h in tr.history] == [False, True]

    def trainer():
        t = Trainer(_cfg(run_dir, max_steps=4, max_skipped_steps=1), data, feats, tconf, [1, 3, 4])
        t.features = _NaNFeatures(feats["train"].dir, bad)
        return t

    assert trainer().fit(progress=False, stop_at=2) is None  # one skip allowed; checkpoint at step 2
    resumed = trainer()
    assert resumed.resume() and resumed.step == 2
    with pytest.raises(SkippedStepsError, match=r"2 optimizer steps .*\(steps 2, 3\), more than "
                                                r"train.max_skipped_steps=1"):
        resumed.fit(progress=False)


def test_too_many_skipped_steps_is_exit_2_at_the_console(monkeypatch, capsys):
    """The console script reports a SkippedStepsError as one error line and exit code 2 (bad data the
    user must look at), not a traceback."""
    from peagle_train import cli

    def stage(args):
        raise SkippedStepsError("recipe.yaml: 3 optimizer steps of this run were skipped ... train.max_skipped_steps=2")

    monkeypatch.setattr(cli, "_stage", stage)
    assert cli.main(["train", "recipes/smollm2-135m.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle-train: error: recipe.yaml: 3 optimizer steps") and "Traceback" not in err


def test_prefetched_host_inputs_give_the_same_steps(run_dir):
    """train.prefetch: the next step's host inputs (token lists, COD sample, grid) are built on the
    worker thread while the current step runs; the losses equal a run that builds them in the step,
    and every step after the first took its inputs from the worker."""
    import threading

    data, feats, tconf = _cached_inputs(run_dir)
    losses, built_on = {}, []
    for prefetch in (False, True):
        tr = Trainer(_cfg(run_dir, max_steps=4, prefetch=prefetch), data, feats, tconf, [1, 3, 4])
        orig = tr.host_inputs

        def spy(step, orig=orig):
            built_on.append((prefetch, step, threading.current_thread().name))
            return orig(step)

        tr.host_inputs = spy
        losses[prefetch] = [tr.train_step()["loss"] for _ in range(4)]
        tr._stop_prefetch()
    assert losses[True] == losses[False]
    on = dict((s, name) for p, s, name in built_on if p)  # step -> the thread that built its inputs
    assert on[0] == threading.current_thread().name  # the first step builds its own
    assert sorted(s for s, name in on.items() if name.startswith("peagle-host-inputs")) == [1, 2, 3]
    assert all(name == threading.current_thread().name for p, _, name in built_on if not p)


def test_online_features_launched_a_step_ahead_give_the_same_steps(run_dir):
    """train.prefetch with online features: the next step's target forward is launched at the end of the
    current step's backward; the losses equal a run that computes every step's features in its step,
    and every step after the first used the features launched ahead (the target ran once per step)."""
    from transformers import AutoConfig

    from peagle_train.features.online import OnlineFeatures
    from peagle_train.features.target import load_target

    data = load_prepared(run_dir / "run")
    tconf = AutoConfig.from_pretrained(str(run_dir / "target"))
    losses, asked = {}, {}
    for prefetch in (False, True):
        cfg = _cfg(run_dir, features="online", max_steps=4, prefetch=prefetch)
        target = load_target(cfg.target, with_tokenizer=False)
        feats = {s: OnlineFeatures(target, data[s]["input_ids"]) for s in ("train", "eval")}
        calls = asked[prefetch] = []
        orig = feats["train"].get
        feats["train"].get = lambda ix, orig=orig, calls=calls: calls.append(list(ix)) or orig(ix)
        tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
        losses[prefetch] = [tr.train_step()["loss"]]
        assert (tr._online_ahead is not None) is prefetch  # step 2's first micro-batch, launched in step 1
        assert len(calls) == 1 + prefetch
        losses[prefetch] += [tr.train_step()["loss"] for _ in range(3)]
        tr._stop_prefetch()
        assert tr._online_ahead is None
    assert losses[True] == losses[False]
    assert asked[True] == asked[False] and len(asked[True]) == 4  # the same batches, each once


def test_frozen_embeddings_train_the_mask_row_alone(run_dir):
    """drafter.embeddings: frozen: after three steps the embedding table is the target's, unchanged; the
    mask row (``mask_embedding``) moved; AdamW holds exactly the trainable parameters."""
    data, feats, tconf = _cached_inputs(run_dir)
    cfg = _cfg(run_dir, max_steps=3)
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"embeddings": "frozen"})})
    tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    drafter = tr.acc.unwrap_model(tr.model).drafter
    table, mask = drafter.embed_tokens.weight.detach().clone(), drafter.mask_embedding.detach().clone()
    assert torch.equal(mask, table[63])
    for _ in range(3):
        tr.train_step()
    tr._stop_prefetch()
    assert torch.equal(drafter.embed_tokens.weight, table)
    assert not torch.equal(drafter.mask_embedding.detach(), mask)
    in_opt = {id(p) for g in tr.opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in drafter.parameters() if p.requires_grad}
    assert id(drafter.embed_tokens.weight) not in in_opt


def test_frozen_lm_head_keeps_the_targets_rows(run_dir):
    """drafter.lm_head: frozen: three steps leave the lm_head (the target head's draft rows) unchanged and
    out of AdamW; the rest trains."""
    data, feats, tconf = _cached_inputs(run_dir)
    cfg = _cfg(run_dir, max_steps=3)
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"lm_head": "frozen"})})
    tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    drafter = tr.acc.unwrap_model(tr.model).drafter
    head, fc = drafter.lm_head.weight.detach().clone(), drafter.fc.weight.detach().clone()
    for _ in range(3):
        tr.train_step()
    tr._stop_prefetch()
    assert torch.equal(drafter.lm_head.weight, head) and not torch.equal(drafter.fc.weight.detach(), fc)
    assert id(drafter.lm_head.weight) not in {id(p) for g in tr.opt.param_groups for p in g["params"]}


def test_init_layers_target_starts_from_the_targets_last_layers(run_dir):
    """drafter.init_layers: target, cached features (the target's files are read, not the model): the
    drafter's layers start as the target's last two (4 and 5 of 6), its norm as the target's, fc as the
    pass-through of the last aux state; it trains from there. The default starts elsewhere."""
    from safetensors.torch import load_file

    data, feats, tconf = _cached_inputs(run_dir)
    w = load_file(str(run_dir / "target" / "model.safetensors"))
    cfg = _cfg(run_dir, max_steps=2)
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_layers": "target"})})
    tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    drafter = tr.acc.unwrap_model(tr.model).drafter
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, w["model.layers.5.mlp.down_proj.weight"])
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight[:, 32:], w["model.layers.4.self_attn.q_proj.weight"])
    assert torch.equal(drafter.layers[0].hidden_norm.weight, w["model.layers.4.input_layernorm.weight"])
    assert torch.equal(drafter.norm.weight, w["model.norm.weight"])
    assert torch.equal(drafter.fc.weight[:, 64:], torch.eye(32)) and not drafter.fc.weight[:, :64].any()
    start = drafter.layers[1].mlp.down_proj.weight.detach().clone()
    for _ in range(2):
        tr.train_step()
    tr._stop_prefetch()
    assert not torch.equal(drafter.layers[1].mlp.down_proj.weight.detach(), start)
    plain = Trainer(_cfg(run_dir, max_steps=2), data, feats, tconf, [1, 3, 4])
    plain._stop_prefetch()
    assert not torch.equal(plain.acc.unwrap_model(plain.model).drafter.layers[1].mlp.down_proj.weight, start)


def test_init_layers_target_with_frozen_embeddings_and_head_trains_the_layers_only(run_dir):
    """The next GPU ablation's variant (docs/results.md, run 5): drafter layers from the target, embeddings and
    lm_head frozen. AdamW holds the layers, fc, norms, mask_hidden and the mask row, not the table or the head,
    which stay the target's; the portable state counts those parameters only."""
    from peagle_train.trainer.portable_state import recipe_state_size

    data, feats, tconf = _cached_inputs(run_dir)
    cfg = _cfg(run_dir, max_steps=2)
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(
        update={"init_layers": "target", "embeddings": "frozen", "lm_head": "frozen"})})
    tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    drafter = tr.acc.unwrap_model(tr.model).drafter
    table, head = drafter.embed_tokens.weight.detach().clone(), drafter.lm_head.weight.detach().clone()
    layer = drafter.layers[1].mlp.down_proj.weight.detach().clone()
    for _ in range(2):
        tr.train_step()
    tr._stop_prefetch()
    assert torch.equal(drafter.embed_tokens.weight, table) and torch.equal(drafter.lm_head.weight, head)
    assert not torch.equal(drafter.layers[1].mlp.down_proj.weight.detach(), layer)
    in_opt = {id(p) for g in tr.opt.param_groups for p in g["params"]}
    assert id(drafter.embed_tokens.weight) not in in_opt and id(drafter.lm_head.weight) not in in_opt
    trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert recipe_state_size(cfg)["trainable"] == trainable


def test_init_layers_target_starts_an_eagle3_drafter_from_the_targets_last_layer(run_dir):
    """The EAGLE-3 GPU recipe's setting (drafter.init_layers: target, one layer): its only layer, the fusion
    layer, starts as the target's last (5 of 6), its norm as the target's; TTT steps train it from there."""
    from safetensors.torch import load_file

    data, feats, tconf = _cached_inputs(run_dir)
    w = load_file(str(run_dir / "target" / "model.safetensors"))
    cfg = _cfg(run_dir, method="eagle3", K=3, max_steps=2)
    cfg = cfg.model_copy(update={"drafter": cfg.drafter.model_copy(update={"init_layers": "target", "num_layers": 1})})
    tr = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    drafter = tr.acc.unwrap_model(tr.model).drafter
    assert len(drafter.layers) == 1
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, w["model.layers.5.mlp.down_proj.weight"])
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight[:, 32:], w["model.layers.5.self_attn.q_proj.weight"])
    assert not drafter.layers[0].self_attn.q_proj.weight[:, :32].any()  # the embedding half starts at zero
    assert torch.equal(drafter.norm.weight, w["model.norm.weight"])
    start = drafter.layers[0].mlp.down_proj.weight.detach().clone()
    for _ in range(2):
        tr.train_step()
    tr._stop_prefetch()
    assert not torch.equal(drafter.layers[0].mlp.down_proj.weight.detach(), start)


def test_adamw_is_fused_on_cuda_for_plain_parameters_only(run_dir):
    """One fused AdamW kernel on CUDA for a single process or DDP; torch's default elsewhere (FSDP2's
    sharded and DeepSpeed's partitioned parameters; the CPU); the trainer builds what it says."""
    from peagle_train.trainer.setup import adamw_implementation

    assert adamw_implementation("cuda", "single") == adamw_implementation("cuda", "ddp") == {"fused": True}
    assert adamw_implementation("cuda", "fsdp2") == adamw_implementation("cuda", "deepspeed") == {}
    assert adamw_implementation("cpu", "single") == {}
    data, feats, tconf = _cached_inputs(run_dir)
    tr = Trainer(_cfg(run_dir, max_steps=1), data, feats, tconf, [1, 3, 4])
    assert not tr.opt.param_groups[0].get("fused")


def test_no_full_garbage_collection_inside_a_training_step(run_dir):
    """train.gc_every: during fit Python's collector is off; young collections run inside steps every
    gc_every steps, full ones never inside a step; the collector is back on after fit."""
    import gc

    data, feats, tconf = _cached_inputs(run_dir)
    tr = Trainer(_cfg(run_dir, max_steps=6, gc_every=2), data, feats, tconf, [1, 3, 4])
    inside, seen = [False], []
    step = tr.train_step

    def marked():
        inside[0] = True
        try:
            return step()
        finally:
            inside[0] = False

    def cb(phase, info):
        if phase == "stop":
            seen.append((info["generation"], inside[0]))

    tr.train_step = marked
    gc.callbacks.append(cb)
    try:
        tr.fit(progress=False)
    finally:
        gc.callbacks.remove(cb)
    assert (2, True) not in seen, seen
    assert seen.count((1, True)) >= 3  # after steps 2, 4, 6
    assert gc.isenabled()


def test_profile_steps_write_the_phase_summary(run_dir):
    """train.profile_steps: logs/profile.json holds the profiled steps' wall times, the host time of
    each marked phase and the top ops (CPU here), and training is otherwise unchanged."""
    cfg = _cfg(run_dir, max_steps=4, profile_steps=2, profile_start=1, features="online")
    run_train(cfg, progress=False)
    prof = json.loads((Path(cfg.output_dir) / "logs" / "profile.json").read_text())
    assert prof["steps"] == [2, 3] and len(prof["step_ms"]) == 2
    for phase in ("peagle/host_inputs", "peagle/features", "peagle/forward_backward", "peagle/optimizer"):
        assert prof["ranges"][phase]["cpu_ms"] > 0, phase
    assert prof["top"] and prof["timeline"] is None  # no GPU timeline on a CPU


def test_dynamic_shapes_set_the_compile_mode(run_dir):
    """train.dynamic_shapes decides torch.compile's dynamic= for what the run compiles (flex, layers, loss)."""
    from peagle_train.kernels import compiling

    data, feats, tconf = _cached_inputs(run_dir)
    try:
        Trainer(_cfg(run_dir, max_steps=1, dynamic_shapes=False), data, feats, tconf, [1, 3, 4])
        assert compiling.DYNAMIC is False
        Trainer(_cfg(run_dir, max_steps=1), data, feats, tconf, [1, 3, 4])
        assert compiling.DYNAMIC is None  # automatic dynamic shapes: one recompile in all
    finally:
        compiling.set_dynamic_shapes(False)


def test_compile_target_compiles_the_online_targets_layers(run_dir):
    """train.compile_target: the trainer compiles each decoder layer of the online target (regional
    compilation, dynamic shapes); off (the default) the layers' own forwards run."""
    from transformers import AutoConfig

    from peagle_train.features.online import OnlineFeatures
    from peagle_train.features.target import load_target
    from peagle_train.kernels.compiling import BatchedOnly
    from peagle_train.trainer.trainer import Trainer

    data = load_prepared(run_dir / "run")
    tconf = AutoConfig.from_pretrained(str(run_dir / "target"))
    for on in (False, True):
        cfg = _cfg(run_dir, features="online", max_steps=1, compile_target=on)
        target = load_target(cfg.target, with_tokenizer=False)
        feats = {s: OnlineFeatures(target, data[s]["input_ids"]) for s in ("train", "eval")}
        Trainer(cfg, data, feats, tconf, [1, 3, 4])
        layers = target.model.get_decoder().layers
        assert all(isinstance(layer.forward, BatchedOnly) is on for layer in layers)
        if on:
            assert all(layer.forward.compiled.dynamic is True for layer in layers)


def test_target_batch_tokens_reaches_the_online_features(run_dir, monkeypatch):
    """train.target_batch_tokens: the padded-token budget run_train gives the online features."""
    import peagle_train.trainer.trainer as T

    seen = []

    class Spy(T.Trainer):
        def __init__(self, cfg, data, features, *a, **k):
            seen.extend(f.batch_tokens for f in features.values())
            raise RuntimeError("stop")

    monkeypatch.setattr(T, "Trainer", Spy)
    with pytest.raises(RuntimeError, match="stop"):
        T.run_train(_cfg(run_dir, features="online", max_steps=1, target_batch_tokens=4096), progress=False)
    assert seen == [4096, 4096]


def test_feature_forwards_run_the_feature_attention_kernel(run_dir, monkeypatch):
    """target.feature_attn_implementation: the cache stage and online training build the target with it (the
    GPT-OSS recipe's flex_attention), while target.attn_implementation stays for regeneration and eval."""
    import peagle_train.features.target as target_mod
    import peagle_train.trainer.trainer as T

    built = []
    load = target_mod.load_target

    def spy(cfg, *a, **k):
        built.append(cfg.attn_implementation)
        return load(cfg, *a, **k)

    monkeypatch.setattr(target_mod, "load_target", spy)
    cfg = _cfg(run_dir, features="online", max_steps=1)
    cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"attn_implementation": "sdpa",
                                                                        "feature_attn_implementation": "eager"})})

    class Stop(T.Trainer):
        def __init__(self, cfg, data, features, *a, **k):
            built.append(next(iter(features.values())).target.model.config._attn_implementation)
            raise RuntimeError("stop")

    monkeypatch.setattr(T, "Trainer", Stop)
    with pytest.raises(RuntimeError, match="stop"):
        T.run_train(cfg, progress=False)
    assert built == ["eager", "eager"]  # asked for, and what the online features' target runs
    built.clear()
    run_cache(cfg.model_copy(update={"train": cfg.train.model_copy(update={"features": "cache"})}), progress=False)
    assert built == ["eager"]
    assert target_mod.feature_target(cfg.target.model_copy(update={"feature_attn_implementation": None})
                                     ).attn_implementation == "sdpa"


def test_depth_weights_reach_the_trainers_loss(run_dir):
    """train.depth_weights [1, 0, 0, 0]: depths >= 1 carry no loss, so three steps leave ``mask_hidden`` and
    the mask token's embedding exactly as they started while the rest trains; with the default weights
    ``mask_hidden`` moves. The in-training eval loss stays the unweighted one."""
    data, feats, tconf = _cached_inputs(run_dir)
    moved = {}
    for name, w in (("depth0", [1.0, 0.0, 0.0, 0.0]), ("default", None)):
        tr = Trainer(_cfg(run_dir, max_steps=3, depth_weights=w), data, feats, tconf, [1, 3, 4])
        drafter = tr.acc.unwrap_model(tr.model).drafter
        mh, emb, fc = (drafter.mask_hidden.detach().clone(), drafter.embed_tokens.weight[63].detach().clone(),
                       drafter.fc.weight.detach().clone())
        eval0 = tr.evaluate()["eval_loss"]
        if name == "default":
            assert eval0 == eval_weighted  # same start (seeded), eval loss unweighted in both runs
        eval_weighted = eval0
        for _ in range(3):
            tr.train_step()
        tr._stop_prefetch()
        assert not torch.equal(drafter.fc.weight.detach(), fc)
        moved[name] = (not torch.equal(drafter.mask_hidden.detach(), mh),
                       not torch.equal(drafter.embed_tokens.weight[63].detach(), emb))
    assert moved == {"depth0": (False, False), "default": (True, True)}


@pytest.mark.parametrize("bad, match", [([1.0, 1.0], "one per depth"), ([1.0, -1.0, 1.0, 1.0], ">= 0"),
                                        ([0.0, 0.0, 0.0, 0.0], "one > 0")])
def test_depth_weights_are_checked(tmp_path, bad, match):
    with pytest.raises(Exception, match=match):
        _cfg(tmp_path, depth_weights=bad)
    with pytest.raises(Exception, match="ttt_decay"):
        from peagle_train.methods import get_method
        get_method("eagle3").validate_recipe(_cfg(tmp_path, method="eagle3", depth_weights=[1.0] * 4))


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_prefix_kernel_options_reach_each_methods_attention(run_dir, method, flex_kernel_options_seen, monkeypatch):
    """train.prefix_kernel_options: what the recipe gives reaches the prefix part's flex call of either method's
    objective (sorted on the split masks, a dict again at the call). The default, auto, is resolved for the grid's
    device: on this CPU none is passed (as with null); where the device reports compute capability 9 (an H100 or
    H200, simulated) the split masks hold the forward block, and this float32 drafter (head dimension not 64) still
    passes none (auto's block applies at head dimension 64 in bf16 / fp16 only: the split-attention unit test
    ``test_auto_block_applies_only_at_the_head_dim_and_dtype_it_was_measured``). The objective's forward runs
    eagerly on CPU (FlexAttention forward only), where torch ignores the options: the loss is the same each time."""
    import peagle_train.kernels.attention as attention_mod
    seen = flex_kernel_options_seen
    data, feats, tconf = _cached_inputs(run_dir)
    opts = {"fwd_num_warps": 4, "fwd_BLOCK_N": 128, "USE_TMA": False}
    cases = [({"prefix_kernel_options": opts}, None, opts), ({"prefix_kernel_options": None}, None, None),
             ({}, None, None),  # the default: auto on a CPU
             ({}, (9, 0), None), ({"prefix_kernel_options": None}, (9, 0), None),
             ({}, (8, 0), None)]
    losses = []
    for given, capability, expected in cases:
        K = 4 if method == "peagle" else 3
        tr = Trainer(_cfg(run_dir, method=method, K=K, max_steps=1, **given), data, feats, tconf, [1, 3, 4])
        objective = tr.acc.unwrap_model(tr.model)
        assert objective.prefix_kernel_options == given.get("prefix_kernel_options", "auto")
        objective.attention = "flex"  # as on CUDA (attention: auto); the trainer chose sdpa for this CPU
        c = objective.drafter.config
        assert (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) != 64  # auto's block: not here
        seen.clear()
        with monkeypatch.context() as patch, torch.no_grad():
            if capability is not None:
                patch.setattr(attention_mod, "device_capability", lambda device, c=capability: c)
            losses.append(float(tr.evaluate()["eval_loss"]))
        tr._stop_prefetch()
        assert seen and all(o == expected for o in seen), (given, capability, seen)
    assert len(set(losses)) == 1  # same math (eager FlexAttention ignores the options)


@pytest.mark.parametrize("method", ["peagle", "eagle3"])
def test_prefix_compiled_apart_reaches_each_methods_split_masks(run_dir, method, monkeypatch):
    """train.prefix_compiled_apart: what the recipe gives reaches the split masks each method's objective builds
    (``SplitMasks.prefix_compiled_apart``, what ``split_attention`` reads), off by default; the loss is the same
    (on this CPU the layers run eagerly, where the setting changes nothing)."""
    import peagle_train.kernels.attention as attention_mod
    data, feats, tconf = _cached_inputs(run_dir)
    seen, losses = [], []
    real = attention_mod.split_attention

    def spy(q, k, v, split, prefix_attention=None):
        seen.append(split.prefix_compiled_apart)
        return real(q, k, v, split, prefix_attention)

    monkeypatch.setattr(attention_mod, "split_attention", spy)
    for given in ({}, {"prefix_compiled_apart": True}):
        K = 4 if method == "peagle" else 3
        tr = Trainer(_cfg(run_dir, method=method, K=K, max_steps=1, **given), data, feats, tconf, [1, 3, 4])
        objective = tr.acc.unwrap_model(tr.model)
        assert objective.prefix_compiled_apart is given.get("prefix_compiled_apart", False)
        objective.attention = "flex"  # as on CUDA (attention: auto); the trainer chose sdpa for this CPU
        seen.clear()
        with torch.no_grad():
            losses.append(float(tr.evaluate()["eval_loss"]))
        tr._stop_prefetch()
        assert seen and all(x is given.get("prefix_compiled_apart", False) for x in seen), (given, seen)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("bad, match", [
    ({"fwd_BLOCK_M": "64"}, "prefix_kernel_options"), ({"fwd_BLOCK_M": 64.0}, "prefix_kernel_options"),
    ([64], "prefix_kernel_options"), ({"ROWS_GUARANTEED_SAFE": True}, "not a tuning option"),
    ({"fwd_BLOCK_MM": 64}, "not a tuning option"), ({"OUTPUT_LOGSUMEXP": False}, "not a tuning option"),
    ({"bwd_BLOCK_N1": 0}, "whole number >= 1"), ({"num_warps": True}, "whole number >= 1"),
    ({"USE_TMA": 1}, "true or false"),
    ("fast", "train.prefix_kernel_options: 'fast' is not allowed; give 'auto'"),
    ("AUTO", "train.prefix_kernel_options: 'AUTO' is not allowed"), ("", "train.prefix_kernel_options: '' is not")])
def test_prefix_kernel_options_are_checked(tmp_path, bad, match):
    """Only "auto", null / {} or FlexAttention's tuning options (block sizes, warps, stages: whole numbers >= 1;
    USE_TMA: a boolean), for both passes or one: a misspelt name (torch would ignore it), an option that changes what
    is computed (ROWS_GUARANTEED_SAFE would break the padding rows' -inf lse), a wrong value or another string is
    refused with the field named."""
    with pytest.raises(Exception, match=match):
        _cfg(tmp_path, prefix_kernel_options=bad)


def test_prefix_kernel_options_are_how_not_what(tmp_path):
    """Tuning for one GPU: the default is "auto", ``{}`` and null are None; the options (auto, a mapping or null)
    are neither part of a run folder's identity nor of a portable state's fingerprint, so a run resumed on another
    GPU kind may tune its kernels anew."""
    from transformers import LlamaConfig

    from peagle_train.stages import stamp_differences
    from peagle_train.trainer.portable_state import run_fingerprint

    assert _cfg(tmp_path).train.prefix_kernel_options == "auto"
    assert _cfg(tmp_path, prefix_kernel_options={}).train.prefix_kernel_options is None
    assert _cfg(tmp_path, prefix_kernel_options=None).train.prefix_kernel_options is None
    ok = {"fwd_BLOCK_M": 64, "bwd_BLOCK_N1": 128, "fwd_USE_TMA": True, "num_stages": 3, "bwd_num_warps": 8}
    tuned, plain, auto = (_cfg(tmp_path, prefix_kernel_options=ok), _cfg(tmp_path, prefix_kernel_options=None),
                          _cfg(tmp_path))
    assert tuned.train.prefix_kernel_options == ok
    for a, b in ((tuned, plain), (plain, auto), (auto, tuned)):
        assert stamp_differences(a, b.model_dump(mode="json")) == []
    tc = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    a, b, c = (run_fingerprint(cfg, tc, [[1, 2, 3]], [[0, 1, 1]]) for cfg in (tuned, plain, auto))
    assert a == b == c and not any("prefix_kernel_options" in k for k in a["keys"])
    apart = _cfg(tmp_path, prefix_compiled_apart=True)  # where the prefix kernel is compiled: how, not what
    assert _cfg(tmp_path).train.prefix_compiled_apart is False and apart.train.prefix_compiled_apart is True
    assert stamp_differences(apart, plain.model_dump(mode="json")) == []
    assert run_fingerprint(apart, tc, [[1, 2, 3]], [[0, 1, 1]]) == b


def test_compile_cache_is_written_at_the_end_of_a_launch_and_read_by_the_next(run_dir):
    """train.compile_cache (relative: under output_dir): each launch gives torch the file before training and writes
    what was compiled at its end (a stopped launch too); the records in the returned metrics say what was loaded
    and saved. (That a fresh process then hits those compiles: tests/unit/test_compile_cache.py.)"""
    import torch

    cfg = _cfg(run_dir, max_steps=3, compile_cache="cc.bin")
    run_cache(cfg, progress=False)
    torch.compile(lambda x: x * 3 + 1)(torch.ones(3))  # something compiled in this process: the file is not empty
    first = run_train(cfg, progress=False, stop_at=1)
    path = Path(cfg.output_dir) / "cc.bin"
    assert first["compile_cache"]["loaded"] is None and first["compile_cache"]["saved"]["bytes"] == path.stat().st_size
    resumed = run_train(cfg, progress=False)
    assert resumed["compile_cache"]["loaded"]["bytes"] == first["compile_cache"]["saved"]["bytes"]
    assert resumed["compile_cache"]["loaded"]["artifacts"] == first["compile_cache"]["saved"]["artifacts"]
    assert resumed["compile_cache"]["saved"]["bytes"] == path.stat().st_size > 0
    assert json.loads((Path(cfg.output_dir) / "train_metrics.json").read_text())["compile_cache"]["saved"]["bytes"] > 0
    # where the file lies is not the run's identity: a launch may name another (the folder's stamp, the state)
    from peagle_train.stages import stamp_differences
    from peagle_train.trainer.portable_state import LAUNCH_ONLY_TRAIN_KEYS

    other = _cfg(run_dir, max_steps=3, compile_cache="/elsewhere/cc.bin")
    assert stamp_differences(other, cfg.model_dump(mode="json")) == [] and "compile_cache" in LAUNCH_ONLY_TRAIN_KEYS
