"""What each root forward checks of the model: shards cast, moved or moved out, and
parameters added after ``shard``, refused; ``requires_grad`` changes taken up (Note
[freezing after shard]).
"""

from __future__ import annotations

import torch.nn as nn

from ..._args import some_names
from ...errors import ShardwiseError
from .unit import Unit, sharded_param

# Shared with the refusal of casts (engine/entry_points/casts.py): what to do instead.
CAST_ADVICE = ("Cast or move the model before sw.shard, or keep fp32 master weights and "
               "compute in low precision with sw.shard(model, mixed_precision="
               "sw.MixedPrecision(param_dtype=torch.bfloat16))")


def check_model(root: nn.Module, units: list[Unit], follow_flags: bool = True) -> None:
    """Raise if the model changed under shardwise since ``shard`` (at each root forward).

    Replacing a shard's data (``p.data = ...``, or a cast of the parameter itself; casts
    of modules are handled by :func:`guard_apply`) detaches it from shardwise's storage;
    a parameter added later would be neither sharded nor kept identical across ranks.
    Each would train silently wrong. ``requires_grad`` changes are taken up here when
    ``follow_flags`` (a forward that records a graph, Note [flags of a forward without
    gradients] in engine/unit.py), except while ``no_sync`` gradients wait and, in part,
    for offloaded units (Note [freezing after shard]).
    """
    moved = [n for u in units for g in u.groups for n in g.detached()]
    # Note [freezing after shard]: every change is checked before any is taken up.
    changes = [(g, *g.freezing_changes()) for u in units for g in u.groups] \
        if follow_flags else []
    refused = [(p.fqns[0], why) for _, ch, why in changes if why for p, _ in ch]
    flipped = [n for n, _ in refused]
    why = refused[0][1] if refused else ""
    if moved:
        raise ShardwiseError(
            f"{len(moved)} parameter(s) ({some_names(moved)}) were cast or moved after sw.shard "
            f"(p.data = ..., or a cast of the parameter itself), so their shards left "
            f"shardwise's storage and training would silently use the old values. "
            + CAST_ADVICE)
    if flipped and why == "no_sync":
        raise ShardwiseError(
            f"requires_grad of {len(flipped)} parameter(s) ({some_names(flipped)}) changed while "
            f"gradients accumulated under sw.no_sync (or require_backward_grad_sync=False) "
            f"wait for their reduction, and some of them were frozen holding a gradient "
            f"of an earlier micro-batch: a part of the step's sum for a parameter that no "
            f"longer trains. Change requires_grad between steps, after the synced "
            f"backward (Note [freezing after shard])")
    if flipped:
        raise ShardwiseError(
            f"requires_grad of {len(flipped)} parameter(s) ({some_names(flipped)}) changed after "
            f"sw.shard in an offloaded unit: its tiers were laid out for the frozen and "
            f"trainable parameters at sw.shard, so only freezing or unfreezing all of a "
            f"unit's parameters that were trainable then is followed. Set requires_grad "
            f"before sw.shard(model, offload=...) (Note [freezing after shard])")
    for g, ch, _ in changes:
        if ch:
            g.follow_freezing(ch)
    # A shard moved out of its slot: nn.utils.parametrize registered after shard moves
    # the weight into module.parametrizations, whose property then computes with the
    # shard itself, a DTensor among the unit's plain tensors.
    moved_out = [p.fqns[0] for u in units for g in u.groups for p in g.params
                 if any(attr not in m._parameters for m, attr in p.slots)]
    if moved_out:
        raise ShardwiseError(
            f"{len(moved_out)} parameter(s) ({some_names(moved_out)}) no longer sit where "
            f"sw.shard registered them: torch.nn.utils.parametrize registered after "
            f"sw.shard moves a weight into module.parametrizations, where the unit's "
            f"gathers cannot reach it. Register parametrizations before sw.shard(model)")
    added = [n for n, p in root.named_parameters() if sharded_param(p) is None]
    if added:
        raise ShardwiseError(
            f"{len(added)} parameter(s) ({some_names(added)}) are not the shards sw.shard "
            f"registered: added to the model after sw.shard, or put in place of a shard "
            f"(torch.func.functional_call and torch.nn.utils.stateless replace parameters "
            f"for a call, which a sharded model's units cannot follow: they compute with "
            f"the full parameters they gather). Nothing keeps such a parameter identical "
            f"across ranks. Add every module before sw.shard(model); for another set of "
            f"weights, load them (load_state_dict, sw.load_pretrained) or use a copy")
