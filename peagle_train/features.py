"""Target features for training: a sharded on-disk cache, or the live target (online).

Both sources implement ``get(indices) -> list[dict]`` giving, per sequence of
``n`` tokens: ``aux [n, A*T]``, ``last [n, T]`` (final hidden state after the
target's final norm) and ``argmax [n]`` int64 (target greedy next token); and
``target_head() -> [V, T]``. The trainer never knows which one it has.

Cache layout (``<dir>/``)::

    manifest.json            format, dtype, T, A, aux ids, shards [{file, sha256, first, count, tokens}]
    shard-00000.safetensors  aux [tokens, A*T], last [tokens, T], argmax [tokens] int32, offsets [count+1] int64
    target_head.safetensors  head [V, T]

Shards are written to a temp name, hashed, then renamed; the manifest is
rewritten atomically after every shard, so a killed run resumes at the first
missing shard and never trusts a half-written file. Reads are memory-mapped
(``safetensors.safe_open`` slices) and each shard's sha256 is checked before
first use.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "peagle-features-v1"


class CacheError(RuntimeError):
    """A feature cache is missing, corrupt, or does not match the run; the message says what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def write_cache(target, sequences: list[list[int]], out_dir: str | Path, *, dtype: str = "bfloat16",
                batch_size: int = 8, shard_size: int = 64, progress: bool = True) -> Path:
    """Run the target over ``sequences`` and write the sharded cache (resumable).

    Args:
        target: :class:`~peagle_train.target.Target`.
        sequences: token id lists (the training set, in order).
        out_dir: cache directory. dtype: storage dtype of ``aux``/``last``.
        batch_size: sequences per target forward. shard_size: sequences per shard.

    Returns:
        ``out_dir``.

    Raises:
        CacheError: an existing manifest was written for different data/target.
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = hashlib.sha256(json.dumps([target.path, target.aux_layer_ids, sequences]).encode()).hexdigest()
    man_path = out / "manifest.json"
    manifest = {
        "format": FORMAT, "dtype": dtype, "fingerprint": fingerprint,
        "target": target.path, "aux_layer_ids": target.aux_layer_ids,
        "hidden_size": target.config.hidden_size, "num_sequences": len(sequences), "shards": [], "complete": False,
    }
    if man_path.exists():
        old = json.loads(man_path.read_text())
        if old.get("fingerprint") != fingerprint:
            raise CacheError(f"{man_path}: cache was built for other data or another target; "
                             "delete the directory or choose another output_dir")
        manifest = old
    sdt = getattr(torch, dtype)
    head_path = out / "target_head.safetensors"
    if not head_path.exists():
        tmp = out / "target_head.tmp"
        save_file({"head": target.lm_head_weight().detach().to("cpu", sdt).contiguous(),
                   "embed": target.model.get_input_embeddings().weight.detach().to("cpu", sdt).contiguous()},
                  str(tmp))
        os.replace(tmp, head_path)
    done = {s["first"] for s in manifest["shards"]}
    starts = list(range(0, len(sequences), shard_size))
    bar = tqdm(total=sum(len(s) for s in sequences), unit="tok", desc="cache", disable=not progress)
    for first in starts:
        chunk = sequences[first:first + shard_size]
        if first in done:
            bar.update(sum(len(s) for s in chunk))
            continue
        parts = {"aux": [], "last": [], "argmax": []}
        for feats in iter_target_features(target, chunk, batch_size):
            for k in parts:
                parts[k].append(feats[k].cpu())
            bar.update(feats["argmax"].numel())
        lengths = torch.tensor([0] + [len(s) for s in chunk]).cumsum(0)
        name = f"shard-{first // shard_size:05d}.safetensors"
        tmp = out / (name + ".tmp")
        save_file({
            "aux": torch.cat(parts["aux"]).to(sdt).contiguous(),
            "last": torch.cat(parts["last"]).to(sdt).contiguous(),
            "argmax": torch.cat(parts["argmax"]).to(torch.int32).contiguous(),
            "offsets": lengths.to(torch.int64),
        }, str(tmp))
        os.replace(tmp, out / name)
        manifest["shards"].append({"file": name, "sha256": _sha256(out / name), "first": first,
                                   "count": len(chunk), "tokens": int(lengths[-1])})
        manifest["shards"].sort(key=lambda s: s["first"])
        _atomic_json(man_path, manifest)
    bar.close()
    manifest["complete"] = True
    manifest["bytes_per_token"] = sum((out / s["file"]).stat().st_size for s in manifest["shards"]) / max(
        1, sum(s["tokens"] for s in manifest["shards"]))
    _atomic_json(man_path, manifest)
    return out


@torch.no_grad()
def iter_target_features(target, sequences: list[list[int]], batch_size: int):
    """Yield per-sequence feature dicts (``aux``, ``last``, ``argmax``) by running the target in padded batches."""
    dev = target.device
    for s in range(0, len(sequences), batch_size):
        batch = sequences[s:s + batch_size]
        n = max(len(x) for x in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        att = torch.zeros(len(batch), n, dtype=torch.long)
        for i, x in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            att[i, : len(x)] = 1
        f = target.features(ids.to(dev), att.to(dev))
        for i, x in enumerate(batch):
            yield {"aux": f["aux"][i, : len(x)], "last": f["last"][i, : len(x)], "argmax": f["argmax"][i, : len(x)]}


class CachedFeatures:
    """Memory-mapped reader of a feature cache.

    Raises:
        CacheError: missing/incomplete manifest, unknown format, checksum mismatch
            (names the shard and says to delete it and re-run ``peagle-train cache``).
    """

    def __init__(self, cache_dir: str | Path, verify: bool = True):
        self.dir = Path(cache_dir)
        man = self.dir / "manifest.json"
        if not man.is_file():
            raise CacheError(f"{man} not found: run `peagle-train cache RECIPE` first")
        self.manifest = json.loads(man.read_text())
        if self.manifest.get("format") != FORMAT:
            raise CacheError(f"{man}: unknown cache format {self.manifest.get('format')!r}")
        if not self.manifest.get("complete"):
            raise CacheError(f"{man}: cache is incomplete (interrupted?); re-run `peagle-train cache` to resume")
        self.verify = verify
        self._verified: set[str] = set()
        self._index = []  # global sequence index -> (shard, local)
        for s in self.manifest["shards"]:
            self._index += [(s, j) for j in range(s["count"])]

    def __len__(self) -> int:
        return len(self._index)

    def _open(self, shard: dict):
        path = self.dir / shard["file"]
        if self.verify and shard["file"] not in self._verified:
            if not path.is_file() or _sha256(path) != shard["sha256"]:
                raise CacheError(f"{path}: checksum mismatch or missing; delete it and re-run `peagle-train cache`")
            self._verified.add(shard["file"])
        return safe_open(str(path), framework="pt")

    def get(self, indices: list[int]) -> list[dict]:
        """Features of sequences ``indices`` (dicts of ``aux``, ``last``, ``argmax`` int64)."""
        out = []
        for i in indices:
            shard, j = self._index[i]
            with self._open(shard) as f:
                off = f.get_slice("offsets")[j: j + 2]
                a, b = int(off[0]), int(off[1])
                out.append({"aux": f.get_slice("aux")[a:b], "last": f.get_slice("last")[a:b],
                            "argmax": f.get_slice("argmax")[a:b].to(torch.int64)})
        return out

    def target_head(self) -> torch.Tensor:
        """The target head ``[V, T]``."""
        with safe_open(str(self.dir / "target_head.safetensors"), framework="pt") as f:
            return f.get_tensor("head")

    def target_embeddings(self) -> torch.Tensor:
        """The target input embeddings ``[V, T]`` (the drafter's embedding init)."""
        with safe_open(str(self.dir / "target_head.safetensors"), framework="pt") as f:
            return f.get_tensor("embed")


class OnlineFeatures:
    """The frozen target runs inside the trainer (no grad), behind the cache's interface."""

    def __init__(self, target, sequences: list[list[int]], batch_size: int = 8):
        self.target, self.sequences, self.batch_size = target, sequences, batch_size

    def __len__(self) -> int:
        return len(self.sequences)

    def get(self, indices: list[int]) -> list[dict]:
        return list(iter_target_features(self.target, [self.sequences[i] for i in indices], self.batch_size))

    def target_head(self) -> torch.Tensor:
        return self.target.lm_head_weight().detach()

    def target_embeddings(self) -> torch.Tensor:
        return self.target.model.get_input_embeddings().weight.detach()


def pack(samples: list[dict], input_ids: list[list[int]], loss_masks: list[list[int]], device) -> dict:
    """Concatenate sequences into one packed micro-batch with document ids.

    Returns:
        dict with ``input_ids [N]`` int64, ``loss_mask [N]`` bool, ``doc_ids [N]`` int64,
        ``aux [N, A*T]``, ``last [N, T]``, ``argmax [N]`` int64, on ``device``.
    """
    return {
        "input_ids": torch.tensor([t for s in input_ids for t in s], dtype=torch.long, device=device),
        "loss_mask": torch.tensor([m for s in loss_masks for m in s], dtype=torch.bool, device=device),
        "doc_ids": torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(input_ids)]).to(device),
        "aux": torch.cat([s["aux"] for s in samples]).to(device),
        "last": torch.cat([s["last"] for s in samples]).to(device),
        "argmax": torch.cat([s["argmax"] for s in samples]).to(device),
    }
