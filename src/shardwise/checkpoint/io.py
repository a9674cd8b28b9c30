"""``save_checkpoint`` / ``load_checkpoint``: sharded, atomic, reshardable, no pickle.

See _format.py for the layout and Note [atomic save]. Each rank writes the pieces it
stores; a load at another world size reads, for each new piece, the slices of the old
pieces that overlap it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from typing import Any

import safetensors.torch
import torch
import torch.nn as nn
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from .._agree import agreed
from .._order_check import announce
from .._registry import model_state
from ..buffers import BufferPolicy
from ..consistency import check_consistency
from ..errors import ShardwiseError
from ._format import (
    BUFFERS_FILE,
    FORMAT,
    FORMAT_VERSION,
    META,
    dtype_from_name,
    dtype_name,
    fsync_dir,
    inside,
    rank_file,
    read_json,
    verify_file,
    write_atomic,
    write_json_atomic,
)
from ._schema import CHECKSUM, canonical_sha256, validate
from ._targets import ParamTarget, apply_values, comm_of, module_targets


def _py_rng() -> list:
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def _set_py_rng(saved: list) -> None:
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


def _optimizer_parts(optimizer: torch.optim.Optimizer, name_of: dict[int, str]):
    """Split an optimizer's state into JSON metadata and this rank's tensors."""
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
                if isinstance(v, DTensor):
                    v = v.to_local()  # this rank's rows, like the parameter's
                value = v.detach().to("cpu", copy=True).contiguous()
                # State shaped like the parameter is stored flat: it is cut into the same
                # pieces as the parameter, and reloads at any world size.
                tensors[f"optim/{name}/{k}"] = value.reshape(-1) if sharded else value
                entry[k] = {"kind": "sharded" if sharded else "replicated",
                            "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
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


def save_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    extra: Any = None) -> None:
    """Save a sharded checkpoint into the folder ``path``, atomically.

    Holds every rank's parameter pieces, the buffers (checked identical across ranks
    first; under the ``"local"`` buffer policy, rank 0's are saved without the check), the
    optimizer state, the step, RNG states and ``extra``. Data is safetensors,
    metadata JSON; nothing is pickled. A crash at any moment leaves the previous checkpoint
    in ``path`` intact and loadable (Note [atomic save] in _format.py).

    Args:
        path: the checkpoint folder (created if needed; a previous checkpoint there is
            replaced only once the new one is complete).
        module: the model, sharded or not.
        optimizer: optional optimizer built over ``module.parameters()``.
        extra: a JSON value (dicts with string keys, lists, strings, numbers, booleans,
            None), returned exactly by :func:`load_checkpoint`.

    Raises:
        DivergenceError: buffers differ across ranks (nothing is written).
        ShardwiseError: ``extra`` or optimizer hyperparameters do not survive JSON; the
            optimizer holds parameters that are not the module's; or the model is inside
            its forward/backward or a ``gathered()`` block.

    Example:
        >>> sw.save_checkpoint("ckpt/latest", model, opt, extra={"epoch": 3})
    """
    path = os.fspath(path)
    comm = comm_of(module)
    announce(comm, "save_checkpoint")
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    state = model_state(module)
    if comm is not None and not (state is not None
                                 and state.buffers.policy is BufferPolicy.LOCAL):
        check_consistency(module, group=comm.group)
    what = f"save_checkpoint({path!r}) failed"
    # Note [agreed failure] in _agree.py: a non-JSON extra on one rank, a path that is a
    # file, a read-only or full disk each become one error on every rank.
    params, buffers, tensors, opt_meta = agreed(
        comm, what, lambda: _prepare(module, optimizer, extra))
    data_dir = _new_data_dir(path, comm, rank, world, what)
    try:
        mine = agreed(comm, what,
                               lambda: _write_data(data_dir, rank, world, tensors, buffers))
        mine["pieces"] = {t.names[0]: list(t.local_range()) for t in params}
        everyone = comm.all_gather_object(mine) if comm is not None and world > 1 else [mine]

        def commit() -> None:
            if rank == 0:
                meta = _metadata(module, params, buffers, opt_meta, tensors, everyone,
                                 extra, world)
                meta["data"] = os.path.basename(data_dir)
                _commit(path, data_dir, meta)

        agreed(comm, what, commit)  # nobody returns before the commit
    except ShardwiseError:
        if rank == 0:  # the failed save's own data, not the last good checkpoint's
            shutil.rmtree(data_dir, ignore_errors=True)
        raise


def _prepare(module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Any):
    """This rank's view of what to save (checks included); nothing is written."""
    _json_ok(extra, "extra", exact=True)
    params, buffers = module_targets(module)
    tensors, opt_meta = _local_tensors(params, optimizer)
    return params, buffers, tensors, opt_meta


def _local_tensors(params: list[ParamTarget], optimizer: torch.optim.Optimizer | None,
                   ) -> tuple[dict[str, torch.Tensor], dict | None]:
    """This rank's parameter pieces, optimizer-state pieces and RNG states, and the
    optimizer's metadata."""
    name_of: dict[int, str] = {}
    for t in params:
        key = t.sharded.shard if t.sharded is not None else t.plain
        name_of[id(key)] = t.names[0]
    tensors = {f"param/{t.names[0]}": t.local_values().to("cpu", copy=True).contiguous()
               for t in params}
    opt_meta = None
    if optimizer is not None:
        opt_meta, opt_tensors = _optimizer_parts(optimizer, name_of)
        tensors.update(opt_tensors)
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    return tensors, opt_meta


def _new_data_dir(path: str, comm, rank: int, world: int, what: str) -> str:
    """A fresh ``data-<id>`` folder, created by rank 0 before anyone writes into it."""
    data_id = uuid.uuid4().hex[:12] if rank == 0 else None
    if comm is not None and world > 1:
        data_id = comm.all_gather_object(data_id)[0]
    data_dir = os.path.join(path, f"data-{data_id}")

    def make() -> None:
        if rank == 0:
            try:
                os.makedirs(data_dir, exist_ok=False)
            except OSError as e:
                raise ShardwiseError(f"cannot create {data_dir}: {e}") from e

    agreed(comm, what, make)
    return data_dir


def _write_data(data_dir: str, rank: int, world: int, tensors: dict[str, torch.Tensor],
                buffers: dict[str, torch.Tensor]) -> dict:
    """Write this rank's file (and rank 0 the buffers); what rank 0 must record of it."""
    fname = rank_file(rank, world)
    info = write_atomic(os.path.join(data_dir, fname),
                        safetensors.torch.save(tensors, metadata={"format": FORMAT}))
    files = {fname: info}
    if rank == 0 and buffers:
        buf = {n: b.detach().to("cpu", copy=True).contiguous() for n, b in buffers.items()}
        files[BUFFERS_FILE] = write_atomic(
            os.path.join(data_dir, BUFFERS_FILE),
            safetensors.torch.save(buf, metadata={"format": FORMAT}))
    return {"file": fname, "files": files, "python_rng": _py_rng()}


def _metadata(module: nn.Module, params: list[ParamTarget], buffers: dict[str, torch.Tensor],
              opt_meta: dict | None, tensors: dict[str, torch.Tensor], everyone: list[dict],
              extra: Any, world: int) -> dict:
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
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        meta["hf_config"] = json.loads(config.to_json_string())
    return meta


def _commit(path: str, data_dir: str, meta: dict) -> None:
    """Replace ``checkpoint.json`` (the commit point), then remove other data folders."""
    meta[CHECKSUM] = canonical_sha256(meta)
    write_json_atomic(os.path.join(path, META), meta)
    fsync_dir(path)
    for entry in os.listdir(path):  # earlier checkpoints' data and crashed attempts
        full = os.path.join(path, entry)
        if entry.startswith("data-") and full != data_dir and os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)


def _step_of(opt_meta: dict, tensors: dict[str, torch.Tensor]) -> int | None:
    """The optimizer's step count (torch optimizers keep it per parameter)."""
    for name, st in opt_meta["state"].items():
        s = st.get("step")
        if s is not None:
            return int(s["value"] if s["kind"] == "value"
                       else tensors[f"optim/{name}/step"].item())
    return None


class _Checkpoint:
    """A verified view of a checkpoint folder's metadata and files."""

    def __init__(self, path: str) -> None:
        self.path = path
        meta_path = os.path.join(path, META)
        if not os.path.isfile(meta_path):
            raise ShardwiseError(f"{path}: not a shardwise checkpoint ({META} is missing)")
        try:
            self.meta = read_json(meta_path)
        except (OSError, ValueError) as e:
            raise ShardwiseError(f"{meta_path}: unreadable ({e})") from e
        validate(self.meta, meta_path)  # Note [metadata that cannot lie]
        self.data = inside(path, self.meta.get("data"), f"{meta_path}: field 'data'")
        self.world_size = self.meta["world_size"]
        self._handles: dict[str, Any] = {}

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
            self._handles[name] = safe_open(full, framework="pt", device="cpu")
        return self._handles[name]

    def assemble(self, key: str, pieces: list[list[int]], lo: int, n: int,
                 dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, lo+n)`` of a sharded tensor saved as per-rank pieces."""
        out = torch.empty(n, dtype=dtype)
        for r, (off, cnt) in enumerate(pieces):
            a, b = max(lo, off), min(lo + n, off + cnt)
            if b <= a:
                continue
            f = self.file(rank_file(r, self.world_size))
            out[a - lo:b - lo] = f.get_slice(key)[a - off:b - off]
        return out


def _match_params(ck: _Checkpoint, params: list[ParamTarget]):
    by_name = {}
    for main, entry in ck.meta["params"].items():
        for n in entry["names"]:
            by_name[n] = (main, entry)
    matched, missing, mismatched, used = [], [], [], set()
    for t in params:
        hit = next((by_name[n] for n in t.names if n in by_name), None)
        if hit is None:
            missing.append(t.names[0])
            continue
        main, entry = hit
        used.add(main)
        if tuple(entry["shape"]) != t.shape or entry["dtype"] != dtype_name(t.dtype):
            mismatched.append(f"{t.names[0]}: checkpoint {entry['dtype']} {entry['shape']}, "
                              f"model {dtype_name(t.dtype)} {list(t.shape)}")
            continue
        matched.append((t, main, entry))
    unexpected = [m for m in ck.meta["params"] if m not in used]
    return matched, missing, mismatched, unexpected


def _plan_load(path: str, module: nn.Module, optimizer, rank: int, world: int):
    ck = _Checkpoint(path)
    params, buffers = module_targets(module)
    matched, missing, mismatched, unexpected = _match_params(ck, params)
    saved_buffers = ck.meta.get("buffers", {})
    for n, b in buffers.items():
        e = saved_buffers.get(n)
        if e is None:
            missing.append(n)
        elif tuple(e["shape"]) != tuple(b.shape) or e["dtype"] != dtype_name(b.dtype):
            mismatched.append(f"{n}: checkpoint {e['dtype']} {e['shape']}, model "
                              f"{dtype_name(b.dtype)} {list(b.shape)}")
    unexpected += [n for n in saved_buffers if n not in buffers]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"not in the model: {unexpected}")
    if mismatched:
        problems.append("mismatched: " + "; ".join(mismatched))
    if problems:
        raise ShardwiseError(f"{path}: " + "; ".join(problems))

    _check_headers(ck, matched)
    values = []
    for t, main, entry in matched:
        lo, n = t.local_range()
        values.append((t, ck.assemble(f"param/{main}", entry["pieces"], lo, n, t.dtype)))
    buffer_values = []
    if buffers:
        f = ck.file(BUFFERS_FILE)
        buffer_values = [(b, f.get_tensor(n)) for n, b in buffers.items()]

    opt_sd = None
    if optimizer is not None:
        opt_sd = _plan_optimizer(ck, optimizer, matched)
    rng = None
    if ck.world_size == world:
        f = ck.file(rank_file(rank, world))
        rng = (f.get_tensor("rng/torch"),
               f.get_tensor("rng/cuda") if "rng/cuda" in f.keys() else None,
               ck.meta["python_rng"][rank])
    return values, buffer_values, opt_sd, rng, ck.meta.get("extra")


def _check_headers(ck: _Checkpoint, matched) -> None:
    """Cross-check the metadata against what the data files hold (their headers only):
    each rank's piece of each parameter has the recorded length, and every optimizer
    tensor a file holds is described (a deleted state entry would silently reset it)."""
    state = (ck.meta.get("optimizer") or {}).get("state") or {}
    described = {f"optim/{name}/{k}" for name, st in state.items()
                 for k, info in st.items() if info["kind"] != "value"}
    pieces = {main: entry["pieces"] for _, main, entry in matched}
    sharded = {f"optim/{name}/{k}": name for name, st in state.items()
               for k, info in st.items() if info["kind"] == "sharded"}
    for r in range(ck.world_size):
        fname = rank_file(r, ck.world_size)
        f = ck.file(fname)
        keys = set(f.keys())
        for _, main, entry in matched:
            key = f"param/{main}"
            length = f.get_slice(key).get_shape()[0] if key in keys else None
            if length != entry["pieces"][r][1]:
                raise ShardwiseError(f"{ck.data}/{fname}: {key} holds {length} elements, "
                                     f"the metadata's piece {entry['pieces'][r]} says "
                                     f"{entry['pieces'][r][1]}")
        for key, name in sharded.items():
            if name in pieces and key in keys:
                length = f.get_slice(key).get_shape()[0]
                if length != pieces[name][r][1]:
                    raise ShardwiseError(f"{ck.data}/{fname}: {key} holds {length} elements, "
                                         f"the parameter's piece says {pieces[name][r][1]}")
        stray = sorted(k for k in keys if k.startswith("optim/") and k not in described)
        if stray and ck.meta.get("optimizer") is not None:
            raise ShardwiseError(f"{ck.data}/{fname}: holds optimizer state the metadata "
                                 f"does not describe: {stray[:3]}")


def _plan_optimizer(ck: _Checkpoint, optimizer, matched):
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
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ShardwiseError(f"{ck.path}: {len(groups)} optimizer parameter groups saved, the "
                             f"optimizer has {len(optimizer.param_groups)}")
    state, new_groups, index = {}, [], 0
    for saved, group in zip(groups, optimizer.param_groups):
        mains = [target_of[id(p)][1] if id(p) in target_of else None for p in group["params"]]
        if mains != saved["params"]:
            raise ShardwiseError(f"{ck.path}: optimizer parameter groups hold different "
                                 f"parameters than when saved")
        ids = []
        for p in group["params"]:
            t, main, entry = target_of[id(p)]
            saved_state = meta["state"].get(main)
            if saved_state:
                lo, n = t.local_range()
                st = {}
                for k, info in saved_state.items():
                    key = f"optim/{main}/{k}"
                    if info["kind"] == "value":
                        st[k] = info["value"]
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
        # JSON turned tuples (AdamW's betas) into lists: restore them.
        hyper = {k: tuple(v) if isinstance(v, list) and isinstance(group.get(k), tuple) else v
                 for k, v in saved.items() if k != "params"}
        new_groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": new_groups}


def load_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint`, at any world size.

    Everything is read and verified (names, shapes, dtypes, file sizes and SHA-256) before
    anything changes; a failure on any rank raises on every rank and leaves the module and
    optimizer untouched. RNG states are restored when the world size is the one saved.

    Args:
        path: the checkpoint folder.
        module: the model, sharded (at any world size) or not.
        optimizer: optional optimizer over ``module.parameters()``, same class and groups.

    Returns:
        ``extra`` exactly as saved.

    Raises:
        ShardwiseError: naming the file and the problem (missing, truncated, corrupt), or
            listing missing, unexpected and mismatched tensors.

    Example:
        >>> extra = sw.load_checkpoint("ckpt/latest", model, opt)
    """
    path = os.fspath(path)
    comm = comm_of(module)
    announce(comm, "load_checkpoint")
    rank, world = (comm.rank, comm.world_size) if comm else (0, 1)
    values, buffer_values, opt_sd, rng, extra = agreed(
        comm, f"load_checkpoint({path!r}) failed",
        lambda: _plan_load(path, module, optimizer, rank, world))
    apply_values(values, buffer_values)
    if optimizer is not None:
        optimizer.load_state_dict(opt_sd)
    if rng is not None:
        torch.set_rng_state(rng[0])
        if rng[1] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng[1])
        _set_py_rng(rng[2])
    return extra
