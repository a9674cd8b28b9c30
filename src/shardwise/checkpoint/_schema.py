"""``checkpoint.json`` checked strictly before anything is read or changed.

Note [metadata that cannot lie]
The data files are protected by their SHA-256, but the metadata says how to read them:
which flat range of which parameter each rank's piece holds, what each optimizer-state
tensor is, where the data folder is. A wrong field there would load wrong values without
any error. So every load validates the whole file first: types and ranges of every
field, pieces that tile each parameter exactly, known optimizer-state kinds with shapes
that match, one file entry per rank, RNG states that ``random.setstate`` accepts. Every
checkpoint carries the SHA-256 of its own canonical JSON (``meta_sha256``), so any edit at
all is caught, and one without it is refused: deleting the field would otherwise let any
edit through. A deliberate edit, or a checkpoint from a shardwise older than the field,
is signed explicitly with ``shardwise sign`` (``io.sign_checkpoint``), which first checks
the metadata as a load does, against the data files. Every failure names the file, the
field and the problem.

A checksum recomputed by whoever edits the file proves nothing, so the metadata is also
checked against what the data files say of themselves (verify.check_files): every tensor's
dtype and shape in its file's header, and the pieces each rank's file records that it
holds. A file that records its pieces (format 2) is checked as such whatever
``format_version`` claims: a metadata "downgraded" to format 1 cannot skip the check.
What no check can catch is a full forgery: data files rewritten and every hash and
record recomputed to match. The checks guard against bugs, conversion tools and
hand edits, not against an attacker with write access to the folder.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from typing import Any

from ..errors import ShardwiseError
from ._format import BUFFERS_FILE, DATA_DIR, FORMAT, FORMAT_VERSION, STORABLE, rank_file
from ._names import SUBCLASSES, dtype_name

CHECKSUM = "meta_sha256"
_DTYPES = {dtype_name(d) for d in STORABLE}
_KINDS = ("sharded", "replicated", "value")
_SHA = re.compile(r"[0-9a-f]{64}")


def canonical_sha256(meta: dict[str, Any]) -> str:
    """SHA-256 of ``meta`` without its checksum field, in a canonical JSON form."""
    body = {k: v for k, v in meta.items() if k != CHECKSUM}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class _Checker:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> ShardwiseError:
        return ShardwiseError(f"{self.path}: field {field}: {problem}")

    def int_(self, value: Any, field: str, lo: int = 0) -> int:
        if type(value) is not int or value < lo:
            raise self.fail(field, f"expected an integer >= {lo}, got {value!r}")
        return value

    def str_(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(field, f"expected a non-empty string, got {value!r}")
        return value

    def dict_(self, value: Any, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(field, f"expected an object, got {type(value).__name__}")
        return value

    def list_(self, value: Any, field: str, length: int | None = None) -> list:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            want = "a list" if length is None else f"a list of {length}"
            raise self.fail(field, f"expected {want}, got {value!r:.80}")
        return value

    def dtype(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or value not in _DTYPES:
            raise self.fail(field, f"unknown dtype {value!r}")
        return value

    def shape(self, value: Any, field: str) -> tuple[int, ...]:
        return tuple(self.int_(d, f"{field}[{i}]")
                     for i, d in enumerate(self.list_(value, field)))


def validate(meta: Any, path: str, signed: bool = True) -> None:
    """Check ``meta`` (a parsed ``checkpoint.json``) completely; raise on the first lie.

    ``signed``: the checksum must be there (Note [metadata that cannot lie]); only
    ``shardwise sign``, which writes it after checking everything else, passes False.

    Raises:
        ShardwiseError: naming ``path``, the field and the problem.
    """
    c = _Checker(path)
    meta = c.dict_(meta, "(top level)")
    if meta.get("format") != FORMAT:
        raise c.fail("format", f"not a shardwise checkpoint ({meta.get('format')!r})")
    version = c.int_(meta.get("format_version"), "format_version", lo=1)
    if version > FORMAT_VERSION:
        raise c.fail("format_version", f"{version} is newer than this shardwise reads "
                                       f"({FORMAT_VERSION})")
    if signed and CHECKSUM not in meta:
        raise c.fail(CHECKSUM, f"missing. shardwise writes it into every checkpoint, so "
                               f"the metadata was edited by hand or by a tool (or written "
                               f"by a shardwise older than the checksum). If that was "
                               f"deliberate, check and sign it with `shardwise sign "
                               f"{os.path.dirname(path) or '.'}`")
    if signed and meta[CHECKSUM] != canonical_sha256(meta):
        raise c.fail(CHECKSUM, f"does not match the file's contents: it was edited or "
                               f"corrupted after it was written. If the edit was "
                               f"deliberate, check and sign it with `shardwise sign "
                               f"{os.path.dirname(path) or '.'}`")
    if not isinstance(meta.get("data"), str) or not DATA_DIR.fullmatch(meta["data"]):
        raise c.fail("data", f"expected a data-<hex> folder name, got {meta.get('data')!r}")
    world = c.int_(meta.get("world_size"), "world_size", lo=1)
    if meta.get("step") is not None:
        c.int_(meta["step"], "step")
    _files(c, meta, world)
    seen: set[str] = set()
    shapes = _params(c, meta, world, seen)
    if SUBCLASSES in meta:
        _subclasses(c, meta, world, seen)
        # An optimizer may hold the frozen tensor subclasses too (without state).
        shapes.update({main: tuple(e["shape"]) for main, e in meta[SUBCLASSES].items()})
    buffers = c.dict_(meta.get("buffers", {}), "buffers")
    for name, e in buffers.items():
        e = c.dict_(e, f"buffers.{name}")
        c.shape(e.get("shape"), f"buffers.{name}.shape")
        c.dtype(e.get("dtype"), f"buffers.{name}.dtype")
    if buffers and BUFFERS_FILE not in meta["files"]:
        raise c.fail("files", f"buffers are listed but {BUFFERS_FILE} is not")
    if meta.get("optimizer") is not None:
        _optimizer(c, meta["optimizer"], shapes, version)
    rngs = c.list_(meta.get("python_rng"), "python_rng", length=world)
    for r, s in enumerate(rngs):
        _python_rng(c, s, f"python_rng[{r}]")


def _files(c: _Checker, meta: dict, world: int) -> None:
    files = c.dict_(meta.get("files"), "files")
    for name, info in files.items():
        info = c.dict_(info, f"files.{name}")
        c.int_(info.get("bytes"), f"files.{name}.bytes")
        if not isinstance(info.get("sha256"), str) or not _SHA.fullmatch(info["sha256"]):
            raise c.fail(f"files.{name}.sha256", f"not a SHA-256: {info.get('sha256')!r}")
    for r in range(world):
        if rank_file(r, world) not in files:
            raise c.fail("files", f"{rank_file(r, world)} (rank {r}'s data) is not listed")


def _params(c: _Checker, meta: dict, world: int,
            seen: set[str]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for main, e in c.dict_(meta.get("params"), "params").items():
        f = f"params.{main}"
        e = c.dict_(e, f)
        _names(c, f, main, e, seen)
        shape = c.shape(e.get("shape"), f"{f}.shape")
        c.dtype(e.get("dtype"), f"{f}.dtype")
        _pieces(c, f"{f}.pieces", e.get("pieces"), world, math.prod(shape))
        shapes[main] = shape
    return shapes


def _subclasses(c: _Checker, meta: dict, world: int, seen: set[str]) -> None:
    """Parameters held as a tensor subclass's inner tensors (Note [packed checkpoints] in
    engine/groups/subclass.py): each inner tensor's pieces tile its full shape, as a
    parameter's do."""
    for main, e in c.dict_(meta.get(SUBCLASSES), SUBCLASSES).items():
        f = f"{SUBCLASSES}.{main}"
        e = c.dict_(e, f)
        _names(c, f, main, e, seen)
        c.str_(e.get("type"), f"{f}.type")
        c.shape(e.get("shape"), f"{f}.shape")
        c.dtype(e.get("dtype"), f"{f}.dtype")
        inner = c.dict_(e.get("inner"), f"{f}.inner")
        if not inner:
            raise c.fail(f"{f}.inner", "lists no inner tensors")
        for name, ie in inner.items():
            g = f"{f}.inner.{name}"
            ie = c.dict_(ie, g)
            shape = c.shape(ie.get("shape"), f"{g}.shape")
            c.dtype(ie.get("dtype"), f"{g}.dtype")
            _pieces(c, f"{g}.pieces", ie.get("pieces"), world, math.prod(shape))


def _names(c: _Checker, f: str, main: str, e: dict, seen: set[str]) -> None:
    """A tensor's names start with its key, and no name belongs to two tensors."""
    names = c.list_(e.get("names"), f"{f}.names")
    if not names or names[0] != main:
        raise c.fail(f"{f}.names", f"must start with {main!r}, got {names!r:.80}")
    for n in names:
        if c.str_(n, f"{f}.names") in seen:
            raise c.fail(f"{f}.names", f"{n!r} is listed twice")
        seen.add(n)


def _pieces(c: _Checker, field: str, value: Any, world: int, numel: int) -> None:
    """One ``[offset, count]`` per rank, tiling ``numel`` elements."""
    pieces = c.list_(value, field, length=world)
    spans = []
    for r, piece in enumerate(pieces):
        off, cnt = c.list_(piece, f"{field}[{r}]", length=2)
        spans.append((c.int_(off, f"{field}[{r}][0]"), c.int_(cnt, f"{field}[{r}][1]"), r))
    _tile(c, field, spans, numel)


def _tile(c: _Checker, field: str, spans: list[tuple[int, int, int]], numel: int) -> None:
    """The non-empty pieces must cover ``[0, numel)`` exactly, without gap or overlap."""
    cursor = 0
    for off, cnt, r in sorted(s for s in spans if s[1] > 0):
        if off != cursor:
            what = "overlaps the piece before it" if off < cursor else f"leaves elements " \
                f"{cursor}..{off - 1} in no piece"
            raise c.fail(field, f"rank {r}'s piece at {off} {what}")
        cursor = off + cnt
    if cursor != numel:
        raise c.fail(field, f"the pieces cover {cursor} elements, the parameter has {numel}")


def _optimizer(c: _Checker, opt: Any, shapes: dict[str, tuple[int, ...]],
               version: int) -> None:
    opt = c.dict_(opt, "optimizer")
    c.str_(opt.get("class"), "optimizer.class")
    for i, g in enumerate(c.list_(opt.get("param_groups"), "optimizer.param_groups")):
        g = c.dict_(g, f"optimizer.param_groups[{i}]")
        for n in c.list_(g.get("params"), f"optimizer.param_groups[{i}].params"):
            if not isinstance(n, str) or n not in shapes:
                raise c.fail(f"optimizer.param_groups[{i}].params", f"unknown parameter {n!r}")
    for name, st in c.dict_(opt.get("state"), "optimizer.state").items():
        if name not in shapes:
            raise c.fail("optimizer.state", f"state for unknown parameter {name!r}")
        for k, info in c.dict_(st, f"optimizer.state.{name}").items():
            f = f"optimizer.state.{name}.{k}"
            info = c.dict_(info, f)
            kind = info.get("kind")
            if kind not in _KINDS:
                raise c.fail(f"{f}.kind", f"unknown kind {kind!r} (expected one of {_KINDS})")
            if kind == "value":
                if "value" not in info:
                    raise c.fail(f, "a value entry without its value")
                continue
            c.dtype(info.get("dtype"), f"{f}.dtype")
            # A sharded tensor's pieces are the parameter's; their lengths are checked
            # against the data files' headers when it is read (verify.check_files).
            shape = c.shape(info.get("shape"), f"{f}.shape")
            like_param = len(shape) > 0 and shape == shapes[name]
            # Version 1 recorded rank 0's local shape for sharded state.
            if kind == "sharded" and not like_param and version >= 2:
                raise c.fail(f"{f}.shape", f"sharded state must have its parameter's shape "
                                           f"{list(shapes[name])}, got {list(shape)}")
            if kind == "replicated" and like_param:
                raise c.fail(f"{f}.kind", "state shaped like its parameter is saved sharded, "
                                          "not replicated")


def _python_rng(c: _Checker, s: Any, field: str) -> None:
    """A state ``random.setstate`` accepts: [version, 625 ints, gauss or None], tried
    on a scratch generator (the version and the index in the last int matter too)."""
    s = c.list_(s, field, length=3)
    if type(s[0]) is not int:
        raise c.fail(field, "version is not an integer")
    state = c.list_(s[1], f"{field}[1]", length=625)
    if any(type(x) is not int or not 0 <= x < 2**32 for x in state):
        raise c.fail(f"{field}[1]", "not a list of 32-bit unsigned integers")
    if s[2] is not None and not isinstance(s[2], float):
        raise c.fail(f"{field}[2]", f"expected a float or null, got {s[2]!r:.40}")
    try:
        random.Random().setstate((s[0], tuple(state), s[2]))
    except (ValueError, TypeError) as e:
        raise c.fail(field, f"not a state Python's random accepts ({e})") from e
