"""``load_checkpoint``: read and verify everything, then change the model, at any world size.

A load at another world size reads, for each new piece, the slices of the old pieces
that overlap it. Files are read through verify.py's ``VerifiedCheckpoint`` (and so
_format.py's ``Reader``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..comm.agree import agreed
from ..comm.order_check import operation
from ..engine.groups.alloc import freed
from ..errors import ShardwiseError
from ._messages import by_rank, summary
from ._names import SUBCLASSES, dtype_from_name, dtype_name, optim_key
from ._paths import path_argument
from ._rng import RankRng, read_rank_rng
from ._targets import (
    ParamTarget,
    Part,
    Value,
    abandon_unfinished,
    apply_values,
    comm_of,
    match_targets,
    module_targets,
)
from ._tensor_parallel import checkpoint_comm
from .background import finish_previous
from .verify import VerifiedCheckpoint, check_files

_LOAD_ATTEMPTS = 5  # reads of a checkpoint replaced meanwhile before giving up


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
    (every rank the same one), starting again if the save replaced it mid-read. A
    background save of this process still in flight is waited for first.

    Args:
        path: the checkpoint folder.
        module: the model, sharded (at any world size) or not.
        optimizer: optional optimizer over ``module.parameters()``, same class and groups.

    Returns:
        ``extra`` exactly as saved.

    Raises:
        ShardwiseError: naming the file and the problem (missing, truncated, corrupt,
            metadata that contradicts the files), or listing missing, unexpected and
            mismatched tensors; ``path`` is not a path, or differs across ranks; the
            previous background save failed and no ``wait()`` took its error (nothing is
            loaded).

    Example:
        >>> extra = sw.load_checkpoint("ckpt/latest", model, opt)
    """
    path = path_argument(path, "load_checkpoint")
    # A tensor-parallel model's checkpoint spans its dp and tp ranks (Note
    # [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
    comm = checkpoint_comm(module, comm_of(module))
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    what = f"load_checkpoint({path!r}) failed"
    previous = finish_previous(comm)  # Note [background saves]: a load sees what was saved
    everyone = comm.all_gather_object if comm is not None and world > 1 else (lambda x: [x])
    paths = everyone(path)
    if len(set(paths)) > 1:
        raise ShardwiseError(f"{what}: the ranks were given different paths: "
                             f"{by_rank(paths)}")
    for _ in range(_LOAD_ATTEMPTS):
        got = agreed(comm, what, lambda: _read_checkpoint(path, module, optimizer, rank, world,
                                                          previous))
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
            rng.restore()

    # Everything that could fail was checked above; should anything still fail on one
    # rank, every rank says so instead of the others going on to hang.
    agreed(comm, f"{what} while applying the checked values", apply, changed=True)
    return extra


def _read_checkpoint(path: str, module: nn.Module, optimizer, rank: int, world: int,
                     previous: str | None = None):
    """(digest of the metadata read, the values read), or None when a save replaced the
    checkpoint while it was being read (the caller starts again). ``previous``: the error
    of the background save before, raised here (Note [background saves])."""
    if previous is not None:
        raise ShardwiseError(previous)
    abandon_unfinished(module)
    params, buffers = module_targets(module)
    ck = VerifiedCheckpoint(path, expect=len(params) + len(buffers))
    try:
        return ck.digest, _read_values(ck, params, buffers, optimizer, rank, world)
    except (ShardwiseError, OSError):
        if ck.replaced():  # e.g. its data folder was removed by the save that replaced it
            return None
        raise


def _read_values(ck: VerifiedCheckpoint, params: list[ParamTarget],
                 buffers: dict[str, torch.Tensor], optimizer, rank: int, world: int) -> tuple:
    """Everything this rank will write into the module, optimizer and RNGs, read and
    checked; nothing is changed. A parameter held by rows or whole is matched in the
    metadata's ``params``, a tensor subclass in its section of them (``SUBCLASSES``,
    Note [packed checkpoints]); then every part of each is read alike."""
    saved = {main: (tuple(e["shape"]), e["dtype"]) for main, e in ck.meta["params"].items()}
    saved.update({n: (tuple(e["shape"]), e["dtype"])
                  for n, e in ck.meta.get("buffers", {}).items()})
    key_of = {n: main for main, e in ck.meta["params"].items() for n in e["names"]}
    key_of.update({n: n for n in ck.meta.get("buffers", {})})
    match = match_targets([t for t in params if t.kind is None], buffers, saved, key_of,
                          "checkpoint")
    problems = match.problems("checkpoint")
    if problems:
        raise ShardwiseError(f"{ck.path}: " + "; ".join(problems))
    matched = [(t, main, ck.meta["params"][main]) for t, main in match.params]

    check_files(ck)
    matched += _match_subclasses(ck, [t for t in params if t.kind is not None])
    values: list[tuple[Part, Value]] = []
    for t, main, entry in matched:
        for part in t.parts(rank):
            if part.inner is None:
                read = functools.partial(t.read_local, functools.partial(
                    ck.assemble, part.key_for(main), entry["pieces"], dtype=part.dtype))
            else:
                read = functools.partial(ck.assemble, part.key_for(main),
                                         entry["inner"][part.inner]["pieces"], *part.local,
                                         part.dtype)
            values.append((part, read if t.streams_state else read()))  # Note [streamed load]
    buffer_values = []
    if buffers:
        f = ck.buffers()
        buffer_values = [(b, f.read(key)) for b, key in match.buffers]

    opt_sd = None
    deferred: list[Callable[[], None]] = []
    if optimizer is not None:
        opt_sd = _read_optimizer(ck, optimizer, matched, deferred)
    rng: RankRng | None = None
    if ck.world_size == world:
        f = ck.rank(rank)
        rng = read_rank_rng(f, ck.meta["python_rng"][rank], f.path)
    return values, buffer_values, (opt_sd, deferred), rng, ck.meta.get("extra")


def _match_subclasses(ck: VerifiedCheckpoint, subclasses: list[ParamTarget]
                      ) -> list[tuple[ParamTarget, str, dict]]:
    """The tensor subclasses each with its saved name and record (Note [packed
    checkpoints]), checked against the model's: the same type, shape and dtype, inner
    tensors of the same full shapes and dtypes (the subclass's strategy phrases a
    difference: what it suggests is the mode's)."""
    saved = ck.meta.get(SUBCLASSES, {})
    key_of = {n: main for main, e in saved.items() for n in e["names"]}
    problems: list[str] = []
    matched: list[tuple[ParamTarget, str, dict]] = []
    taken: set[str] = set()
    for t in subclasses:
        present = [n for n in t.names if n in key_of]
        if not present:
            problems.append(f"{t.names[0]}: not among the checkpoint's tensor subclasses")
            continue
        main = key_of[present[0]]
        e, parts = saved[main], t.parts(0)
        taken.add(main)
        mine = (t.kind, list(t.shape), dtype_name(t.dtype))
        inner = sorted(str(part.inner) for part in parts)
        if (e["type"], e["shape"], e["dtype"]) != mine or sorted(e["inner"]) != inner:
            problems.append(f"{t.names[0]}: the checkpoint holds a {e['type']} "
                            f"{e['shape']} {e['dtype']} with {sorted(e['inner'])}, the "
                            f"model a {mine[0]} {mine[1]} {mine[2]} with {inner}")
            continue
        if t.unsaveable:
            problems.append(t.unsaveable)
            continue
        wrong = []
        for part in parts:
            ie = e["inner"][part.inner]
            if (tuple(ie["shape"]), ie["dtype"]) != (part.shape, dtype_name(part.dtype)):
                wrong.append(t.record.gather.inner_mismatch(
                    t.names[0], part.inner, f"{ie['dtype']} {ie['shape']}",
                    f"{dtype_name(part.dtype)} {list(part.shape)}"))
        problems += wrong
        if not wrong:
            matched.append((t, main, e))
    unexpected = [m for m in saved if m not in taken]
    if unexpected:
        problems.append(f"tensor subclasses the model does not have: {summary(unexpected)}")
    if problems:
        raise ShardwiseError(f"{ck.path}: " + "; ".join(problems))
    return matched


def _read_optimizer(ck: VerifiedCheckpoint, optimizer, matched,
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
    # A tensor subclass is frozen: named in the optimizer's groups, without state.
    target_of = {id(t.tensor): (t, main, entry) for t, main, entry in matched}
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
            if saved_state and t.kind is not None:
                raise ShardwiseError(f"{ck.path}: optimizer state for the tensor "
                                     f"subclass {main}, which is frozen")
            if saved_state:
                st = {}
                for k, info in saved_state.items():
                    key = optim_key(main, k)
                    read = functools.partial(t.read_local, functools.partial(
                        ck.assemble, key, entry["pieces"], dtype=dtype_from_name(info["dtype"])))
                    if info["kind"] == "value":
                        st[k] = info["value"]
                    elif info["kind"] == "sharded" and t.streams_state:
                        deferred.append(functools.partial(_adopt_state, optimizer, p, t, k,
                                                          read))
                    elif info["kind"] == "sharded":
                        flat = read()
                        st[k] = (t.sharded.as_dtensor(flat.view(t.sharded.local.shape))
                                 if t.sharded is not None else flat.view(t.shape))
                    else:
                        st[k] = ck.rank(0).read(key)
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
def _adopt_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, t: ParamTarget,
                 key: str, read: Callable[[], torch.Tensor]) -> None:
    """Read one optimizer state tensor of ``p`` into its tier's file (Note [streamed
    load])."""
    flat = read()
    optimizer.state[p][key] = t.adopt_state(key, flat)
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
