"""Reference speculative-decoding loop: vLLM's parallel drafting (P-EAGLE) and EAGLE-3 chain drafting.

This is the ground truth for acceptance length and for the lossless check (spec §4).
One request (batch 1), plain PyTorch, readable rather than fast.

Notation. ``x[0..]`` is the token sequence (prompt then generated tokens), ``aux[j]``
``[A*T]`` the target's aux state at position ``j`` (the layers of spec §1 after reading
``x[0..j]``), ``t`` the last position whose token and target KV are committed, ``b = x[t+1]``
the bonus token the target produced at ``t`` (committed, KV not yet computed by the target).

Drafter layout (spec §4, vLLM ``vllm/v1/spec_decode/eagle.py`` with ``parallel_drafting``):

* context slot of position ``j``: token ``x[j+1]``, hidden ``fc(aux[j])``, RoPE position ``j``
  (the EAGLE shift); the **bonus slot** is the context slot of ``t`` (token ``b``);
* P-EAGLE: ``K-1`` mask slots, token ``mask_token_id``, hidden ``fc(mask_hidden)``, positions
  ``t+1 .. t+K-1``; one forward over ``[new context slots, mask slots]`` with causal attention
  over ``[cached KV, new slots]``; drafts = the bonus slot and the mask slots;
* EAGLE-3: one forward over the new context slots gives draft 1 at the bonus slot, then
  ``K-1`` single-slot forwards, token = previous draft, hidden = the drafter's previous
  pre-norm output ``h`` (``H``-dim, no ``fc``), position + 1.

Context-slot KV is kept (those tokens are verified); mask / chain KV is dropped after the round.
Each round's drafting is the draft method's own :meth:`~peagle_train.methods.base.DraftMethod.draft_round`
(``methods/peagle.py``: one forward over the mask slots; ``methods/eagle3.py``: the chain of forwards).
Worked example, prompt ``x0 x1 x2``, target prefill gives ``b = x3``, ``K = 3``::

    slot      ctx  ctx  bonus  mask  mask
    token     x1   x2   x3     M     M
    hidden    a0   a1   a2     m     m          (a_j = fc(aux[j]), m = fc(mask_hidden))
    position  0    1    2      3     4
    drafts                 d1    d2    d3       (x4, x5, x6 proposals)

The target verifies ``[x3, d1, d2, d3]`` at positions ``3..6``; with ``d1`` accepted and
``d2`` rejected it emits ``b' = x5`` and the next round's new context slots are ``(d1, a3, 3)``
and ``(b', a4, 4)``, followed by two mask slots at positions 5, 6.

Shapes: ``K`` served draft tokens, ``V`` target vocab, ``Vd`` draft vocab, ``H`` drafter
hidden, ``A*T`` concatenated aux width, ``n`` new context slots.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from peagle_train.core.dtypes import acc_dtype
from peagle_train.decoding.rejection import AcceptRule, standard_accept_rule, verify_greedy, verify_sampling
from peagle_train.decoding.target_runner import TargetRunner
from peagle_train.features.target import Target
from peagle_train.kernels.attention import AttnSpec
from peagle_train.methods import get_method, method_of_config
from peagle_train.model.drafter import Drafter
from peagle_train.peagle.spec_stats import SpecStats, TargetStats, acceptance_length, per_position_acceptance


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _causal(n_new: int, n_past: int, device) -> torch.Tensor:
    """Causal mask of ``n_new`` queries over ``[n_past cached, n_new]`` keys, ``[n_new, n_past + n_new]`` bool."""
    return torch.ones(n_new, n_past + n_new, dtype=torch.bool, device=device).tril(n_past)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float32 (float64 stays float64)."""
    return torch.softmax(logits.to(acc_dtype(logits.dtype)) / temperature, dim=-1)


@dataclass
class Proposal:
    """One round of drafts.

    Attributes:
        draft_ids: ``[K]`` int64 target-vocab ids (draft ids mapped with ``d2t``).
        draft_logits: ``[K, Vd]`` raw drafter logits of the bonus slot and the mask (or chain) slots.
        q: ``[K, V]`` float32 drafter distributions ``softmax(logits / temperature)`` scattered onto the
            target vocab (zero outside the draft vocab); ``None`` in greedy mode.
    """

    draft_ids: torch.Tensor
    draft_logits: torch.Tensor
    q: torch.Tensor | None


class DraftSession:
    """The drafter side of one request, with its own KV cache (spec §4).

    Args:
        drafter: a :class:`Drafter` in eval mode.
        K: served number of draft tokens per round (``>= 1``).
        method: a registered draft method's name (``"peagle"``: one forward over the mask slots,
            vLLM ``parallel_drafting``; ``"eagle3"``: a chain of forwards), whose
            :meth:`~peagle_train.methods.base.DraftMethod.draft_round` proposes each round;
            ``None``: the method the drafter config describes (:func:`~peagle_train.methods.method_of_config`).

    Raises:
        ValueError: ``K < 1``; an unknown method; what the method's ``check_served_K`` refuses
            (P-EAGLE: ``K`` above the trained ``drafter.config.num_parallel_depths``, since mask
            depths beyond it were never trained and vLLM does not check this, spec §4; a drafter
            without ``mask_token_id`` / ``mask_hidden``).
    """

    def __init__(self, drafter: Drafter, K: int, method: str | None = None):
        self.method = method_of_config(drafter.config) if method is None else get_method(method)
        if K < 1:
            raise ValueError(f"served K must be >= 1 (got {K})")
        self.method.check_served_K(drafter, K)
        self.drafter, self.K = drafter, K
        self.kv: list | None = None  # per layer (k, v) [1, nkv, num_cached, hd], context slots only
        self.num_cached = 0  # committed context slots = positions 0 .. num_cached-1
        self._vocab_ids = torch.arange(drafter.d2t.numel(), device=drafter.d2t.device) + drafter.d2t  # [Vd]

    @property
    def device(self) -> torch.device:
        return self.drafter.fc.weight.device

    def forward(self, tokens, hidden, positions, past):
        """The drafter over new slots ``tokens [n]`` / ``hidden [n, H]`` / ``positions [n]``, causal over
        ``past`` (per-layer ``(k, v)``) and themselves → ``(h [n, H], kv)``."""
        spec = AttnSpec(dense=_causal(tokens.numel(), 0 if past is None else past[0][0].shape[2], self.device))
        return self.drafter(tokens, hidden, positions, spec, past)

    def _pick(self, logits: torch.Tensor, sampling: bool, temperature: float, generator):
        """``logits [Vd]`` → (target id 0-dim int64, q ``[V]`` or None); ``logits [R, Vd]`` → (ids ``[R]``, q
        ``[R, V]`` or None), greedy in one argmax (P-EAGLE's K drafts of a round at once), sampled row by row in
        order (the generator draws as for R single rows)."""
        if not sampling:
            return self._vocab_ids[logits.argmax(-1)], None
        if logits.dim() == 2:
            rows = [self._pick(row, sampling, temperature, generator) for row in logits]
            return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        probs = _probs(logits, temperature)  # [Vd]
        idx = torch.multinomial(probs, 1, generator=generator)[0]
        q = probs.new_zeros(self.drafter.t2d.numel()).scatter_(0, self._vocab_ids, probs)  # [V]
        return self._vocab_ids[idx], q

    @torch.no_grad()
    def propose(
        self,
        ctx_tokens: torch.Tensor,
        ctx_aux: torch.Tensor,
        *,
        sampling: bool = False,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Append the newly verified context slots and draft ``K`` tokens.

        Args:
            ctx_tokens: ``[n]`` int64, ``x[j+1]`` for the new positions ``j = num_cached ..
                num_cached+n-1``; the last one is the bonus token ``b`` (so ``n >= 1``).
            ctx_aux: ``[n, A*T]`` target aux states ``aux[j]`` of the same positions.
            sampling: sample drafts from ``softmax(logits / temperature)`` instead of argmax.
            generator: ``torch.Generator`` on the drafter's device (sampling only).

        Returns:
            :class:`Proposal` with ``K`` drafts; the context slots' KV is now cached.
        """
        d = self.drafter
        n, P = ctx_tokens.numel(), self.num_cached
        if n < 1 or ctx_aux.shape[0] != n:
            raise ValueError(f"need n >= 1 context slots with one aux row each (tokens {n}, aux {tuple(ctx_aux.shape)})")
        dev = self.device
        ctx_tokens = ctx_tokens.to(dev)
        hidden = d.project_aux(ctx_aux.to(device=dev, dtype=d.fc.weight.dtype))  # [n, H]
        positions = torch.arange(P, P + n, device=dev)
        logits, picks = self.method.draft_round(self, ctx_tokens, hidden, positions,
                                                lambda row: self._pick(row, sampling, temperature, generator))
        self.num_cached = P + n
        draft_ids = torch.stack([p[0] for p in picks])
        q = torch.stack([p[1] for p in picks]) if sampling else None
        return Proposal(draft_ids=draft_ids, draft_logits=logits, q=q)


def _eos_set(eos_token_id) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def _finished(out: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    """Truncate ``out`` in place at the first EOS (kept) or at ``max_new_tokens``; True when done."""
    for i, tok in enumerate(out[:max_new_tokens]):
        if tok in eos:
            del out[i + 1 :]
            return True
    if len(out) >= max_new_tokens:
        del out[max_new_tokens:]
        return True
    return False


def _next_token(logits: torch.Tensor, sampling: bool, temperature: float, generator) -> int:
    if not sampling:
        return int(logits.argmax())
    return int(torch.multinomial(_probs(logits, temperature), 1, generator=generator)[0])


def _prompt_tensor(prompt_ids, device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.int64, device=device).flatten()
    if ids.numel() < 1:
        raise ValueError("prompt_ids must hold at least one token")
    return ids


def _check_sampling(sampling: bool, temperature: float, max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (got {max_new_tokens})")
    if sampling and not temperature > 0:
        raise ValueError(f"sampling needs temperature > 0 (got {temperature})")


@torch.no_grad()
def target_generate(
    target: Target,
    prompt_ids,
    max_new_tokens: int,
    *,
    sampling: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id=None,
    runner: TargetRunner | None = None,
) -> tuple[list[int], TargetStats]:
    """Target-alone decoding, one token per forward (a ``DynamicCache`` unless ``runner`` says otherwise).

    The baseline for the lossless check and for tokens/s. Stopping rule shared with
    :func:`speculative_generate`: stop after ``max_new_tokens`` tokens or after the first
    EOS (included).

    Args:
        prompt_ids: ``[N]`` int token ids (list or tensor).
        sampling: sample from ``softmax(logits / temperature)``; greedy argmax otherwise.
        generator: ``torch.Generator`` on the target's device (sampling only).
        eos_token_id: int, iterable of ints, or None.
        runner: the target's forward and KV cache (:class:`TargetRunner`; None: a dynamic one). Pass the
            same static runner to :func:`speculative_generate` so both time the same kind of forward.

    Returns:
        ``(new token ids list[int], TargetStats)``.

    Raises:
        ValueError: empty prompt, ``max_new_tokens < 1``, sampling with ``temperature <= 0``.
    """
    _check_sampling(sampling, temperature, max_new_tokens)
    dev = target.device
    ids = _prompt_tensor(prompt_ids, dev)
    eos = _eos_set(eos_token_id)
    stats = TargetStats()
    _sync(dev)
    start = time.perf_counter()
    runner = runner or TargetRunner(target)
    runner.start(ids.numel() + max_new_tokens)
    logits, _ = runner.forward(ids, want_aux=False, prefill=True)
    out = [_next_token(logits[-1], sampling, temperature, generator)]
    _sync(dev)
    stats.prefill_s = time.perf_counter() - start
    while not _finished(out, max_new_tokens, eos):
        logits, _ = runner.forward(torch.tensor([out[-1]], device=dev), want_aux=False)
        out.append(_next_token(logits[-1], sampling, temperature, generator))
    _sync(dev)
    stats.total_s = time.perf_counter() - start
    stats.new_tokens = len(out)
    return out, stats


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompt_ids,
    K: int,
    max_new_tokens: int,
    *,
    sampling: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id=None,
    method: str | None = None,
    accept_rule: AcceptRule | None = None,
    runner: TargetRunner | None = None,
) -> tuple[list[int], SpecStats]:
    """Speculative decoding of one request with the drafter's layout of spec §4.

    Each round the drafter proposes ``K`` tokens (:class:`DraftSession`), the target runs one
    forward over ``[b, d1..dK]`` (``K+1`` positions, hooks on the tapped layers for the aux
    states of the newly accepted positions), acceptance is :func:`verify_greedy` or
    :func:`verify_sampling`, and the target's KV cache drops the rejected drafts
    (:meth:`TargetRunner.drop`). Greedy output is token-for-token the target's greedy output, up to floating-point
    differences between a ``K+1``-token and a 1-token forward, which can flip a near-tied argmax
    in bf16/fp16 (run lossless checks in float32); sampled output has the target's distribution.
    vLLM's padding slots for rejected drafts are omitted: they write no KV and nothing attends them.

    Args:
        target: the verifier. drafter: a :class:`Drafter` on the target's device.
        prompt_ids: ``[N]`` int token ids (list or tensor), ``N >= 1``.
        K: served draft tokens per round. max_new_tokens: exact cap on returned tokens.
        sampling / temperature / generator: as :func:`target_generate` (the drafter samples
            its drafts at the same temperature).
        eos_token_id: int, iterable of ints, or None; output stops after the first EOS.
        method: a registered draft method name (``"peagle"`` / ``"eagle3"``) or None (from the drafter config).
        accept_rule: test hook for :func:`verify_sampling`; leave None.
        runner: the target's forward and KV cache (:class:`TargetRunner`; None: a dynamic one, eager).

    Returns:
        ``(new token ids list[int], SpecStats)``; the last round may verify more tokens than are
        returned (its acceptance still counts in the stats).

    Raises:
        ValueError: see :class:`DraftSession`, :func:`target_generate`.
    """
    _check_sampling(sampling, temperature, max_new_tokens)
    session = DraftSession(drafter, K, method)
    dev = target.device
    ids = _prompt_tensor(prompt_ids, dev)
    eos = _eos_set(eos_token_id)
    stats = SpecStats(K=K)
    _sync(dev)
    start = time.perf_counter()
    runner = runner or TargetRunner(target)
    runner.start(ids.numel() + max_new_tokens + K + 1)  # the last round may verify K + 1 past the cap
    logits, aux = runner.forward(ids, want_aux=True, prefill=True)  # [N, V], [N, A*T]
    out = [_next_token(logits[-1], sampling, temperature, generator)]  # x[N], the first bonus
    _sync(dev)
    stats.prefill_s = time.perf_counter() - start
    ctx_tokens = torch.cat([ids[1:], torch.tensor(out, device=dev)])  # x[1..N]: every prompt slot
    while not _finished(out, max_new_tokens, eos):
        t0 = time.perf_counter()
        prop = session.propose(ctx_tokens, aux, sampling=sampling, temperature=temperature, generator=generator)
        _sync(dev)
        t1 = time.perf_counter()
        verify_in = torch.cat([torch.tensor([out[-1]], device=dev), prop.draft_ids.to(dev)])  # [K+1]
        logits, aux_v = runner.forward(verify_in, want_aux=True)  # [K+1, V], [K+1, A*T]
        if sampling:
            a, nxt = verify_sampling(prop.draft_ids, prop.q, _probs(logits, temperature), generator, accept_rule)
        else:
            a, nxt = verify_greedy(prop.draft_ids, logits)
        runner.drop(K - a)  # keep b, d1..da; drop rejected drafts
        new = verify_in[1 : a + 1].tolist() + [nxt]
        out.extend(new)
        ctx_tokens = torch.tensor(new, device=dev)  # x[j+1] for the new context positions
        aux = aux_v[: a + 1]  # aux of b, d1..da's positions
        _sync(dev)
        stats.draft_s.append(t1 - t0)
        stats.verify_s.append(time.perf_counter() - t1)
        stats.accepted.append(a)
    _sync(dev)
    stats.total_s = time.perf_counter() - start
    stats.new_tokens = len(out)
    return out, stats


__all__ = [
    "AcceptRule", "DraftSession", "Proposal", "SpecStats", "TargetRunner", "TargetStats", "acceptance_length",
    "per_position_acceptance", "speculative_generate", "standard_accept_rule", "target_generate",
    "verify_greedy", "verify_sampling",
]
