"""The learning curve of one training run that may span several launches (``--stop-after`` legs resumed
from a portable state, docs/resume.md), from its run folder.

    python benchmarks/run_curve.py RUN_DIR OUT.json [--K 7]

Reads ``RUN_DIR/logs/steps.jsonl`` (the trainer writes the whole history there, the restored steps of
earlier launches included; where that log did not come back, the ``history`` of a finished run's
``train_metrics.json``, which holds the same records) and ``RUN_DIR/logs/state_out.json`` (the last portable state written), and
writes one JSON:

* ``curve``: one row per in-training evaluation, and the end-of-run evaluation of a finished run
  (``train_metrics.json`` ``final``) as the last row: ``step``, ``gpu_minutes`` (the run's training wall
  time up to that step, summed over launches, in minutes: ``elapsed_s`` / 60; loading and saving are
  not counted), ``tokens_seen`` (target tokens trained up to and including that step, all ranks),
  ``eval_loss`` and, at ``--K``, ``walk_al`` (``eval_walk_al``: the reference loop's acceptance
  length replayed on the eval split), ``sim_al`` (``eval_sim_al``) and ``walk_al_heldout``
  (``eval_walk_al_heldout``: the same walk on the eval sequences of the eval stage's ``heldout`` prompts, the
  figure the decoding loop measured within 0.4 % in run 7 of docs/results.md; None where the log lacks it),
  ``walk_al_<set>`` for each set of ``train.eval_walk_sets`` (``eval_walk_al_sets``: the walk on the target's
  answers to that set's prompts, e.g. ``walk_al_humaneval``; only where the run logged them);
  ``acc1_copyable`` / ``acc1_fresh``
  (the first drafted position's accuracy on copyable / fresh labels; None in logs older than them) and
  ``acc_copyable`` / ``acc_fresh`` (the same at every depth, lists);
* ``loss``: ``[step, gpu_minutes, loss]`` every ``--every`` steps (default 10) and the last step;
* ``steps``, ``gpu_minutes``, ``tokens_seen`` of the run so far, and ``state``: the state_out record.

Raises SystemExit naming the file when the run folder has no step log.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def at_k(record: dict | None, k: int):
    """``record[str(k)]`` (JSON keys) or ``record[k]``; None when absent."""
    if not record:
        return None
    return record.get(str(k), record.get(k))


def minutes(record: dict) -> float:
    """A step record's ``elapsed_s`` (training seconds of the run up to it) in minutes, 4 decimals."""
    return round(float(record.get("elapsed_s", 0.0)) / 60, 4)


def run_curve(run_dir: Path, k: int = 7, every: int = 10) -> dict:
    """The curve of ``run_dir`` (see the module docstring). Raises FileNotFoundError without a step log
    and without a ``train_metrics.json`` that holds a ``history``."""
    log = run_dir / "logs" / "steps.jsonl"
    metrics = run_dir / "train_metrics.json"  # a finished run's (read once: history fallback and final eval)
    m = json.loads(metrics.read_text()) if metrics.is_file() else None
    if log.is_file():
        history = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    elif m is not None and "history" in m:
        history = m["history"]  # the same per-step records (Trainer.fit), e.g. an ablation variant's folder
    else:
        raise FileNotFoundError(2, "no step log", str(log))

    def row(h: dict, ev: dict, seen: int) -> dict:  # step record h, its evaluation ev
        return {"step": h["step"], "gpu_minutes": minutes(h), "tokens_seen": seen, "eval_loss": ev["eval_loss"],
                "walk_al": at_k(ev.get("eval_walk_al"), k), "sim_al": at_k(ev.get("eval_sim_al"), k),
                "walk_al_heldout": at_k(ev.get("eval_walk_al_heldout"), k),
                **{f"walk_al_{name}": at_k(al, k) for name, al in (ev.get("eval_walk_al_sets") or {}).items()},
                "acc1_copyable": ev.get("eval_acc1_copyable"), "acc1_fresh": ev.get("eval_acc1_fresh"),
                "acc_copyable": ev.get("eval_acc_copyable"), "acc_fresh": ev.get("eval_acc_fresh")}

    seen, curve, loss = 0, [], []
    for i, h in enumerate(history):
        seen += int(h.get("tokens", 0))
        if "eval_loss" in h:
            curve.append(row(h, h, seen))
        if h["step"] % every == 0 or i == len(history) - 1:
            loss.append([h["step"], minutes(h), h["loss"]])
    if m is not None and history:  # a finished run: its end-of-run evaluation is the curve's last row
        final = m.get("final") or {}
        if "eval_loss" in final and (not curve or curve[-1]["step"] != history[-1]["step"]):
            curve.append(row(history[-1], final, seen))
    state = run_dir / "logs" / "state_out.json"
    last = history[-1] if history else {}
    return {"run_dir": str(run_dir), "K": k, "steps": last.get("step", 0),
            "gpu_minutes": minutes(last), "tokens_seen": seen,
            "finished": m is not None,
            "state": json.loads(state.read_text()) if state.is_file() else None, "curve": curve, "loss": loss}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--K", type=int, default=7, help="the K whose acceptance lengths the curve holds (default 7)")
    p.add_argument("--every", type=int, default=10, help="loss every N steps (default 10)")
    a = p.parse_args(argv)
    try:
        res = run_curve(a.run_dir, a.K, a.every)
    except FileNotFoundError as e:
        sys.exit(f"run_curve: {e.filename}: no step log; give the output_dir of a run that trained")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1))
    print(f"{a.run_dir.name}: step {res['steps']}, {res['gpu_minutes']:.2f} GPU-minutes, {res['tokens_seen']:,} tokens, "
          f"last walk AL(K={a.K}) {res['curve'][-1]['walk_al'] if res['curve'] else None}")
    return res


if __name__ == "__main__":
    main()
