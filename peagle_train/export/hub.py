"""Push an exported drafter directory to the Hugging Face Hub.

The directory must pass the vLLM contract check first
(:func:`peagle_train.export.check.check_export`): a checkpoint that vLLM would reject,
or load with uninitialised weights, is never published. The token is read from
an environment variable and handed to ``huggingface_hub.HfApi`` only; it is
never printed, logged or put in an exception message.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from peagle_train.export.check import ExportCheckError, check_export


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

    Steps: (1) refuse a directory that fails the contract check; (2) list the
    files (:func:`upload_files`) and print ``relative/path  size`` for each; (3)
    unless ``dry_run``, read the token from ``$token_env``, call
    ``HfApi.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)``
    and ``HfApi.upload_folder`` with exactly those files (``allow_patterns``).

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
            or (not dry run) ``$token_env`` unset.
    """
    root = Path(path)
    if not root.is_dir():
        raise HubPushError(f"'{root}' is not a directory; export first with peagle_train.export.writer.export_vllm")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise HubPushError(f"repo_id must look like 'owner/name' (got {repo_id!r})")
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
    if dry_run:
        return names
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    api.upload_folder(folder_path=str(root), repo_id=repo_id, repo_type="model", commit_message=commit_message,
                      allow_patterns=[glob.escape(n) for n in names])
    print(f"pushed to https://huggingface.co/{repo_id}")
    return names


__all__ = ["HubPushError", "push_to_hub", "upload_files"]
