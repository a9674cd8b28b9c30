"""The disk tier: a folder per rank, and buffers that are shared file mappings.

Note [the disk tier] in engine/offload/__init__.py says why the files are unlinked as soon
as they are mapped, and how memory stays bounded.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import threading

import torch

from ...errors import ShardwiseError

_PAGE = mmap.PAGESIZE
_held: dict[str, DiskFolder] = {}  # this process's folders, by real path
_lock = threading.Lock()


class DiskBuffer:
    """``numel`` elements of ``dtype`` in a file of their own, viewed by ``tensor``."""

    def __init__(self, mapping: mmap.mmap, tensor: torch.Tensor, nbytes: int) -> None:
        self._map = mapping
        self.tensor = tensor
        self.nbytes = nbytes

    def release(self) -> None:
        """Drop the pages from this process (the page cache keeps what was written)."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def prefetch(self) -> None:
        """Start reading the file into the page cache without waiting."""
        self._map.madvise(mmap.MADV_WILLNEED)


class DiskFolder:
    """A rank's offload folder, held with an exclusive lock for the life of the process.

    Files left by an earlier process (one killed between creating and unlinking a file)
    are removed when the folder is taken; they are never read.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes = 0  # reserved by this process's buffers, live or not
        self._count = 0
        try:
            os.makedirs(path, exist_ok=True)
            self._fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ShardwiseError(f"offload folder {path}: cannot be created or written "
                                 f"({e.strerror}); pass a folder= on a local disk this user "
                                 f"can write") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            raise ShardwiseError(f"offload folder {path} is in use by another process (a job "
                                 f"still running, or another rank given the same folder on "
                                 f"the same machine with the same rank); give each job its "
                                 f"own folder") from e
        for name in os.listdir(path):
            if name.endswith(".bin"):
                os.unlink(os.path.join(path, name))
        _raise_file_limit()

    @classmethod
    def for_rank(cls, folder: str, rank: int) -> DiskFolder:
        """The folder ``<folder>/rank<rank>``, shared by this process's sharded models."""
        path = os.path.join(os.path.realpath(folder), f"rank{rank}")
        with _lock:
            if path not in _held:
                _held[path] = cls(path)
            return _held[path]

    def buffer(self, numel: int, dtype: torch.dtype, what: str) -> DiskBuffer:
        """A new zeroed buffer, its space reserved on the disk now.

        Raises:
            ShardwiseError: when the disk has no room for it, with the sizes.
        """
        nbytes = max(numel * torch.empty((), dtype=dtype).element_size(), 1)
        with _lock:
            self._count += 1
            name = os.path.join(self.path, f"{self._count:07d}-{what}.bin")
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                free = os.statvfs(self.path)
                raise ShardwiseError(
                    f"offload folder {self.path}: no room for {nbytes / 2**20:.1f} MiB more "
                    f"({free.f_bavail * free.f_frsize / 2**20:.1f} MiB free, "
                    f"{self.bytes / 2**20:.1f} MiB already used by this rank). Free space or "
                    f"choose a larger disk (`shardwise plan` gives the bytes per "
                    f"tier)") from e
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            os.unlink(name)
        self.bytes += nbytes
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel) if numel else \
            torch.empty(0, dtype=dtype)
        return DiskBuffer(mapping, tensor, nbytes)


def _raise_file_limit() -> None:
    """Each mapping keeps a file descriptor open (Python's mmap duplicates it): a deep
    model has a few per unit. Raise the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
