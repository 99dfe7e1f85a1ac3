"""Names and value rules both export checkers share (vLLM's layout, ``check.py``; speculators'
layout, ``check_speculators.py``): the files of an export directory and what counts as an integer
field of ``config.json``."""
from __future__ import annotations

#: the export directory's config and weights files (what vLLM reads, spec §5).
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def is_int(x) -> bool:
    """A JSON integer: ``int`` but not ``bool`` (``True`` is an ``int`` in Python, never a size in a config)."""
    return isinstance(x, int) and not isinstance(x, bool)
