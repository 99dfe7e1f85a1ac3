"""The pipeline stages, each a function of the validated config: prepare → cache → train → export → eval.

Every stage writes under ``cfg.output_dir`` and can be re-run: finished work is
kept (prepared data is reused, the feature cache resumes at the first missing
shard, training resumes from the newest complete checkpoint). An output folder
that already holds a run of a *different* recipe is refused before any work.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import shutil
import time
from contextvars import ContextVar
from pathlib import Path

import yaml

from peagle_train.core.atomic import write_json_atomic, write_text_atomic
from peagle_train.core.config import ConfigError
from peagle_train.features.tokenized import first_supervised, heldout_rows, save_tokenized
from peagle_train.recipe import RunConfig, dump_config, validate_against_target, validate_mask_token_absent

_IDENTITY_SECTIONS = ("target", "data", "regen", "drafter", "train")
_PREPARED = ("data", "features")  # made from the target/data/regen sections only
_TRAINED = ("drafter", "checkpoints", "export", "eval", "train_metrics.json")  # also from drafter/train
# keys that change logging/bookkeeping or the time budget, not what is computed: a run may continue with new values
_NON_IDENTITY_KEYS = {"train.report_to", "train.log_every", "train.eval_every", "train.save_every",
                      "train.keep_last", "train.eval_sequences", "train.eval_walk_sets", "train.max_minutes",
                      "train.profile_steps", "train.profile_start",  # what is recorded, not what is trained
                      "train.gc_every",  # when Python's garbage collector runs
                      # which kernel computes the target's attention, not what it computes: kernels that agree
                      # (benchmarks/real_shape_experiment.sh attn-check) may change between stages, e.g. the
                      # regeneration on the default one and the feature forwards on flex_attention (docs/real_shapes.md)
                      "target.attn_implementation", "target.feature_attn_implementation",
                      "regen.decode_kernel",  # the same for regeneration's decoding attention (tests: token-identical)
                      # how many shards one engine run answers: a resumed prepare regroups the shards left anyway
                      # (greedy answers equal in exact arithmetic, test; on a GPU bf16 near-ties may differ, as
                      # between any two batch compositions)
                      "regen.shards_per_call",
                      # whether the segmented engine copies a continuing row's KV cache instead of prefilling it
                      # again, and how much history it copies: the same greedy tokens (tests/unit/test_kv_carry.py:
                      # in float64 every built cache row equals a forward over that row alone; token-identical to
                      # generate), so a half-done prepare resumes with either
                      "regen.keep_kv", "regen.keep_kv_frames",
                      # where a launch reads and writes its portable state (docs/resume.md): each launch names its own
                      "train.state_in", "train.state_out", "train.state_moments", "train.state_part_mib",
                      "train.compile_cache",  # where torch.compile's compiled code is kept between launches
                      "train.prefix_kernel_options",  # FlexAttention's block sizes for a GPU: how, not what
                      "train.prefix_compiled_apart"}  # where the prefix kernel is compiled: how, not what
#: how eval runs the target, not what was prepared or trained: eval may change them in a finished run's folder
#: (a random-weight target's near-tie logits need float32 for the lossless check, docs/real_shapes.md; a user
#: evaluates a drafter trained on bf16 features against the target as served), and leaves the folder's stamp
EVAL_RUNTIME_KEYS = frozenset({"target.dtype", "target.device"})
#: the running stage's end line when it did no work (set by :func:`_reused`), None outside a stage
_OUTCOME: ContextVar[list[str] | None] = ContextVar("stage_outcome", default=None)
#: fields the running stage adds to its ``logs/stages.jsonl`` record (:func:`_stage_fields`), None outside a stage
_FIELDS: ContextVar[dict | None] = ContextVar("stage_fields", default=None)


def _reused(why: str, verb: str = "reused") -> None:
    """Called inside a stage: its end line reads ``<stage>: <verb> (<why>)`` instead of ``done in X s``."""
    note = _OUTCOME.get()
    if note is not None:
        note[:] = [f"{verb} ({why})"]


def _stage_fields(**fields) -> None:
    """Called inside a stage: ``fields`` join its record in ``logs/stages.jsonl`` (:func:`stage_lines`)."""
    extra = _FIELDS.get()
    if extra is not None:
        extra.update(fields)


def stage_lines(name: str):
    """Decorator of a stage function: one line when it starts and one when it ends.

    ``<name>: started`` before the call; after it ``<name>: done in 12.3 s`` or, when the stage
    called :func:`_reused` (its work was already there), ``<name>: reused (why)``. A stage that
    raises prints no end line. Lines go to stdout, only when the call's ``progress`` argument is
    true (``--quiet`` silences them) and only on the main process of a distributed launch
    (``RANK`` unset or 0), so every stage of ``peagle-train run`` is announced once.

    Every finished stage also appends one record to ``<output_dir>/logs/stages.jsonl`` (main process,
    quiet or not): ``{"stage", "seconds", "reused", "peak_gpu_bytes", "at"}`` -- the wall time and, on
    CUDA, the peak memory torch allocated on this process's GPU during the stage (reset at its start;
    None without CUDA), so a run's per-stage time and memory table reads from one file -- plus what the
    stage adds (:func:`_stage_fields`; the train stage: the memory planner's ``predicted_peak_bytes``
    and ``predicted_peak_for``, see :func:`run_train`).
    """
    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            show = bool(bound.arguments.get("progress", True)) and int(os.environ.get("RANK", "0")) == 0
            if show:
                print(f"{name}: started", flush=True)
            note: list[str] = []
            fields: dict = {}
            token, fields_token = _OUTCOME.set(note), _FIELDS.set(fields)
            import torch

            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                _OUTCOME.reset(token)
                _FIELDS.reset(fields_token)
            seconds = time.perf_counter() - t0
            if show:
                print(f"{name}: {note[0] if note else f'done in {seconds:.1f} s'}", flush=True)
            _record_stage(bound.arguments.get("cfg"), name, seconds, bool(note),
                          int(torch.cuda.max_memory_allocated()) if cuda else None, fields)
            return result
        return run
    return wrap


def _record_stage(cfg, name: str, seconds: float, reused: bool, peak: int | None, fields: dict | None = None) -> None:
    """Append the stage's record to ``<cfg.output_dir>/logs/stages.jsonl`` (main process only; see
    :func:`stage_lines`); ``peak``: bytes torch allocated on the GPU at most during the stage, None
    without CUDA; ``fields``: what the stage added (:func:`_stage_fields`). Without an ``output_dir``
    nothing is written."""
    out = getattr(cfg, "output_dir", None)
    if out is None or int(os.environ.get("RANK", "0")) != 0:
        return
    logs = Path(out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rec = {"stage": name, "seconds": round(seconds, 3), "reused": reused, "peak_gpu_bytes": peak,
           **(fields or {}), "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(logs / "stages.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")


def stamp_differences(cfg: RunConfig, stamp: dict) -> list[str]:
    """The identity keys (``"section.key"``) in which ``cfg`` differs from a folder's stamp.

    ``stamp`` is a loaded ``run_config.yaml`` (``RunConfig.model_dump(mode="json")`` of the recipe
    that made the folder). Only :data:`_IDENTITY_SECTIONS` count, minus :data:`_NON_IDENTITY_KEYS`.
    A key the stamp lacks (added to the recipe schema after the folder was stamped, e.g.
    ``data.fold_system_into_user``) counts as equal when the recipe leaves it at its default (the
    behaviour the folder was made with); set to another value it is a difference.

    Returns:
        Sorted list of differing keys (empty: the same recipe).
    """
    from pydantic_core import to_jsonable_python

    mine = cfg.model_dump(mode="json")
    diffs = []
    for s in _IDENTITY_SECTIONS:
        ours, theirs = mine.get(s, {}), stamp.get(s) or {}
        fields = type(getattr(cfg, s)).model_fields
        for k in set(ours) | set(theirs):
            if f"{s}.{k}" in _NON_IDENTITY_KEYS:
                continue
            if k not in theirs and k in fields:  # a key newer than the stamp: equal at its default
                default = to_jsonable_python(fields[k].get_default(call_default_factory=True))
                if ours.get(k) == default:
                    continue
            if ours.get(k) != theirs.get(k):
                diffs.append(f"{s}.{k}")
    return sorted(diffs)


def claim_output_dir(cfg: RunConfig, overwrite: bool = False, runtime_keys: frozenset[str] = frozenset()) -> Path:
    """Create ``output_dir`` or check it holds a run of the same recipe.

    ``runtime_keys`` (eval: :data:`EVAL_RUNTIME_KEYS`) may differ from the stamp without counting as a
    change, and the stamp is then left as it is.

    The folder is stamped with ``run_config.yaml``. The stamp is replaced by a recipe that
    differs only where nothing made yet depends on it, so a command corrected after failing on
    bad input can run in the same folder: with no work beside the stamp, any change; with only
    prepared data (``data/``, ``features/``), changes to the ``drafter`` and ``train`` sections
    except ``drafter.mask_token_id`` once the data is tokenised (``data/meta.json``: prepare checked
    that token's absence from it).
    Once training output exists (``drafter/``, ``checkpoints/``, ``export/``, ``eval/``,
    ``train_metrics.json``) every identity change is refused. A key newer than the stamp is no
    change while the recipe leaves it at its default (:func:`stamp_differences`).

    Raises:
        ConfigError: the folder holds a run whose target/data/regen/drafter/train
            sections differ (lists the differing keys); nothing is deleted.
    """
    out = Path(cfg.output_dir)
    stamp = out / "run_config.yaml"
    if stamp.exists() and not overwrite:
        diffs = [d for d in stamp_differences(cfg, yaml.safe_load(stamp.read_text()) or {}) if d not in runtime_keys]
        if not diffs:
            return out
        trained = any((out / w).exists() for w in _TRAINED)
        prepared = any((out / w).exists() for w in _PREPARED)
        # what exists was made from sections that did not change: the folder can take the new recipe
        # the mask token is checked against the data when it is tokenised: finished data needs the same one
        tokenised = (out / "data" / "meta.json").exists()
        if trained or (prepared and not {d.split(".")[0] for d in diffs} <= {"drafter", "train"}) \
                or (tokenised and "drafter.mask_token_id" in diffs):
            raise ConfigError(
                f"output_dir '{out}' already holds a run of a different recipe (differs in: {', '.join(sorted(diffs))}); "
                "choose another output_dir (e.g. output_dir=checkpoints/new-run) or pass --overwrite to replace it")
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, stamp)
        return out
    if overwrite and out.exists():
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, stamp)
    return out


@stage_lines("prepare")
def run_prepare(cfg: RunConfig, progress: bool = True, regen_worker: tuple[int, int] | None = None) -> dict:
    """Load prompts, regenerate responses with the target, tokenise with assistant-only masks.

    Writes ``<output_dir>/data/{train,eval}.safetensors`` (:mod:`peagle_train.features.tokenized`),
    ``data/eval_prompts.json`` (the eval split's prompt token ids, for the ``heldout`` eval set)
    and ``data/meta.json``. Skipped when the data already exists.

    Args:
        regen_worker: ``(rank, world)``: data-parallel regeneration. This process only writes the
            regeneration shards ``i`` with ``i % world == rank`` (``<output_dir>/data/regen``;
            every worker derives the same shard list from the recipe) and returns without
            tokenising. Run one worker per GPU (``CUDA_VISIBLE_DEVICES``) or per node on a shared
            file system, then a plain ``prepare``, which regenerates any missing shard and
            tokenises. None: one process does everything.

    Returns:
        ``meta.json``'s content; with ``regen_worker``, ``{"regen_worker": [rank, world], "shards": {...}}``.

    Conversations repeated in the source are dropped before the train/eval split (the first
    kept; counted as ``meta.json`` ``source.duplicates_removed``), so no conversation is in both.
    With ``data.decontaminate`` (default), so is every conversation whose user turns overlap a prompt
    of an evaluation set in ``eval.datasets`` (:mod:`data_prep.decontaminate`; ``source.eval_overlap``).
    ``data.mix`` entries follow the main source in both splits (:func:`data_prep.sources.load_mixture`;
    ``source.mix`` in ``meta.json``), so adding one leaves the regeneration shards made before it valid.

    Raises:
        ConfigError: a recipe the target cannot run (drafter shape, vocab, layers:
            :func:`~peagle_train.recipe.validate_against_target`, from the target's config before
            any weight, data or tokenizer is loaded and before anything is written); mask token
            present in the data; ``regen_worker`` out of range or given with ``regen.enabled: false``.
        DataError: unusable data (from :mod:`data_prep.sources`), or the target's chat template fails
            on a conversation (:class:`~data_prep.template.TemplateError`: not prefix-stable, content
            not rendered verbatim, does not compile, raises; prefixed with the split and conversation
            index, naming the template, the message and the fix). Regenerated shards already written
            stay on disk for the next run.
    """
    from data_prep.decontaminate import eval_overlap_screen
    from data_prep.loops import unsupervise_loop_tails
    from data_prep.sources import load_mixture
    from data_prep.template import TemplateError, tokenize_conversation
    from peagle_train.features.target import load_target, load_target_config

    out = Path(cfg.output_dir) / "data"
    if regen_worker is not None:
        rank, world = regen_worker
        if not (world >= 1 and 0 <= rank < world):
            raise ConfigError(f"--regen-worker {rank}/{world}: need 0 <= rank < world (e.g. 0/2 and 1/2)")
        if not cfg.regen.enabled:
            raise ConfigError(f"{cfg.source_file}: --regen-worker needs regen.enabled: true (nothing to regenerate)")
    # the target's config alone, before weights, data or tokenizer; also when the data is reused, since
    # the drafter section may have changed since (claim_output_dir allows it) and train is next
    validate_against_target(cfg, load_target_config(cfg.target)[1])
    if (out / "meta.json").exists():
        _reused("data/meta.json exists")
        return json.loads((out / "meta.json").read_text())
    target = load_target(cfg.target)
    t0 = time.perf_counter()
    screen = eval_overlap_screen(cfg.eval.datasets) if cfg.data.decontaminate else None
    train_c, eval_c, src_report = load_mixture(cfg.data, screen)
    meta: dict = {"source": src_report, "target": cfg.target.name, "splits": {}}
    out.mkdir(parents=True, exist_ok=True)
    if regen_worker is not None:
        done = {name: _regenerate_sharded(target, split, cfg, out / "regen", name, progress, regen_worker)
                for name, split in (("train", train_c), ("eval", eval_c)) if split}
        return {"regen_worker": list(regen_worker), "shards": done}
    for name, split in (("train", train_c), ("eval", eval_c)):
        if not split:
            continue
        regen_report = None
        if cfg.regen.enabled:
            split, regen_report = _regenerate_sharded(target, split, cfg, out / "regen", name, progress)
        rows, dropped, reasoning_counts = [], 0, {}
        # data.loop_tail: the train split only, so that variants are evaluated on the same eval split
        loops = ({"sequences": 0, "tokens_unsupervised": 0, "tokens_removed": 0}
                 if cfg.data.loop_tail != "keep" and name == "train" else None)
        for k, conv in enumerate(split):
            try:
                r = tokenize_conversation(target.tokenizer, conv, cfg.data.max_length, cfg.data.overlong,
                                          supervise_reasoning=cfg.data.supervise_reasoning, report=reasoning_counts)
            except TemplateError as e:  # say which conversation, as the data files do (exit 2)
                raise type(e)(f"{name} split, conversation {k}: {e}") from None
            if r is not None and loops is not None:  # data.loop_tail: unsupervise
                ids, mask, n_off = unsupervise_loop_tails(r["input_ids"], r["loss_mask"])
                if n_off:
                    loops["sequences"] += 1
                    loops["tokens_unsupervised"] += n_off
                    loops["tokens_removed"] += len(r["input_ids"]) - len(ids)
                r = {**r, "input_ids": ids, "loss_mask": mask}
            if r is None or sum(r["loss_mask"]) == 0:
                dropped += 1
                continue
            rows.append(r)
        hits = sum(1 for r in rows if cfg.drafter.mask_token_id in r["input_ids"])
        validate_mask_token_absent(cfg, hits > 0, f"{hits} {name} sequences")
        if name == "train" and not rows:
            raise ConfigError(f"{cfg.source_file}: no training sequence survived tokenisation "
                              f"(data.max_length={cfg.data.max_length}, data.overlong={cfg.data.overlong})")
        save_tokenized(rows, out / f"{name}.safetensors")
        if name == "eval":
            write_json_atomic(out / "eval_prompts.json", eval_prompt_ids(rows), indent=None)
        lengths = sorted(len(r["input_ids"]) for r in rows)
        meta["splits"][name] = {
            "sequences": len(rows), "dropped_overlong_or_empty": dropped,
            "tokens": sum(lengths), "supervised_tokens": sum(sum(r["loss_mask"]) for r in rows),
            "median_length": lengths[len(lengths) // 2] if lengths else 0, "regeneration": regen_report,
            "reasoning": reasoning_counts, **({"loop_tails": loops} if loops is not None else {}),
        }
    meta["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / "meta.json", meta, default=str)  # written last: marks prepared data
    return meta


def _regenerate_sharded(target, convs, cfg: RunConfig, root: Path, split: str, progress: bool,
                        worker: tuple[int, int] | None = None):
    """Regenerate in shards of ``regen.shard_size`` conversations; each finished shard is
    written atomically to ``root/<split>-NNNNN.json`` and reused on a re-run (resumable).

    With ``worker = (rank, world)`` only shards ``i % world == rank`` are generated and the
    return value is ``{"written": [...], "reused": [...]}`` (shard indices); otherwise
    ``(conversations, summed report)`` over all shards.

    Before the first shard that must be generated, the HF backend's cap, batch and KV budget are checked
    against free memory (:func:`data_prep.regenerate.check_regen_memory`): reduced with a printed message,
    or refused (ConfigError) when not one sequence fits. A run killed mid-shard loses only that shard's
    work: a shard file is complete or absent (``write_json_atomic``), so a re-run redoes exactly the
    missing shards, each conversation once. Every shard already on disk is checked against the conversations
    it was made from before any is generated.

    ``regen.shards_per_call = k``: the shards still to generate (this worker's) are answered ``k`` consecutive
    ones at a time by one engine run (:func:`data_prep.regenerate.regenerate` with ``parts``), so the engine's
    batch is refilled from the next shard's conversations while one shard's drain; each shard's conversations
    and report are still its own, written to its own file as soon as its last conversation has ended (a kill
    loses the work on the shards not written yet, never a conversation twice). Its report's ``group`` names the
    run's shards. A worker also checks the shards on disk that it reuses.

    A shard on disk made from the first conversations of what it now holds (a split's last, partial shard,
    after a ``data.mix`` entry appended conversations to the split) keeps its answers: only the appended
    conversations are generated, and the shard is rewritten whole with both parts (report under
    ``grown_from``); until then the earlier file stays as it was, so a kill loses nothing.

    ``regen.train_shards = n`` (train split only): shards ``n`` and later are neither generated nor
    returned, so prepare tokenises the first ``n * regen.shard_size`` train conversations."""
    from data_prep.regenerate import check_regen_memory, regenerate

    root.mkdir(parents=True, exist_ok=True)
    size = cfg.regen.shard_size
    mine: dict[str, list[int]] = {"written": [], "reused": []}
    limit = cfg.regen.train_shards if split == "train" else None
    shards = [i for i in range(-(-len(convs) // size)) if limit is None or i < limit]
    if worker is not None:
        shards = [i for i in shards if i % worker[1] == worker[0]]

    def path(i: int) -> Path:
        return root / f"{split}-{i:05d}.json"

    def part(i: int) -> list:
        return convs[i * size:(i + 1) * size]

    saved: dict[int, dict] = {}  # the shards' contents (a worker keeps none: it returns only indices)
    grown: dict[int, dict] = {}  # shards on disk made from a prefix of what they now hold: only the rest is generated
    def later_shards_match(i: int) -> bool:  # every shard file after i is this layout's and made from its part
        for p in root.glob(f"{split}-*.json"):
            j = int(p.stem.rsplit("-", 1)[1])
            if j > i and (j * size >= len(convs) or json.loads(p.read_text()).get("inputs_sha256") != _sha256_json(part(j))):
                return False
        return True

    for i in shards:  # every shard on disk checked before any is generated
        if path(i).exists():
            shard, want = json.loads(path(i).read_text()), _sha256_json(part(i))
            n_in = shard.get("report", {}).get("conversations_in", len(part(i)))
            if shard.get("inputs_sha256", want) == want and n_in == len(part(i)):
                mine["reused"].append(i)
                if worker is None:
                    saved[i] = shard
            elif _made_from_prefix(shard, part(i)) and later_shards_match(i):
                # (a later shard of another layout, e.g. a smaller regen.shard_size, means this one was not the last)
                grown[i] = shard
            else:
                raise ConfigError(
                    f"{path(i)}: this regeneration shard was made from other conversations than the recipe now selects "
                    "(data section or source file changed); delete the data/regen folder or choose another output_dir")
    if grown:
        print(f"prepare: {split} shard(s) {sorted(grown)} were made before conversations were appended to the split "
              "(data.mix): their conversations are reused and only the appended ones are generated")

    def rest(i: int) -> list:  # the conversations of shard i still to generate
        return part(i)[grown[i]["report"]["conversations_in"]:] if i in grown else part(i)

    todo = [i for i in shards if i not in mine["reused"]]
    mine["written"] = list(todo)
    k = cfg.regen.shards_per_call
    regen_cfg = None  # cfg.regen once checked against memory
    for g in range(0, len(todo), k):  # regen.shards_per_call shards still to generate in one engine run
        group = todo[g:g + k]
        if regen_cfg is None:
            regen_cfg = cfg.regen
            if cfg.regen.backend == "hf":
                try:
                    regen_cfg, note = check_regen_memory(target.model, cfg.regen, cfg.data.max_prompt_tokens)
                except ValueError as e:
                    raise ConfigError(f"{cfg.source_file}: {e}") from None
                if note:
                    print(f"prepare: {note}")

        def write(j: int, new: list, rep: dict, group=group) -> None:  # shard group[j], as soon as it is done
            i = group[j]
            if len(group) > 1:
                rep["group"]["shards"] = list(group)
            if i in grown:  # the earlier prefix's answers first, then the appended conversations'
                new, rep = grown[i]["conversations"] + new, _grown_report(grown[i]["report"], rep)
            shard = {"conversations": new, "report": rep, "inputs_sha256": _sha256_json(part(i))}
            write_json_atomic(path(i), shard, indent=None)
            if worker is None:
                saved[i] = shard

        if len(group) == 1:
            write(0, *regenerate(target.model, target.tokenizer, rest(group[0]), regen_cfg,
                                 cfg.data.max_prompt_tokens, progress=progress))
        else:
            regenerate(target.model, target.tokenizer, [c for i in group for c in rest(i)], regen_cfg,
                       cfg.data.max_prompt_tokens, progress=progress, parts=[len(rest(i)) for i in group],
                       on_part=write)
    if worker is not None:
        return mine
    out, reports = [], []
    for i in shards:
        out += saved[i]["conversations"]
        reports.append(saved[i]["report"])
    # unfinished_reasoning: responses cut inside their reasoning (data_prep.rounds); 0 in shards written before it
    summed = {k: sum(r.get(k, 0) for r in reports) for k in ("conversations_in", "conversations_out", "generated_tokens",
                                                            "prompts_too_long", "unfinished_responses", "looped_responses",
                                                            "unfinished_reasoning")}
    secs = sum(r["generate_seconds"] for r in reports)
    summed.update(generate_seconds=secs, tokens_per_s=summed["generated_tokens"] / secs if secs else None,
                  engine=sorted({r.get("engine", "generate") for r in reports}),  # HF shards written before it: generate
                  sampling=reports[0]["sampling"] if reports else None, shards=len(reports),
                  shards_in_split=-(-len(convs) // size))  # more than shards: regen.train_shards stopped early
    return out, summed


#: report counts that add up when a grown shard's earlier and appended parts are joined (_grown_report)
_ADDITIVE_REPORT_KEYS = ("conversations_in", "conversations_out", "conversations_dropped", "conversations_cut",
                         "turns_requested", "prompts_too_long", "empty_responses", "unfinished_responses",
                         "unfinished_reasoning", "turns_generated", "generated_tokens", "generate_seconds",
                         "looped_responses")


def _made_from_prefix(shard: dict, convs: list) -> bool:
    """Whether a shard on disk was made from the first ``conversations_in`` of ``convs`` and fewer than all of them:
    a split's last, partial shard after conversations were appended to the split (a ``data.mix`` entry added)."""
    n = shard.get("report", {}).get("conversations_in")
    return (isinstance(n, int) and 0 < n < len(convs) and "inputs_sha256" in shard
            and shard["inputs_sha256"] == _sha256_json(convs[:n]))


def _grown_report(earlier: dict, appended: dict) -> dict:
    """The report of a grown shard: the appended part's, its counts (``_ADDITIVE_REPORT_KEYS``) summed with the
    earlier part's, ``tokens_per_s`` recomputed, the earlier part's report kept whole under ``grown_from``."""
    out = dict(appended)
    for k in _ADDITIVE_REPORT_KEYS:
        if isinstance(earlier.get(k), (int, float)) or isinstance(appended.get(k), (int, float)):
            out[k] = earlier.get(k, 0) + appended.get(k, 0)  # a count only one part has (e.g. looped_responses)
    secs = out.get("generate_seconds")
    out["tokens_per_s"] = out.get("generated_tokens", 0) / secs if secs else None
    out["grown_from"] = earlier
    return out


def _sha256_json(obj) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON: the fingerprint of a regeneration shard's inputs."""
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def eval_prompt_ids(rows: list[dict]) -> list[list[int]]:
    """The prompt of every tokenised sequence: ``input_ids`` before its first supervised token.

    These are exactly the token ids the training-time evaluation conditions on, so the eval
    stage's ``heldout`` set measures the decoding loop on the same prompts (single-turn data:
    the whole prompt; multi-turn: the first turn's). Rows without a prompt are skipped: no
    supervised token, or the first one at index 0 (:func:`~peagle_train.features.tokenized.heldout_rows`).
    """
    listed = (rows[i] for i in heldout_rows([r["loss_mask"] for r in rows]))
    return [[int(t) for t in r["input_ids"][:first_supervised(r["loss_mask"])]] for r in listed]


@stage_lines("cache")
def run_cache(cfg: RunConfig, progress: bool = True) -> Path | None:
    """Write the hidden-state cache for both splits (``features: cache`` only; resumable, self-repairing).

    Per split (``<output_dir>/features/{train,eval}``): the temp files a killed run left are deleted
    first (:func:`~peagle_train.features.cache.remove_temp_files`; their names are printed). A split
    whose manifest says complete is verified (:func:`~peagle_train.features.cache.damaged_shards`:
    every listed shard's existence, size and sha256, i.e. one read of the cache) and skipped when
    intact, without loading the target; otherwise only its missing or damaged shards are rebuilt,
    byte-identical to an uninterrupted run, and their names printed. An incomplete split resumes.
    Sequences per target forward: ``regen.batch_size``, reduced with a printed reason where the target's
    forward over the longest sequence would not fit the GPU
    (:func:`~peagle_train.features.cache.cache_batch_size`).

    Returns:
        ``<output_dir>/features``, or None for ``features: online``.

    Raises:
        CacheError: a split folder holds a cache of other data or settings
            (:func:`~peagle_train.features.cache.write_cache`).
        FileNotFoundError: no prepared data.
    """
    import torch

    from peagle_train.features.cache import cache_batch_size, damaged_shards, remove_temp_files, write_cache
    from peagle_train.features.target import feature_target, load_target
    from peagle_train.features.tokenized import load_prepared

    if cfg.train.features != "cache":
        _reused("train.features: online, the trainer runs the target", verb="skipped")
        return None
    root = Path(cfg.output_dir) / "features"
    data = load_prepared(Path(cfg.output_dir))
    target = None
    for split in ("train", "eval"):
        d = root / split
        removed = remove_temp_files(d)
        if removed:
            print(f"cache: {d}: removed {len(removed)} temp file(s) left by an interrupted run: {', '.join(removed)}")
        damaged = []
        if (d / "manifest.json").exists() and json.loads((d / "manifest.json").read_text()).get("complete"):
            damaged = damaged_shards(d)
            if not damaged:
                continue
            print(f"cache: {d}: rebuilding {len(damaged)} damaged file(s): "
                  + "; ".join(f"{name} ({why})" for name, why in damaged))
        target = target or load_target(feature_target(cfg.target), with_tokenizer=False)
        gpu = torch.cuda.get_device_properties(target.device).total_memory if target.device.type == "cuda" else None
        batch, why = cache_batch_size(target, [len(x) for x in data[split]["input_ids"]], cfg.regen.batch_size, gpu)
        if why:
            print(why, flush=True)
        write_cache(target, data[split]["input_ids"], d, dtype=cfg.data.cache_dtype, batch_size=batch,
                    progress=progress)
        if damaged:
            print(f"cache: {d}: rebuilt {', '.join(name for name, _ in damaged)}")
    if target is None:  # no split needed the target: both were complete and intact
        _reused("features/train and features/eval complete, checksums verified")
    return root


def _card(cfg: RunConfig, eval_results: dict | None = None) -> dict:
    """Model-card sections from the run's files: training metrics, the dataset's name and counts
    (never its local path: :func:`~peagle_train.export.model_card.data_summary`), recipe, eval table,
    and what the serve command names: the target's Hub id or path and the export's absolute path."""
    from peagle_train.export.model_card import data_summary, target_refs

    out = Path(cfg.output_dir)
    metrics = json.loads((out / "train_metrics.json").read_text()) if (out / "train_metrics.json").exists() else {}
    meta = json.loads((out / "data" / "meta.json").read_text()) if (out / "data" / "meta.json").exists() else {}
    serve_target, target_hub_id = target_refs(cfg.target.path, cfg.target.name, cfg.export.verifier)
    card = {"train": {k: v for k, v in metrics.items() if k != "history"},
            "data": data_summary(meta, cfg.data.source, cfg.data.path,
                                 [(m["source"], m["path"]) for m in cfg.data.mix_sources()]) if meta else {},
            "recipe": cfg.model_dump(mode="json"), "drafter_path": str((out / "export").absolute()),
            "serve_target": serve_target, "target_hub_id": target_hub_id}
    if cfg.target.random_init_from_config:  # named by its shipped name or file name, never a local path
        src = cfg.target.random_init_from_config
        card["random_weights"] = src if src.startswith("pkg:") else Path(src).name
    if eval_results:
        card["eval"] = [
            {"dataset": name, "K": row["K"], "acceptance length": row["acceptance_length"],
             "speedup (reference loop, batch 1)": row.get("speedup"),
             "lossless": "yes" if row.get("mismatches", 0) == 0 else "NO"}
            for name, ds in eval_results["datasets"].items() for row in ds["by_K"]
        ]
    return card


@stage_lines("export")
def run_export(cfg: RunConfig, progress: bool = True) -> Path:
    """Export ``<output_dir>/drafter`` to ``<output_dir>/export`` in vLLM's layout (spec §5), contract-checked.

    ``progress``: print the stage's start and end lines (:func:`stage_lines`)."""
    import torch
    from transformers import AutoTokenizer

    from peagle_train.export.writer import TargetMismatchError, export_vllm, load_drafter_folder
    from peagle_train.features.target import load_target_config, tokenizer_source

    out = Path(cfg.output_dir)
    drafter = load_drafter_folder(out / "drafter")  # ConfigError for a folder that is not a drafter
    tpath, tcfg = load_target_config(cfg.target)  # tcfg cross-checked: aux ids, hidden size, vocab; bos/eos copied
    tok = AutoTokenizer.from_pretrained(tokenizer_source(cfg.target, tpath))
    card = _card(cfg)
    if cfg.export.speculators_format and cfg.export.verifier is None:
        raise ConfigError(f"{cfg.source_file}: export.speculators_format needs export.verifier "
                          "(the target's Hub id: vLLM refuses a local verifier path)")
    try:
        path = export_vllm(drafter, out / "export", tokenizer=tok, target_name=cfg.target.name, target_config=tcfg,
                           dtype=getattr(torch, cfg.export.dtype), card=card, overwrite=True)
        if cfg.export.speculators_format:
            from peagle_train.export.writer import export_speculators

            spec_dir = out / "export-speculators"
            export_speculators(drafter, spec_dir, tokenizer=tok, target_name=cfg.target.name,
                               verifier_name_or_path=cfg.export.verifier, target_config=tcfg,
                               dtype=getattr(torch, cfg.export.dtype), overwrite=True,
                               card={**card, "drafter_path": str(spec_dir.absolute())})
    except TargetMismatchError as e:
        raise ConfigError(f"{cfg.source_file}: target {cfg.target.name!r} is not the target "
                          f"{out / 'drafter'} was trained for: {e}") from None
    return path


def heldout_prompts(out_dir: Path, n: int) -> list:
    """The first ``n`` prompts of the prepared eval split as :class:`~peagle_train.eval.evaluate.TokenPrompt` s.

    Raises:
        FileNotFoundError: ``data/eval_prompts.json`` is missing (data prepared by an older
            version, or ``data.eval_fraction`` gave no eval split): says what to re-run.
    """
    from peagle_train.eval.evaluate import TokenPrompt

    path = Path(out_dir) / "data" / "eval_prompts.json"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: the 'heldout' eval set needs the eval split's prompts, written by 'prepare' "
            "(set data.eval_fraction > 0; data prepared by an older version: delete data/meta.json and re-run prepare, "
            "the regeneration shards are reused)")
    return [TokenPrompt(tuple(p)) for p in json.loads(path.read_text())[:n]]


@stage_lines("eval")
def run_eval(cfg: RunConfig, progress: bool = True, worker: tuple[int, int] | None = None,
             merge: int | None = None, partial: bool = False, claim: str | None = None) -> dict:
    """Speculative decoding with the *exported* drafter on the eval prompts; report under ``<output_dir>/eval``.

    ``progress``: the stage lines (:func:`stage_lines`) and the evaluator's bars per dataset × K.
    ``worker = (rank, world)``: only every ``world``-th prompt of each set, raw statistics to
    ``eval/parts/`` (:func:`peagle_train.eval.evaluate.run_eval`), no report; ``merge = world``: no decoding,
    the report of the ``world`` parts (:func:`peagle_train.eval.evaluate.merge_eval`; ``partial``: of the sets
    every worker finished) and the model card. ``claim`` (with ``worker``): the workers take the next untaken prompt
    of each set instead of every ``world``-th (faster workers decode more; the name is shared by one evaluation's
    workers).
    Several workers share one GPU well: the batch-1 loop leaves it mostly idle."""
    from data_prep.eval_prompts import load_eval_prompts
    from peagle_train.eval import evaluate
    from peagle_train.export.model_card import render_model_card
    from peagle_train.export.writer import load_exported
    from peagle_train.features.target import load_target

    out = Path(cfg.output_dir)
    target_name = cfg.target.name + (" (RANDOM WEIGHTS: target.random_init_from_config)"
                                     if cfg.target.random_init_from_config else "")
    if merge is not None:
        results = evaluate.merge_eval(out / "eval", merge, partial=partial)
    else:
        target = load_target(cfg.target)
        drafter = load_exported(out / "export").to(target.device)
        results = evaluate.run_eval(target, drafter, cfg.eval, out / "eval", target_name=target_name,
                                    drafter_name=f"{cfg.train.method} drafter", trained_K=cfg.train.K,
                                    load_prompts=lambda name, n: heldout_prompts(out, n) if name == "heldout"
                                    else load_eval_prompts(name, n), progress=progress, worker=worker,
                                    claim=claim)
        if worker is not None:
            return {"eval_worker": list(worker), "part": str(evaluate.part_path(out / "eval", *worker))}
    # the model card carries the eval table next to the serve command
    export_cfg = json.loads((out / "export" / "config.json").read_text())
    readme = render_model_card(export_cfg, target_name=cfg.target.name, model_ref="export", card=_card(cfg, results))
    write_text_atomic(out / "export" / "README.md", readme)
    return results


@stage_lines("train")
def run_train(cfg: RunConfig, progress: bool = True, stop_at: int | None = None,
              stop_after_minutes: float | None = None) -> dict:
    """The train stage with its start and end lines: :func:`peagle_train.trainer.trainer.run_train`
    (``stop_at`` / ``stop_after_minutes``: a launch that stops early, see there).

    A run that already finished (``train_metrics.json`` and ``drafter/config.json``, no
    ``stop_at``) is not trained again; it is reported by the stage's end line, ``train: reused
    (...)``, in place of the trainer's own message.

    A run that trained adds to its ``logs/stages.jsonl`` record the memory planner's prediction for the
    launch (P-EAGLE; :meth:`~peagle_train.trainer.trainer.Trainer._note_predicted_peak`): ``predicted_peak_bytes``,
    the largest predicted peak over the micro-batches the launch trained (their packed tokens and S, the
    online target's forwards included), and ``predicted_peak_for`` ``{"tokens", "partitions",
    "target_forwards"}``, the micro-batch it was predicted for; compare with the record's ``peak_gpu_bytes``.
    """
    from peagle_train.trainer.trainer import run_train as train

    out = Path(cfg.output_dir)
    finished = stop_at is None and (out / "train_metrics.json").exists() and (out / "drafter" / "config.json").exists()
    if finished:
        steps = json.loads((out / "train_metrics.json").read_text()).get("steps")
        _reused(f"{out} already holds a finished run of {steps} steps: train_metrics.json and drafter/; "
                "delete train_metrics.json or pass --overwrite to train again")
    result = train(cfg, progress and not finished, stop_at, stop_after_minutes)
    if not finished:
        predicted = result.get("predicted_peak") or {}
        _stage_fields(predicted_peak_bytes=predicted.get("bytes"),
                      predicted_peak_for={k: v for k, v in predicted.items() if k != "bytes"} or None)
    return result


def run_all(cfg: RunConfig, overwrite: bool = False, progress: bool = True) -> dict:
    """prepare → cache → train → export → eval, each announced by :func:`stage_lines`; returns the eval summary."""
    claim_output_dir(cfg, overwrite)
    run_prepare(cfg, progress)
    run_cache(cfg, progress)
    run_train(cfg, progress)
    path = run_export(cfg, progress)
    if progress:
        print(f"export: {path} (vLLM layout, contract check passed)")
    return run_eval(cfg, progress)
