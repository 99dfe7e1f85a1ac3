"""Atomic checkpoints of a training run and exact resume, and the trained drafter folder.

:class:`Checkpoints` is mixed into :class:`~peagle_train.trainer.trainer.Trainer`: a checkpoint
holds weights, optimizer, scheduler, every rank's RNG states (``accelerate.save_state``) and the
data position (``trainer_state.json``), written to a temp folder and renamed, with a ``COMPLETE``
marker, so a kill at any point leaves the previous checkpoints or a new complete one. With
``train.state_out`` every checkpoint (and the end of a launch) also writes the compact portable
state of :mod:`~peagle_train.trainer.portable_state`; ``train.state_in`` resumes from one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from peagle_train.core.atomic import write_json_atomic
from peagle_train.core.config import ConfigError
from peagle_train.distributed.strategy import full_state_dict
from peagle_train.model.checkpoint import complete_checkpoints, write_drafter_dir
from peagle_train.trainer import portable_state


class Checkpoints:
    """Save / resume of the trainer's state (mixed into :class:`~peagle_train.trainer.trainer.Trainer`)."""

    def save_checkpoint(self) -> Path:
        """Atomic checkpoint ``checkpoints/step-XXXXXXXX``; keeps the last ``train.keep_last``.

        Every rank writes its part (``accelerate.save_state``: weights/optimizer shards, RNG
        states) into ``.tmp-step-XXXXXXXX``; then rank 0 adds ``trainer_state.json`` and the
        ``COMPLETE`` marker and renames the folder. A kill at any point leaves either the
        previous checkpoints alone or a new complete one.
        """
        root = self.out / "checkpoints"
        final = root / f"step-{self.step:08d}"
        tmp = root / f".tmp-step-{self.step:08d}"
        if self.acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp))
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            state = {"step": self.step, "history": self.history, "world_size": self.acc.num_processes,
                     "strategy": self.layout.strategy}
            (tmp / "trainer_state.json").write_text(json.dumps(state))
            (tmp / "COMPLETE").write_text("ok")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in complete_checkpoints(root)[: -self.tc.keep_last]:
                shutil.rmtree(old)
        self.acc.wait_for_everyone()
        self.save_state_out()
        return final

    # -- portable state (train.state_out / train.state_in) ------------------------------------------
    def state_fingerprint(self) -> dict:
        """The run's fingerprint a portable state must match (:func:`~peagle_train.trainer.portable_state.run_fingerprint`),
        computed once per trainer."""
        if getattr(self, "_state_fp", None) is None:
            self._state_fp = portable_state.run_fingerprint(self.cfg, self.target_config, self.train_ids,
                                                            self.train_masks)
        return self._state_fp

    def save_state_out(self) -> dict | None:
        """Write ``train.state_out`` for the current step (once per step; nothing without the key) and
        record what was written in ``<output_dir>/logs/state_out.json``.

        Returns:
            what :func:`~peagle_train.trainer.portable_state.save_portable_state` returns (rank 0), or None.

        Raises:
            ConfigError: an FSDP2 / DeepSpeed launch (sharded optimizer state).
        """
        if not self.tc.state_out or getattr(self, "_state_out_step", None) == self.step:
            return None
        res = portable_state.save_portable_state(self, self.tc.state_out, self.tc.state_moments,
                                                 self.tc.state_part_mib)
        self._state_out_step = self.step
        if res is not None:  # rank 0: what was written, for the job's log (path, bytes, sha256, parts, step)
            (self.out / "logs").mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.out / "logs" / "state_out.json", res)
        return res

    def resume(self) -> bool:
        """Load the newest complete checkpoint, if any; returns whether one was loaded.

        With ``train.state_in``, that portable state is loaded instead when the run folder holds no
        complete checkpoint of the same or a later step (a fresh run folder on a new machine).

        Temp folders of an interrupted save (``.tmp-step-*``) are removed first.

        Raises:
            ConfigError: the checkpoint was written by a different number of processes (exact
                resume restores each rank's RNG state and data position).
            StateError: ``train.state_in`` is damaged or was written by another run
                (:func:`~peagle_train.trainer.portable_state.load_portable_state`).
        """
        root = self.out / "checkpoints"
        if self.acc.is_main_process and root.exists():
            for tmp in root.glob(".tmp-step-*"):
                shutil.rmtree(tmp, ignore_errors=True)
        self.acc.wait_for_everyone()
        ckpts = complete_checkpoints(root)
        if self.tc.state_in:  # a portable state of a later step than the newest checkpoint wins
            ckpt_step = int(ckpts[-1].name.split("-")[-1]) if ckpts else -1
            state_step = portable_state.peek_step(self.tc.state_in)
            if state_step is None or state_step > ckpt_step:  # None: unreadable, let the loader say why
                portable_state.load_portable_state(self, self.tc.state_in)
                return True
        if not ckpts:
            return False
        state = json.loads((ckpts[-1] / "trainer_state.json").read_text())
        saved_world = state.get("world_size", 1)
        if saved_world != self.acc.num_processes:
            raise ConfigError(f"{ckpts[-1]} was written by {saved_world} processes but this launch has "
                              f"{self.acc.num_processes}: relaunch with {saved_world} processes to resume exactly, "
                              "or choose a new output_dir")
        self.acc.load_state(str(ckpts[-1]))
        self.step, self.history = state["step"], state["history"]
        # training time already spent: max_minutes and schedule: time count the whole run, not this launch
        self.elapsed_before = float(self.history[-1].get("elapsed_s", 0.0)) if self.history else 0.0
        self.acc.print(f"resumed from {ckpts[-1]} (step {self.step})")
        return True

    def save_drafter(self) -> Path:
        """Write the trained drafter (fp32 safetensors + config) to ``<output_dir>/drafter`` atomically.

        Gathers sharded weights first (FSDP2, ZeRO-3): call on every rank.
        """
        full = full_state_dict(self.acc, self.model)
        drafter = self.acc.unwrap_model(self.model).drafter
        out = self.out / "drafter"
        if self.acc.is_main_process:
            sd = {k[len("drafter."):]: v for k, v in full.items() if k.startswith("drafter.")}
            write_drafter_dir(sd, drafter.config, out)
        self.acc.wait_for_everyone()
        return out
