"""The training loop on ``accelerate``: one optimizer step = micro-batches × partition segments.

Per optimizer step (spec §3 "Sequence partitioning", STYLE: loss normalised by
the global supervised count):

1. draw ``grad_accum`` micro-batches (each packs ``micro_batch_size`` sequences,
   documents kept apart by ``doc_ids``), fetch their target features (cache or
   online), sample COD and build each grid;
2. all-reduce the supervised count over micro-batches and ranks → ``G``;
3. for every micro-batch and every partition segment: forward, loss =
   ``sum(own supervised losses) / (G / world)`` (DDP averages over ranks), backward;
   gradients are synchronised only on the very last backward (``no_sync`` before);
4. clip, skip the step if the grad norm is not finite (with a warning naming the step's
   sequences; more than ``train.max_skipped_steps`` skips in a run stop it), AdamW, cosine schedule.

Checkpoints are written atomically (temp dir + rename, a ``COMPLETE`` marker)
and hold weights, optimizer, scheduler, RNG states of every rank
(``accelerate.save_state``) and the data position, so a run resumes exactly; a
temp dir left by a kill is removed at resume and the newest complete checkpoint
is loaded.

The distributed strategy (DDP, FSDP2, DeepSpeed ZeRO) comes from the launcher and
is applied by :mod:`peagle_train.distributed`; this loop only calls its hooks. What differs
between draft methods (grid, objective, partitioning, acceptance walk) is asked of the method
the recipe names (:mod:`peagle_train.methods`). Beside this module: ``setup.py`` (drafter, data
order), ``evaluation.py`` (in-training eval), ``checkpoints.py`` (save / resume).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from torch.profiler import record_function

from peagle_train.core.atomic import finite_or_none, write_json_atomic, write_text_atomic
from peagle_train.core.config import ConfigError
from peagle_train.core.device import on_device, to_device
from peagle_train.core.errors import SkippedStepsError
from peagle_train.core.gc_control import full_collection, manual_collection, young_collection
from peagle_train.core.tracking import flat_metrics, peak_memory
from peagle_train.distributed.accelerator import make_accelerator
from peagle_train.distributed.batches import rank_batches
from peagle_train.distributed.layout import Layout, requested_layout, validate_layout
from peagle_train.distributed.strategy import (
    after_prepare,
    backward,
    configure_deepspeed,
    grad_norm_value,
    grad_sync,
    reduce_values,
    shard_target,
)
from peagle_train.features.cache import CachedFeatures, check_caches_match
from peagle_train.features.online import OnlineFeatures
from peagle_train.features.packing import concat_features, pack, pack_tokens
from peagle_train.features.tokenized import load_prepared
from peagle_train.features.vocab import select_draft_vocab, token_frequencies
from peagle_train.kernels.chain_kernel import resolve as resolve_chain_kernel
from peagle_train.kernels.compiling import compile_decoder_layers, set_dynamic_shapes
from peagle_train.kernels.loss import loss_path
from peagle_train.methods import get_method
from peagle_train.peagle.grid import supervised_count
from peagle_train.peagle.metrics import DepthStats, depth_stats
from peagle_train.recipe import RunConfig, dump_config
from peagle_train.trainer.checkpoints import Checkpoints
from peagle_train.trainer.evaluation import InTrainingEval
from peagle_train.trainer.profiling import StepProfiler
from peagle_train.trainer.setup import (
    adamw_implementation,
    build_drafter,
    dynamic_shapes_for,
    epoch_order,
    resolve_attention,
    step_generator,
)


def ranks_max(acc, device, value: float) -> float:
    """The largest of the ranks' ``value`` (a Python float, any unit): ``value`` itself for one process (no
    collective, no device sync), else one max all-reduce of a 1-element tensor on ``device`` through
    ``acc`` (an ``accelerate.Accelerator``; waits for the rank's queued work). Every rank must call it."""
    if acc.num_processes == 1:
        return value
    return float(acc.reduce(torch.tensor([value], device=device), reduction="max"))


class Trainer(InTrainingEval, Checkpoints):
    """Owns the accelerate objects and the loop; built by :func:`run_train`.

    Args:
        cfg: the run. data: ``{"train"|"eval": {"input_ids", "loss_mask"}}`` lists per sequence.
        features: ``{"train"|"eval": CachedFeatures | OnlineFeatures}``.
        target_config: the target's HF config. aux_layer_ids: tapped layers.
        accelerator: an existing ``Accelerator`` (default: built for ``layout``).
        layout: the launch layout (default: :func:`~peagle_train.distributed.layout.requested_layout`).

    Raises:
        ConfigError: an impossible layout (:func:`~peagle_train.distributed.layout.validate_layout`),
            ``train.chain_kernel: triton`` where Triton cannot run, or ``train.attention: flex_flash`` where
            FlashAttention-4 cannot run (:func:`~peagle_train.trainer.setup.resolve_attention`).
        RuntimeError: processes that do not form one group (each rank would train alone).
    """

    def __init__(self, cfg: RunConfig, data: dict, features, target_config, aux_layer_ids, accelerator=None,
                 layout: Layout | None = None):
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        self.cfg, self.tc = cfg, cfg.train
        self.target_config = target_config  # part of a portable state's fingerprint (checkpoints.py)
        self.method = get_method(cfg.train.method)  # everything that differs between draft methods
        self.out = Path(cfg.output_dir)
        self.layout = layout or requested_layout()
        self.train_ids, self.train_masks = data["train"]["input_ids"], data["train"]["loss_mask"]
        if self.tc.train_sequences is not None:  # data-size ablation: a prefix of the prepared split
            if self.tc.train_sequences > len(self.train_ids):
                raise ConfigError(f"train.train_sequences={self.tc.train_sequences} but the prepared train split in "
                                  f"{self.out / 'data'} holds {len(self.train_ids)} sequences; lower it or prepare more "
                                  "data (data.num_conversations)")
            self.train_ids = self.train_ids[: self.tc.train_sequences]
            self.train_masks = self.train_masks[: self.tc.train_sequences]
        self.lengths = [len(x) for x in self.train_ids]
        self.eval_ids, self.eval_masks = data["eval"]["input_ids"], data["eval"]["loss_mask"]
        self.grad_accum = validate_layout(cfg, self.layout, len(self.train_ids))
        self.acc = accelerator or make_accelerator(cfg, self.layout, self.out / "logs")
        self.features, self.eval_features = features["train"], features["eval"]
        V = target_config.vocab_size
        counts = token_frequencies(zip(self.train_ids, self.train_masks), V)
        mask_id = cfg.drafter.mask_token_id
        Vd = cfg.drafter.draft_vocab_size or V
        self.draft_ids = select_draft_vocab(counts, Vd, exclude=[mask_id] if mask_id is not None else [])
        head = self.features.target_head().detach().clone()
        embed = self.features.target_embeddings().detach().clone()
        self.device = self.acc.device
        try:  # before the target is placed or the drafter built: a kind that cannot run here is refused at once
            self.attention = resolve_attention(self.tc.attention, self.device)
        except ConfigError as e:
            raise ConfigError(f"{cfg.source_file}: {e}") from None
        if self.tc.features == "online":
            self._place_target()
        loaded = getattr(getattr(self.features, "target", None), "model", None)  # online: the target in memory
        drafter = build_drafter(cfg, target_config, aux_layer_ids, self.draft_ids, embed, head, loaded)
        drafter.gradient_checkpointing = self.tc.activation_checkpointing
        set_dynamic_shapes(dynamic_shapes_for(self.attention, self.tc.dynamic_shapes))  # before anything compiles
        try:  # once, at set-up: a recipe asking for Triton where it cannot run fails here, not at the first step
            self.chain_kernel = resolve_chain_kernel(self.tc.chain_kernel, self.device)
        except RuntimeError as e:
            raise ConfigError(f"{cfg.source_file}: train.chain_kernel: {e}") from None
        objective = self.method.build_objective(
            drafter, head[self.draft_ids].float(), cfg, attention=self.attention, chain_kernel=self.chain_kernel,
            max_micro_tokens=self.tc.micro_batch_size * max(self.lengths, default=1))
        trainable = [p for p in objective.parameters() if p.requires_grad]  # drafter.embeddings: frozen leaves one out
        opt = torch.optim.AdamW(trainable, lr=self.tc.lr, betas=tuple(self.tc.betas), weight_decay=self.tc.weight_decay,
                                **adamw_implementation(self.device.type, self.layout.strategy))
        per_step = self.tc.micro_batch_size * self.grad_accum * self.acc.num_processes
        self.steps_per_epoch = len(self.train_ids) // per_step
        self.total_steps = self.tc.max_steps or self.steps_per_epoch * self.tc.epochs
        sched = get_cosine_with_min_lr_schedule_with_warmup(
            opt, num_warmup_steps=math.ceil(self.tc.warmup_ratio * self.total_steps),
            num_training_steps=self.total_steps, min_lr_rate=self.tc.min_lr_ratio)
        self.time_fraction = 0.0  # elapsed / max_minutes, the same on every rank (schedule: time)
        if self.tc.schedule == "time":
            by_steps = sched.lr_lambdas[0]
            sched.lr_lambdas[0] = lambda step: by_steps(
                max(step, min(self.total_steps, int(self.time_fraction * self.total_steps))))
        configure_deepspeed(self.acc, self.tc, self.layout.ds_config)
        self.model, self.opt, self.sched = self.acc.prepare(objective, opt, sched)
        after_prepare(self.acc, self.model)
        self._ranks: dict[int, int] | None = None  # heldout rank per eval sequence (_heldout_rank), built on first use
        self._copyable_cache: dict = {}  # eval sequence -> [n] bool copyable tokens (InTrainingEval._copyable)
        self._walk_refs: dict | None = None  # train.eval_walk_sets: {set: (ids, masks, features)}, made on first use
        self._walk_refs_s = 0.0  # seconds the target took to answer the sets (InTrainingEval._walk_sets)
        self._eval_items: list[int] | None = None
        self.step = 0
        self.elapsed_before = 0.0  # training seconds of earlier launches of this run (set by resume)
        self._plan_inputs = None  # (drafter shape, GPU bytes) for the memory planner, set on first use
        self._target_shape = None  # the online target as the planner sees it (_online_step), set on first use
        self.predicted_peak: dict | None = None  # the largest planner prediction of this launch (_note_predicted_peak)
        self._pool = None  # worker thread building the next step's host inputs (train.prefetch), started on first use
        self._ahead: dict = {}  # {0-based step: Future of its host_inputs}
        self._online_ahead = None  # (indices, features) of the next step's first micro-batch (online target)
        self.history: list[dict] = []

    def _place_target(self) -> None:
        """Online features: replicate the frozen target on this rank's device, or FSDP2-shard it."""
        targets = {id(f.target): f.target for f in (self.features, self.eval_features) if hasattr(f, "target")}
        for t in targets.values():
            if self.tc.target_sharding == "shard":
                shard_target(t.model)
            else:
                t.model.to(self.device)
            if self.tc.compile_target:  # regional: each decoder layer, dynamic shapes (every padded batch is new)
                compile_decoder_layers(t.model)

    # -- data ---------------------------------------------------------------------------------
    def micro_batches(self, step: int, rank: int | None = None) -> list[list[int]]:
        """Sequence indices of this rank's (or ``rank``'s) micro-batches for optimizer step ``step`` (0-based).

        Each step takes the next ``micro_batch_size × grad_accum × world`` sequences of the
        epoch's seeded shuffle and deals them to ranks (:func:`~peagle_train.distributed.batches.rank_batches`).
        """
        world = self.acc.num_processes
        rank = self.acc.process_index if rank is None else rank
        per_step = self.tc.micro_batch_size * self.grad_accum * world
        epoch, within = divmod(step, self.steps_per_epoch)
        order = epoch_order(len(self.train_ids), self.tc.seed, epoch)
        chunk = order[within * per_step:(within + 1) * per_step]
        return rank_batches(chunk, self.lengths, world, rank, self.tc.micro_batch_size, self.grad_accum,
                            self.tc.length_balance)

    def host_micro(self, indices, ids, masks, gen, source=None) -> tuple:
        """The CPU side of one micro-batch: its token lists packed and its COD grid, built from the
        token lists alone (no device), so it can be built ahead on a worker thread; with a ``source``
        that reads on the host (a feature cache, ``reads_on_host``), its features too, concatenated in
        pinned memory (:func:`~peagle_train.features.packing.concat_features`).

        Returns:
            ``(indices, tokens, host_grid, features or None)``: :func:`~peagle_train.features.packing.pack_tokens`,
            the method's grid (:meth:`~peagle_train.methods.base.DraftMethod.build_grid`), both on the CPU,
            and the cache's features (None: :meth:`device_micro` asks the source, e.g. the online target).
        """
        tokens = pack_tokens([ids[i] for i in indices], [masks[i] for i in indices])
        grid = self.method.build_grid(tokens, self.cfg, gen)
        feats = None
        if source is not None and getattr(source, "reads_on_host", False):
            feats = concat_features(source.get(indices), tokens, pin=self.device.type == "cuda")
        return indices, tokens, grid, feats

    def host_inputs(self, step: int) -> list[tuple]:
        """:meth:`host_micro` of every micro-batch of this rank for 0-based optimizer step ``step``
        (the COD generator of each is :func:`step_generator` of the step, rank and micro-batch, so the
        result depends on ``step`` alone: built ahead or now, it is the same)."""
        return [self.host_micro(ix, self.train_ids, self.train_masks,
                                step_generator(self.tc.seed, step, self.acc.process_index, m), self.features)
                for m, ix in enumerate(self.micro_batches(step))]

    def _step_host_inputs(self) -> list[tuple]:
        """This step's :meth:`host_inputs`: taken from the worker thread that built them while the
        previous step ran on the device (built now if none was started, e.g. the first step of a launch),
        after starting the next step's on the worker (``train.prefetch``)."""
        fut = self._ahead.pop(self.step, None)
        if self.tc.prefetch and self.step + 1 < self.total_steps:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peagle-host-inputs")
            self._ahead = {self.step + 1: self._pool.submit(self.host_inputs, self.step + 1)}
        return fut.result() if fut is not None else self.host_inputs(self.step)

    def _stop_prefetch(self) -> None:
        """Drop the inputs built ahead and end the worker thread (end of ``fit``; a later step builds its own)."""
        self._ahead, self._online_ahead = {}, None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def device_micro(self, host: tuple, source) -> tuple:
        """Features of a :meth:`host_micro` result (read ahead from the cache, or asked of ``source`` now:
        the online target's forward), packed on the device, and its grid copied there without blocking:
        no host sync before the forward.

        Returns:
            ``(packed, grid, host_grid)``: ``packed`` as :func:`~peagle_train.features.packing.pack` (tokens,
            ``aux [N, A*T]``, ``last [N, T]``, ``argmax [N]`` on the device), ``grid`` on the device,
            ``host_grid`` the same on the CPU.

        Raises:
            ValueError: features that do not match the token lists (:func:`~peagle_train.features.packing.pack`).
        """
        indices, tokens, host_grid, feats = host
        if feats is None and source is self.features and self._online_ahead is not None:
            ahead, self._online_ahead = self._online_ahead, None
            if ahead[0] == list(indices):
                feats = ahead[1]  # launched during the previous step (_launch_online_features)
        if feats is None:
            with record_function("peagle/features"):
                feats = source.get(indices)
        with record_function("peagle/host_inputs"):
            packed = pack(feats, tokens, self.device)
            return packed, host_grid.to(self.device, non_blocking=True), host_grid

    def _launch_online_features(self) -> None:
        """Online features (``train.prefetch``): launch the target's forward for the next step's first
        micro-batch now, after this step's backward is queued and before its optimizer's host syncs, so
        the host queues the target's kernels while the device still runs the backward instead of after
        it (the frozen target does not depend on this step's update; the next step's micro-batches are
        fixed by :meth:`micro_batches`). Same features, same training; holds one micro-batch's features
        (``aux``, ``last``, ``argmax``) for one step longer."""
        if not self._prefetches_online() or self.step + 1 >= self.total_steps:
            return
        ix = self.micro_batches(self.step + 1)[0]
        with record_function("peagle/features"):
            self._online_ahead = (list(ix), self.features.get(ix))

    def _time_fraction(self, t_start: float) -> float:
        """Elapsed wall time over ``train.max_minutes``, the same on every rank (the time schedule's LR and the
        stop): the ranks' maximum through one collective; one process reads its clock alone, so the step
        starts without a device sync (a device tensor read back would wait for the queued work, the
        prefetched target forward included)."""
        return ranks_max(self.acc, self.device, (time.perf_counter() - t_start) / (60 * self.tc.max_minutes))

    def _prefetches_online(self) -> bool:
        """Whether :meth:`_launch_online_features` runs the next step's target forward (``train.prefetch``,
        features computed on the device, one micro-batch per step)."""
        return self.tc.prefetch and not getattr(self.features, "reads_on_host", True) and self.grad_accum == 1

    def _forward(self, packed, grid, normaliser):
        return self.model(grid, packed["aux"], packed["last"], packed["argmax"], normaliser,
                          *self.method.objective_inputs(packed))

    def _stats(self, packed, grid, pred) -> DepthStats:
        drafter = self.acc.unwrap_model(self.model).drafter
        tgt = packed["argmax"][grid.label_index]
        correct = drafter.draft_to_target(pred) == tgt
        return depth_stats(grid.anchor, grid.depth, grid.loss_weight, correct, drafter.t2d[tgt], self.tc.K,
                           n_anchors=packed["input_ids"].numel())

    # -- one optimizer step ----------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step (module docstring); returns the step's record (global loss, lr, grad norm, rates)."""
        t0 = time.perf_counter()
        with record_function("peagle/host_inputs"):
            host = self._step_host_inputs()
        micros = [self.device_micro(h, self.features) for h in host]
        with record_function("peagle/plan"):
            local_count = sum(supervised_count(h) for _, _, h in micros)  # host grids: no device sync
            global_count = float(reduce_values(self.acc, [local_count], "sum")[0])
            normaliser = max(global_count, 1.0) / self.acc.num_processes
            stats = DepthStats.zeros(self.tc.K, self.device)
            loss_total, positions, tokens = torch.zeros((), dtype=torch.float64, device=self.device), 0, 0
            plans = []
            lengths, indices = [packed["input_ids"].numel() for packed, _, _ in micros], [h[0] for h in host]
            online = self._online_steps(lengths, indices)  # the target's forwards, worked out once per step
            parts = self._partitions(lengths, online)
            self._note_predicted_peak(lengths, parts, online)
            for (packed, grid, host_grid), S in zip(micros, parts):
                n = packed["input_ids"].numel()
                # each segment with the indices of the elements it owns, found on the host (no nonzero sync);
                # None: the method trains the whole grid in one forward
                host_segs = self.method.segments(host_grid, n, S)
                segs = None if host_segs is None else [
                    (seg.to(self.device, non_blocking=True),
                     to_device(seg.owned.nonzero().flatten(), self.device, non_blocking=True)) for seg in host_segs]
                plans.append(segs)
                positions += len(grid)
                tokens += n
            n_backward = sum(len(s) if s else 1 for s in plans)
        done = 0
        self.model.train()
        with record_function("peagle/forward_backward"):
            for (packed, grid, _), segs in zip(micros, plans):
                for seg, owned_at in (segs or [(None, None)]):
                    done += 1
                    last = done == n_backward  # gradients are synchronised on the last backward only (spec §3)
                    g = seg.apply(grid) if seg is not None else grid
                    with grad_sync(self.acc, self.model, last):
                        with self.acc.autocast():
                            loss, pred = self._forward(packed, g, normaliser)
                        backward(self.acc, loss, last)
                    loss_total = loss_total + loss.detach().double()  # summed on the device: no sync per backward
                    own = g if seg is None else g.select(owned_at)
                    own_pred = pred if seg is None else pred[owned_at]
                    stats = stats.add(self._stats(packed, own, own_pred))
        self._launch_online_features()
        with record_function("peagle/optimizer"):
            grad_norm = grad_norm_value(self.acc.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip))
            # DeepSpeed has already stepped inside the last backward (no skip there: see docs/distributed.md)
            skipped = not math.isfinite(grad_norm) and self.layout.strategy != "deepspeed"
            if skipped:
                self.opt.zero_grad(set_to_none=True)
            else:
                self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
        self.step += 1
        with record_function("peagle/stats"):
            counts = torch.tensor([positions, tokens], dtype=torch.float64, device=self.device)
            # one collective and one device-to-host copy for the step's loss, counts and depth statistics
            sums = self.acc.reduce(torch.cat([loss_total.reshape(1), counts, stats.stacked().flatten()]),
                                   reduction="sum").cpu()
        st = DepthStats.from_stacked(sums[3:].view(4, self.tc.K))
        dt = time.perf_counter() - t0
        rec = {"step": self.step, "loss": float(sums[0]) / self.acc.num_processes,
               "lr": self.sched.get_last_lr()[0], "grad_norm": grad_norm, "skipped": skipped,
               "positions": int(sums[1]), "tokens": int(sums[2]),  # grid elements and tokens of the step (all ranks)
               "positions_per_s": float(sums[1]) / dt, "tokens_per_s": float(sums[2]) / dt,
               "supervised": global_count, "acc": st.accuracy(), "sim_al": st.simulated_acceptance_length(),
               "loss_path": loss_path(self.acc.unwrap_model(self.model).drafter.lm_head, self.tc.fused_loss)}
        rec.update(peak_memory())
        if not (math.isfinite(rec["loss"]) and math.isfinite(grad_norm)):
            self._warn_nonfinite(rec)
        young_collection(self.step, self.tc.gc_every)  # generations 0-1 only (train.gc_every): no full pause
        return rec

    def _warn_nonfinite(self, rec: dict) -> None:
        """Print (main process only) one warning line for a step whose loss or grad norm is not finite.

        It names the step (1-based, as in the logs), the values, whether the optimizer step was
        skipped, the skips of the run so far against ``train.max_skipped_steps``, the train-split
        sequence indices of the step (per rank under several processes) and, with cached features,
        the cache's shard files holding them and which of them hold non-finite cached features (each
        re-read once, on this failure path only; online features are not recomputed).
        """
        if not self.acc.is_main_process:
            return
        loss, grad_norm = rec["loss"], rec["grad_norm"]
        bad = " and ".join(name for name, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v))
        n_skipped = sum(bool(h.get("skipped")) for h in self.history) + rec["skipped"]
        if rec["skipped"]:
            action = (f"optimizer step skipped ({n_skipped} skipped in this run, train.max_skipped_steps="
                      f"{self.tc.max_skipped_steps})")
        elif self.layout.strategy == "deepspeed":
            action = "not skipped: DeepSpeed applies the step inside the backward"
        else:
            action = "the gradients are finite, so the optimizer step was applied"
        world = self.acc.num_processes
        per_rank = [sorted(i for mb in self.micro_batches(rec["step"] - 1, r) for i in mb) for r in range(world)]
        seqs = sorted(i for ix in per_rank for i in ix)
        where = str(seqs) if world == 1 else "; ".join(f"rank {r}: {ix}" for r, ix in enumerate(per_rank))
        msg = (f"warning: step {rec['step']}: non-finite {bad} (loss={loss}, grad_norm={grad_norm}); {action}; "
               f"train-split sequences {where}")
        if isinstance(self.features, CachedFeatures):
            shards = sorted({self.features.shard_file(i).name for i in seqs})
            nonfinite = [i for i in seqs if not all(bool(torch.isfinite(f[k]).all())
                                                    for f in self.features.get([i]) for k in ("aux", "last"))]
            msg += (f"; feature cache {self.features.dir}, shard files {', '.join(shards)}; sequences with "
                    f"non-finite cached features: {nonfinite or 'none'}")
        else:
            msg += " (features computed online by the target)"
        self.acc.print(msg)

    def partitions(self, lengths: list[int], indices: list[list[int]] | None = None) -> list[int]:
        """Segments S per micro-batch (``lengths``: packed tokens of each; ``indices``: its train-split
        sequences, for the online target's forwards). ``train.partitions: auto`` asks
        :func:`~peagle_train.peagle.planner.partitions_for` with this GPU's memory, the online target's
        weights, forward and features being inside the prediction (:meth:`_online_step`), and takes the
        maximum over ranks per micro-batch, so FSDP2 / ZeRO ranks run the same number of forwards. The
        planner is told ``train.fused_loss`` (the recompute path keeps more), ``drafter.lm_head``, the
        objective's float32 target head rows, and that gradients are resident during the forward when the
        step has several micro-batches (after the first) or several processes (DDP allocates its gradient
        buckets up front); otherwise it assumes they are only where a micro-batch has S > 1.

        Raises:
            ConfigError: ``auto`` and no partition count fits (names the micro-batch size and what to change).
        """
        return self._partitions(lengths, self._online_steps(lengths, indices))

    def _online_steps(self, lengths: list[int], indices: list[list[int]] | None) -> list:
        """:meth:`_online_step` of each micro-batch (None entries with cached features or ``train.partitions``
        fixed for a method the planner does not model: nothing asks for them)."""
        if self.tc.partitions != "auto" and not self.method.memory_planned:
            return [None] * len(lengths)
        return [self._online_step(ix, n) for n, ix in zip(lengths, indices or [None] * len(lengths))]

    def _partitions(self, lengths: list[int], online: list) -> list[int]:
        """:meth:`partitions` with each micro-batch's :class:`~peagle_train.peagle.planner.OnlineStep` (or None)
        already worked out."""
        if self.tc.partitions != "auto":
            return [self.tc.partitions] * len(lengths)
        from peagle_train.peagle.planner import partitions_for

        shape, gpu = self._planner_inputs()
        try:
            parts = [partitions_for(n, self.tc.K, self.tc.cod_r, self.tc.cod_r_min, shape, gpu,
                                    online=on, **self._plan_kwargs(len(lengths)))
                     for n, on in zip(lengths, online)]
        except ValueError as e:
            raise ConfigError(f"{self.cfg.source_file}: train.partitions=auto found no plan for a micro-batch of "
                              f"{max(lengths)} tokens ({e}); lower train.micro_batch_size or data.max_length, "
                              + ("" if self.tc.activation_checkpointing else
                                 "turn on train.activation_checkpointing (then planned with it), ")
                              + "or set train.partitions yourself") from None
        return [int(x) for x in reduce_values(self.acc, parts, "max", dtype=torch.int64)]

    def _planner_inputs(self) -> tuple:
        """``(drafter ShapeParams, this GPU's total memory in bytes or None off CUDA)``, fixed for the run."""
        if self._plan_inputs is None:
            from peagle_train.peagle.planner import ShapeParams

            gpu = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
            self._plan_inputs = (ShapeParams.from_config(self.acc.unwrap_model(self.model).drafter.config), gpu)
        return self._plan_inputs

    def _plan_kwargs(self, n_micro: int) -> dict:
        """The drafter-side settings of the memory planner for a step of ``n_micro`` micro-batches (this rank),
        the recipe's ``train.activation_checkpointing`` among them: one set for planning S and predicting the peak."""
        resident = n_micro > 1 or self.acc.num_processes > 1
        return dict(chunk=self.tc.loss_chunk_size, max_anchors=self.tc.max_anchors, fused_loss=self.tc.fused_loss,
                    grads_resident=True if resident else None,
                    lm_head_trainable=self.cfg.drafter.lm_head == "trainable",
                    target_head_bytes=4,  # the objective's target head rows are float32 (build_objective)
                    compiled_loss=bool(self.tc.compile),  # train.compile compiles the loss chunk body
                    checkpointing=self.tc.activation_checkpointing)

    def _online_step(self, indices: list[int] | None, n: int):
        """The online target's part of the memory model for a micro-batch of train-split ``indices`` (``n``
        packed tokens): a :class:`~peagle_train.peagle.planner.OnlineStep` with the target forwards
        :class:`~peagle_train.features.online.OnlineFeatures` runs for it (``indices`` None: one sequence of
        ``n`` tokens); None with cached features."""
        from peagle_train.features.target import GREEDY_CHUNK
        from peagle_train.peagle.planner import OnlineStep, target_forwards

        target = getattr(self.features, "target", None)
        if target is None or self.tc.features != "online":
            return None
        if self._target_shape is None:
            self._target_shape = target.memory_shape(self._target_bytes())
        forwards = ((1, n),) if indices is None else target_forwards([self.lengths[i] for i in indices],
                                                                      self.features.batch_tokens)
        return OnlineStep(self._target_shape, forwards, prefetch=self._prefetches_online(),
                          micro_batches=self.grad_accum,
                          head_chunk=None if self.tc.target_sharding == "shard" else GREEDY_CHUNK)

    def _note_predicted_peak(self, lengths: list[int], parts: list[int], online: list) -> None:
        """Keep in ``self.predicted_peak`` the largest peak the memory planner predicts for this launch's
        micro-batches so far (methods the planner models: ``DraftMethod.memory_planned``): each micro-batch's
        packed tokens, the S it runs with and the recipe's ``train.activation_checkpointing``, with the online
        target's weights, forwards and features (``online``: :meth:`_online_steps`)
        (:func:`~peagle_train.peagle.planner.predict_online_peak_bytes`) or without
        (:func:`~peagle_train.peagle.planner.predict_peak_bytes`). ``run_train`` returns it and the train
        stage writes it to ``logs/stages.jsonl`` beside the measured peak.
        """
        if not self.method.memory_planned:
            return
        from peagle_train.peagle.planner import predict_online_peak_bytes, predict_peak_bytes

        shape, _ = self._planner_inputs()
        cod = (self.tc.K, self.tc.cod_r, self.tc.cod_r_min)
        kw = self._plan_kwargs(len(lengths))
        for n, S, on in zip(lengths, parts, online):
            peak = (predict_peak_bytes(n, S, shape, *cod, **kw) if on is None
                    else predict_online_peak_bytes(n, S, shape, on, *cod, **kw))
            if self.predicted_peak is None or peak > self.predicted_peak["bytes"]:
                forwards = None if on is None else [list(f) for f in on.forwards]
                self.predicted_peak = {"bytes": peak, "tokens": n, "partitions": S, "target_forwards": forwards}

    def _target_bytes(self) -> int:
        """Bytes of the online target's weights on this device (an FSDP2-sharded target: this rank's shards)."""
        params = [p.to_local() if hasattr(p, "to_local") else p for p in self.features.target.model.parameters()]
        return sum(p.numel() * p.element_size() for p in params if on_device(p.device, self.device))

    # -- loop --------------------------------------------------------------------------------------
    def _log(self, rec: dict, prefix: str) -> None:
        self.acc.log(flat_metrics(rec, prefix), step=self.step)

    def _check_skipped(self, bar) -> None:
        """Stop the run once more steps were skipped than ``train.max_skipped_steps`` allows.

        Counts the skipped records of ``self.history``, so skips before a resume count too; every
        rank holds the same history (the skip follows the global grad norm), so all ranks stop together.

        Raises:
            SkippedStepsError: naming the skipped steps, the key and the data to check.
        """
        skipped = [h["step"] for h in self.history if h.get("skipped")]
        limit = self.tc.max_skipped_steps
        if len(skipped) <= limit:
            return
        bar.close()
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        raise SkippedStepsError(
            f"{self.cfg.source_file or '<recipe>'}: {len(skipped)} optimizer steps of this run were skipped because "
            f"their loss or gradient norm was not finite (steps {shown}), more than train.max_skipped_steps={limit} "
            "allows: check the training data and the features of the sequences named in the warnings above (a "
            "damaged feature cache is rebuilt by deleting it and re-running `peagle-train cache`), or raise "
            "train.max_skipped_steps to tolerate more skipped steps")

    def _open_step_log(self):
        """``<output_dir>/logs/steps.jsonl`` (main process; None on other ranks): one JSON line per optimizer
        step, the record :meth:`train_step` returns with its ``elapsed_s`` and any in-training evaluation,
        written as the step ends, so a run stopped by a job's time limit or a kill still leaves its curve
        (``train_metrics.json`` is written only at the end). It is rewritten from the history restored at
        a resume (steps after the last checkpoint are trained again and logged again), then appended to.
        """
        if not self.acc.is_main_process:
            return None
        path = self.out / "logs" / "steps.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "".join(json.dumps(finite_or_none(h)) + "\n" for h in self.history))
        return path.open("a")

    def fit(self, progress: bool = True, stop_at: int | None = None,
            stop_after_minutes: float | None = None) -> dict | None:
        """Train to ``total_steps``; with ``stop_at``, checkpoint and return ``None`` at that step
        (a planned interruption: the schedule still targets ``total_steps``); with ``stop_after_minutes``,
        the same after the first step that ends at least that many minutes after this launch's first step
        began (:meth:`_launch_over`: a job's time limit; loading before and saving after are not counted).
        Python's garbage collector runs as ``train.gc_every`` says (:mod:`peagle_train.core.gc_control`):
        its full collections only between steps.

        Raises:
            SkippedStepsError: more than ``train.max_skipped_steps`` skipped steps in the run
                (:meth:`_check_skipped`); the last checkpoint is left as it was.
        """
        with manual_collection(self.tc.gc_every):
            return self._fit(progress, stop_at, stop_after_minutes=stop_after_minutes)

    def _launch_over(self, t_launch: float, minutes: float | None) -> bool:
        """Whether this launch has trained ``minutes`` (wall minutes since its first step began), the same
        answer on every rank: one process reads its clock; several take the ranks' maximum through one
        collective, on steps that are a multiple of ``train.log_every`` only (the collective waits for
        the queued work, so not after every step). False when ``minutes`` is None."""
        if minutes is None:
            return False
        over = time.perf_counter() - t_launch >= 60 * minutes
        if self.acc.num_processes > 1 and self.step % self.tc.log_every:
            return False
        return ranks_max(self.acc, self.device, float(over)) > 0

    def _fit(self, progress: bool, stop_at: int | None, stop_after_minutes: float | None = None) -> dict | None:
        from tqdm import tqdm

        self.acc.init_trackers("peagle_train", init_kwargs={"wandb": {
            "dir": str(self.out / "logs"), "name": self.out.name, "config": self.cfg.model_dump(mode="json")}})
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train[{self.tc.method}]",
                   disable=not (progress and self.acc.is_local_main_process))
        t_launch = time.perf_counter()
        t_start = t_launch - self.elapsed_before
        step_log = self._open_step_log()
        profiler = StepProfiler(self.tc.profile_steps if self.acc.is_main_process else 0, self.tc.profile_start,
                                self.out / "logs" / "profile.json")
        while self.step < self.total_steps:
            if self.tc.max_minutes is not None:
                self.time_fraction = self._time_fraction(t_start)
                if self.time_fraction > 1.0:
                    break
            profiler.before_step(self.step)
            rec = self.train_step()
            rec["elapsed_s"] = time.perf_counter() - t_start  # wall time since fit() started (s)
            self.history.append(rec)
            bar.update(1)
            # the simulated AL of this step's batch (train_sim_al), not the eval stage's measured AL
            bar.set_postfix({"loss": f"{rec['loss']:.3f}", "sim_al(train)": f"{rec['sim_al']:.2f}",
                             "tok_s": f"{rec['tokens_per_s']:.0f}"})
            if self.step % self.tc.log_every == 0 or self.step == self.total_steps:
                with record_function("peagle/log"):
                    self._log(rec, "train")
            if rec["skipped"]:
                self._check_skipped(bar)
            if self.tc.eval_every and self.step % self.tc.eval_every == 0 and self.step < self.total_steps:
                with record_function("peagle/eval"):
                    ev = self.evaluate()
                    full_collection(None, self.tc.gc_every)  # between steps, with the evaluation's time
                rec.update(ev)
                self._log(ev, "eval")
            else:
                full_collection(self.step, self.tc.gc_every)  # every 20 x gc_every steps, between steps
            profiler.after_step(self.step - 1)
            if step_log is not None:
                step_log.write(json.dumps(finite_or_none(rec)) + "\n")
                step_log.flush()
            if self.tc.save_every and self.step % self.tc.save_every == 0:
                self.save_checkpoint()
            # (a time limit met on the run's last step lets the run finish: evaluate and save now, not next launch;
            # so does one met when the run's time budget, train.max_minutes, is spent too: the budget ends the run)
            if (stop_at is not None and self.step >= stop_at) or (
                    self._launch_over(t_launch, stop_after_minutes) and self.step < self.total_steps
                    and not (self.tc.max_minutes is not None and self._time_fraction(t_start) >= 1.0)):
                if stop_at is None or self.step < stop_at:
                    self.acc.print(f"train: stopped after {stop_after_minutes} minutes of this launch at step "
                                   f"{self.step} of {self.total_steps}; the next launch continues the run")
                if step_log is not None:
                    step_log.close()
                self._stop_prefetch()
                profiler.finish()
                self.save_checkpoint()
                bar.close()
                return None
        bar.close()
        if step_log is not None:
            step_log.close()
        self._stop_prefetch()
        profiler.finish()  # a run that ended inside the profiled window still writes its summary
        self.save_state_out()  # train.state_out: the launch's last step (once per step)
        final = self.evaluate()
        self._log(final, "eval")
        for tracker in self.acc.trackers:  # not end_training(): the process group is still needed to save
            tracker.finish()
        return final


def run_train(cfg: RunConfig, progress: bool = True, stop_at: int | None = None,
              stop_after_minutes: float | None = None) -> dict:
    """The ``train`` stage: features (cache or online) → drafter → ``<output_dir>/drafter``.

    ``stop_at``: checkpoint and return after that optimizer step (resume later by calling again);
    ``stop_after_minutes``: the same after this launch's first step that ends that many wall minutes
    after its first step began (:meth:`Trainer.fit`); either returns ``{"stopped_at": step, ...}``.
    Under a multi-process launch every rank calls this (see ``launch/README.md``).

    A run that already finished (``train_metrics.json`` and a complete ``drafter/``) is not
    trained again: its saved metrics are returned (delete ``train_metrics.json``, or pass
    ``--overwrite`` to the CLI, to retrain).

    Returns:
        the final eval metrics (also written to ``<output_dir>/train_metrics.json``).

    Raises:
        ConfigError: an impossible layout or recipe (before the target is loaded).
        CacheError: ``features: cache`` and a cache that is missing, incomplete, or made for another
            target, aux layers, dtype or prepared data (before training; names every difference).
        RuntimeError: processes that do not form one group.
    """
    from peagle_train.features.target import default_aux_layer_ids, feature_target, load_target, load_target_config
    from peagle_train.trainer.compile_cache import compile_cache_path, load_compile_cache, save_compile_cache

    out = Path(cfg.output_dir)
    done = out / "train_metrics.json"
    if stop_at is None and done.exists() and (out / "drafter" / "config.json").exists():
        metrics = json.loads(done.read_text())
        if progress:
            print(f"train: {out} already holds a finished run ({metrics.get('steps')} steps); reusing it "
                  "(delete train_metrics.json or pass --overwrite to train again)")
        return metrics
    data = load_prepared(out)
    layout = requested_layout()
    validate_layout(cfg, layout, len(data["train"]["input_ids"]))  # before loading anything heavy
    acc = make_accelerator(cfg, layout, out / "logs")  # also selects this rank's GPU for the target below
    tpath, tconf = load_target_config(cfg.target)
    aux_ids = cfg.target.aux_layer_ids or default_aux_layer_ids(tconf.num_hidden_layers)
    if cfg.train.features == "cache":
        feats = {"train": CachedFeatures(out / "features" / "train"), "eval": CachedFeatures(out / "features" / "eval")}
        # before training: a cache of other aux layers, another target, dtype or data is refused
        check_caches_match(feats, {s: data[s]["input_ids"] for s in feats}, target=str(tpath), aux_layer_ids=aux_ids,
                           hidden_size=tconf.hidden_size, vocab_size=tconf.vocab_size, dtype=cfg.data.cache_dtype)
    else:
        # train.eval_walk_sets: the in-training eval renders the sets' prompts with the target's chat template
        target = load_target(feature_target(cfg.target), with_tokenizer=bool(cfg.train.eval_walk_sets))
        feats = {s: OnlineFeatures(target, data[s]["input_ids"], batch_tokens=cfg.train.target_batch_tokens)
                 for s in ("train", "eval")}
    trainer = Trainer(cfg, data, feats, tconf, aux_ids, accelerator=acc, layout=layout)
    if trainer.acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out / "resolved_config.yaml")
    trainer.resume()
    cc_path = compile_cache_path(cfg.train.compile_cache, out)
    cc = {"loaded": load_compile_cache(cc_path)}  # before the first step compiles anything
    t0 = time.perf_counter()
    final = trainer.fit(progress=progress, stop_at=stop_at, stop_after_minutes=stop_after_minutes)
    if trainer.acc.is_main_process:  # every rank compiled the same code
        cc["saved"] = save_compile_cache(cc_path)
    if final is None:
        return {"stopped_at": trainer.step, "history": trainer.history, "predicted_peak": trainer.predicted_peak,
                "compile_cache": cc}
    trainer.save_drafter()
    metrics = {"method": cfg.train.method, "K": cfg.train.K, "steps": trainer.step,
               "train_seconds": time.perf_counter() - t0, "draft_vocab_size": int(trainer.draft_ids.numel()),
               "predicted_peak": trainer.predicted_peak, "final": final, "history": trainer.history,
               "compile_cache": cc}
    if trainer.acc.is_main_process:  # written last and atomically: its presence marks a finished run
        write_json_atomic(done, metrics)
    trainer.acc.wait_for_everyone()
    return metrics
