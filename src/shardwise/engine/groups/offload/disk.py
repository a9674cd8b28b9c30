"""The disk tier: a folder per rank, and buffers that are shared file mappings.

Note [the disk tier] in engine/groups/offload/__init__.py says why the files are unlinked as soon
as they are mapped, and how memory stays bounded.

Note [tier files changed from outside]
A tier file is unlinked once mapped, so only the process's own descriptors reach it:
``/proc/<pid>/fd/N``, to the process's user (or root). Through one, another program can
write into the file, and the rank trains on what it wrote, or truncate it, and the next
touch of a page past the new end killed the rank with SIGBUS. Truncation is checked: each
buffer compares its file's size with its own (``mmap.size()``, one ``fstat``) before the
storage reads or writes it for a gather, a reduction, a publication or an optimizer
step, and a short file raises a ``ShardwiseError`` naming it. (A truncation between that
check and the access still kills the rank.) Writes are not checked: a checksum of every
page would read each tier file once more per step, as many bytes as the step itself
reads from it (measured: ``zlib.crc32`` at 2.0 GB/s on the 2-core CI machine, slower than
the copies it would guard), far above the 2% of a step such a guard may cost.
Protecting the process's descriptors is the operating system's part: a user who can
write to ``/proc/<pid>/fd`` can also attach a debugger.

Note [writes that read nothing]
A store through a mapping into a page that is not in the page cache first reads that
page from the disk, even when every byte of it is about to be overwritten: the kernel
cannot know. Reduced rows overwrite their whole gradients' file (Note [reduced rows
written once] in engine/groups/offload/storage.py), and by the time they do, a model
larger than the page cache has long evicted last step's gradients, so writing them
through the mapping read a shard's worth of old gradients a step for nothing (measured
with a cold cache, benchmarks/offload.py --compare: a quarter of the step's disk reads).
The gradients' buffer keeps its file open and is written with ``pwrite``, which
overwrites whole pages without reading them and goes to the same page cache the mapping
views, so the values are the same bytes either way. Only that buffer keeps a
descriptor (one more per trainable group), closed with it.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import resource
import threading
import weakref

import torch

from ...._fs import kind, open_dir, remove_own_files
from ....errors import ShardwiseError

_PAGE = mmap.PAGESIZE
_LOCK = ".lock"
_SIGNATURE = b"shardwise offload folder\n"  # in .lock: shardwise made this folder
_OWN = re.compile(r"\d{7}-[A-Za-z0-9_.-]*\.bin")  # a buffer's file (never another's)
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_WHAT = {"link": "a symbolic link", "file": "a file", "other": "not a folder"}
_held: dict[str, DiskFolder] = {}  # this process's folders, by real path
_lock = threading.Lock()


class DiskBuffer:
    """``numel`` elements of ``dtype`` in a file of their own, viewed by ``tensor``."""

    def __init__(self, mapping: mmap.mmap | None, tensor: torch.Tensor, nbytes: int,
                 what: str = "", fd: int | None = None) -> None:
        self._map = mapping  # None: no elements, no file
        self.tensor = tensor
        self.nbytes = nbytes
        self.what = what
        self._fd = fd  # kept open for write() (Note [writes that read nothing])
        if fd is not None:
            weakref.finalize(self, os.close, fd)

    def write(self, data: torch.Tensor) -> None:
        """Put ``data`` (a CPU tensor of the buffer's dtype) at the start of the file
        with ``pwrite``, not through the mapping (Note [writes that read nothing])."""
        assert data.dtype == self.tensor.dtype and data.device.type == "cpu"
        if self._fd is None or data.numel() == 0:
            with torch.no_grad():
                self.tensor[:data.numel()].copy_(data.reshape(-1))
            return
        raw = memoryview(data.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                         .data)
        done = 0
        while done < len(raw):
            done += os.pwrite(self._fd, raw[done:], done)

    def check(self) -> None:
        """Raise if the file under the mapping was cut shorter than the buffer (Note [tier
        files changed from outside]): touching the missing pages would kill the process
        with SIGBUS."""
        if self._map is not None and self._map.size() < self.nbytes:
            raise ShardwiseError(
                f"the offload file holding {self.what} was truncated from outside "
                f"shardwise ({self._map.size()} of its {self.nbytes} bytes left), through "
                f"/proc/<pid>/fd: its contents are lost. Restart from the last checkpoint "
                f"(Note [tier files changed from outside] in engine/groups/offload/disk.py)")

    def release(self) -> None:
        """Drop the pages from this process (the page cache keeps what was written)."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def prefetch(self) -> None:
        """Start reading the file into the page cache without waiting."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_WILLNEED)


class DiskFolder:
    """A rank's offload folder, held with an exclusive lock for the life of the process.

    The folder is shardwise's own: made by it (its ``.lock`` file says so), never a
    link, so that removing the files an earlier process left (one killed between creating
    and unlinking a file) removes nothing else; they are never read. A folder of that
    name that shardwise did not make is refused, naming what is in it (Note [what
    shardwise deletes] in _fs.py).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes = 0  # reserved by this process's buffers, live or not
        self._count = 0
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            try:
                os.mkdir(path, 0o700)
                made = True
            except FileExistsError:
                made = False
            found = kind(path)
            if found != "dir":
                raise ShardwiseError(
                    f"offload folder {path} is {_WHAT.get(found or '', 'gone')}: shardwise "
                    f"keeps its files in a folder of its own, never through a link, since "
                    f"it deletes the files it left there. Remove it, or give another "
                    f"folder=")
            self._dir = open_dir(path)
            if self._dir is None:
                raise ShardwiseError(f"offload folder {path}: cannot be opened as a folder; "
                                     f"give another folder=")
            if not made:
                self._check_ours()
            self._fd = os.open(_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600,
                               dir_fd=self._dir)
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
        if os.pread(self._fd, len(_SIGNATURE), 0) != _SIGNATURE:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, _SIGNATURE, 0)
        remove_own_files(self._dir, lambda _, n: _OWN.fullmatch(n) is not None, path)
        _raise_file_limit()

    def _check_ours(self) -> None:
        """The folder existed: take it only if shardwise made it (its lock file carries
        the signature), or it is empty, or holds only an older shardwise's empty lock."""
        assert self._dir is not None
        entries = os.listdir(self._dir)
        if _LOCK in entries and kind(_LOCK, self._dir) == "file":
            fd = os.open(_LOCK, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self._dir)
            try:
                head = os.pread(fd, len(_SIGNATURE) + 1, 0)
            finally:
                os.close(fd)
            if head == _SIGNATURE or (not head and entries == [_LOCK]):
                return
        elif not entries:
            return
        os.close(self._dir)
        shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
        raise ShardwiseError(
            f"offload folder {self.path} exists and was not made by shardwise ({shown}); "
            f"shardwise keeps its files in a folder of its own and deletes the ones it "
            f"left there, so it never uses one that holds other files. Give a folder= "
            f"whose rank<r> folder does not exist yet, or empty this one")

    @classmethod
    def for_rank(cls, folder: str, rank: int) -> DiskFolder:
        """The folder ``<folder>/rank<rank>``, shared by this process's sharded models."""
        path = os.path.join(os.path.realpath(folder), f"rank{rank}")
        with _lock:
            if path not in _held:
                _held[path] = cls(path)
            return _held[path]

    def buffer(self, numel: int, dtype: torch.dtype, what: str,
               writes: bool = False) -> DiskBuffer:
        """A new zeroed buffer, its space reserved on the disk now; ``writes``: it keeps
        its file open for :meth:`DiskBuffer.write`.

        Raises:
            ShardwiseError: when the disk has no room for it, with the sizes.
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            # A rank may hold no rows of a group: no file (which would still take a block
            # of a disk that may be full, and fail for nothing).
            return DiskBuffer(None, torch.empty(0, dtype=dtype), 0)
        with _lock:
            self._count += 1
            name = f"{self._count:07d}-{_UNSAFE.sub('_', what)}.bin"
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=self._dir)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ShardwiseError(self._no_room(nbytes, what, e.errno)) from e
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(name, dir_fd=self._dir)
        if not writes:
            os.close(fd)
        self.bytes += nbytes
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel) if numel else \
            torch.empty(0, dtype=dtype)
        return DiskBuffer(mapping, tensor, nbytes, what, fd if writes else None)


    def _no_room(self, nbytes: int, what: str, code: int | None) -> str:
        """Why the disk refused ``nbytes``, in sizes that never round to nothing (a small
        buffer on a full disk once said "no room for 0.0 MiB")."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        # The disk hands out whole blocks: what this buffer takes there.
        need = -(-nbytes // st.f_frsize) * st.f_frsize if st.f_frsize else nbytes
        if code == errno.EDQUOT:
            cause = "this user's disk quota is used up"
        elif st.f_files and st.f_favail == 0:
            cause = "the disk has no free inodes (files) left"
        elif free < need:
            cause = f"the disk is full: {_size(free)} free"
        else:
            cause = (f"the disk reports {_size(free)} free but refused the space (space "
                     f"reserved for root, or a quota)")
        return (f"offload folder {self.path}: no room for this rank's {what} buffer "
                f"({_size(nbytes)}, {_size(need)} on the disk): {cause}. This rank's "
                f"buffers already take {_size(self.bytes)} there, and more follow (the "
                f"gradients and optimizer state are made at first use): `shardwise plan "
                f"--model ... --offload ...` gives the bytes per rank. Free space or give a "
                f"folder= on a larger disk")


def _size(n: int) -> str:
    """``n`` bytes for a message: exact below 1 KiB, else 3 significant digits."""
    if n < 1024:
        return f"{n} bytes"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"  # unreachable


def _raise_file_limit() -> None:
    """Each mapping keeps a file descriptor open (Python's mmap duplicates it): a deep
    model has a few per unit. Raise the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
