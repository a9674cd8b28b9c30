"""Moves and casts of a sharded model (``model.to(...)``, ``.half()``, ``.to_empty()``:
``nn.Module._apply``): no-ops pass, casts to another floating dtype reach shardwise's
storage, anything else is refused before anything changes (Note [casting after shard]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..._args import some_names
from ..._registry import copy_all_attributes, set_instance_method
from ...errors import ShardwiseError
from ..groups.layout import contiguous_stride
from ..iteration.model_check import CAST_ADVICE
from ..iteration.residency import release
from ..iteration.unit import FlatGroup, sharded_param


def guard_apply(module: nn.Module) -> None:
    """Route ``module``'s moves and casts (``.to(...)``, ``.cpu()``, ``.cuda()``,
    ``.float()``, ``.half()``, ``.to_empty()``...: all ``nn.Module._apply``) through
    :func:`_apply`."""
    set_instance_method(module, "_apply", functools.partial(_apply, module))


# Note [casting after shard]
# A shard must stay a view of its group's flat buffer, and torch's Module._apply would
# replace it by a DTensor of its own. So ``fn`` is first tried on a small probe of each
# shard's dtype, device and dimension, before anything changes:
# - it returns the probe itself (``.to("cpu")`` on CPU, ``.float()`` on fp32): a no-op;
# - it returns the probe's values in another floating dtype, same device and layout
#   (``.to(torch.float64)``, ``.half()``, ``.bfloat16()``): a cast, which shardwise
#   applies to its own storage, as FSDP2 applies it to its shards: each group whose
#   parameters are all cast gets a new flat buffer in the new dtype, and each shard keeps
#   its identity (an optimizer built before holds it) with its contents swapped, as
#   torch swaps a DTensor parameter's (recast, below). Under mixed precision the
#   compute dtype (param_dtype) stays; a reduce dtype equal to the old one follows;
# - anything else (another device, ``to_empty``, channels-last): refused.
# A quantized (packed) parameter is probed as the dtype it stands for: a move or cast that
# changes nothing leaves it as it is (torch would otherwise put a parameter shardwise does
# not know in its place), and a cast is refused, since it would dequantize it.
# A cast is refused, with nothing changed, where the storage is not at rest or cannot
# follow: part of a group cast (a unit's parameters are cast together), a unit inside
# gathered(), a model between a forward and its backward or with sw.no_sync gradients
# waiting, offloaded or quantized parameters, and the reproducible mode (its exact sums
# are of float32). The optimizer's existing state keeps its dtype, as under FSDP2 and
# on an unsharded model: cast before the first step.
def _apply(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor],
           recurse: bool = True) -> nn.Module:
    """``nn.Module._apply`` for a module of a sharded model (Note [casting after shard]).

    Moves and casts that change nothing are no-ops; casts to another floating dtype are
    applied to shardwise's storage; any other change raises before anything changes. The
    shards are then held out while torch applies ``fn`` to the rest (buffers).
    """
    def shards() -> list[tuple[nn.Module, str, Any]]:
        return [(m, name, t) for m in (module.modules() if recurse else [module])
                for name, t in m._parameters.items()
                if t is not None and sharded_param(t) is not None]

    probes: dict[tuple, torch.dtype | bool] = {}
    casts: dict[int, tuple[Any, torch.dtype]] = {}  # id(ShardedParam) -> (it, dtype)
    changed: dict[str, None] = {}
    # Tensor subclasses a cast would reach (gathered as bytes: their strategy refuses).
    subclasses: dict[str, Any] = {}
    for _, _, t in shards():
        sp = sharded_param(t)
        assert sp is not None
        # Probed as the dtype it stands for: a tensor subclass too, so that a
        # no-op leaves it alone (held out below); torch would otherwise rebuild it as a
        # parameter shardwise does not know, and a cast would dequantize it.
        key = (sp.dtype, sp.local.device, len(sp.shape))
        if key not in probes:
            probes[key] = _probe(fn, *key)
        change = probes[key]
        if isinstance(change, torch.dtype) and not sp.by_rows:
            subclasses[sp.fqns[0]] = sp
        elif isinstance(change, torch.dtype):
            casts[id(sp)] = (sp, change)
        elif change:
            changed[sp.fqns[0]] = None
    if changed:
        raise ShardwiseError(
            f"{len(changed)} parameter(s) ({some_names(list(changed))}) cannot be moved after "
            f"sw.shard (model.to(device), .cuda(), .to_empty(), channels-last, ...): their "
            f"shards would leave shardwise's storage and training would silently use the "
            f"old values. Nothing was changed; a move that changes nothing (.to('cpu') on "
            f"CPU) is allowed, and so is a cast to another floating dtype (.to(torch."
            f"float64), .half()). Move the model before sw.shard")
    if subclasses:
        first = next(iter(subclasses.values()))
        raise ShardwiseError(first.gather.cast_refusal(list(subclasses)))
    if casts:
        for g, dtype in _cast_groups(module, list(casts.values())):
            recast(g, dtype)
    held = shards()  # after a cast resharded a unit left gathered: its shards
    for m, name, _ in held:
        m._parameters[name] = None  # skipped by torch, and keeps the parameters' order
    try:
        return nn.Module._apply(module, fn, recurse)
    finally:
        for m, name, t in held:
            m._parameters[name] = t


def _probe(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
           device: torch.device, dim: int) -> torch.dtype | bool:
    """What ``fn`` does to a parameter of this dtype, device and dimension: ``False``
    for nothing, a dtype for a plain cast to it, ``True`` for anything else."""
    probe = torch.arange(2 ** dim, device=device).to(dtype).reshape((2,) * dim)
    with torch.no_grad():
        out = fn(probe)
    if out is probe:
        return False
    if (isinstance(out, torch.Tensor) and type(out) is torch.Tensor
            and out.device == probe.device and out.dtype != dtype
            and out.dtype.is_floating_point and out.shape == probe.shape
            and out.is_contiguous() and torch.equal(out, probe.to(out.dtype))):
        return out.dtype
    return True


def _cast_groups(module: nn.Module, casts: list[tuple[Any, torch.dtype]]
                 ) -> list[tuple[Any, torch.dtype]]:
    """The groups a cast changes, each with its new dtype; a ShardwiseError, before
    anything changes, where one cannot be cast (Note [casting after shard])."""
    by_group: dict[int, tuple[Any, torch.dtype, list[str]]] = {}
    for sp, dtype in casts:
        g = sp.group
        entry = by_group.setdefault(id(g), (g, dtype, []))
        entry[2].append(sp.fqns[0])
    problems = []
    for g, _, names in by_group.values():
        unit = g.params[0].unit
        if len(names) < len(g.params):
            left = [p.fqns[0] for p in g.params if p.fqns[0] not in names]
            problems.append(f"{some_names(names)} would be cast without {some_names(left)}, which "
                            f"unit {unit.name} holds in the same buffer: cast the whole "
                            f"unit (or model)")
        elif unit.pins:
            problems.append(f"unit {unit.name} is held by an open sw.gathered() block")
        elif unit.model.awaiting_backward:
            problems.append("the model is between a forward and its backward")
        elif g.reduction.has_accumulated() or unit.deferred:
            problems.append(f"unit {unit.name} holds gradients accumulated under "
                            f"sw.no_sync")
        elif (why := g.cast_refusal()) is not None:
            problems.append(why)
        # A group of tensor subclasses in the unit is never cast: it says why.
        problems += [why for o in unit.groups
                     if not o.by_rows and (why := o.cast_refusal()) is not None]
    if problems:
        raise ShardwiseError(
            f"the parameters of {type(module).__name__} cannot be cast now: "
            + "; ".join(dict.fromkeys(problems)) + ". Nothing was changed. " + CAST_ADVICE)
    out = []
    for g, dtype, _ in by_group.values():
        unit = g.params[0].unit
        release(unit)  # a unit left gathered by a forward without backward (no comms)
        out.append((g, dtype))
    return out


def recast(g: FlatGroup, dtype: torch.dtype) -> None:
    """Note [casting after shard]: hold the parameters in ``dtype`` from now on. The
    group must be at rest (sharded, nothing reducing, not offloaded): the caller,
    :func:`_apply`, checked."""
    old = g.dtype
    g.dtype = dtype
    if g.precision.compute == old:  # else mixed precision's param_dtype stays
        g.precision.compute = dtype
    if g.precision.reduce == old:
        g.precision.reduce = dtype
    g.storage.recast(dtype, g.compute_dtype)
    g.full = torch.empty(g.layout.full_numel, dtype=g.compute_dtype, device=g.device)
    for p in g.params:
        p.local = p.gather.local_of(g.local, g.comm.rank)
        p.dtype = dtype
        # The shard keeps its identity (an optimizer built before holds it): its
        # contents are swapped for a DTensor over the new buffer, as torch's own
        # Module._apply swaps a DTensor parameter's, its attributes and our record
        # carried over. Its gradient is cast, as torch casts it.
        grad = p.shard.grad
        with torch.no_grad():
            dt = DTensor.from_local(p.local, g.topology.mesh, g.topology.placements,
                                    run_check=False, shape=p.shape,
                                    stride=contiguous_stride(p.shape))
        shard = nn.Parameter(dt, requires_grad=p.shard.requires_grad)
        copy_all_attributes(p.shard, shard)
        torch.utils.swap_tensors(p.shard, shard)
        if grad is not None:
            p.shard.grad = p.as_dtensor(cast(DTensor, grad).to_local().to(dtype))
        # A new full parameter over the new full buffer: nothing holds the old one
        # while the unit is sharded. Its end-of-backward trigger is registered again.
        old_full = p.full
        p.full = nn.Parameter(p.gather.full_of(g.full), requires_grad=p.requires_grad)
        copy_all_attributes(old_full, p.full)
        p.hooked = False
        if p.requires_grad:
            p.hook_end_of_backward()
    g.free()
