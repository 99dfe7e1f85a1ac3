"""benchmarks/quality_report.py: the P-EAGLE vs EAGLE-3 comparison tables from the experiment's files."""
import json

import pytest
import quality_report  # benchmarks/ is on sys.path (conftest)


def _eval(al7: float, draft_ms: list[float]) -> dict:
    rows = [{"K": k, "acceptance_length": 1 + (al7 - 1) * k / 7, "draft_ms_per_round": draft_ms[k - 1],
             "speedup": 1.0 + 0.01 * k} for k in range(1, 8)]
    return {"datasets": {d: {"by_K": rows} for d in ("mt_bench", "humaneval", "heldout")}}


def test_comparison_tables(tmp_path):
    names = quality_report.NAMES
    (tmp_path / f"{names['peagle']}-eval.json").write_text(json.dumps(_eval(2.4, [4.0] * 6 + [4.4])))
    (tmp_path / f"{names['eagle3']}-eval.json").write_text(json.dumps(_eval(2.0, [1.0 * k for k in range(1, 8)])))
    final = {"eval_walk_al_heldout": {"7": 2.5}, "eval_sim_al": {"7": 2.9}, "eval_loss": 1.5}
    (tmp_path / f"{names['peagle']}-train-metrics.json").write_text(json.dumps({"steps": 10, "final": final}))
    md, data = quality_report.build(tmp_path)
    assert data["acceptance_length"]["mt_bench/K7"]["ratio"] == pytest.approx(1.2)
    assert data["draft_ms"]["peagle"]["K7_over_K1"] == pytest.approx(1.1)
    assert data["draft_ms"]["eagle3"]["K7_over_K1"] == pytest.approx(7.0)
    gap = data["sim_vs_measured"]["peagle/K7"]
    assert gap["measured"] == pytest.approx(2.4) and gap["relative_gap"] == pytest.approx(2.4 / 2.5 - 1)
    assert data["sim_vs_measured"]["eagle3/K7"]["simulated"] is None  # no train metrics: shown as a dash
    assert "| mt_bench | 7 | 2.40 | 2.00 | 1.20 |" in md and "-4.0 %" in md
    assert quality_report.main([str(tmp_path)]) == 0 and (tmp_path / "comparison.json").exists()
    png = tmp_path / "comparison.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_missing_reports_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="eval step"):
        quality_report.build(tmp_path)
