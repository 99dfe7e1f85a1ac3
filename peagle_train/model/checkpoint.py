"""Drafter and checkpoint folders on disk: the trained drafter (fp32 safetensors + config),
and the completeness rule for training checkpoints (a ``COMPLETE`` marker written last)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from peagle_train.model.drafter import Drafter


def complete_checkpoints(root: Path) -> list[Path]:
    """``step-*`` folders under ``root`` that carry the ``COMPLETE`` marker, oldest first."""
    if not root.exists():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "COMPLETE").exists())


def write_drafter_dir(state_dict: dict[str, torch.Tensor], config, out: Path) -> Path:
    """Write a drafter's full (gathered) state dict as fp32 safetensors plus ``config.json`` to ``out``
    atomically (temp folder, then rename), replacing an older one."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(".tmp-" + out.name)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    sd = {k: v.float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in state_dict.items()}
    save_file(sd, str(tmp / "model.safetensors"))
    config.to_json_file(str(tmp / "config.json"))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def load_drafter_dir(path: str | Path) -> Drafter:
    """Load a drafter written by :func:`write_drafter_dir` (``Trainer.save_drafter``), fp32 on CPU.

    Raises:
        FileNotFoundError: with the command to run first.
    """
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    path = Path(path)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{path}/model.safetensors not found: run `peagle-train train RECIPE` first")
    config = LlamaConfig.from_json_file(str(path / "config.json"))
    drafter = Drafter(config)
    drafter.load_state_dict(load_file(str(path / "model.safetensors")))
    return drafter
