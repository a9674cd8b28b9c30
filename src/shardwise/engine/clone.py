"""Deep copies of a sharded model, and the refusal to pickle one.

``copy.deepcopy(model)`` (``torch.optim.swa_utils.AveragedModel``, EMA helpers and DPO
reference models all do it) gives an independent sharded model: the same units, process
group and settings, its own shard buffers holding a copy of this rank's rows, and its own
units and state, which its hooks drive. Each rank copies its own rows: no collective.

Note [deep copy]
A generic deep copy cannot work: a shard is a DTensor viewing a flat buffer, a full
parameter's storage is freed between gathers (copying one reads freed memory: the SIGSEGV
of issue 20), and units and the model state hold the process group. So the copy is made
in three steps:

1. one new flat group per group of the original, holding a copy of its shard buffer;
2. a deep copy of the module tree, with ``memo`` mapping every shard (and every full
   parameter, for a unit gathered at the time) to its new shard, and the units and the
   state to ``None``: the module copies hold the new shards wherever the originals held
   theirs, user attributes included;
3. new units over the copied modules and a new :class:`ModelState`, from the same
   builder as ``shard``'s (``build_copy`` in engine/build.py) and the original's
   settings.

Module and state-dict hooks are copied with their modules; they find their unit through
the module they are called on (``engine/iteration/hooks.py``), so the copy's hooks drive the copy's
units. Every module of a sharded model carries the two methods below in its
``__dict__``, bound (through ``functools.partial``, which a deep copy rebinds) to the
module and the root. The builder installs them with :func:`guard_model_copies`, passing
its ``build_copy`` (:data:`Rebuild`) for step 3: this module cannot import the builder,
which imports it.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any, NoReturn

import torch.nn as nn

from .._registry import set_instance_method
from ..comm.mesh import Topology
from ..errors import ShardwiseError
from .groups.flat import FlatGroup
from .iteration.buffers import BufferSync
from .iteration.state import ModelState, Settings, model_state

# One unit's groups, built and installed, before its Unit is made: (name, module,
# groups). What engine/build.py assembles, for ``shard`` and copies alike.
BuiltUnit = tuple[str, nn.Module, list[FlatGroup]]
# engine/build.py's ``build_copy``: (the copied root, topology, units, buffers, settings)
# -> the copy's model state.
Rebuild = Callable[[nn.Module, Topology, list[BuiltUnit], BufferSync, Settings], ModelState]


def guard_model_copies(root: nn.Module, rebuild: Rebuild) -> None:
    """:func:`guard_copies` on every module of ``root``'s sharded model."""
    for sub in root.modules():
        guard_copies(sub, root, rebuild)


def guard_copies(module: nn.Module, root: nn.Module, rebuild: Rebuild) -> None:
    """Route ``copy.deepcopy`` and pickling of ``module`` (part of ``root``'s sharded
    model) through this module; a copy of the whole model gets its engine from
    ``rebuild``."""
    set_instance_method(module, "__deepcopy__",
                        functools.partial(_deepcopy, module, root, rebuild))
    set_instance_method(module, "__reduce_ex__", functools.partial(_refuse_pickle, module))


def _deepcopy(module: nn.Module, root: nn.Module, rebuild: Rebuild,
              memo: dict[int, Any]) -> nn.Module:
    state = model_state(root)
    assert state is not None, "guard_copies is installed on sharded models only"
    if id(state) in memo:  # a module inside a whole-model copy: step 2 of Note [deep copy]
        return _copy_module(module, memo)
    if module is not root:
        raise ShardwiseError(
            f"copy.deepcopy of a {type(module).__name__} inside a sharded model: its "
            f"parameters belong to the model's units, so only the whole model can be "
            f"copied (copy.deepcopy(model) gives an independent sharded copy). For values, "
            f"use sw.full_state_dict(model) or `with sw.gathered(model):`")
    return _clone(state, memo, rebuild)


def _refuse_pickle(module: nn.Module, protocol: int) -> NoReturn:
    raise ShardwiseError(
        f"a sharded {type(module).__name__} cannot be pickled (torch.save(model), "
        f"copy.copy, multiprocessing): it holds this rank's rows, its units and its "
        f"process group, which cannot be restored elsewhere. Save its weights instead: "
        f"sw.save_checkpoint(path, model, optimizer) to resume (at any world size), "
        f"sw.full_state_dict(model) for one consolidated state dict, or "
        f"torch.save(model.state_dict(), per_rank_file) on every rank for this rank's "
        f"rows. copy.deepcopy(model) makes an independent sharded copy")


def _copy_module(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """What ``copy.deepcopy`` does for a module without a ``__deepcopy__``."""
    cls = type(module)
    clone = cls.__new__(cls)
    memo[id(module)] = clone
    clone.__setstate__(copy.deepcopy(module.__getstate__(), memo))
    return clone


def _clone(state: ModelState, memo: dict[int, Any], rebuild: Rebuild) -> nn.Module:
    """Note [deep copy]."""
    if state.awaiting_backward:
        raise ShardwiseError(
            "copy.deepcopy of a sharded model between a forward and its backward: the "
            "copy would miss this step's gradients. Copy it before the forward or after "
            "the backward")
    if state.mid_step():
        raise ShardwiseError(
            "copy.deepcopy of a reproducible model between the micro-batches of a step: "
            "the copy would miss what they summed so far. Copy it after the step's last "
            "(synced) backward")
    twins: dict[int, FlatGroup] = {}
    for u in state.units:
        for g in u.groups:
            # The same kinds of storage, precision, reduction and secondary shard (Note
            # [secondary shards]: the same groups of k ranks) as the original's, and a
            # copy of this rank's shard (rows, or a tensor subclass's bytes).
            twin = g.twin()
            for old, new in zip(g.params, twin.params):
                memo[id(old.shard)] = memo[id(old.full)] = new.shard
            twins[id(g)] = twin
    memo[id(state)] = None
    for u in state.units:
        memo[id(u)] = None
    root = _copy_module(state.root, memo)
    for twin in twins.values():
        for sp in twin.params:
            sp.slots = [(memo[id(m)], attr) for m, attr in sp.slots]
        twin.install()
    units: list[BuiltUnit] = [(u.name, memo[id(u.module)], [twins[id(g)] for g in u.groups])
                              for u in state.units]
    buffers = BufferSync(root, state.comm, state.buffers.policy, state.src_rank,
                         state.buffers.exact)
    rebuild(root, state.topology, units, buffers, state.settings)
    return root
