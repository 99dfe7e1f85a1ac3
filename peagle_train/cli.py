"""``peagle-train`` console script: one subcommand per pipeline stage, and ``run`` for all of them.

Usage::

    peagle-train run recipes/smollm2-135m.yaml [section.key=value ...] [--overwrite]
    peagle-train {prepare,cache,train,export,eval} RECIPE [overrides ...]
    peagle-train train RECIPE train.state_in=S0.pst train.state_out=S1.pst --stop-at 800   # docs/resume.md
    peagle-train train RECIPE train.state_in=S1.pst train.state_out=S2.pst --stop-after 25  # minutes
    peagle-train prepare RECIPE --regen-worker 0/2   # + 1/2 on another GPU, then a plain prepare
    peagle-train eval RECIPE --eval-worker 0/4       # + 1/4 .. 3/4 at the same time, then --eval-merge 4
    peagle-train check EXPORT_DIR [--target TARGET_DIR_OR_CONFIG] [--num-speculative-tokens K]
    peagle-train push EXPORT_DIR REPO_ID [--public] [--dry-run]

Exit status 2 with a one-paragraph message for invalid recipes and bad input;
tracebacks only for genuine bugs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

STAGES = ("prepare", "cache", "train", "export", "eval", "run")


def build_parser() -> argparse.ArgumentParser:
    """The ``peagle-train`` argument parser: stage subcommands plus ``check`` and ``push``."""
    p = argparse.ArgumentParser(prog="peagle-train", description="Train P-EAGLE drafters for vLLM.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in STAGES:
        s = sub.add_parser(name, help=f"run the {name} stage" if name != "run" else "run every stage")
        s.add_argument("recipe", help="YAML recipe, e.g. recipes/smollm2-135m.yaml")
        s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4")
        s.add_argument("--overwrite", action="store_true", help="replace a run already in output_dir")
        s.add_argument("--quiet", action="store_true", help="no progress bars")
        if name == "train":
            s.add_argument("--stop-at", metavar="STEP", type=int, default=None,
                           help="checkpoint (and write train.state_out) after optimizer step STEP and exit; the next "
                                "launch continues the run (a job under a time limit; docs/resume.md)")
            s.add_argument("--stop-after", metavar="MINUTES", type=float, default=None,
                           help="the same after the first optimizer step that ends MINUTES wall minutes after this "
                                "launch's first step began (loading before and saving after are not counted)")
        if name == "eval":
            s.add_argument("--eval-worker", metavar="RANK/WORLD", default=None,
                           help="decode only prompts i %% WORLD == RANK of each set and write their statistics to "
                                "eval/parts/ (run WORLD of them, e.g. at once on one GPU, then --eval-merge WORLD)")
            s.add_argument("--eval-claim", metavar="NAME", default=None,
                           help="with --eval-worker: take the next prompt no worker has taken (claim files in "
                                "eval/parts/claims-NAME/) instead of every WORLD-th, so faster workers decode more; "
                                "NAME is shared by the workers of one evaluation, a new one for each")
            s.add_argument("--eval-merge", metavar="WORLD", type=int, default=None,
                           help="no decoding: the report of the WORLD worker parts in eval/parts/")
            s.add_argument("--eval-partial", action="store_true",
                           help="with --eval-merge: when some workers stopped early, the report of the sets every "
                                "worker finished (eval.json's 'partial' names the others)")
        if name == "prepare":
            s.add_argument("--regen-worker", metavar="RANK/WORLD", default=None,
                           help="data-parallel regeneration: write only shards i %% WORLD == RANK, then exit "
                                "(run one per GPU, then a plain 'prepare' tokenises), e.g. 0/2 and 1/2")
    c = sub.add_parser("check", help="contract-check an export directory against vLLM's loader")
    c.add_argument("export_dir")
    c.add_argument("--target", default=None, metavar="TARGET",
                   help="also check against the target: a local Hugging Face model directory or its config.json "
                        "(only the config is read): aux layer ids, hidden size, vocab, bos/eos ids")
    c.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="the K it will be served with; refused above the trained K of a parallel-drafting export")
    h = sub.add_parser("push", help="upload an export to the Hugging Face Hub")
    h.add_argument("export_dir")
    h.add_argument("repo_id")
    h.add_argument("--public", action="store_true", help="create a public repo (default private)")
    h.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")
    return p


def _stage(args) -> object:
    from peagle_train import stages
    from peagle_train.core.config import ConfigError
    from peagle_train.recipe import load_config

    eval_worker = _eval_worker(args) if args.command == "eval" else None  # before anything loads
    cfg = load_config(args.recipe, args.overrides)
    progress = not args.quiet
    if args.quiet:  # also silence transformers' weight-loading bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    report = str(Path(cfg.output_dir) / "eval" / "eval.md")
    if args.command == "run":
        return {**stages.run_all(cfg, overwrite=args.overwrite, progress=progress), "report": report}
    stages.claim_output_dir(cfg, args.overwrite,
                            runtime_keys=stages.EVAL_RUNTIME_KEYS if args.command == "eval" else frozenset())
    if args.command == "prepare":
        worker = None
        if args.regen_worker is not None:
            worker = _rank_world("--regen-worker", args.regen_worker, "0/2")
        return stages.run_prepare(cfg, progress, regen_worker=worker)
    if args.command == "cache":
        return str(stages.run_cache(cfg, progress))
    if args.command == "train":
        if args.stop_after is not None and not args.stop_after > 0:
            raise ConfigError(f"--stop-after {args.stop_after}: give the minutes of this launch, a number > 0")
        m = stages.run_train(cfg, progress, stop_at=args.stop_at,  # the trainer with the stage's start/end lines
                             stop_after_minutes=args.stop_after)
        return {k: v for k, v in m.items() if k != "history"}
    if args.command == "export":
        return str(stages.run_export(cfg, progress))
    if eval_worker is not None:
        return stages.run_eval(cfg, progress, worker=eval_worker, claim=args.eval_claim)
    return {**stages.run_eval(cfg, progress, merge=args.eval_merge, partial=args.eval_partial), "report": report}


def _rank_world(flag: str, value: str, example: str) -> tuple[int, int]:
    """A worker flag's ``RANK/WORLD`` value as two ints (ranges are checked by the caller).

    Raises:
        ConfigError: not two integers separated by ``/``, naming ``flag`` and an ``example``.
    """
    from peagle_train.core.config import ConfigError

    try:
        rank, world = (int(x) for x in value.split("/"))
    except ValueError:
        raise ConfigError(f"{flag} {value!r}: expected RANK/WORLD, e.g. {example}") from None
    return rank, world


def _eval_worker(args) -> tuple[int, int] | None:
    """``--eval-worker RANK/WORLD`` as ``(rank, world)`` (None without it), checked with ``--eval-merge``.

    Raises:
        ConfigError: not ``RANK/WORLD`` with ``0 <= RANK < WORLD``; given with ``--eval-merge``; ``--eval-merge`` < 1;
            ``--eval-partial`` without ``--eval-merge``; ``--eval-claim`` without ``--eval-worker`` or not one plain
            word.
    """
    from peagle_train.core.config import ConfigError, check_claim_name

    if args.eval_merge is not None and args.eval_merge < 1:
        raise ConfigError(f"--eval-merge {args.eval_merge}: give the number of workers (>= 1)")
    if args.eval_partial and args.eval_merge is None:
        raise ConfigError("--eval-partial goes with --eval-merge WORLD (it reports the sets every worker finished)")
    if args.eval_worker is None:
        if getattr(args, "eval_claim", None) is not None:
            raise ConfigError("--eval-claim goes with --eval-worker RANK/WORLD (the workers share the claim name)")
        return None
    if getattr(args, "eval_claim", None) is not None:
        check_claim_name(args.eval_claim, "--eval-claim")
    if args.eval_merge is not None:
        raise ConfigError("give --eval-worker (decode a share) or --eval-merge (report the shares), not both")
    rank, world = _rank_world("--eval-worker", args.eval_worker, "0/4")
    if not 0 <= rank < world:
        raise ConfigError(f"--eval-worker {rank}/{world}: need 0 <= rank < world (e.g. 0/4 .. 3/4)")
    return rank, world


ALLOC_CONF_DEFAULT = "expandable_segments:True"


def default_allocator_conf(environ=None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the user set the CUDA caching
    allocator's configuration (``PYTORCH_CUDA_ALLOC_CONF`` or its newer name ``PYTORCH_ALLOC_CONF``).

    Why: grid lengths change from step to step (COD sampling, packing, S partitions); expandable
    segments let the allocator grow one mapping instead of leaving fragments between differently
    sized blocks. The N = 65,536 GPT-OSS-20B-shaped step in one partition (112.9 GiB of an H200's
    139.8, ``docs/benchmarks.md``, 2026-11-30) was measured with it. It takes effect only
    before the first CUDA allocation, which is why the console script sets it first.

    Args:
        environ: the environment mapping (default ``os.environ``).

    Returns:
        True when it set the variable, False when the user's setting was kept.
    """
    env = os.environ if environ is None else environ
    if "PYTORCH_CUDA_ALLOC_CONF" in env or "PYTORCH_ALLOC_CONF" in env:
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF_DEFAULT
    return True


def main(argv: list[str] | None = None) -> int:
    """Console entry point. Returns 0 on success, 1 when ``check`` finds problems, 2 on bad input."""
    args = build_parser().parse_args(argv)
    if args.command in STAGES:
        default_allocator_conf()  # before anything allocates on a GPU
    from data_prep.sources import DataError
    from peagle_train.core.config import ConfigError
    from peagle_train.core.errors import SkippedStepsError
    from peagle_train.features.cache import CacheError
    from peagle_train.features.target import TargetLoadError

    try:
        if args.command in STAGES:
            result = _stage(args)
            from peagle_train.distributed.accelerator import end_process_group

            end_process_group()  # every rank got here: tear the process group down before exit
        elif args.command == "check":
            from peagle_train.export.check import check_export

            problems = check_export(args.export_dir, target=args.target,
                                    num_speculative_tokens=args.num_speculative_tokens)
            for pr in problems:
                print(f"FAIL {pr}")
            print("OK: export matches the vLLM contract" if not problems else f"{len(problems)} problem(s)")
            return 1 if problems else 0
        else:
            from peagle_train.export.check import ExportCheckError
            from peagle_train.export.hub import HubPushError, push_to_hub

            try:
                result = push_to_hub(args.export_dir, args.repo_id, private=not args.public, dry_run=args.dry_run)
            except ExportCheckError as e:  # what `check` reports: the problems, exit 1
                print(f"peagle-train: push refused: {e}", file=sys.stderr)
                return 1
            except HubPushError as e:  # no token, bad repo id, Hub refusal: the message never holds the token
                print(f"peagle-train: error: {e}", file=sys.stderr)
                return 2
    except (ConfigError, FileNotFoundError, TargetLoadError, CacheError, DataError, SkippedStepsError) as e:  # names file/row/key + fix
        print(f"peagle-train: error: {e}", file=sys.stderr)
        return 2
    if isinstance(result, dict) and "datasets" in result:  # eval / run: a short acceptance table
        print(f"lossless (greedy == target alone): {result['lossless']['passed']} "
              f"({result['lossless']['checked']} outputs checked)")
        for name, ds in result["datasets"].items():
            print(f"{name}: " + "  ".join(f"K={r['K']} AL={r['acceptance_length']:.2f}" for r in ds["by_K"]))
        print(f"full report: {result['report']}")
    elif result is not None and args.command != "push":  # push printed its own file list
        print(json.dumps(result, indent=1, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
