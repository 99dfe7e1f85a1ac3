"""benchmarks/must_show_throughput.py: issue 19's record, every figure read from a committed raw file."""
import json
import shutil
from pathlib import Path

import must_show_throughput as ms  # benchmarks/ is on sys.path (conftest)
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_committed_record_is_what_the_raw_files_give():
    """docs/data/must_show/throughput.json equals a fresh build: no figure typed in by hand or left stale."""
    rec = ms.build()
    assert json.loads((ROOT / "docs/data/must_show/throughput.json").read_text()) == json.loads(json.dumps(rec))
    for key, src in rec["sources"].items():
        assert (ROOT / src).is_file(), (key, src)
    assert set(rec["missing"]) == {k for k, (f, _) in ms.FIGURES.items() if f is None}


def test_figures_come_from_the_named_rows(tmp_path):
    """The path picks the row by value (N = 8,192, the run named zero2), ratios are computed, checks follow."""
    for name in {f for f, _ in ms.FIGURES.values() if f}:
        shutil.copy(ROOT / "docs/data" / name, tmp_path / name)
    # the max-autotune row of the 8K file, picked by value (the compile: on row before it must not be read); the
    # 131,072 step in ms becomes seconds
    g8, long_name = ms.FIGURES["gptoss_8k_ms"][0], ms.FIGURES["n131072_step_ms"][0]
    step = json.loads((tmp_path / g8).read_text())
    for row in step["rows"]:
        row["ref_step_ms"], row["step_ms"] = (800.0, 400.0) if row["compile"] == "max-autotune" else (1.0, 1.0)
        row["tflops"] = 500.0 if row["compile"] == "max-autotune" else 1.0
    step["meta"]["bf16_matmul_tflops"] = 1000.0
    (tmp_path / g8).write_text(json.dumps(step))
    long = json.loads((tmp_path / long_name).read_text())
    long["rows"][0]["step_ms"] = 14_000.0
    (tmp_path / long_name).write_text(json.dumps(long))
    # each ratio against the plain run of its own file (the two files' plain runs differ)
    for name, speeds in (("strategies_f5b8066_h100_mb64.json", {"plain": 100.0, "zero2": 1.0, "fsdp2": 80.0}),
                         ("strategies_90547d1_h100_mb64_zero2.json", {"plain": 200.0, "zero2": 190.0})):
        st = json.loads((tmp_path / name).read_text())
        for r in st["runs"]:
            r["tokens_per_s"] = speeds[r["name"]]
        (tmp_path / name).write_text(json.dumps(st))
    rec = ms.build(tmp_path)
    assert rec["speculators_8k_ms"] == 800.0 and rec["gptoss_8k_ms"] == 400.0
    assert rec["gptoss_8k_fraction_of_peak"] == pytest.approx(0.5) and rec["n131072_step_s"] == pytest.approx(14.0)
    assert rec["checks"]["gptoss_8k_ge_1.8x_speculators"]["holds"] and rec["checks"]["n131072_le_15s"]["holds"]
    assert rec["checks"]["gptoss_8k_ge_45pct_of_peak"]["holds"]
    assert rec["zero2_vs_plain"] == pytest.approx(0.95)
    assert rec["fsdp2_vs_plain"] == pytest.approx(0.80)
    assert rec["checks"]["zero2_ge_0.9"]["holds"] and not rec["checks"]["fsdp2_ge_0.9"]["holds"]
    assert rec["commits"]["zero2_vs_plain"] == "90547d1" and rec["commits"]["fsdp2_vs_plain"] == "f5b8066"
    assert rec["all_hold"] is False  # the N = 262,144 figure has no file


def test_a_missing_row_or_file_is_named(tmp_path):
    with pytest.raises(KeyError, match="0 items with N = 8192"):
        ms.dig([{"N": 4096}], [{"key": "N", "is": 8192}], "x.json")
    with pytest.raises(FileNotFoundError, match="must_show_throughput.py"):
        ms.build(tmp_path)
