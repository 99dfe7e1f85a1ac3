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
