"""Target features for training: a sharded on-disk cache, or the live target (online).

Both sources implement ``get(indices) -> list[dict]`` giving, per sequence of
``n`` tokens: ``aux [n, A*T]``, ``last [n, T]`` (final hidden state after the
target's final norm) and ``argmax [n]`` int64 (target greedy next token); and
``target_head() -> [V, T]``. The trainer never knows which one it has.

Cache layout (``<dir>/``)::

    manifest.json            format, dtype, T, A, aux ids, totals, shards [{file, sha256, first, count, tokens, bytes}]
    shard-00000.safetensors  see below
    target_head.safetensors  head [V, T], embed [V, T] (bfloat16)

Shard tensors (``tokens`` = sum of the shard's sequence lengths, rows in sequence order)::

    input_ids [tokens] int32            the token ids the features were computed on
    offsets   [count+1] int64           sequence j is rows [offsets[j], offsets[j+1])
    argmax    [tokens] int32            target greedy next token
    aux       [tokens, A*T]             bfloat16 | float8_e4m3fn
    last      [tokens, T]               bfloat16 | float8_e4m3fn
    aux_scale [tokens, A] float32       fp8 only: one scale per token and aux layer
    last_scale[tokens, 1] float32       fp8 only: one scale per token

fp8 (``dtype="fp8"``) stores ``q = round_e4m3(x / s)`` with ``s = amax(|x|) / 448`` over each
row's ``T`` values (448 = largest finite float8_e4m3fn; a zero row gets ``s = 1``), the
per-row ("per-token") scaling used for fp8 activations (e.g. vLLM/TransformerEngine
per-token quantisation). Each aux layer has its own scale because the residual stream
grows with depth. Reads dequantise ``q.float() * s`` and return bfloat16, the same dtype
as a bf16 cache, so the trainer sees one interface. Storage: bf16 = ``2(A+1)T + 8``
bytes/token, fp8 = ``(A+1)T + 4(A+1) + 8`` (+ the safetensors header and ``offsets``).

Shards are written to ``<name>.tmp``, renamed, hashed (sha256); the manifest is rewritten
atomically after every shard, so a killed run resumes at the first shard the manifest
lacks, never trusts a half-written file (the temp files a kill leaves are deleted at the
start of the next run: :func:`remove_temp_files`), and re-writes a listed shard whose file
is missing, has another size, or fails its checksum (:func:`damaged_shards`; also in a cache
already marked complete: the repair ``peagle-train cache`` runs). Feature computation
for a shard depends only on that shard's sequences and ``batch_size``, so a resumed cache
is byte-identical to an uninterrupted one (tested). Reads are memory-mapped
(``safetensors.safe_open`` + ``get_slice``): a sequence's rows are the only tensor rows
read. With ``verify=True`` each shard's sha256 is checked once, on its first use (this
reads that shard once in full). :func:`check_caches_match` (with :meth:`CachedFeatures.mismatches`)
refuses a cache made for another run (target, aux layers, hidden size, vocab, dtype, token ids).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from peagle_train.core.atomic import write_json_atomic
from peagle_train.core.dtypes import safetensors_itemsize
from peagle_train.features.fp8 import dequantize_fp8_rows, quantize_fp8_rows
from peagle_train.features.online import iter_target_features
from peagle_train.features.target import sha256_file as _sha256

FORMAT = "peagle-features-v2"


#: accepted ``dtype`` values of :func:`write_cache` → storage dtype of ``aux``/``last``.
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


#: the names of the temp files the cache itself writes: a shard or the head before its rename, and
#: the manifest (``core.atomic``'s ``.<name>.tmp<pid>``). :func:`remove_temp_files` deletes only these.
_TEMP_NAME = re.compile(r"(shard-\d{5,}\.safetensors|target_head\.safetensors)\.tmp|\.manifest\.json\.tmp\d+")


class CacheError(RuntimeError):
    """A feature cache is missing, corrupt, or does not match the run; the message says what to do."""


def _fingerprint(target_path: str, aux_layer_ids, sequences: list[list[int]], dtype: str, shard_size: int,
                 batch_size: int) -> str:
    """sha256 (hex) of the settings and every token id a cache is computed from (the manifest's ``fingerprint``)."""
    h = hashlib.sha256(json.dumps([target_path, list(aux_layer_ids), dtype, shard_size, batch_size]).encode())
    for s in sequences:
        h.update(json.dumps(s).encode())
        h.update(b"\n")
    return h.hexdigest()


def remove_temp_files(cache_dir: str | Path) -> list[str]:
    """Delete the temp files an interrupted :func:`write_cache` left in ``cache_dir``.

    Only names of the cache's own temp naming are touched: ``shard-NNNNN.safetensors.tmp``,
    ``target_head.safetensors.tmp`` and ``.manifest.json.tmp<pid>``; every other file stays. A
    kill leaves such a file (up to one shard's size), which a later run would otherwise overwrite
    only if it writes that shard again (the pid-named manifest temp: never). Two processes must not write one cache at once (this would delete the other's temp
    file; the manifest would race anyway).

    Returns:
        the names removed, sorted (``[]`` when ``cache_dir`` does not exist).
    """
    d = Path(cache_dir)
    if not d.is_dir():
        return []
    names = sorted(p.name for p in d.iterdir() if _TEMP_NAME.fullmatch(p.name) and p.is_file())
    for name in names:
        (d / name).unlink(missing_ok=True)
    return names


def damaged_shards(cache_dir: str | Path, manifest: dict | None = None) -> list[tuple[str, str]]:
    """The files of a cache that cannot be trusted: listed shards and the target head.

    Each shard the manifest lists must exist, have the manifest's size (``bytes``) and its sha256;
    ``target_head.safetensors`` must exist (the manifest holds no checksum of it). Cost: one full
    read of every shard whose size is right (sha256), i.e. one read of the whole cache.

    Args:
        cache_dir: the cache directory. manifest: its parsed ``manifest.json`` (default: read it).

    Returns:
        ``[(file name, reason)]`` in manifest order, the head last; ``[]`` for an intact cache.

    Raises:
        CacheError: no ``manifest.json`` (and no ``manifest`` given).
    """
    d = Path(cache_dir)
    if manifest is None:
        if not (d / "manifest.json").is_file():
            raise CacheError(f"{d / 'manifest.json'} not found: not a feature cache")
        manifest = json.loads((d / "manifest.json").read_text())
    bad = []
    for s in manifest["shards"]:
        path = d / s["file"]
        if not path.is_file():
            bad.append((s["file"], "missing"))
        elif s.get("bytes") is not None and path.stat().st_size != s["bytes"]:
            bad.append((s["file"], f"{path.stat().st_size} bytes, the manifest says {s['bytes']} (truncated?)"))
        elif (actual := _sha256(path)) != s["sha256"]:
            bad.append((s["file"], f"checksum mismatch (sha256 {actual[:16]}…, the manifest says {s['sha256'][:16]}…)"))
    if not (d / "target_head.safetensors").is_file():
        bad.append(("target_head.safetensors", "missing"))
    return bad


def _encode_shard(parts: dict, lengths: list[int], dtype: str, A: int) -> dict[str, torch.Tensor]:
    """Concatenate per-sequence features into the shard's tensors (layout in the module docstring)."""
    aux = torch.cat(parts["aux"])
    last = torch.cat(parts["last"])
    out = {
        "input_ids": torch.tensor([t for s in parts["input_ids"] for t in s], dtype=torch.int32),
        "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
        "argmax": torch.cat(parts["argmax"]).to(torch.int32).contiguous(),
    }
    if dtype == "fp8":
        out["aux"], out["aux_scale"] = quantize_fp8_rows(aux, A)
        out["last"], out["last_scale"] = quantize_fp8_rows(last, 1)
    else:
        out["aux"], out["last"] = aux.to(CACHE_DTYPES[dtype]), last.to(CACHE_DTYPES[dtype])
    return {k: v.contiguous() for k, v in out.items()}


def _save_or_explain(tensors: dict[str, torch.Tensor], tmp: Path, metadata: dict | None = None) -> None:
    """``save_file(tensors, tmp)``; a full disk becomes a :class:`CacheError` saying where, how many
    bytes the file needed and how many were free, after removing the partial ``tmp`` (the manifest
    lists only finished shards, so a re-run after freeing space resumes at this shard).

    Raises:
        CacheError: no space left on the device (``errno.ENOSPC``, or the quota's ``EDQUOT``).
        OSError: any other write error, unchanged.
    """
    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        tmp.unlink(missing_ok=True)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        free = shutil.disk_usage(tmp.parent).free
        raise CacheError(f"{tmp.parent}: disk full while writing {tmp.name.removesuffix('.tmp')} (it needs about "
                         f"{need / 2**20:.1f} MiB; {free / 2**20:.1f} MiB free there). Free space (or point output_dir "
                         "at a larger disk) and re-run `peagle-train cache`: the finished shards are kept and the "
                         "cache resumes at this one") from None


def cache_batch_size(target, lengths: list[int], requested: int, gpu_bytes: int | None,
                     headroom: float = 0.9) -> tuple[int, str | None]:
    """Sequences per target forward of the feature cache: ``requested`` (``regen.batch_size``) reduced to what
    fits ``headroom`` of the GPU beside the target's weights, for right-padded rows of the longest sequence.

    The forward's transient is :func:`data_prep.target_memory.target_forward_peak_bytes` (the model the online
    planner uses): an eager-attention target holds three ``[B, heads, n, n + 1]`` score tensors per layer, so
    GPT-OSS-20B at ``regen.batch_size`` 64 and n = 3,880 asked for 114.86 GiB in one of them and died on an
    H200; the model gives 15 rows there, and for the 2 rows that then ran it predicts 53.99 GB against the
    54.15 GB measured (``tests/unit/test_planner_online.py``). The choice depends on the data, the target and
    the GPU's total memory, not on what is free, so a resumed cache gets the same batch (the fingerprint holds
    it).

    Args:
        target: :class:`~peagle_train.features.target.Target`. lengths: token counts of the split's sequences.
        requested: ``regen.batch_size``. gpu_bytes: the GPU's total memory; None (CPU) keeps ``requested``.
        headroom: fraction of ``gpu_bytes`` the weights and the forward may take.

    Returns:
        ``(batch_size, message)``; ``message`` says why the batch was reduced, None when it was not.

    Raises:
        CacheError: not even one row of the longest sequence fits (names the sequence length, the bytes and
            what to change).
    """
    from data_prep.target_memory import largest_fitting_batch, target_forward_peak_bytes
    from peagle_train.features.target import GREEDY_CHUNK

    if gpu_bytes is None or not lengths:
        return requested, None
    weights = sum(p.numel() * p.element_size() for p in target.model.parameters())
    shape = target.memory_shape(weights)
    n, budget = max(lengths), int(headroom * gpu_bytes) - weights
    b = largest_fitting_batch(n, shape, budget, requested, GREEDY_CHUNK)
    need = target_forward_peak_bytes(requested, n, shape, GREEDY_CHUNK)
    where = (f"regen.batch_size {requested} x the longest sequence ({n} tokens) needs {need / 2**30:.2f} GiB for "
             f"the target's forward{' (eager attention scores)' if shape.eager_attention else ''} beside "
             f"{weights / 2**30:.2f} GiB of weights, more than {headroom:.0%} of the GPU's {gpu_bytes / 2**30:.2f} GiB")
    if b == 0:
        raise CacheError(f"cache: {where}, even with one sequence per forward: lower data.max_length, or set "
                         "target.attn_implementation to one that does not materialise the scores")
    return b, (None if b == requested else f"cache: {where}: caching with batch_size {b} instead")


def write_cache(target, sequences: list[list[int]], out_dir: str | Path, *, dtype: str = "bfloat16",
                batch_size: int = 8, shard_size: int = 64, progress: bool = True) -> Path:
    """Run the target over ``sequences`` and write the sharded cache (resumable, byte-identical on resume).

    Args:
        target: :class:`~peagle_train.features.target.Target` (``features()``, ``aux_layer_ids``, ``path``).
        sequences: token id lists (the training set, in order), each non-empty.
        out_dir: cache directory (created).
        dtype: storage of ``aux``/``last``: ``"bfloat16"`` (default) or ``"fp8"``
            (float8_e4m3fn with per-token float32 scales; module docstring).
        batch_size: sequences per target forward (right-padded). shard_size: sequences per shard.
        progress: tqdm bar in tokens.

    Returns:
        ``out_dir``. Its ``manifest.json`` gains ``complete: true``, ``total_tokens``,
        ``total_bytes`` (shards only) and ``bytes_per_token``.

    Re-running on an existing cache (complete or not) first deletes the temp files a kill left
    (:func:`remove_temp_files`), then checks every listed shard (:func:`damaged_shards`: one read
    of the cache) and recomputes only the missing, damaged and unlisted ones.

    Raises:
        ValueError: unknown ``dtype``, or an empty sequence (names its index).
        CacheError: ``out_dir`` holds a cache built for other data, another target, another
            dtype, shard size or batch size (says which and what to do).
    """
    from tqdm import tqdm

    if dtype not in CACHE_DTYPES:
        raise ValueError(f"cache dtype {dtype!r} is not one of {sorted(CACHE_DTYPES)}")
    empty = next((i for i, s in enumerate(sequences) if len(s) == 0), None)
    if empty is not None:
        raise ValueError(f"write_cache: sequence {empty} is empty; drop empty rows before caching")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_temp_files(out)  # left by a killed run
    A, T = len(target.aux_layer_ids), target.config.hidden_size
    fingerprint = _fingerprint(target.path, target.aux_layer_ids, sequences, dtype, shard_size, batch_size)
    man_path = out / "manifest.json"
    manifest = {
        "format": FORMAT, "dtype": dtype, "fingerprint": fingerprint,
        "target": target.path, "aux_layer_ids": list(target.aux_layer_ids), "num_aux": A,
        "hidden_size": T, "num_sequences": len(sequences), "shard_size": shard_size, "batch_size": batch_size,
        "shards": [], "complete": False,
    }
    if man_path.exists():
        old = json.loads(man_path.read_text())
        if old.get("fingerprint") != fingerprint:
            what = [f"{k} {old.get(k)!r} → {manifest[k]!r}" for k in ("format", "dtype", "target", "aux_layer_ids",
                                                                       "num_sequences", "shard_size", "batch_size")
                    if old.get(k) != manifest[k]]
            raise CacheError(f"{man_path}: cache was built for other data or settings ({'; '.join(what) or 'token ids differ'}); "
                             "delete the directory or choose another output_dir")
        manifest = old
        # a listed shard whose file is gone or altered is recomputed, not trusted (a complete cache too)
        bad = {name for name, _ in damaged_shards(out, manifest)}
        manifest["shards"] = [s for s in manifest["shards"] if s["file"] not in bad]
        manifest["complete"] = False
    head_path = out / "target_head.safetensors"
    if not head_path.exists():
        tmp = out / "target_head.safetensors.tmp"
        _save_or_explain({"head": target.lm_head_weight().detach().to("cpu", torch.bfloat16).contiguous(),
                          "embed": target.model.get_input_embeddings().weight.detach().to("cpu", torch.bfloat16)
                          .contiguous()}, tmp)
        os.replace(tmp, head_path)
    done = {s["first"] for s in manifest["shards"]}
    bar = tqdm(total=sum(len(s) for s in sequences), unit="tok", desc=f"cache ({dtype})", disable=not progress)
    for first in range(0, len(sequences), shard_size):
        chunk = sequences[first:first + shard_size]
        if first in done:
            bar.update(sum(len(s) for s in chunk))
            continue
        parts = {"aux": [], "last": [], "argmax": [], "input_ids": chunk}
        for feats in iter_target_features(target, chunk, batch_size):
            for k in ("aux", "last", "argmax"):
                parts[k].append(feats[k].cpu())
            bar.update(feats["argmax"].numel())
        lengths = [len(s) for s in chunk]
        tensors = _encode_shard(parts, lengths, dtype, A)
        name = f"shard-{first // shard_size:05d}.safetensors"
        tmp = out / (name + ".tmp")
        # one metadata key only: safetensors writes a multi-key metadata map in hash order, which
        # would make otherwise identical shards differ byte-wise between runs
        _save_or_explain(tensors, tmp, metadata={"peagle_features": f"{FORMAT} {dtype}"})
        os.replace(tmp, out / name)
        manifest["shards"].append({"file": name, "sha256": _sha256(out / name), "first": first, "count": len(chunk),
                                   "tokens": sum(lengths), "bytes": (out / name).stat().st_size})
        manifest["shards"].sort(key=lambda s: s["first"])
        write_json_atomic(man_path, manifest)
    bar.close()
    manifest["complete"] = True
    manifest["total_tokens"] = sum(s["tokens"] for s in manifest["shards"])
    manifest["total_bytes"] = sum(s["bytes"] for s in manifest["shards"])
    manifest["bytes_per_token"] = manifest["total_bytes"] / max(1, manifest["total_tokens"])
    write_json_atomic(man_path, manifest)
    return out


def cache_size_report(cache_dir: str | Path) -> dict:
    """Size of a feature cache, per tensor and in bytes/token.

    Returns:
        ``{"dtype", "sequences", "tokens", "shard_bytes", "bytes_per_token", "head_bytes",
        "tensor_bytes_per_token": {name: bytes/token}}``; ``shard_bytes`` counts the shard files
        (headers included), ``tensor_bytes_per_token`` the raw tensor payloads.

    Raises:
        CacheError: no manifest.
    """
    d = Path(cache_dir)
    if not (d / "manifest.json").is_file():
        raise CacheError(f"{d / 'manifest.json'} not found: not a feature cache")
    man = json.loads((d / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in man["shards"])
    nbytes = sum((d / s["file"]).stat().st_size for s in man["shards"])
    per: dict[str, int] = {}
    for s in man["shards"]:
        with safe_open(str(d / s["file"]), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                numel = 1
                for x in sl.get_shape():
                    numel *= x
                per[k] = per.get(k, 0) + numel * safetensors_itemsize(sl.get_dtype())
    head = d / "target_head.safetensors"
    return {"dtype": man["dtype"], "sequences": sum(s["count"] for s in man["shards"]), "tokens": tokens,
            "shard_bytes": nbytes, "bytes_per_token": nbytes / max(1, tokens),
            "head_bytes": head.stat().st_size if head.is_file() else 0,
            "tensor_bytes_per_token": {k: v / max(1, tokens) for k, v in sorted(per.items())}}


def check_caches_match(caches: dict[str, "CachedFeatures"], sequences: dict[str, list[list[int]]], **run) -> None:
    """Refuse, before training, feature caches made for another recipe, target or prepared data.

    Args:
        caches: split name → its cache. sequences: split name → the prepared token id lists.
        **run: the run's ``target``, ``aux_layer_ids``, ``hidden_size``, ``dtype`` and
            ``vocab_size`` (:meth:`CachedFeatures.mismatches`).

    Raises:
        CacheError: names every cache folder that differs, each differing field with the cache's
            and the run's value, and what to do (re-cache with this recipe, or fix the recipe).
    """
    found = {name: c.mismatches(sequences=sequences[name], **run) for name, c in caches.items()}
    found = {name: d for name, d in found.items() if d}
    if not found:
        return
    what = "; ".join(f"{caches[name].dir}: " + ", ".join(f"{f}: cache {c!r}, this run {r!r}" for f, c, r, _ in d)
                     for name, d in found.items())
    fix = ", ".join(dict.fromkeys(k for d in found.values() for *_, k in d))
    dirs = " and ".join(str(caches[name].dir) for name in found)
    raise CacheError(f"the feature cache was not made for this run ({what}); training on it would silently use "
                     f"the wrong features. Delete {dirs} and re-run `peagle-train cache RECIPE` with this recipe, "
                     f"or fix the recipe ({fix}) to match the cache")


class CachedFeatures:
    """Memory-mapped reader of a feature cache (layout in the module docstring).

    Args:
        cache_dir: the directory :func:`write_cache` wrote.
        verify: check each shard's sha256 against the manifest once, before its first use.

    Raises:
        CacheError: missing/incomplete manifest, unknown format (e.g. a cache of an older
            version: delete it and re-run ``peagle-train cache``), checksum mismatch (names
            the shard, the expected and actual digests, and says to delete it and re-run).
    """

    #: ``get`` reads files on the CPU: the trainer calls it ahead, on its worker thread (``train.prefetch``)
    reads_on_host = True

    def __init__(self, cache_dir: str | Path, verify: bool = True):
        self.dir = Path(cache_dir)
        man = self.dir / "manifest.json"
        if not man.is_file():
            raise CacheError(f"{man} not found: run `peagle-train cache RECIPE` first")
        self.manifest = json.loads(man.read_text())
        if self.manifest.get("format") != FORMAT:
            raise CacheError(f"{man}: cache format {self.manifest.get('format')!r} is not {FORMAT!r}; "
                             "delete the directory and re-run `peagle-train cache RECIPE`")
        if not self.manifest.get("complete"):
            raise CacheError(f"{man}: cache is incomplete (interrupted?); re-run `peagle-train cache` to resume")
        self.dtype = self.manifest["dtype"]
        self.verify = verify
        self._verified: set[str] = set()
        self._index = []  # global sequence index -> (shard, local)
        for s in self.manifest["shards"]:
            self._index += [(s, j) for j in range(s["count"])]

    def __len__(self) -> int:
        return len(self._index)

    def mismatches(self, *, target: str, aux_layer_ids, hidden_size: int, dtype: str,
                   sequences: list[list[int]], vocab_size: int | None = None) -> list[tuple[str, object, object, str]]:
        """What differs between this cache and the run that wants to train on it.

        Compared: ``target`` (the identity :func:`write_cache` records, ``Target.path``: the
        string :func:`~peagle_train.features.target.materialise_target` returns; two existing
        local paths are compared resolved), ``aux_layer_ids``, ``num_aux`` (A), ``hidden_size``
        (T), ``vocab_size`` (V, the rows of ``target_head.safetensors``' head ``[V, T]``),
        ``dtype``, ``num_sequences``, ``total_tokens`` and, when the counts agree, the token ids
        themselves: the manifest's ``fingerprint`` recomputed from ``sequences`` with the
        manifest's own settings (JSON + sha256 over every token id: about 10 M tokens/s on one core).

        Args:
            target: the run's target identity. aux_layer_ids: its tapped layers.
            hidden_size: the target's T. dtype: the recipe's ``data.cache_dtype``.
            sequences: the prepared split's token id lists, in order (what the cache must hold).
            vocab_size: the target's V (None: not checked).

        Returns:
            ``[(field, cache value, run value, what to fix in the recipe)]``; ``[]`` when the cache fits.
        """
        m = self.manifest
        diffs: list[tuple[str, object, object, str]] = []

        def compare(field, cached, run, fix):
            if cached != run:
                diffs.append((field, cached, run, fix))

        cached_target = str(m.get("target"))
        same_path = Path(cached_target).exists() and Path(target).exists() \
            and Path(cached_target).resolve() == Path(target).resolve()
        compare("target", m.get("target"), m.get("target") if same_path else target, "target.path / target.gguf_file")
        compare("aux_layer_ids", m.get("aux_layer_ids"), [int(i) for i in aux_layer_ids], "target.aux_layer_ids")
        compare("num_aux", m.get("num_aux"), len(aux_layer_ids), "target.aux_layer_ids")
        compare("hidden_size", m.get("hidden_size"), hidden_size, "target (another model)")
        head = self.dir / "target_head.safetensors"
        if vocab_size is not None and head.is_file():
            with safe_open(str(head), framework="pt") as f:
                compare("vocab_size", f.get_slice("head").get_shape()[0], vocab_size, "target (another model)")
        compare("dtype", m.get("dtype"), dtype, "data.cache_dtype")
        data = "the prepared data (data/)"
        counts = (len(sequences), sum(len(x) for x in sequences))
        compare("num_sequences", m.get("num_sequences"), counts[0], data)
        compare("total_tokens", m.get("total_tokens"), counts[1], data)
        if counts == (m.get("num_sequences"), m.get("total_tokens")):  # other counts: the ids differ anyway
            fp = _fingerprint(m["target"], m["aux_layer_ids"], sequences, m["dtype"], m["shard_size"], m["batch_size"])
            compare("token ids (fingerprint)", m.get("fingerprint", "")[:16] + "…", fp[:16] + "…", data)
        return diffs

    def _open(self, shard: dict):
        path = self.dir / shard["file"]
        if not path.is_file():
            raise CacheError(f"{path}: shard listed in the manifest is missing; re-run `peagle-train cache` "
                             "to rebuild it")
        if self.verify and shard["file"] not in self._verified:
            actual = _sha256(path)
            if actual != shard["sha256"]:
                raise CacheError(f"{path}: checksum mismatch (sha256 {actual[:16]}…, manifest says "
                                 f"{shard['sha256'][:16]}…): the shard is corrupt; re-run `peagle-train cache` "
                                 "(it rebuilds shards that fail their checksum)")
            self._verified.add(shard["file"])
        return safe_open(str(path), framework="pt")

    def _locate(self, i: int) -> tuple[dict, int]:
        if not 0 <= i < len(self._index):
            raise IndexError(f"sequence {i} out of range: the cache holds {len(self._index)} sequences")
        return self._index[i]

    def shard_file(self, i: int) -> Path:
        """The shard file holding sequence ``i`` (raises IndexError outside ``[0, len)``)."""
        return self.dir / self._locate(i)[0]["file"]

    def get(self, indices: list[int], with_input_ids: bool = False) -> list[dict]:
        """Features of sequences ``indices``, read by slicing only their rows.

        Returns:
            per index ``{"aux": [n, A*T] bfloat16, "last": [n, T] bfloat16, "argmax": [n] int64}``
            (fp8 caches are dequantised), plus ``"input_ids": [n] int64`` when ``with_input_ids``.

        Raises:
            IndexError: an index outside ``[0, len)``. CacheError: see the class.
        """
        out = []
        for i in indices:
            shard, j = self._locate(i)
            with self._open(shard) as f:
                off = f.get_slice("offsets")[j: j + 2]
                a, b = int(off[0]), int(off[1])
                aux, last = f.get_slice("aux")[a:b], f.get_slice("last")[a:b]
                if self.dtype == "fp8":
                    aux = dequantize_fp8_rows(aux, f.get_slice("aux_scale")[a:b])
                    last = dequantize_fp8_rows(last, f.get_slice("last_scale")[a:b])
                item = {"aux": aux, "last": last, "argmax": f.get_slice("argmax")[a:b].to(torch.int64)}
                if with_input_ids:
                    item["input_ids"] = f.get_slice("input_ids")[a:b].to(torch.int64)
                out.append(item)
        return out

    @torch.no_grad()
    def verify_against(self, target, i: int) -> dict:
        """Recompute sequence ``i`` with ``target`` (batch of one) and compare with the cache.

        Use on request (e.g. after moving a cache between machines, or to measure what fp8
        storage costs): the target must be the one the cache was built with.

        Returns:
            ``{"sequence": i, "tokens": n, "dtype", "aux": {"max_abs", "mean_abs", "mean_abs_ref",
            "rel_mean"}, "last": {...}, "argmax_agreement": fraction}`` -- errors of the cached
            values against the fresh float32 recompute (``mean_abs_ref`` = mean |reference|,
            ``rel_mean`` = ``mean_abs / mean_abs_ref``).

        Raises:
            CacheError: the target's aux layer ids or hidden size differ from the manifest's.
        """
        m = self.manifest
        if list(target.aux_layer_ids) != m["aux_layer_ids"] or target.config.hidden_size != m["hidden_size"]:
            raise CacheError(f"{self.dir}: cache was built with aux layers {m['aux_layer_ids']} / T={m['hidden_size']}, "
                             f"not {list(target.aux_layer_ids)} / T={target.config.hidden_size}: wrong target")
        cached = self.get([i], with_input_ids=True)[0]
        ref = next(iter_target_features(target, [cached["input_ids"].tolist()], 1))

        def err(c: torch.Tensor, r: torch.Tensor) -> dict:
            d = (c.float() - r.float().cpu()).abs()
            ref_mag = r.float().abs().mean().item()
            return {"max_abs": d.max().item(), "mean_abs": d.mean().item(), "mean_abs_ref": ref_mag,
                    "rel_mean": d.mean().item() / ref_mag if ref_mag else float("nan")}

        return {"sequence": i, "tokens": int(cached["argmax"].numel()), "dtype": self.dtype,
                "aux": err(cached["aux"], ref["aux"]), "last": err(cached["last"], ref["last"]),
                "argmax_agreement": (cached["argmax"] == ref["argmax"].cpu()).float().mean().item()}

    def target_head(self) -> torch.Tensor:
        """The target head ``[V, T]`` bfloat16."""
        with safe_open(str(self.dir / "target_head.safetensors"), framework="pt") as f:
            return f.get_tensor("head")

    def target_embeddings(self) -> torch.Tensor:
        """The target input embeddings ``[V, T]`` bfloat16 (the drafter's embedding init)."""
        with safe_open(str(self.dir / "target_head.safetensors"), framework="pt") as f:
            return f.get_tensor("embed")
