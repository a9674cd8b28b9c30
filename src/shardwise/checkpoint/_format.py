"""The on-disk format: a checkpoint's file names, its safetensors data files, JSON metadata.

A checkpoint is a folder::

    CKPT/
      checkpoint.json          metadata; replacing it is the commit point
      data-<id>/
        rank-00000-of-00002.safetensors   rank 0's parameter and optimizer pieces, RNG
        rank-00001-of-00002.safetensors
        buffers.safetensors               every buffer, checked identical across ranks
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._fs import kind, open_dir, read_head, remove_empty_dir, remove_own_files, unlink_own
from ._files import create_temporary, final_name, fsync_dir, temporary_name

FORMAT = "shardwise-checkpoint"
# 2: each rank's data file records the pieces it holds (its header's "pieces").
FORMAT_VERSION = 2
META = "checkpoint.json"
BUFFERS_FILE = "buffers.safetensors"
PIECES = "pieces"  # a rank file's header entry: {parameter: [offset, count]}
DATA_DIR = re.compile(r"data-[0-9a-f]{1,64}")  # a save's data folder (a random id)
_RANK_FILE = re.compile(r"rank-\d{5,}-of-\d{5,}\.safetensors")

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_FP8 = {getattr(torch, n): s for n, s in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))
        if hasattr(torch, n)}
_ST_DTYPES.update(_FP8)


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def own_data_file(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``dir_fd`` is a data file a save wrote: named as a
    save names them, with a safetensors header that says it is shardwise's."""
    final = final_name(name)
    if final != BUFFERS_FILE and _RANK_FILE.fullmatch(final) is None:
        return False
    head = read_head(name, dir_fd, 8)
    if len(head) < 8:
        return False
    n = struct.unpack("<Q", head)[0]
    if n > 1 << 28:
        return False
    try:
        header = json.loads(read_head(name, dir_fd, 8 + n)[8:])
        return header["__metadata__"]["format"] == FORMAT
    except (ValueError, KeyError, TypeError):
        return False


def own_meta_temporary(dir_fd: int, name: str) -> bool:
    """Whether ``name`` is a temporary ``checkpoint.json`` a save left behind."""
    return name != META and final_name(name) == META


def remove_data_folder(parent_fd: int, name: str, where: str) -> bool:
    """Remove the data folder ``name`` (in the folder ``parent_fd``) as shardwise wrote
    it: its data files, then the folder if nothing else is in it (Note [what shardwise
    deletes] in _fs.py). Whether it is gone."""
    if DATA_DIR.fullmatch(name) is None:
        return False
    fd = open_dir(name, parent_fd)
    if fd is None:
        return False  # a link, a file, or gone
    try:
        remove_own_files(fd, own_data_file, os.path.join(where, name))
    finally:
        os.close(fd)
    return remove_empty_dir(name, parent_fd)


def remove_checkpoint(path: str) -> bool:
    """Remove the checkpoint folder ``path`` as shardwise wrote it: its data folders,
    ``checkpoint.json`` and its temporaries and a lock nobody holds, then the folder once
    empty. Never through a link; anything else stays (Note [what shardwise deletes]).
    Whether the folder is gone."""
    from ._lock import remove_if_free

    fd = open_dir(path)
    if fd is None:
        return kind(path) is None
    try:
        # The metadata first: a removal cut short leaves an incomplete checkpoint, which
        # nothing loads, never metadata naming missing data.
        if kind(META, fd) == "file":
            os.unlink(META, dir_fd=fd)
        for name in os.listdir(fd):
            if DATA_DIR.fullmatch(name):
                remove_data_folder(fd, name, path)
        remove_if_free(fd)
        remove_own_files(fd, own_meta_temporary, path)
    finally:
        os.close(fd)
    return remove_empty_dir(path)


class SafetensorsStreamWriter:
    """Writes a safetensors file one tensor at a time, so memory stays at one tensor.

    The header (names, dtypes, shapes, offsets) is known up front from metadata; tensors
    must then be written in the order given. The file is written under a temporary name
    and renamed by :meth:`close`, which returns its size and SHA-256 (as
    :func:`write_atomic` does).
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        offset = 0
        self._order = []
        for name, dtype, shape in entries:
            if dtype not in _ST_DTYPES:
                raise ValueError(f"safetensors cannot store dtype {dtype} ({name})")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path = path
        self.total_bytes = offset
        self._tmp = temporary_name(path)
        self._f = open(create_temporary(self._tmp), "wb")  # noqa: SIM115 - closed by close()
        self._hash = hashlib.sha256()
        self._bytes = 0
        self._put(struct.pack("<Q", len(raw)))
        self._put(raw)
        self._next = 0

    def _put(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._hash.update(data)
        self._bytes += len(data)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, nbytes = self._order[self._next]
        if name != expected:
            raise ValueError(f"expected tensor {expected!r} next, got {name!r}")
        # No copy of a contiguous CPU tensor: its memory goes to the file as it is.
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if data.numel() != nbytes:
            raise ValueError(f"{name}: {data.numel()} bytes, expected {nbytes}")
        if sys.byteorder != "little":
            raise RuntimeError("writing safetensors needs a little-endian machine")
        if nbytes:
            # Through ctypes, not numpy(): numpy() marks the storage as not resizable
            # for good, and shardwise frees and refills some storages by resizing them.
            self._put(memoryview((ctypes.c_ubyte * nbytes).from_address(data.data_ptr())))
        self._next += 1

    def close(self, before_rename: Callable[[], None] | None = None) -> dict[str, Any]:
        """Finish the file and rename it into place (``before_rename`` runs just before,
        as for ``_files.write_atomic``); its size and SHA-256."""
        if self._next != len(self._order):
            self.abort()
            raise ValueError(f"only {self._next} of {len(self._order)} tensors were written")
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            if before_rename is not None:
                before_rename()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        fsync_dir(os.path.dirname(self.path) or ".")
        return {"bytes": self._bytes, "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        unlink_own(self._tmp)


def flat_range(reader_slice, shape: Iterable[int], lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a row-major tensor of at least one dimension, reading only
    the rows that hold them. ``reader_slice`` is a safetensors slice (indexable along dim 0)
    or a tensor.
    """
    shape = tuple(shape)
    if hi <= lo:
        return torch.empty(0)
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = lo // row, -(-hi // row)
    rows = reader_slice[r0:r1]
    return rows.reshape(-1)[lo - r0 * row:hi - r0 * row]
