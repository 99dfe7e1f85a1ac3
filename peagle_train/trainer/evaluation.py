"""In-training evaluation: loss, per-depth metrics and the loop-equivalent simulated acceptance length
on the eval split (no COD drop), as the trainer logs every ``train.eval_every`` steps and at the end.

:class:`InTrainingEval` is mixed into :class:`~peagle_train.trainer.trainer.Trainer`; it reads the
trainer's model, accelerator, eval split and features, and asks the draft method for the eval grid
and the acceptance walk.
"""
from __future__ import annotations

import math
import time

import torch

from data_prep.loops import copyable_flags
from peagle_train.features.packing import pack, pack_tokens
from peagle_train.features.tokenized import first_supervised, heldout_rows
from peagle_train.peagle.grid import supervised_count
from peagle_train.peagle.metrics import DepthStats
from peagle_train.peagle.spec_stats import chain_matrix


class InTrainingEval:
    """The trainer's evaluation (mixed into :class:`~peagle_train.trainer.trainer.Trainer`)."""

    def eval_items(self) -> list[int]:
        """Eval-split sequences used in evaluation: the first ``eval_sequences`` with a supervised element."""
        if self._eval_items is None:
            items = []
            for i in range(len(self.eval_ids)):
                if len(items) == self.tc.eval_sequences:
                    break
                if supervised_count(self._eval_grid(i)) > 0:
                    items.append(i)
            self._eval_items = items
        return self._eval_items

    def _eval_grid(self, i: int, device=None):
        """Eval sequence ``i``'s grid with every chain kept to depth K - 1 (the method's eval grid)."""
        return self._grid_of(self.eval_ids[i], self.eval_masks[i], device)

    def _grid_of(self, ids, mask, device=None):
        """The method's eval grid (every chain kept to depth K - 1) of one sequence: ``ids`` token ids and
        ``mask`` its loss mask (equal-length lists or 1-D tensors)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        tokens = {"input_ids": ids, "loss_mask": torch.as_tensor(mask, dtype=torch.bool, device=device),
                  "doc_ids": torch.zeros_like(ids)}
        return self.method.build_grid(tokens, self.cfg, train=False)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Loss and per-depth metrics on the eval split (no COD drop: r = r_min = 1 for all depths).

        Every rank runs the same number of forwards (the last round is padded with a repeated,
        uncounted sequence), as FSDP2 / ZeRO-3 gather weights in every forward.
        """
        self.model.eval()
        items = self.eval_items()
        world, rank = self.acc.num_processes, self.acc.process_index
        stats, loss_sum, count = DepthStats.zeros(self.tc.K, self.device), 0.0, 0.0
        # loop-equivalent simulated AL: [all eval sequences / the eval stage's heldout subset][tokens, rounds][served K]
        walk = torch.zeros(2, 2, self.tc.K, dtype=torch.float64)
        # by depth: [right, all] on copyable labels, then on fresh ones
        copy = torch.zeros(4, self.tc.K, dtype=torch.float64)
        for r in range(math.ceil(len(items) / world)):
            j = r * world + rank
            counted = j < len(items)
            i = items[j % len(items)]
            packed, grid, loss, pred = self._predict(self.eval_features, i, self.eval_ids[i], self.eval_masks[i])
            if counted:
                loss_sum += float(loss)
                count += supervised_count(grid)
                stats = stats.add(self._stats(packed, grid, pred))
                right = self._right(packed, grid, pred)  # once per sequence: the walk and the copy split read it
                walk += self._walk(grid, right, i, matched=self._heldout_rank(i) < self.cfg.eval.num_prompts)
                copy += self._depth_by_copyable(grid, right, i, self.tc.K)
        tot = self.acc.reduce(torch.tensor([loss_sum, count], dtype=torch.float64, device=self.device), "sum")
        st = DepthStats.from_stacked(self.acc.reduce(stats.stacked(), reduction="sum"))
        walk = self.acc.reduce(walk.to(self.device), reduction="sum").cpu()
        copy = self.acc.reduce(copy.to(self.device), reduction="sum").cpu()
        made = self._walk_refs is None  # this launch's first evaluation makes the sets' answers (timed, logged)
        t0 = time.perf_counter()
        sets = {name: _al_by_k(w, self.tc.K) for name, w in self._walk_sets().items()}
        sets_s = time.perf_counter() - t0
        self.model.train()
        al = lambda w: _al_by_k(w, self.tc.K)  # noqa: E731
        ratio = lambda a, b: float(a / b) if b > 0 else float("nan")  # noqa: E731
        return {**({"eval_walk_al_sets": sets, "eval_walk_sets_s": sets_s} if sets else {}),
                **({"eval_walk_sets_answers_s": self._walk_refs_s} if sets and made else {}),
                "eval_loss": float(tot[0] / max(tot[1], 1.0)), "eval_acc": st.accuracy(),
                "eval_cond_acc": st.conditional_accuracy(),
                "eval_sim_al": {k: st.simulated_acceptance_length(k) for k in range(1, self.tc.K + 1)},
                "eval_walk_al": al(walk[0]), "eval_walk_al_heldout": al(walk[1]),
                "eval_acc1_copyable": ratio(copy[0, 0], copy[1, 0]), "eval_acc1_fresh": ratio(copy[2, 0], copy[3, 0]),
                "eval_copyable_share": ratio(copy[1, 0], copy[1, 0] + copy[3, 0]),
                "eval_acc_copyable": [ratio(a, b) for a, b in zip(copy[0], copy[1])],
                "eval_acc_fresh": [ratio(a, b) for a, b in zip(copy[2], copy[3])]}

    def _predict(self, features, i: int, ids, mask):
        """One sequence through the drafter on its eval grid (no COD drop): ``(packed, grid, loss, pred)``, with
        ``features.get([i])`` its target features, ``ids`` / ``mask`` its tokens and loss mask."""
        packed = pack(features.get([i]), pack_tokens([ids], [mask]), self.device)
        grid = self._grid_of(ids, mask, self.device)
        with self.acc.autocast():
            loss, pred = self._forward(packed, grid, 1.0)
        return packed, grid, loss, pred

    def _walk_sets(self) -> dict[str, torch.Tensor]:
        """``{set: [2, K]}`` float64 (tokens, rounds) per served K of the walk on the target's own answers to each
        set of ``train.eval_walk_sets`` (:mod:`peagle_train.trainer.walk_sets`, made once per launch on first use,
        their seconds in ``self._walk_refs_s``; :meth:`evaluate` logs them as ``eval_walk_sets_answers_s`` and the
        walk's seconds as ``eval_walk_sets_s``: both count in the run's time as every evaluation does),
        each answer walked to ``eval.max_new_tokens`` as the decoding loop measures it; summed over ranks (each
        rank runs the same number of forwards, as :meth:`evaluate`). ``{}`` without sets."""
        if not self.tc.eval_walk_sets:
            return {}
        if self._walk_refs is None:
            from peagle_train.features.online import OnlineFeatures
            from peagle_train.trainer.walk_sets import reference_sequences

            target = getattr(self.eval_features, "target", None)
            if target is None or getattr(target, "tokenizer", None) is None:
                raise RuntimeError("train.eval_walk_sets needs the online target with its tokenizer "
                                   "(train.features: online; run_train loads it so)")
            ev = self.cfg.eval
            t0 = time.perf_counter()
            refs = reference_sequences(target, list(self.tc.eval_walk_sets), ev.num_prompts, ev.max_new_tokens,
                                       ev.both_turns, extra_tokens=self.tc.K + 1)
            self._walk_refs = {}
            for name, seqs in refs.items():
                ids = [p + a for p, a in seqs]
                masks = [[0] * len(p) + [1] * len(a) for p, a in seqs]
                self._walk_refs[name] = (ids, masks, OnlineFeatures(target, ids, self.eval_features.batch_tokens))
            self._walk_refs_s = time.perf_counter() - t0
        world, rank = self.acc.num_processes, self.acc.process_index
        out = {}
        for name, (ids, masks, feats) in self._walk_refs.items():
            walk = torch.zeros(2, self.tc.K, dtype=torch.float64)
            for r in range(math.ceil(len(ids) / world)):
                j = r * world + rank
                i = j % len(ids)
                packed, grid, _, pred = self._predict(feats, i, ids[i], masks[i])
                if j < len(ids):
                    right = self._right(packed, grid, pred)
                    walk += self._walk_counts(self._chains(grid, right, len(ids[i])), masks[i],
                                              self.cfg.eval.max_new_tokens)
            out[name] = self.acc.reduce(walk.to(self.device), reduction="sum").cpu()
        return out

    def _chains(self, grid, correct: torch.Tensor, n: int):
        """``(ok, sup)`` of :func:`~peagle_train.peagle.spec_stats.chain_matrix` for one sequence of ``n`` tokens
        from its grid and ``correct`` (``[E]`` bool per grid element, :meth:`_right`)."""
        return chain_matrix(grid.anchor, grid.depth, correct, grid.loss_weight > 0, n, self.tc.K)

    def _walk_counts(self, chains, mask, horizon: int | None) -> torch.Tensor:
        """``[2, K]`` float64: accepted tokens (drafts + 1 a round) and rounds per served K of
        :func:`~peagle_train.peagle.spec_stats.walk_accepted` over the first assistant turn of one sequence with
        loss mask ``mask`` and chains ``chains`` (:meth:`_chains`), to ``horizon`` new tokens (None: the whole
        turn); zeros when the sequence has no prompt."""
        out = torch.zeros(2, self.tc.K, dtype=torch.float64)
        first = first_supervised(mask) or 0
        if first < 1:
            return out
        ok_t, sup_t = chains
        for k in range(1, self.tc.K + 1):
            acc = self.method.accepted_walk(ok_t, sup_t, first, k, horizon)
            out[0, k - 1] += sum(a + 1 for a in acc)
            out[1, k - 1] += len(acc)
        return out

    def _right(self, packed, grid, pred) -> torch.Tensor:
        """``[E]`` bool: the element's draft equals the target's greedy token and that token is in the draft vocab
        (a target token outside it is a rejected draft, as in the decoding loop, not the end of the turn)."""
        drafter = self.acc.unwrap_model(self.model).drafter
        tgt = packed["argmax"][grid.label_index]
        return (drafter.draft_to_target(pred) == tgt) & drafter.t2d[tgt]

    def _copyable(self, i: int) -> torch.Tensor:
        """``[n]`` bool: eval sequence ``i``'s supervised tokens a lookup in the sequence before them predicts
        (:func:`data_prep.loops.copyable_flags`, n = 4: the 4 tokens before occurred earlier, followed by this token);
        False elsewhere. Cached per sequence."""
        if i not in self._copyable_cache:
            ids, mask = list(self.eval_ids[i]), [int(m) for m in self.eval_masks[i]]
            flags = torch.zeros(len(ids), dtype=torch.bool)
            sup = [p for p, m in enumerate(mask) if m]
            flags[sup] = torch.tensor([c for _, c in copyable_flags(ids, mask)], dtype=torch.bool)
            self._copyable_cache[i] = flags
        return self._copyable_cache[i]

    def _depth_by_copyable(self, grid, right: torch.Tensor, i: int, K: int) -> torch.Tensor:
        """``[4, K]`` float64: at each drafted position (column d - 1 for depth d), the supervised elements whose
        label is right (``right``: ``[E]`` bool, :meth:`_right`) and all of them, first where the label token is
        copyable (:meth:`_copyable`), then where it is fresh (rows: right copyable, all copyable, right fresh, all
        fresh). Not conditional on the shallower
        depths: in a loop every depth's label is copyable, and a drafter that copies gets them all.

        The label of an element is the token at ``label_index + 1`` (``label_index`` is the row of the target's
        distribution that predicts it, spec §2). Why it is asked (issue 20, docs/results.md, run 4): the decoding loop
        accepted the first draft on 46 % of MT-Bench's copyable rounds, where a lookup drafter is right by
        construction, so whether the drafter learns to copy from its context, at the first and at deeper positions,
        is tracked over training."""
        right = right.cpu()
        sup = (grid.loss_weight > 0).cpu()
        depth = grid.depth.cpu()
        cp = self._copyable(i)[(grid.label_index.cpu() + 1).clamp(max=len(self.eval_ids[i]) - 1)]
        out = torch.zeros(4, K, dtype=torch.float64)
        for j, sel in enumerate((sup & cp, sup & ~cp)):
            out[2 * j].index_add_(0, depth[sel], right[sel].to(torch.float64))
            out[2 * j + 1].index_add_(0, depth[sel], torch.ones(int(sel.sum()), dtype=torch.float64))
        return out

    def _heldout_rank(self, i: int) -> int:
        """Position of eval sequence ``i`` in ``data/eval_prompts.json`` (the eval stage's ``heldout``
        order, :func:`~peagle_train.features.tokenized.heldout_rows`); a huge number for a sequence not listed."""
        if self._ranks is None:
            self._ranks = {row: rank for rank, row in enumerate(heldout_rows(self.eval_masks))}
        return self._ranks.get(i, 1 << 62)

    def _walk(self, grid, correct: torch.Tensor, i: int, matched: bool) -> torch.Tensor:
        """``[2, 2, K]`` float64 (tokens, rounds) per served K of :func:`walk_accepted` on eval sequence
        ``i``'s first assistant turn, from ``correct`` (``[E]`` bool per grid element, :meth:`_right`): row 0
        the whole turn, row 1 (only when ``matched``: one of the first ``eval.num_prompts`` sequences, as the
        eval stage's ``heldout`` set) its first ``eval.max_new_tokens`` tokens, the decoding loop's horizon."""
        mask, chains = self.eval_masks[i], self._chains(grid, correct, len(self.eval_ids[i]))  # once for both rows
        out = torch.zeros(2, 2, self.tc.K, dtype=torch.float64)
        out[0] = self._walk_counts(chains, mask, None)
        if matched:
            out[1] = self._walk_counts(chains, mask, self.cfg.eval.max_new_tokens)
        return out


def _al_by_k(w: torch.Tensor, K: int) -> dict[int, float]:
    """``{k: tokens / rounds}`` for k = 1..K from ``w`` ``[2, K]`` (row 0 tokens, row 1 rounds); NaN without rounds."""
    return {k: float(w[0, k - 1] / w[1, k - 1]) if w[1, k - 1] > 0 else float("nan") for k in range(1, K + 1)}
