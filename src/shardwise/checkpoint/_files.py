"""Files written atomically (a temporary name, fsync, rename) and checked by size and SHA-256.

A file is written to ``<final name>.tmp-<pid>``, created new (never through a link, never
an existing file truncated), flushed and fsynced, then renamed over its final name with
``os.replace`` and its folder fsynced: a reader sees the old file or the new one, whole.
What is written comes back as ``{"bytes": ..., "sha256": ...}``, the record a checkpoint
keeps of each data file and checks before reading it (:func:`file_problem`). A
checkpoint's data files are written this way by _format.py, and JSON files (its metadata,
Resumable's failure records, a Hugging Face index written by ``consolidate``) by
:func:`write_json_atomic`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

from .._fs import unlink_own

TMP_MARK = ".tmp-"  # temporary files are named <final name>.tmp-<pid>
_TMP = re.compile(r"(.+)" + re.escape(TMP_MARK) + r"\d+")


def temporary_name(path: str) -> str:
    """The temporary name this process writes ``path`` under."""
    return f"{path}{TMP_MARK}{os.getpid()}"


def final_name(name: str) -> str:
    """``name`` without the temporary mark of :func:`temporary_name` (if it has one)."""
    m = _TMP.fullmatch(name)
    return m.group(1) if m else name


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_temporary(tmp: str) -> int:
    """Create ``tmp`` (a ``<name>.tmp-<pid>`` of ours) for writing, as a new file: never
    opened through a link, never an existing file truncated (a link or a hard link of
    that name would have made the write land in, or truncate, a file shardwise did not
    write). A name left there by a dead process of the same pid is replaced: it is
    removed, which removes only the name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(tmp, flags, 0o644)
    except FileExistsError:
        os.unlink(tmp)
        return os.open(tmp, flags, 0o644)


def write_atomic(path: str, data: bytes,
                 before_rename: Callable[[], None] | None = None) -> dict[str, Any]:
    """Write ``data`` to ``path`` through a temporary file; return its size and SHA-256.

    ``before_rename`` runs once the temporary file is complete (a point of the save
    protocol, Note [save protocol] in save.py)."""
    tmp = temporary_name(path)
    fd = create_temporary(tmp)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if before_rename is not None:
            before_rename()
        os.replace(tmp, path)
    except BaseException:
        # A full disk must not stay full of our own debris.
        unlink_own(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_json_atomic(path: str, obj: Any,
                      before_rename: Callable[[], None] | None = None) -> None:
    write_atomic(path, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode(),
                 before_rename)


def read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def sha256_file(path: str, chunk: int = 1 << 24) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def file_problem(path: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with ``path`` against its record ``{"bytes", "sha256"}``, for a
    message, or None when it is intact."""
    if not os.path.isfile(path):
        return f"{path}: missing"
    try:
        size, digest = sha256_file(path)
    except FileNotFoundError:
        # A save with keep_previous=False removed it since the line above: a load sees
        # the checkpoint replaced and starts again (Note [save protocol] in save.py).
        return f"{path}: missing"
    except OSError as e:
        return f"{path}: unreadable ({e})"
    if size != expected["bytes"]:
        return f"{path}: truncated or resized ({size} bytes, expected {expected['bytes']})"
    if digest != expected["sha256"]:
        return f"{path}: corrupt (SHA-256 does not match the checkpoint metadata)"
    return None
