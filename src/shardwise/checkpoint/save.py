"""``save_checkpoint``: each rank writes its pieces, rank 0 commits; atomic, no pickle.

Note [atomic save]
Data files go into a fresh ``data-<id>`` folder that no metadata refers to yet; each is
written to a temporary name, fsynced and renamed. Only then is ``checkpoint.json`` written
to a temporary name, fsynced and moved over the old one with ``os.replace`` (atomic on
POSIX), and the folder is fsynced. A crash before that leaves the old ``checkpoint.json``
pointing at the old, untouched data; a crash after it leaves the new one complete. Stale
``data-*`` folders are removed by the next successful save. Every data file's size and
SHA-256 are in the metadata, so truncation and corruption are reported, by file name.

Note [save protocol] below gives the steps in order. The files are written through
_format.py's ``Writer`` (its layout and encoding are that module's alone); reading is
load.py, verification verify.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._args import require_bool
from .._fs import open_dir, remove_own_files
from ..comm.agree import agreed
from ..comm.order_check import operation
from ..consistency import check_consistency
from ..engine.iteration.buffers import BufferPolicy
from ..engine.iteration.state import model_state
from ..errors import ShardwiseError
from ._format import (
    BUFFERS_FILE,
    DATA_DIR,
    DATA_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    Writer,
    data_folder,
    metadata_path,
    own_meta_temporary,
    rank_file,
    read_metadata,
    remove_data_folder,
    write_metadata,
    write_tensors,
)
from ._lock import FolderLock
from ._messages import by_rank
from ._names import SUBCLASSES, dtype_name, optim_key, parameter_of, part_key
from ._paths import path_argument
from ._rng import python_rng_state, rank_rng_tensors
from ._schema import CHECKSUM, canonical_sha256
from ._targets import (
    ParamTarget,
    Part,
    abandon_unfinished,
    comm_of,
    module_targets,
)
from ._tensor_parallel import checkpoint_comm
from .background import SaveHandle, finish_previous, side_comm, start


def _json_ok(obj: Any, what: str, round_trip: bool = False) -> None:
    """``obj`` must serialise to JSON; with ``round_trip``, come back exactly as it is."""
    try:
        # NaN and infinity are not JSON: Python would write them anyway, as tokens other
        # readers refuse.
        same = json.loads(json.dumps(obj, allow_nan=False)) == obj
    except ValueError as e:
        raise ShardwiseError(f"{what} must be JSON: NaN and infinity are not ({e}); store "
                             f"them as strings or None") from e
    except TypeError as e:
        raise ShardwiseError(f"{what} must be JSON-serialisable: {e}") from e
    if round_trip and not same:
        raise ShardwiseError(f"{what} would not come back from JSON as saved (tuples become "
                             f"lists, non-string keys become strings): {obj!r:.200}")


def _optimizer_parts(optimizer: torch.optim.Optimizer, name_of: dict[int, str],
                     target_of: dict[str, ParamTarget], pending: dict[str, ParamTarget]):
    """Split an optimizer's state into JSON metadata and this rank's tensors: of state
    shaped like its parameter, what the parameter's target saves of its rows (none
    where another replica saves them); those its target exchanges over tp are left as
    the rows, their keys in ``pending`` (Note [tensor-parallel checkpoints] in
    checkpoint/_tensor_parallel.py)."""
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
                    value, target = value.reshape(-1), target_of[name]
                    if target.exchanges:
                        pending[optim_key(name, k)] = target
                    else:
                        value = target.saved_values(value)[:target.saved_range()[1]]
                tensors[optim_key(name, k)] = value
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
#   prepared      every rank: its pieces are in memory (a background save's: copies),
#                 checks passed
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
# the one it named before this save. A background save passes the same steps: up to
# data-folder in the call, from data-tmp on in its thread, over a process group of its
# own (Note [background saves] in checkpoint/background.py).
SAVE_STEPS = ("begin", "prepared", "locked", "data-folder", "data-tmp", "data-written",
              "reports", "meta-tmp", "committed", "agreed", "tidied")


def _reached(step: str) -> None:
    """A step of Note [save protocol] (a point where the crash-point test stops a rank)."""


@operation("save_checkpoint", lambda path, module, **_: (
    comm_of(module), f"save_checkpoint({path_argument(path, 'save_checkpoint')!r})", None))
def save_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: Any = None, *, keep_previous: bool = True,
                    background: bool = False) -> SaveHandle | None:
    """Save a sharded checkpoint into the folder ``path``, atomically.

    Holds every rank's parameter pieces, the buffers (checked identical across ranks
    first; under the ``"local"`` buffer policy, rank 0's are saved without the check), the
    optimizer state, the step, RNG states and ``extra``. Data is safetensors,
    metadata JSON; nothing is pickled. A crash or failure at any moment, on any rank,
    leaves the new or the previous checkpoint in ``path``, complete and loadable (Note
    [atomic save]). One job at a time may save into a folder. A save (or load) first
    waits for this process's background save in flight, if any.

    With ``background=True`` the call returns a :class:`SaveHandle` as soon as this
    rank's state is copied into host memory (the staging), and a thread writes the files
    and commits them, through the same steps (Note [background saves] in
    checkpoint/background.py), while training goes on: the model and optimizer may be
    changed right away. ``handle.wait()`` returns once the checkpoint is committed.
    What it costs: one copy of this rank's state (parameters, optimizer state,
    buffers) in host memory until the write ends, one save in flight per process, and
    the thread's CPU time (hashing, copies into the page cache) beside training's. For a
    model offloaded to disk (``sw.Offload(..., "disk")``) the staging reads the disk
    tier's whole state into host memory, which the disk tier exists to avoid; a
    synchronous save streams it with a few MiB instead (Note [streamed save]). A staging
    that would not fit in the memory available is refused, on every rank, before
    anything is written.

    Args:
        path: the checkpoint folder (created if needed; a previous checkpoint there is
            replaced only once the new one is complete).
        module: the model, sharded or not.
        optimizer: optional optimizer built over ``module.parameters()``.
        extra: a JSON value (dicts with string keys, lists, strings, numbers, booleans,
            None), returned exactly by :func:`load_checkpoint`. With ``background``, its
            value at the call is saved (a copy: changing it afterwards changes nothing).
        keep_previous: keep the replaced checkpoint's data folder until the next save, so
            that a load that started before this save still finds its files (it costs
            the disk space of one more checkpoint). With False it is removed at once; a
            load it interrupts starts again from the new checkpoint.
        background: return once the state is staged, and write it on a thread.

    Returns:
        None, or with ``background`` the :class:`SaveHandle` of the write.

    Raises:
        DivergenceError: buffers differ across ranks (nothing is written).
        ShardwiseError: on every rank: ``path`` is not a path or differs across ranks;
            another job is saving into ``path`` (naming it); ``extra`` or optimizer
            hyperparameters do not survive JSON; the optimizer holds parameters that are
            not the module's; the model is inside its forward/backward or a
            ``gathered()`` block; a write failed on some rank (a full or read-only disk;
            with ``background``, raised by ``wait()``); the previous background save
            failed and no ``wait()`` took its error (this call then does nothing); with
            ``background``, the staged copy would not fit in the memory available.

    Example:
        >>> sw.save_checkpoint("ckpt/latest", model, opt, extra={"epoch": 3})
        >>> handle = sw.save_checkpoint("ckpt/latest", model, opt, background=True)
        >>> ...                                        # training goes on
        >>> handle.wait()                              # committed
    """
    path = path_argument(path, "save_checkpoint")
    require_bool(keep_previous, "save_checkpoint", "keep_previous")
    require_bool(background, "save_checkpoint", "background")
    model_comm = comm_of(module)
    # A tensor-parallel model's checkpoint spans its dp and tp ranks (Note
    # [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
    comm = checkpoint_comm(module, model_comm)
    what = f"save_checkpoint({path!r}) failed"
    previous = finish_previous(comm)  # Note [background saves]: one in flight
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    state = model_state(module)
    if model_comm is not None and not (state is not None
                                       and state.buffers.policy is BufferPolicy.LOCAL):
        check_consistency(module, group=model_comm.group)
    _reached("begin")
    # Note [agreed failure] in comm/agree.py: a non-JSON extra on one rank, a path that is a
    # file, a read-only or full disk each become one error on every rank.
    staged = agreed(comm, what, lambda: _prepare(module, optimizer, extra, rank, world,
                                                 stage=background, previous=previous))
    agreed(comm, what, staged.exchange)  # every rank checked what it saves
    _reached("prepared")
    side = side_comm(comm) if background else None
    folder = _Folder(path, keep_previous) if rank == 0 else None
    try:
        data_dir = _new_data_dir(path, comm, rank, world, what, folder)
    except BaseException:
        if folder is not None:
            folder.close()
        raise

    def write(over) -> None:
        try:
            _write_and_commit(staged, data_dir, over, rank, world, what, folder)
        finally:
            if folder is not None:
                folder.close()

    if background:
        return start(path, comm, lambda: write(side))
    write(comm)
    return None


def _write_and_commit(staged: _Staged, data_dir: str, comm, rank: int, world: int,
                      what: str, folder: _Folder | None) -> None:
    """Steps ``data-tmp`` to ``agreed`` of Note [save protocol]: the data files, the
    reports, the commit. ``comm`` is the training's group, or with a background save the
    side group (Note [background saves]); nothing here reads the model."""
    mine = agreed(comm, what, lambda: _write_data(data_dir, rank, world, staged))
    _reached("data-written")
    everyone = comm.all_gather_object(mine) if comm is not None and world > 1 else [mine]
    _reached("reports")

    def commit() -> None:
        if folder is not None:
            meta = _complete_metadata(staged.meta, everyone)
            meta["data"] = os.path.basename(data_dir)
            folder.commit(meta)

    agreed(comm, what, commit)  # nobody returns before the commit
    _reached("agreed")


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
        _refuse_foreign_metadata(self.path)
        self.previous = _committed_data(self.path)
        try:
            os.makedirs(data_dir, exist_ok=False)
        except OSError as e:
            raise ShardwiseError(f"cannot create {data_dir}: {e}") from e
        _reached("data-folder")

    def commit(self, meta: dict) -> None:
        """Replace ``checkpoint.json``: from here on the new checkpoint is the one."""
        meta[CHECKSUM] = canonical_sha256(meta)
        write_metadata(self.path, meta, before_rename=lambda: _reached("meta-tmp"))
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
        if current is None and os.path.exists(metadata_path(self.path)):
            return  # unreadable metadata: remove nothing rather than guess
        keep = {current, self.previous if self.keep_previous else None}
        # Only data folders and temporary files of saves, as saves write them, never
        # through a link (Note [what shardwise deletes] in _fs.py).
        fd = open_dir(self.path)
        if fd is None:
            return
        try:
            for entry in os.listdir(fd):
                if entry not in keep and DATA_DIR.fullmatch(entry):
                    with contextlib.suppress(OSError):
                        remove_data_folder(fd, entry, self.path)
            with contextlib.suppress(OSError):
                remove_own_files(fd, own_meta_temporary, self.path)
        finally:
            os.close(fd)


def _refuse_foreign_metadata(path: str) -> None:
    """A ``checkpoint.json`` that is JSON but not a shardwise checkpoint's is someone
    else's file: the commit would replace it. Refused, naming it (one that does not parse
    may be a damaged one of ours, which a save is the way to replace)."""
    meta = metadata_path(path)
    try:
        found = read_metadata(path)
    except (OSError, ValueError):
        return
    if not (isinstance(found, dict) and found.get("format") == FORMAT):
        raise ShardwiseError(
            f"{meta} is not a shardwise checkpoint's metadata (its 'format' is "
            f"{found.get('format') if isinstance(found, dict) else None!r}), and a save "
            f"would replace it. Save into another folder, or move that file away")


def _committed_data(path: str) -> str | None:
    """The data folder ``path/checkpoint.json`` names, or None (none, or unreadable)."""
    try:
        data = read_metadata(path).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    return data if isinstance(data, str) and data.startswith(DATA_PREFIX) else None


@dataclass
class _Staged:
    """What a rank writes, taken in the call (Note [background saves]): its tensors (views
    of the live ones, or with ``stage`` copies), the buffers, the pieces its file holds,
    the pages to release after each tensor, Python's RNG state and (rank 0) the metadata
    without the per-rank parts."""

    tensors: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    pieces: dict[str, list[int]]
    releases: dict[str, Callable[[], None]]
    python_rng: list
    meta: dict
    # Tensors still this rank's rows, of parameters whose part is exchanged over tp
    # (Note [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
    pending: dict[str, ParamTarget]

    def exchange(self) -> None:
        """Replace each pending tensor by this rank's part of it: collectives over tp,
        run by every rank once all have checked what they save, in the call (never on a
        background save's thread)."""
        for key, target in self.pending.items():
            self.tensors[key] = target.saved_values(self.tensors[key])
        self.pending = {}


def _prepare(module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any,
             rank: int, world: int, stage: bool = False,
             previous: str | None = None) -> _Staged:
    """This rank's view of what to save (checks included); nothing is written. With
    ``stage``, the tensors and buffers are copies in host memory and ``extra`` a copy,
    so that the model may change once this returns. ``previous``: the error of the
    background save before, raised here (Note [background saves])."""
    if previous is not None:
        raise ShardwiseError(previous)
    _json_ok(extra, "extra", round_trip=True)
    abandon_unfinished(module)
    params, buffers = module_targets(module)
    unsaveable = [why for t in params if (why := t.unsaveable)]
    if unsaveable:
        raise ShardwiseError(unsaveable[0])
    tensors, opt_meta, pending = _local_tensors(params, optimizer, rank)
    pieces = {part.piece: list(part.saved) for part in _parts(params, rank)}
    releases = {t.names[0]: release for t in params
                if (release := t.page_release()) is not None}
    if stage:
        _refuse_unless_it_fits(tensors, buffers)
        tensors = _copies(tensors, releases)
        buffers = _copies(buffers, {})
        releases = {}  # the copies hold no pages
        extra = json.loads(json.dumps(extra))  # checked above to come back as it is
        if opt_meta is not None:
            opt_meta = json.loads(json.dumps(opt_meta))
    meta = (_metadata(module, params, buffers, opt_meta, tensors, extra, world)
            if rank == 0 else {})  # rank 0 commits
    return _Staged(tensors, buffers, pieces, releases, python_rng_state(), meta, pending)


def _copies(tensors: dict[str, torch.Tensor],
            releases: dict[str, Callable[[], None]]) -> dict[str, torch.Tensor]:
    """Contiguous host-memory copies of ``tensors`` (CPU ones too: training changes them
    in place), a disk tier's pages released after each (Note [the disk tier])."""
    out = {}
    for k, v in tensors.items():
        copy = torch.empty(tuple(v.shape), dtype=v.dtype)
        copy.copy_(v.detach())
        out[k] = copy
        owner = parameter_of(k)
        release = releases.get(owner) if owner is not None else None
        if release is not None:
            release()
    return out


def _refuse_unless_it_fits(tensors: dict[str, torch.Tensor],
                           buffers: dict[str, torch.Tensor]) -> None:
    """A staging larger than the memory the OS says is available is refused (Note
    [background saves])."""
    need = sum(t.numel() * t.element_size() for d in (tensors, buffers) for t in d.values())
    available = _available_memory()
    if available is not None and need > available:
        raise ShardwiseError(
            f"a background save stages this rank's state in host memory, {need / 2**20:.0f} "
            f"MiB, and only {available / 2**20:.0f} MiB are available; save with "
            f"background=False, which streams the state to the files a tensor at a time")


def _available_memory() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _parts(params: list[ParamTarget], rank: int) -> list[Part]:
    """Every part this rank's file holds of the parameters: theirs, then the tensor
    subclasses' inner tensors (Note [packed checkpoints]), in the files' order."""
    parts = [part for t in params for part in t.parts(rank)]
    return sorted(parts, key=lambda part: part.inner is not None)  # stable


def _local_tensors(params: list[ParamTarget], optimizer: torch.optim.Optimizer | None,
                   rank: int) -> tuple[dict[str, torch.Tensor], dict | None,
                                       dict[str, ParamTarget]]:
    """This rank's parameter pieces (a tensor subclass's inner tensors' too: Note [packed
    checkpoints]), optimizer-state pieces and RNG states, the optimizer's metadata, and
    the tensors still to exchange over tp (:attr:`_Staged.pending`)."""
    # A frozen tensor subclass an optimizer holds has no state, but is named in its groups.
    name_of = {id(t.tensor): t.names[0] for t in params}
    # Views of the live tensors, not copies: the data file is streamed from them, one at
    # a time (Note [streamed save]); a background save copies them afterwards.
    tensors: dict[str, torch.Tensor] = {}
    pending: dict[str, ParamTarget] = {}
    for part in _parts(params, rank):
        if part.inner is not None:
            tensors[part.key] = part.values[:part.saved[1]]
        elif part.target.exchanges:
            tensors[part.key], pending[part.key] = part.values, part.target
        else:
            tensors[part.key] = part.target.saved_values(part.values)[:part.saved[1]]
    opt_meta = None
    if optimizer is not None:
        target_of = {t.names[0]: t for t in params}
        opt_meta, opt_tensors = _optimizer_parts(optimizer, name_of, target_of, pending)
        tensors.update(opt_tensors)
    tensors.update(rank_rng_tensors())
    return tensors, opt_meta, pending


def _new_data_dir(path: str, comm, rank: int, world: int, what: str,
                  folder: _Folder | None) -> str:
    """A fresh ``data-<id>`` folder, created by rank 0 (holding the folder's lock) before
    anyone writes into it. Every rank must have been given the same ``path``."""
    data_id = uuid.uuid4().hex[:12] if rank == 0 else None
    paths = [path]
    if comm is not None and world > 1:
        seen = comm.all_gather_object((path, data_id))
        paths, data_id = [p for p, _ in seen], seen[0][1]
    data_dir = os.path.join(path, data_folder(str(data_id)))  # rank 0's id, on every rank

    def make() -> None:
        if len(set(paths)) > 1:
            raise ShardwiseError(f"the ranks were given different paths: {by_rank(paths)}")
        if folder is not None:
            folder.start(data_dir)

    agreed(comm, what, make)
    return data_dir


# Note [streamed save]
# A rank's data file is written one tensor at a time, from where each tensor lives (the
# device, host memory, or an offload tier's file), through a writer that knows the
# file's header up front (_format.Writer). The tensors collected before the writes are
# views of the live parameters and optimizer state, not copies: nothing changes them
# during a synchronous save, every rank being inside it. So a save needs memory for one
# tensor at a time, where it needed a copy of the rank's state plus the file's bytes; and
# a disk tier's pages, read for the file, are released after each of its tensors (Note
# [the disk tier]), so the state of an offloaded model larger than memory can be saved
# (docs/offload.md). A background save is the exception: training changes the live
# tensors while its thread writes, so it copies them first (Note [background saves] in
# checkpoint/background.py).
def _write_data(data_dir: str, rank: int, world: int, staged: _Staged) -> dict:
    """Write this rank's file (and rank 0 the buffers); what rank 0 must record of it.

    The file's own header records the pieces it holds, so that metadata claiming other
    pieces is caught at load (Note [metadata that cannot lie] in _schema.py)."""
    tensors = staged.tensors
    fname = rank_file(rank, world)
    writer = Writer(os.path.join(data_dir, fname),
                    [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()],
                    pieces=staged.pieces)
    try:
        for k, v in tensors.items():
            writer.write(k, v)
            owner = parameter_of(k)
            release = staged.releases.get(owner) if owner is not None else None
            if release is not None:
                release()  # its pages, read for the file, leave the process again
    except BaseException:
        writer.abort()
        raise
    files = {fname: writer.finish(before_rename=lambda: _reached("data-tmp"))}
    if rank == 0 and staged.buffers:
        files[BUFFERS_FILE] = write_tensors(os.path.join(data_dir, BUFFERS_FILE),
                                            staged.buffers)
    return {"file": fname, "files": files, "python_rng": staged.python_rng,
            "pieces": staged.pieces}


def _metadata(module: nn.Module, params: list[ParamTarget],
              buffers: dict[str, torch.Tensor], opt_meta: dict | None,
              tensors: dict[str, torch.Tensor], extra: Any, world: int) -> dict:
    """``checkpoint.json`` without what every rank reports (:func:`_complete_metadata`)
    and without ``data``: taken in the call, so that a background save's thread reads
    nothing of the model."""
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "world_size": world,
        "step": _step_of(opt_meta, tensors) if opt_meta else None,
        "module_class": type(module).__name__,
        "params": {t.names[0]: {"names": t.names, "shape": list(t.shape),
                                "dtype": dtype_name(t.dtype), "pieces": None}
                   for t in params if t.kind is None},
        "buffers": {n: {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
                    for n, b in buffers.items()},
        "optimizer": opt_meta,
        "python_rng": None,
        "extra": extra,
        "files": None,
    }
    subclasses = {t.names[0]: _subclass_entry(t) for t in params if t.kind is not None}
    if subclasses:  # Note [packed checkpoints]; absent otherwise, as before it existed
        meta[SUBCLASSES] = subclasses
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        meta["hf_config"] = json.loads(config.to_json_string())
    return meta


def _complete_metadata(base: dict, everyone: list[dict]) -> dict:
    """``checkpoint.json`` (without ``data``), from :func:`_metadata`'s part and every
    rank's report."""
    meta = {**base, "python_rng": [e["python_rng"] for e in everyone],
            "files": {name: info for e in everyone for name, info in e["files"].items()}}
    meta["params"] = {main: {**entry, "pieces": [e["pieces"][main] for e in everyone]}
                      for main, entry in base["params"].items()}
    if SUBCLASSES in base:
        meta[SUBCLASSES] = {
            main: {**entry, "inner": {
                inner: {**record, "pieces": [e["pieces"][part_key(main, inner)]
                                             for e in everyone]}
                for inner, record in entry["inner"].items()}}
            for main, entry in base[SUBCLASSES].items()}
    return meta


def _subclass_entry(t: ParamTarget) -> dict:
    """A tensor subclass's record: its type, shape and dtype, and each inner tensor's
    full shape and dtype; the pieces come from the reports (Note [packed checkpoints])."""
    return {"names": t.names, "type": t.kind, "shape": list(t.shape),
            "dtype": dtype_name(t.dtype),
            "inner": {part.inner: {"shape": list(part.shape),
                                   "dtype": dtype_name(part.dtype), "pieces": None}
                      for part in t.parts(0)}}


def _step_of(opt_meta: dict, tensors: dict[str, torch.Tensor]) -> int | None:
    """The optimizer's step count (torch optimizers keep it per parameter)."""
    for name, st in opt_meta["state"].items():
        s = st.get("step")
        if s is not None:
            return int(s["value"] if s["kind"] == "value"
                       else tensors[optim_key(name, "step")].item())
    return None
