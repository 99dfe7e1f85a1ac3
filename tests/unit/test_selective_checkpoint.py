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
from peagle_train.kernels.selective_checkpoint import attention_ops, check_mode
from peagle_train.methods.peagle import PEagleObjective
from peagle_train.peagle.planner import ShapeParams, predict_peak_bytes

pytestmark = pytest.mark.usefixtures("torch_single_thread")

SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class _CountAttention(TorchDispatchMode):
    """Counts the CPU SDPA kernel's calls (what runs, not what a checkpoint replays from its cache)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is SDPA_CPU
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
    _assert_same(none[:2], full[:2], 1e-12)
    _assert_same(none[:2], sel[:2], 1e-12)


@needs_cc
def test_selective_checkpointing_compiled_matches_eager(tiny_drafter, objective_problem):
    eager = _run(tiny_drafter, objective_problem, "selective", dtype=torch.float32)
    comp = _run(tiny_drafter, objective_problem, "selective", compile=True, dtype=torch.float32)
    d = comp[3]
    assert d._selective_cache is not None and all(c.mode == "fullgraph" for c in d._selective_cache), \
        [c.mode for c in d._selective_cache]
    _assert_same(eager[:2], comp[:2], 1e-4)
    d.set_compile(True)  # the same mode: the compiled calls are kept
    assert d._selective_cache is not None
    d.set_compile("max-autotune")  # another mode: built again at the next call
    assert d._selective_cache is None


def test_planner_counts_the_kept_attention_between_full_checkpointing_and_none():
    shape = ShapeParams(2880, 7680, 4, 64, 8, 64, 201088, 32000, 2880)  # the GPT-OSS-20B-shaped drafter
    full, sel, none = (shape.act_bytes_per_element(c) for c in (True, "selective", False))
    assert sel - full == 4 * (2 * 64 * 64 + 4 * 64)  # per layer: bf16 output and fp32 log-sum-exp, 4 layers
    assert full < sel < none
    peaks = [predict_peak_bytes(131072, 2, shape, checkpointing=c) for c in (True, "selective", False)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_other_values_are_refused():
    assert TrainConfig(activation_checkpointing="selective").activation_checkpointing == "selective"
    assert TrainConfig(activation_checkpointing=True).activation_checkpointing is True
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig(activation_checkpointing="sometimes")
    assert check_mode("selective") == "selective" and check_mode(False) is False
    with pytest.raises(ValueError, match="one of false, true, 'selective'"):
        check_mode("full")


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
