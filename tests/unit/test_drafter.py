"""Pins the drafter (PEAGLE_SPEC §2, §4, §5; ``drafter.py``) and the objectives that drive it (``methods/peagle.py``, ``methods/eagle3.py``).

* A non-fusion layer (``layers.1``) equals transformers' ``LlamaDecoderLayer`` on the
  same weights (fp32, causal mask, arbitrary RoPE positions); the fusion layer
  (``layers.0``) equals a hand-written reference of §2: ``cat(input_layernorm(emb),
  hidden_norm(fc(h)))`` (width 2H) into q/k/v, residual ``fc(h)`` not normed.
* ``state_dict`` keys are exactly vLLM's checkpoint names with the §5 shapes (no
  ``model.`` prefix, no RoPE buffers), for P-EAGLE and for EAGLE-3 (no ``mask_hidden``).
* ``make_drafter_config`` refuses ``H != T`` without opt-in and never copies target
  biases; ``set_draft_vocab`` builds ``d2t``/``t2d``; ``draft_to_target`` maps back;
  ``init_from_target``; ``grid_hidden`` routes real rows through ``fc`` and mask rows
  through ``fc(mask_hidden)``.
* Train/inference consistency: logits of the teacher-forced training grid at anchor
  ``t``, depths ``0..K-1`` equal the logits of vLLM's runtime layout (§4: context
  slots, bonus slot, K−1 mask slots, plain causal attention), computed incrementally
  with a KV cache, within 1e-5 in fp32, for several anchors in a packed document.
* Bucketed padding (``pad_multiple``, ``grid.pad_grid``) changes nothing: loss, predictions
  and float64 gradients of both objectives equal the unpadded ones; a padded flex
  objective equals the sdpa one in forward.
* Float64 runs are float64-exact: the objectives must not round ``loss_weight / normaliser``
  (or ``decay**k``) to float32 (``test_objectives_weights_exact_in_float64``).
* ``Eagle3Objective`` (TTT): the loss equals a manual per-step sum
  ``Σ_k decay**k · L_k`` computed without the KV cache (recomputing each prefix),
  and the gradient of the step-1 loss flows through the fed-back step-0 hidden state.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding, apply_rotary_pos_emb

from peagle_train.kernels.attention import AttnSpec, make_attn_spec
from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.methods.eagle3 import Eagle3Objective, eagle3_tokens
from peagle_train.methods.peagle import PEagleObjective
from peagle_train.model.drafter import Drafter, make_drafter_config
from peagle_train.peagle.grid import build_grid, cod_sample, supervised_count
from peagle_train.peagle.masks import GridMeta, dense_mask

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def causal(E, P=0):
    """Dense causal mask of E new queries over P cached + E new keys."""
    return torch.cat([torch.ones(E, P, dtype=torch.bool), torch.ones(E, E, dtype=torch.bool).tril()], dim=1)


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


# ----------------------------------------------------------------------------- layers vs references


def test_plain_layer_matches_hf_llama_decoder_layer(tiny_drafter):
    drafter = tiny_drafter(num_layers=3, seed=1).eval()
    cfg = drafter.config
    cfg._attn_implementation = "eager"
    hf = LlamaDecoderLayer(cfg, layer_idx=1).eval()
    ours = drafter.layers[1]
    # copy weights by name (strict: the names are the same)
    hf.load_state_dict(ours.state_dict(), strict=True)
    E, H = 19, cfg.hidden_size
    torch.manual_seed(0)
    x = torch.randn(E, H)
    pos = torch.arange(E) * 3 + 7  # arbitrary increasing positions
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos[None])
    c2, s2 = drafter.rotary_emb(x, pos[None])
    torch.testing.assert_close(cos, c2, atol=0, rtol=0)
    additive = torch.zeros(E, E).masked_fill(~causal(E), float("-inf"))[None, None]
    with torch.no_grad():
        ref = hf(x[None], attention_mask=additive, position_ids=pos[None], position_embeddings=(cos, sin))
        ref = ref[0] if isinstance(ref, tuple) else ref
        got, (k, v) = ours(x, None, cos, sin, AttnSpec(dense=causal(E)))
    torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)
    assert k.shape == (1, cfg.num_key_value_heads, E, cfg.head_dim) and v.shape == k.shape


def test_fusion_layer_matches_manual_reference(tiny_drafter):
    drafter = tiny_drafter(num_layers=2, seed=2).eval()
    cfg = drafter.config
    L0 = drafter.layers[0]
    nh, nkv, hd, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    E = 11
    torch.manual_seed(1)
    emb, h = torch.randn(E, H), torch.randn(E, H) * 3
    pos = torch.arange(E) + 2
    cos, sin = drafter.rotary_emb(h, pos[None])
    with torch.no_grad():
        got, _ = L0(h, emb, cos, sin, AttnSpec(dense=causal(E)))
        eps = cfg.rms_norm_eps
        x = torch.cat([rms(emb, L0.input_layernorm.weight, eps), rms(h, L0.hidden_norm.weight, eps)], -1)  # [E, 2H]
        assert x.shape[-1] == 2 * H == L0.self_attn.q_proj.in_features
        q = (x @ L0.self_attn.q_proj.weight.T).view(E, nh, hd).transpose(0, 1)[None]
        k = (x @ L0.self_attn.k_proj.weight.T).view(E, nkv, hd).transpose(0, 1)[None]
        v = (x @ L0.self_attn.v_proj.weight.T).view(E, nkv, hd).transpose(0, 1)[None]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = (q @ k.transpose(-1, -2)) / hd**0.5
        a = s.masked_fill(~causal(E), float("-inf")).softmax(-1) @ v  # [1, nh, E, hd]
        a = a[0].transpose(0, 1).reshape(E, nh * hd) @ L0.self_attn.o_proj.weight.T
        h1 = h + a  # residual is the raw (fc-projected) hidden, not hidden_norm(h)
        m = L0.mlp
        y = rms(h1, L0.post_attention_layernorm.weight, eps)
        ref = h1 + (F.silu(y @ m.gate_proj.weight.T) * (y @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # norm_before_residual = False: with attention and MLP outputs zeroed the layer is the identity on h
    with torch.no_grad():
        L0.self_attn.o_proj.weight.zero_()
        L0.mlp.down_proj.weight.zero_()
        out, _ = L0(h, emb, cos, sin, AttnSpec(dense=causal(E)))
    assert torch.equal(out, h)


# ----------------------------------------------------------------------------- checkpoint names


def expected_keys(n_layers, H, T, A, nh, nkv, hd, I, V, Vd, parallel=True):
    keys = {
        "fc.weight": (H, A * T),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "embed_tokens.weight": (V, H),
        "d2t": (Vd,),
        "t2d": (V,),
    }
    if parallel:
        keys["mask_hidden"] = (1, 1, A * T)
    for i in range(n_layers):
        w = 2 * H if i == 0 else H
        p = f"layers.{i}."
        keys.update({
            p + "self_attn.q_proj.weight": (nh * hd, w),
            p + "self_attn.k_proj.weight": (nkv * hd, w),
            p + "self_attn.v_proj.weight": (nkv * hd, w),
            p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
        })
        if i == 0:
            keys[p + "hidden_norm.weight"] = (H,)
    return keys


@pytest.mark.parametrize("parallel", [True, False])
def test_state_dict_is_exactly_the_vllm_names(tiny_drafter, parallel):
    d = tiny_drafter(num_layers=4, draft_vocab_size=50, parallel_drafting=parallel)
    c = d.config
    sd = d.state_dict()
    exp = expected_keys(4, c.hidden_size, c.target_hidden_size, 3, c.num_attention_heads, c.num_key_value_heads,
                        c.head_dim, c.intermediate_size, c.vocab_size, 50, parallel)
    rotary = [k for k in sd if "rotary" in k or "inv_freq" in k]
    assert rotary == [], f"RoPE buffers leak into the checkpoint: {rotary}"
    assert set(sd) == set(exp), (set(sd) ^ set(exp))
    assert not any(k.startswith("model.") for k in sd)
    for k, shape in exp.items():
        assert tuple(sd[k].shape) == shape, k
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(sd[k].is_floating_point() for k in exp if k not in ("d2t", "t2d"))


def test_make_drafter_config_hidden_size_opt_in(tiny_llama_config):
    tc = tiny_llama_config(hidden_size=32, attention_bias=True)
    kw = dict(aux_layer_ids=[1, 2, 3], draft_vocab_size=64, mask_token_id=127)
    with pytest.raises(ValueError, match="hidden"):
        make_drafter_config(tc, hidden_size=48, **kw)
    cfg = make_drafter_config(tc, hidden_size=48, num_attention_heads=4, head_dim=12,
                              allow_hidden_size_mismatch=True, **kw)
    d = Drafter(cfg)
    assert d.fc.weight.shape == (48, 96)  # [H, A*T]
    assert d.mask_hidden.shape == (1, 1, 96)  # pre-fc space: A*T, not A*H
    assert d.mask_hidden_projected().shape == (48,)
    cfg = make_drafter_config(tc, **kw)
    assert cfg.hidden_size == 32 and cfg.target_hidden_size == 32
    assert cfg.attention_bias is False and cfg.mlp_bias is False  # never copied from the target
    assert cfg.hidden_act == "silu" and cfg.tie_word_embeddings is False
    assert cfg.max_position_embeddings == tc.max_position_embeddings and cfg.vocab_size == tc.vocab_size
    assert cfg.eagle_aux_hidden_state_layer_ids == [1, 2, 3] and cfg.mask_token_id == 127
    assert cfg.draft_vocab_size == 64
    assert make_drafter_config(tc, parallel_drafting=False, **kw).mask_token_id is None


def test_draft_vocab_mapping(tiny_drafter):
    d = tiny_drafter(draft_vocab_size=5)
    ids = torch.tensor([3, 4, 10, 11, 90])
    d.set_draft_vocab(ids)
    assert d.d2t.tolist() == [3, 3, 8, 8, 86]  # d2t[i] = draft_ids[i] - i
    assert d.t2d.sum() == 5 and d.t2d[ids].all()
    assert d.draft_to_target(torch.arange(5)).tolist() == ids.tolist()
    assert d.draft_to_target(torch.tensor([[4, 0], [2, 2]])).tolist() == [[90, 3], [10, 10]]
    for bad in (torch.tensor([3, 4, 4, 11, 90]), torch.tensor([4, 3, 10, 11, 90]), torch.tensor([1, 2, 3])):
        with pytest.raises(ValueError):
            d.set_draft_vocab(bad)
    full = tiny_drafter()  # Vd == V: identity mapping, d2t all zero, t2d all True
    assert (full.d2t == 0).all() and full.t2d.all()
    assert torch.equal(full.draft_to_target(torch.arange(128)), torch.arange(128))


def test_init_from_target(tiny_drafter):
    d = tiny_drafter(draft_vocab_size=6)
    V, H = d.embed_tokens.weight.shape
    emb, head = torch.randn(V, H), torch.randn(V, H)
    ids = torch.tensor([0, 5, 6, 50, 51, 120])
    d.init_from_target(emb, head, ids)
    assert torch.equal(d.embed_tokens.weight, emb) and torch.equal(d.lm_head.weight, head[ids])
    assert d.draft_to_target(torch.arange(6)).tolist() == ids.tolist()
    with pytest.raises(ValueError):
        d.init_from_target(torch.randn(V, H + 1), head, ids)


def test_grid_hidden_routes_real_and_mask_rows(tiny_drafter):
    d = tiny_drafter()
    aux = torch.randn(9, 96)
    idx = torch.tensor([0, 3, -1, 8, -1])
    out = d.grid_hidden(aux, idx)
    torch.testing.assert_close(out[[0, 1, 3]], d.fc(aux[[0, 3, 8]]))
    torch.testing.assert_close(out[2], d.fc(d.mask_hidden.view(-1)))
    torch.testing.assert_close(out[4], out[2])
    out.sum().backward()
    assert d.mask_hidden.grad is not None and d.mask_hidden.grad.abs().sum() > 0
    e3 = tiny_drafter(parallel_drafting=False)
    with pytest.raises(ValueError):
        e3.grid_hidden(aux, idx)
    torch.testing.assert_close(e3.grid_hidden(aux, torch.tensor([1, 2])), e3.fc(aux[[1, 2]]))


@pytest.mark.parametrize("max_real", [3, 4, 9])
def test_grid_hidden_sync_free_form_equals_the_nonzero_path(tiny_drafter, max_real):
    """``max_real`` (nonzero_static, scratch row for unused slots) gives the same output and the
    same gradients, in float64, as the exact nonzero path; too small a bound is an error."""
    d = tiny_drafter().double()
    aux = torch.randn(9, 96, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([0, 3, -1, 8, -1])
    w = torch.randn(5, d.fc.out_features, dtype=torch.float64)
    params = [aux, d.mask_hidden, d.fc.weight]
    ref = d.grid_hidden(aux, idx)
    g_ref = torch.autograd.grad((ref * w).sum(), params)
    got = d.grid_hidden(aux, idx, max_real=max_real)
    g_got = torch.autograd.grad((got * w).sum(), params)
    torch.testing.assert_close(got, ref, atol=1e-14, rtol=1e-14)  # fc on more rows: ULP-level GEMM differences
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, atol=1e-14, rtol=1e-14)
    with pytest.raises(RuntimeError, match="more than max_real=2 real rows"):
        d.grid_hidden(aux, idx, max_real=2)
    with pytest.MonkeyPatch.context() as mp:  # a backend without nonzero_static: the nonzero path
        def missing(*a, **k):
            raise NotImplementedError("nonzero_static")
        mp.setattr(torch, "nonzero_static", missing)
        torch.testing.assert_close(d.grid_hidden(aux, idx, max_real=max_real), ref, atol=0, rtol=0)
    e3 = tiny_drafter(parallel_drafting=False)
    with pytest.raises(RuntimeError, match="no mask_hidden"):
        e3.grid_hidden(aux.float().detach(), idx, max_real=max_real)


# ----------------------------------------------------------------------------- train/inference consistency


@pytest.mark.parametrize("t", [0, 1, 6, 14])
def test_training_grid_matches_vllm_runtime_layout(tiny_drafter, packed_batch, t):
    """Grid logits at anchor t, depths 0..K-1 == vLLM parallel drafting (spec §4) with a KV cache."""
    K = 5
    b = packed_batch([13, 21], n_pad=3, loss_prob=1.0, seed=4)
    x, doc_ids, loss_mask = b["input_ids"], b["doc_ids"], b["loss_mask"]
    N = b["N"]
    drafter = tiny_drafter(num_layers=3, K=K, draft_vocab_size=90, seed=7).eval()
    M = drafter.mask_token_id
    torch.manual_seed(3)
    aux = torch.randn(N, 96)
    kept = cod_sample(loss_mask, doc_ids, K, r=1.0, r_min=1.0, generator=torch.Generator().manual_seed(0))
    g = build_grid(x, loss_mask, doc_ids, kept, M)

    s, L = 13, 21  # second packed document: tokens x[s : s+L]
    assert t + 2 + (K - 1) < L  # every depth of the chain at t exists
    with torch.no_grad():
        hidden = drafter.grid_hidden(aux, g.hidden_index)
        grids = {}
        for kind in ("sdpa", "flex"):
            h, _ = drafter(g.token_ids, hidden, g.position_ids, make_attn_spec(GridMeta.of(g), kind=kind))
            grids[kind] = drafter.logits(h)
        rows = [int(((g.anchor == s + t) & (g.depth == d)).nonzero()) for d in range(K)]
        train = grids["sdpa"][rows]  # [K, Vd]
        torch.testing.assert_close(grids["flex"][rows], train, atol=1e-5, rtol=1e-5)

        # vLLM runtime, on the document alone (positions from 0), two incremental calls
        xd, hd = x[s:s + L], aux[s:s + L]
        past = None
        if t > 0:  # context slots j < t: token x[j+1], hidden fc(h[j]), position j
            _, past = drafter(xd[1:t + 1], drafter.fc(hd[:t]), torch.arange(t), AttnSpec(dense=causal(t)),
                              past_kv=None)
        tokens = torch.cat([xd[t + 1:t + 2], torch.full((K - 1,), M)])  # bonus token, then K-1 mask tokens
        hid = torch.cat([drafter.fc(hd[t:t + 1]), drafter.mask_hidden_projected().expand(K - 1, -1)])
        pos = torch.arange(t, t + K)
        h_rt, kv = drafter(tokens, hid, pos, AttnSpec(dense=causal(K, t)), past_kv=past)
        runtime = drafter.logits(h_rt)
    assert kv[0][0].shape[2] == t + K
    torch.testing.assert_close(train, runtime, atol=1e-5, rtol=1e-5)
    assert torch.equal(train.argmax(-1), runtime.argmax(-1))


# ----------------------------------------------------------------------------- EAGLE-3 objective


@pytest.fixture(scope="module")
def eagle3_problem(tiny_drafter, packed_batch):
    K = 3
    b = packed_batch([11, 14], n_pad=2, loss_prob=0.9, seed=9)
    kept = cod_sample(b["loss_mask"], b["doc_ids"], K, r=1.0, r_min=1.0, generator=torch.Generator().manual_seed(0))
    g = build_grid(b["input_ids"], b["loss_mask"], b["doc_ids"], kept, mask_token_id=127)
    drafter = tiny_drafter(parallel_drafting=False, num_layers=1, K=K, draft_vocab_size=70, seed=11).double()
    N, T = b["N"], 32
    torch.manual_seed(5)
    aux = torch.randn(N, 96, dtype=torch.float64)
    last = torch.randn(N, T, dtype=torch.float64)
    head = torch.randn(70, T, dtype=torch.float64)
    argmax = torch.zeros(N, dtype=torch.long)
    return dict(b=b, g=g, K=K, drafter=drafter, aux=aux, last=last, head=head, argmax=argmax)


def manual_ttt(P, detach_feedback=False):
    """TTT without a KV cache: step k re-runs steps 0..k in one forward (the rule is causal in step order).

    Returns per-step (h_k, loss_k) with loss_k = Σ weight/normaliser · loss (no decay)."""
    g, drafter, x = P["g"], P["drafter"], P["b"]["input_ids"]
    norm = float(supervised_count(g))
    target = TargetDist(P["last"], P["head"], P["argmax"])
    tokens = x[g.anchor + 1 + g.depth]  # ground-truth token x[a+1+k] at TTT step k
    out, steps = [], []
    inputs_hidden = []
    for k in range(P["K"]):
        idx = (g.depth == k).nonzero().flatten()
        if k == 0:
            hid = drafter.fc(P["aux"][g.anchor[idx]])
        else:
            prev_idx, prev_h = steps[-1], out[-1][0]
            pos_of = {int(a): i for i, a in enumerate(g.anchor[prev_idx])}
            hid = prev_h[[pos_of[int(a)] for a in g.anchor[idx]]]
            if detach_feedback:
                hid = hid.detach()
        inputs_hidden.append(hid)
        steps.append(idx)
        all_idx = torch.cat(steps)
        meta = GridMeta(g.anchor[all_idx], g.depth[all_idx], g.doc[all_idx])
        h_all, _ = drafter(tokens[all_idx], torch.cat(inputs_hidden), g.position_ids[all_idx],
                           AttnSpec(dense=dense_mask(meta)))
        h_k = h_all[-idx.numel():]
        loss_k, pred_k = chunked_loss(drafter.norm, drafter.lm_head, h_k, g.label_index[idx],
                                      g.loss_weight[idx].double() / norm, target, "kl", 7)
        out.append((h_k, loss_k, pred_k))
    return out


def test_eagle3_tokens():
    g = build_grid(torch.arange(10, 20), torch.ones(10, dtype=torch.bool), torch.zeros(10, dtype=torch.int64),
                   cod_sample(torch.ones(10, dtype=torch.bool), torch.zeros(10, dtype=torch.int64), 3, 1.0, 1.0), 99)
    toks = eagle3_tokens(g, torch.arange(10, 20))
    assert torch.equal(toks, 10 + g.anchor + 1 + g.depth)


@pytest.mark.parametrize("decay", [1.0, 0.8, 0.5])
def test_eagle3_loss_is_decayed_sum_of_steps(eagle3_problem, decay):
    P = eagle3_problem
    g = P["g"]
    assert int(g.depth.max()) == P["K"] - 1
    obj = Eagle3Objective(P["drafter"], P["head"], loss="kl", chunk_size=5, attention="sdpa", decay=decay)
    with torch.no_grad():
        loss, pred = obj(g, P["aux"], P["last"], P["argmax"], float(supervised_count(g)), P["b"]["input_ids"])
        steps = manual_ttt(P)
    expect = sum(decay**k * l_k for k, (_, l_k, _) in enumerate(steps))
    # rel 1e-7, not 1e-12: the objective forms weight*decay**k/normaliser in float32 (see
    # test_objectives_weights_exact_in_float64)
    assert abs(loss.item() - expect.item()) < 1e-7 * expect.item()
    assert all(l_k.item() > 0 for _, l_k, _ in steps)
    for k, (_, _, p_k) in enumerate(steps):
        assert torch.equal(pred[g.depth == k], p_k)


def test_eagle3_flex_forward_matches_sdpa(eagle3_problem):
    P = eagle3_problem
    g = P["g"]
    drafter = P["drafter"]
    kwargs = dict(loss="kl", chunk_size=64, pad_multiple=128)
    with torch.no_grad():
        a, _ = Eagle3Objective(drafter, P["head"], attention="sdpa", **kwargs)(
            g, P["aux"], P["last"], P["argmax"], 10.0, P["b"]["input_ids"])
        b, _ = Eagle3Objective(drafter, P["head"], attention="flex", **kwargs)(
            g, P["aux"], P["last"], P["argmax"], 10.0, P["b"]["input_ids"])
    assert abs(a.item() - b.item()) < 1e-8


def test_eagle3_gradient_flows_through_fed_back_hidden(eagle3_problem):
    P = eagle3_problem
    g, drafter = P["g"], P["drafter"]
    # isolate the step-1 loss: zero the weights of every other step
    g1 = dataclasses.replace(g, loss_weight=g.loss_weight * (g.depth == 1).to(g.loss_weight.dtype))
    norm = float(supervised_count(g))
    obj = Eagle3Objective(drafter, P["head"], loss="kl", chunk_size=5, attention="sdpa", decay=1.0)
    params = [p for _, p in drafter.named_parameters()]
    names = [n for n, _ in drafter.named_parameters()]

    loss, _ = obj(g1, P["aux"], P["last"], P["argmax"], norm, P["b"]["input_ids"])
    got = torch.autograd.grad(loss, params, allow_unused=True)
    ref = torch.autograd.grad(manual_ttt(P)[1][1], params, allow_unused=True)
    det = torch.autograd.grad(manual_ttt(P, detach_feedback=True)[1][1], params, allow_unused=True)
    # rel 1e-7: float32 weight/normaliser (see test_objectives_weights_exact_in_float64)
    assert abs(loss.item() - manual_ttt(P)[1][1].item()) < 1e-7 * loss.item()
    moved = 0
    for n, a, r, d in zip(names, got, ref, det):
        a = torch.zeros_like(r) if a is None else a
        r = torch.zeros_like(a) if r is None else r
        torch.testing.assert_close(a, r, atol=1e-12, rtol=1e-7, msg=n)
        if d is not None and n.startswith(("layers.", "fc.")) and (a - d).abs().max() > 1e-6:
            moved += 1
    # the fed-back hidden contributes: detaching it changes the layer / fc gradients
    assert moved >= 5
    gi = dict(zip(names, got))
    assert gi["fc.weight"].abs().max() > 0 and gi["layers.0.mlp.down_proj.weight"].abs().max() > 0


def test_peagle_objective_loss_normalised(tiny_drafter, packed_batch):
    """PEagleObjective = Σ weight · KL / normaliser over the grid; doubling the normaliser halves it."""
    b = packed_batch([15, 10], n_pad=2, loss_prob=0.8, seed=2)
    K = 3
    kept = cod_sample(b["loss_mask"], b["doc_ids"], K, 0.8, 0.3, generator=torch.Generator().manual_seed(1))
    g = build_grid(b["input_ids"], b["loss_mask"], b["doc_ids"], kept, 127)
    d = tiny_drafter(K=K, draft_vocab_size=60).double()
    aux, last, head = torch.randn(b["N"], 96).double(), torch.randn(b["N"], 32).double(), torch.randn(60, 32).double()
    obj = PEagleObjective(d, head, attention="sdpa", chunk_size=8)
    with torch.no_grad():
        l1, pred = obj(g, aux, last, torch.zeros(b["N"], dtype=torch.long), 10.0)
        l2, _ = obj(g, aux, last, torch.zeros(b["N"], dtype=torch.long), 20.0)
        hid = d.grid_hidden(aux, g.hidden_index)
        h, _ = d(g.token_ids, hid, g.position_ids, AttnSpec(dense=dense_mask(GridMeta.of(g))))
        logp = F.log_softmax(d.logits(h), -1)
        tlogp = F.log_softmax(last[g.label_index] @ head.T, -1)
        ref = ((tlogp.exp() * (tlogp - logp)).sum(-1) * g.loss_weight.double()).sum() / 10.0
    # rel 1e-7 (float32 weight/normaliser, see test_objectives_weights_exact_in_float64)
    assert abs(l1.item() - ref.item()) < 1e-7 * ref.item() and abs(l1.item() - 2 * l2.item()) < 1e-12
    assert torch.equal(pred, logp.argmax(-1)) and pred.shape == (len(g),)


def test_objectives_weights_exact_in_float64(tiny_drafter, packed_batch, eagle3_problem):
    """Float64 runs must be float64-exact: ``loss_weight / normaliser`` (and ``decay**k``) must not be
    rounded to float32. Fails while the objectives divide the float32 ``grid.loss_weight`` in float32."""
    P = eagle3_problem
    g = P["g"]
    obj = Eagle3Objective(P["drafter"], P["head"], loss="kl", chunk_size=5, attention="sdpa", decay=0.8)
    with torch.no_grad():
        loss, _ = obj(g, P["aux"], P["last"], P["argmax"], float(supervised_count(g)), P["b"]["input_ids"])
        expect = sum(0.8**k * l_k for k, (_, l_k, _) in enumerate(manual_ttt(P)))
    assert abs(loss.item() - expect.item()) < 1e-12 * expect.item()

    b = packed_batch([15, 10], n_pad=2, loss_prob=0.8, seed=2)
    kept = cod_sample(b["loss_mask"], b["doc_ids"], 3, 0.8, 0.3, generator=torch.Generator().manual_seed(1))
    g = build_grid(b["input_ids"], b["loss_mask"], b["doc_ids"], kept, 127)
    d = tiny_drafter(K=3, draft_vocab_size=60).double()
    aux, last, head = torch.randn(b["N"], 96).double(), torch.randn(b["N"], 32).double(), torch.randn(60, 32).double()
    zeros = torch.zeros(b["N"], dtype=torch.long)
    with torch.no_grad():
        l10, _ = PEagleObjective(d, head, attention="sdpa")(g, aux, last, zeros, 10.0)
        l1, _ = PEagleObjective(d, head, attention="sdpa")(g, aux, last, zeros, 1.0)
    assert abs(l10.item() - l1.item() / 10.0) < 1e-12 * l1.item()


@pytest.mark.parametrize("which", ["peagle", "eagle3"])
def test_bucketed_padding_changes_nothing(tiny_drafter, objective_problem, which):
    P = objective_problem([17, 12], 3, 0.8, 6, 3, 2, dtype=torch.float64)
    g, aux, last, head, argmax, norm, K = (P[k] for k in ("grid", "aux", "last", "head", "argmax", "norm", "K"))
    if which == "peagle":
        d = tiny_drafter(K=K, draft_vocab_size=60, seed=5).double()
        make = lambda **kw: PEagleObjective(d, head, chunk_size=16, **kw)  # noqa: E731
        run = lambda o: o(g, aux, last, argmax, norm)  # noqa: E731
    else:
        d = tiny_drafter(K=K, draft_vocab_size=60, parallel_drafting=False, num_layers=1, seed=5).double()
        make = lambda **kw: Eagle3Objective(d, head, chunk_size=16, **kw)  # noqa: E731
        run = lambda o: o(g, aux, last, argmax, norm, P["input_ids"])  # noqa: E731
    params = list(d.parameters())
    results = []
    for pad in (1, 64):
        loss, pred = run(make(attention="sdpa", pad_multiple=pad))
        assert torch.isfinite(loss)
        results.append((loss.detach(), pred, torch.autograd.grad(loss, params, allow_unused=True)))
    (l1, p1, g1), (l2, p2, g2) = results
    assert abs(l1.item() - l2.item()) < 1e-12 and torch.equal(p1, p2) and p1.shape == (len(g),)
    for a, c in zip(g1, g2):
        if a is None:
            assert c is None
            continue
        assert torch.isfinite(c).all() and (a - c).abs().max() < 1e-12
    # flex objectives with bucket padding, split and joint (forward only on CPU; 128 keeps eager flex cheap)
    for kind in ("flex", "flex_joint"):
        with torch.no_grad():
            lf, pf = run(make(attention=kind, pad_multiple=128))
        assert abs(lf.item() - l1.item()) < 1e-9 and torch.equal(pf, p1), kind


def test_eagle3_steps_have_fixed_bucketed_shapes(eagle3_problem, monkeypatch):
    """Every TTT step's attention is [Q, (k+1)·Q] with Q = depth-0 count rounded up to the
    bucket, whatever the COD sizes of the deeper steps (bounded recompiles of the fused kernel),
    and the padding changes nothing: same loss and predictions as unpadded steps."""
    import peagle_train.methods.eagle3 as objective

    P = eagle3_problem
    g = P["g"]
    shapes = []
    real = objective.make_attn_spec

    def spy(q, kv=None, kind="flex", **kw):
        shapes.append((q.anchor.numel(), (kv or q).anchor.numel()))
        return real(q, kv, kind, **kw)

    monkeypatch.setattr(objective, "make_attn_spec", spy)
    args = (g, P["aux"], P["last"], P["argmax"], 10.0, P["b"]["input_ids"])
    E0 = int((g.depth == 0).sum())
    K = int(g.depth.max()) + 1
    sizes = [int((g.depth == k).sum()) for k in range(K)]
    assert sizes[1] < E0  # COD dropped some chains: deeper steps are padded up
    with torch.no_grad():
        a, pa = Eagle3Objective(P["drafter"], P["head"], attention="sdpa", pad_multiple=1)(*args)
        assert shapes == [(sizes[k], sum(sizes[: k + 1])) for k in range(K)]  # no bucketing: exact lengths
        shapes.clear()
        b, pb = Eagle3Objective(P["drafter"], P["head"], attention="sdpa", pad_multiple=16)(*args)
    Q = -(-E0 // 16) * 16
    assert shapes == [(Q, (k + 1) * Q) for k in range(K)]
    assert abs(a.item() - b.item()) < 1e-6 * abs(a.item()) and torch.equal(pa, pb)


def test_eagle3_step_lengths_follow_the_cod_bound():
    from peagle_train.methods.eagle3 import eagle3_step_lengths
    from peagle_train.peagle.grid import cod_keep_counts

    assert eagle3_step_lengths(11000, 7, 1, (0.7, 0.2, None)) is None
    lens = eagle3_step_lengths(11000, 7, 1024, (0.7, 0.2, None))
    assert lens[0] == 11264 and lens == [11264, 7936, 5632, 3968, 2816, 2304, 2304]
    assert all(x % 128 == 0 for x in lens)
    assert eagle3_step_lengths(11000, 7, 1024, None) == [11264] * 7
    assert eagle3_step_lengths(11000, 3, 1024, (0.7, 0.2, 1000)) == [11264, 1024, 1024]
    # static_tokens: every micro-batch up to that many tokens gets the same K shapes (one compile per run)
    static = eagle3_step_lengths(8192, 7, 1024, (0.7, 0.2, None))
    assert all(eagle3_step_lengths(E0, 7, 1024, (0.7, 0.2, None), static_tokens=8192) == static
               for E0 in (1, 1000, 1025, 5000, 8192))
    assert eagle3_step_lengths(9000, 7, 1024, None, static_tokens=8192) == [9216] * 7  # longer: own bucket
    # a COD sample never exceeds its step's length, for any n_valid up to the depth-0 count
    for n_valid in (1, 500, 10239, 11000):
        counts = cod_keep_counts(n_valid, 7, 0.7, 0.2, None)
        assert all(c <= L for c, L in zip(counts, eagle3_step_lengths(11000, 7, 1024, (0.7, 0.2, None))))


# ----------------------------------------------------------------------------- drafter.init_layers: target


def test_init_layers_from_target_continues_the_target_from_its_last_aux_state(tmp_path):
    """``drafter.init_layers: target``: at the start the drafter's depth-0 stack, fed the last aux state, is
    the target's last n layers: with that state the input of layer L - n (aux ids 1, 2, 3 of a 6-layer
    target, n = 3) its logits equal the target's in float64, whatever the input tokens (the fusion layer's
    embedding half is zero). That half still receives gradients, so the embeddings enter from step 1."""
    from conftest import save_tiny_target
    from transformers import LlamaForCausalLM

    from peagle_train.features.target import target_layer_tensors

    tc = save_tiny_target(tmp_path)
    target = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    n, aux = 3, [1, 2, 3]
    d = Drafter(make_drafter_config(tc, aux_layer_ids=aux, draft_vocab_size=64, mask_token_id=63, num_layers=n))
    d = d.double()
    d.init_from_target(target.model.embed_tokens.weight, target.lm_head.weight, torch.arange(64))
    layers, norm = target_layer_tensors(tmp_path, [3, 4, 5])
    assert sorted(layers[0]) == sorted(target.model.layers[3].state_dict())
    d.init_layers_from_target(layers, norm)
    E = 12
    ids = torch.randint(0, 63, (1, E), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    aux_states = torch.cat([out.hidden_states[i][0] for i in aux], -1)  # [E, 3T]
    other_tokens = (ids[0] + 7) % 63
    for tokens in (ids[0], other_tokens):
        with torch.no_grad():
            h, _ = d(tokens, d.project_aux(aux_states), torch.arange(E), AttnSpec(dense=causal(E)))
        # float64 but for transformers' LlamaRMSNorm, which normalises in float32 (differences ~4e-8)
        torch.testing.assert_close(d.logits(h), out.logits[0], atol=1e-6, rtol=1e-4)
    shifted = Drafter(make_drafter_config(tc, aux_layer_ids=aux, draft_vocab_size=64, mask_token_id=63,
                                          num_layers=n)).double()
    shifted.init_from_target(target.model.embed_tokens.weight, target.lm_head.weight, torch.arange(64))
    shifted.init_layers_from_target(*target_layer_tensors(tmp_path, [2, 3, 4]))  # one layer too early
    with torch.no_grad():
        h2, _ = shifted(ids[0], shifted.project_aux(aux_states), torch.arange(E), AttnSpec(dense=causal(E)))
    assert (shifted.logits(h2) - out.logits[0]).abs().max() > 1e-4  # the check above tells layers apart
    H = tc.hidden_size
    assert d.layers[0].self_attn.q_proj.weight[:, :H].abs().sum() == 0
    h, _ = d(ids[0], d.project_aux(aux_states), torch.arange(E), AttnSpec(dense=causal(E)))
    d.logits(h).logsumexp(-1).sum().backward()
    assert d.layers[0].self_attn.q_proj.weight.grad[:, :H].abs().sum() > 0  # the embedding half trains
    assert d.fc.weight.grad[:, : 2 * H].abs().sum() > 0  # and so do the other aux states


def test_init_layers_from_target_refuses_what_does_not_fit(tmp_path, tiny_llama_config):
    """A random-weight target has nothing on disk (its loaded model is read instead); a layer of another
    shape or without a Llama key is refused naming the layer and key; a wrong layer count too."""
    from transformers import LlamaForCausalLM

    from peagle_train.features.target import RANDOM_WEIGHTS_MARKER, target_layer_tensors

    tc = tiny_llama_config(num_hidden_layers=4)
    (tmp_path / RANDOM_WEIGHTS_MARKER).write_text("{}")
    with pytest.raises(ValueError, match="random-weight target.*features: online"):
        target_layer_tensors(tmp_path, [2, 3])
    model = LlamaForCausalLM(tc)
    layers, norm = target_layer_tensors(tmp_path, [2, 3], model=model)
    assert torch.equal(layers[1]["mlp.down_proj.weight"], model.model.layers[3].mlp.down_proj.weight)
    assert torch.equal(norm, model.model.norm.weight)
    d = Drafter(make_drafter_config(tc, aux_layer_ids=[1, 2, 3], draft_vocab_size=tc.vocab_size,
                                    mask_token_id=tc.vocab_size - 1, num_layers=2))
    with pytest.raises(ValueError, match="2 target layers for 3"):
        Drafter(make_drafter_config(tc, aux_layer_ids=[1, 2, 3], draft_vocab_size=tc.vocab_size,
                                    mask_token_id=tc.vocab_size - 1, num_layers=3)).init_layers_from_target(layers, norm)
    bad = [dict(layers[0]), dict(layers[1])]
    del bad[1]["mlp.gate_proj.weight"]
    with pytest.raises(ValueError, match="drafter layer 1 has no 'mlp.gate_proj.weight'"):
        d.init_layers_from_target(bad, norm)
    bad[1] = {**layers[1], "mlp.up_proj.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"'mlp.up_proj.weight' of drafter layer 1: target \(3, 3\)"):
        d.init_layers_from_target(bad, norm)
