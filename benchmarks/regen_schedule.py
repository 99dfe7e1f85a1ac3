"""How the static engine in segments spends its batch places on a recorded regeneration: the engine's own
scheduling code replayed on the answers a target already gave, without the target.

    python benchmarks/regen_schedule.py RECIPE --shards DIR [--limit-shards N] [--conversations N] [--group G]
                                        [--override KEY=VALUE ...]
                                        [--variants NAME=regen.KEY=VALUE[,regen.KEY=VALUE] ...] [--out OUT.json]

``DIR`` holds regeneration shards (``train-*.json``, as ``peagle-train prepare`` writes them under
``data/regen/``) or a ``benchmarks/ferry.py`` pack of them (``pack-manifest.json``, checked by sha256), e.g.
``docs/data/quality/regen_92788d0``. Each shard's conversations are regenerated again by
``data_prep.regenerate.regenerate`` with the recipe's ``regen`` settings (``--override`` and each variant's
changes on top): the prompts, the chat template, turns streamed into the batch, the calls' widths and
lengths, ``regen.refill_at``'s stopping criterion and ``regen.stop_loops``' check are the run's own code.
Only ``model.generate`` is replaced (:class:`ReplayTarget`): it answers each row with the tokens that
row's recorded answer has next, so a call ends where the real one would end (every row at its end-of-turn
token, the criterion, or the call's token count).

What it measures is the schedule, which does not depend on the GPU: the decoding steps of all calls, the
batch places those steps hold (``row_steps``, padding copies included), the share of them that produced a
token, and the prompt tokens the calls prefill again (a row that goes on is re-prefilled with its prompt and
its tokens so far at every call, left-padded to the call's length). It does not time anything. With
``--calibrate`` the recorded run's own shard times (its reports' ``generate_seconds``) are fitted to its replayed
schedule, seconds ~ a * row-steps + b * padded prefill tokens (:func:`fit_seconds`, the first shard's compiles
left out), and every variant's time on that machine is predicted from its schedule (:func:`predict`): a model
fitted on a few shards, for choosing what to measure next, not a measurement.

    python benchmarks/regen_schedule.py recipes/smollm2-135m-peagle-gpu.yaml --shards docs/data/quality/regen_92788d0 \
        --override target.dtype=bfloat16 --calibrate docs/data/regen_prepare_92788d0_streamed_shards.json \
        --variants b512=regen.batch_size=512 --out OUT.json
    python benchmarks/regen_schedule.py ... --group 3 --fit-from OUT.json --out OUT3.json

Recorded answers are the shards' texts, tokenised again (``tokenizer.encode``): a few answers may differ by a
token from the ids the target produced. An answer counts as finished (its end-of-turn token appended) unless it
ends in a repetition loop (:func:`data_prep.loops.ends_in_loop`, the rule ``regen.stop_loops`` applies) or
reaches the cap; such an answer goes on past its recorded end by repeating its last loop period (what a greedy
target does in a loop), so a replay whose loop check comes later than the recorded run's still finds a loop.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from data_prep.kv_carry import KVCarry  # noqa: E402 -- after the path

#: a looped answer is continued by repeating its last period: the shortest p <= this whose shift matches ...
MAX_PERIOD = 256
#: ... over the answer's last this many tokens (else its last MATCH tokens repeat)
MATCH = 64


def loop_period(ids: list[int], max_period: int = MAX_PERIOD, match: int = MATCH) -> int:
    """The shortest ``p`` in ``1..min(max_period, m)`` with ``ids[-m:] == ids[-m-p:-p]``, ``m = min(match,
    len(ids) // 2)`` (the last ``m`` tokens repeat with period ``p``), else ``min(match, len(ids))``.

    Example: ``[7, 1, 2, 3, 1, 2, 3, 1, 2, 3]`` with ``match`` 4 gives 3; ``[9, 1, 2, 1, 2]`` gives 2. ``[]``
    gives 0.
    """
    n = len(ids)
    m = min(match, n // 2)
    for p in range(1, min(max_period, m) + 1):
        if ids[n - m:] == ids[n - m - p:n - p]:
            return p
    return min(match, n)


def extend_answer(ids: list[int], upto: int) -> list[int]:
    """``ids`` continued to ``upto`` tokens by repeating its last loop period (:func:`loop_period`); an empty
    ``ids`` stays empty (nothing to repeat)."""
    p = loop_period(ids)
    if not p:
        return list(ids)
    out = list(ids)
    while len(out) < upto:
        out += out[-p:]
    return out[:upto] if len(ids) < upto else out


class UserTurnKey:
    """The key of a ChatML prompt (``<|im_start|>role ... <|im_end|>`` segments) that names its conversation and
    turn without its assistant answers: the ids with every assistant segment (and the open assistant header)
    left out. Two prompts share it when their system and user messages so far are the same, whatever the
    answers in between (a replay may stop a looping answer at another length than the recorded run did).

    Raises:
        ValueError: a tokenizer without ``<|im_start|>`` (a template this replay does not parse).
    """

    def __init__(self, tokenizer):
        start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        if start is None or start == tokenizer.unk_token_id:
            raise ValueError("regen_schedule: the tokenizer has no <|im_start|> token; the replay keys ChatML prompts "
                             "(SmolLM2, Qwen) only")
        self.start = start
        self.assistant = tokenizer.encode("<|im_start|>assistant", add_special_tokens=False)

    def __call__(self, ids: list[int]) -> tuple[int, ...]:
        keep, seg = [], []
        for t in list(ids) + [self.start]:  # a sentinel closes the last segment
            if t == self.start and seg:
                if seg[:len(self.assistant)] != self.assistant:
                    keep += seg
                seg = []
            seg.append(t)
        return tuple(keep)


def recorded_answers(tokenizer, conversations: list[list[dict]], cap: int, eos: int,
                     key: "UserTurnKey | None" = None) -> tuple[dict, dict, dict]:
    """``({prompt key: [answer ids, ...]}, counts, {hash(prompt ids): [answer ids, ...]})`` for every assistant turn
    of ``conversations`` (normal form, as a regeneration shard holds them). The prompt is the one
    ``data_prep.rounds.run_rounds`` builds for the turn from its recorded history; the first table keys it by
    ``key`` (a :class:`UserTurnKey` of ``tokenizer`` when None; conversations with the same system and user turns
    share a key, their answers listed in order), the last by its exact ids. The answer is tokenised again, with ``eos`` appended when it finished (not
    :func:`~data_prep.loops.ends_in_loop`, fewer than ``cap`` tokens) and otherwise continued to ``cap`` tokens by
    :class:`ReplayTarget` (:func:`extend_answer`). ``counts``: ``answers``, ``tokens`` (recorded, no eos),
    ``looped`` and ``at_cap`` (recorded answers of either kind).

    Raises:
        ValueError: a conversation not in normal form (``data_prep.rounds.split_turns`` names it).
    """
    from data_prep.loops import ends_in_loop
    from data_prep.rounds import split_turns
    from data_prep.template import build_prompt_ids

    key = key or UserTurnKey(tokenizer)
    table, exact, counts = {}, {}, {"answers": 0, "tokens": 0, "looped": 0, "at_cap": 0}
    for k, conv in enumerate(conversations):
        head, users = split_turns(conv, k)
        rest = conv[len(head):]
        history = [{"role": m["role"], "content": m["content"]} for m in head]
        for r, user in enumerate(users):
            if 2 * r + 1 >= len(rest):
                break  # a trailing user turn the recorded run did not answer
            msgs = history + [{"role": "user", "content": user}]
            ids = tokenizer.encode(rest[2 * r + 1]["content"], add_special_tokens=False)
            looped, at_cap = ends_in_loop(ids), len(ids) >= cap
            counts.update(answers=counts["answers"] + 1, tokens=counts["tokens"] + len(ids),
                          looped=counts["looped"] + looped, at_cap=counts["at_cap"] + (at_cap and not looped))
            prompt = build_prompt_ids(tokenizer, msgs)
            answer = ids + [eos] if not (looped or at_cap) else ids
            table.setdefault(key(prompt), []).append(answer)
            exact.setdefault(hash(tuple(prompt)), []).append(answer)
            history = msgs + [{"role": "assistant", "content": rest[2 * r + 1]["content"]}]
    return table, counts, exact


class ReplayTarget:
    """A stand-in for the target under ``data_prep.regenerate.regenerate`` (HF backend, any engine that calls
    ``model.generate``): ``generate`` answers each row with the next tokens of its recorded answer.

    A row's answer is found by its ids: a row that goes on from an earlier call is ``its input + the tokens
    returned then`` (remembered by hash); a new row is looked up by its exact prompt ids in ``exact`` (the
    recorded history), else by its prompt's :class:`UserTurnKey` in ``answers`` (a history that the replay made
    otherwise, e.g. a loop stopped at another length); either way the next of that prompt's recorded answers
    (:func:`recorded_answers`); rows alike within one call, such as the padding copies of the first row, share one.
    Per call: each row emits its answer's tokens, then ``pad_token_id`` after its end-of-turn token; the call ends at the first step where every row has ended or a ``stopping_criteria``
    entry (``regen.refill_at``'s :class:`~data_prep.regenerate._EndsWhenShareDone`) says stop, or after
    ``max_new_tokens``, as ``transformers``' ``generate`` ends. The criteria are called once per step with that
    step's tokens ``[B, 1]`` (they read the last column).

    ``calls`` records per call ``(rows, padded length, real prompt tokens, steps)``.

    Raises:
        KeyError: a prompt with no recorded answer (a prompt the recorded run did not ask: other data settings).
    """

    def __init__(self, answers: dict, key: UserTurnKey, eos_ids: list[int], cap: int, exact: dict | None = None):
        import torch

        self.answers, self.key, self.cap, self.exact = answers, key, cap, exact or {}
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.config = SimpleNamespace(_attn_implementation="eager", num_key_value_heads=None, num_attention_heads=None)
        self.generation_config = SimpleNamespace(eos_token_id=list(eos_ids))
        self._going: dict[int, tuple[list[int], int]] = {}  # hash(row ids) -> (answer, tokens of it given so far)
        self.calls: list[tuple[int, int, int, int]] = []
        #: per call: ``(positions prefilled, causal prefill attention pairs)``; rows x L and rows x L (L + 1) / 2
        #: unless a :class:`CountingCarry` (``regen.keep_kv``) said what it prefilled for the call
        self.prefills: list[tuple[int, int]] = []
        self.carried_prefill: tuple[int, int] | None = None

    def eval(self):
        return self

    def _answer(self, row: list[int]) -> tuple[list[int], int]:
        """``(answer, tokens of it given so far)`` for a row: one that goes on, or a new prompt, which takes the
        next of its key's recorded answers (the last one stays for any later prompt with that key)."""
        h = hash(tuple(row))
        got = self._going.get(h)
        if got is not None:
            return got
        listed = self.exact.get(h) or self.answers.get(self.key(row))  # the recorded history, else the user turns
        if not listed:
            raise KeyError(f"regen_schedule: no recorded answer for a prompt of {len(row)} tokens; the shards were "
                           "regenerated with other data settings (data.max_turns, data.max_prompt_tokens, the "
                           "template) than this recipe's")
        return (listed.pop(0) if len(listed) > 1 else listed[0]), 0

    def generate(self, input_ids, attention_mask, pad_token_id, eos_token_id, max_new_tokens, stopping_criteria=None,
                 **_):
        import torch

        eos = set(eos_token_id)
        B, L = input_ids.shape
        lens = attention_mask.sum(1).tolist()
        rows = [input_ids[b, L - n:].tolist() for b, n in enumerate(lens)]
        new, ends = [], []  # per row: (answer, offset, its next tokens), the step its call may end at
        same: dict[int, tuple[list[int], int]] = {}  # rows alike in this call (padding copies): one answer
        for row in rows:
            h = hash(tuple(row))
            ans, off = same[h] if h in same else same.setdefault(h, self._answer(row))
            if len(ans) < off + max_new_tokens and not (ans and ans[-1] in eos):
                ans = extend_answer(ans, off + max_new_tokens)  # a loop or a cap-cut answer goes on
            c = ans[off:off + max_new_tokens]
            stop = next((t for t, tok in enumerate(c) if tok in eos), None)
            new.append((ans, off, c))
            ends.append(max_new_tokens if stop is None else stop + 1)
        # generate ends once every row has its end-of-turn token, or after max_new_tokens
        steps = max(ends) if all(c[e - 1:e] and c[e - 1] in eos for (_, _, c), e in zip(new, ends)) else max_new_tokens
        if stopping_criteria:
            for t in range(1, steps + 1):
                col = torch.tensor([[c[t - 1] if t <= e else pad_token_id] for (_, _, c), e in zip(new, ends)])
                if any(bool(crit(col, None).all()) for crit in stopping_criteria):
                    steps = t
                    break
        out = torch.full((B, L + steps), pad_token_id, dtype=torch.long)
        out[:, :L] = input_ids
        for b, ((ans, off, c), row) in enumerate(zip(new, rows)):
            got = c[:min(steps, ends[b])]
            out[b, L:L + len(got)] = torch.tensor(got, dtype=torch.long)
            if not (got and got[-1] in eos):
                self._going[hash(tuple(row + got))] = (ans, off + len(got))
        self.calls.append((B, L, sum(lens), steps))
        self.prefills.append(self.carried_prefill or (B * L, B * L * (L + 1) // 2))
        self.carried_prefill = None
        return out


class CountingCarry(KVCarry):
    """``regen.keep_kv``'s :class:`data_prep.kv_carry.KVCarry` on a :class:`ReplayTarget`: the same rows carried,
    continued from a previous turn or prefilled (:meth:`~data_prep.kv_carry.KVCarry.layout`), no cache: the
    positions and attention pairs it would compute are handed to the replay target for its next ``generate``."""

    def build(self, model, input_ids, attention_mask, keys, max_new_tokens):
        lengths = attention_mask.sum(-1).tolist()
        keys = self.padding_keys(input_ids, keys)
        B, W = input_ids.shape
        self.lengths["max_len"] = L = max(self.lengths.get("max_len", 0), W + max_new_tokens)  # as the engine's
        plan = self.layout(keys, lengths, self.frame_budget(B, L))  # continued turns beyond the budget: prefilled
        self.prefilled_tokens += plan.prefilled()
        self.reused_tokens += plan.reused()
        # each group of fresh rows: causal P x P; of continued turns: S queries over D - S earlier columns and
        # themselves
        pairs = sum(len(g) * plan.fresh_len(g) * (plan.fresh_len(g) + 1) // 2 for g in plan.fresh)
        for g in plan.prefixed:
            D, S = plan.frame_len(g), plan.suffix_len(g)
            pairs += len(g) * (S * (D - S) + S * (S + 1) // 2)
        model.carried_prefill = (plan.prefilled(), pairs)
        for k in keys:
            self._plan.pop(k, None)
        return None


@contextlib.contextmanager
def _counting_carry():
    """``data_prep.regenerate``'s engine builds :class:`CountingCarry` objects instead of caches in the block."""
    import data_prep.regenerate as engine

    real = engine.KVCarry
    engine.KVCarry = CountingCarry
    try:
        yield
    finally:
        engine.KVCarry = real


def replay_shard(tokenizer, conversations: list[list[dict]], regen_cfg, max_prompt_tokens: int,
                 parts: list[int] | None = None) -> dict:
    """One shard's conversations regenerated by ``data_prep.regenerate.regenerate`` on a :class:`ReplayTarget`
    of their own recorded answers. Returns the regeneration report's counts (``turns_generated``,
    ``generated_tokens``, ``unfinished_responses``, ``looped_responses``, ``engine_profile``), the recorded
    answers' ``recorded`` counts and the schedule, in tokens (positions) summed over the ``generate`` calls:
    ``calls``; ``decode_steps``; ``row_steps`` (rows x steps, padding copies included); ``prefill_padded_tokens``
    (rows x the call's padded length L; with ``regen.keep_kv`` the new rows x their own padded length) and
    ``prefill_prompt_tokens`` (the rows' real lengths); ``prefill_attention_pairs`` (rows x L (L + 1) / 2, the
    causal scores over the padded rows; keep_kv: the new rows');
    ``decode_kv_positions`` (cached positions the decoding steps attend to over the padded cache, L + t per row at
    step t) and ``decode_kv_positions_real`` (real length + t: what a kernel that skips the left padding reads,
    ``regen.decode_kernel: triton``); ``per_call``: ``[rows, L, real prompt tokens, steps]`` per call.
    With ``parts`` (the shards' sizes; ``regen.shards_per_call``: one engine run, ``regenerate(parts=...)``) the
    counts are summed over the parts and ``part_ends`` gives, per part, the calls made when it ended (when the
    stage writes its shard).

    Raises:
        ValueError: ``regen.engine`` other than ``static`` or ``generate`` (the others do not call generate).
    """
    from data_prep.regenerate import regenerate

    if regen_cfg.engine not in ("static", "generate"):
        raise ValueError(f"regen_schedule: regen.engine {regen_cfg.engine!r} does not call model.generate; "
                         "replay the static or generate engine")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    key = UserTurnKey(tokenizer)
    answers, recorded, exact = recorded_answers(tokenizer, conversations, regen_cfg.max_new_tokens, eos, key)
    model = ReplayTarget(answers, key, [eos], regen_cfg.max_new_tokens, exact=exact)
    keys = ("turns_generated", "generated_tokens", "unfinished_responses", "looped_responses")
    with _counting_carry():  # regen.keep_kv: the carry's schedule, without caches
        if parts is None:
            _, report = regenerate(model, tokenizer, conversations, regen_cfg, max_prompt_tokens, progress=False)
            out = {k: report[k] for k in (*keys, "engine_profile") if k in report}
        else:
            ends = {}
            got = regenerate(model, tokenizer, conversations, regen_cfg, max_prompt_tokens, progress=False,
                             parts=parts, on_part=lambda i, kept, rep: ends.setdefault(i, len(model.calls)))
            out = {k: sum(rep[k] for _, rep in got) for k in keys if k in got[0][1]}
            out["part_ends"] = [ends[i] for i in range(len(parts))]
    calls = model.calls
    out.update(recorded=recorded, calls=len(calls), decode_steps=sum(c[3] for c in calls),
               row_steps=sum(c[0] * c[3] for c in calls),
               prefill_padded_tokens=sum(p for p, _ in model.prefills),
               prefill_prompt_tokens=sum(c[2] for c in calls),
               # decoding attention at step t of a call: L + t cached positions per row over the padded cache
               # (PyTorch's masked SDPA), or its real length + t (the split-K kernel skips the left padding)
               decode_kv_positions=sum(B * (L * T + T * (T + 1) // 2) for B, L, _, T in calls),
               decode_kv_positions_real=sum(n * T + B * T * (T + 1) // 2 for B, _, n, T in calls),
               # prefill attention: the causal half of each padded row's L x L scores (keep_kv: the new rows')
               prefill_attention_pairs=sum(a for _, a in model.prefills),
               per_call=[list(c) for c in calls])
    return out


def summarize(shards: list[dict]) -> dict:
    """The sum of :func:`replay_shard` results over shards, with ``place_share`` (generated tokens over
    ``row_steps``: the share of the calls' batch places that produced a token) and ``prefill_per_generated``
    (padded prefill tokens per generated token)."""
    tot = {k: sum(s[k] for s in shards) for k in ("turns_generated", "generated_tokens", "unfinished_responses",
                                                   "calls", "decode_steps", "row_steps", "prefill_padded_tokens",
                                                   "prefill_prompt_tokens", "decode_kv_positions",
                                                   "decode_kv_positions_real",
                                                   "prefill_attention_pairs")}
    tot["looped_responses"] = sum(s.get("looped_responses", 0) for s in shards)
    tot["place_share"] = round(tot["generated_tokens"] / max(tot["row_steps"], 1), 4)
    tot["prefill_per_generated"] = round(tot["prefill_padded_tokens"] / max(tot["generated_tokens"], 1), 3)
    tot["tokens_per_step"] = round(tot["generated_tokens"] / max(tot["decode_steps"], 1), 1)
    return tot


def fit_seconds(shards: list[dict], seconds: list[float]) -> dict:
    """Least-squares fit of a recorded run's shard times to its replayed schedule: ``seconds[i] ~ a * row_steps +
    b * prefill_padded_tokens`` of shard ``i`` (:func:`replay_shard`; the decoding work grows with the rows a step
    holds, the prefill with the padded tokens it computes). Returns ``{"per_row_step_s": a, "per_prefill_token_s":
    b, "max_residual_s", "shards"}``.

    Raises:
        ValueError: fewer than 3 shards, or lists of different lengths.
    """
    import numpy as np

    if len(shards) != len(seconds) or len(shards) < 3:
        raise ValueError(f"fit_seconds: {len(shards)} replayed shards and {len(seconds)} recorded times; give 3 or more "
                         "of each, in the same order")
    A = np.array([[s["row_steps"], s["prefill_padded_tokens"]] for s in shards], dtype=float)
    y = np.array(seconds, dtype=float)
    coef = np.linalg.lstsq(A, y, rcond=None)[0]
    return {"per_row_step_s": float(coef[0]), "per_prefill_token_s": float(coef[1]),
            "max_residual_s": round(float(np.abs(y - A @ coef).max()), 2), "shards": len(shards)}


def recorded_pairs(reports: dict, names: list[str], replayed: list[dict], skip: int) -> tuple[list[dict], list[float]]:
    """``(replayed shards, their recorded generate_seconds)`` for :func:`fit_seconds`: each replayed shard (named
    ``names[i]``) paired with the recorded report of the shard of that name (``reports["shards"]``: entries with
    ``"shard"`` and ``"report"``, as ``docs/data/regen_prepare_*_shards.json``), the first ``skip`` replayed shards
    left out (the first compiles).

    Raises:
        SystemExit: a replayed shard with no recorded report, or a recorded shard written by several shards' engine
            run (``regen.shards_per_call`` > 1: its time is not its own).
    """
    by_name = {sh["shard"]: sh["report"] for sh in reports["shards"]}
    pairs, seconds = [], []
    for name, rep in list(zip(names, replayed))[skip:]:
        if name not in by_name:
            raise SystemExit(f"regen_schedule: --calibrate has no recorded report for {name}")
        if "group" in by_name[name]:
            raise SystemExit(f"regen_schedule: {name} was written by an engine run over several shards "
                             "(regen.shards_per_call): its generate_seconds is not its own time; calibrate on a run "
                             "with one shard per engine run")
        pairs.append(rep)
        seconds.append(by_name[name]["generate_seconds"])
    return pairs, seconds


def predict(total: dict, fit: dict) -> dict:
    """``{"predicted_seconds", "predicted_tokens_per_s", "prefill_share"}`` of a replayed schedule's ``total``
    (:func:`summarize`) under a :func:`fit_seconds` fit."""
    decode = fit["per_row_step_s"] * total["row_steps"]
    prefill = fit["per_prefill_token_s"] * total["prefill_padded_tokens"]
    return {"predicted_seconds": round(decode + prefill, 1),
            "predicted_tokens_per_s": round(total["generated_tokens"] / (decode + prefill)),
            "prefill_share": round(prefill / (decode + prefill), 3)}


def load_shards(src: Path, limit: int | None = None) -> list[tuple[str, list]]:
    """``[(shard name, conversations)]`` from ``src``: a ``benchmarks/ferry.py`` pack (``pack-manifest.json``:
    unpacked to a temporary folder with every sha256 checked) or a folder of ``train-*.json`` shards; the first
    ``limit`` shards by name.

    Raises:
        ValueError: no shard in ``src``, or a damaged pack (``ferry.unpack`` says which piece).
    """
    from ferry import MANIFEST, unpack

    def read(folder: Path):
        files = sorted(folder.glob("train-*.json"))[:limit]
        if not files:
            raise ValueError(f"regen_schedule: no train-*.json shard in {folder}")
        return [(f.name, json.loads(f.read_text())["conversations"]) for f in files]

    if (src / MANIFEST).exists():
        with tempfile.TemporaryDirectory() as tmp:
            unpack(src, Path(tmp))
            return read(Path(tmp))
    return read(src)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--shards", required=True, type=Path, help="shard folder or ferry pack (module docstring)")
    p.add_argument("--limit-shards", type=int, default=None)
    p.add_argument("--conversations", type=int, default=None, help="the first N conversations of each shard")
    p.add_argument("--group", type=int, default=1, metavar="G",
                   help="replay G consecutive shards as one regenerate call: the schedule of regen.shards_per_call G "
                        "(the batch refilled from the next shard's conversations)")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every run")
    p.add_argument("--variants", nargs="*", default=[], metavar="NAME=regen.KEY=VALUE[,regen.KEY=VALUE]",
                   help="regen settings replayed beside the recipe's own (base)")
    p.add_argument("--calibrate", type=Path, default=None, metavar="SHARD_REPORTS.json",
                   help="the recorded run's shard reports ({'shards': [{'report': {'generate_seconds': ...}}]}, as "
                        "docs/data/regen_prepare_*_shards.json): fit its shard times to the base replay "
                        "(fit_seconds; --group 1) and predict each variant's time")
    p.add_argument("--calibrate-skip", type=int, default=1, metavar="N",
                   help="leave the first N shards out of the fit (the first compiles the decoding step)")
    p.add_argument("--fit-from", type=Path, default=None, metavar="OUT.json",
                   help="predict with the fit an earlier --calibrate run wrote")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    from peagle_train.core.atomic import write_json_atomic
    from peagle_train.features.target import materialise_target, tokenizer_source
    from peagle_train.recipe import load_config
    from regen_throughput import parse_variants
    from train_step import provenance
    from transformers import AutoTokenizer

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.group < 1:
        raise SystemExit(f"regen_schedule: --group {args.group}: give 1 or more shards per regenerate call")
    if args.calibrate and (args.group != 1 or args.conversations is not None):
        raise SystemExit("regen_schedule: --calibrate fits the recorded shards' times to whole shards replayed one by "
                         "one: run it without --group and --conversations (then --fit-from for the other runs)")
    fit = json.loads(args.fit_from.read_text()).get("fit") if args.fit_from else None
    if args.fit_from and fit is None:
        raise SystemExit(f"regen_schedule: {args.fit_from} has no 'fit' (write one with --calibrate)")
    variants = {"base": {}, **parse_variants(args.variants)}
    cfg = load_config(args.recipe, list(args.override))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(cfg.target, materialise_target(cfg.target)))
    try:
        shards = [(n, c[:args.conversations]) for n, c in load_shards(args.shards, args.limit_shards)]
    except ValueError as e:  # no shard there, or a damaged pack: the message names the folder or piece
        raise SystemExit(str(e)) from None
    groups = [shards[i:i + args.group] for i in range(0, len(shards), args.group)]
    result = {"meta": {**provenance(argv, "benchmarks/regen_schedule.py"),
                       "recipe": args.recipe, "overrides": args.override,
                       "shards": ["+".join(n for n, _ in g) for g in groups],
                       "group": args.group, "fit_from": str(args.fit_from) if args.fit_from else None,
                       "what": "the static engine's schedule replayed on recorded answers (module docstring): "
                               "decoding steps, batch places, prefilled tokens; no timing"}, "variants": {}}
    for name, upd in variants.items():
        rcfg = cfg.regen.model_copy(update=upd)
        t0 = time.perf_counter()
        try:
            per = [replay_shard(tokenizer, [c for _, cs in g for c in cs], rcfg, cfg.data.max_prompt_tokens,
                                parts=[len(cs) for _, cs in g] if args.group > 1 else None) for g in groups]
        except (KeyError, ValueError) as e:  # a prompt the recorded run did not ask; an engine without generate
            raise SystemExit(f"{e.args[0] if e.args else e} (variant {name})") from None
        rec = {"settings": {k: getattr(rcfg, k) for k in ("engine", "batch_size", "max_new_tokens", "segment_tokens",
                                                           "refill_at", "stop_loops")},
               "total": summarize(per), "shards": per, "replay_seconds": round(time.perf_counter() - t0, 1)}
        if name == "base" and args.calibrate:
            fit = {**fit_seconds(*recorded_pairs(json.loads(args.calibrate.read_text()), [n for n, _ in shards], per,
                                                 args.calibrate_skip)),
                   "from": str(args.calibrate), "skipped_shards": args.calibrate_skip}
            result["fit"] = fit
        if fit is not None:
            rec["total"].update(predict(rec["total"], fit))
        result["variants"][name] = rec
        print(name, json.dumps(rec["settings"]), json.dumps(rec["total"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.out, result)
    return result


if __name__ == "__main__":
    main()
