"""CPU smoke test of ``benchmarks/train_step.py`` (issue #7): the tiny shape runs end to end
with ``--partitions auto`` (planner), two partitions, and ``--profile`` (top-ops table in the
JSON); rows and the table come out. ``--compile`` is exercised numerically in
``test_compile.py`` (compiling the benchmark's step on CPU takes about a minute)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_step_bench", ROOT / "benchmarks" / "train_step.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.usefixtures("torch_single_thread")
def test_train_step_cpu_smoke(bench, tmp_path, capsys):
    out = tmp_path / "b.json"
    rows = bench.main(["--shape", "tiny", "--seq-len", "256", "128", "--partitions", "auto", "2", "--steps", "2",
                       "--warmup", "1", "--compile", "off", "--profile", "--out", str(out)])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert rows[0]["S"] == 1 and rows[0]["plan"]["S"] == 1 and rows[1]["S"] == 2
    assert all(r["step_ms"] > 0 and r["first_step_s"] > 0 and r["compile"] is False for r in rows)
    data = json.loads(out.read_text())
    assert data["meta"]["compile_variants"] == [False]
    top = data["profile"]["top"]
    assert 0 < len(top) <= 25 and {"name", "ms_per_step", "pct_of_step"} <= set(top[0])
    printed = capsys.readouterr().out
    assert "step ms" in printed and "first s" in printed and "top" in printed


def test_reference_rows_carry_the_ratio(bench):
    rows = [{"N": 2048, "step_ms": 100.0}, {"N": 65536, "step_ms": 9000.0}, {"N": 4096, "error": "OOM"}]
    refs = {2048: {"status": "ok", "step_ms_median": 150.0, "peak_alloc_gb": 20.0, "grid_positions": 6897},
            65536: {"status": "oom"}, 4096: {"status": "ok", "step_ms_median": 200.0, "peak_alloc_gb": 16.0}}
    bench.attach_reference(rows, refs)
    assert rows[0]["speedup"] == pytest.approx(1.5) and rows[0]["ref_peak_gb"] == 20.0
    assert rows[1]["speedup"] is None and rows[1]["ref_status"] == "oom"  # where the reference runs out of memory
    assert rows[2]["speedup"] is None and rows[2]["ref_step_ms"] == 200.0  # ours failed: no ratio


def test_matmul_rate_is_none_on_cpu(bench):
    import torch

    assert bench.matmul_rate(torch.device("cpu")) is None


def test_mask_density_counts(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mask_density

    res = mask_density.main(["--seq-len", "300", "--out", str(tmp_path / "m.json")])
    assert res["blocks_partial"] + res["blocks_full"] <= res["blocks_total"]
    assert res["pairs_computed"] >= res["pairs_allowed"] > 0  # the block mask never drops an allowed pair
    assert json.loads((tmp_path / "m.json").read_text())["elements"] % 1024 == 0
