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
  over target-alone tokens/s on the same sequences.

Outputs in ``out_dir`` (see :mod:`peagle_train.eval.report`): ``eval.json``, ``eval.md``,
``acceptance_by_position.png``, ``al_speedup_vs_k.png``.
"""
from __future__ import annotations

import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_train.core.config import EvalConfig
from peagle_train.decoding.speculative import (
    SpecStats,
    TargetStats,
    acceptance_length,
    per_position_acceptance,
    speculative_generate,
    target_generate,
)
from peagle_train.eval.report import write_report
from peagle_train.features.target import Target
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


def eos_ids(target: Target) -> list[int] | None:
    """End-of-sequence ids: the model's ``generation_config.eos_token_id`` (int or list), else the
    tokenizer's ``eos_token_id``, else None."""
    gen = getattr(target.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None and target.tokenizer is not None:
        eos = getattr(target.tokenizer, "eos_token_id", None)
    if eos is None:
        return None
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


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
) -> dict:
    """Evaluate a drafter against its target and write the report.

    Args:
        target, drafter: on the same device; put in eval mode here.
        cfg: datasets, ``num_prompts`` per dataset, ``max_new_tokens``, ``k_max``, ``both_turns``.
        out_dir: created if missing; receives ``eval.json``, ``eval.md`` and two PNG plots.
        target_name, drafter_name: shown in the report. trained_K: the drafter's trained K.
        load_prompts: ``(dataset, n) -> prompts`` (default ``data_prep.eval_prompts.load_eval_prompts``);
            a prompt is its list of user turns (str) or a :class:`TokenPrompt` (one turn, ids as given).
        encode: chat messages → prompt ids (default ``data_prep.template.build_prompt_ids`` with the
            target's tokenizer). decode: answer ids → text for turn 2's history (default the
            tokenizer's ``decode(skip_special_tokens=True)``).
        progress: show a tqdm bar per dataset for target-alone decoding and one per dataset × K
            (sequences done of the dataset, generated tokens/s in the postfix); False: silent.

    Returns:
        The results dict also written to ``eval.json`` (keys: ``target``, ``drafter``, ``method``,
        ``trained_K``, ``k_values``, ``max_new_tokens``, ``hardware``, ``datasets`` →
        ``{name: {num_prompts, num_sequences, target_alone, by_K: [...]}}``, ``lossless``).

    Raises:
        ValueError: ``k_max`` above ``trained_K`` for a parallel-drafting drafter (spec §4).
        LosslessError: any greedy speculative output differs from the target's, after the
            report (listing every mismatch) has been written.
        FileNotFoundError / ValueError: from the prompt loader (missing eval set distribution).
    """
    method = method_of_config(drafter.config)
    if not method.serves_above_trained_K and cfg.k_max > trained_K:
        raise ValueError(f"eval.k_max={cfg.k_max} exceeds the drafter's trained K={trained_K} (served K <= trained K)")
    load_prompts = load_prompts or _default_loader
    if encode is None:
        from data_prep.template import build_prompt_ids

        encode = lambda messages: build_prompt_ids(target.tokenizer, messages)  # noqa: E731
    decode = decode or (lambda ids: target.tokenizer.decode(ids, skip_special_tokens=True))
    target.model.eval()
    drafter.eval()
    eos = eos_ids(target)
    ks = list(range(1, cfg.k_max + 1))
    mismatches: list[dict] = []
    checked = 0
    datasets: dict[str, dict] = {}
    warmed = False
    for name in cfg.datasets:
        prompts = load_prompts(name, cfg.num_prompts)
        base = TargetStats()
        # target alone first: each sequence's prompt ids and greedy reference (turn 2's history needs turn 1's)
        seqs: list[tuple[int, int, list[int], list[int]]] = []  # (prompt, turn, ids, reference)
        steps = [[t] if isinstance(t, TokenPrompt) else t[: 2 if cfg.both_turns else 1] for t in prompts]
        bar = _bar(sum(map(len, steps)), f"eval[{name}] target alone", progress)
        for pi, turns in enumerate(steps):
            history: list[dict] = []
            for ti, user in enumerate(turns):
                if isinstance(user, TokenPrompt):
                    ids = list(user.ids)
                else:
                    history.append({"role": "user", "content": user})
                    ids = list(encode(history))
                if not warmed:  # lazy init (kernels, allocator) stays out of the timings
                    target_generate(target, ids, min(4, cfg.max_new_tokens), eos_token_id=eos)
                    speculative_generate(target, drafter, ids, ks[-1], min(4, cfg.max_new_tokens), eos_token_id=eos)
                    warmed = True
                ref, bst = target_generate(target, ids, cfg.max_new_tokens, eos_token_id=eos)
                base.new_tokens += bst.new_tokens
                base.total_s += bst.total_s
                seqs.append((pi, ti, ids, ref))
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
                out, st = speculative_generate(target, drafter, ids, k, cfg.max_new_tokens, eos_token_id=eos)
                per_k[k].append(st)
                checked += 1
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
        mismatches += sorted(found, key=lambda m: (m["prompt"], m["turn"], m["K"]))  # prompt order, then K
        datasets[name] = {
            "num_prompts": len(prompts),
            "num_sequences": len(seqs),
            "target_alone": {"new_tokens": base.new_tokens, "seconds": base.total_s, "tokens_per_s": base.tokens_per_s},
            "by_K": [_pool(per_k[k], base.new_tokens, base.total_s, k, bad_k[k]) for k in ks],
        }
    results = {
        "target": target_name,
        "drafter": drafter_name,
        "method": method.name,
        "trained_K": trained_K,
        "k_values": ks,
        "max_new_tokens": cfg.max_new_tokens,
        "both_turns": cfg.both_turns,
        "decoding": "greedy",
        "hardware": hardware_info(target.device),
        "datasets": datasets,
        "lossless": {"checked": checked, "mismatches": mismatches, "passed": not mismatches},
    }
    write_report(results, out_dir)
    if mismatches:
        first = mismatches[0]
        raise LosslessError(
            f"{len(mismatches)} of {checked} speculative outputs differ from target-alone greedy decoding "
            f"(first: {first['dataset']} prompt {first['prompt']} turn {first['turn']} K={first['K']} at token "
            f"{first['position']}, top-2 margin {first['target_top2_margin']}); details in {Path(out_dir) / 'eval.json'}"
        )
    return results
