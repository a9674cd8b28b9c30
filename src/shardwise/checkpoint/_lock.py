"""One writer per checkpoint folder: an advisory lock that dies with its holder.

Note [one writer]
Two jobs saving into one folder would each remove the other's data folders and commit
metadata over each other. Rank 0 of a saving job therefore holds an exclusive ``flock``
on ``CKPT/checkpoint.lock`` from before it creates its data folder until after it has
committed and tidied. The kernel releases the lock when its holder exits, however it
exits (a killed job never leaves a stale lock behind), and a second writer fails at once
with an error naming the holder, whose host, pid and start time the file records.
The file is removed on release. Removing a lock file is racy in general (a waiter may
lock the removed inode while a newcomer locks a new file), so whoever acquires it checks
that the path still names the inode it locked, and retries otherwise.
Readers take no lock: the previous checkpoint's data outlives one more save (Note
[atomic save] in _format.py), and a load retries when a save replaced the checkpoint
under it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from ..errors import ShardwiseError

LOCK = "checkpoint.lock"


class FolderLock:
    """An exclusive lock on a checkpoint folder (rank 0 of a saving job holds it)."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise at once.

        Raises:
            ShardwiseError: another process holds it (the message names the holder).
        """
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise ShardwiseError(f"cannot lock {self.path}: {e}") from e
                raise ShardwiseError(
                    f"{os.path.dirname(self.path)} is being written by another save "
                    f"({self._holder()}); two jobs must not save into one checkpoint "
                    f"folder: give each job its own path") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file we locked: lock the new one
        os.ftruncate(fd, 0)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.write(fd, json.dumps(info).encode())
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def _holder(self) -> str:
        try:
            with open(self.path) as f:
                info = json.loads(f.read() or "{}")
            return (f"held by pid {info['pid']} on host {info['host']} since "
                    f"{info['since']}")
        except (OSError, ValueError, KeyError, TypeError):
            return "held by a process that has not yet written its name"
