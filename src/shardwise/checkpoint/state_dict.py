"""Consolidated (full) state dicts of sharded models and of their optimizers."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._args import require_bool
from ..comm.agree import agree
from ..comm.collectives import Comm
from ..comm.order_check import operation
from ..engine.groups.tensor_parallel import tp_of
from ..engine.iteration.state import owning_state
from ..engine.iteration.unit import ShardedParam, sharded_param
from ..errors import ShardwiseError


def _announced(module: nn.Module, **_: Any) -> tuple[Comm, str, int] | None:
    state = owning_state(module)
    return None if state is None else (state.comm, "full_state_dict", state.number)


@operation("full_state_dict", _announced)
def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded module's ``state_dict()``, consolidated on CPU.

    Same keys as the unsharded module (original names; a tied weight under each name, as
    separate tensors), shapes and dtypes; parameters and persistent buffers. One unit is
    gathered at a time, so memory stays near one unit plus the CPU result. Every rank must
    call it.

    Args:
        module: a sharded root, or a submodule of one (keys relative to it; every rank
            passes the same submodule); an unsharded module is simply copied to CPU.
        rank0_only: return an empty dict on ranks other than 0 of the model's group (of
            the world, for an unsharded module).

    Returns:
        ``{name: CPU tensor}``, or ``{}`` on other ranks when ``rank0_only``. Every tensor
        is plain and of its full shape, never a DTensor or a piece.

    Raises:
        ShardwiseError: on every rank, when the module holds a DTensor parameter that is
            not one of its shards (one replaced after ``shard``).

    Example:
        >>> sd = sw.full_state_dict(model)
        >>> if dist.get_rank() == 0:
        ...     safetensors.torch.save_file(sd, "model.safetensors")
    """
    require_bool(rank0_only, "full_state_dict", "rank0_only")
    state = owning_state(module)
    if state is not None:
        keep = not rank0_only or state.comm.rank == 0
    else:
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    sd = module.state_dict(keep_vars=True)
    pieces = [k for k, v in sd.items() if isinstance(v, DTensor) and _param_of(v) is None]
    if pieces:  # every rank sees the same keys: every rank raises, before any collective
        raise ShardwiseError(
            f"full_state_dict would return this rank's rows for {len(pieces)} parameter(s) "
            f"({', '.join(pieces[:3])}{', ...' if len(pieces) > 3 else ''}): DTensors that "
            f"are not shards of this model (a parameter replaced after sw.shard, e.g. by "
            f"load_state_dict(assign=True) or torch.utils.swap_tensors). Replace "
            f"parameters before sw.shard, or load values with model.load_state_dict(sd)")
    full: dict[int, torch.Tensor] = {}
    if state is not None:
        # A submodule of a sharded model gathers the groups holding its parameters only;
        # every rank was given the same submodule, so every rank gathers the same ones.
        wanted = {id(sp) for v in sd.values()
                  if isinstance(v, torch.Tensor) and (sp := _param_of(v)) is not None}
        for unit in state.units:
            for g in unit.groups:
                if not any(id(p) in wanted for p in g.params):
                    continue
                # A tensor subclass (a quantized weight) comes back as it is: the full
                # subclass, its bytes gathered as they are (Note [packed parameters]).
                values = g.gather_values()
                for p in g.params:  # Note [tensor-parallel parameters]: a collective over tp
                    if (tp := tp_of(p)) is not None:
                        values[id(p)] = tp.full_tensor(values[id(p)])
                if keep:
                    for p in g.params:
                        v = values[id(p)]
                        full[id(p)] = (v.to("cpu", copy=True) if type(v) is torch.Tensor
                                       else v.to("cpu"))
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    given: set[int] = set()
    for key, value in sd.items():
        sp = _param_of(value) if isinstance(value, torch.Tensor) else None
        if sp is not None:
            # A tied weight gets its own copy under each further name, so the result can
            # go straight to safetensors, which refuses tensors sharing memory.
            out[key] = full[id(sp)].clone() if id(sp) in given else full[id(sp)]
            given.add(id(sp))
        elif isinstance(value, torch.Tensor):
            out[key] = _cpu_copy(value)
        else:
            out[key] = value
        if isinstance(value, torch.Tensor):
            _check_full(key, out[key], value.shape if sp is None
                        else tp.shape if (tp := tp_of(sp)) is not None else sp.shape)
    return out


def share_tied(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (:func:`full_state_dict` of ``module``) with each tied weight's names
    holding one tensor, as an unsharded module's ``state_dict()`` hands them out. Hugging
    Face's ``save_pretrained`` finds ties by shared storage and writes a tied head once,
    as for the unsharded model; ``full_state_dict`` gives separate copies instead, for
    ``safetensors.torch.save_file``, which refuses shared tensors."""
    if not state:
        return state
    out, first = dict(state), dict[int, str]()
    for key, value in module.state_dict(keep_vars=True).items():
        p = _param_of(value) if isinstance(value, torch.Tensor) else None
        if p is None or key not in out:
            continue
        if id(p) in first:
            out[key] = out[first[id(p)]]
        else:
            first[id(p)] = key
    return out


def _param_of(t: torch.Tensor) -> ShardedParam | None:
    return sharded_param(t)


def _check_full(key: str, got: torch.Tensor, shape: torch.Size) -> None:
    """The promise of :func:`full_state_dict`, checked on every tensor it returns: plain
    and of the full shape, never a DTensor or a piece."""
    if isinstance(got, DTensor) or tuple(got.shape) != tuple(shape):
        raise ShardwiseError(
            f"internal: full_state_dict's value for {key} is a {type(got).__name__} of shape "
            f"{tuple(got.shape)}, not the full {tuple(shape)}; please report this")


def _announced_optimizer(module: nn.Module, **_: Any) -> tuple[Comm, str, int] | None:
    state = owning_state(module)
    return (None if state is None
            else (state.comm, "full_optimizer_state_dict", state.number))


@operation("full_optimizer_state_dict", _announced_optimizer)
def full_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                              rank0_only: bool = True) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` as over the unsharded module, consolidated on CPU.

    The layout of ``torch.optim.Optimizer.state_dict()`` (``state`` numbered as torch
    numbers the parameters, ``param_groups`` with their hyperparameters), where each state
    tensor shaped like a sharded parameter (AdamW's moments, ...) is the full tensor, plain
    and on CPU, as an unsharded model's optimizer would hold it. Every rank passing it to
    ``optimizer.load_state_dict`` takes its own rows (Note [optimizers meet shards]), at
    any world size, and an optimizer over the unsharded model loads it as it is: save it
    on rank 0 beside :func:`full_state_dict`, load that file on every rank (the DDP
    habit). One tensor is gathered at a time. Every rank must call it.

    Args:
        module: the sharded model the optimizer was built over (an unsharded module: the
            optimizer's state is simply copied to CPU).
        optimizer: a ``torch.optim.Optimizer`` over ``module.parameters()``.
        rank0_only: return an empty dict on ranks other than 0 of the model's group.

    Returns:
        ``{"state": {index: {name: value}}, "param_groups": [...]}``, or ``{}`` on other
        ranks when ``rank0_only``.

    Raises:
        ShardwiseError: on every rank, when the optimizer holds a shard of another model,
            state that is a DTensor not shaped like its parameter, or state that differs
            in keys or shapes across ranks.

    Example:
        >>> sd = sw.full_state_dict(model)
        >>> osd = sw.full_optimizer_state_dict(model, optimizer)
        >>> if dist.get_rank() == 0:
        ...     torch.save({"model": sd, "optimizer": osd}, "ckpt.pt")
        >>> ck = torch.load("ckpt.pt")        # on resume, every rank
        >>> model.load_state_dict(ck["model"])
        >>> optimizer.load_state_dict(ck["optimizer"])
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ShardwiseError(f"full_optimizer_state_dict: optimizer must be a "
                             f"torch.optim.Optimizer, got {type(optimizer).__name__}")
    require_bool(rank0_only, "full_optimizer_state_dict", "rank0_only")
    state = owning_state(module)
    sd = optimizer.state_dict()
    if state is None:
        keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
        return _to_cpu(sd) if keep else {}
    keep = not rank0_only or state.comm.rank == 0
    params = [p for g in optimizer.param_groups for p in g["params"]]
    order = list({id(p): p for p in params}.values())  # as state_dict() numbers them
    _agree_layout(sd, order, state)
    out = _gathered_state(sd, order, keep)
    if not keep:
        return {}
    return {"state": out, "param_groups": _to_cpu(sd["param_groups"])}


def _agree_layout(sd: dict[str, Any], order: list[torch.Tensor], state: Any) -> None:
    """Everything that could differ between ranks, agreed before the first gather, so
    that every rank gathers the same tensors in the same order (or every rank raises)."""
    error, layout = None, []
    try:
        layout = _layout(sd, order, state)
    except ShardwiseError as e:
        error = str(e)
    agree(state.comm, error, "full_optimizer_state_dict")
    everyone = state.comm.all_gather_object(layout, what="full_optimizer_state_dict's layout")
    differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
    if differ:
        raise ShardwiseError(f"full_optimizer_state_dict: the optimizer's state on rank(s) "
                             f"{differ} differs from rank 0's (other state names, shapes or "
                             f"dtypes): did every rank step the same parameters? Nothing "
                             f"was gathered")


def _gathered_state(sd: dict[str, Any], order: list[torch.Tensor], keep: bool
                    ) -> dict[Any, Any]:
    """``sd["state"]`` with each sharded state tensor gathered in full, on CPU (every
    rank gathers; only where ``keep`` are the full tensors kept)."""
    out: dict[Any, Any] = {}
    for idx, st in sd["state"].items():  # the same order on every rank: _agree_layout
        sp = sharded_param(order[idx]) if isinstance(idx, int) else None
        entry: dict[str, Any] = {}
        for k, v in st.items():
            if sp is not None and isinstance(v, DTensor):
                full = _gather_rows(sp, v, f"{sp.fqns[0]}[{k!r}]")
                if keep:
                    entry[k] = full
            elif isinstance(v, torch.Tensor):
                entry[k] = v.detach().to("cpu", copy=True)
            else:
                entry[k] = copy.deepcopy(v)
        out[idx] = entry
    return out


def _layout(sd: dict[str, Any], order: list[torch.Tensor], state: Any) -> list[tuple]:
    """Each state tensor's index, name, shape and dtype, for the ranks to compare; raise
    if the state cannot be gathered: a shard of another model, DTensor state not shaped
    like its parameter, a reproducible model between the micro-batches of a step."""
    others = [sp.fqns[0] for p in order if (sp := sharded_param(p)) is not None
              and (sp.unit is None or sp.unit.model is not state)]
    if others:
        raise ShardwiseError(f"the optimizer holds {len(others)} parameter(s) of another "
                             f"sharded model (e.g. {others[0]}); pass the model the "
                             f"optimizer was built over")
    if state.mid_step():
        raise ShardwiseError("the reproducible model is between the micro-batches of a "
                             "step; call it after the step's last (synced) backward")
    layout = []
    for idx, st in sd["state"].items():
        sp = sharded_param(order[idx]) if isinstance(idx, int) else None
        for k, v in st.items():
            if isinstance(v, DTensor) and (sp is None or tuple(v.shape) != _shape(sp)):
                name = sp.fqns[0] if sp is not None else f"parameter {idx}"
                raise ShardwiseError(
                    f"the state {k!r} of {name} is a DTensor of shape {tuple(v.shape)}, not "
                    f"shaped like its parameter: this optimizer's state cannot be "
                    f"consolidated row by row. Save it with sw.save_checkpoint or "
                    f"torch.distributed.checkpoint")
            if isinstance(v, torch.Tensor):
                layout.append((str(idx), str(k), tuple(v.shape), str(v.dtype)))
    return layout


def _shape(sp: ShardedParam) -> tuple[int, ...]:
    """The parameter's (global) shape: a tensor-parallel one's local tensor is
    ``sp.shape`` (Note [tensor-parallel parameters] in engine/groups/tensor_parallel.py)."""
    tp = tp_of(sp)
    return tuple(sp.shape if tp is None else tp.shape)


def _gather_rows(sp: ShardedParam, value: DTensor, key: str) -> torch.Tensor:
    """The full tensor whose rows each rank of ``sp``'s shard group holds in ``value``
    (shaped like the parameter), on CPU: one all-gather of the rows padded as the shards
    are; for a tensor-parallel parameter, that local tensor then gathered over tp."""
    assert sp.unit is not None
    comm = sp.unit.model.topology.shard
    local = value.to_local().detach()
    chunk = sp.slot.chunk_rows * sp.slot.row_numel
    send = torch.zeros(chunk, dtype=local.dtype, device=comm.device)
    send[:local.numel()].copy_(local.reshape(-1))
    out = torch.empty(chunk * comm.world_size, dtype=local.dtype, device=comm.device)
    comm.all_gather(out, send, what=f"full_optimizer_state_dict ({key})")
    full = out[:sp.numel].view(sp.shape)
    if (tp := tp_of(sp)) is not None:
        full = tp.full_tensor(full)
    return full.to("cpu", copy=True)


def _to_cpu(value: Any) -> Any:
    """``value`` with every tensor copied to CPU (an unsharded optimizer's state dict)."""
    if isinstance(value, torch.Tensor):
        return _cpu_copy(value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return copy.deepcopy(value)


def _cpu_copy(value: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``value``. A wrapper subclass (torchao's ``NF4Tensor``, on a model
    quantized with ``quantize_nf4`` and not sharded) is copied through its inner tensors:
    NF4 refuses ``.to(copy=True)``, its ``.to`` shares them, and its ``clone`` quantizes
    its dequantized values again with the default block sizes."""
    value = value.detach()
    flatten = getattr(value, "__tensor_flatten__", None)
    if type(value) is torch.Tensor or flatten is None:
        return value.to("cpu", copy=True)
    names, context = flatten()
    inner = {n: _cpu_copy(getattr(value, n)) for n in names}
    return type(value).__tensor_unflatten__(  # type: ignore[attr-defined]
        inner, context, value.size(), value.stride())
