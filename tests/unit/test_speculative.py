"""Reference speculative-decoding loop (peagle_train/decoding/speculative.py, spec §4).

Tiny random Llama targets and drafters on CPU:

* greedy output is token-for-token the target's greedy output for every served K = 1..7,
  P-EAGLE and EAGLE-3, ``Vd < V`` and ``Vd == V``, with drafters that get some rounds fully
  accepted, some partially, some rejected (so the target cache crop runs at every depth);
* an oracle: a target that always emits token ``c`` and a drafter that always drafts it
  accepts everything (AL = K + 1); a drafter that never drafts it accepts nothing;
* the drafter session's incremental layout equals a from-scratch forward of the whole
  ``[context, bonus, masks]`` sequence (P-EAGLE) / of the whole chain (EAGLE-3);
* sampling is lossless in distribution: a chi-square goodness-of-fit test against the exact
  target distribution of 3-token continuations accepts drafted sampling (P-EAGLE, EAGLE-3) and
  target-alone sampling and rejects two wrong acceptance rules; the rejection rule alone is
  checked with many more draws on a Markov-chain "target" (catches a wrong residual or bonus row).
"""
from __future__ import annotations

import collections
import gc
import itertools

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from peagle_train.decoding.speculative import (
    DraftSession,
    acceptance_length,
    per_position_acceptance,
    speculative_generate,
    target_generate,
    verify_greedy,
    verify_sampling,
)
from peagle_train.features.target import Target
from peagle_train.kernels.attention import AttnSpec
from peagle_train.model.drafter import Drafter, make_drafter_config

AUX = [1, 2, 3]
C = 5  # the token biased targets favour


pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _biased(lin: nn.Linear, index: int, value: float) -> nn.Linear:
    """Same weights plus a bias vector that adds ``value`` to output ``index``."""
    new = nn.Linear(lin.in_features, lin.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(lin.weight)
        new.bias.zero_()
        new.bias[index] = value
    return new


def make_target(V=64, hidden=32, layers=4, init=0.1, seed=0, c_quantile=None, c_bias=None) -> Target:
    """Random Llama target. ``c_quantile``: bias token C so it is the argmax at about that
    fraction of random contexts; ``c_bias``: a fixed bias on C."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=init)
    m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    if c_quantile is not None:
        with torch.no_grad():
            lg = m(input_ids=torch.randint(0, V, (1, 200))).logits[0]
        c_bias = float((lg.max(-1).values - lg[:, C]).quantile(c_quantile))
    if c_bias is not None:
        m.lm_head = _biased(m.lm_head, C, c_bias)
    return Target(model=m, tokenizer=None, aux_layer_ids=AUX, path="")


def make_drafter(target: Target, *, parallel=True, Vd=None, K=7, layers=2, std=0.1, seed=1,
                 bias_token=None, bias=0.0, mask_token_id=None) -> Drafter:
    V = target.config.vocab_size
    Vd = Vd or V
    cfg = make_drafter_config(target.config, aux_layer_ids=AUX, draft_vocab_size=Vd,
                              mask_token_id=V - 1 if mask_token_id is None else mask_token_id, K=K,
                              num_layers=layers, parallel_drafting=parallel)
    torch.manual_seed(seed)
    d = Drafter(cfg).eval().requires_grad_(False)
    d.reset_parameters(std)
    if Vd < V:  # every third id dropped, C kept
        keep = [i for i in range(V) if i % 3 != 2 or i == C][:Vd]
        assert len(keep) == Vd and C in keep
        d.set_draft_vocab(torch.tensor(keep))
    if bias_token is not None:
        ids = (torch.arange(Vd) + d.d2t).tolist()
        d.lm_head = _biased(d.lm_head, ids.index(bias_token), bias)
    return d


def prompts(V, n=2, length=10):
    return [torch.randint(0, V - 1, (length,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(n)]


# --------------------------------------------------------------------------- greedy: lossless


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
@pytest.mark.parametrize("reduced_vocab", [False, True], ids=["Vd=V", "Vd<V"])
def test_greedy_identical_to_target_for_every_K(parallel, reduced_vocab):
    target = make_target(c_quantile=0.75)
    V = target.config.vocab_size
    # a drafter leaning towards C (multi-token acceptances) and a plain random one (varied drafts)
    drafters = [
        make_drafter(target, parallel=parallel, Vd=40 if reduced_vocab else None, bias_token=C, bias=2.0),
        make_drafter(target, parallel=parallel, Vd=40 if reduced_vocab else None, std=0.3, seed=2),
    ]
    hist = collections.Counter()
    for i, p in enumerate(prompts(V)):
        ref, _ = target_generate(target, p, 20)
        assert len(ref) == 20
        for K in range(1, 8):
            for d in drafters[: 2 - i]:  # the random drafter on the first prompt only (time)
                out, stats = speculative_generate(target, d, p, K, 20)
                assert out == ref, f"K={K}: speculative output diverges from the target's greedy output"
                hist.update(("none" if a == 0 else "all" if a == K else "some") for a in stats.accepted)
    # every verification branch ran: full rejection, partial acceptance (crop mid-way), full acceptance
    assert hist["none"] > 0 and hist["some"] > 0 and hist["all"] > 0, hist


def test_eos_stops_both_loops_at_the_same_token():
    target = make_target(c_quantile=0.75)
    d = make_drafter(target, bias_token=C, bias=2.0)
    p = prompts(64, 1)[0]
    full, _ = target_generate(target, p, 30)
    eos = full[7]
    first = full.index(eos)
    ref, _ = target_generate(target, p, 30, eos_token_id=eos)
    assert ref == full[: first + 1]
    for K in (1, 4, 7):
        out, stats = speculative_generate(target, d, p, K, 30, eos_token_id=[eos, 999])
        assert out == ref and stats.new_tokens == len(ref)


# --------------------------------------------------------------------------- acceptance oracle


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_oracle_perfect_drafter_accepts_everything(parallel):
    target = make_target(c_bias=1e4)  # the target's argmax is C whatever the context
    good = make_drafter(target, parallel=parallel, Vd=40, bias_token=C, bias=1e4)
    bad = make_drafter(target, parallel=parallel, Vd=40, bias_token=C + 1, bias=1e4)
    p = prompts(64, 1)[0]
    for K in (1, 3, 7):
        out, s = speculative_generate(target, good, p, K, 25)
        assert out == [C] * 25
        assert s.accepted == [K] * s.rounds
        assert s.rounds == -(-24 // (K + 1))  # first token from the prefill, K+1 per round after
        assert s.acceptance_length == K + 1
        assert s.per_position() == [1.0] * K
        out, s = speculative_generate(target, bad, p, K, 25)
        assert out == [C] * 25
        assert s.accepted == [0] * 24 and s.acceptance_length == 1.0
        pp = s.per_position()
        assert pp[0] == 0.0 and all(x != x for x in pp[1:])  # later positions never reached: NaN


def test_stats_are_consistent():
    target = make_target(c_quantile=0.75)
    d = make_drafter(target, bias_token=C, bias=2.0)
    p = prompts(64, 1)[0]
    out, s = speculative_generate(target, d, p, 4, 30)
    acc = s.accepted
    assert len(s.draft_s) == len(s.verify_s) == s.rounds == len(acc) > 0
    assert all(0 <= a <= 4 for a in acc)
    produced = 1 + sum(a + 1 for a in acc)  # prefill token + (accepted + correction/bonus) per round
    assert produced >= 30 > produced - (acc[-1] + 1)  # the last round crossed max_new_tokens
    assert len(out) == s.new_tokens == 30
    assert s.acceptance_length == pytest.approx(sum(acc) / len(acc) + 1)
    for i, rate in enumerate(s.per_position(), start=1):
        reached = [a for a in acc if a >= i - 1]
        assert rate == pytest.approx(sum(a >= i for a in reached) / len(reached))
    assert s.tokens_per_s == pytest.approx(30 / s.total_s)
    assert s.total_s >= s.prefill_s + sum(s.draft_s) + sum(s.verify_s) > 0
    d_ = s.to_dict()
    assert d_["accepted"] == acc and d_["acceptance_length"] == s.acceptance_length


def test_acceptance_helpers_by_hand():
    assert acceptance_length([0, 2, 3]) == pytest.approx((1 + 3 + 4) / 3)
    # K=3: position 1 reached 3x accepted 2x; position 2 reached 2x accepted 2x; position 3 reached 2x accepted 1x
    assert per_position_acceptance([0, 2, 3], 3) == pytest.approx([2 / 3, 1.0, 0.5])


def test_verify_greedy_by_hand():
    logits = torch.full((4, 6), -1.0)
    for row, tok in enumerate([2, 4, 1, 3]):
        logits[row, tok] = 1.0
    assert verify_greedy(torch.tensor([2, 4, 1]), logits) == (3, 3)  # all accepted, bonus 3
    assert verify_greedy(torch.tensor([2, 0, 1]), logits) == (1, 4)  # d2 rejected, correction 4
    assert verify_greedy(torch.tensor([0, 4, 1]), logits) == (0, 2)


def test_served_K_above_trained_K_is_refused():
    target = make_target()
    d = make_drafter(target, K=3)
    with pytest.raises(ValueError, match="trained K"):
        DraftSession(d, 4)
    with pytest.raises(ValueError, match="trained K"):
        speculative_generate(target, d, [1, 2, 3], 4, 5)
    with pytest.raises(ValueError, match=">= 1"):
        DraftSession(d, 0)
    DraftSession(make_drafter(target, parallel=False, K=3), 5)  # chain drafting has no such limit


# --------------------------------------------------------------------------- session layout


def _dense_causal(E):
    return AttnSpec(dense=torch.ones(E, E, dtype=torch.bool).tril())


def test_parallel_session_equals_from_scratch_forward():
    """Incremental rounds (context slots cached, mask slots dropped) == one forward over
    ``[x1..x_{t+1} | mask * (K-1)]`` with hidden ``[fc(aux[0..t]) | fc(mask_hidden)]`` and
    positions ``0..t+K-1`` under a dense causal mask."""
    torch.manual_seed(3)
    target = make_target()
    K = 4
    d = make_drafter(target, K=K, std=0.3)
    A_T = 3 * target.config.hidden_size
    x = torch.randint(0, 63, (40,))  # committed tokens x[0..]
    aux = torch.randn(40, A_T)  # aux[j]
    s = DraftSession(d, K)
    t = 6  # prefill: prompt x[0..6] (7 tokens), bonus x[7]
    ctx = (torch.arange(0, t + 1),)  # new context positions this round
    for a in [None, 0, 3, K, 1, 0, 2]:  # accepted per round (None = first proposal after prefill)
        if a is not None:
            ctx = (torch.arange(t + 1, t + a + 2),)
            t = t + a + 1
        pos = ctx[0]
        prop = s.propose(x[pos + 1], aux[pos])
        tokens = torch.cat([x[1 : t + 2], torch.full((K - 1,), d.mask_token_id)])
        hidden = torch.cat([d.project_aux(aux[: t + 1]), d.mask_hidden_projected().expand(K - 1, -1)])
        h, _ = d(tokens, hidden, torch.arange(t + K), _dense_causal(t + K))
        ref = d.logits(h[t:])  # bonus slot and mask slots
        torch.testing.assert_close(prop.draft_logits, ref, atol=1e-5, rtol=0)
        assert torch.equal(prop.draft_ids, ref.argmax(-1) + d.d2t[ref.argmax(-1)])
        assert s.num_cached == t + 1 and s.kv[0][0].shape[2] == t + 1  # mask-slot KV dropped


def test_eagle3_session_equals_from_scratch_chain():
    """Chain step k: token = draft k-1, hidden = previous pre-norm output, position t+k-1;
    reference recomputes the whole ``[context | chain]`` sequence without a cache each step."""
    torch.manual_seed(4)
    target = make_target()
    K = 3
    d = make_drafter(target, parallel=False, K=K, Vd=40, std=0.3)
    A_T = 3 * target.config.hidden_size
    x = torch.randint(0, 63, (30,))
    aux = torch.randn(30, A_T)
    s = DraftSession(d, K)
    t, new = 5, torch.arange(0, 6)
    for a in [None, 0, 2, K, 1]:
        if a is not None:
            new = torch.arange(t + 1, t + a + 2)
            t = t + a + 1
        prop = s.propose(x[new + 1], aux[new])
        toks, hid = x[1 : t + 2], d.project_aux(aux[: t + 1])
        rows = []
        for k in range(K):
            E = toks.numel()
            h, _ = d(toks, hid, torch.arange(E), _dense_causal(E))
            rows.append(d.logits(h[-1]))
            draft = rows[-1].argmax() + d.d2t[rows[-1].argmax()]
            toks, hid = torch.cat([toks, draft.view(1)]), torch.cat([hid, h[-1:]])
        torch.testing.assert_close(prop.draft_logits, torch.stack(rows), atol=1e-5, rtol=0)
        assert s.num_cached == t + 1 and s.kv[0][0].shape[2] == t + 1  # chain KV dropped


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_loop_feeds_the_session_the_verified_context(parallel, monkeypatch):
    """Inside speculative_generate, the session receives exactly the committed context: tokens
    ``x[1..t+1]`` (prompt, then accepted drafts and correction/bonus tokens) and the target's aux
    states ``aux[0..t]`` (equal to a from-scratch target forward), round after round."""
    target = make_target(c_quantile=0.75)
    d = make_drafter(target, parallel=parallel, Vd=40, bias_token=C, bias=2.0)
    seen = []
    original = DraftSession.propose

    def spy(self, ctx_tokens, ctx_aux, **kw):
        seen.append((self.num_cached, ctx_tokens.clone(), ctx_aux.clone()))
        return original(self, ctx_tokens, ctx_aux, **kw)

    monkeypatch.setattr(DraftSession, "propose", spy)
    p = prompts(64, 1)[0]
    out, stats = speculative_generate(target, d, p, 3, 20)
    assert len(seen) == stats.rounds and any(0 < a < 3 for a in stats.accepted)
    x = torch.tensor(p + out)
    full_aux = target.features(x[None])["aux"][0]  # [N, A*T] from scratch, no cache
    t = -1
    for (cached, toks, aux), a in zip(seen, [None] + stats.accepted[:-1]):
        assert cached == t + 1
        n = len(p) if a is None else a + 1  # prompt slots first, then accepted + 1 per round
        assert toks.numel() == n
        assert torch.equal(toks, x[t + 2 : t + 2 + n])
        torch.testing.assert_close(aux, full_aux[t + 1 : t + 1 + n], atol=1e-4, rtol=1e-4)
        t += n


# --------------------------------------------------------------------------- sampling: lossless in distribution


def _exact_joint(target: Target, prompt, V):
    """Exact target probability of every 3-token continuation, ``[V, V, V]`` float64."""
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
    with torch.no_grad():
        p = torch.softmax(target.model(input_ids=seqs).logits.double(), -1)  # [V*V, N+2, V]
    p1, p2, p3 = p[0, -3], p[::V, -2], p[:, -1].view(V, V, V)
    return p1[:, None, None] * p2[:, :, None] * p3


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness-of-fit p-value; cells expecting < 5 counts are pooled into one.

    p = Q(df/2, X²/2), the chi-square survival function via the regularised upper
    incomplete gamma (``torch.special.gammaincc``)."""
    n = counts.sum()
    e, c = probs.flatten() * n, counts.flatten().double()
    big = e >= 5
    c = torch.cat([c[big], c[~big].sum().view(1)])
    e = torch.cat([e[big], e[~big].sum().view(1)])
    stat = ((c - e) ** 2 / e).sum()
    df = c.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _sample_counts(fn, V, runs, seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, V)
    for _ in range(runs):
        out = fn(g)
        counts[tuple(out)] += 1
    return counts


@pytest.fixture(scope="module")
def sampling_setup():
    """V=8 target with peaked distributions; P-EAGLE and EAGLE-3 drafters over Vd=6 that
    disagree with it (q != p), so acceptance is neither always nor never."""
    V = 8
    target = make_target(V=V, init=0.5, seed=0)
    prompt = [1, 3, 5, 2]
    drafters = {}
    for parallel in (True, False):
        cfg = make_drafter_config(target.config, aux_layer_ids=AUX, draft_vocab_size=6, mask_token_id=V - 1, K=2,
                                  num_layers=1, parallel_drafting=parallel)
        torch.manual_seed(1)
        d = Drafter(cfg).eval().requires_grad_(False)
        d.reset_parameters(0.5)
        d.set_draft_vocab(torch.tensor([0, 1, 2, 4, 5, 6]))
        drafters["peagle" if parallel else "eagle3"] = d
    return target, drafters, prompt, _exact_joint(target, prompt, V)


def test_sampling_matches_target_distribution(sampling_setup):
    target, drafters, prompt, joint = sampling_setup
    V = 8
    accepted = []

    def spec(name, K):
        def run(g):
            out, s = speculative_generate(target, drafters[name], prompt, K, 3, sampling=True, generator=g)
            accepted.extend(s.accepted)
            return out
        return run

    base = _sample_counts(lambda g: target_generate(target, prompt, 3, sampling=True, generator=g)[0], V, 150, 0)
    assert _chi_square_p(base, joint) > 1e-3
    # K=2: x2, x3 come from draft positions 1, 2 (or a resample); K=1: x3 may be the bonus from p
    for name, K, runs in (("peagle", 2, 300), ("peagle", 1, 150), ("eagle3", 2, 150)):
        accepted.clear()
        counts = _sample_counts(spec(name, K), V, runs, 1)
        assert _chi_square_p(counts, joint) > 1e-3, (name, K)
        assert 0 < sum(accepted) < K * len(accepted)  # both branches of the rule ran


@pytest.mark.parametrize(
    "rule",
    [lambda p, q: torch.ones_like(p), lambda p, q: torch.clamp(q / p, max=1.0)],
    ids=["always-accept", "min(1,q/p)"],
)
def test_wrong_acceptance_rule_is_detected(sampling_setup, rule):
    target, drafters, prompt, joint = sampling_setup
    counts = _sample_counts(
        lambda g: speculative_generate(target, drafters["peagle"], prompt, 2, 3, sampling=True, generator=g,
                                       accept_rule=rule)[0], 8, 100, 1)
    assert _chi_square_p(counts, joint) < 1e-6


def _markov_samples(P, Q, parallel, K, runs, seed, accept_rule=None):
    """Speculative sampling of 3 tokens from a Markov-chain 'target' ``P [V, V]`` (row = previous
    token) with drafts from ``Q [K, V, V]``: chain drafting ``d_i ~ Q[i, d_{i-1}]`` or parallel
    drafting ``d_i ~ Q[i, s]`` (every depth conditioned on the round's start token ``s`` only)."""
    g = torch.Generator().manual_seed(seed)
    V = P.shape[0]
    counts = torch.zeros(V, V, V)
    for _ in range(runs):
        seq = [0]
        while len(seq) < 4:
            s, drafts, q = seq[-1], [], []
            for i in range(K):
                row = Q[i, s if parallel or i == 0 else drafts[-1]]
                drafts.append(int(torch.multinomial(row, 1, generator=g)))
                q.append(row)
            p = P[torch.tensor([s] + drafts)]  # [K+1, V]: target rows after s, d1, .., dK
            a, nxt = verify_sampling(torch.tensor(drafts), torch.stack(q), p, g, accept_rule)
            seq += drafts[:a] + [nxt]
        counts[tuple(seq[1:4])] += 1
    return counts


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "chain"])
def test_rejection_rule_is_exact_on_a_markov_chain(parallel):
    """verify_sampling alone, many draws: the emitted 3-token sequences follow the chain ``P``;
    mutated rules (always accept; min(1, q/p)) and a drafter-independent resample are rejected."""
    torch.manual_seed(5)
    V, K = 6, 2  # K=2: a fully accepted round puts its bonus token inside the 3 counted tokens
    P = torch.softmax(2.0 * torch.randn(V, V, dtype=torch.float64), -1)
    Q = 0.5 * P + 0.5 * torch.softmax(2.0 * torch.randn(K, V, V, dtype=torch.float64), -1)
    Q[..., 3] = 0  # a token outside the draft vocab: reachable only through the residual / bonus
    Q /= Q.sum(-1, keepdim=True)
    exact = P[0][:, None, None] * P[:, :, None] * P[None]  # [V, V, V], start token 0
    counts = _markov_samples(P, Q, parallel, K, 3000, 0)
    assert _chi_square_p(counts, exact) > 1e-3
    for rule in (lambda p, q: torch.ones_like(p), lambda p, q: torch.clamp(q / p, max=1.0)):
        assert _chi_square_p(_markov_samples(P, Q, parallel, K, 1000, 0, rule), exact) < 1e-6


# --------------------------------------------------------------------------- simulated AL = measured AL


def test_walk_accepted_by_hand():
    from peagle_train.peagle.spec_stats import walk_accepted

    n, K = 12, 3
    ok = torch.zeros(n, K, dtype=torch.bool)
    sup = torch.zeros(n, K, dtype=torch.bool)
    sup[3:10] = True  # anchors 3..9 supervised (response tokens x[5..]), deeper ones everywhere
    ok[4] = torch.tensor([True, True, False])   # round at anchor 4: 2 accepted -> next anchor 7
    ok[7] = torch.tensor([True, True, True])    # 3 accepted -> next anchor 11 (unsupervised: stop)
    # P = 5: the first round drafts from anchor 4
    assert walk_accepted(ok, sup, 5, K) == [2, 3]
    assert walk_accepted(ok, sup, 5, 2) == [2, 2]  # served K=2: anchors 4 -> 7 -> 10 (unsupervised: stop)
    assert walk_accepted(ok, sup, 5, K, horizon=3) == [2]  # 1 (prefill) + 3 tokens >= 3: the loop stops
    assert walk_accepted(ok, sup, 5, K, horizon=1) == []
    with pytest.raises(ValueError, match="exceeds the trained depths"):
        walk_accepted(ok, sup, 5, 4)


@pytest.mark.parametrize("reduced_vocab", [False, True], ids=["Vd=V", "Vd<V"])
@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_walked_training_predictions_equal_the_decoding_loop(parallel, reduced_vocab):
    """Training-grid predictions replayed by walk_accepted give, round for round, the accepted
    counts of the real decoding loop on the target's own greedy output (every served K)."""
    from peagle_train.features.online import OnlineFeatures
    from peagle_train.features.packing import pack, pack_tokens
    from peagle_train.methods.eagle3 import Eagle3Objective
    from peagle_train.methods.peagle import PEagleObjective
    from peagle_train.peagle.grid import build_grid, cod_sample
    from peagle_train.peagle.spec_stats import acceptance_length, chain_matrix, walk_accepted

    target = make_target(c_quantile=0.4 if reduced_vocab else 0.75)
    V = target.config.vocab_size
    drafter = make_drafter(target, parallel=parallel, bias_token=None if reduced_vocab else C, bias=2.0,
                           Vd=40 if reduced_vocab else None)
    if reduced_vocab:  # a draft vocab without tokens 3 and 4, which this target emits between runs of C
        keep = [i for i in range(V) if i not in (3, 4)][:40]
        drafter.set_draft_vocab(torch.tensor(keep))
        drafter.lm_head = _biased(drafter.lm_head, keep.index(C), 2.0)
    H, K = 24, 7
    total_rounds, out_of_vocab, best = 0, 0, 0
    for p in prompts(V):
        # the sequence runs K+1 tokens past the horizon: the loop's last round verifies drafts
        # beyond max_new_tokens (then truncates), and the walk needs those labels too
        ref, _ = target_generate(target, p, H + K + 1)
        seq = p + ref
        lm = [0] * len(p) + [1] * len(ref)
        feats = OnlineFeatures(target, [seq])
        packed = pack(feats.get([0]), pack_tokens([seq], [lm]), "cpu")
        kept = cod_sample(packed["loss_mask"], packed["doc_ids"], K, 1.0, 1.0)
        mask_id = drafter.config.mask_token_id if parallel else 0
        grid = build_grid(packed["input_ids"], packed["loss_mask"], packed["doc_ids"], kept, mask_id)
        head = feats.target_head()[(torch.arange(drafter.config.draft_vocab_size) + drafter.d2t)]
        args = (grid, packed["aux"], packed["last"], packed["argmax"], 1.0)
        if parallel:
            _, pred = PEagleObjective(drafter, head, attention="sdpa")(*args)
        else:
            _, pred = Eagle3Objective(drafter, head, attention="sdpa")(*args, input_ids=packed["input_ids"])
        tgt = packed["argmax"][grid.label_index]
        correct = (drafter.draft_to_target(pred) == tgt) & drafter.t2d[tgt]
        sup = grid.loss_weight > 0
        out_of_vocab += int((sup & ~drafter.t2d[tgt]).sum())
        ok_t, sup_t = chain_matrix(grid.anchor, grid.depth, correct, sup, len(seq), K)
        for k in range(1, K + 1):
            _, stats = speculative_generate(target, drafter, p, k, H)
            walked = walk_accepted(ok_t, sup_t, len(p), k, horizon=H)
            assert walked == stats.accepted, f"K={k}"
            assert acceptance_length(walked) == stats.acceptance_length
            total_rounds += len(walked)
            best = max([best, *walked])
    assert total_rounds > 0
    assert (out_of_vocab > 0) == reduced_vocab  # Vd < V: the responses hold tokens the drafter cannot draft
    assert best >= (1 if reduced_vocab else 2)  # accepted drafts (multi-token with Vd = V): the walk is exercised


# --------------------------------------------------------------------------- the static target runner (eval.compile_target)


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_static_target_runner_decodes_as_the_dynamic_one(parallel):
    """One static KV cache reused by every request (rejected drafts dropped by moving its write position back,
    stale keys left in place) gives the dynamic cache's tokens and acceptances, target alone and speculative,
    float64; the cache grows in blocks when a longer request comes (5, 12 then 30 prompt tokens, blocks of 16)."""
    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target(c_quantile=0.75)
    target.model.double()
    V = target.config.vocab_size
    drafters = [make_drafter(target, parallel=parallel, bias_token=C, bias=2.0).double(),  # long acceptances
                make_drafter(target, parallel=parallel, std=0.3, seed=2).double()]  # rejections
    static = TargetRunner(target, static=True, compile=True, block=16)  # compile: CUDA only, eager on a CPU
    assert not static.compile
    sizes, hist = [], collections.Counter()
    for length in (5, 12, 30):
        p = torch.randint(0, V - 1, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        ref, _ = target_generate(target, p, 20)
        assert target_generate(target, p, 20, runner=static)[0] == ref
        for K, d in itertools.product((1, 3, 7), drafters):
            out, st = speculative_generate(target, d, p, K, 20)
            out_s, st_s = speculative_generate(target, d, p, K, 20, runner=static)
            assert out == out_s == ref and st.accepted == st_s.accepted, (length, K)
            hist.update(("none" if a == 0 else "all" if a == K else "some") for a in st.accepted)
        sizes.append(static._max_len)
    assert hist["none"] > 0 and hist["some"] > 0 and hist["all"] > 0, hist  # every drop: K, part of K, none
    assert sizes == [48, 48, 64]  # 5+20+(7+1) = 33 -> 48, 12+20+8 = 40 fits, 30+20+8 = 58 -> 64


@pytest.mark.parametrize("parallel", [True, False], ids=["peagle", "eagle3"])
def test_eager_attention_target_decodes_as_the_sdpa_one(parallel):
    """The target on eager attention (matmul + softmax: ``target.attn_implementation=eager``, which
    ``EVAL_COMPILE=profile`` picks where decode_profile.py finds it faster) gives the SDPA target's greedy tokens and
    acceptances, target alone and speculative, through the dynamic cache and the static runner (stale keys
    masked), float32; the two are the same weights, only the kernel differs."""
    from peagle_train.decoding.target_runner import TargetRunner

    sdpa = make_target(c_quantile=0.75)
    sdpa.model.set_attn_implementation("sdpa")
    eager = make_target(c_quantile=0.75)
    eager.model.set_attn_implementation("eager")
    assert (sdpa.model.config._attn_implementation, eager.model.config._attn_implementation) == ("sdpa", "eager")
    V = sdpa.config.vocab_size
    drafters = [make_drafter(sdpa, parallel=parallel, bias_token=C, bias=2.0),  # long acceptances
                make_drafter(sdpa, parallel=parallel, std=0.3, seed=2)]  # rejections
    hist = collections.Counter()
    for static in (False, True):
        runners = [TargetRunner(t, static=static, block=16) for t in (sdpa, eager)]
        for length in (5, 12, 30):
            p = torch.randint(0, V - 1, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            ref = [target_generate(t, p, 20, runner=r)[0] for t, r in zip((sdpa, eager), runners)]
            assert ref[0] == ref[1], (static, length)
            for K, d in itertools.product((1, 3, 7), drafters):
                (out_s, st_s), (out_e, st_e) = (speculative_generate(t, d, p, K, 20, runner=r)
                                                for t, r in zip((sdpa, eager), runners))
                assert out_s == out_e == ref[0] and st_s.accepted == st_e.accepted, (static, length, K)
                hist.update(("none" if a == 0 else "all" if a == K else "some") for a in st_s.accepted)
        for r in runners:
            r.close()
    assert hist["none"] > 0 and hist["some"] > 0 and hist["all"] > 0, hist  # every drop: K, part of K, none


def test_static_target_runner_refuses_what_it_cannot_hold():
    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target()
    with pytest.raises(ValueError, match="compile needs static=True"):
        TargetRunner(target, compile=True)
    r = TargetRunner(target, static=True, block=8)
    r.start(8)
    r.forward(torch.arange(6), want_aux=False, prefill=True)
    with pytest.raises(ValueError, match="6 \\+ 3 positions exceed the static cache's 8"):
        r.forward(torch.arange(3), want_aux=False)
    r.drop(2)
    assert r.length == 4 and r.forward(torch.arange(3), want_aux=True)[1].shape == (3, 3 * 32)
    assert r.kind == "static" and r.fallback is None


def test_static_target_runner_falls_back_to_eager_when_the_compiled_forward_fails():
    """A compiled forward that raises (a CUDA-graph or compile failure on the GPU) is given up for the eager
    one from that round on, with the same logits, and the reason is kept for the report."""
    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target()
    r = TargetRunner(target, static=True, block=16)
    r.start(12)
    r.forward(torch.arange(5), want_aux=False, prefill=True)

    def broken(**kw):
        kw["cache"if "cache" in kw else "past_key_values"].layers[0].cumulative_length.add_(3)  # half-done writes
        raise RuntimeError("CUDA graph capture failed")

    r._step = broken
    assert r.kind == "static+cuda-graphs"
    logits, _ = r.forward(torch.arange(5, 8), want_aux=False)
    full = target.model(input_ids=torch.arange(8)[None]).logits[0]
    torch.testing.assert_close(logits, full[5:8], rtol=1e-5, atol=1e-5)
    assert r.kind == "static" and "CUDA graph capture failed" in r.fallback and r.length == 8


def test_compiled_target_forward_has_no_graph_break_and_the_aux_states_of_output_hidden_states():
    """The static runner's compiled forward (here torch.compile's ``eager`` backend, which runs Dynamo's
    tracing without CUDA graphs) is one graph per query length, with or without aux states, and no graph
    break: the aux states come from hooks on the tapped layers, not ``output_hidden_states`` (transformers
    installs its output-recording hooks at the first call that asks for hidden states; inside a compiled
    call that breaks the graph, 5.17 and 5.25). The aux states equal transformers' ``hidden_states`` at the
    tapped ids, and a runner that is closed or collected leaves no hook on the target."""
    from torch._dynamo.utils import counters

    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target()
    ids = torch.arange(9)
    full = target.model(input_ids=ids[None], output_hidden_states=True)
    want = torch.cat([full.hidden_states[i][0] for i in target.aux_layer_ids], dim=-1)
    hooked = lambda: sum(len(m._forward_hooks) for m in target.model.modules())  # noqa: E731
    before = hooked()
    torch._dynamo.reset()
    counters.clear()
    with TargetRunner(target, static=True, block=16) as r:
        assert hooked() == before + len(target.aux_layer_ids)
        r.start(12)
        r.forward(ids[:5], want_aux=False, prefill=True)  # eager; the first aux states come from compiled calls
        r._step = torch.compile(target.model, backend="eager", dynamic=False)
        for a, b in ((5, 7), (7, 9)):  # the same query length twice: one graph, no recompile
            logits, aux = r.forward(ids[a:b], want_aux=True)
            torch.testing.assert_close(aux, want[a:b], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(logits, full.logits[0, a:b], rtol=1e-5, atol=1e-5)
        assert r.forward(ids[:2], want_aux=False)[1] is None and r.kind == "static+cuda-graphs"
        r.drop(r.length)  # the eager prefill's aux states too
        torch.testing.assert_close(r.forward(ids[:5], want_aux=True, prefill=True)[1], want[:5], rtol=1e-5, atol=1e-5)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # aux on and off: one graph
    assert hooked() == before
    with pytest.raises(RuntimeError, match="closed"):
        r.forward(ids[:1], want_aux=False)
    TargetRunner(target)  # collected at once: its hooks go with it
    gc.collect()
    assert hooked() == before


def test_compiled_target_forward_reports_why_cuda_graphs_were_skipped():
    """When inductor runs a compiled forward without CUDA graphs (it logs "skipping cudagraphs due to ...", e.g.
    for mutated inputs), the runner keeps each reason once and names its kind ``static+compiled``, so the eval
    report says the forward was not graph-replayed; closing the runner stops listening."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target()
    with TargetRunner(target, static=True, block=16) as r:
        r.start(12)
        r.forward(torch.arange(5), want_aux=False, prefill=True)
        assert r.cudagraph_skips == []
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to an unrelated run")  # not listening yet

        def compiled_without_graphs(**kw):
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (2 instances)")
            return target.model(**kw)

        r._step = compiled_without_graphs
        assert r.kind == "static+cuda-graphs"
        for a in (5, 7):
            logits, _ = r.forward(torch.arange(a, a + 2), want_aux=True)
        assert r.cudagraph_skips == ["skipping cudagraphs due to mutated inputs (2 instances)"]
        assert r.kind == "static+compiled" and r.fallback is None
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a later run")
    assert r.cudagraph_skips == ["skipping cudagraphs due to mutated inputs (2 instances)"]


def test_picking_a_rounds_drafts_at_once_equals_picking_them_row_by_row():
    """DraftSession._pick on ``[R, Vd]`` (P-EAGLE's K drafts of a round in one call): greedy ids are the row-wise
    argmaxes in one op; sampled ids and q are those of R single-row calls drawing in order from the same generator."""
    from peagle_train.decoding.speculative import DraftSession

    target = make_target()
    session = DraftSession(make_drafter(target, parallel=True), 3)
    logits = torch.randn(3, session._vocab_ids.numel(), generator=torch.Generator().manual_seed(0))
    ids, q = session._pick(logits, False, 1.0, None)
    assert q is None and ids.tolist() == [int(session._pick(r, False, 1.0, None)[0]) for r in logits]
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ids, q = session._pick(logits, True, 0.7, g1)
    rows = [session._pick(r, True, 0.7, g2) for r in logits]
    assert ids.tolist() == [int(r[0]) for r in rows] and torch.equal(q, torch.stack([r[1] for r in rows]))
    assert q.shape == (3, session.drafter.t2d.numel())


def test_target_runner_compile_modes_compile_as_named_and_only_cuda_graphs_marks_steps(monkeypatch):
    """``compile=True`` / ``"cuda-graphs"`` compiles with ``mode="reduce-overhead"`` and marks a CUDA-graph step before
    each call; ``"inductor"`` compiles with inductor's defaults (no CUDA graphs), marks nothing and names its kind
    ``static+inductor``; both decode as the eager forward. Another value is refused; on a CPU nothing compiles (the
    compiled forward is CUDA's), and ``eval.compile_target`` takes the same values."""
    from peagle_train.core.config import EvalConfig
    from peagle_train.decoding.target_runner import TargetRunner

    target = make_target()
    ids = torch.arange(9)
    want = target.model(input_ids=ids[None]).logits[0]
    made, marks = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: made.append(kw) or model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    for compile, kwargs, kind, marked in ((True, {"dynamic": False, "mode": "reduce-overhead"}, "static+cuda-graphs", 2),
                                          ("cuda-graphs", {"dynamic": False, "mode": "reduce-overhead"},
                                           "static+cuda-graphs", 2),
                                          ("inductor", {"dynamic": False}, "static+inductor", 0)):
        made.clear(), marks.clear()
        with TargetRunner(target, static=True, compile=compile, block=16) as r:
            assert not r.compile and r.compile_mode is None and r.kind == "static"  # a CPU: eager
            r.compile_mode = "cuda-graphs" if compile is True else compile  # as on a GPU
            r.start(12)
            assert made == [kwargs]
            r.forward(ids[:5], want_aux=False, prefill=True)
            for a, b in ((5, 7), (7, 9)):
                torch.testing.assert_close(r.forward(ids[a:b], want_aux=True)[0], want[a:b], rtol=1e-5, atol=1e-5)
            assert len(marks) == marked and r.kind == kind
    with pytest.raises(ValueError, match="compile='graphs'"):
        TargetRunner(target, static=True, compile="graphs")
    assert EvalConfig(compile_target="inductor").compile_target == "inductor"
    assert EvalConfig(compile_target=True).compile_target is True
    with pytest.raises(ValueError):
        EvalConfig(compile_target="graphs")
