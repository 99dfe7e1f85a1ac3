"""Pins ``train.activation_checkpointing: selective`` (``peagle_train.kernels.selective_checkpoint``): the same loss
and gradients as no checkpointing and as full checkpointing (float64), with the attention kernel run once per layer
(full checkpointing runs it again in the backward), eagerly and compiled; the planner's memory model between the two;
the config and the drafter refuse other values."""
from __future__ import annotations

import pytest
import torch
from conftest import needs_cc
from torch.utils._python_dispatch import TorchDispatchMode

from peagle_train.core.config import TrainConfig
from peagle_train.kernels.selective_checkpoint import attention_ops, checkpointing_mode
from peagle_train.methods.peagle import PEagleObjective
from peagle_train.peagle.planner import ShapeParams, predict_peak_bytes

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class _CountAttention(TorchDispatchMode):
    """Counts the CPU SDPA kernel's calls and the matrix multiplies (what runs, not what a checkpoint replays from
    its cache)."""

    def __init__(self):
        super().__init__()
        self.calls = self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is SDPA_CPU
        self.matmuls += func in MATMULS
        return func(*args, **(kwargs or {}))


def _run(tiny_drafter, objective_problem, mode, compile=False, dtype=torch.float64):
    P = objective_problem([40, 30], 2, 0.9, 3, 3, 1, dtype=dtype)
    d = tiny_drafter(K=P["K"], draft_vocab_size=60, seed=5).to(dtype)
    d.gradient_checkpointing = mode
    d.train()
    obj = PEagleObjective(d, P["head"], chunk_size=64, attention="sdpa", pad_multiple=32, compile=compile)
    params = [p for p in d.parameters() if p.requires_grad]
    if compile:  # Dynamo does not trace under a user dispatch mode: no count
        loss, _ = obj(P["grid"], P["aux"], P["last"], P["argmax"], P["norm"])
        return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True), None, d
    with _CountAttention() as count:
        loss, _ = obj(P["grid"], P["aux"], P["last"], P["argmax"], P["norm"])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    d.matmuls_run = count.matmuls
    return loss.detach(), grads, count.calls, d


def _assert_same(a, b, tol):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(lb, la, atol=tol, rtol=tol)
    for x, y in zip(ga, gb):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(y, x, atol=tol, rtol=tol)


def test_selective_checkpointing_gives_the_same_gradients_and_runs_attention_once(tiny_drafter, objective_problem):
    none = _run(tiny_drafter, objective_problem, False)
    full = _run(tiny_drafter, objective_problem, True)
    sel = _run(tiny_drafter, objective_problem, "selective")
    layers = len(none[3].layers)
    assert SDPA_CPU in attention_ops()
    assert none[2] == layers  # the forward only
    assert full[2] == 2 * layers  # the forward again in the backward
    assert sel[2] == layers  # kept from the forward
    # the rest is recomputed (projections, MLP): as many matmuls as under full checkpointing, more than without
    assert sel[3].matmuls_run == full[3].matmuls_run > none[3].matmuls_run
    _assert_same(none[:2], full[:2], 1e-12)
    _assert_same(none[:2], sel[:2], 1e-12)


@needs_cc
def test_selective_checkpointing_compiled_matches_eager(tiny_drafter, objective_problem):
    eager = _run(tiny_drafter, objective_problem, "selective", dtype=torch.float32)
    comp = _run(tiny_drafter, objective_problem, "selective", compile=True, dtype=torch.float32)
    d = comp[3]
    assert d._selective_cache is not None and all(c.mode == "fullgraph" for c in d._selective_cache), \
        [c.mode for c in d._selective_cache]
    assert d.compiled_calls() is d._selective_cache  # what a benchmark row reports: the calls that ran
    _assert_same(eager[:2], comp[:2], 1e-4)
    d.set_compile(True)  # the same mode: the compiled calls are kept
    assert d._selective_cache is not None
    d.set_compile("max-autotune")  # another mode: built again at the next call
    assert d._selective_cache is None


def test_planner_counts_the_kept_attention_between_full_checkpointing_and_none():
    shape = ShapeParams(2880, 7680, 4, 64, 8, 64, 201088, 32000, 2880)  # the GPT-OSS-20B-shaped drafter
    full, sel, none = (shape.act_bytes_per_element(c) for c in (True, "selective", False))
    # per layer: bf16 q, k, v (8 KV heads) and output, fp32 log-sum-exp, 4 layers
    assert sel - full == 4 * (2 * (2 * 64 + 2 * 8) * 64 + 4 * 64)
    assert full < sel < none
    peaks = [predict_peak_bytes(131072, 2, shape, checkpointing=c) for c in (True, "selective", False)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_other_values_are_refused():
    assert TrainConfig(activation_checkpointing="selective").activation_checkpointing == "selective"
    assert TrainConfig(activation_checkpointing=True).activation_checkpointing is True
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="sometimes")
    assert checkpointing_mode("selective") == "selective" and checkpointing_mode(False) is False
    with pytest.raises(ValueError, match="one of false, true, 'selective'"):
        checkpointing_mode("full")
    with pytest.raises(ValueError, match="prefix_compiled_apart"):  # its graph break would leave layers uncompiled
        TrainConfig(activation_checkpointing="selective", prefix_compiled_apart=True, compile=True)
    assert TrainConfig(activation_checkpointing="selective", prefix_compiled_apart=True).compile is False
    with pytest.raises(ValueError, match="False, True or 'selective'"):
        ShapeParams(2880, 7680, 4, 64, 8, 64, 201088, 32000, 2880).act_bytes_per_element("sometimes")


@pytest.mark.parametrize("mode", [True, "selective"])
def test_compiled_layers_run_attention_again_only_under_full_checkpointing(tiny_drafter, objective_problem,
                                                                            monkeypatch, mode):
    """The compiled drafter as the trainer runs it (``set_compile``, here through AOTAutograd without Inductor so
    the graphs can be read): under full checkpointing each layer's compiled forward, attention included, runs again
    in the backward (the checkpoint wraps the compiled layer); under selective checkpointing each runs once and the
    backward graphs hold the attention kernel's backward, not its forward. Gradients equal eager's (float64)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    real_compile = torch.compile
    runs = {"fw_attention": 0, "bw_attention_fwd": 0, "bw_attention_bwd": 0}

    def reading(gm, kind):
        ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        fwd = sum("flash_attention_for_cpu.default" in o for o in ops)
        bwd = sum("flash_attention_for_cpu_backward" in o for o in ops)
        if kind == "bw":
            runs["bw_attention_fwd"] += fwd
            runs["bw_attention_bwd"] += bwd
            return make_boxed_func(gm)
        inner = make_boxed_func(gm)

        def counted(args):
            runs["fw_attention"] += fwd
            return inner(args)
        counted._boxed_call = True
        return counted

    backend = aot_autograd(fw_compiler=lambda gm, _: reading(gm, "fw"), bw_compiler=lambda gm, _: reading(gm, "bw"))
    monkeypatch.setattr(torch, "compile", lambda fn, fullgraph=True, dynamic=None, **kw: real_compile(
        fn, fullgraph=fullgraph, dynamic=dynamic, backend=backend))
    loss, grads, _, d = _run(tiny_drafter, objective_problem, mode, compile=True)
    layers = len(d.layers)
    calls = d._selective_cache if mode == "selective" else d._compiled_layers
    assert all(c.mode == "fullgraph" for c in calls), [c.mode for c in calls]
    if mode is True:
        assert runs["fw_attention"] == 2 * layers  # the forward again in the backward
    else:
        assert runs["fw_attention"] == layers and runs["bw_attention_fwd"] == 0
    assert runs["bw_attention_bwd"] == layers
    eager = _run(tiny_drafter, objective_problem, False)
    _assert_same(eager[:2], (loss, grads), 1e-10)


def test_selective_without_compile_warns_that_flex_attention_is_recomputed(tiny_drafter, monkeypatch):
    """FlexAttention's eager call is a compiled region the policy cannot see: without train.compile a split or
    joint FlexAttention spec gets one warning saying its forward runs again; SDPA's dense spec gets none."""
    import warnings

    import peagle_train.kernels.selective_checkpoint as sc
    from peagle_train.kernels.attention import AttnSpec

    sc.warn_flex_not_kept.cache_clear()
    d = tiny_drafter(seed=5).train()
    d.gradient_checkpointing = "selective"
    E = 8
    ids, hidden, pos = torch.zeros(E, dtype=torch.long), torch.randn(E, d.config.hidden_size), torch.arange(E)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d(ids, hidden, pos, AttnSpec(dense=torch.ones(E, E, dtype=torch.bool).tril()))  # SDPA: no warning
    flex_like = AttnSpec(dense=torch.ones(E, E, dtype=torch.bool).tril())
    object.__setattr__(flex_like, "block_mask", object())  # only its kind is read before the layers run
    monkeypatch.setattr(d, "_selective_calls", list)  # no layer runs (no FlexAttention backward on CPU)
    with pytest.warns(UserWarning, match="FlexAttention's eager call"):
        d(ids, hidden, pos, flex_like)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d(ids, hidden, pos, flex_like)  # once per process


def test_a_drafter_compiled_with_graph_breaks_is_refused_selective_checkpointing(tiny_drafter):
    """A checkpoint region Dynamo cannot trace in one graph is skipped whole, so a drafter compiled with graph breaks
    allowed (train.prefix_compiled_apart) would run its selective layers uncompiled: refused. (The selective calls
    never retry with graph breaks either: SafeCompiled(graph_breaks=False), tests/unit/test_compile.py.)"""
    from peagle_train.kernels.attention import AttnSpec

    d = tiny_drafter(seed=5).train()
    d.gradient_checkpointing = "selective"
    d.set_compile(True, fullgraph=False)
    E = 8
    with pytest.raises(ValueError, match="prefix_compiled_apart"):
        d(torch.zeros(E, dtype=torch.long), torch.randn(E, d.config.hidden_size), torch.arange(E),
          AttnSpec(dense=torch.ones(E, E, dtype=torch.bool).tril()))
