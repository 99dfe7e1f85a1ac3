"""Files across a device call's transfer limits: which files travel together.

A device call brings back at most 8 files of at most 16 MiB each, 64 MiB in all, and carries in at
most 64 MiB (``/work/.library/device/README.md``); a portable training state of a few hundred MB
(docs/resume.md, written in 14 MiB pieces with ``train.state_part_mib=14``) therefore travels in
several calls. :func:`plan` groups files in order so that each group fits one call.

    python benchmarks/ferry.py out SRC I DEST     # batch I of SRC's files (<= 8, <= 62 MiB) copied to DEST
                                                  # ($FERRY_MAX_FILES: fewer files, room for others)
    python benchmarks/ferry.py carry SRC DEST     # all of SRC's files into DEST/b0, b1, ... (<= 43 MiB each)
    python benchmarks/ferry.py pack SRC DEST      # SRC's files, each xz-compressed, in tar pieces of <= 14 MiB
                                                  # (DEST/pack-NNN.tar) and DEST/pack-manifest.json (sha256s)
    python benchmarks/ferry.py unpack SRC DEST    # the pieces of SRC (checked) into DEST; files there are kept
    python benchmarks/ferry.py split DEST NAME=DIR ...   # each DIR's files cut into byte pieces of <= 14 MiB in
                                                  # DEST (uncompressed: weights do not compress), DEST/SPLIT_MANIFEST;
                                                  # nothing done where DEST holds the pieces of the same files
    python benchmarks/ferry.py join SRC DEST      # those pieces (checked) back into DEST/NAME/FILE
    python benchmarks/ferry.py out-next SRC DEST  # the files of SRC not sent before with the same content (a
                                                  # split's manifest first), as many as fit beside what DEST holds
                                                  # (8 files, 62 MiB in all)

(``quality_experiment.sh state-out``, ``ferry-groups``, ``regen-out`` and ``regen-in``: regeneration
shards, many small JSON files that compress well, travel as ``pack`` pieces; ``export-out``: a trained drafter's
export, one weights file larger than a returned file, travels as ``split`` pieces.)
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
MAX_GROUP_BYTES = 62 * 2**20  # back from a call: under its 64 MiB, with room for the command's own output
#: the tracked working tree at most (tests/integration/test_quality_script.py keeps it under this): every call
#: carries it beside its inputs
MAX_TREE_BYTES = 21 * 2**20
#: carried into a call: its 64 MiB hold the tracked tree too (up to MAX_TREE_BYTES): 3 pieces of 14 MiB and the
#: manifests (58 MiB until the tree grew past a few MiB with the committed shards: such a group no longer fit)
MAX_CARRY_BYTES = 64 * 2**20 - MAX_TREE_BYTES
#: one ``pack`` piece: under a returned file's 16 MiB with room for the tar headers
MAX_PIECE_BYTES = 14 * 2**20
MANIFEST = "pack-manifest.json"
SPLIT_MANIFEST = "split-manifest.json"
#: out_next's record of what it sent from a folder (hidden: ``files_of`` skips it, so it never travels itself)
SENT = ".sent.json"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file (this script stays standard-library only: it runs under any ``python3`` on either
    machine, where ``peagle_train.features.target.sha256_file`` would import torch)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


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
    """The plain files directly in ``src``, sorted by name, without hidden ones (``.NAME.tmpPID``: a file an
    atomic write has not finished, ``peagle_train.core.atomic``)."""
    return sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))


def pack(src: Path, dest: Path, max_piece_bytes: int = MAX_PIECE_BYTES) -> dict:
    """Pack the plain files of ``src`` (sorted by name), each xz-compressed (``NAME.xz``), into uncompressed tar
    pieces ``dest/pack-000.tar``, ``pack-001.tar``, ... of at most ``max_piece_bytes`` of compressed content, and
    write ``dest/pack-manifest.json``: ``{"files": {name: sha256 of the original}, "pieces": {piece: sha256}}``.

    ``dest`` is emptied of earlier pieces first (a pack describes ``src`` as it is now). Pieces and the manifest
    are written to temporary names and renamed (a killed run leaves no piece that looks complete).

    Returns:
        the manifest.

    Raises:
        ValueError: ``src`` is not a folder; a file whose compressed size exceeds ``max_piece_bytes`` (named).
    """
    if not src.is_dir():
        raise ValueError(f"pack: {src} is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("pack-*"):
        old.unlink()
    files, pieces, current, size = {}, {}, [], 0

    def flush():
        name = f"pack-{len(pieces):03d}.tar"
        tmp = dest / f".{name}.tmp"
        with tarfile.open(tmp, "w") as t:
            for arc, blob in current:
                info = tarfile.TarInfo(arc)
                info.size, info.mtime = len(blob), 0
                t.addfile(info, io.BytesIO(blob))
        os.replace(tmp, dest / name)
        pieces[name] = sha256_file(dest / name)

    for f in files_of(src):
        data = f.read_bytes()
        files[f.name] = hashlib.sha256(data).hexdigest()
        blob = lzma.compress(data, preset=6)
        if len(blob) > max_piece_bytes:
            raise ValueError(f"pack: {f} is {len(blob) / 2**20:.1f} MiB compressed, more than one piece holds "
                             f"({max_piece_bytes / 2**20:.0f} MiB)")
        if current and size + len(blob) > max_piece_bytes:
            flush()
            current, size = [], 0
        current.append((f.name + ".xz", blob))
        size += len(blob)
    if current:
        flush()
    manifest = {"files": files, "pieces": pieces}
    tmp = dest / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, dest / MANIFEST)
    return manifest


def unpack(src: Path, dest: Path) -> tuple[list[str], list[str]]:
    """Extract the pieces that ``pack`` wrote (``src/pack-manifest.json`` and its pieces) into ``dest``.

    Every piece's sha256 is checked against the manifest before anything is written, and every extracted
    file's against the original's; a file already in ``dest`` is kept, not overwritten (a shard finished on
    this machine stays). Each file is written to a temporary name and renamed.

    Returns:
        ``(written, kept)`` file names.

    Raises:
        ValueError: no manifest in ``src``; a piece missing or damaged (named, with what to do); a file whose
            content does not match the manifest.
    """
    mf = src / MANIFEST
    if not mf.is_file():
        raise ValueError(f"unpack: no {MANIFEST} in {src}: carry the folder that `pack` wrote (its pieces and manifest)")
    manifest = json.loads(mf.read_text())
    for piece, digest in manifest["pieces"].items():
        if not (src / piece).is_file():
            raise ValueError(f"unpack: {src / piece} is missing: carry every piece the manifest lists "
                             f"({', '.join(manifest['pieces'])})")
        if sha256_file(src / piece) != digest:
            raise ValueError(f"unpack: {src / piece} is damaged (sha256 differs from {MANIFEST}): fetch it again")
    dest.mkdir(parents=True, exist_ok=True)
    written, kept = [], []
    for piece in manifest["pieces"]:
        with tarfile.open(src / piece, "r") as t:
            for m in t.getmembers():
                name = m.name.removesuffix(".xz")
                if name != Path(name).name or name not in manifest["files"]:
                    raise ValueError(f"unpack: {src / piece} holds {m.name!r}, which {MANIFEST} does not list")
                if (dest / name).exists():
                    kept.append(name)
                    continue
                data = lzma.decompress(t.extractfile(m).read())
                if hashlib.sha256(data).hexdigest() != manifest["files"][name]:
                    raise ValueError(f"unpack: {name} in {src / piece} does not match {MANIFEST}")
                tmp = dest / f".{name}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, dest / name)
                written.append(name)
    return written, kept


def split(dirs: dict[str, Path], dest: Path, max_piece_bytes: int = MAX_PIECE_BYTES) -> dict:
    """Cut the plain files of each folder in ``dirs`` (``{name: folder}``) into byte pieces of at most
    ``max_piece_bytes`` in ``dest`` (``NAME.FILE.pNNN``), and write ``dest/SPLIT_MANIFEST``:
    ``{"files": {"NAME/FILE": {"sha256", "bytes", "pieces": [piece, ...]}}, "pieces": {piece: sha256}}``.

    For files larger than one returned file (a drafter's export: ~145 MB of weights for the SmolLM2 P-EAGLE head),
    which ``pack`` refuses; nothing is compressed (float weights gain little and xz would cost the machine's
    minutes). ``dest`` is emptied of earlier pieces first; each piece and the manifest are written to a temporary
    name and renamed.

    Returns:
        the manifest.

    Raises:
        ValueError: a folder in ``dirs`` is missing or holds no file; a name that is not one plain word
            (letters, digits, ``-``, ``_``).
    """
    started = time.time()  # split_is_current: a file modified after this was perhaps cut half-old
    dest.mkdir(parents=True, exist_ok=True)
    for old in list(dest.glob("*.p[0-9][0-9][0-9]")) + [dest / SPLIT_MANIFEST]:
        old.unlink(missing_ok=True)
    files, pieces = {}, {}
    for name, folder in dirs.items():
        if not name or not all(c.isalnum() or c in "-_" for c in name):
            raise ValueError(f"split: {name!r} is not a plain name (letters, digits, '-', '_')")
        if not folder.is_dir() or not files_of(folder):
            raise ValueError(f"split: {folder} is not a folder with files (name {name}): export the drafter first")
        for f in files_of(folder):
            h, parts, i = hashlib.sha256(), [], 0
            with open(f, "rb") as src:
                while True:
                    block = src.read(max_piece_bytes)
                    if not block and parts:
                        break
                    h.update(block)
                    piece = f"{name}.{f.name}.p{i:03d}"
                    tmp = dest / f".{piece}.tmp"
                    tmp.write_bytes(block)
                    os.replace(tmp, dest / piece)
                    pieces[piece] = hashlib.sha256(block).hexdigest()
                    parts.append(piece)
                    i += 1
                    if len(block) < max_piece_bytes:
                        break
            files[f"{name}/{f.name}"] = {"sha256": h.hexdigest(), "bytes": f.stat().st_size, "pieces": parts}
    manifest = {"files": files, "pieces": pieces, "started": started}
    tmp = dest / f".{SPLIT_MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, dest / SPLIT_MANIFEST)
    return manifest


def split_is_current(dirs: dict[str, Path], dest: Path) -> bool:
    """Whether ``dest`` already holds the ``split`` pieces of exactly these folders' files (the same ``NAME/FILE``
    entries and sizes in ``dest/SPLIT_MANIFEST``) and no file there changed after them (modified later than the
    split began, its manifest's ``started``; the manifest's own time for one without it: a file rewritten while it
    was being cut, as the evaluation's merge rewrites the model card, is cut again even at the same size):
    ``export-out`` then sends the pieces it cut before instead of cutting them again for every batch.
    A manifest that is not ``split``'s JSON counts as not current (the pieces are cut again). Raises nothing."""
    mf = dest / SPLIT_MANIFEST
    if not mf.is_file() or not all(folder.is_dir() for folder in dirs.values()):
        return False
    try:
        manifest = json.loads(mf.read_text())
        files = manifest["files"]
        made = float(manifest.get("started", mf.stat().st_mtime))
    except (ValueError, KeyError, TypeError, AttributeError):  # a damaged manifest: cut again (split rewrites it)
        return False
    now = {f"{name}/{f.name}": f for name, folder in dirs.items() for f in files_of(folder)}
    return now.keys() == files.keys() and all(f.stat().st_size == files[k]["bytes"] and f.stat().st_mtime <= made
                                              for k, f in now.items())


def join(src: Path, dest: Path) -> list[str]:
    """Put the files that ``split`` cut back together: ``src/SPLIT_MANIFEST`` and its pieces (e.g. the ``export-out``
    batches gathered in one folder) into ``dest/NAME/FILE``.

    Every piece is checked before anything is written, and each joined file's sha256 and size against the manifest;
    a file is written to a temporary name and renamed. An existing file with the manifest's content is left as it
    is; one with other content is refused (a drafter of another run).

    Returns:
        the ``NAME/FILE`` paths written.

    Raises:
        ValueError: no manifest in ``src``, or one that is not split's; a piece missing or damaged (named, with what
            to do); a joined file that does not match the manifest; a file in ``dest`` with other content.
    """
    mf = src / SPLIT_MANIFEST
    if not mf.is_file():
        raise ValueError(f"join: no {SPLIT_MANIFEST} in {src}: gather every batch of export-out in one folder")
    try:
        manifest = json.loads(mf.read_text())
        pieces, files = manifest["pieces"], manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"join: {mf} is not split's manifest ({type(e).__name__}: {e}): bring it back again "
                         "(export-out's batch 0 holds it)") from None
    missing = [p for p in pieces if not (src / p).is_file()]
    if missing:
        raise ValueError(f"join: {len(missing)} pieces missing in {src} (first: {missing[0]}): bring back every "
                         "batch of export-out (quality_experiment.sh prints how many there are)")
    for piece, digest in pieces.items():
        if sha256_file(src / piece) != digest:
            raise ValueError(f"join: {src / piece} is damaged (sha256 differs from {SPLIT_MANIFEST}): fetch it again")
    written = []
    for rel, info in files.items():
        name, fname = rel.split("/", 1)
        if name != Path(name).name or fname != Path(fname).name or name in ("", ".", ".."):
            raise ValueError(f"join: {SPLIT_MANIFEST} names {rel!r}, not NAME/FILE")
        out = dest / name / fname
        if out.exists():
            if sha256_file(out) != info["sha256"]:
                raise ValueError(f"join: {out} exists with other content: join into an empty folder")
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{fname}.tmp"
        h = hashlib.sha256()
        with open(tmp, "wb") as w:
            for piece in info["pieces"]:
                block = (src / piece).read_bytes()
                h.update(block)
                w.write(block)
        if h.hexdigest() != info["sha256"] or tmp.stat().st_size != info["bytes"]:
            tmp.unlink()
            raise ValueError(f"join: {rel} joined from {len(info['pieces'])} pieces does not match {SPLIT_MANIFEST}")
        os.replace(tmp, out)
        written.append(rel)
    return written


def _sent_record(src: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``out_next``'s record of ``src`` (``{name: sha256}`` sent; an older or damaged record counts as nothing
    sent) and the sha256 of each file there now (from the split manifest's ``pieces`` where listed, else hashed).
    Raises nothing."""
    try:
        listed = json.loads((src / SPLIT_MANIFEST).read_text())["pieces"]
        listed = listed if isinstance(listed, dict) else {}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        listed = {}
    try:
        sent = json.loads((src / SENT).read_text())["sent"]
        sent = sent if isinstance(sent, dict) else {}  # an older record (names only): none kept
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        sent = {}
    return sent, {f.name: listed.get(f.name) or sha256_file(f) for f in files_of(src)}


def unsent(src: Path) -> list[str]:
    """Names of the files of ``src`` that ``out_next`` has not sent with their present content (every file where
    there is no record), sorted.

    Raises:
        ValueError: ``src`` is not a folder (named, as ``out_next`` says it).
    """
    if not src.is_dir():
        raise ValueError(f"out-next: {src} is not a folder: cut the export first (ferry.py split)")
    sent, digest = _sent_record(src)
    return [n for n in sorted(digest) if sent.get(n) != digest[n]]


def out_next(src: Path, dest: Path, max_files: int = MAX_FILES, max_bytes: int = MAX_GROUP_BYTES) -> list[str]:
    """Copy to ``dest`` the files of ``src`` that no earlier ``out_next`` sent with the same content,
    ``SPLIT_MANIFEST`` first and then in name order, as many as fit beside what ``dest`` already holds
    (``max_files`` files and ``max_bytes`` bytes in all, a device call's returned files: the ``wait`` step's log
    and results come first); record them (name and sha256) as sent in ``src/SENT``.

    Each ``wait`` call of a lease thus brings back the next pieces of a finished drafter's export while the
    evaluation runs, with no call of its own (``export-out I`` sends a batch again by its index). The record is by
    content, not by cut: when the export is cut again because one of its files changed (the evaluation's merge
    rewrites the model card, ``README.md``, after the weights were cut and partly sent: run 9), only the pieces
    whose bytes changed and the new manifest go again; a piece's sha256 is taken from the manifest's ``pieces``
    where it is listed there, else hashed. Gather the calls' files in call order on the other side (a later
    manifest replaces an earlier one). Files are copied under a temporary name and renamed; the record is written
    after the copies.

    Returns:
        the names copied (empty: everything was sent, or the first unsent file does not fit; files stay in order).

    Raises:
        ValueError: ``src`` is not a folder.
    """
    if not src.is_dir():
        raise ValueError(f"out-next: {src} is not a folder: cut the export first (ferry.py split)")
    sent, digest = _sent_record(src)
    todo = [f for f in sorted(files_of(src), key=lambda f: (f.name != SPLIT_MANIFEST, f.name))
            if sent.get(f.name) != digest[f.name]]
    dest.mkdir(parents=True, exist_ok=True)
    held = files_of(dest)
    n_files, n_bytes = len(held), sum(f.stat().st_size for f in held)
    copied = []
    for f in todo:
        size = f.stat().st_size
        if n_files + 1 > max_files or n_bytes + size > max_bytes:
            break
        tmp = dest / f".{f.name}.tmp"
        shutil.copy2(f, tmp)
        os.replace(tmp, dest / f.name)
        copied.append(f.name)
        n_files, n_bytes = n_files + 1, n_bytes + size
    tmp = src / f"{SENT}.tmp"
    tmp.write_text(json.dumps({"sent": {**sent, **{n: digest[n] for n in copied}}}, indent=0))
    os.replace(tmp, src / SENT)
    return copied


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
    for cmd in ("carry", "pack", "unpack", "join"):
        c = sub.add_parser(cmd)
        c.add_argument("src", type=Path)
        c.add_argument("dest", type=Path)
    on = sub.add_parser("out-next")
    on.add_argument("src", type=Path)
    on.add_argument("dest", type=Path)
    sp = sub.add_parser("split")
    sp.add_argument("dest", type=Path)
    sp.add_argument("dirs", nargs="+", help="NAME=DIR: DIR's files, recorded as NAME/FILE")
    a = p.parse_args(argv)
    if a.cmd in ("split", "join"):
        try:
            if a.cmd == "split":
                bad = [d for d in a.dirs if "=" not in d]
                if bad:
                    raise ValueError(f"split: {bad[0]!r} is not NAME=DIR")
                dirs = {d.split("=", 1)[0]: Path(d.split("=", 1)[1]) for d in a.dirs}
                if split_is_current(dirs, a.dest):  # (nothing printed: the pieces of an earlier call are sent)
                    return
                m = split(dirs, a.dest)
                print(f"split: {len(m['files'])} files in {len(m['pieces'])} pieces in {a.dest}")
            else:
                written = join(a.src, a.dest)
                print(f"join: {len(written)} files written under {a.dest}")
        except ValueError as e:
            sys.exit(str(e))
        return
    if a.cmd == "out-next":
        try:
            copied = out_next(a.src, a.dest)
        except ValueError as e:
            sys.exit(str(e))
        left = unsent(a.src)
        print(f"out-next: {len(copied)} files of {a.src} sent in this call"
              + (f" ({', '.join(copied)})" if copied else "")
              + (f"; {len(left)} left for the next calls" if left else "; all of them sent"))
        return
    if a.cmd in ("pack", "unpack"):
        try:
            if a.cmd == "pack":
                m = pack(a.src, a.dest)
                print(f"pack: {len(m['files'])} files of {a.src} in {len(m['pieces'])} pieces in {a.dest}")
            else:
                written, kept = unpack(a.src, a.dest)
                print(f"unpack: {len(written)} files written to {a.dest}, {len(kept)} already there kept")
        except ValueError as e:
            sys.exit(str(e))
        return
    if not a.src.is_dir():
        sys.exit(f"{a.cmd}: {a.src} is not a folder: give the folder of the state's files")
    try:
        groups = plan(files_of(a.src), max_files=int(os.environ.get("FERRY_MAX_FILES", MAX_FILES)),
                      max_group_bytes=MAX_GROUP_BYTES if a.cmd == "out" else MAX_CARRY_BYTES)
    except ValueError as e:  # a piece too large for one call
        sys.exit(f"{a.cmd}: {e}")
    if a.cmd == "out":
        if not 0 <= a.i < len(groups):
            sys.exit(f"out: batch {a.i} does not exist: {a.src} makes {len(groups)} batches (0..{len(groups) - 1})")
        a.dest.mkdir(parents=True, exist_ok=True)
        for f in groups[a.i]:
            shutil.copy2(f, a.dest / f.name)
        print(f"out: batch {a.i} of {len(groups)} (0..{len(groups) - 1}): {', '.join(f.name for f in groups[a.i])}")
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
