"""``save_checkpoint`` / ``load_checkpoint``: sharded, atomic, reshardable, no pickle.

See _format.py for the layout and Note [atomic save]. Each rank writes the pieces it
stores; a load at another world size reads, for each new piece, the slices of the old
pieces that overlap it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import random
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from .._args import require_bool
from ..comm.agree import agreed
from ..comm.order_check import operation
from ..consistency import check_consistency
from ..engine.alloc import freed
from ..engine.buffers import BufferPolicy
from ..engine.offload.storage import GroupStorage
from ..engine.state import model_state
from ..errors import ShardwiseError
from ._format import (
    _ST_DTYPES,
    BUFFERS_FILE,
    FORMAT,
    FORMAT_VERSION,
    META,
    PIECES,
    TMP_MARK,
    SafetensorsStreamWriter,
    dtype_from_name,
    dtype_name,
    fsync_dir,
    inside,
    path_argument,
    rank_file,
    read_json,
    summary,
    verify_file,
    write_atomic,
    write_json_atomic,
)
from ._lock import FolderLock
from ._schema import CHECKSUM, canonical_sha256, validate
from ._targets import (
    InnerTarget,
    PackedTarget,
    ParamTarget,
    Value,
    apply_values,
    comm_of,
    match_targets,
    module_targets,
    packed_targets,
)


def python_rng_state() -> list:
    """Python's ``random`` state as JSON values."""
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def set_python_rng_state(saved: list) -> None:
    """Restore a state from :func:`python_rng_state`."""
    random.setstate((saved[0], tuple(saved[1]), saved[2]))


def _json_ok(obj: Any, what: str, exact: bool = False) -> None:
    """``obj`` must serialise to JSON; with ``exact``, come back exactly as it is."""
    try:
        # NaN and infinity are not JSON: Python would write them anyway, as tokens other
        # readers refuse.
        same = json.loads(json.dumps(obj, allow_nan=False)) == obj
    except ValueError as e:
        raise ShardwiseError(f"{what} must be JSON: NaN and infinity are not ({e}); store "
                             f"them as strings or None") from e
    except TypeError as e:
        raise ShardwiseError(f"{what} must be JSON-serialisable: {e}") from e
    if exact and not same:
        raise ShardwiseError(f"{what} would not come back from JSON as saved (tuples become "
                             f"lists, non-string keys become strings): {obj!r:.200}")


def _optimizer_parts(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                     unsaved: set[str]):
    """Split an optimizer's state into JSON metadata and this rank's tensors; the rows of
    parameters in ``unsaved`` (another replica saves them) are saved empty."""
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in name_of]
    if missing:
        raise ShardwiseError("the optimizer holds parameters that are not the module's; build "
                             "it from module.parameters() after sharding")
    names = [name_of[id(p)] for p in order]
    tensors: dict[str, torch.Tensor] = {}
    state_meta: dict[str, dict] = {}
    for idx, st in sd["state"].items():
        name, param = names[idx], order[idx]
        entry = {}
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                sharded = v.dim() > 0 and tuple(v.shape) == tuple(param.shape)
                shape = list(v.shape)  # the full shape, for a DTensor too
                if isinstance(v, DTensor):
                    v = v.to_local()  # this rank's rows, like the parameter's
                value = v.detach()  # streamed from where it lives (Note [streamed save])
                # State shaped like the parameter is stored flat: it is cut into the same
                # pieces as the parameter, and reloads at any world size.
                if sharded:
                    value = value.reshape(-1)[:0] if name in unsaved else value.reshape(-1)
                tensors[f"optim/{name}/{k}"] = value
                entry[k] = {"kind": "sharded" if sharded else "replicated",
                            "dtype": dtype_name(v.dtype), "shape": shape}
            else:
                _json_ok(v, f"optimizer state {k!r}")
                entry[k] = {"kind": "value", "value": v}
        state_meta[name] = entry
    groups = []
    for g, gsd in zip(optimizer.param_groups, sd["param_groups"]):
        hyper = {k: v for k, v in gsd.items() if k != "params"}
        _json_ok(hyper, "optimizer hyperparameters")
        groups.append({**hyper, "params": [name_of[id(p)] for p in g["params"]]})
    return {"class": type(optimizer).__name__, "param_groups": groups, "state": state_meta}, tensors


# Note [save protocol]
# The steps of a save, in the order ranks pass them. ``_reached`` marks each; it does
# nothing, and exists so that the crash-point test (tests/test_checkpoint_protocol.py) can
# stop a rank at every one of them in turn, by exit, kill and exception, and check that
# the folder always holds the new or the previous checkpoint, loadable, and no debris.
#   begin         every rank: the order check passed, buffers agree
#   prepared      every rank: its pieces are in memory, checks passed
#   locked        rank 0: holds the folder's lock (Note [one writer] in checkpoint/_lock.py)
#   data-folder   rank 0: created the new, empty data-<id> folder
#   data-tmp      every rank: its data file is complete under a temporary name
#   data-written  every rank: the ranks agreed that every data file is in place
#   reports       every rank: rank 0 has every rank's file sizes, hashes and pieces
#   meta-tmp      rank 0: the new checkpoint.json is complete under a temporary name
#   committed     rank 0: checkpoint.json names the new data (the commit point)
#   agreed        every rank: the ranks agreed that the save committed
#   tidied        rank 0: stale data folders and temporary files are gone
# Rank 0 tidies whether the save succeeded or failed, as long as it holds the lock, and
# never removes the data folder that checkpoint.json names, nor (with ``keep_previous``)
# the one it named before this save.
SAVE_STEPS = ("begin", "prepared", "locked", "data-folder", "data-tmp", "data-written",
              "reports", "meta-tmp", "committed", "agreed", "tidied")


def _reached(step: str) -> None:
    """A step of Note [save protocol] (a point where the crash-point test stops a rank)."""


@operation("save_checkpoint", lambda path, module, **_: (
    comm_of(module), f"save_checkpoint({path_argument(path, 'save_checkpoint')!r})", None))
def save_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: Any = None, *, keep_previous: bool = True) -> None:
    """Save a sharded checkpoint into the folder ``path``, atomically.

    Holds every rank's parameter pieces, the buffers (checked identical across ranks
    first; under the ``"local"`` buffer policy, rank 0's are saved without the check), the
    optimizer state, the step, RNG states and ``extra``. Data is safetensors,
    metadata JSON; nothing is pickled. A crash or failure at any moment, on any rank,
    leaves the new or the previous checkpoint in ``path``, complete and loadable (Note
    [atomic save] in _format.py). One job at a time may save into a folder.

    Args:
        path: the checkpoint folder (created if needed; a previous checkpoint there is
            replaced only once the new one is complete).
        module: the model, sharded or not.
        optimizer: optional optimizer built over ``module.parameters()``.
        extra: a JSON value (dicts with string keys, lists, strings, numbers, booleans,
            None), returned exactly by :func:`load_checkpoint`.
        keep_previous: keep the replaced checkpoint's data folder until the next save, so
            that a load that started before this save still finds its files (it costs
            the disk space of one more checkpoint). With False it is removed at once; a
            load it interrupts starts again from the new checkpoint.

    Raises:
        DivergenceError: buffers differ across ranks (nothing is written).
        ShardwiseError: on every rank: ``path`` is not a path or differs across ranks;
            another job is saving into ``path`` (naming it); ``extra`` or optimizer
            hyperparameters do not survive JSON; the optimizer holds parameters that are
            not the module's; the model is inside its forward/backward or a
            ``gathered()`` block; a write failed on some rank (a full or read-only disk).

    Example:
        >>> sw.save_checkpoint("ckpt/latest", model, opt, extra={"epoch": 3})
    """
    path = path_argument(path, "save_checkpoint")
    require_bool(keep_previous, "save_checkpoint", "keep_previous")
    comm = comm_of(module)
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    state = model_state(module)
    if comm is not None and not (state is not None
                                 and state.buffers.policy is BufferPolicy.LOCAL):
        check_consistency(module, group=comm.group)
    what = f"save_checkpoint({path!r}) failed"
    _reached("begin")
    # Note [agreed failure] in comm/agree.py: a non-JSON extra on one rank, a path that is a
    # file, a read-only or full disk each become one error on every rank.
    params, packed, buffers, tensors, opt_meta = agreed(
        comm, what, lambda: _prepare(module, optimizer, extra, rank))
    _reached("prepared")
    folder = _Folder(path, keep_previous) if rank == 0 else None
    try:
        data_dir = _new_data_dir(path, comm, rank, world, what, folder)
        mine = agreed(comm, what, lambda: _write_data(data_dir, rank, world, tensors,
                                                      buffers, params, packed))
        _reached("data-written")
        everyone = comm.all_gather_object(mine) if comm is not None and world > 1 else [mine]
        _reached("reports")

        def commit() -> None:
            if folder is not None:
                meta = _metadata(module, params, packed, buffers, opt_meta, tensors,
                                 everyone, extra, world)
                meta["data"] = os.path.basename(data_dir)
                folder.commit(meta)

        agreed(comm, what, commit)  # nobody returns before the commit
        _reached("agreed")
    finally:
        if folder is not None:
            folder.close()


class _Folder:
    """Rank 0's side of a save: the lock, the new data folder, the commit, the tidying."""

    def __init__(self, path: str, keep_previous: bool) -> None:
        self.path = path
        self.keep_previous = keep_previous
        self.lock = FolderLock(path)
        self.locked = False
        self.previous: str | None = None

    def start(self, data_dir: str) -> None:
        """Lock the folder, note the checkpoint it holds, create the new data folder."""
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise ShardwiseError(f"cannot create {self.path}: {e}") from e
        self.lock.acquire()
        self.locked = True
        _reached("locked")
        self.previous = _committed_data(self.path)
        try:
            os.makedirs(data_dir, exist_ok=False)
        except OSError as e:
            raise ShardwiseError(f"cannot create {data_dir}: {e}") from e
        _reached("data-folder")

    def commit(self, meta: dict) -> None:
        """Replace ``checkpoint.json``: from here on the new checkpoint is the one."""
        meta[CHECKSUM] = canonical_sha256(meta)
        write_json_atomic(os.path.join(self.path, META), meta,
                          before_rename=lambda: _reached("meta-tmp"))
        fsync_dir(self.path)
        _reached("committed")

    def close(self) -> None:
        """Tidy (whether the save succeeded or not) and release the lock."""
        if not self.locked:
            return
        try:
            self._tidy()
            _reached("tidied")
        finally:
            self.lock.release()
            self.locked = False

    def _tidy(self) -> None:
        """Remove data folders no checkpoint needs, and temporary files left by saves that
        crashed (ours are all gone by now: we hold the lock)."""
        current = _committed_data(self.path)
        if current is None and os.path.exists(os.path.join(self.path, META)):
            return  # unreadable metadata: remove nothing rather than guess
        keep = {current, self.previous if self.keep_previous else None}
        for entry in os.listdir(self.path):
            full = os.path.join(self.path, entry)
            if entry.startswith("data-") and entry not in keep and os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            elif entry.startswith(META + TMP_MARK) and os.path.isfile(full):
                with contextlib.suppress(OSError):
                    os.remove(full)


def _committed_data(path: str) -> str | None:
    """The data folder ``path/checkpoint.json`` names, or None (none, or unreadable)."""
    try:
        data = read_json(os.path.join(path, META)).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, str) and data.startswith("data-") else None


def _prepare(module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any,
             rank: int):
    """This rank's view of what to save (checks included); nothing is written."""
    _json_ok(extra, "extra", exact=True)
    params, buffers = module_targets(module)
    packed = packed_targets(module)
    unsaveable = [t.packed.unsaveable for t in packed if t.packed.unsaveable]
    if unsaveable:
        raise ShardwiseError(unsaveable[0])
    tensors, opt_meta = _local_tensors(params, packed, optimizer, rank)
    return params, packed, buffers, tensors, opt_meta


def _local_tensors(params: list[ParamTarget], packed: list[PackedTarget],
                   optimizer: torch.optim.Optimizer | None, rank: int,
                   ) -> tuple[dict[str, torch.Tensor], dict | None]:
    """This rank's parameter pieces (quantized ones' inner tensors too: Note [packed
    checkpoints]), optimizer-state pieces and RNG states, and the optimizer's metadata."""
    name_of: dict[int, str] = {}
    for t in params:
        key = t.sharded.shard if t.sharded is not None else t.plain
        name_of[id(key)] = t.names[0]
    for pt in packed:  # frozen: an optimizer may hold them, without state
        name_of[id(pt.packed.shard)] = pt.names[0]
    # Views of the live tensors, not copies: the data file is streamed from them, one at
    # a time (Note [streamed save]).
    tensors = {f"param/{t.names[0]}": t.local_values()[:t.saved_range()[1]]
               for t in params}
    for pt in packed:
        for inner in pt.packed.inner:
            n = pt.saved_piece(inner, rank)[1]
            tensors[_packed_key(pt.names[0], inner)] = (
                getattr(pt.packed.local, inner).detach().reshape(-1)[:n])
    opt_meta = None
    if optimizer is not None:
        unsaved = {t.names[0] for t in params if not t.writes}
        opt_meta, opt_tensors = _optimizer_parts(optimizer, name_of, unsaved)
        tensors.update(opt_tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    return tensors, opt_meta


def _new_data_dir(path: str, comm, rank: int, world: int, what: str,
                  folder: _Folder | None) -> str:
    """A fresh ``data-<id>`` folder, created by rank 0 (holding the folder's lock) before
    anyone writes into it. Every rank must have been given the same ``path``."""
    data_id = uuid.uuid4().hex[:12] if rank == 0 else None
    paths = [path]
    if comm is not None and world > 1:
        seen = comm.all_gather_object((path, data_id))
        paths, data_id = [p for p, _ in seen], seen[0][1]
    data_dir = os.path.join(path, f"data-{data_id}")

    def make() -> None:
        if len(set(paths)) > 1:
            raise ShardwiseError(f"the ranks were given different paths: {_by_rank(paths)}")
        if folder is not None:
            folder.start(data_dir)

    agreed(comm, what, make)
    return data_dir


def _by_rank(values: list) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def _packed_key(main: str, inner: str) -> str:
    return f"packed/{main}/{inner}"


# Note [streamed save]
# A rank's data file is written one tensor at a time, from where each tensor lives (the
# device, host memory, or an offload tier's file), through a safetensors writer that
# knows the header up front. The tensors collected before the writes are views of the
# live parameters and optimizer state, not copies: nothing changes them during a save,
# every rank being inside it. So a save needs memory for one tensor at a time, where it
# needed a copy of the rank's state plus the file's bytes; and a disk tier's pages, read
# for the file, are released after each of its tensors (Note [the disk tier]), so the
# state of an offloaded model larger than memory can be saved (docs/offload.md).
def _write_data(data_dir: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
                buffers: dict[str, torch.Tensor], params: list[ParamTarget],
                packed: list[PackedTarget]) -> dict:
    """Write this rank's file (and rank 0 the buffers); what rank 0 must record of it.

    The file's own header records the pieces it holds, so that metadata claiming other
    pieces is caught at load (Note [metadata that cannot lie] in _schema.py)."""
    pieces = {t.names[0]: list(t.saved_range()) for t in params}
    pieces.update({_packed_key(t.names[0], inner): list(t.saved_piece(inner, rank))
                   for t in packed for inner in t.packed.inner})
    fname = rank_file(rank, world)
    header = {"format": FORMAT, PIECES: json.dumps(pieces, separators=(",", ":"))}
    writer = SafetensorsStreamWriter(
        os.path.join(data_dir, fname),
        [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], metadata=header)
    on_disk = {t.names[0]: t.sharded.group.store for t in params
               if t.sharded is not None and t.sharded.group is not None
               and t.sharded.group.store is not None and t.sharded.group.store.on_disk}
    try:
        for k, v in tensors.items():
            writer.write(k, v)
            kind, _, rest = k.partition("/")
            store = on_disk.get(rest.split("/")[0]) if kind in ("param", "optim") else None
            if store is not None:
                store.release()  # its pages, read for the file, leave the process again
    except BaseException:
        writer.abort()
        raise
    files = {fname: writer.close(before_rename=lambda: _reached("data-tmp"))}
    if rank == 0 and buffers:
        buf = {n: b.detach().to("cpu", copy=True).contiguous() for n, b in buffers.items()}
        files[BUFFERS_FILE] = write_atomic(
            os.path.join(data_dir, BUFFERS_FILE),
            safetensors.torch.save(buf, metadata={"format": FORMAT}))
    return {"file": fname, "files": files, "python_rng": python_rng_state(), "pieces": pieces}


def _metadata(module: nn.Module, params: list[ParamTarget], packed: list[PackedTarget],
              buffers: dict[str, torch.Tensor], opt_meta: dict | None,
              tensors: dict[str, torch.Tensor], everyone: list[dict], extra: Any,
              world: int) -> dict:
    """``checkpoint.json`` (without ``data``), from every rank's report."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": world,
        "step": _step_of(opt_meta, tensors) if opt_meta else None,
        "module_class": type(module).__name__,
        "params": {t.names[0]: {"names": t.names, "shape": list(t.shape),
                                "dtype": dtype_name(t.dtype),
                                "pieces": [e["pieces"][t.names[0]] for e in everyone]}
                   for t in params},
        "buffers": {n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
                    for n, b in buffers.items()},
        "optimizer": opt_meta,
        "python_rng": [e["python_rng"] for e in everyone],
        "extra": extra,
        "files": {name: info for e in everyone for name, info in e["files"].items()},
    }
    if packed:  # Note [packed checkpoints]; absent otherwise, as before it existed
        meta["packed"] = {t.names[0]: _packed_entry(t, everyone) for t in packed}
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        meta["hf_config"] = json.loads(config.to_json_string())
    return meta


def _packed_entry(t: PackedTarget, everyone: list[dict]) -> dict:
    """A quantized parameter's record: its type, shape and dtype, and each inner tensor's
    full shape, dtype and pieces (Note [packed checkpoints])."""
    main = t.names[0]
    return {"names": t.names, "type": t.kind, "shape": list(t.packed.shape),
            "dtype": dtype_name(t.packed.dtype),
            "inner": {inner: {"shape": list(t.packed.full_inner[inner]),
                              "dtype": dtype_name(getattr(t.packed.local, inner).dtype),
                              "pieces": [e["pieces"][_packed_key(main, inner)]
                                         for e in everyone]}
                      for inner in t.packed.inner}}


def _step_of(opt_meta: dict, tensors: dict[str, torch.Tensor]) -> int | None:
    """The optimizer's step count (torch optimizers keep it per parameter)."""
    for name, st in opt_meta["state"].items():
        s = st.get("step")
        if s is not None:
            return int(s["value"] if s["kind"] == "value"
                       else tensors[f"optim/{name}/step"].item())
    return None


class _Checkpoint:
    """A verified view of a checkpoint folder's metadata and files.

    Args:
        path: the folder.
        expect: how many tensors the model to load into holds (parameters and buffers);
            metadata far larger than that is refused before it is parsed or checked.
    """

    def __init__(self, path: str, expect: int | None = None, signed: bool = True) -> None:
        self.path = path
        meta_path = os.path.join(path, META)
        if not os.path.isfile(meta_path):
            raise ShardwiseError(f"{path}: not a shardwise checkpoint ({META} is missing)")
        try:
            if expect is not None and os.path.getsize(meta_path) > _meta_cap(expect):
                raise ShardwiseError(
                    f"{meta_path}: {os.path.getsize(meta_path)} bytes of metadata, far "
                    f"more than a checkpoint of a model of {expect} tensors needs "
                    f"(at most {_meta_cap(expect)}): not this model's checkpoint")
            with open(meta_path, "rb") as f:
                self.raw = f.read()
            self.meta = json.loads(self.raw)
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"{meta_path}: unreadable ({e})") from e
        if expect is not None:
            _check_counts(self.meta, expect, meta_path)
        validate(self.meta, meta_path, signed)  # Note [metadata that cannot lie]
        self.data = inside(path, self.meta.get("data"), f"{meta_path}: field 'data'")
        self.world_size = self.meta["world_size"]
        self._handles: dict[str, Any] = {}
        self._raw: dict[str, _RawFile] = {}

    @property
    def digest(self) -> str:
        """The SHA-256 of ``checkpoint.json`` as read: ranks compare it."""
        return hashlib.sha256(self.raw).hexdigest()

    def replaced(self) -> bool:
        """Whether ``checkpoint.json`` changed since it was read (a save committed)."""
        try:
            with open(os.path.join(self.path, META), "rb") as f:
                return f.read() != self.raw
        except OSError:
            return True

    def file(self, name: str):
        """An open safetensors file, verified against its size and SHA-256 first."""
        if name not in self._handles:
            expected = self.meta["files"].get(name)
            full = inside(self.data, name, f"{self.data}: data file")
            if expected is None:
                raise ShardwiseError(f"{full}: not listed in the checkpoint metadata")
            problem = verify_file(full, expected)
            if problem:
                raise ShardwiseError(problem)
            try:
                handle = safe_open(full, framework="pt", device="cpu")
                # Opened now: a save removing the folder later cannot take it away.
                self._raw[name] = _RawFile(full)
            except Exception as e:  # noqa: BLE001 - safetensors' errors do not name the file
                # A concurrent save may have removed it since it was verified: the caller
                # sees the checkpoint replaced and reads the new one.
                raise ShardwiseError(f"{full}: not a readable safetensors file ({e})") from e
            self._handles[name] = handle
        return self._handles[name]

    def assemble(self, key: str, pieces: list[list[int]], lo: int, n: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, lo+n)`` of a sharded tensor saved as per-rank pieces."""
        out = torch.empty(n, dtype=dtype)
        for r, (off, cnt) in enumerate(pieces):
            a, b = max(lo, off), min(lo + n, off + cnt)
            if b <= a:
                continue
            name = rank_file(r, self.world_size)
            self.file(name)  # verified first
            self._raw[name].read_into(key, a - off, out[a - lo:b - lo])
        return out

    def __del__(self) -> None:
        for raw in getattr(self, "_raw", {}).values():
            raw.close()


class _RawFile:
    """A verified safetensors file read with ``pread`` into the caller's tensors.

    safetensors' own reader maps the file, and every page it reads then counts in the
    process's resident memory until the mapping goes: a load of a disk tier's state would
    hold the whole file that way (Note [streamed load]). Reading with ``pread`` leaves
    the pages to the page cache, outside the process."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115 - kept open while the checkpoint is read
        n = int.from_bytes(self._f.read(8), "little")
        header = json.loads(self._f.read(n))
        self._base = 8 + n
        self._offsets = {k: v["data_offsets"][0] for k, v in header.items()
                         if k != "__metadata__"}

    def read_into(self, key: str, first: int, out: torch.Tensor) -> None:
        """Elements ``[first, first + out.numel())`` of tensor ``key`` into ``out``."""
        size = out.element_size()
        nbytes = out.numel() * size
        start = self._base + self._offsets[key] + first * size
        view = memoryview((ctypes.c_ubyte * nbytes).from_address(out.data_ptr()))
        done = 0
        while done < nbytes:
            got = os.preadv(self._f.fileno(), [view[done:]], start + done)
            if got <= 0:
                raise ShardwiseError(f"{self.path}: ended while reading {key}")
            done += got

    def close(self) -> None:
        self._f.close()


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


def _read_packed(ck: _Checkpoint, packed: list[PackedTarget],
                 ) -> tuple[list[tuple[InnerTarget, torch.Tensor]], dict[int, str]]:
    """This rank's part of every quantized parameter's inner tensors (Note [packed
    checkpoints]), checked against the model's; and each shard's saved name."""
    saved = ck.meta.get("packed", {})
    key_of = {n: main for main, e in saved.items() for n in e["names"]}
    problems: list[str] = []
    values: list[tuple[InnerTarget, torch.Tensor]] = []
    names: dict[int, str] = {}
    for t in packed:
        present = [n for n in t.names if n in key_of]
        if not present:
            problems.append(f"{t.names[0]}: not among the checkpoint's quantized parameters")
            continue
        main = key_of[present[0]]
        e, pp = saved[main], t.packed
        names[id(pp.shard)] = main
        mine = (t.kind, list(pp.shape), dtype_name(pp.dtype))
        if (e["type"], e["shape"], e["dtype"]) != mine or set(e["inner"]) != set(pp.inner):
            problems.append(f"{t.names[0]}: the checkpoint holds a {e['type']} "
                            f"{e['shape']} {e['dtype']} with {sorted(e['inner'])}, the "
                            f"model a {mine[0]} {mine[1]} {mine[2]} with {sorted(pp.inner)}")
            continue
        if pp.unsaveable:
            problems.append(pp.unsaveable)
            continue
        for inner in pp.inner:
            ie, dtype = e["inner"][inner], getattr(pp.local, inner).dtype
            if (tuple(ie["shape"]), ie["dtype"]) != (pp.full_inner[inner], dtype_name(dtype)):
                problems.append(f"{t.names[0]}: its {inner} is {ie['dtype']} {ie['shape']} "
                                f"in the checkpoint, {dtype_name(dtype)} "
                                f"{list(pp.full_inner[inner])} in the model (quantized with "
                                f"other settings?)")
                continue
            lo, n = pp.inner_piece(inner)
            values.append((t.inner(inner), ck.assemble(_packed_key(main, inner),
                                                       ie["pieces"], lo, n, dtype)))
    unexpected = [m for m in saved if m not in names.values()]
    if unexpected:
        problems.append(f"quantized parameters the model does not have: {summary(unexpected)}")
    if problems:
        raise ShardwiseError(f"{ck.path}: " + "; ".join(problems))
    return values, names


def _read_values(ck: _Checkpoint, params: list[ParamTarget], packed: list[PackedTarget],
                 buffers: dict[str, torch.Tensor], optimizer, rank: int, world: int) -> tuple:
    """Everything this rank will write into the module, optimizer and RNGs, read and
    checked; nothing is changed."""
    saved = {main: (tuple(e["shape"]), e["dtype"]) for main, e in ck.meta["params"].items()}
    saved.update({n: (tuple(e["shape"]), e["dtype"])
                  for n, e in ck.meta.get("buffers", {}).items()})
    key_of = {n: main for main, e in ck.meta["params"].items() for n in e["names"]}
    key_of.update({n: n for n in ck.meta.get("buffers", {})})
    match = match_targets(params, buffers, saved, key_of, "checkpoint")
    problems = match.problems("checkpoint")
    if problems:
        raise ShardwiseError(f"{ck.path}: " + "; ".join(problems))
    matched = [(t, main, ck.meta["params"][main]) for t, main in match.params]

    _check_files(ck)
    values: list[tuple[ParamTarget | InnerTarget, Value]] = []
    for t, main, entry in matched:
        lo, n = t.local_range()
        read = functools.partial(ck.assemble, f"param/{main}", entry["pieces"], lo, n,
                                 t.dtype)
        values.append((t, read if _disk_store(t) is not None else read()))  # Note [streamed load]
    inner_values, packed_names = _read_packed(ck, packed)
    values += inner_values
    buffer_values = []
    if buffers:
        f = ck.file(BUFFERS_FILE)
        buffer_values = [(b, f.get_tensor(key)) for b, key in match.buffers]

    opt_sd = None
    deferred: list[Callable[[], None]] = []
    if optimizer is not None:
        opt_sd = _read_optimizer(ck, optimizer, matched, packed_names, deferred)
    rng = None
    if ck.world_size == world:
        f = ck.file(rank_file(rank, world))
        rng = (f.get_tensor("rng/torch"),
               f.get_tensor("rng/cuda") if "rng/cuda" in f.keys() else None,
               ck.meta["python_rng"][rank])
        try:  # on a scratch generator: a bad state must fail before anything changes
            torch.Generator().set_state(rng[0])
        except (RuntimeError, TypeError) as e:
            raise ShardwiseError(f"{ck.data}/{rank_file(rank, world)}: rng/torch is not a "
                                 f"torch RNG state ({e})") from e
    return values, buffer_values, (opt_sd, deferred), rng, ck.meta.get("extra")


def _read_checkpoint(path: str, module: nn.Module, optimizer, rank: int, world: int):
    """(digest of the metadata read, the values read), or None when a save replaced the
    checkpoint while it was being read (the caller starts again)."""
    params, buffers = module_targets(module)
    packed = packed_targets(module)
    ck = _Checkpoint(path, expect=len(params) + len(packed) + len(buffers))
    try:
        return ck.digest, _read_values(ck, params, packed, buffers, optimizer, rank, world)
    except ShardwiseError:
        if ck.replaced():  # e.g. its data folder was removed by the save that replaced it
            return None
        raise


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
    if not os.path.isfile(os.path.join(path, META)):
        raise ShardwiseError(f"{path}: not a shardwise checkpoint ({META} is missing)")
    lock = FolderLock(path)
    lock.acquire()
    try:
        ck = _Checkpoint(path, signed=False)
        _check_files(ck)
        for name in ck.meta["files"]:
            ck.file(name)  # size and SHA-256 of every listed file, not only those read
        before, after = ck.meta.get(CHECKSUM), canonical_sha256(ck.meta)
        if before == after:
            return f"{path}: the checksum matches already; nothing written"
        ck.meta[CHECKSUM] = after
        write_json_atomic(os.path.join(path, META), ck.meta)
        was = "no checksum before" if before is None else "the old checksum did not match"
        return f"{path}: signed ({was}); the metadata agrees with the data files"
    finally:
        lock.release()


def _check_files(ck: _Checkpoint) -> None:
    """Cross-check the metadata against what the data files say of themselves (headers
    only, Note [metadata that cannot lie] in _schema.py): every tensor a file holds is
    described, with the dtype and shape the metadata gives it; each rank's file records
    the same pieces as the metadata; no file holds a tensor the metadata does not know
    (a deleted optimizer-state entry would silently reset it)."""
    meta = ck.meta
    pieces = {main: e["pieces"] for main, e in meta["params"].items()}
    packed = {_packed_key(main, inner): (ie["dtype"], ie["pieces"])
              for main, e in meta.get("packed", {}).items()
              for inner, ie in e["inner"].items()}
    pieces.update({key: p for key, (_, p) in packed.items()})
    state = (meta.get("optimizer") or {}).get("state") or {}
    for r in range(ck.world_size):
        expected: dict[str, tuple[str, list[int]]] = {}
        for main, e in meta["params"].items():
            expected[f"param/{main}"] = (e["dtype"], [pieces[main][r][1]])
        for name, st in state.items():
            for k, info in st.items():
                if info["kind"] == "sharded":
                    expected[f"optim/{name}/{k}"] = (info["dtype"], [pieces[name][r][1]])
                elif info["kind"] == "replicated":
                    expected[f"optim/{name}/{k}"] = (info["dtype"], info["shape"])
        for key, (dtype, inner_pieces) in packed.items():
            expected[key] = (dtype, [inner_pieces[r][1]])
        fname = rank_file(r, ck.world_size)
        f = ck.file(fname)
        where = f"{ck.data}/{fname}"
        _check_tensors(f, where, expected, optional_prefix="rng/")
        # A data file recording its pieces is checked as format 2, whatever the metadata
        # claims (Note [metadata that cannot lie]).
        if meta["format_version"] >= 2 or PIECES in (f.metadata() or {}):
            _check_pieces(f, where, {main: p[r] for main, p in pieces.items()})
    if meta.get("buffers"):
        _check_tensors(ck.file(BUFFERS_FILE), f"{ck.data}/{BUFFERS_FILE}",
                       {n: (e["dtype"], e["shape"]) for n, e in meta["buffers"].items()})


def _check_tensors(f, where: str, expected: dict[str, tuple[str, list[int]]],
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
        piece = f.get_slice(key)
        want = _ST_DTYPES[dtype_from_name(dtype)]
        if piece.get_dtype() != want or list(piece.get_shape()) != list(shape):
            raise ShardwiseError(f"{where}: {key} is {piece.get_dtype()} "
                                 f"{list(piece.get_shape())} in the file, the metadata says "
                                 f"{want} {list(shape)}")
    for key in ("rng/torch", "rng/cuda"):
        if key in keys and (f.get_slice(key).get_dtype() != "U8"
                            or len(f.get_slice(key).get_shape()) != 1):
            raise ShardwiseError(f"{where}: {key} is not an RNG state (1-D uint8)")


def _check_pieces(f, where: str, pieces: dict[str, list[int]]) -> None:
    """A rank's file names the pieces it holds; the metadata must say the same."""
    try:
        recorded = json.loads((f.metadata() or {})[PIECES])
    except (KeyError, ValueError) as e:
        raise ShardwiseError(f"{where}: its header does not record its pieces") from e
    if recorded != pieces:
        wrong = sorted(n for n in set(pieces) | set(recorded if isinstance(recorded, dict)
                                                     else {})
                       if not isinstance(recorded, dict) or recorded.get(n) != pieces.get(n))
        raise ShardwiseError(f"{where}: holds other pieces than the metadata says, for "
                             f"{summary(wrong)} (e.g. {wrong[0]}: the file holds "
                             f"{recorded.get(wrong[0]) if isinstance(recorded, dict) else '?'}"
                             f", the metadata says {pieces.get(wrong[0])})")


def _read_optimizer(ck: _Checkpoint, optimizer, matched, packed_names: dict[int, str],
                    deferred: list[Callable[[], None]]):
    """The optimizer's state dict, read and checked. State that lives on a disk tier is
    not read here: ``deferred`` gets, per tensor, what reads it into its tier's file
    once the load applies (Note [streamed load])."""
    meta = ck.meta.get("optimizer")
    if meta is None:
        raise ShardwiseError(f"{ck.path}: holds no optimizer state")
    if meta["class"] != type(optimizer).__name__:
        raise ShardwiseError(f"{ck.path}: optimizer state is {meta['class']}'s, not "
                             f"{type(optimizer).__name__}'s")
    target_of = {}
    for t, main, entry in matched:
        key = t.sharded.shard if t.sharded is not None else t.plain
        target_of[id(key)] = (t, main, entry)
    for shard_id, main in packed_names.items():  # frozen: named in groups, no state
        target_of[shard_id] = (None, main, None)
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ShardwiseError(f"{ck.path}: {len(groups)} optimizer parameter groups saved, the "
                             f"optimizer has {len(optimizer.param_groups)}")
    state, new_groups, index = {}, [], 0
    for i, (saved, group) in enumerate(zip(groups, optimizer.param_groups)):
        mains = [target_of[id(p)][1] if id(p) in target_of else None for p in group["params"]]
        if mains != saved["params"]:
            raise ShardwiseError(f"{ck.path}: optimizer parameter groups hold different "
                                 f"parameters than when saved")
        ids = []
        for p in group["params"]:
            t, main, entry = target_of[id(p)]
            saved_state = meta["state"].get(main)
            if saved_state and t is None:
                raise ShardwiseError(f"{ck.path}: optimizer state for the quantized "
                                     f"parameter {main}, which is frozen")
            if saved_state:
                lo, n = t.local_range()
                st = {}
                for k, info in saved_state.items():
                    key = f"optim/{main}/{k}"
                    if info["kind"] == "value":
                        st[k] = info["value"]
                    elif info["kind"] == "sharded" and _disk_store(t) is not None:
                        read = functools.partial(ck.assemble, key, entry["pieces"], lo, n,
                                                 dtype_from_name(info["dtype"]))
                        deferred.append(functools.partial(_adopt_state, optimizer, p, t, k,
                                                          read))
                    elif info["kind"] == "sharded":
                        flat = ck.assemble(key, entry["pieces"], lo, n,
                                           dtype_from_name(info["dtype"]))
                        st[k] = (t.sharded.as_dtensor(flat.view(t.sharded.local.shape))
                                 if t.sharded is not None else flat.view(t.shape))
                    else:
                        st[k] = ck.file(rank_file(0, ck.world_size)).get_tensor(key)
                state[index] = st
            ids.append(index)
            index += 1
        hyper = _hyperparameters(saved, group, f"{ck.path}: optimizer.param_groups[{i}]")
        new_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": new_groups}


# Note [streamed load]
# A disk tier's state is not read into memory when a load checks the checkpoint: its
# parameter rows and optimizer state are read one tensor at a time once the load applies,
# each written into its tier's file and its pages released (Note [the disk tier]), so
# that the state of an offloaded model larger than memory loads as it saved (Note
# [streamed save]). What is checked before anything changes is unchanged: the files were
# verified (sizes, SHA-256, pieces) and stay open, so a save replacing the checkpoint
# meanwhile cannot change what is read.
def _disk_store(t: ParamTarget) -> GroupStorage | None:
    """The storage of ``t``'s group when its optimizer tier is the disk."""
    sp = t.sharded
    store = sp.group.store if sp is not None and sp.group is not None else None
    return store if store is not None and store.placement.optimizer == "disk" else None


def _adopt_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, t: ParamTarget,
                 key: str, read: Callable[[], torch.Tensor]) -> None:
    """Read one optimizer state tensor of ``p`` into its tier's file (Note [streamed
    load])."""
    sp, store = t.sharded, _disk_store(t)
    assert sp is not None and store is not None
    flat = read()
    optimizer.state[p][key] = store.adopt_state(sp, key, sp.as_dtensor(flat.view(
        sp.local.shape)))
    store.release()
    freed(flat.numel() * flat.element_size())  # Note [freed memory]


def _hyperparameters(saved: dict, live: dict, where: str) -> dict:
    """The saved group's hyperparameters, checked against the live optimizer's group:
    every one the optimizer has is present, of the same type (a number for a number, a
    list of as many numbers for a tuple, ...), so that ``step()`` cannot fail on them
    later. JSON turned tuples (AdamW's betas) into lists: they are restored."""
    out = {}
    for k, want in live.items():
        if k == "params":
            continue
        if k not in saved:
            raise ShardwiseError(f"{where}: lacks the hyperparameter {k!r} the optimizer has")
        got = saved[k]
        if not _same_kind(got, want):
            raise ShardwiseError(f"{where}.{k}: {got!r:.60} where the optimizer has "
                                 f"{type(want).__name__} {want!r:.60}")
        out[k] = tuple(got) if isinstance(want, tuple) else got
    for k, got in saved.items():  # ones this optimizer does not know: kept, as torch does
        if k not in live and k != "params":
            out[k] = got
    return out


def _same_kind(got: Any, want: Any) -> bool:
    if isinstance(want, bool) or want is None or isinstance(want, str):
        return type(got) is type(want)
    if isinstance(want, (int, float)) or (isinstance(want, torch.Tensor) and want.dim() == 0):
        return type(got) in (int, float)
    if isinstance(want, (tuple, list)):
        return (isinstance(got, list) and len(got) == len(want)
                and all(_same_kind(g, w) for g, w in zip(got, want)))
    return True  # a type JSON cannot hold was refused at save; nothing to compare


@operation("load_checkpoint", lambda path, module, **_: (
    comm_of(module), f"load_checkpoint({path_argument(path, 'load_checkpoint')!r})", None))
def load_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size.

    Everything is read and verified (names, shapes, dtypes, file sizes and SHA-256, the
    pieces each file holds, hyperparameter types, RNG states) before anything changes; a
    failure on any rank raises on every rank and leaves the module and optimizer
    untouched. RNG states are restored when the world size is the one saved. A load
    running beside a save into the same folder loads the old or the new checkpoint
    (every rank the same one), starting again if the save replaced it mid-read.

    Args:
        path: the checkpoint folder.
        module: the model, sharded (at any world size) or not.
        optimizer: optional optimizer over ``module.parameters()``, same class and groups.

    Returns:
        ``extra`` exactly as saved.

    Raises:
        ShardwiseError: naming the file and the problem (missing, truncated, corrupt,
            metadata that contradicts the files), or listing missing, unexpected and
            mismatched tensors; ``path`` is not a path, or differs across ranks.

    Example:
        >>> extra = sw.load_checkpoint("ckpt/latest", model, opt)
    """
    path = path_argument(path, "load_checkpoint")
    comm = comm_of(module)
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    what = f"load_checkpoint({path!r}) failed"
    everyone = comm.all_gather_object if comm is not None and world > 1 else (lambda x: [x])
    paths = everyone(path)
    if len(set(paths)) > 1:
        raise ShardwiseError(f"{what}: the ranks were given different paths: "
                             f"{_by_rank(paths)}")
    for _ in range(_LOAD_ATTEMPTS):
        got = agreed(comm, what, lambda: _read_checkpoint(path, module, optimizer, rank, world))
        digest = got[0] if got is not None else None
        digests = everyone(digest)
        if got is not None and None not in digests and len(set(digests)) == 1:
            break
    else:
        raise ShardwiseError(f"{what}: {path} was replaced by another save during each of "
                             f"{_LOAD_ATTEMPTS} attempts to read it; is a job saving into "
                             f"it in a loop?")
    values, buffer_values, (opt_sd, deferred), rng, extra = got[1]

    def apply() -> None:
        apply_values(values, buffer_values)
        if optimizer is not None:
            optimizer.load_state_dict(opt_sd)
            for adopt in deferred:  # Note [streamed load]
                adopt()
        if rng is not None:
            torch.set_rng_state(rng[0])
            if rng[1] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng[1])
            set_python_rng_state(rng[2])

    # Everything that could fail was checked above; should anything still fail on one
    # rank, every rank says so instead of the others going on to hang.
    agreed(comm, f"{what} while applying the checked values", apply, changed=True)
    return extra


_LOAD_ATTEMPTS = 5
