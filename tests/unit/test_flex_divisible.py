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
