"""Atomic file writes for the run's bookkeeping files (manifests, metrics, configs, model cards).

A reader (another regeneration worker, a resumed run, a crashed writer's successor) sees the old
file or the whole new one, never a torn write: the text goes to a temp file in the same folder,
then ``os.replace`` swaps it in. Only the standard library, so any module can use it cheaply.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``.<name>.tmp<pid>`` and ``os.replace``.

    Raises:
        OSError: the folder is missing or not writable (``path`` is left as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through ``.<name>.tmp<pid>``, ``fsync`` and ``os.replace``: a reader sees the
    old file or the whole new one, also after a crash (large files that must survive one: portable states).

    Raises:
        OSError: the folder is missing or not writable (``path`` is left as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finite_or_none(obj):
    """``obj`` with every NaN / ±inf float (at any depth of dicts, lists and tuples) replaced by
    None, so it serialises as strict JSON (``null``): Python writes bare ``NaN``, which strict
    parsers (``jq``, browsers, most languages) reject. Other values are returned as they are."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def write_json_atomic(path: str | Path, obj, indent: int | None = 1, default=None) -> None:
    """Write ``obj`` as strict JSON to ``path`` atomically (:func:`write_text_atomic`): non-finite
    floats become ``null`` (:func:`finite_or_none`; e.g. a conditional accuracy at a depth that
    no chain reached); ``default`` as in ``json.dumps``.

    Raises:
        TypeError: ``obj`` is not JSON-serialisable (nothing is written). OSError: as above.
    """
    write_text_atomic(path, json.dumps(finite_or_none(obj), indent=indent, default=default, allow_nan=False))
