"""train.compile_cache: torch.compile's compiled code written at the end of a launch and read by the next one on
another machine (here: another process with an empty Inductor cache folder), so the next launch hits the compiles
instead of running them (peagle_train/trainer/compile_cache.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import needs_cc

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import json, sys, torch
    from pathlib import Path
    from torch._dynamo.utils import counters
    from peagle_train.trainer.compile_cache import load_compile_cache, save_compile_cache
    path, mode = Path(sys.argv[1]), sys.argv[2]
    loaded = load_compile_cache(path) if mode == "load" else None
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    f = torch.compile(lambda x: torch.relu(lin(x)) * 2)
    x = torch.randn(4, 8, requires_grad=True)
    f(x).sum().backward()
    saved = save_compile_cache(path) if mode == "save" else None
    print(json.dumps({"loaded": loaded, "saved": saved, "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
''')


def _run(tmp_path: Path, mode: str, cache_dir: str) -> dict:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache_dir), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cc.bin"), mode], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_cc
def test_a_fresh_process_hits_the_compiles_the_saved_file_holds(tmp_path):
    first = _run(tmp_path, "save", "inductor_a")
    assert first["misses"] >= 1 and first["hits"] == 0
    assert first["saved"]["bytes"] == (tmp_path / "cc.bin").stat().st_size > 0
    assert first["saved"]["artifacts"].get("inductor", 0) >= 1
    second = _run(tmp_path, "load", "inductor_b")  # another machine: an empty Inductor cache folder
    assert second["loaded"]["artifacts"] == first["saved"]["artifacts"]
    assert second["hits"] >= 1 and second["misses"] == 0
    cold = _run(tmp_path, "none", "inductor_c")  # the same without the file: compiled afresh
    assert cold["hits"] == 0 and cold["misses"] >= 1


def test_paths_and_an_unreadable_file(tmp_path):
    from peagle_train.trainer.compile_cache import compile_cache_path, load_compile_cache, save_compile_cache

    assert compile_cache_path(None, tmp_path) is None
    assert compile_cache_path("cc.bin", tmp_path) == tmp_path / "cc.bin"
    assert compile_cache_path(str(tmp_path / "x" / "cc.bin"), "/elsewhere") == tmp_path / "x" / "cc.bin"
    assert load_compile_cache(None) is None and save_compile_cache(None) is None
    assert load_compile_cache(tmp_path / "absent.bin") is None
    (tmp_path / "bad.bin").write_bytes(b"not torch's format")
    with pytest.warns(UserWarning, match="could not read it.*compiling afresh"):
        got = load_compile_cache(tmp_path / "bad.bin")
    assert got["bytes"] == 18 and got["error"]
