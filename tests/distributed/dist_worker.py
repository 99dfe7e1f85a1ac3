"""Helper run by tests/distributed/test_distributed.py in child processes (torchrun, accelerate launch or plain python).

Usage::

    python tests/distributed/dist_worker.py step  --cfg CFG.json --out DIR [--steps N] [--sabotage-no-sync] [--resume-check]
                                      [--online-shard-check]
    python tests/distributed/dist_worker.py train --cfg CFG.json [--pause-after-save STEP] [--kill-in-save STEP]
                                      [--loss-log FILE]

``step``: build the :class:`~peagle_train.trainer.trainer.Trainer` for the launch layout, run ``N``
optimizer steps and write ``DIR/<tag>-rank<r>.pt`` with this rank's records and the full
(unsharded) weights. ``--sabotage-no-sync`` also builds a second trainer whose ranks never
synchronise gradients (``no_sync`` on every backward) and writes ``nosync-rank<r>.pt``: the
tests use it to prove their check catches ranks that train alone. ``--resume-check`` saves a
checkpoint, loads it into a fresh trainer and writes both trainers' weights and next-step
records. ``--online-shard-check`` (FSDP2) compares an FSDP2-sharded target's features with
the unsharded target's and runs one step plus an evaluation with the sharded target.

``train``: ``run_train`` on the recipe. ``--pause-after-save S``: after the checkpoint of step
``S`` is complete, write ``<output_dir>/PAUSED`` and sleep (the test then SIGKILLs the job; a rank
whose launcher is gone, or that slept 10 minutes, exits by itself). ``--kill-in-save S``: while
the checkpoint of step ``S`` is being written, write half a file and SIGKILL this process.
``--loss-log``: append every step's record (rank 0) as JSON lines.

With ``PEAGLE_TEST_PID_DIR`` set, each worker process first writes an empty file named by its pid
there, so the test can end every rank it started (torchrun makes each rank a session leader of its
own: killing the launcher's process group does not reach them).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

if os.environ.get("PEAGLE_TEST_PID_DIR"):  # first, before the slow imports: the test kills what is listed
    os.makedirs(os.environ["PEAGLE_TEST_PID_DIR"], exist_ok=True)
    Path(os.environ["PEAGLE_TEST_PID_DIR"], str(os.getpid())).touch()

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from peagle_train.distributed.accelerator import end_process_group  # noqa: E402
from peagle_train.distributed.strategy import full_state_dict  # noqa: E402
from peagle_train.features.cache import CachedFeatures  # noqa: E402
from peagle_train.features.online import OnlineFeatures  # noqa: E402
from peagle_train.features.tokenized import load_prepared  # noqa: E402
from peagle_train.recipe import config_from_dict
from peagle_train.trainer import trainer as train_mod  # noqa: E402
from peagle_train.trainer.trainer import Trainer, run_train  # noqa: E402


def _trainer(cfg, feats=None):
    from transformers import AutoConfig

    out = Path(cfg.output_dir)
    data = load_prepared(out)
    if feats is None:
        feats = {"train": CachedFeatures(out / "features" / "train"), "eval": CachedFeatures(out / "features" / "eval")}
    tconf = AutoConfig.from_pretrained(cfg.target.path)
    return Trainer(cfg, data, feats, tconf, cfg.target.aux_layer_ids)


def _dump(tr, recs, out: Path, tag: str, extra: dict | None = None) -> None:
    params = full_state_dict(tr.acc, tr.model)  # collective: every rank
    rank = tr.acc.process_index
    blob = {"rank": rank, "world": tr.acc.num_processes, "strategy": tr.layout.strategy,
            "distributed_type": str(tr.acc.distributed_type), "records": recs,
            "micro_batches": [tr.micro_batches(s) for s in range(len(recs))],
            "params": {k: v.float() for k, v in params.items() if k.startswith("drafter.")},
            # the dtypes the trainable parameters live in on this rank (DeepSpeed's bf16 mode: bf16; autocast: fp32)
            "param_dtypes": sorted({str(q.dtype) for q in tr.model.parameters() if q.requires_grad})}
    blob.update(extra or {})
    torch.save(blob, out / f"{tag}-rank{rank}.pt")


def _always_no_sync(acc, model, sync):
    """Sabotage: ``no_sync`` on every backward, so gradients are never synchronised (ranks train alone)."""
    return acc.no_sync(model)


def cmd_step(args) -> None:
    cfg = config_from_dict(json.loads(Path(args.cfg).read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tr = _trainer(cfg)
    recs = [tr.train_step() for _ in range(args.steps)]
    _dump(tr, recs, out, "sync")
    if args.resume_check:
        tr.save_checkpoint()
        tr2 = _trainer(cfg)
        assert tr2.resume(), "no checkpoint found"
        loaded = full_state_dict(tr2.acc, tr2.model)
        rec_a, rec_b = tr.train_step(), tr2.train_step()
        _dump(tr2, [rec_b], out, "resumed", {"loaded": {k: v.float() for k, v in loaded.items()
                                                         if k.startswith("drafter.")}, "next_original": rec_a})
    if args.online_shard_check:
        from peagle_train.features.target import load_target

        data = load_prepared(Path(cfg.output_dir))
        plain = load_target(cfg.target, with_tokenizer=False)
        sharded = load_target(cfg.target, with_tokenizer=False)
        ocfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"features": "online",
                                                                            "target_sharding": "shard"})})
        feats = {"train": OnlineFeatures(sharded, data["train"]["input_ids"]),
                 "eval": OnlineFeatures(sharded, data["eval"]["input_ids"])}
        tr3 = _trainer(ocfg, feats)  # shards the target (FSDP2)
        idx = [tr3.acc.process_index, 2 + tr3.acc.process_index]
        got = tr3.features.get(idx)
        want = OnlineFeatures(plain, data["train"]["input_ids"]).get(idx)
        diff = max(float((g[k].float() - w[k].float()).abs().max()) for g, w in zip(got, want) for k in ("aux", "last"))
        same_argmax = all(bool((g["argmax"] == w["argmax"]).all()) for g, w in zip(got, want))
        tparams = list(sharded.model.parameters())
        rec = tr3.train_step()
        ev = tr3.evaluate()
        torch.save({"feature_max_abs_diff": diff, "same_argmax": same_argmax, "record": rec, "eval": ev,
                    "target_param_types": sorted({type(p).__name__ for p in tparams}),
                    "target_local_numel": sum(int(p.to_local().numel()) if hasattr(p, "to_local") else int(p.numel())
                                              for p in tparams),
                    "target_full_numel": sum(int(p.numel()) for p in tparams),
                    "eval_items": tr3.eval_items()},
                   out / f"online-rank{tr3.acc.process_index}.pt")
    if args.sabotage_no_sync:
        train_mod.grad_sync = _always_no_sync
        tr4 = _trainer(cfg)
        recs = [tr4.train_step() for _ in range(args.steps)]
        _dump(tr4, recs, out, "nosync")
    # as fit does at its end: no worker thread still building a next step's inputs when the process group goes
    for t in [v for k, v in locals().items() if k in ("tr", "tr2", "tr3", "tr4")]:
        t._stop_prefetch()
    tr.acc.wait_for_everyone()


def cmd_train(args) -> None:
    cfg = config_from_dict(json.loads(Path(args.cfg).read_text()))
    out = Path(cfg.output_dir)
    if args.loss_log:
        orig_step = Trainer.train_step

        def logged_step(self):
            rec = orig_step(self)
            if self.acc.is_main_process:
                with open(args.loss_log, "a") as f:
                    f.write(json.dumps({"step": rec["step"], "loss": rec["loss"]}) + "\n")
            return rec

        Trainer.train_step = logged_step
    if args.pause_after_save is not None:
        orig_save = Trainer.save_checkpoint

        def save_then_pause(self):
            path = orig_save(self)
            if self.step == args.pause_after_save:
                if self.acc.is_main_process:
                    (out / "PAUSED").write_text(str(self.step))
                launcher, deadline = os.getppid(), time.monotonic() + 600
                while os.getppid() == launcher and time.monotonic() < deadline:  # the test SIGKILLs the job here
                    time.sleep(1)
                os._exit(1)  # never outlive the test: no clean-up, as after a kill
            return path

        Trainer.save_checkpoint = save_then_pause
    if args.kill_in_save is not None:
        import accelerate.checkpointing as ckpt

        orig = ckpt.save
        tag = f".tmp-step-{args.kill_in_save:08d}"

        def save_or_die(obj, f, *a, **kw):
            if tag in str(f):
                Path(f).write_bytes(b"half-written" * 8)  # a torn file, then a hard kill mid-checkpoint
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(obj, f, *a, **kw)

        ckpt.save = save_or_die
    metrics = run_train(cfg, progress=False)
    if metrics.get("history") is not None and (int(os.environ.get("RANK", "0")) == 0):
        (out / "history.json").write_text(json.dumps([{"step": h["step"], "loss": h["loss"]}
                                                      for h in metrics["history"]]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step")
    s.add_argument("--cfg", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=1)
    s.add_argument("--sabotage-no-sync", action="store_true")
    s.add_argument("--resume-check", action="store_true")
    s.add_argument("--online-shard-check", action="store_true")
    t = sub.add_parser("train")
    t.add_argument("--cfg", required=True)
    t.add_argument("--pause-after-save", type=int, default=None)
    t.add_argument("--kill-in-save", type=int, default=None)
    t.add_argument("--loss-log", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cmd_step(args) if args.cmd == "step" else cmd_train(args)
    end_process_group()  # as the console script does: no gloo teardown at interpreter exit


if __name__ == "__main__":
    main()
