"""Reading a checkpoint folder verified, checking it, and ``sign_checkpoint``.

``VerifiedCheckpoint`` is the one way into a checkpoint folder's data: load.py,
consolidation.py and ``sign_checkpoint`` read through it (Note [metadata that cannot
lie] in _schema.py says what is checked).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from ..errors import ShardwiseError
from ._format import (
    BUFFERS_FILE,
    META,
    Reader,
    has_metadata,
    metadata_path,
    parse_metadata,
    rank_file,
    read_metadata_bytes,
    type_code,
    write_metadata,
)
from ._lock import FolderLock
from ._messages import summary
from ._names import (
    RNG_CUDA,
    RNG_PREFIX,
    RNG_TORCH,
    SUBCLASSES,
    dtype_from_name,
    inner_key,
    optim_key,
    param_key,
)
from ._paths import inside, path_argument
from ._schema import CHECKSUM, canonical_sha256, validate


def no_checkpoint(path: str) -> str:
    """Why ``path`` holds no checkpoint, for a message: a path that does not exist (a
    typo), a file, or a folder without ``checkpoint.json`` (another folder, a save that
    never finished: the metadata is written last), naming the checkpoints inside it."""
    if not os.path.lexists(path):
        parent = os.path.dirname(os.path.abspath(path))
        near = ""
        if os.path.isdir(parent):
            import difflib

            close = difflib.get_close_matches(os.path.basename(os.path.abspath(path)),
                                              sorted(os.listdir(parent)), n=3)
            near = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        where = "" if os.path.isdir(parent) else f" (nor its parent, {parent!r})"
        cwd = "" if os.path.isabs(path) else f" (relative to {os.getcwd()!r})"
        return f"{path}: no such checkpoint folder{where}: check the path{cwd}{near}"
    if not os.path.exists(path):
        return (f"{path}: a symbolic link that leads nowhere (a loop, or a missing target), "
                f"not a checkpoint folder")
    if not os.path.isdir(path):
        return (f"{path}: a file, not a checkpoint folder (a checkpoint is the folder "
                f"sw.save_checkpoint wrote, holding {META})")
    try:
        inside = sorted(e for e in os.listdir(path) if has_metadata(os.path.join(path, e)))
    except OSError:
        inside = []
    if inside:
        shown = ", ".join(repr(e) for e in inside[-3:])
        return (f"{path}: a folder without {META}, not a checkpoint itself; it holds "
                f"checkpoints ({len(inside)}, the last by name: {shown}): pass one of them")
    return (f"{path}: a folder without {META}: not a shardwise checkpoint (or a save that "
            f"did not finish: {META} is written last)")


class VerifiedCheckpoint:
    """A verified view of a checkpoint folder's metadata and files: what reads one.

    ``meta`` is ``checkpoint.json``, validated (and its checksum checked when
    ``signed``); ``file(name)``, ``rank(r)`` and ``buffers()`` open a data file (a
    ``_format.Reader``) after checking its size and SHA-256; ``assemble`` reads any range
    of a sharded tensor from the pieces that hold it.
    ``load_checkpoint``, ``consolidate``, ``describe`` and ``sign_checkpoint`` read
    through it; nothing else opens a checkpoint's data.

    Args:
        path: the folder.
        expect: how many tensors the model to load into holds (parameters and buffers);
            metadata far larger than that is refused before it is parsed or checked.
        signed: require a matching checksum (False to describe or sign one without).

    Raises:
        ShardwiseError: the folder holds no checkpoint, or unreadable or invalid
            metadata (naming the file and the field).

    Example:
        >>> ck = VerifiedCheckpoint("ckpt/latest")
        >>> ck.meta["world_size"], ck.buffers().keys()
    """

    def __init__(self, path: str, expect: int | None = None, signed: bool = True) -> None:
        self.path = path
        meta_path = metadata_path(path)
        if not os.path.isfile(meta_path):
            raise ShardwiseError(no_checkpoint(path))
        try:
            if expect is not None and os.path.getsize(meta_path) > _meta_cap(expect):
                raise ShardwiseError(
                    f"{meta_path}: {os.path.getsize(meta_path)} bytes of metadata, far "
                    f"more than a checkpoint of a model of {expect} tensors needs "
                    f"(at most {_meta_cap(expect)}): not this model's checkpoint")
            self.raw = read_metadata_bytes(path)
            self.meta = parse_metadata(self.raw)
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"{meta_path}: unreadable ({e})") from e
        if expect is not None:
            _check_counts(self.meta, expect, meta_path)
        validate(self.meta, meta_path, signed)  # Note [metadata that cannot lie]
        self.data = inside(path, self.meta.get("data"), f"{meta_path}: field 'data'")
        self.world_size = self.meta["world_size"]
        self._readers: dict[str, Reader] = {}

    @property
    def digest(self) -> str:
        """The SHA-256 of ``checkpoint.json`` as read: ranks compare it."""
        return hashlib.sha256(self.raw).hexdigest()

    def replaced(self) -> bool:
        """Whether ``checkpoint.json`` changed since it was read (a save committed)."""
        try:
            return read_metadata_bytes(self.path) != self.raw
        except OSError:
            return True

    def file(self, name: str) -> Reader:
        """The data file ``name``, open, verified against its size and SHA-256 first.

        Opened now, it stays readable: a save removing the folder later cannot take it
        away. A save may have removed it already: the error then makes the caller see
        the checkpoint replaced, and read the new one."""
        if name not in self._readers:
            expected = self.meta["files"].get(name)
            full = inside(self.data, name, f"{self.data}: data file")
            if expected is None:
                raise ShardwiseError(f"{full}: not listed in the checkpoint metadata")
            self._readers[name] = Reader(full, expected)
        return self._readers[name]

    def rank(self, r: int) -> Reader:
        """Rank ``r``'s data file (:meth:`file`)."""
        return self.file(rank_file(r, self.world_size))

    def buffers(self) -> Reader:
        """The buffers' data file (:meth:`file`)."""
        return self.file(BUFFERS_FILE)

    def assemble(self, key: str, pieces: list[list[int]], lo: int, n: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, lo+n)`` of a sharded tensor saved as per-rank pieces."""
        out = torch.empty(n, dtype=dtype)
        for r, (off, cnt) in enumerate(pieces):
            a, b = max(lo, off), min(lo + n, off + cnt)
            if b <= a:
                continue
            self.rank(r).read_into(key, a - off, out[a - lo:b - lo])
        return out

    def __del__(self) -> None:
        for reader in getattr(self, "_readers", {}).values():
            reader.close()


def _meta_cap(expect: int) -> int:
    """Bytes of ``checkpoint.json`` a model of ``expect`` tensors may need: a generous
    64 KiB per tensor (names, pieces of thousands of ranks, optimizer state) plus 64 MiB
    (Python RNG states: 7 KB per rank)."""
    return 64 * 2**20 + 64 * 2**10 * expect


def _check_counts(meta: Any, expect: int, meta_path: str) -> None:
    """Refuse metadata with many more entries than the model has tensors, cheaply and
    before the full check (which would take seconds and list every invented name)."""
    if not isinstance(meta, dict):
        return  # the schema says what is wrong
    for field in ("params", "buffers"):
        entries = meta.get(field)
        if isinstance(entries, dict) and len(entries) > expect:
            raise ShardwiseError(f"{meta_path}: field {field} lists {len(entries)} tensors, "
                                 f"the model has {expect} in all: not this model's "
                                 f"checkpoint ({summary(list(entries))})")


def sign_checkpoint(path: str | os.PathLike) -> str:
    """Check a checkpoint's metadata as a load does, then write its checksum.

    For a ``checkpoint.json`` edited on purpose, or written by a shardwise older than the
    checksum (Note [metadata that cannot lie]): a load refuses metadata without a
    matching checksum. Everything a load checks without the model is checked first: the
    schema, every data file's size and SHA-256, and each file's tensors and recorded
    pieces against the metadata. Holds the folder's lock, so no save runs meanwhile.
    What ``shardwise sign`` runs.

    Args:
        path: the checkpoint folder.

    Returns:
        What was done, in one line.

    Raises:
        ShardwiseError: the folder is not a checkpoint, a save holds it, or a check
            failed (naming the file, the field and the problem); nothing is written then.

    Example:
        >>> sw.checkpoint.sign_checkpoint("ckpt/latest")   # after editing "extra" by hand
    """
    path = path_argument(path, "sign_checkpoint")
    if not has_metadata(path):
        raise ShardwiseError(no_checkpoint(path))
    lock = FolderLock(path)
    lock.acquire()
    try:
        ck = VerifiedCheckpoint(path, signed=False)
        check_files(ck)
        for name in ck.meta["files"]:
            ck.file(name)  # size and SHA-256 of every listed file, not only those read
        before, after = ck.meta.get(CHECKSUM), canonical_sha256(ck.meta)
        if before == after:
            return f"{path}: the checksum matches already; nothing written"
        ck.meta[CHECKSUM] = after
        write_metadata(path, ck.meta)
        was = "no checksum before" if before is None else "the old checksum did not match"
        return f"{path}: signed ({was}); the metadata agrees with the data files"
    finally:
        lock.release()


def check_files(ck: VerifiedCheckpoint) -> None:
    """Cross-check the metadata against what the data files say of themselves (headers
    only, Note [metadata that cannot lie] in _schema.py): every tensor a file holds is
    described, with the dtype and shape the metadata gives it; each rank's file records
    the same pieces as the metadata; no file holds a tensor the metadata does not know
    (a deleted optimizer-state entry would silently reset it)."""
    meta = ck.meta
    pieces = {main: e["pieces"] for main, e in meta["params"].items()}
    inner = {inner_key(main, name): (ie["dtype"], ie["pieces"])
             for main, e in meta.get(SUBCLASSES, {}).items()
             for name, ie in e["inner"].items()}
    pieces.update({key: p for key, (_, p) in inner.items()})
    state = (meta.get("optimizer") or {}).get("state") or {}
    for r in range(ck.world_size):
        expected: dict[str, tuple[str, list[int]]] = {}
        for main, e in meta["params"].items():
            expected[param_key(main)] = (e["dtype"], [pieces[main][r][1]])
        for name, st in state.items():
            for k, info in st.items():
                if info["kind"] == "sharded":
                    expected[optim_key(name, k)] = (info["dtype"], [pieces[name][r][1]])
                elif info["kind"] == "replicated":
                    expected[optim_key(name, k)] = (info["dtype"], info["shape"])
        for key, (dtype, inner_pieces) in inner.items():
            expected[key] = (dtype, [inner_pieces[r][1]])
        f = ck.rank(r)
        where = f.path
        _check_tensors(f, where, expected, optional_prefix=RNG_PREFIX)
        # A data file recording its pieces is checked as format 2, whatever the metadata
        # claims (Note [metadata that cannot lie]).
        if meta["format_version"] >= 2 or f.records_pieces():
            _check_pieces(f, where, {main: p[r] for main, p in pieces.items()})
    if meta.get("buffers"):
        f = ck.buffers()
        _check_tensors(f, f.path,
                       {n: (e["dtype"], e["shape"]) for n, e in meta["buffers"].items()})


def _check_tensors(f: Reader, where: str, expected: dict[str, tuple[str, list[int]]],
                   optional_prefix: str | None = None) -> None:
    keys = set(f.keys())
    absent = [k for k in expected if k not in keys]
    if absent:
        raise ShardwiseError(f"{where}: lacks {summary(absent)}, which the metadata lists")
    stray = sorted(k for k in keys if k not in expected
                   and not (optional_prefix and k.startswith(optional_prefix)))
    if stray:
        raise ShardwiseError(f"{where}: holds tensors the metadata does not describe: "
                             f"{summary(stray)}")
    for key, (dtype, shape) in expected.items():
        stored, stored_shape = f.stored(key)
        want = type_code(dtype_from_name(dtype))
        if stored != want or stored_shape != list(shape):
            raise ShardwiseError(f"{where}: {key} is {stored} {stored_shape} in the file, "
                                 f"the metadata says {want} {list(shape)}")
    for key in (RNG_TORCH, RNG_CUDA):
        if key in keys and (f.stored(key)[0] != type_code(torch.uint8)
                            or len(f.stored(key)[1]) != 1):
            raise ShardwiseError(f"{where}: {key} is not an RNG state (1-D uint8)")


def _check_pieces(f: Reader, where: str, pieces: dict[str, list[int]]) -> None:
    """A rank's file names the pieces it holds; the metadata must say the same."""
    try:
        recorded = f.pieces()
    except ValueError as e:
        raise ShardwiseError(f"{where}: its header does not record its pieces") from e
    if recorded != pieces:
        wrong = sorted(n for n in set(pieces) | set(recorded if isinstance(recorded, dict)
                                                     else {})
                       if not isinstance(recorded, dict) or recorded.get(n) != pieces.get(n))
        raise ShardwiseError(f"{where}: holds other pieces than the metadata says, for "
                             f"{summary(wrong)} (e.g. {wrong[0]}: the file holds "
                             f"{recorded.get(wrong[0]) if isinstance(recorded, dict) else '?'}"
                             f", the metadata says {pieces.get(wrong[0])})")
