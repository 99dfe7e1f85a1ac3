"""Files across a device call's transfer limits: which files travel together.

A device call brings back at most 8 files of at most 16 MiB each, 64 MiB in all, and carries in at
most 64 MiB (``/work/.library/device/README.md``); a portable training state of a few hundred MB
(docs/resume.md, written in 14 MiB pieces with ``train.state_part_mib=14``) therefore travels in
several calls. :func:`plan` groups files in order so that each group fits one call.
"""
from __future__ import annotations

from pathlib import Path

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
MAX_GROUP_BYTES = 62 * 2**20  # back from a call: under its 64 MiB, with room for the command's own output
#: carried into a call: its 64 MiB hold the working tree too (a few MiB): 4 pieces of 14 MiB and the manifests
MAX_CARRY_BYTES = 58 * 2**20


def plan(files: list[Path], max_files: int = MAX_FILES, max_file_bytes: int = MAX_FILE_BYTES,
         max_group_bytes: int = MAX_GROUP_BYTES) -> list[list[Path]]:
    """Split ``files`` (in the given order) into consecutive groups of at most ``max_files`` files and
    ``max_group_bytes`` bytes; returns the groups (empty input: no groups).

    Raises:
        ValueError: a file larger than ``max_file_bytes`` (name and size; write the state with
            ``train.state_part_mib=14`` so that its pieces fit).
    """
    groups: list[list[Path]] = []
    size = 0
    for f in files:
        n = f.stat().st_size
        if n > max_file_bytes:
            raise ValueError(f"{f}: {n / 2**20:.1f} MiB, more than one call carries per file "
                             f"({max_file_bytes / 2**20:.0f} MiB): write the state with train.state_part_mib=14")
        if not groups or len(groups[-1]) >= max_files or size + n > max_group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(f)
        size += n
    return groups
