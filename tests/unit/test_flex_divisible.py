"""``IS_DIVISIBLE`` for FlexAttention on grids padded to multiples of 128
(``peagle_train.kernels.attention.divisible_options``): added on CUDA where both lengths are multiples of 128, never
where one is not, on a CPU, where the caller set it, or with ``DIVISIBLE_HINT`` off; passed on by ``_flex_call`` to
the FlexAttention call (the kernels' bounds-checked path is otherwise taken under dynamic shapes, where Inductor
cannot prove the lengths' divisibility)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import peagle_train.kernels.attention as attention_mod
from peagle_train.kernels.attention import _flex_call, divisible_options


class CudaLike:
    """What :func:`divisible_options` reads of a CUDA tensor (a class Dynamo traces, unlike ``SimpleNamespace``)."""

    is_cuda = True

    def __init__(self, shape):
        self.shape = shape


def fake(E: int, cuda: bool = True):
    """A stand-in tensor ``[1, heads, E, hd]``: only ``is_cuda`` and ``shape`` are read."""
    return SimpleNamespace(is_cuda=cuda, shape=(1, 8, E, 64))


def test_divisible_options_adds_the_hint_only_where_both_lengths_are_multiples_of_128():
    opts = {"fwd_BLOCK_M": 64}
    assert divisible_options(opts, fake(2048), fake(1024)) == {"fwd_BLOCK_M": 64, "IS_DIVISIBLE": True}
    assert opts == {"fwd_BLOCK_M": 64}  # the caller's dict is left as it was
    assert divisible_options(None, fake(128), fake(3072)) == {"IS_DIVISIBLE": True}
    for q, k in ((fake(2000), fake(2048)), (fake(2048), fake(2000)), (fake(64), fake(64))):
        assert divisible_options(opts, q, k) is opts  # one length not a multiple: Inductor's own choice
    assert divisible_options(None, fake(2048, cuda=False), fake(2048, cuda=False)) is None  # CPU: eager, no options
    given = {"IS_DIVISIBLE": False}
    assert divisible_options(given, fake(2048), fake(2048)) is given  # the caller's value wins


def test_divisible_hint_off_leaves_the_options_alone(monkeypatch):
    monkeypatch.setattr(attention_mod, "DIVISIBLE_HINT", False)
    assert divisible_options(None, fake(2048), fake(2048)) is None
    assert divisible_options({"BLOCK_M": 64}, fake(2048), fake(2048)) == {"BLOCK_M": 64}


@pytest.mark.parametrize("E, hinted", [(2048, True), (2000, False)])
def test_flex_call_passes_the_hint_to_flex_attention(E, hinted):
    seen = {}

    def flex(q, k, v, **kw):
        seen.update(kw)
        return "out"

    assert _flex_call(flex, fake(E), fake(E), fake(E), "mask", return_lse=False) == "out"
    assert seen["block_mask"] == "mask" and seen["enable_gqa"] is True
    assert seen.get("kernel_options") == ({"IS_DIVISIBLE": True} if hinted else None)


def test_divisible_options_in_a_compiled_graph_is_a_guard_on_the_length():
    """Traced by Dynamo with dynamic lengths (as inside a compiled drafter layer), the test on the length becomes a
    guard: lengths that are multiples of 128 share one graph that takes the hint, another length gets a graph of its
    own without it, and there is no graph break (``fullgraph``)."""
    import torch
    from torch._dynamo.testing import CompileCounter

    def f(x):
        q = CudaLike(x.shape)  # a CUDA tensor's two attributes, the length symbolic
        return x + (1.0 if divisible_options(None, q, q) else 0.0)

    torch._dynamo.reset()
    counter = CompileCounter()
    g = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for E, hinted in ((256, True), (384, True), (1024, True), (200, False), (512, True)):
        assert g(torch.zeros(1, 2, E, 4))[0, 0, 0, 0].item() == (1.0 if hinted else 0.0), E
    assert counter.frame_count == 2  # one graph for the multiples of 128, one for 200
    torch._dynamo.reset()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="FlexAttention's compiled kernels need CUDA")
def test_the_hint_changes_no_number_on_a_gpu(monkeypatch):
    """On a GPU: compiled FlexAttention under dynamic shapes (lengths 1,024, 2,048, then 1,000, which gets no hint)
    gives the same outputs and gradients with the hint as without it."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def run(hint: bool):
        monkeypatch.setattr(attention_mod, "DIVISIBLE_HINT", hint)
        torch._dynamo.reset()
        flex = torch.compile(flex_attention, dynamic=None)
        results = []
        for E in (1024, 2048, 1000):
            g = torch.Generator(device="cuda").manual_seed(E)
            q = torch.randn(1, 4, E, 64, device="cuda", generator=g, requires_grad=True)
            k, v = (torch.randn(1, 2, E, 64, device="cuda", generator=g, requires_grad=True) for _ in range(2))
            mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, E, E, device="cuda")
            out = _flex_call(flex, q, k, v, mask, return_lse=False)
            out.square().sum().backward()
            results.append((out.detach(), q.grad, k.grad, v.grad))
        return results

    for with_hint, without in zip(run(True), run(False)):
        for a, b in zip(with_hint, without):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
