"""Pins the memory planner (``planner.py``, issue #7): it reproduces the measured peaks of
``docs/benchmarks.md`` within 15 %, predicted peaks grow with N and shrink with S, small
sequences need no partitions, the fewest fitting S is chosen (checkpointing only when no
S fits without it), and an impossible request raises a clear error."""
from __future__ import annotations

import pytest

from peagle_train.planner import GIB, ShapeParams, expected_elements, plan_step, predict_peak_bytes

GPT_OSS = ShapeParams(hidden_size=2880, intermediate_size=7680, num_layers=4, num_heads=64, num_kv_heads=8,
                      head_dim=64, vocab_size=201088, draft_vocab_size=32000, target_hidden_size=2880)
H200 = int(139.8 * GIB)
COD = dict(K=8, r=0.7, r_min=0.2)


def test_trainable_params_match_the_benchmark_count():
    assert GPT_OSS.trainable_params() == 990_388_800  # docs/benchmarks.md


def test_expected_elements():
    assert expected_elements(8192, **COD) == pytest.approx(27_626, rel=2e-3)  # measured grid positions
    assert expected_elements(8192, **COD) / 8192 == pytest.approx(3.373, abs=1e-3)


@pytest.mark.parametrize("N,S,measured_gib", [(2048, 1, 21.8), (4096, 1, 26.8), (8192, 1, 35.7), (16384, 1, 53.6),
                                              (32768, 2, 69.1)])
def test_calibration_points_within_15_percent(N, S, measured_gib):
    got = predict_peak_bytes(N, S, GPT_OSS, **COD) / GIB
    assert got == pytest.approx(measured_gib, rel=0.15)
    assert got == pytest.approx(measured_gib, rel=0.05)  # the fit is in fact within 4 %


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
    plan = plan_step(65536, gpu_bytes=H200, shape=GPT_OSS, **COD)
    assert plan.partitions == 2 and not plan.checkpointing  # S=1 would need ~173 GiB
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert predict_peak_bytes(65536, 1, GPT_OSS, **COD) > plan.budget_bytes


def test_checkpointing_only_when_no_S_fits():
    plan = plan_step(131072, gpu_bytes=H200, shape=GPT_OSS, **COD)
    assert plan.checkpointing
    with pytest.raises(ValueError, match="no plan fits"):
        plan_step(131072, gpu_bytes=H200, shape=GPT_OSS, allow_checkpointing=False, **COD)


def test_impossible_raises_clear_error():
    with pytest.raises(ValueError, match=r"no plan fits N=1048576.*exceeds the budget"):
        plan_step(1 << 20, gpu_bytes=H200, shape=GPT_OSS, **COD)
    with pytest.raises(ValueError, match="no plan fits"):
        plan_step(2048, gpu_bytes=8 * GIB, shape=GPT_OSS, **COD)  # weights + AdamW alone are ~15 GiB
    with pytest.raises(ValueError, match="headroom"):
        plan_step(2048, gpu_bytes=H200, shape=GPT_OSS, headroom=0.0, **COD)


def test_partitions_for_training():
    from peagle_train.planner import partitions_for

    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, None) == 1  # no GPU: no split
    assert partitions_for(2048, 8, 0.7, 0.2, GPT_OSS, H200) == 1
    assert partitions_for(65536, 8, 0.7, 0.2, GPT_OSS, H200) == 2
    with pytest.raises(ValueError, match="no plan fits"):
        partitions_for(10**6, 8, 0.7, 0.2, GPT_OSS, 40 * GIB)
