"""The eval stage: acceptance length, per-position acceptance, speed, and the lossless check.

For every dataset of ``EvalConfig.datasets`` and every served ``K = 1..k_max`` the reference loop
of :mod:`peagle_train.decoding.speculative` decodes each prompt greedily, and its output is compared token
for token with target-alone greedy decoding (the lossless check of spec §4). MT-Bench prompts
have two user turns; with ``both_turns`` turn 2 is asked with the history
``[user 1, assistant = the target's own greedy turn-1 answer, user 2]``, as FastChat's MT-Bench
does.

Per dataset, target-alone decoding of every sequence (prompt turn) runs first, then each ``K``
over the same sequences; with ``progress`` each of these passes shows a tqdm bar (sequences done,
generated tokens/s).

Aggregation (pooled over all sequences of a dataset):

* acceptance length ``AL = mean(accepted + 1)`` over verification rounds;
* per-position acceptance at draft position ``i``: rounds accepting ``d_i`` / rounds reaching it;
* drafting ms per round: the steady-state rounds (the first proposal of each sequence also runs
  the drafter over the whole prompt and is reported separately as ``draft_prefill_ms``);
* tokens/s: returned tokens / wall seconds including the prefill; speedup = speculative tokens/s
  over target-alone tokens/s on the same sequences;
* ``target_alone.copyable``: the share of the target's own new tokens that a lookup in their context
  predicts (``data_prep.loops.copyable_flags``, n = 4: the 4 tokens before were followed by the token
  earlier in the prompt or answer). A small target's greedy answers fall into loops, where every depth
  is easy to draft, so an AL measured on such text is not one measured on fresh text (issue 20).

Outputs in ``out_dir`` (see :mod:`peagle_train.eval.report`): ``eval.json``, ``eval.md``,
``acceptance_by_position.png``, ``al_speedup_vs_k.png``.
"""
from __future__ import annotations

import functools
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from data_prep.loops import copyable_flags
from peagle_train.core.atomic import write_json_atomic
from peagle_train.core.config import ConfigError, EvalConfig, check_claim_name
from peagle_train.decoding.speculative import (
    SpecStats,
    TargetStats,
    acceptance_length,
    per_position_acceptance,
    speculative_generate,
    target_generate,
)
from peagle_train.decoding.target_runner import TargetRunner
from peagle_train.eval.report import write_report
from peagle_train.features.target import Target, eos_ids
from peagle_train.methods import method_of_config
from peagle_train.model.drafter import Drafter


@dataclass(frozen=True)
class TokenPrompt:
    """A single-turn prompt given as chat-templated token ids (ends with the assistant header).

    The ``heldout`` eval set uses these: the exact prompts of the prepared eval split, so the
    measured acceptance length is comparable with the training-time simulated one.
    """

    ids: tuple[int, ...]


#: ``(name, n) -> prompts``; each prompt is its list of user turns, or a :class:`TokenPrompt`.
PromptLoader = Callable[[str, int], list]


class LosslessError(AssertionError):
    """Speculative greedy output differed from target-alone greedy output (report already written)."""


def hardware_info(device: torch.device) -> dict:
    """Where the numbers were measured: device type and name (GPU name or CPU model), CPU cores,
    torch intra-op threads, torch / transformers / Python versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    info = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    return info


def _default_loader(name: str, n: int) -> list[list[str]]:
    from data_prep.eval_prompts import load_eval_prompts

    return load_eval_prompts(name, n)


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def _top2_margin(target: Target, prompt: list[int], ref: list[int], pos: int) -> float | None:
    """Target logit gap between its two best tokens where outputs diverged (a gap near 0 means a
    floating-point tie, not a loop bug). None when the divergence is past the end of ``ref``."""
    if pos >= len(ref):
        return None
    ids = torch.tensor([prompt + ref[:pos]], device=target.device)
    top = target.model(input_ids=ids).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def _bar(total: int, desc: str, progress: bool):
    """A tqdm bar over ``total`` decoded sequences (one sequence = one prompt turn); hidden unless ``progress``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="seq", disable=not progress)


def _advance(bar, tokens: int, seconds: float) -> None:
    """One more sequence done; the postfix shows the bar's generated tokens per second so far."""
    bar.update(1)
    bar.set_postfix(tok_s=f"{tokens / seconds:.1f}" if seconds > 0 else "n/a")


def _pool(stats: list[SpecStats], base_tokens: int, base_s: float, K: int, mismatches: int) -> dict:
    accepted = [a for s in stats for a in s.accepted]
    steady = [t for s in stats for t in s.draft_s[1:]]
    first = [s.draft_s[0] for s in stats if s.draft_s]
    verify = [t for s in stats for t in s.verify_s]
    tokens, seconds = sum(s.new_tokens for s in stats), sum(s.total_s for s in stats)
    tps = tokens / seconds if seconds > 0 else float("nan")
    base_tps = base_tokens / base_s if base_s > 0 else float("nan")
    mean_ms = lambda xs: 1e3 * sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "K": K,
        "rounds": len(accepted),
        "acceptance_length": acceptance_length(accepted),
        "per_position_acceptance": per_position_acceptance(accepted, K),
        "draft_ms_per_round": mean_ms(steady),
        "draft_prefill_ms": mean_ms(first),
        "verify_ms_per_round": mean_ms(verify),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tps,
        "speedup": tps / base_tps,
        "mismatches": mismatches,
    }


def run_eval(
    target: Target,
    drafter: Drafter,
    cfg: EvalConfig,
    out_dir: str | Path,
    *,
    target_name: str,
    drafter_name: str,
    trained_K: int,
    load_prompts: PromptLoader | None = None,
    encode: Callable[[list[dict]], list[int]] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    progress: bool = True,
    worker: tuple[int, int] | None = None,
    claim: str | None = None,
) -> dict:
    """Evaluate a drafter against its target and write the report.

    Args:
        target: loaded target (model + tokenizer); its device is used.
        drafter: a :class:`Drafter` on the same device.
        cfg: datasets, ``num_prompts`` per dataset, ``max_new_tokens``, ``k_max`` / ``k_values`` (the served K),
            ``both_turns``.
        out_dir: where :func:`peagle_train.eval.report.write_report` writes.
        target_name / drafter_name: labels in the report. trained_K: the drafter's trained depths.
        load_prompts: ``(name, n) -> prompts`` (default :func:`data_prep.eval_prompts.load_eval_prompts`).
        encode: user-message history -> prompt ids (default: the target's chat template).
        decode: ids -> text (turn-1 answer in turn 2's history).
        progress: tqdm bars per dataset × K.
        worker: ``(rank, world)``: decode only the prompts ``i`` with ``i % world == rank`` of each set and write
            their raw statistics to ``out_dir/parts/worker-RANK-of-WORLD.json`` instead of the report, after every
            set (``"complete": false`` until the last: a worker stopped early leaves the sets it finished); once all
            ``world`` parts are there, :func:`merge_eval` writes the report they make together (the same
            acceptance lengths, per-position acceptance and lossless check as one process; timings then come
            from ``world`` processes sharing the device).
        claim: with ``worker``: a name the ``world`` workers of one evaluation share (any word: letters, digits,
            ``-``, ``_``). Instead of every ``world``-th prompt, each worker takes the next prompt no worker has
            taken (a claim file ``out_dir/parts/claims-CLAIM/SET.PROMPT`` created exclusively, :func:`claim_prompt`),
            so faster workers (a GPU's beside the CPU's) decode more of each set; the part is written after every
            prompt and lists the prompts it holds, and :func:`merge_eval` takes a set whose prompts all parts
            together cover. A new name starts a new evaluation (claims of another name are not seen); a worker run
            again under the same name continues from its part (with the same settings), releasing the prompt it was
            decoding when it stopped (:func:`release_claims`).

    Returns:
        the report's dict (``eval.json``); with ``worker``, the part's dict.

    Raises:
        ValueError: ``k_max`` above ``trained_K`` for a parallel-drafting drafter (spec §4); ``worker`` out of range;
            ``claim`` without ``worker`` or not one plain word.
        LosslessError: any greedy speculative output differs from target-alone greedy decoding, after the
            report (listing every mismatch) has been written (not raised by a worker: :func:`merge_eval` does).
        FileNotFoundError / ValueError: from the prompt loader (missing eval set distribution).
    """
    method = method_of_config(drafter.config)
    if not method.serves_above_trained_K and cfg.k_max > trained_K:
        raise ValueError(f"eval.k_max={cfg.k_max} exceeds the drafter's trained K={trained_K} (served K <= trained K)")
    if worker is not None and not 0 <= worker[0] < worker[1]:
        raise ValueError(f"eval worker {worker[0]}/{worker[1]}: need 0 <= rank < world (e.g. 0/4 .. 3/4)")
    if claim is not None:
        if worker is None:
            raise ValueError(f"eval claim {claim!r}: give it with worker=(rank, world)")
        check_claim_name(claim, "eval claim")
    load_prompts = load_prompts or _default_loader
    if encode is None:
        from data_prep.template import build_prompt_ids

        encode = lambda messages: build_prompt_ids(target.tokenizer, messages)  # noqa: E731
    decode = decode or (lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True))
    target.model.eval()
    drafter.eval()
    eos = eos_ids(target)
    ks = cfg.served_ks()
    raw: dict[str, _RawSet] = {}
    taken: dict[str, list[int]] = {}  # claim: the prompts of each set this worker decoded
    warm = [False]
    # a claiming worker run again under its evaluation's name continues from its part (the prompts it decoded are
    # claimed for good); any other part left by an earlier run must not stand for this one if this worker stops early
    resumed = _resumable_part(out_dir, worker, claim, cfg, ks, method.name, trained_K) if claim is not None else None
    if worker is not None and resumed is None:
        part_path(out_dir, *worker).unlink(missing_ok=True)

    def head(runner: TargetRunner) -> dict:
        return {"target": target_name, "drafter": drafter_name, "method": method.name, "trained_K": trained_K,
                "k_values": ks, "max_new_tokens": cfg.max_new_tokens, "both_turns": cfg.both_turns,
                "decoding": "greedy", "hardware": hardware_info(target.device),
                "target_runner": runner.kind, "target_runner_fallback": runner.fallback,
                "target_runner_cudagraph_skips": list(runner.cudagraph_skips)}

    def write_part(runner: TargetRunner, done: bool) -> dict:
        # written after every set: a worker stopped later (a job's time limit) leaves the sets it finished,
        # "complete": false until the last one (merge_eval's partial merge reads them)
        part = {**head(runner), "worker": list(worker), "datasets_planned": list(cfg.datasets),
                "complete": done, "datasets": {n: r.to_dict() for n, r in raw.items()},
                "claim": claim, "prompts": taken if claim is not None else None}
        path = part_path(out_dir, *worker)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, part, indent=None)  # each write whole or not at all
        return part

    with TargetRunner(target, static=bool(cfg.compile_target), compile=cfg.compile_target) as runner:
        for si, name in enumerate(cfg.datasets):
            prompts = load_prompts(name, cfg.num_prompts)
            last = si == len(cfg.datasets) - 1
            if claim is None:
                mine = [pi for pi in range(len(prompts)) if worker is None or pi % worker[1] == worker[0]]
                raw[name] = _decode_set(target, drafter, name, prompts, mine, cfg, ks, eos, encode, decode, warm,
                                        progress, runner)
                if worker is not None:
                    part = write_part(runner, last)
                continue
            raw[name], taken[name] = _RawSet.empty(len(prompts), ks), []
            if resumed is not None:
                if name in resumed["datasets"]:
                    raw[name] = _RawSet.from_dict(resumed["datasets"][name])
                    taken[name] = list(resumed["prompts"][name])
                release_claims(out_dir, claim, name, worker[0], keep=taken[name])
            for pi in range(len(prompts)):
                if not claim_prompt(out_dir, claim, name, pi, worker[0]):
                    continue
                one = _decode_set(target, drafter, name, prompts, [pi], cfg, ks, eos, encode, decode, warm,
                                  False, runner)
                raw[name] = raw[name].add(one)
                taken[name].append(pi)
                part = write_part(runner, False)  # after every prompt: a worker stopped later loses one prompt
            part = write_part(runner, last)
    if worker is not None:
        return part
    return _report(head(runner), raw, ks, out_dir, workers=1)


def claim_prompt(out_dir: str | Path, claim: str, name: str, prompt: int, rank: int) -> bool:
    """Take prompt ``prompt`` of set ``name`` for the worker ``rank`` of the evaluation named ``claim``: create
    ``out_dir/parts/claims-CLAIM/NAME.PROMPT`` exclusively (``O_CREAT | O_EXCL``, atomic on a local file
    system), holding the rank. Returns True when this call created it (the prompt is this worker's), False when
    another worker's call did. Raises OSError when the folder cannot be made or written."""
    d = Path(out_dir) / "parts" / f"claims-{claim}"
    d.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(d / f"{name}.{prompt}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(str(rank))
    return True


def release_claims(out_dir: str | Path, claim: str, name: str, rank: int, keep: list[int]) -> list[int]:
    """Delete the claim files of set ``name`` that worker ``rank`` created under ``claim`` for prompts its part does
    not hold (``keep``): the prompt it was decoding when it stopped, which any worker may then take. Returns the
    prompts released (none when the claims folder does not exist). Raises OSError when a claim file cannot be read
    or removed."""
    d = Path(out_dir) / "parts" / f"claims-{claim}"
    freed = []
    for f in d.glob(f"{name}.*") if d.is_dir() else []:
        pi = f.name[len(name) + 1:]
        if pi.isdigit() and int(pi) not in keep and f.read_text().strip() == str(rank):
            f.unlink(missing_ok=True)
            freed.append(int(pi))
    return sorted(freed)


def _resumable_part(out_dir, worker, claim: str, cfg: EvalConfig, ks: list[int], method: str,
                    trained_K: int) -> dict | None:
    """The part worker ``worker`` wrote earlier under the claim name ``claim`` with the same settings (served K,
    new tokens, turns, sets, method), which it continues from; None when there is none (or another evaluation's, a
    damaged one)."""
    path = part_path(out_dir, *worker)
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    same = (old.get("claim") == claim and old.get("k_values") == ks and old.get("max_new_tokens") == cfg.max_new_tokens
            and old.get("both_turns") == cfg.both_turns and old.get("datasets_planned") == list(cfg.datasets)
            and old.get("method") == method and old.get("trained_K") == trained_K
            and isinstance(old.get("prompts"), dict))
    return old if same else None


def part_path(out_dir: str | Path, rank: int, world: int) -> Path:
    """Where eval worker ``rank`` of ``world`` (:func:`run_eval` with ``worker``) writes its part:
    ``out_dir/parts/worker-RANK-of-WORLD.json``."""
    return Path(out_dir) / "parts" / f"worker-{rank}-of-{world}.json"


@dataclass
class _RawSet:
    """One eval set's raw statistics (all its sequences, or one worker's share): target-alone totals, the
    loop's statistics per served ``K`` and sequence, lossless mismatches per ``K`` and their records."""

    num_prompts: int
    base: TargetStats
    per_k: dict[int, list[SpecStats]]
    bad_k: dict[int, int]
    found: list[dict]
    sequences: int
    # [copyable, all] of the target-alone answer tokens (EOS not counted); None: a part written before the field
    copyable: list[int] | None = field(default_factory=lambda: [0, 0])

    def to_dict(self) -> dict:
        return {"num_prompts": self.num_prompts, "sequences": self.sequences, "base": self.base.to_dict(),
                "per_k": {str(k): [st.to_dict() for st in v] for k, v in self.per_k.items()},
                "bad_k": {str(k): v for k, v in self.bad_k.items()}, "found": self.found,
                "copyable": None if self.copyable is None else list(self.copyable)}

    @staticmethod
    def empty(num_prompts: int, ks: list[int]) -> "_RawSet":
        """A share of no sequences of a set of ``num_prompts`` prompts served at ``ks`` (what :meth:`add` starts
        from)."""
        return _RawSet(num_prompts, TargetStats(), {k: [] for k in ks}, {k: 0 for k in ks}, [], 0, [0, 0])

    @staticmethod
    def from_dict(d: dict) -> "_RawSet":
        """The set of :meth:`to_dict`'s dict (a worker part); a part without ``copyable`` gives None there."""
        stat = lambda x: SpecStats(K=x["K"], accepted=x["accepted"], draft_s=x["draft_s"],  # noqa: E731
                                   verify_s=x["verify_s"], prefill_s=x["prefill_s"], total_s=x["total_s"],
                                   new_tokens=x["new_tokens"])
        b = d["base"]
        return _RawSet(d["num_prompts"], TargetStats(b["prefill_s"], b["total_s"], b["new_tokens"]),
                       {int(k): [stat(x) for x in v] for k, v in d["per_k"].items()},
                       {int(k): v for k, v in d["bad_k"].items()}, list(d["found"]), d["sequences"],
                       list(d["copyable"]) if d.get("copyable") is not None else None)

    def add(self, other: "_RawSet") -> "_RawSet":
        """Both shares of the same set together (sums and concatenations; mismatches in prompt order)."""
        base = TargetStats(self.base.prefill_s + other.base.prefill_s, self.base.total_s + other.base.total_s,
                           self.base.new_tokens + other.base.new_tokens)
        return _RawSet(self.num_prompts, base, {k: self.per_k[k] + other.per_k[k] for k in self.per_k},
                       {k: self.bad_k[k] + other.bad_k[k] for k in self.bad_k},
                       sorted(self.found + other.found, key=lambda m: (m["prompt"], m["turn"], m["K"])),
                       self.sequences + other.sequences,
                       None if self.copyable is None or other.copyable is None  # a share of some workers only: none
                       else [a + b for a, b in zip(self.copyable, other.copyable)])


def _decode_set(target, drafter, name: str, prompts: list, mine: list[int], cfg: EvalConfig, ks: list[int], eos,
                encode, decode, warm: list, progress: bool, runner: TargetRunner) -> _RawSet:
    """Target alone, then the loop at every ``K``, over the prompts ``mine`` (indices into ``prompts``) of set
    ``name``, the target's forwards through ``runner``."""
    base = TargetStats()
    copyable = [0, 0]  # the target's new tokens a lookup in their context predicts (data_prep.loops), all of them
    # target alone first: each sequence's prompt ids and greedy reference (turn 2's history needs turn 1's)
    seqs: list[tuple[int, int, list[int], list[int]]] = []  # (prompt, turn, ids, reference)
    steps = {pi: [prompts[pi]] if isinstance(prompts[pi], TokenPrompt) else prompts[pi][: 2 if cfg.both_turns else 1]
             for pi in mine}
    bar = _bar(sum(map(len, steps.values())), f"eval[{name}] target alone", progress)
    for pi, turns in steps.items():
        history: list[dict] = []
        for ti, user in enumerate(turns):
            if isinstance(user, TokenPrompt):
                ids = list(user.ids)
            else:
                history.append({"role": "user", "content": user})
                ids = list(encode(history))
            if not warm[0]:  # lazy init (kernels, allocator) and compiles stay out of the timings
                target_generate(target, ids, min(4, cfg.max_new_tokens), eos_token_id=eos, runner=runner)
                # a compiled target meets each query length (K + 1) at the first round of its K
                for k in (ks if runner.compile else ks[-1:]):
                    speculative_generate(target, drafter, ids, k, min(4, cfg.max_new_tokens), eos_token_id=eos,
                                         runner=runner)
                warm[0] = True
            ref, bst = target_generate(target, ids, cfg.max_new_tokens, eos_token_id=eos, runner=runner)
            base.new_tokens += bst.new_tokens
            base.total_s += bst.total_s
            seqs.append((pi, ti, ids, ref))
            answer = ref[:-1] if eos and ref and ref[-1] in eos else ref  # EOS is not answer text
            flags = copyable_flags(ids + answer, [0] * len(ids) + [1] * len(answer))
            copyable[0] += sum(c for _, c in flags)
            copyable[1] += len(flags)
            _advance(bar, base.new_tokens, base.total_s)
            if not isinstance(user, TokenPrompt):
                answer = [t for t in ref if eos is None or t not in eos]
                history.append({"role": "assistant", "content": decode(answer)})
    bar.close()
    per_k: dict[int, list[SpecStats]] = {k: [] for k in ks}
    bad_k = {k: 0 for k in ks}
    found: list[dict] = []
    for k in ks:
        bar = _bar(len(seqs), f"eval[{name}] K={k}", progress)
        for pi, ti, ids, ref in seqs:
            out, st = speculative_generate(target, drafter, ids, k, cfg.max_new_tokens, eos_token_id=eos,
                                           runner=runner)
            per_k[k].append(st)
            _advance(bar, sum(s.new_tokens for s in per_k[k]), sum(s.total_s for s in per_k[k]))
            if out != ref:
                pos = _first_diff(ref, out)
                bad_k[k] += 1
                found.append({
                    "dataset": name, "prompt": pi, "turn": ti + 1, "K": k, "position": pos,
                    "target_token": ref[pos] if pos < len(ref) else None,
                    "speculative_token": out[pos] if pos < len(out) else None,
                    "target_len": len(ref), "speculative_len": len(out),
                    "target_top2_margin": _top2_margin(target, ids, ref, pos),
                })
        bar.close()
    return _RawSet(len(prompts), base, per_k, bad_k, sorted(found, key=lambda m: (m["prompt"], m["turn"], m["K"])),
                   len(seqs), copyable)


def _report(head: dict, raw: dict[str, _RawSet], ks: list[int], out_dir: str | Path, workers: int) -> dict:
    """The report of ``raw`` (per set, all its sequences): pooled per ``K``, written by
    :func:`~peagle_train.eval.report.write_report`; raises :class:`LosslessError` after writing if any mismatch."""
    datasets, mismatches = {}, []
    for name, r in raw.items():
        mismatches += r.found  # prompt order, then K
        datasets[name] = {
            "num_prompts": r.num_prompts,
            "num_sequences": r.sequences,
            "target_alone": {"new_tokens": r.base.new_tokens, "seconds": r.base.total_s,
                             "tokens_per_s": r.base.tokens_per_s,
                             # share of the target's own output a lookup in its context predicts (repetition)
                             "copyable": r.copyable[0] / r.copyable[1] if r.copyable and r.copyable[1] else None},
            "by_K": [_pool(r.per_k[k], r.base.new_tokens, r.base.total_s, k, r.bad_k[k]) for k in ks],
        }
    checked = sum(r.sequences for r in raw.values()) * len(ks)
    results = {**head, "workers": workers, "datasets": datasets,
               "lossless": {"checked": checked, "mismatches": mismatches, "passed": not mismatches}}
    write_report(results, out_dir)
    if mismatches:
        first = mismatches[0]
        raise LosslessError(
            f"{len(mismatches)} of {checked} speculative outputs differ from target-alone greedy decoding "
            f"(first: {first['dataset']} prompt {first['prompt']} turn {first['turn']} K={first['K']} at token "
            f"{first['position']}, top-2 margin {first['target_top2_margin']}); details in {Path(out_dir) / 'eval.json'}"
        )
    return results


def worker_loop(rank: int, device: str | None, shares: list[_RawSet]) -> dict:
    """One eval worker's decoding over its ``shares`` (its part of each set, :meth:`_RawSet.from_dict`):
    ``{"worker": rank, "device": device, "seconds": wall seconds of its target-alone and speculative loops
    (prefill included), "new_tokens": the tokens those loops generated, "tokens_per_s"}``. Summed over every served
    K and the target-alone pass, so workers with equal shares compare by ``seconds``."""
    secs = sum(r.base.total_s + sum(st.total_s for v in r.per_k.values() for st in v) for r in shares)
    toks = sum(r.base.new_tokens + sum(st.new_tokens for v in r.per_k.values() for st in v) for r in shares)
    return {"worker": rank, "device": device, "seconds": secs, "new_tokens": toks,
            "tokens_per_s": toks / secs if secs > 0 else None}


def _claimed_whole(parts: list[dict], name: str, world: int) -> bool:
    """Whether the parts of a claiming evaluation (:func:`run_eval` with ``claim``) together hold every prompt of
    set ``name`` exactly once. Raises ConfigError naming the prompt when two parts hold the same one (claims of
    two evaluations under one name: run them again under a new one)."""
    held = [pi for p in parts for pi in (p.get("prompts") or {}).get(name, [])]
    if len(held) != len(set(held)):
        dup = next(pi for pi in held if held.count(pi) > 1)
        raise ConfigError(f"eval merge: prompt {dup} of {name} is in two of the {world} parts: the claims of two "
                          "evaluations mixed; run the workers again under a new claim name")
    return _missing_prompts(parts, name) == []


def _missing_prompts(parts: list[dict], name: str) -> list[int] | str:
    """The prompts of set ``name`` no claiming part holds, ascending (``"the whole set"`` when no part has the
    set; its size is the ``num_prompts`` the parts record, the same in every part of one evaluation)."""
    sizes = [p["datasets"][name]["num_prompts"] for p in parts if name in p["datasets"]]
    if not sizes:
        return "the whole set"
    held = {pi for p in parts for pi in (p.get("prompts") or {}).get(name, [])}
    return [pi for pi in range(sizes[0]) if pi not in held]


def merge_eval(out_dir: str | Path, world: int, partial: bool = False) -> dict:
    """The report of ``world`` eval workers (:func:`run_eval` with ``worker``), from their parts in
    ``out_dir/parts/``: each set's sequences of all workers pooled as one process pools them (acceptance
    length, per-position acceptance, lossless check are the same; timings are those of the workers, which
    shared the device: ``workers`` in the report says how many).

    ``partial``: also when some workers stopped before their last set (their parts say ``"complete": false``):
    the report of the sets every worker finished, each set whole (all its prompts), with ``"partial":
    {"sets_left_out": [...]}``; without it such parts are refused. Workers that claimed their prompts
    (``claim``): a set is whole when the parts together hold each of its prompts, whichever worker decoded it.

    The report also holds ``worker_loops`` (:func:`worker_loop` per worker: its device, decoding seconds and tokens)
    and, where the workers ran on more than one kind of device, ``worker_devices``.

    Returns / Raises: as :func:`run_eval`; also FileNotFoundError naming the missing parts (run those workers),
    ConfigError (a ValueError; the CLI's exit 2) naming a part that is not JSON, was made with other settings
    (K values, datasets, tokens) than worker 0's, or is incomplete (without ``partial``; with it, when no set
    was finished by every worker); parts of different claim names, or one prompt in two parts.
    """
    parts = []
    missing = []
    for r in range(world):
        path = part_path(out_dir, r, world)
        if not path.exists():
            missing.append(str(path))
        else:
            try:
                parts.append(json.loads(path.read_text()))
            except json.JSONDecodeError as e:
                raise ConfigError(f"eval merge: {path} is not a worker part ({e}): run that worker again") from None
    if missing:
        raise FileNotFoundError(f"eval merge: {len(missing)} of {world} worker parts are missing ({', '.join(missing)}): "
                                f"run `peagle-train eval RECIPE --eval-worker RANK/{world}` for each")
    keys = ("target", "drafter", "method", "trained_K", "k_values", "max_new_tokens", "both_turns", "decoding")
    planned = lambda p: p.get("datasets_planned") or list(p["datasets"])  # noqa: E731 (parts before the key: whole)
    for p in parts[1:]:
        diff = [k for k in keys if p[k] != parts[0][k]] + (["datasets"] if planned(p) != planned(parts[0]) else [])
        if diff:
            raise ConfigError(f"eval merge: worker {p['worker'][0]}/{world} was run with other settings than worker "
                             f"0/{world} ({', '.join(diff)}): run all workers with the same recipe")
    claims = {p.get("claim") for p in parts}
    if len(claims) > 1:
        raise ConfigError(f"eval merge: the {world} parts come from different evaluations (claims "
                          f"{', '.join(sorted(map(str, claims)))}): run all workers of one evaluation again")
    claim = claims.pop()
    stopped = [p for p in parts if p.get("complete") is False]
    if stopped and not partial:
        names = ", ".join(f"{p['worker'][0]} (finished: {', '.join(p['datasets']) or 'none'})" for p in stopped)
        raise ConfigError(f"eval merge: {len(stopped)} of {world} workers stopped before their last set: {names}; "
                          "run them again, or report the sets every worker finished with --eval-partial")
    if claim is None:  # every world-th prompt: a set is whole when every worker finished it
        common = [n for n in planned(parts[0]) if all(n in p["datasets"] for p in parts)]
    else:  # claimed prompts: a set is whole when the parts together hold each of its prompts once
        common = [n for n in planned(parts[0]) if _claimed_whole(parts, n, world)]
        if not partial and len(common) < len(planned(parts[0])):  # every worker done, yet a set not whole
            gaps = {n: _missing_prompts(parts, n) for n in planned(parts[0]) if n not in common}
            raise ConfigError(f"eval merge: the {world} parts leave prompts undecoded ({gaps}): run the workers "
                              f"again under the same --eval-claim {claim} (each continues from its part), or report "
                              "the whole sets with --eval-partial")
    if not common:
        raise ConfigError(f"eval merge: no set was finished by all {world} workers: run them again")
    ks = parts[0]["k_values"]
    shares = {name: [_RawSet.from_dict(p["datasets"][name]) if name in p["datasets"]  # [set][worker]
                     else _RawSet.empty(next(q["datasets"][name]["num_prompts"] for q in parts
                                             if name in q["datasets"]), ks) for p in parts] for name in common}
    raw = {name: functools.reduce(_RawSet.add, shares[name]) for name in common}
    head = {k: parts[0][k] for k in (*keys, "hardware")}
    kinds = sorted({p.get("target_runner") or "dynamic" for p in parts})  # parts made before the key: dynamic
    fallbacks = [f"worker {p['worker'][0]}: {p['target_runner_fallback']}" for p in parts if p.get("target_runner_fallback")]
    skips = list(dict.fromkeys(m for p in parts for m in p.get("target_runner_cudagraph_skips") or []))
    head |= {"target_runner": kinds[0] if len(kinds) == 1 else "mixed: " + ", ".join(kinds),
             "target_runner_fallback": "; ".join(fallbacks) or None, "target_runner_cudagraph_skips": skips}
    hardware = [p.get("hardware") or {} for p in parts]
    devices = [h.get("device_name") or h.get("device") for h in hardware]
    if len(set(devices)) > 1:  # e.g. CPU workers beside a GPU's (quality_experiment.sh EVAL_CPU_WORKERS)
        head["worker_devices"] = devices
    # each worker's decoding (target alone and every served K, over the sets all of them finished): which device
    # bounded the evaluation's wall time, and at what rate each kind decodes beside the others
    head["worker_loops"] = [worker_loop(p["worker"][0], devices[i], [shares[n][i] for n in common])
                            for i, p in enumerate(parts)]
    left_out = [n for n in planned(parts[0]) if n not in common]
    if left_out:
        head["partial"] = {"sets_left_out": left_out}
    return _report(head, raw, ks, out_dir, workers=world)
