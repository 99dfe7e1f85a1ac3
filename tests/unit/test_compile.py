"""Pins the ``train.compile`` knob (issue #7; ``compiling.py``, ``Drafter.set_compile``,
``loss.compiled_chunk_loss`` and the fused loss chunk): a compiled drafter + compiled loss chunk
(fused or recompute, ``train.fused_loss``) gives the same
loss, predictions and gradients as eager (fp32, within 1e-4), keeps the ``state_dict``
keys, composes with activation checkpointing, and :class:`SafeCompiled` falls back to
eager when compiling fails.

Compiling on CPU needs Inductor's C++ toolchain; without a C compiler the numeric
test is skipped (the fallback test still runs).
"""
from __future__ import annotations

import pytest
import torch
from conftest import needs_cc

import peagle_train.kernels.loss as loss_mod
from peagle_train.kernels.compiling import SafeCompiled
from peagle_train.kernels.loss import compiled_chunk_loss
from peagle_train.methods.peagle import PEagleObjective

pytestmark = pytest.mark.usefixtures("torch_single_thread")



def _problem(tiny_drafter, objective_problem, ckpt: bool):
    P = objective_problem([40, 30], 2, 0.9, 3, 3, 1)
    d = tiny_drafter(K=P["K"], draft_vocab_size=60, seed=5)
    d.gradient_checkpointing = ckpt
    d.train()
    return d, P["head"], (P["grid"], P["aux"], P["last"], P["argmax"], P["norm"])


@needs_cc
@pytest.mark.parametrize("fused", [True, False], ids=["fused_loss", "recompute"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_compiled_objective_matches_eager(tiny_drafter, objective_problem, ckpt, fused):
    d, head, args = _problem(tiny_drafter, objective_problem, ckpt)
    keys = list(d.state_dict())
    params = [p for p in d.parameters() if p.requires_grad]
    out = []
    for compile in (False, True):
        obj = PEagleObjective(d, head, chunk_size=64, attention="sdpa", pad_multiple=32, compile=compile,
                              fused_loss=fused)
        loss, pred = obj(*args)
        out.append((loss.detach(), pred, torch.autograd.grad(loss, params, allow_unused=True)))
    assert d.compiled and list(d.state_dict()) == keys
    assert all(c.mode == "fullgraph" for c in d._compiled_layers), [c.mode for c in d._compiled_layers]
    chunk_body = compiled_chunk_loss(None, fused=fused)  # the body the benchmark reports
    assert chunk_body.mode == "fullgraph"
    (l0, p0, g0), (l1, p1, g1) = out
    torch.testing.assert_close(l1, l0, atol=1e-5, rtol=1e-5)
    assert (p0 == p1).float().mean() > 0.99  # argmax ties may flip at fp32 rounding
    for a, c in zip(g0, g1):
        if a is None:
            assert c is None
            continue
        torch.testing.assert_close(c, a, atol=1e-4, rtol=1e-4)
    d.set_compile(False)
    assert not d.compiled


@pytest.mark.parametrize("graph_breaks", [True, False])
def test_safe_compiled_falls_back_to_eager(monkeypatch, graph_breaks):
    """A failed compile retries with graph breaks allowed, then runs eagerly; with ``graph_breaks=False`` (the
    selective-checkpointing layers) it goes straight to eager."""
    calls = []

    def broken_compile(fn, **kw):
        calls.append(kw["fullgraph"])

        def run(*a, **k):
            raise RuntimeError("simulated Inductor failure")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    f = SafeCompiled(lambda x: x * 2, "double", graph_breaks=graph_breaks)
    tried = [True, False] if graph_breaks else [True]
    with pytest.warns(UserWarning, match="running it eagerly"):
        assert f(torch.tensor(3.0)).item() == 6.0
    assert calls == tried and f.mode == "eager"
    assert f(torch.tensor(4.0)).item() == 8.0  # stays eager, no retry
    assert calls == tried


def test_safe_compiled_does_not_swallow_oom(monkeypatch):
    def oom_compile(fn, **kw):
        def run(*a, **k):
            raise torch.OutOfMemoryError("simulated")
        return run

    monkeypatch.setattr(torch, "compile", oom_compile)
    with pytest.raises(torch.OutOfMemoryError):
        SafeCompiled(lambda x: x, "id")(torch.tensor(1.0))


def test_max_autotune_reaches_every_compile(tiny_drafter, objective_problem, monkeypatch):
    """train.compile: max-autotune compiles the decoder layers and the loss chunk with
    AUTOTUNE_OPTIONS (Inductor's max_autotune, GEMMs on cuBLAS); train.compile: true with Inductor's
    defaults (no options). The recipe accepts both; anything else is refused."""
    import peagle_train.kernels.compiling as compiling
    from peagle_train.core.config import ConfigError
    from peagle_train.recipe import config_from_dict

    seen = []

    def fake_compile(fn, **kw):  # record the call, run eagerly
        assert "mode" not in kw
        seen.append((getattr(fn, "__name__", type(fn).__name__), repr(kw.get("options"))))
        return fn

    monkeypatch.setattr(compiling.torch, "compile", fake_compile)
    monkeypatch.setattr(loss_mod, "_CHUNK_COMPILED", {})  # earlier tests' compiled chunk bodies are cached
    d, head, args = _problem(tiny_drafter, objective_problem, False)
    assert compiling.AUTOTUNE_OPTIONS["max_autotune"] and compiling.AUTOTUNE_OPTIONS["max_autotune_gemm_backends"] == "ATEN"
    with pytest.raises(ValueError, match="unknown compile mode"):
        compiling.compile_kwargs("fastest")
    for compile, mode in ((True, repr(None)), ("max-autotune", repr(compiling.AUTOTUNE_OPTIONS))):
        for fused, body in ((True, "_fused_chunk"), (False, "_chunk_loss")):  # fused: also "_apply_norm"
            seen.clear()
            loss, _ = PEagleObjective(d, head, chunk_size=64, attention="sdpa", compile=compile,
                                      fused_loss=fused)(*args)
            assert torch.isfinite(loss)
            assert {m for _, m in seen} == {mode} and body in {n for n, _ in seen}
            assert ("_apply_norm" in {n for n, _ in seen}) is fused  # the final norm outside the fused chunk
            if fused:  # the first objective of this mode compiles the layers; the second reuses them
                assert sum(n == "DrafterLayer" for n, _ in seen) == len(d.layers), seen
    base = {"output_dir": "x", "target": {"name": "t", "path": "p"}, "train": {}}
    assert config_from_dict(base | {"train": {"compile": "max-autotune"}}).train.compile == "max-autotune"
    assert config_from_dict(base | {"train": {"compile": True}}).train.compile is True
    with pytest.raises(ConfigError, match="train.compile"):
        config_from_dict(base | {"train": {"compile": "fastest"}})


def test_safe_compiled_can_start_with_graph_breaks_allowed(monkeypatch):
    """``fullgraph=False`` (``train.prefix_compiled_apart``'s layers, which break by design): the first and only
    compile allows graph breaks (no failing ``fullgraph=True`` attempt and its warning); a failure then goes to
    eager."""
    calls = []

    def fake_compile(fn, **kw):
        calls.append(kw["fullgraph"])
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    f = SafeCompiled(lambda x: x * 2, "double", fullgraph=False)
    assert f(torch.tensor(3.0)).item() == 6.0 and calls == [False] and f.mode == "graph-breaks"
    assert SafeCompiled(lambda x: x, "id").fullgraph is True


@pytest.mark.parametrize("objective", ["peagle", "eagle3"])
def test_objective_compiles_layers_with_graph_breaks_when_the_prefix_runs_apart(tiny_drafter, objective_problem,
                                                                                objective):
    """``prefix_compiled_apart=True`` with ``compile`` and the split form (``attention="flex"``) builds each layer's
    :class:`SafeCompiled` with ``fullgraph=False``; the default, or another attention kind (no prefix part to break
    at), keeps ``fullgraph=True``; switching builds the layers' wrappers anew. Both methods' objectives."""
    from peagle_train.methods.eagle3 import Eagle3Objective

    d, head, _ = _problem(tiny_drafter, objective_problem, ckpt=False)
    cls = PEagleObjective if objective == "peagle" else Eagle3Objective
    kw = {"chunk_size": 64, "pad_multiple": 32, "compile": True}
    for attention, apart, fullgraph in (("flex", False, True), ("flex", True, False), ("sdpa", True, True),
                                        ("flex_joint", True, True), ("flex", True, False)):
        obj = cls(d, head, attention=attention, prefix_compiled_apart=apart, **kw)
        assert obj.prefix_compiled_apart is apart
        assert [c.fullgraph for c in d._compiled_layers] == [fullgraph] * len(d.layers), (attention, apart)
