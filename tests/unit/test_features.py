"""Tests for the hidden-state cache (peagle_train.features): bf16/fp8 round trips, resume after a
kill, checksums, memory-mapped random access, manifest counts, verify-against-recompute.

The target is a tiny random ``LlamaForCausalLM`` (hidden 32, 4 layers, aux ids 1,2,3) wrapped
in the real :class:`peagle_train.features.target.Target`, so ``features()`` is the production code path.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from peagle_train.features import cache as F
from peagle_train.features import packing
from peagle_train.features.cache import CachedFeatures, CacheError, cache_size_report, write_cache
from peagle_train.features.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from peagle_train.features.online import OnlineFeatures, iter_target_features, length_batches
from peagle_train.features.target import Target

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaForCausalLM

    from tests.conftest import _tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config()).eval().requires_grad_(False)
    with torch.no_grad():  # larger-than-init weights: hidden states with a realistic spread
        for p in model.parameters():
            p.mul_(4.0)
    return Target(model=model, tokenizer=None, aux_layer_ids=[1, 2, 3], path="tiny-random-llama")


@pytest.fixture(scope="module")
def seqs():
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(3, 40, (11,), generator=g).tolist()
    return [torch.randint(0, 127, (n,), generator=g).tolist() for n in lens]


def build(target, seqs, d: Path, dtype="bfloat16", **kw) -> Path:
    return write_cache(target, seqs, d, dtype=dtype, batch_size=3, shard_size=4, progress=False, **kw)


def reference(target, seqs):
    return list(iter_target_features(target, seqs, 3))


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# --------------------------------------------------------------------------- round trips


def test_bf16_round_trip_is_exact_cast(target, seqs, tmp_path):
    build(target, seqs, tmp_path)
    cache = CachedFeatures(tmp_path)
    ref = reference(target, seqs)
    assert len(cache) == len(seqs)
    got = cache.get(list(range(len(seqs))), with_input_ids=True)
    for s, r, g in zip(seqs, ref, got):
        assert g["aux"].dtype == torch.bfloat16 and g["aux"].shape == (len(s), 3 * 32)
        assert g["last"].shape == (len(s), 32)
        assert torch.equal(g["aux"], r["aux"].to(torch.bfloat16))
        assert torch.equal(g["last"], r["last"].to(torch.bfloat16))
        assert torch.equal(g["argmax"], r["argmax"]) and g["argmax"].dtype == torch.int64
        assert g["input_ids"].tolist() == s
    assert torch.equal(cache.target_head(), target.lm_head_weight().to(torch.bfloat16))
    assert torch.equal(cache.target_embeddings(), target.model.get_input_embeddings().weight.to(torch.bfloat16))


def test_fp8_round_trip_within_e4m3_error_bounds(target, seqs, tmp_path):
    build(target, seqs, tmp_path, dtype="fp8")
    cache = CachedFeatures(tmp_path)
    ref = reference(target, seqs)
    num = den = 0.0
    for i, (s, r) in enumerate(zip(seqs, ref)):
        g = cache.get([i])[0]
        assert g["aux"].dtype == torch.bfloat16  # dequantised to the bf16 cache's dtype
        for key, groups in (("aux", 3), ("last", 1)):
            x = r[key].float()
            n = x.shape[0]
            scale = x.view(n, groups, -1).abs().amax(-1, keepdim=True) / 448.0
            # e4m3: 3 mantissa bits -> rel. error <= 2^-4 on normals, abs <= scale*2^-10 on subnormals;
            # plus the bf16 output rounding (rel. 2^-9)
            bound = x.view(n, groups, -1).abs() * (2**-4 + 2**-8) + scale * 2**-9
            err = (g[key].float() - x).view(n, groups, -1).abs()
            assert (err <= bound + 1e-7).all(), f"sequence {i} {key}: fp8 error above the e4m3 bound"
            if key == "aux":
                num, den = num + err.sum().item(), den + x.abs().sum().item()
        assert torch.equal(g["argmax"], r["argmax"])
    assert 0.0 < num / den < 0.04  # mean relative error of e4m3 round-to-nearest is ~2^-5


def test_fp8_quantiser_zero_rows_and_outliers():
    x = torch.zeros(3, 8)
    x[1, 2] = 1000.0
    x[1, 3] = 1e-3
    x[2] = torch.linspace(-5, 5, 8)
    q, s = quantize_fp8_rows(x, groups=2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s.dtype == torch.float32
    assert s[0].tolist() == [1.0, 1.0]  # all-zero blocks
    y = dequantize_fp8_rows(q, s, torch.float32)
    assert torch.equal(y[0], x[0])
    assert y[1, 2].item() == 1000.0  # the block's amax is exact (maps to 448)
    with pytest.raises(ValueError, match="G=3"):
        quantize_fp8_rows(torch.zeros(2, 8), groups=3)


# --------------------------------------------------------------------------- manifest and size


@pytest.mark.parametrize("dtype,payload", [("bfloat16", 2 * 4 * 32), ("fp8", 4 * 32 + 4 * 4)])
def test_manifest_counts_and_size_report(target, seqs, tmp_path, dtype, payload):
    build(target, seqs, tmp_path, dtype=dtype)
    man = json.loads((tmp_path / "manifest.json").read_text())
    lens = [len(s) for s in seqs]
    assert man["complete"] and man["dtype"] == dtype and man["num_sequences"] == len(seqs)
    assert [s["count"] for s in man["shards"]] == [4, 4, 3]
    assert [s["tokens"] for s in man["shards"]] == [sum(lens[0:4]), sum(lens[4:8]), sum(lens[8:])]
    assert man["total_tokens"] == sum(lens)
    files = sum((tmp_path / s["file"]).stat().st_size for s in man["shards"])
    assert man["total_bytes"] == files and man["bytes_per_token"] == pytest.approx(files / sum(lens))
    rep = cache_size_report(tmp_path)
    assert rep["tokens"] == sum(lens) and rep["sequences"] == len(seqs)
    per = rep["tensor_bytes_per_token"]
    # aux+last(+scales) bytes/token: bf16 2*(A+1)*T, fp8 (A+1)*T + 4*(A+1)
    assert sum(v for k, v in per.items() if k.startswith(("aux", "last"))) == payload
    assert per["input_ids"] == 4 and per["argmax"] == 4


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_resume_after_kill_mid_shard_is_byte_identical(target, seqs, tmp_path, monkeypatch, dtype):
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    build(target, seqs, clean, dtype=dtype)

    real_save = F.save_file
    calls = {"n": 0}

    def dying_save(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:  # head, shard 0, then die while writing shard 1: a half-written .tmp
            Path(path).write_bytes(b"half a shard")
            raise KeyboardInterrupt("killed")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(F, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        build(target, seqs, killed, dtype=dtype)
    monkeypatch.setattr(F, "save_file", real_save)
    man = json.loads((killed / "manifest.json").read_text())
    assert not man["complete"] and [s["file"] for s in man["shards"]] == ["shard-00000.safetensors"]
    assert (killed / "shard-00001.safetensors.tmp").exists()
    with pytest.raises(CacheError, match="incomplete"):
        CachedFeatures(killed)

    recomputed = []
    real_iter = F.iter_target_features
    monkeypatch.setattr(F, "iter_target_features", lambda t, chunk, b: (recomputed.append(len(chunk)), real_iter(t, chunk, b))[1])
    build(target, seqs, killed, dtype=dtype)
    assert recomputed == [4, 3]  # only the missing shards were recomputed
    assert dir_bytes(killed) == dir_bytes(clean)  # shards, head and manifest byte-identical; no .tmp left


def test_disk_full_names_where_and_how_much_and_resumes(target, seqs, tmp_path, monkeypatch):
    """A full disk while writing shard 1 is a CacheError naming the folder, the shard and the bytes it
    needed; no partial file stays, the manifest lists only finished shards, and a re-run after space is
    freed finishes a cache byte-identical to an uninterrupted one."""
    import errno

    clean, full = tmp_path / "clean", tmp_path / "full"
    build(target, seqs, clean)
    real_save = F.save_file
    calls = {"n": 0}

    def no_space(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:  # head, shard 0, then the disk is full in shard 1
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(F, "save_file", no_space)
    with pytest.raises(CacheError, match=r"full: disk full while writing shard-00001\.safetensors \(it needs about "
                                         r"[0-9.]+ MiB; [0-9.]+ MiB free there\).*re-run `peagle-train cache`"):
        build(target, seqs, full)
    assert not (full / "shard-00001.safetensors.tmp").exists()
    man = json.loads((full / "manifest.json").read_text())
    assert not man["complete"] and [s["file"] for s in man["shards"]] == ["shard-00000.safetensors"]
    monkeypatch.setattr(F, "save_file", real_save)
    build(target, seqs, full)
    for f in sorted(clean.glob("shard-*.safetensors")):
        assert (full / f.name).read_bytes() == f.read_bytes()


def test_resume_rebuilds_a_listed_shard_that_is_corrupt(target, seqs, tmp_path):
    build(target, seqs, tmp_path)
    good = dir_bytes(tmp_path)
    shard = tmp_path / "shard-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5] + b"XXXXX")
    man = json.loads((tmp_path / "manifest.json").read_text())
    man["complete"] = False
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    build(target, seqs, tmp_path)
    assert dir_bytes(tmp_path) == good


def _count_recomputed(monkeypatch, die_at: int | None = None) -> list[int]:
    """Record the chunk size of every shard the cache computes; with ``die_at``, a kill (KeyboardInterrupt)
    as the ``die_at``-th shard (1-based) starts computing."""
    recomputed: list[int] = []
    real_iter = F.iter_target_features

    def spy(t, chunk, b):
        recomputed.append(len(chunk))
        if len(recomputed) == die_at:
            raise KeyboardInterrupt("killed")
        return real_iter(t, chunk, b)

    monkeypatch.setattr(F, "iter_target_features", spy)
    return recomputed


def test_damaged_shards_of_a_complete_cache_are_named_and_rebuilt(target, seqs, tmp_path, monkeypatch):
    """damaged_shards names a deleted, a truncated and a bit-flipped shard and a missing head, each with
    its reason; write_cache on the cache (still marked complete) rebuilds exactly those, byte-identical."""
    build(target, seqs, tmp_path)
    good = dir_bytes(tmp_path)
    assert F.damaged_shards(tmp_path) == []
    (tmp_path / "shard-00000.safetensors").unlink()
    s1, s2 = tmp_path / "shard-00001.safetensors", tmp_path / "shard-00002.safetensors"
    s1.write_bytes(s1.read_bytes()[:100])
    flipped = bytearray(s2.read_bytes())
    flipped[-3] ^= 0x01
    s2.write_bytes(bytes(flipped))
    (tmp_path / "target_head.safetensors").unlink()
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"]
    bad = F.damaged_shards(tmp_path)
    assert [name for name, _ in bad] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                         "shard-00002.safetensors", "target_head.safetensors"]
    assert bad[0][1] == "missing" and bad[3][1] == "missing"
    assert bad[1][1].startswith("100 bytes, the manifest says ") and "checksum mismatch" in bad[2][1]
    recomputed = _count_recomputed(monkeypatch)
    build(target, seqs, tmp_path)
    assert recomputed == [4, 4, 3]
    assert dir_bytes(tmp_path) == good
    with pytest.raises(CacheError, match="not a feature cache"):
        F.damaged_shards(tmp_path / "nothing")


def test_next_run_first_removes_the_temp_files_a_kill_left(target, seqs, tmp_path, monkeypatch):
    """A kill leaves temp files of the cache's own naming (a half-written shard or head, the manifest's
    atomic-write temp ``.manifest.json.tmp<pid>``, which no later run would overwrite). The next
    write_cache deletes them before any work (here it is killed again before reaching shard 1) and
    leaves every other file alone; the finished cache equals an uninterrupted one."""
    clean = build(target, seqs, tmp_path / "clean")
    d = tmp_path / "killed"
    _count_recomputed(monkeypatch, die_at=2)
    with pytest.raises(KeyboardInterrupt):
        build(target, seqs, d)
    orphans = ["shard-00001.safetensors.tmp", "target_head.safetensors.tmp", ".manifest.json.tmp4242"]
    others = ["notes.tmp", "shard-00001.safetensors.tmp.bak", "shard-1.safetensors.tmp", ".manifest.json.tmp",
              "mine.safetensors"]
    for name in orphans + others:
        (d / name).write_bytes(b"half a shard" * 100)
    assert F.remove_temp_files(tmp_path / "absent") == []
    recomputed = _count_recomputed(monkeypatch, die_at=1)
    with pytest.raises(KeyboardInterrupt):
        build(target, seqs, d)
    assert recomputed == [4]  # killed as it started shard 1: the old temp files are already gone
    assert not [n for n in orphans if (d / n).exists()]
    assert all((d / n).read_bytes() == b"half a shard" * 100 for n in others)
    monkeypatch.setattr(F, "iter_target_features", iter_target_features)
    build(target, seqs, d)
    assert {k: v for k, v in dir_bytes(d).items() if k not in others} == dir_bytes(clean)


def test_mismatches_name_every_field_that_differs(target, seqs, tmp_path):
    """CachedFeatures.mismatches compares the manifest with the run: target identity, aux layers (ids
    and count), hidden size, vocab size, dtype, sequence and token counts, and the token ids themselves."""
    build(target, seqs, tmp_path)
    cache = CachedFeatures(tmp_path)
    run = dict(target="tiny-random-llama", aux_layer_ids=[1, 2, 3], hidden_size=32, vocab_size=128, dtype="bfloat16")
    assert cache.mismatches(sequences=seqs, **run) == []
    other = dict(target="other", aux_layer_ids=[0, 2], hidden_size=64, vocab_size=256, dtype="fp8")
    got = {f: (c, r) for f, c, r, _ in cache.mismatches(sequences=seqs, **other)}
    assert got == {"target": ("tiny-random-llama", "other"), "aux_layer_ids": ([1, 2, 3], [0, 2]),
                   "num_aux": (3, 2), "hidden_size": (32, 64), "vocab_size": (128, 256), "dtype": ("bfloat16", "fp8")}
    swapped = [seqs[1], seqs[0]] + seqs[2:]  # same counts, other order: only the fingerprint sees it
    assert [f for f, *_ in cache.mismatches(sequences=swapped, **run)] == ["token ids (fingerprint)"]
    shorter = seqs[:-1]
    assert [f for f, *_ in cache.mismatches(sequences=shorter, **run)] == ["num_sequences", "total_tokens"]
    with pytest.raises(CacheError, match=r"not made for this run \(.*dtype: cache 'bfloat16', this run 'fp8'\).*"
                                         r"re-run `peagle-train cache RECIPE` with this recipe.*data.cache_dtype"):
        F.check_caches_match({"train": cache}, {"train": seqs}, **{**run, "dtype": "fp8"})
    F.check_caches_match({"train": cache}, {"train": seqs}, **run)


def test_existing_cache_for_other_settings_is_refused(target, seqs, tmp_path):
    build(target, seqs, tmp_path)
    with pytest.raises(CacheError, match=r"dtype 'bfloat16' → 'fp8'.*delete the directory"):
        build(target, seqs, tmp_path, dtype="fp8")
    with pytest.raises(CacheError, match="token ids differ"):
        build(target, seqs[:-1] + [seqs[-1][:-1]], tmp_path)
    with pytest.raises(ValueError, match="not one of"):
        build(target, seqs, tmp_path / "x", dtype="float8")
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        build(target, [seqs[0], []], tmp_path / "y")


# --------------------------------------------------------------------------- reading


def test_corrupt_shard_is_named_by_checksum(target, seqs, tmp_path):
    build(target, seqs, tmp_path)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # one bit-flipped byte inside the aux payload
    shard.write_bytes(bytes(data))
    cache = CachedFeatures(tmp_path)
    cache.get([0, 3, 8])  # shards 0 and 2 are fine
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors: checksum mismatch.*re-run `peagle-train cache`"):
        cache.get([5])
    shard.unlink()
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors: shard listed in the manifest is missing"):
        CachedFeatures(tmp_path).get([4])


class _Spy:
    """Wraps safetensors' safe_open and records which tensors are read, and how."""

    log: list = []

    def __init__(self, path, framework):
        self._f = F._real_safe_open(path, framework=framework)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *a):
        return self._f.__exit__(*a)

    def get_tensor(self, name):
        _Spy.log.append(("full", name))
        return self._f.get_tensor(name)

    def get_slice(self, name):
        real = self._f.get_slice(name)
        spy = self

        class S:
            def __getitem__(self, idx):
                _Spy.log.append(("slice", name, idx.start, idx.stop))
                return real[idx]

        return S()


def test_random_access_reads_only_the_sequences_rows(target, seqs, tmp_path, monkeypatch):
    build(target, seqs, tmp_path, dtype="fp8")
    monkeypatch.setattr(F, "_real_safe_open", F.safe_open, raising=False)
    monkeypatch.setattr(F, "safe_open", _Spy)
    _Spy.log = []
    cache = CachedFeatures(tmp_path, verify=False)
    i = 6  # shard 1, local 2
    got = cache.get([i])[0]
    offs = [0] + torch.tensor([len(s) for s in seqs[4:8]]).cumsum(0).tolist()
    a, b = offs[2], offs[3]
    assert not [e for e in _Spy.log if e[0] == "full"]  # no tensor is loaded whole
    read = {e[1]: (e[2], e[3]) for e in _Spy.log if e[1] != "offsets"}
    assert read == {"aux": (a, b), "last": (a, b), "argmax": (a, b), "aux_scale": (a, b), "last_scale": (a, b)}
    assert got["aux"].shape[0] == len(seqs[i])
    # and the bytes behind those rows are all that matter: zeroing every other sequence's aux
    # rows in the file (outside the checksum, verify=False) leaves sequence i unchanged
    monkeypatch.setattr(F, "safe_open", F._real_safe_open)
    path = tmp_path / "shard-00001.safetensors"
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:header])
    s0, s1 = meta["aux"]["data_offsets"]
    row = 3 * 32  # fp8 bytes per aux row
    for r in range((s1 - s0) // row):
        if not a <= r < b:
            raw[header + s0 + r * row: header + s0 + (r + 1) * row] = bytes(row)
    path.write_bytes(bytes(raw))
    again = CachedFeatures(tmp_path, verify=False).get([i, 5])
    assert torch.equal(again[0]["aux"], got["aux"])
    assert again[1]["aux"].abs().sum() == 0  # the neighbour really was overwritten
    with pytest.raises(IndexError, match="holds 11 sequences"):
        cache.get([11])


def test_verify_against_recompute(target, seqs, tmp_path):
    res = {}
    for dtype in ("bfloat16", "fp8"):
        build(target, seqs, tmp_path / dtype, dtype=dtype)
        res[dtype] = CachedFeatures(tmp_path / dtype).verify_against(target, 7)
        assert res[dtype]["tokens"] == len(seqs[7]) and res[dtype]["argmax_agreement"] == 1.0
    # bf16 storage: rel. error ~2^-9; fp8: ~2^-5 (and an order of magnitude above bf16)
    assert res["bfloat16"]["aux"]["rel_mean"] < 4e-3
    assert 4e-3 < res["fp8"]["aux"]["rel_mean"] < 4e-2
    assert res["fp8"]["aux"]["mean_abs"] > 4 * res["bfloat16"]["aux"]["mean_abs"]
    other = Target(model=target.model, tokenizer=None, aux_layer_ids=[0, 1, 2], path="x")
    with pytest.raises(CacheError, match="wrong target"):
        CachedFeatures(tmp_path / "fp8").verify_against(other, 0)


def test_online_features_match_the_cache_interface(target, seqs, tmp_path):
    build(target, seqs, tmp_path)
    online, cached = OnlineFeatures(target, seqs, batch_tokens=40), CachedFeatures(tmp_path)
    assert len(online) == len(cached)
    for o, c in zip(online.get([2, 9]), cached.get([2, 9])):
        assert o.keys() == c.keys()
        assert torch.allclose(o["aux"].to(torch.bfloat16).float(), c["aux"].float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(o["argmax"], c["argmax"])


def test_unknown_format_and_missing_manifest(tmp_path, target, seqs):
    with pytest.raises(CacheError, match="run `peagle-train cache RECIPE` first"):
        CachedFeatures(tmp_path)
    build(target, seqs[:2], tmp_path)
    man = json.loads((tmp_path / "manifest.json").read_text())
    man["format"] = "peagle-features-v1"
    (tmp_path / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(CacheError, match="delete the directory and re-run"):
        CachedFeatures(tmp_path)
    shutil.rmtree(tmp_path)


# --------------------------------------------------------------------------- draft vocab (spec §2)


@pytest.mark.parametrize("Vd", [1, 7, 50, 127, 128])
def test_draft_vocab_d2t_t2d_consistent(Vd):
    from peagle_train.features.vocab import d2t_t2d, select_draft_vocab, token_frequencies

    g = torch.Generator().manual_seed(Vd)
    rows = [(torch.randint(0, 128, (60,), generator=g).tolist(), torch.randint(0, 2, (60,), generator=g).tolist())
            for _ in range(5)]
    counts = token_frequencies(rows, 128)
    assert int(counts.sum()) == sum(sum(m) for _, m in rows)
    ids = select_draft_vocab(counts, Vd, exclude=[127])
    d2t, t2d = d2t_t2d(ids, 128)
    assert ids.numel() == Vd and torch.equal(ids, ids.sort().values) and ids.unique().numel() == Vd
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == Vd
    assert torch.equal(d2t + torch.arange(Vd), ids)  # draft index i -> target id i + d2t[i]
    assert torch.equal(torch.nonzero(t2d).flatten(), ids)  # t2d marks exactly the draft ids
    back = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft index
    assert torch.equal(back[ids], torch.arange(Vd))
    if Vd == 128:  # Vd == V: identity, d2t all zeros (allowed, spec §2), even the excluded id
        assert torch.equal(d2t, torch.zeros(128, dtype=torch.int64)) and bool(t2d.all())
    else:
        assert 127 not in ids.tolist()
        rest = torch.ones(128, dtype=torch.bool)
        rest[ids], rest[127] = False, False
        if rest.any():  # most frequent first: every chosen count >= every unchosen count
            assert counts[ids].min() >= counts[rest].max()
    with pytest.raises(ValueError, match=r"must be in \[1, 128\]"):
        select_draft_vocab(counts, 129)


def test_pack_refuses_features_of_other_token_lists():
    """Features whose token counts differ from the token lists (a stale cache) fail with both counts."""
    samples = [{"aux": torch.zeros(n, 6), "last": torch.zeros(n, 2), "argmax": torch.zeros(n, dtype=torch.long)}
               for n in (3, 4)]
    ok = packing.pack(samples, packing.pack_tokens([[1, 2, 3], [4, 5, 6, 7]], [[0, 1, 1], [0, 0, 1, 1]]), "cpu")
    assert ok["aux"].shape == (7, 6) and ok["input_ids"].numel() == 7
    with pytest.raises(ValueError, match=r"7 tokens \(per sequence \[3, 4\].*hold 6.*peagle-train cache"):
        packing.pack(samples, packing.pack_tokens([[1, 2, 3], [4, 5, 6]], [[0, 1, 1], [0, 0, 1]]), "cpu")
    with pytest.raises(ValueError, match=r"per sequence \[3, 4\].*per sequence \[4, 3\]"):  # same total
        packing.pack(samples, packing.pack_tokens([[1, 2, 3, 4], [5, 6, 7]], [[0, 1, 1, 1], [0, 0, 1]]), "cpu")
    samples[1]["last"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="last/argmax rows differ"):
        packing.pack(samples, packing.pack_tokens([[1, 2, 3], [4, 5, 6, 7]], [[0, 1, 1], [0, 0, 1, 1]]), "cpu")


def test_length_batches_sort_and_respect_the_budget():
    assert length_batches([5, 100, 7, 90], 200) == [[1, 3], [2, 0]]  # the docstring's example
    assert length_batches([300, 5], 200) == [[0], [1]]  # longer than the budget: alone
    assert length_batches([4] * 5, 100, max_batch=2) == [[0, 1], [2, 3], [4]]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 700, (200,), generator=g).tolist()
    batches = length_batches(lengths, 4096)
    assert sorted(i for b in batches for i in b) == list(range(200))
    assert all(len(b) * max(lengths[i] for i in b) <= 4096 or len(b) == 1 for b in batches)
    assert len(batches) < 60  # 200 sequences of ~350 tokens: ~10 a forward, not 200
    with pytest.raises(ValueError, match="batch_tokens=0"):
        length_batches([3], 0)


def test_online_features_do_not_depend_on_their_batch(target, seqs):
    """Alone (budget 1: one sequence a forward) or batched with others, in any order asked:
    the same features in the order of the indices."""
    alone, batched = OnlineFeatures(target, seqs, batch_tokens=1), OnlineFeatures(target, seqs, batch_tokens=10_000)
    ix = [9, 2, 5, 0]
    for a, b, i in zip(alone.get(ix), batched.get(ix), ix):
        assert a["aux"].shape[0] == len(seqs[i])
        torch.testing.assert_close(a["aux"], b["aux"], rtol=1e-4, atol=1e-4)  # fp32: batch-shape noise only
        torch.testing.assert_close(a["last"], b["last"], rtol=1e-4, atol=1e-4)
        assert torch.equal(a["argmax"], b["argmax"])


def test_greedy_tokens_in_chunks_equal_the_full_head(target):
    last = torch.randn(3, 7, target.config.hidden_size)
    want = (last @ target.lm_head_weight().T).argmax(-1)
    for chunk in (1, 4, 4096):
        assert torch.equal(target.greedy_tokens(last, chunk=chunk), want)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None, reason="needs a C++ compiler")
def test_compiled_target_layers_give_the_same_features(seqs):
    """train.compile_target: with every decoder layer compiled (dynamic shapes, as the trainer does) the
    target hands out the eager forward's features for batches of several shapes; the layers compile
    in one graph without breaks (no fallback to eager); a batch of one runs the eager layers."""
    import copy

    from transformers import LlamaForCausalLM

    from peagle_train.kernels.compiling import compile_decoder_layers
    from tests.conftest import _tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config()).eval().requires_grad_(False)
    twin = copy.deepcopy(model)
    compiled = compile_decoder_layers(twin)
    eager = Target(model=model, tokenizer=None, aux_layer_ids=[1, 2, 3], path="tiny")
    comp = Target(model=twin, tokenizer=None, aux_layer_ids=[1, 2, 3], path="tiny")
    a, b = OnlineFeatures(eager, seqs, batch_tokens=64), OnlineFeatures(comp, seqs, batch_tokens=64)
    for ix in ([0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10]):
        for x, y in zip(a.get(ix), b.get(ix)):
            torch.testing.assert_close(y["aux"], x["aux"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(y["last"], x["last"], rtol=1e-4, atol=1e-4)
            assert torch.equal(y["argmax"], x["argmax"])
    assert {c.mode for c in compiled} == {"fullgraph"}
    for c in compiled:  # a batch of one never reaches the compiled layers
        c.mode = "eager"
        c.fn = lambda *a, **k: (_ for _ in ()).throw(AssertionError("compiled layer called"))
    for x, y in zip(a.get([4]), b.get([4])):
        torch.testing.assert_close(y["aux"], x["aux"], rtol=1e-4, atol=1e-4)


def test_online_ids_reach_the_device_without_a_host_sync(target, seqs, monkeypatch):
    """The padded ids of every target forward go through ``to_device(..., non_blocking=True)`` (pinned memory):
    a plain ``.to("cuda")`` from pageable memory synchronises the stream, so the trainer's prefetched forward
    would wait for the backward and each forward of a micro-batch for the one before (H200 profile: GPU idle
    121 of 290 ms per online step). The features are unchanged."""
    import peagle_train.features.online as O

    calls = []
    real = O.to_device

    def spy(t, device, non_blocking=False):
        calls.append(non_blocking)
        return real(t, device, non_blocking)

    monkeypatch.setattr(O, "to_device", spy)
    got = list(O.iter_target_features(target, seqs, 3))
    assert calls == [True] * -(-len(seqs) // 3)  # one copy per forward, none blocking
    monkeypatch.undo()
    want = reference(target, seqs)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want) for k in ("aux", "last", "argmax"))


def test_time_fraction_of_one_process_reads_no_device_value():
    """``train.max_minutes`` on one process: the elapsed fraction comes from the host clock alone (no device
    tensor read back at the start of every step); several processes agree through one max-reduction."""
    import time
    from types import SimpleNamespace

    from peagle_train.trainer.trainer import Trainer

    def no_collective(*a, **k):
        raise AssertionError("one process must not reduce")

    one = SimpleNamespace(tc=SimpleNamespace(max_minutes=1.0), device=torch.device("cpu"),
                          acc=SimpleNamespace(num_processes=1, reduce=no_collective))
    frac = Trainer._time_fraction(one, time.perf_counter() - 30.0)
    assert 0.49 < frac < 0.6
    two = SimpleNamespace(tc=SimpleNamespace(max_minutes=1.0), device=torch.device("cpu"),
                          acc=SimpleNamespace(num_processes=2, reduce=lambda t, reduction: t * 0 + 0.9))
    assert Trainer._time_fraction(two, time.perf_counter()) == pytest.approx(0.9)
