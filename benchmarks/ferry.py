"""Files across a device call's transfer limits: which files travel together.

A device call brings back at most 8 files of at most 16 MiB each, 64 MiB in all, and carries in at
most 64 MiB (``/work/.library/device/README.md``); a portable training state of a few hundred MB
(docs/resume.md, written in 14 MiB pieces with ``train.state_part_mib=14``) therefore travels in
several calls. :func:`plan` groups files in order so that each group fits one call.

    python benchmarks/ferry.py out SRC I DEST     # batch I of SRC's files (<= 8, <= 62 MiB) copied to DEST
    python benchmarks/ferry.py carry SRC DEST     # all of SRC's files into DEST/b0, b1, ... (<= 58 MiB each)

(``quality_experiment.sh state-out`` and ``ferry-groups``.)
"""
from __future__ import annotations

import argparse
import shutil
import sys
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


def files_of(src: Path) -> list[Path]:
    """The plain files directly in ``src``, sorted by name."""
    return sorted(p for p in src.iterdir() if p.is_file())


def main(argv=None) -> None:
    """The command line above. Exits with a message naming the folder or file for a missing source folder, a
    file too large for one call, a batch that does not exist, or a non-empty ``carry`` destination (an earlier
    leg's pieces must not be carried with these); nothing is copied then."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("out")
    o.add_argument("src", type=Path)
    o.add_argument("i", type=int)
    o.add_argument("dest", type=Path)
    c = sub.add_parser("carry")
    c.add_argument("src", type=Path)
    c.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    if not a.src.is_dir():
        sys.exit(f"{a.cmd}: {a.src} is not a folder: give the folder of the state's files")
    try:
        groups = plan(files_of(a.src), max_group_bytes=MAX_GROUP_BYTES if a.cmd == "out" else MAX_CARRY_BYTES)
    except ValueError as e:  # a piece too large for one call
        sys.exit(f"{a.cmd}: {e}")
    if a.cmd == "out":
        if not 0 <= a.i < len(groups):
            sys.exit(f"state-out: batch {a.i} does not exist: {a.src} makes {len(groups)} batches (0..{len(groups) - 1})")
        a.dest.mkdir(parents=True, exist_ok=True)
        for f in groups[a.i]:
            shutil.copy2(f, a.dest / f.name)
        print(f"state-out: batch {a.i} of {len(groups)} (0..{len(groups) - 1}): {', '.join(f.name for f in groups[a.i])}")
        return
    if a.dest.exists() and any(a.dest.iterdir()):
        sys.exit(f"ferry-groups: {a.dest} is not empty: remove it first (an earlier leg's pieces must not be carried)")
    for i, g in enumerate(groups):
        (a.dest / f"b{i}").mkdir(parents=True, exist_ok=True)
        for f in g:
            shutil.copy2(f, a.dest / f"b{i}" / f.name)
    print(f"ferry-groups: {len(groups)} groups in {a.dest}")


if __name__ == "__main__":
    main()
