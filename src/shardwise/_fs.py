"""Deleting files: only names shardwise can prove are its own, never through a link.

Note [what shardwise deletes]
Every deletion in shardwise goes through this module (but one: ``shardwise demo``
removes the folder it created itself for a run that then failed). A folder shardwise
deletes from is opened once, with ``O_NOFOLLOW | O_DIRECTORY``, and every later step
names entries relative to that descriptor (``dir_fd=``), so a path that is a symbolic
link, or that is swapped for one half-way, is never followed: a link in the run folder,
the checkpoint folder or the offload folder leads nowhere. In the folder, only regular
files the caller recognises as its own are removed (``rank-00001-of-00002.safetensors``
with a shardwise header, a failure record ``rank3-4711.json`` that parses as one); a
link or a folder of that name, and every other file, stays. A folder is removed only
once it is empty, with ``rmdir``, which never removes anything else. So a folder of
someone else's files that happens to sit where shardwise deletes loses nothing, and what
shardwise leaves behind is named at debug level. docs/reliability.md lists each place,
and tests/test_safety.py points every one of them at a link and at a folder of foreign
files.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

from ._log import logger

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def open_dir(path: str, dir_fd: int | None = None) -> int | None:
    """A descriptor of the folder ``path`` itself (relative to ``dir_fd`` if given), or
    None when it is missing, a symbolic link, or not a folder."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EACCES, errno.EPERM):
            return None
        raise


def kind(path: str, dir_fd: int | None = None) -> str | None:
    """``"link"``, ``"dir"``, ``"file"`` or ``"other"`` for ``path`` itself (no link
    followed), or None when nothing has that name."""
    try:
        mode = os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        return "dir"
    return "file" if stat.S_ISREG(mode) else "other"


def remove_own_files(dir_fd: int, own: Callable[[int, str], bool], where: str) -> list[str]:
    """Remove the regular files of the folder ``dir_fd`` that ``own(dir_fd, name)``
    recognises; return the names left there (others' files, links, folders). ``where``
    names the folder in the debug log."""
    left = []
    for name in os.listdir(dir_fd):
        if kind(name, dir_fd) == "file" and own(dir_fd, name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
        else:
            left.append(name)
    if left:
        logger.debug("%s: left %d entries shardwise did not write: %s", where, len(left),
                     ", ".join(sorted(left)[:10]))
    return left


def read_head(name: str, dir_fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from the start of the regular file ``name`` in the folder
    ``dir_fd``, never through a link (b"" if it cannot be read)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     dir_fd=dir_fd)
    except OSError:
        return b""
    try:
        return os.pread(fd, limit, 0)
    except OSError:
        return b""
    finally:
        os.close(fd)


def remove_empty_dir(name: str, dir_fd: int | None = None) -> bool:
    """Remove the folder ``name`` if it is empty (``rmdir``: never a link, never a file,
    never a folder with anything in it); whether it is gone."""
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def unlink_own(path: str, inode: int | None = None) -> bool:
    """Remove the regular file ``path`` (never a link's target, never a folder); with
    ``inode``, only if ``path`` still names that file. Whether it was removed."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or (inode is not None and st.st_ino != inode):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
