"""``benchmarks/speculators_ref.py``: the speculators 0.9.0 P-EAGLE reference timing (issue #7).

* Without speculators (the project's own environment): the module imports, ``run_reference``
  raises an ``ImportError`` that names the ``.whl_spec`` wheels folder, ``SHAPES`` are read from
  ``train_step.py``'s source, and the fused-loss autotune patch splits a shared config list
  (checked on stand-in kernels, since Triton is not on the CPU machine).
* With speculators importable (e.g. ``/work/spec-venv``): the CPU smoke path (eager attention,
  eager KL loss, no compile) runs a tiny shape end to end and returns sane keys and values, and
  the meta-device parameter count matches the GPT-OSS-20B shape's formula.
"""
from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import speculators_ref as ref  # benchmarks/ is on sys.path (conftest)

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            vocab_size=512, rms_norm_eps=1e-5, max_position_embeddings=4096, rope_theta=10000.0)


def test_shapes_read_from_train_step_source():
    shapes = ref.load_shapes()
    assert "gpt-oss-20b" in shapes and "tiny" in shapes
    g = shapes["gpt-oss-20b"]
    assert g["hidden_size"] == 2880 and g["vocab_size"] == 201088 and g["draft_vocab"] == 32000
    assert all(k in g for k in ref.SHAPE_KEYS)


def test_missing_speculators_raises_clear_import_error(monkeypatch):
    # Hide speculators whether or not it is installed: a None entry in sys.modules makes import fail.
    for name in [m for m in sys.modules if m == "speculators" or m.startswith("speculators.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "speculators", None)
    with pytest.raises(ImportError) as ei:
        ref.run_reference(TINY, 64, 8, 0.7, 0.2, 1, 0, "cpu", 256)
    msg = str(ei.value)
    assert isinstance(ei.value, ref.SpeculatorsUnavailableError)
    assert ".whl_spec" in msg and "--target /tmp/site" in msg and "PYTHONPATH" in msg


def test_autotune_patch_splits_shared_config_list():
    class Cfg:
        def __init__(self, block):
            self.kwargs = {"BLOCK_SIZE": block}
            self.num_warps = 4

    shared = [Cfg(1024), Cfg(2048)]
    fused = types.SimpleNamespace(loss_forward_kernel=types.SimpleNamespace(configs=shared),
                                  loss_backward_kernel=types.SimpleNamespace(configs=shared))
    assert ref.patch_fused_loss_autotune(fused) is True
    fwd, bwd = fused.loss_forward_kernel.configs, fused.loss_backward_kernel.configs
    assert fwd is not bwd and fwd is not shared
    assert [c.kwargs for c in fwd] == [c.kwargs for c in bwd] == [{"BLOCK_SIZE": 1024}, {"BLOCK_SIZE": 2048}]
    assert all(a is not b and a.kwargs is not b.kwargs for a, b in zip(fwd, bwd))
    assert ref.patch_fused_loss_autotune(fused) is False  # idempotent: already separate
    assert ref.patch_fused_loss_autotune(types.SimpleNamespace()) is False


def test_datasets_shim_only_when_missing(monkeypatch):
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    real = importlib.util.find_spec("datasets") is not None
    installed = ref._install_datasets_shim()
    try:
        assert installed is (not real)
        if installed:
            stub = sys.modules["datasets"]
            assert getattr(stub, "__speculators_ref_stub__", False)
            with pytest.raises(ImportError, match="not installed"):
                stub.load_from_disk("x")
            assert importlib.util.find_spec("datasets") is not None  # probing it does not raise
    finally:
        if installed:
            sys.modules.pop("datasets", None)
            ref._shimmed.remove("datasets")


@pytest.fixture(scope="module")
def speculators_available():
    ref._install_datasets_shim()  # import-only stub, as run_reference does, when `datasets` is missing
    pytest.importorskip("speculators.models.peagle",
                        reason="speculators 0.9.0 not importable (install the .whl_spec wheels or use /work/spec-venv)")


def test_cpu_smoke_run(speculators_available):
    rec = ref.run_reference(TINY, 64, 4, 0.7, 0.2, steps=2, warmup=1, device="cpu", draft_vocab=256, layers=2)
    assert rec["status"] == "ok", rec["status"]
    for k in ref.RESULT_KEYS:
        assert k in rec
    assert 0 < rec["step_ms_min"] <= rec["step_ms_median"] <= rec["step_ms_max"]
    assert rec["first_step_s"] > 0
    assert rec["peak_alloc_gb"] is None  # CPU
    # depth 0 keeps all 64 positions; depths 1..3 keep about 64 * r**d (floor r_min), never more than N per depth
    assert 64 + 3 * 10 < rec["grid_positions"] <= 64 * 4
    assert rec["loss_implementation"] == "eager" and rec["attention"].startswith("eager")
    assert rec["speculators"] == "0.9.0"
    # trainable = embed [V, H] + fc [H, 3H] + mask_hidden [3H] + layers + final norm (lm_head frozen)
    H, V, I, nh, nkv, hd = 64, 512, 128, 4, 2, 16
    attn = lambda d_in: d_in * (nh + 2 * nkv) * hd + nh * hd * H  # noqa: E731
    first = attn(2 * H) + 3 * H * I + 3 * H
    other = attn(H) + 3 * H * I + 2 * H
    assert rec["trainable_params"] == V * H + 3 * H * H + 3 * H + first + other + H


def test_gpt_oss_trainable_params_on_meta(speculators_available):
    g = ref.load_shapes()["gpt-oss-20b"]
    n = ref.count_trainable_params(g, 32000, layers=4, K=8)
    assert n == 990_388_800  # same as peagle_train's Drafter for this shape (lm_head frozen)


def test_bad_optimizer_reports_error(speculators_available):
    rec = ref.run_reference(TINY, 32, 2, 0.7, 0.2, 1, 0, "cpu", 256, layers=1, optimizer="sgd")
    assert rec["status"].startswith("error: ValueError")


def test_train_step_reference_rows_in_one_run(speculators_available, bench, tmp_path, capsys):
    """``train_step.py --reference speculators``: ours and speculators' step for the same N in one
    process; every row carries the reference time and the ratio."""
    import json

    out = tmp_path / "b.json"
    rows = bench.main(["--shape", "tiny", "--seq-len", "64", "--steps", "1", "--warmup", "1",
                       "--reference", "speculators", "--out", str(out)])
    assert rows[0]["ref_status"] == "ok" and rows[0]["ref_step_ms"] > 0
    assert rows[0]["speedup"] == pytest.approx(rows[0]["ref_step_ms"] / rows[0]["step_ms"])
    assert json.loads(out.read_text())["rows"][0]["speedup"] == rows[0]["speedup"]
    assert "speculators:" in capsys.readouterr().out
