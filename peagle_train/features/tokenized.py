"""Tokenised conversations on disk: one safetensors file per split.

Layout: ``input_ids [total]`` int32, ``loss_mask [total]`` uint8 and ``offsets [n+1]``
int64 (row ``i`` is ``[offsets[i], offsets[i+1])``). Compact (5 bytes/token),
memory-mappable, and readable without ``datasets`` (the GPU machines lack it).
Writes are atomic (temp file + rename).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save_tokenized(rows: list[dict], path: str | Path) -> None:
    """Write rows ``{"input_ids": list[int], "loss_mask": list[int]}`` to ``path`` (.safetensors).

    Raises:
        ValueError: a row whose ``input_ids`` and ``loss_mask`` lengths differ (names the row).
    """
    for i, r in enumerate(rows):
        if len(r["input_ids"]) != len(r["loss_mask"]):
            raise ValueError(f"row {i}: input_ids and loss_mask lengths differ")
    lengths = torch.tensor([0] + [len(r["input_ids"]) for r in rows], dtype=torch.int64)
    ids = torch.tensor([t for r in rows for t in r["input_ids"]], dtype=torch.int32)
    mask = torch.tensor([m for r in rows for m in r["loss_mask"]], dtype=torch.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"input_ids": ids, "loss_mask": mask, "offsets": lengths.cumsum(0)}, str(tmp))
    os.replace(tmp, path)


def load_tokenized(path: str | Path) -> dict:
    """Read a split: ``{"input_ids": list[list[int]], "loss_mask": list[list[int]]}``.

    Raises:
        FileNotFoundError: the split is missing.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `peagle-train prepare RECIPE` first")
    with safe_open(str(path), framework="pt") as f:
        ids, mask, off = f.get_tensor("input_ids").tolist(), f.get_tensor("loss_mask").tolist(), f.get_tensor("offsets").tolist()
    return {"input_ids": [ids[a:b] for a, b in zip(off[:-1], off[1:])],
            "loss_mask": [mask[a:b] for a, b in zip(off[:-1], off[1:])]}


def first_supervised(loss_mask) -> int | None:
    """Index of the first supervised (loss-mask 1) token of a sequence, None if there is none.

    A sequence's prompt is everything before it (the ``heldout`` eval set and the training-time
    loop replay both start there).
    """
    return next((i for i, m in enumerate(loss_mask) if m), None)


def heldout_rows(loss_masks) -> list[int]:
    """Rows of a split that form the ``heldout`` eval set, in order: those with a prompt, i.e. a
    first supervised token after index 0 (:func:`first_supervised`). The one rule behind both
    ``data/eval_prompts.json`` (:func:`peagle_train.stages.eval_prompt_ids`) and the training log's
    ``eval_walk_al_heldout`` subset (``Trainer._heldout_rank``)."""
    return [i for i, m in enumerate(loss_masks) if first_supervised(m)]


def load_prepared(out_dir: Path) -> dict:
    """Read the tokenised ``train``/``eval`` splits written by ``prepare`` (eval falls back to train).

    Raises:
        FileNotFoundError: with the command to run first.
    """
    d = Path(out_dir) / "data"
    out = {"train": load_tokenized(d / "train.safetensors")}
    out["eval"] = load_tokenized(d / "eval.safetensors") if (d / "eval.safetensors").exists() else out["train"]
    return out
