"""The on-disk format: a checkpoint's file names, and how its tensors and metadata are
encoded (safetensors and JSON), behind one ``Writer`` and one ``Reader``.

A checkpoint is a folder::

    CKPT/
      checkpoint.json          metadata; replacing it is the commit point
      data-<id>/
        rank-00000-of-00002.safetensors   rank 0's parameter and optimizer pieces, RNG
        rank-00001-of-00002.safetensors
        buffers.safetensors               every buffer, checked identical across ranks

This module is the only one that imports safetensors or parses a file's header. Save,
verify, load and consolidation write and read data files through :class:`Writer` and
:class:`Reader`, and the metadata through :func:`write_metadata` and
:func:`read_metadata`; what the tensors inside are called is _names.py's, and the order
in which a save writes and commits is save.py's (Note [atomic save], Note [save
protocol]). The weights folders ``load_pretrained`` reads and ``consolidate`` writes
(Hugging Face's layout) are safetensors by their own definition, not by shardwise's: they
go through the same ``Reader`` and ``Writer`` (``export=True``), since reading and writing
them is the same code.

Note [a new format]
A new checkpoint format (another container for the tensors, another encoding of the
metadata) is a new ``Writer`` and a new ``Reader`` in this module, and no other module
changes. With them go this module's few other facts about the files: their names
(``rank_file``, ``BUFFERS_FILE``, ``META``), the dtypes a file can store (``STORABLE``,
``type_code``), how a save's file is recognised before it is removed (``own_data_file``),
and how the metadata is written and parsed (``write_metadata``, ``parse_metadata``).
What the new ``Writer`` and ``Reader`` must still do:

- ``Writer``: one data file written a tensor at a time in an order fixed up front, to a
  temporary name, fsynced and renamed by ``finish`` (``before_rename`` runs just before:
  it is the ``data-tmp`` step of Note [save protocol], whose crash-point test must keep
  passing), which returns the file's size and SHA-256; ``abort`` removes the temporary
  file. A data file records the pieces it holds, so that metadata claiming others is
  caught (Note [metadata that cannot lie] in _schema.py), and carries a mark saying it
  is shardwise's (``own_data_file``).
- ``Reader``: one data file, opened only after its size and SHA-256 match the metadata's
  record, and kept open (a save removing its folder later cannot take it away); its keys,
  each tensor's stored type and shape, the pieces it records; a whole tensor, or any
  range of a flattened tensor, read into memory the caller owns with plain reads, not
  through a memory map (Note [streamed load] in load.py).

The save protocol and its crash points (save.py), the metadata's schema and the checks
against the files (_schema.py, verify.py), the names of the tensors (_names.py) and the
atomic writes (_files.py) stay as they are. Exports and pretrained sources stay
safetensors: a new format would keep today's classes for them, beside its own. What
reads the files without shardwise (tests/test_checkpoint.py's ``_Saved``, the format-1
fixture of tests/fixtures/v1_checkpoint) and docs/checkpoints.md describe the format too.
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
from typing import IO, Any

import safetensors.torch
import torch
from safetensors import safe_open

from .._fs import kind, open_dir, read_head, remove_empty_dir, remove_own_files, unlink_own
from ..errors import ShardwiseError
from ._files import (
    create_temporary,
    file_problem,
    final_name,
    fsync_dir,
    read_json,
    temporary_name,
    write_atomic,
    write_json_atomic,
)

FORMAT = "shardwise-checkpoint"
# 2: each rank's data file records the pieces it holds (its header's "pieces").
FORMAT_VERSION = 2
META = "checkpoint.json"
BUFFERS_FILE = "buffers.safetensors"
DATA_PREFIX = "data-"
DATA_DIR = re.compile(r"data-[0-9a-f]{1,64}")  # a save's data folder (a random id)
_PIECES = "pieces"  # a rank file's header entry: {parameter: [offset, count]}
_EXPORT = "pt"  # the header mark of a file for other tools (what transformers expects)
_RANK_FILE = re.compile(r"rank-\d{5,}-of-\d{5,}\.safetensors")

# The dtypes a data file can store, by their safetensors names.
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_FP8 = {getattr(torch, n): s for n, s in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"))
        if hasattr(torch, n)}
_CODES.update(_FP8)
_DTYPE_OF = {code: dtype for dtype, code in _CODES.items()}
STORABLE = tuple(_CODES)


def type_code(dtype: torch.dtype) -> str:
    """How a data file names ``dtype`` (what :meth:`Reader.stored` says of a tensor)."""
    return _CODES[dtype]


# -- names --------------------------------------------------------------------------------

def rank_file(rank: int, world_size: int) -> str:
    """The name of rank ``rank``'s data file in a save by ``world_size`` ranks."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def data_folder(data_id: str) -> str:
    """The name of a save's data folder."""
    return f"{DATA_PREFIX}{data_id}"


def checkpoint_entry(name: str) -> bool:
    """Whether ``name``, directly in a checkpoint folder, is the metadata or a data
    folder (nothing else must be written over it; the lock is _lock.py's)."""
    return name == META or name.startswith(DATA_PREFIX)


# -- the metadata -------------------------------------------------------------------------

def metadata_path(folder: str) -> str:
    return os.path.join(folder, META)


def has_metadata(folder: str) -> bool:
    """Whether ``folder`` holds a committed checkpoint's metadata (a save that did not
    finish has none: it is written last)."""
    return os.path.isfile(metadata_path(folder))


def read_metadata_bytes(folder: str) -> bytes:
    """``checkpoint.json`` as it is on disk (ranks compare its hash).

    Raises:
        OSError: it cannot be read.
    """
    with open(metadata_path(folder), "rb") as f:
        return f.read()


def parse_metadata(raw: bytes) -> Any:
    """The metadata in ``raw`` (:func:`read_metadata_bytes`), not yet validated.

    Raises:
        ValueError: it does not parse.
    """
    return json.loads(raw)


def read_metadata(folder: str) -> Any:
    """``folder``'s metadata, parsed, not validated (verify.py validates it).

    Raises:
        OSError, ValueError: none, or unreadable.
    """
    return read_json(metadata_path(folder))


def write_metadata(folder: str, meta: dict[str, Any],
                   before_rename: Callable[[], None] | None = None) -> None:
    """Replace ``folder``'s metadata atomically: from then on it is the checkpoint
    (``before_rename`` runs once the new file is complete, under its temporary name)."""
    write_json_atomic(metadata_path(folder), meta, before_rename)


# -- data files ---------------------------------------------------------------------------

class Writer:
    """Writes a file of named tensors one tensor at a time, so memory stays at one tensor.

    The header (names, dtypes, shapes, offsets) is known up front from ``entries``;
    tensors must then be written in that order. The file is written under a temporary
    name and renamed by :meth:`finish`, which returns its size and SHA-256.

    Args:
        path: the file.
        entries: ``(name, dtype, shape)`` of every tensor, in the order of the writes.
        pieces: the pieces a rank's data file holds (``{key: [offset, count]}``),
            recorded in its header (Note [metadata that cannot lie] in _schema.py).
        export: a file for other tools (``consolidate``'s output), not marked as a
            checkpoint's.

    Raises:
        ValueError: a dtype the format cannot store.
    """

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 *, pieces: dict[str, list[int]] | None = None, export: bool = False) -> None:
        metadata = {"format": _EXPORT if export else FORMAT}
        if pieces is not None:
            metadata[_PIECES] = json.dumps(pieces, separators=(",", ":"))
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        self._order = []
        for name, dtype, shape in entries:
            if dtype not in _CODES:
                raise ValueError(f"safetensors cannot store dtype {dtype} ({name})")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.path = path
        self.total_bytes = offset
        self._tmp = temporary_name(path)
        self._f = open(create_temporary(self._tmp), "wb")  # noqa: SIM115 - closed by finish()
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
        """Append the next tensor, ``name``, from wherever it lives (no copy of a
        contiguous CPU tensor)."""
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

    def finish(self, before_rename: Callable[[], None] | None = None) -> dict[str, Any]:
        """Complete the file and rename it into place (``before_rename`` runs just before);
        its size and SHA-256."""
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
        """Give up: the temporary file is removed."""
        if not self._f.closed:
            self._f.close()
        unlink_own(self._tmp)


def write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write a small data file whole (a save's buffers), copied to CPU first, atomically;
    its size and SHA-256."""
    copies = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()}
    return write_atomic(path, safetensors.torch.save(copies, metadata={"format": FORMAT}))


class Reader:
    """A file of named tensors, open for reading.

    With ``expected`` (the metadata's ``{"bytes", "sha256"}`` record of a data file), the
    file's size and SHA-256 are checked before it is opened. It stays open: a save that
    removes its folder later cannot take it away. ``read`` and ``read_into`` use plain
    reads into memory the caller owns, not a memory map: a mapped file's pages count in
    the process's resident memory for as long as it stays mapped, so a load of a disk
    tier's state, or of a model weight by weight, would hold everything it read that way
    (Note [streamed load] in load.py, Note [quantize while loading] in
    engine/groups/quantize.py). ``read_flat``, with which ``load_pretrained`` reads a rank's rows
    of a weight, goes through safetensors' slices, which map the file.

    Raises:
        ShardwiseError: the file is missing, resized or corrupt against ``expected``, or
            not a readable file of this format (naming it).
    """

    def __init__(self, path: str, expected: dict[str, Any] | None = None) -> None:
        self.path = path
        if expected is not None:
            problem = file_problem(path, expected)
            if problem:
                raise ShardwiseError(problem)
        self._f: IO[bytes] | None = None
        try:
            self._handle: Any = safe_open(path, framework="pt", device="cpu")
            self._f = open(path, "rb")  # noqa: SIM115 - kept open while the file is read
            n = int.from_bytes(self._f.read(8), "little")
            self._header: dict[str, Any] = json.loads(self._f.read(n))
        except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
            self.close()
            raise ShardwiseError(f"{path}: not a readable safetensors file ({e})") from e
        self._base = 8 + n

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def stored(self, key: str) -> tuple[str, list[int]]:
        """How the file stores ``key``: its type as the file names it (compare with
        :func:`type_code`) and its shape."""
        entry = self._header[key]
        return entry["dtype"], list(entry["shape"])

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        """The dtype ``key`` is stored in, without reading its data."""
        entry = self._header.get(key)
        dtype = _DTYPE_OF.get(entry["dtype"]) if isinstance(entry, dict) else None
        return dtype if dtype is not None else self._handle.get_tensor(key).dtype

    def records_pieces(self) -> bool:
        """Whether the header records the pieces the file holds (format 2)."""
        return _PIECES in (self._handle.metadata() or {})

    def pieces(self) -> Any:
        """The pieces the header records (``{key: [offset, count]}`` when intact).

        Raises:
            ValueError: none are recorded, or not as JSON.
        """
        try:
            return json.loads((self._handle.metadata() or {})[_PIECES])
        except KeyError as e:
            raise ValueError("no pieces recorded") from e

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""
        entry = self._header.get(key)
        dtype = _DTYPE_OF.get(entry["dtype"]) if isinstance(entry, dict) else None
        if dtype is None or entry is None:
            return self._handle.get_tensor(key)
        start, end = entry["data_offsets"]
        out = torch.empty(end - start, dtype=torch.uint8)
        self._pread(key, self._base + start, out)
        return out.view(dtype).reshape(entry["shape"])

    def read_into(self, key: str, first: int, out: torch.Tensor) -> None:
        """Elements ``[first, first + out.numel())`` of the flattened tensor ``key`` into
        ``out`` (of the tensor's dtype)."""
        start = self._base + self._header[key]["data_offsets"][0] + first * out.element_size()
        self._pread(key, start, out)

    def read_flat(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``key``, reading only the rows
        that hold them."""
        shape = self.shape(key)
        if len(shape) == 0:
            return self.read(key).reshape(-1)[lo:hi]
        return _flat_range(self._handle.get_slice(key), shape, lo, hi)

    def sample(self, nbytes: int) -> bytes:
        """A digest of the file's size, its header, and the first and last ``nbytes`` of
        its data: what tells two files apart in all likelihood, cheaply (Note [one
        source] in sources.py)."""
        assert self._f is not None
        fd = self._f.fileno()
        size = os.fstat(fd).st_size
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        header = os.pread(fd, min(n, size), 8)
        data = os.pread(fd, nbytes, 8 + len(header))
        tail = os.pread(fd, nbytes, max(8 + n, size - nbytes))
        return hashlib.sha256(str(size).encode() + header + data + tail).digest()

    def _pread(self, key: str, start: int, out: torch.Tensor) -> None:
        assert self._f is not None
        nbytes = out.numel() * out.element_size()
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(out.data_ptr()))
        done = 0
        while done < nbytes:
            got = os.preadv(self._f.fileno(), [view[done:]], start + done)
            if got <= 0:
                raise ShardwiseError(f"{self.path}: {key} is cut short (the file is "
                                     f"truncated)")
            done += got

    def close(self) -> None:
        if self._f is not None:
            self._f.close()

    def __del__(self) -> None:
        if getattr(self, "_f", None) is not None:
            self.close()


def _flat_range(rows_of, shape: Iterable[int], lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a row-major tensor of at least one dimension, reading only
    the rows that hold them. ``rows_of`` is a safetensors slice (indexable along dim 0)."""
    shape = tuple(shape)
    if hi <= lo:
        return torch.empty(0)
    row = 1
    for d in shape[1:]:
        row *= d
    r0, r1 = lo // row, -(-hi // row)
    rows = rows_of[r0:r1]
    return rows.reshape(-1)[lo - r0 * row:hi - r0 * row]


# -- what a save wrote, and so what may be removed ----------------------------------------

def own_data_file(dir_fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``dir_fd`` is a data file a save wrote: named as a
    save names them, with a header that says it is shardwise's."""
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
