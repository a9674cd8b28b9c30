"""``build``: the engine's one entry point, building a sharded model from an agreed plan.

``shard`` (sharding.py) checks its arguments, plans, has the ranks agree, and calls
:func:`build` with the :class:`~shardwise.engine.plan.Plan`; a deep copy
(engine/clone.py) calls :func:`build_copy` over twins of the original's groups. Both end
in :func:`_assemble`, so everything a sharded model carries is made and registered here,
once:

1. the groups (:func:`build`, ``shard`` only): one unit at a time, each group laid
   out, given ``src_rank``'s values and registered in place of the original parameters,
   which are released before the next group is built (Note [freed memory] in
   engine/groups/alloc.py); a unit's frozen tensor subclasses make one group of their own
   (Note [one group type] in engine/groups/flat.py);
2. the buffers, on the device and ``src_rank``'s on every rank (``shard`` only);
3. the units and the model state (:func:`_assemble`), every setting to a constructor;
4. the hooks:
   - module hooks on each unit and on a wrapper root's entries (engine/iteration/hooks.py) and
     state-dict hooks (engine/entry_points/state_dict.py), by :func:`build` only: a deep copy's
     modules carry copies of them, which find their unit through the module they run on;
   - the process-wide step hooks (engine/entry_points/step.py), once per process;
   - each trainable full parameter's end-of-backward trigger
     (``ShardedParam.hook_end_of_backward``, also what a parameter unfrozen later gets);
5. the registry entries and the guards (engine/entry_points/guards.py,
   engine/entry_points/casts.py, engine/entry_points/zero_grad.py), and
   the copy guard (engine/clone.py), handed :func:`build_copy` to build copies with.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from .._log import logger
from .._registry import (
    TP_ORIGINAL,
    attached,
    detach_from,
    mark_collective_forward,
    remove_instance_method,
)
from ..comm.collectives import Comm
from ..comm.mesh import Topology, secondary_groups
from ..errors import ShardwiseError
from .clone import BuiltUnit, guard_model_copies
from .entry_points.casts import guard_apply
from .entry_points.guards import guard_ddp, guard_resize, guard_save_pretrained, retire
from .entry_points.state_dict import install_state_dict_hooks
from .entry_points.step import install_step_hooks
from .entry_points.zero_grad import guard_module_zero_grad
from .groups.alloc import freed, trim
from .groups.flat import flat_group, subclass_group
from .groups.parts import Placement
from .iteration import hooks
from .iteration.buffers import BufferSync
from .iteration.state import ModelState, Settings, set_model_state
from .iteration.unit import FlatGroup, Unit, set_unit
from .plan import GroupSpec, ParamRecord, Plan, UnitPlan
from .sharded_init import clear_init_piece, full_value, init_piece


def build(root: nn.Module, plan: Plan, topology: Topology, device: torch.device,
          settings: Settings) -> ModelState:
    """Build ``root``'s sharded model from ``plan``, which every rank agreed on, in place:
    steps 1 to 5 of this module's docstring. Returns the model state."""
    regather = _regather_group(topology, settings.reshard_after_forward)
    built = [_build_unit(u, topology, device, settings, regather if i else None,
                         plan.placement)
             for i, u in enumerate(plan.units)]
    trim()  # Note [freed memory]
    install_step_hooks(plan.placement)  # Note [the optimizer step]: its part, if any
    _materialise_buffers(root, topology.world.rank, device, settings.src_rank)
    buffers = BufferSync(root, topology.world, plan.buffers, settings.src_rank,
                         exact=settings.reproducible)
    buffers.broadcast_all()
    modules = [module for _, module, _ in built]
    for module in modules:
        module.register_forward_pre_hook(hooks.pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(hooks.post_forward, with_kwargs=True)
        module.register_forward_hook(hooks.forward_raised, always_call=True)
    hooks.install_entries(root, modules)  # Note [forward entries]
    install_state_dict_hooks(root)
    state = _assemble(root, topology, built, buffers, settings)
    _log_units(state.units, topology)
    return state


def build_copy(root: nn.Module, topology: Topology, units: list[BuiltUnit],
               buffers: BufferSync, settings: Settings) -> ModelState:
    """The engine of a deep copy (Note [deep copy] in engine/clone.py): ``units`` hold
    the twins of the original's groups, installed on the copied modules; steps 3 to 5."""
    remove_instance_method(root, "save_pretrained")  # the original's guard: made again
    return _assemble(root, topology, units, buffers, settings)


def _assemble(root: nn.Module, topology: Topology, units: list[BuiltUnit],
              buffers: BufferSync, settings: Settings) -> ModelState:
    """Steps 3 to 5: ``units`` are ``(name, module, groups)``, the root's first, in module
    order."""
    built = [Unit(module, name, groups, settings.reshard_after_forward,
                  is_root=(i == 0), cast_inputs=settings.cast_inputs)
             for i, (name, module, groups) in enumerate(units)]
    state = ModelState(root, topology, built, buffers, settings)
    install_step_hooks()  # Note [the optimizer step]
    for unit in built:
        set_unit(unit.module, unit)
        for sp in unit.params:
            if sp.requires_grad:  # one unfrozen later is hooked then (follow_freezing)
                sp.hook_end_of_backward()
    set_model_state(root, state)
    guard_save_pretrained(root)
    guard_resize(root)
    guard_ddp(root)
    for sub in root.modules():
        mark_collective_forward(sub)
        guard_apply(sub)
        guard_module_zero_grad(sub)  # Note [zero_grad reaches held gradients]
    guard_model_copies(root, build_copy)
    return state


def _regather_group(topology: Topology, reshard_after_forward: bool | int) -> Comm | None:
    """The group of k ranks a non-root unit's backward gathers in under
    ``reshard_after_forward=k`` (Note [secondary shards] in comm/mesh.py); ``None`` when
    there is none: k is the shard group's size (ZeRO-3 itself), or not an int."""
    if type(reshard_after_forward) is not int \
            or reshard_after_forward == topology.shard.world_size:
        return None
    return secondary_groups(topology, reshard_after_forward)


def _build_unit(unit: UnitPlan, topology: Topology, device: torch.device,
                settings: Settings, regather: Comm | None,
                placement: Placement | None) -> BuiltUnit:
    """One unit's groups: its plain parameters' as planned, then one of its frozen tensor
    subclasses."""
    groups = [_build_group(spec, topology, device, settings.src_rank, regather,
                           settings.reproducible, placement)
              for spec in unit.groups]
    if unit.subclasses:
        groups.append(_build_subclasses(unit.subclasses, topology, device, settings,
                                        placement))
    return unit.name, unit.module, groups


def _build_group(spec: GroupSpec, topology: Topology, device: torch.device,
                 src_rank: int, regather: Comm | None, exact: bool,
                 placement: Placement | None) -> FlatGroup:
    """Flatten one group as its plan laid it out, take ``src_rank``'s values, register
    the DTensor shards in place of the originals, and release the originals."""
    originals = [r.param for r in spec.records]
    # Parameters partitioned by sharded_init (stand-ins on the meta device, each holding
    # its piece) are gathered one group at a time, so no full-model copy exists at any
    # point; any other parameter is its own value, and sharded_init is not asked. Each
    # piece is dropped once its full value is here, and the group's shard allocated
    # after: a rank then holds the group whole once, not beside its pieces and its
    # shard (Note [the embeddings' own units] in planning/units.py: with a quantized
    # base the embeddings and the head are groups of their own).
    values, pieces = [], 0
    for p in originals:
        if p.is_meta:
            values.append(full_value(p))
            pieces += _drop_piece(p)
        else:
            values.append(p.detach())
    freed(pieces)
    g = flat_group([r.fqns for r in spec.records], [r.slots for r in spec.records],
                   originals, spec.layout, topology, device, spec.compute_dtype,
                   spec.reduce_dtype, regather, exact, placement)
    g.fill_local(values if topology.world.rank == src_rank else None, src_rank)
    released = sum(v.numel() * v.element_size() for v in values if v.device.type == "cpu")
    del values
    g.install()
    # Release the originals now, not after the last unit: the old and the new storage of
    # the whole model must never coexist. The records were the last references.
    for rec in spec.records:
        # A tensor-parallel stand-in's DTensor too: an optimizer built before shard holds
        # that one (Note [tensor-parallel parameters] in engine/groups/tensor_parallel.py).
        for original in (rec.param, attached(rec.param, TP_ORIGINAL)):
            if original is not None:
                retire(original, rec.fqns[0])
        detach_from(rec.param, TP_ORIGINAL)
        rec.param = None  # type: ignore[assignment]
    freed(released)  # Note [freed memory] in engine/groups/alloc.py
    return g


def _drop_piece(p: torch.Tensor) -> int:
    """Release ``p``'s ``sharded_init`` piece; the bytes it held in host memory."""
    info = init_piece(p)
    if info is None:
        return 0
    clear_init_piece(p)
    return info.piece.nbytes if info.piece.device.type == "cpu" else 0


def _build_subclasses(records: list[ParamRecord], topology: Topology, device: torch.device,
                      settings: Settings, placement: Placement | None) -> FlatGroup:
    """A unit's frozen tensor subclasses (Note [packed parameters] in
    engine/groups/subclass.py): their bytes from ``src_rank``, registered in place of the
    originals, which are released."""
    g = subclass_group([r.fqns for r in records], [r.slots for r in records],
                       [r.param for r in records], topology, device, settings.cast_inputs,
                       settings.src_rank, settings.reproducible, placement)
    g.install()
    for rec in records:
        rec.param = None  # type: ignore[assignment]
    return g


def _materialise_buffers(root: nn.Module, rank: int, device: torch.device,
                         src_rank: int) -> None:
    """Put every buffer on ``device``; meta buffers of other ranks become empty tensors,
    filled by the broadcast from ``src_rank`` that follows."""
    for mod in root.modules():
        for bname, b in mod._buffers.items():
            if b is None:
                continue
            if b.is_meta:
                if rank == src_rank:
                    raise ShardwiseError(f"rank {src_rank} (src_rank) holds a meta buffer "
                                         f"{bname!r} of {type(mod).__name__}")
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
            elif b.device != device:
                mod._buffers[bname] = b.to(device)


def _log_units(units: list[Unit], topology: Topology) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    total = sum(p.numel for u in units for g in u.groups if g.by_rows for p in g.params)
    replicas = f", {topology.replicas} replicas" if topology.replicate is not None else ""
    logger.info("sharded %d parameters over %d ranks%s (%s) in %d units", total,
                topology.shard.world_size, replicas, topology.world.backend, len(units))
    for u in units:
        rows = [g for g in u.groups if g.by_rows]  # padding: of plain rows
        n = sum(p.numel for g in rows for p in g.params)
        padded = sum(g.layout.gathered_numel for g in rows)
        logger.info("  unit %-30s %10d parameters in %d group(s), %5.1f%% padding", u.name,
                    n, len(rows), 100.0 * (padded - n) / max(padded, 1))
