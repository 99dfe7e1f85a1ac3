"""Pins the memory planner (``planner.py``, issue #7): it reproduces the measured peaks of
``docs/benchmarks.md`` within 2 %, predicted peaks grow with N and shrink with S, small
sequences need no partitions, the fewest fitting S is chosen (checkpointing only when no
S fits without it), and an impossible request raises a clear error."""
from __future__ import annotations

import pytest

from peagle_train.peagle.planner import GIB, ShapeParams, expected_elements, plan_step, predict_peak_bytes

GPT_OSS = ShapeParams(hidden_size=2880, intermediate_size=7680, num_layers=4, num_heads=64, num_kv_heads=8,
                      head_dim=64, vocab_size=201088, draft_vocab_size=32000, target_hidden_size=2880)
H200 = int(139.8 * GIB)
COD = dict(K=8, r=0.7, r_min=0.2)


def test_trainable_params_match_the_benchmark_count():
    assert GPT_OSS.trainable_params() == 990_388_800  # docs/benchmarks.md


def test_expected_elements():
    assert expected_elements(8192, **COD) == pytest.approx(27_626, rel=2e-3)  # measured grid positions
    assert expected_elements(8192, **COD) / 8192 == pytest.approx(3.373, abs=1e-3)


# peaks measured on one H200 on 2026-11-30 (docs/data/train_step_s8_*.json; docs/benchmarks.md)
@pytest.mark.parametrize("N,S,measured_gib", [(2048, 1, 17.23), (4096, 1, 20.61), (8192, 1, 26.62), (16384, 1, 38.91),
                                              (32768, 1, 63.56), (65536, 2, 83.32), (65536, 1, 112.87)])
def test_calibration_points_within_2_percent(N, S, measured_gib):
    got = predict_peak_bytes(N, S, GPT_OSS, **COD) / GIB
    assert got == pytest.approx(measured_gib, rel=0.02)  # the fit is within 1 %


def test_recompute_loss_and_resident_gradients_cost_memory():
    """``fused_loss=False`` keeps every chunk's bf16 target logits (measured 27.59 GiB at N = 8,192, S = 1:
    predicted within 3 %, from above); resident gradients (S > 1, or several micro-batches) add 4 bytes
    per trainable parameter."""
    fused, recompute = (predict_peak_bytes(8192, 1, GPT_OSS, fused_loss=f, **COD) for f in (True, False))
    assert recompute - fused == 2 * 32000 * 27648  # 2 Vd E_seg bytes
    assert recompute / GIB == pytest.approx(27.59, rel=0.03) and recompute / GIB > 27.59
    resident = predict_peak_bytes(8192, 1, GPT_OSS, grads_resident=True, **COD)
    assert resident - fused == 4 * GPT_OSS.trainable_params()
    assert predict_peak_bytes(8192, 2, GPT_OSS, grads_resident=False, **COD) < predict_peak_bytes(8192, 2, GPT_OSS, **COD)
    trainable = predict_peak_bytes(8192, 1, GPT_OSS, lm_head_trainable=True, **COD)
    # AdamW m, v + the fused head gradient's accumulator + one chunk's head gradient before it is added
    assert trainable - fused == 8 * 32000 * 2880 + 4 * 32000 * 2880 + 4 * 32000 * 2880
    # the recompute path's extra logits make N = 65,536 need two segments on an H200
    assert plan_step(65536, gpu_bytes=H200, shape=GPT_OSS, fused_loss=False, **COD).partitions == 2


def test_monotone():
    Ns = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
    peaks = [predict_peak_bytes(N, 1, GPT_OSS, **COD) for N in Ns]
    assert peaks == sorted(peaks) and len(set(peaks)) == len(peaks)
    by_S = [predict_peak_bytes(65536, S, GPT_OSS, **COD) for S in range(1, 9)]
    assert by_S == sorted(by_S, reverse=True)
    assert predict_peak_bytes(65536, 1, GPT_OSS, checkpointing=True, **COD) < by_S[0]
    plans = [plan_step(N, gpu_bytes=H200, shape=GPT_OSS, **COD) for N in Ns]
    assert [p.partitions for p in plans] == sorted(p.partitions for p in plans)


def test_small_N_needs_one_partition():
    S, ckpt = plan_step(2048, gpu_bytes=H200, shape=GPT_OSS, **COD)
    assert (S, ckpt) == (1, False)
    tiny = ShapeParams(64, 128, 4, 4, 2, 16, 512, 256, 64)
    assert tuple(plan_step(256, gpu_bytes=80 * GIB, shape=tiny, **COD)) == (1, False)


def test_fewest_partitions_that_fit():
    assert tuple(plan_step(65536, gpu_bytes=H200, shape=GPT_OSS, **COD)) == (1, False)  # measured: 112.9 GiB
    plan = plan_step(131072, gpu_bytes=H200, shape=GPT_OSS, **COD)
    assert plan.partitions == 3 and not plan.checkpointing
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert predict_peak_bytes(131072, 2, GPT_OSS, **COD) > plan.budget_bytes


def test_checkpointing_only_when_no_S_fits():
    plan = plan_step(262144, gpu_bytes=H200, shape=GPT_OSS, **COD)
    assert plan.checkpointing
    with pytest.raises(ValueError, match="no plan fits"):
        plan_step(262144, gpu_bytes=H200, shape=GPT_OSS, allow_checkpointing=False, **COD)


def test_impossible_raises_clear_error():
    with pytest.raises(ValueError, match=r"no plan fits N=1048576.*exceeds the budget"):
        plan_step(1 << 20, gpu_bytes=H200, shape=GPT_OSS, **COD)
    with pytest.raises(ValueError, match="no plan fits"):
        plan_step(2048, gpu_bytes=8 * GIB, shape=GPT_OSS, **COD)  # weights + AdamW alone are ~11 GiB
    with pytest.raises(ValueError, match="headroom"):
        plan_step(2048, gpu_bytes=H200, shape=GPT_OSS, headroom=0.0, **COD)


def test_partitions_for_training():
    from peagle_train.peagle.planner import partitions_for

    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, None) == 1  # no GPU: no split
    assert partitions_for(2048, 8, 0.7, 0.2, GPT_OSS, H200) == 1
    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, H200) == 1
    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, H200, grads_resident=True) == 1  # 116.8 GiB
    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, H200, fused_loss=False) == 2
    with pytest.raises(ValueError, match="no plan fits"):
        partitions_for(10**6, 8, 0.7, 0.2, GPT_OSS, 40 * GIB)


def test_partitions_for_plans_with_the_recipes_checkpointing():
    """``train.activation_checkpointing`` on: the plan is made with it (an 80 GB card, GPT-OSS-20B shape, N =
    131,072: S = 2 with checkpointing, where without it even S = 8 is predicted at 97.6 GiB and refused, the
    refusal of the --checkpointing run in docs/benchmarks.md); the message suggests checkpointing only where
    it was off."""
    from peagle_train.peagle.planner import partitions_for, plan_step

    h100 = int(79.2 * GIB)
    kw = dict(lm_head_trainable=True, target_head_bytes=4)
    with pytest.raises(ValueError, match=r"97\.6 GiB with S <= 8, no checkpointing.*turn on activation checkpointing"):
        partitions_for(131072, 8, 0.7, 0.2, GPT_OSS, h100, **kw)
    assert partitions_for(131072, 8, 0.7, 0.2, GPT_OSS, h100, checkpointing=True, **kw) == 2
    plan = plan_step(131072, 8, 0.7, 0.2, GPT_OSS, h100, checkpointing=True, **kw)
    assert plan.checkpointing and plan.predicted_peak_bytes <= plan.budget_bytes
    with pytest.raises(ValueError, match="S <= 8, checkpointing\\) exceeds") as e:
        partitions_for(262144, 8, 0.7, 0.2, GPT_OSS, h100, checkpointing=True, **kw)
    assert "turn on activation checkpointing" not in str(e.value)
    # checkpointing=None keeps plan_step's search: off first, then on
    assert plan_step(131072, 8, 0.7, 0.2, GPT_OSS, h100, **kw) == plan


def test_eager_loss_chunk_buffers_are_counted_from_its_live_tensors():
    """``OMEGA_EAGER``: without ``train.compile`` the loss chunk body (``kernels.loss._fused_chunk``) is eager; the
    bytes of the tensors it holds at once at its peak, counted on the CPU by a dispatch mode that follows every
    storage it creates until freed, are 6.44 fp32 ``[c, Vd]`` chunks plus its ``[Vd, H]`` float32 head gradient,
    whatever c, Vd and H. OMEGA_EAGER adds the target's logits chunk (1) the loop holds beside it."""
    import torch
    from test_planner_online import LiveBytes

    from peagle_train.kernels.loss import _fused_chunk
    from peagle_train.peagle.planner import OMEGA_EAGER

    for c, V, H in ((256, 4000, 32), (512, 6000, 64)):
        g = torch.Generator().manual_seed(c)
        hn, w = torch.randn(c, H, generator=g).bfloat16(), torch.randn(V, H, generator=g).bfloat16()
        t_logits, weight = torch.randn(c, V, generator=g), torch.rand(c, generator=g)
        live = LiveBytes([hn, w, t_logits, weight])
        with torch.no_grad(), live:
            out = _fused_chunk(hn, w, t_logits, weight, "kl", True, True)
        del out
        chunks = (live.peak - 4 * V * H) / (4 * c * V)
        assert chunks == pytest.approx(OMEGA_EAGER - 1, abs=0.1), chunks  # 6.38-6.44 (which temporaries overlap)


def test_llama_recipe_on_the_cache_matches_its_h200_peak():
    """The first GPU point of an uncompiled step with a large trainable vocabulary (docs/real_shapes.md): the
    Llama-3.1-8B recipe on its feature cache, N = 3,788 packed tokens, S = 2, K = 10, checkpointing, chunk 2,048,
    head and embeddings trained at Vd = V = 128,256, measured 49.92 GB on an H200 (the model without the eager
    loss and head-copy terms said 41.48 GB, -16.9 %). Within 5 %, and not above the measured peak by more."""
    llama = ShapeParams(hidden_size=4096, intermediate_size=14336, num_layers=4, num_heads=32, num_kv_heads=8,
                        head_dim=128, vocab_size=128256, draft_vocab_size=128256, target_hidden_size=4096)
    kw = dict(checkpointing=True, chunk=2048, lm_head_trainable=True, target_head_bytes=4)
    eager = predict_peak_bytes(3788, 2, llama, 10, 0.7, 0.2, compiled_loss=False, **kw)
    assert eager / 49.92e9 == pytest.approx(1.0, abs=0.05)
    compiled = predict_peak_bytes(3788, 2, llama, 10, 0.7, 0.2, **kw)
    assert compiled < eager  # the compiled chunk body keeps fewer buffers
