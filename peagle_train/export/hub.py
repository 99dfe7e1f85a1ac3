"""Push an exported drafter directory to the Hugging Face Hub.

The directory must pass the vLLM contract check first
(:func:`peagle_train.export.check.check_export`): a checkpoint that vLLM would reject,
or load with uninitialised weights, is never published. The token is read from
an environment variable and handed to ``huggingface_hub.HfApi`` only; it is
never printed, logged or put in an exception message.

The README that is published is :func:`hub_readme`: the card's serve block re-rendered with the
Hub repo id (from the export's hidden card source, :data:`~peagle_train.export.writer.CARD_SOURCE_FILE`)
and every remaining local path, home folder or token redacted.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

from peagle_train.export.check import ExportCheckError, check_export
from peagle_train.export.model_card import TARGET_PLACEHOLDER, redact_local_paths, serve_section
from peagle_train.export.writer import CARD_SOURCE_FILE, FILE_MODE, README_FILE


class HubPushError(RuntimeError):
    """The push was refused before any network call (no token, not a directory...)."""


def upload_files(path: str | Path) -> list[tuple[str, int]]:
    """``(relative posix path, size in bytes)`` of every file that would be uploaded, sorted.

    Hidden files and folders (names starting with ``.``) are skipped, as are
    symlinks (their targets may lie outside the export).
    """
    root = Path(path)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or p.is_symlink() or not p.is_file():
            continue
        out.append((rel.as_posix(), p.stat().st_size))
    return out


def hub_readme(path: str | Path, repo_id: str) -> str | None:
    """The README.md text published for the export at ``path`` as ``repo_id`` (None: it has no README).

    The serve block the writer rendered for the local export (drafter = its absolute path, target
    = a local folder or a Hub id) is replaced by the same block naming the Hub repo ``repo_id`` and
    the target's Hub id (or a placeholder to fill in when the target was only a local folder); any
    other mention of the export folder becomes ``repo_id``; then
    :func:`~peagle_train.export.model_card.redact_local_paths` removes every local path, home
    folder and token left.
    """
    root = Path(path)
    if not (root / README_FILE).is_file():
        return None
    text = (root / README_FILE).read_text()
    local_refs = {str(root.absolute()), str(root.resolve())}
    src_file = root / CARD_SOURCE_FILE
    if src_file.is_file():
        try:
            src = json.loads(src_file.read_text())
            old = serve_section(src["target_ref"], src["target_name"], src["drafter_ref"], src["drafter_on_hub"],
                                src["K"], src["parallel_drafting"])
            target = src.get("target_hub_id") or TARGET_PLACEHOLDER
            new = serve_section(target, src["target_name"], repo_id, True, src["K"], src["parallel_drafting"])
            text = text.replace("\n".join(old), "\n".join(new))
            if src["drafter_ref"]:
                local_refs.add(src["drafter_ref"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a hand-edited source: fall back to replacing the folder and redacting
    for ref in sorted(local_refs, key=len, reverse=True):
        text = text.replace(ref, repo_id)
    return redact_local_paths(text)


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def push_to_hub(
    path: str | Path,
    repo_id: str,
    *,
    private: bool = True,
    dry_run: bool = False,
    token_env: str = "HF_TOKEN",
    commit_message: str = "Upload P-EAGLE drafter (peagle_train)",
) -> list[str]:
    """Upload an export directory to the model repo ``repo_id``.

    Steps: (1) refuse a malformed ``repo_id`` and a directory that fails the contract check;
    (2) list the files (:func:`upload_files`) and print ``relative/path  size`` for each; (3)
    unless ``dry_run``, read the token from ``$token_env``, rewrite ``README.md`` as
    :func:`hub_readme` (serve command with ``repo_id``, no local paths), call
    ``HfApi.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)``
    and ``HfApi.upload_folder`` with exactly those files (``allow_patterns``). A failing
    Hub call is re-raised as :class:`HubPushError` with the token blanked out.

    Args:
        path: export directory (from :func:`peagle_train.export.writer.export_vllm`).
        repo_id: ``"owner/name"``.
        private: create the repo private (default True; an existing repo keeps its visibility).
        dry_run: only list and print the files; no token needed, no network.
        token_env: environment variable holding the Hub token.
        commit_message: the upload commit's message.

    Returns:
        The relative paths uploaded (or that would be uploaded), sorted.

    Raises:
        ExportCheckError: the directory fails the vLLM contract check.
        HubPushError: not a directory, nothing to upload, malformed ``repo_id``,
            (not dry run) ``$token_env`` unset, or the Hub refused the upload.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    root = Path(path)
    if not root.is_dir():
        raise HubPushError(f"'{root}' is not a directory; export first with peagle_train.export.writer.export_vllm")
    try:
        if repo_id.count("/") != 1 or not all(repo_id.split("/")):
            raise HFValidationError("one '/' between a non-empty owner and name")
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubPushError(f"repo_id must look like 'owner/name' (letters, digits, '-', '_', '.'; got "
                           f"{repo_id!r}: {e})") from None
    problems = check_export(root)
    if problems:
        raise ExportCheckError(root, problems)
    files = upload_files(root)
    if not files:
        raise HubPushError(f"'{root}' has no files to upload")
    token = None if dry_run else os.environ.get(token_env)
    if not dry_run and not token:
        raise HubPushError(f"environment variable {token_env} is not set; put a Hub write token there "
                           f"(or use dry_run=True to only list the files)")
    verb = "would upload" if dry_run else "uploading"
    print(f"{verb} {len(files)} files to {repo_id} ({'private' if private else 'public'}):")
    for rel, size in files:
        print(f"  {rel}  {_human(size)}")
    names = [rel for rel, _ in files]
    if README_FILE in names:
        print(f"  ({README_FILE} is published with the serve command naming {repo_id} and no local paths)")
    if dry_run:
        return names
    from huggingface_hub import HfApi

    readme = hub_readme(root, repo_id)
    if readme is not None and readme != (root / README_FILE).read_text():
        tmp = root / f".{README_FILE}.tmp{os.getpid()}"
        tmp.write_text(readme)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, root / README_FILE)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(root), repo_id=repo_id, repo_type="model", commit_message=commit_message,
                          allow_patterns=[glob.escape(n) for n in names])
    except Exception as e:  # noqa: BLE001 - any Hub failure: one clear message, the token blanked out
        msg = f"{type(e).__name__}: {e}".replace(token, "<token>")
        raise HubPushError(f"the Hub refused the upload to {repo_id}: {msg}") from None
    print(f"pushed to https://huggingface.co/{repo_id}")
    return names


__all__ = ["HubPushError", "hub_readme", "push_to_hub", "upload_files"]
