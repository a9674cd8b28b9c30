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
that the path still names the inode it locked, and retries otherwise. A holder killed
before its release leaves the file behind, unlocked; it never blocks a later writer of
the same user, who locks it as it is. Another user may not open it for writing, but
may lock it read-only: finding it unlocked, it removes the stale file (which needs only
the right to write the folder) and creates its own. A name that is not a regular file,
or a file the OS will not let go, is refused naming it, its owner and what to do.
Readers take no lock: the previous checkpoint's data outlives one more save (Note
[atomic save] in save.py), and a load retries when a save replaced the checkpoint
under it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time

from .._fs import unlink_own
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
            ShardwiseError: another process holds it (the message names the holder), or
                the lock file cannot be taken over (naming it, its owner, what to do).
        """
        while True:
            fd = self._open()
            if fd is None:
                continue  # a stale file was removed, or another writer was quicker
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise self._refused(e) from e
                raise self._held() from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file we locked: lock the new one
        if not _ours(fd):
            os.close(fd)
            raise self._foreign()
        os.ftruncate(fd, 0)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.write(fd, json.dumps(info).encode())
        self._fd = fd

    def _open(self) -> int | None:
        """The lock file, opened for writing (created if absent); ``None`` to try again.

        A file left by a save that died belongs to its user: another user who may write
        the folder cannot open it for writing, but can lock it read-only to learn that
        nobody holds it, and then remove it (Note [one writer])."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        except OSError as e:  # the folder cannot be searched
            raise self._refused(e) from e
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise ShardwiseError(
                f"{self.path} is not a regular file ({_kind(st.st_mode)}), and shardwise "
                f"uses that name for its lock. Remove it (rm {self.path}) or save into "
                f"another folder")
        if st is not None and st.st_nlink > 1:
            raise self._foreign()  # a hard link: writing the lock would write that file
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except PermissionError as e:
            self._take_over(e)
            return None
        except OSError as e:
            raise self._refused(e) from e

    def _take_over(self, denied: OSError) -> None:
        """Remove another user's lock file if nobody holds it; raise otherwise."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return  # its holder released it meanwhile
        except OSError as e:
            raise self._refused(e) from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                    raise self._held() from None
                raise self._refused(e) from e
            if not _ours(fd):
                raise self._foreign()
            try:
                os.unlink(self.path)  # its writer died: the lock is stale
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._refused(e) from denied
        finally:
            os.close(fd)

    def _held(self) -> ShardwiseError:
        return ShardwiseError(
            f"{os.path.dirname(self.path)} is being written by another save "
            f"({self._holder()}); two jobs must not save into one checkpoint "
            f"folder: give each job its own path")

    def _foreign(self) -> ShardwiseError:
        return ShardwiseError(
            f"{self.path} is not a lock file shardwise wrote (it holds other data, or is "
            f"a hard link to another file), and shardwise uses that name for its lock, "
            f"which it overwrites and deletes. Move that file away, or save into another "
            f"folder")

    def _refused(self, err: OSError) -> ShardwiseError:
        """The OS refused the lock file: say whose it is and what to do."""
        try:
            uid = os.lstat(self.path).st_uid
            owner = f"owned by {_user(uid)}"
        except OSError:
            owner = "whose owner cannot be read"
        return ShardwiseError(
            f"cannot take the checkpoint lock {self.path} ({owner}): "
            f"{err.strerror or err}. A save that died leaves this file behind, and no "
            f"save of yours can run while it is there: if no save by its owner is running, "
            f"remove it (rm {self.path}), or ask its owner to; or save into a folder of "
            f"your own")

    def release(self) -> None:
        """Remove the lock file and release the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            # Only the file locked: a name replaced meanwhile (by a link, another file)
            # is not ours to remove.
            unlink_own(self.path, inode=os.fstat(self._fd).st_ino)
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


def _ours(fd: int) -> bool:
    """Whether the open lock file holds what :meth:`FolderLock.acquire` writes (or
    nothing: a holder killed before writing it), so that taking it over destroys
    nothing of anyone else's."""
    raw = os.pread(fd, 4097, 0)
    if not raw:
        return True
    try:
        info = json.loads(raw)
    except ValueError:
        return False
    return isinstance(info, dict) and set(info) <= {"host", "pid", "since"}


def remove_if_free(dir_fd: int) -> None:
    """Remove the lock file of the folder ``dir_fd`` if nobody holds it and shardwise
    wrote it (a removal of a whole checkpoint folder: Note [what shardwise deletes])."""
    try:
        fd = os.open(LOCK, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return  # none, a link, or not ours to open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_nlink > 1:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # held: a save is running
        if _ours(fd) and os.stat(LOCK, dir_fd=dir_fd, follow_symlinks=False).st_ino == \
                os.fstat(fd).st_ino:
            os.unlink(LOCK, dir_fd=dir_fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"
