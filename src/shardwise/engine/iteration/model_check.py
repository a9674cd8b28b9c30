"""What each root forward checks of the model: shards cast, moved or moved out, and
parameters added after ``shard``, refused; ``requires_grad`` changes taken up (Note
[freezing after shard]), and those made between a forward and its backward followed for
that backward.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..._args import some_names
from ...errors import ShardwiseError
from .residency import Residencies
from .unit import FlatGroup, ShardedParam, Unit, sharded_param

# Shared with the refusal of casts (engine/entry_points/casts.py): what to do instead.
CAST_ADVICE = ("Cast or move the model before sw.shard, or keep fp32 master weights and "
               "compute in low precision with sw.shard(model, mixed_precision="
               "sw.MixedPrecision(param_dtype=torch.bfloat16))")


def check_model(root: nn.Module, units: list[Unit], residency: Residencies,
                follow_flags: bool = True) -> None:
    """Raise if the model changed under shardwise since ``shard`` (at each root forward).

    Replacing a shard's data (``p.data = ...``, or a cast of the parameter itself; casts
    of modules are handled by :func:`guard_apply`) detaches it from shardwise's storage;
    a parameter added later would be neither sharded nor kept identical across ranks.
    Each would train silently wrong. ``requires_grad`` changes are taken up here when
    ``follow_flags`` (a forward that records a graph, Note [flags of a forward without
    gradients] in engine/iteration/unit.py), except while ``no_sync`` gradients wait and
    where a group's storage refuses them (an offloaded unit's, in part: Note [freezing
    after shard]); what keeps units gathered is then settled again (``residency``, Note
    [residency] in engine/iteration/residency.py).
    """
    moved = [n for u in units for g in u.groups for n in detached(g)]
    # Note [freezing after shard]: every change is checked before any is taken up.
    changes = [(g, *freezing_changes(g)) for u in units for g in u.groups] \
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
    # A frozen tensor subclass unfrozen after shard: its group gathers bytes and reduces
    # nothing (Note [one group type]), so it would train silently not at all; refused as
    # sw.shard refuses a trainable one, in its gather strategy's words.
    thawed = [p for u in units for g in u.groups if not g.by_rows
              for p in g.params if p.shard.requires_grad or p.full.requires_grad] \
        if follow_flags else []
    if thawed:
        raise ShardwiseError(thawed[0].gather.gradient_refusal([p.fqns[0] for p in thawed]))
    if flipped and why == "no_sync":
        raise ShardwiseError(
            f"requires_grad of {len(flipped)} parameter(s) ({some_names(flipped)}) changed while "
            f"gradients accumulated under sw.no_sync (or require_backward_grad_sync=False) "
            f"wait for their reduction, and some of them were frozen holding a gradient "
            f"of an earlier micro-batch: a part of the step's sum for a parameter that no "
            f"longer trains. Change requires_grad between steps, after the synced "
            f"backward (Note [freezing after shard])")
    if flipped:  # ``why``: the group's storage says (Note [freezing after shard])
        raise ShardwiseError(
            f"requires_grad of {len(flipped)} parameter(s) ({some_names(flipped)}) changed after "
            f"sw.shard {why}")
    for g, ch, _ in changes:
        if ch:
            follow_freezing(g, ch)
            residency.unsettle()
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


class FrozenForBackward:
    """Note [flags of a forward without gradients] in engine/iteration/unit.py: a parameter
    frozen on its shard between its forward and its backward gets no gradient, as autograd
    gives none to a leaf frozen after its forward: its full parameter, which autograd
    accumulates into, is frozen for that backward."""

    def __init__(self) -> None:
        self.params: list[ShardedParam] = []

    def freeze(self, units: list[Unit]) -> None:
        """A backward starts: freeze the full parameters of shards frozen since."""
        for u in units:
            for g in u.trainable_groups:
                for p in g.params:
                    if p.requires_grad and not p.shard.requires_grad and p.full.requires_grad:
                        p.full.requires_grad_(False)
                        self.params.append(p)

    def thaw(self) -> None:
        """The backward ended: the shard's flag is taken up at the next forward that
        records a graph (Note [freezing after shard])."""
        for p in self.params:
            p.full.requires_grad_(p.requires_grad)
        self.params = []


def detached(g: FlatGroup) -> list[str]:
    """Names of parameters whose shard no longer views ``local``.

    ``model.to(dtype)``, ``.half()``, ``.cuda()`` and ``p.data = ...`` replace a shard's
    storage: the optimizer would then update a tensor that is never gathered.
    Nothing for tensor subclasses: frozen, no optimizer steps them.
    """
    if not g.by_rows:
        return []
    home = g.local.untyped_storage().data_ptr()
    out = []
    for p in g.params:
        mine = p.shard._local_tensor if isinstance(p.shard, DTensor) else p.shard
        if (p.shard.dtype != g.dtype or mine.device != g.local.device
                or mine.untyped_storage().data_ptr() != home):
            out.append(p.fqns[0])
    return out


def freezing_changes(g: FlatGroup) -> tuple[list[tuple[ShardedParam, bool]], str]:
    """Note [freezing after shard]: the ``requires_grad`` changes made since the last
    root forward, as (parameter, new value), and why they cannot be followed ("" when
    they can: :func:`follow_freezing`). A group of tensor subclasses is frozen for
    good (Note [one group type])."""
    changed: list[tuple[ShardedParam, bool]] = []
    if not g.by_rows:
        return changed, ""
    for p in g.params:
        wanted = p.shard.requires_grad
        if wanted == p.requires_grad:
            wanted = p.full.requires_grad  # set while the unit was gathered
        if wanted != p.requires_grad:
            changed.append((p, wanted))
    # Gradients accumulated under no_sync wait in the reduction, or in the full
    # parameters of a held unit (Note [gathered across micro-batches]). A parameter
    # frozen while it holds one of them is refused: its part of the step's sum has no
    # meaning DDP's would share. Anything else is followed (Note [freezing after
    # shard]): a parameter unfrozen gets the later micro-batches' gradients, one
    # frozen without a gradient so far gets none.
    if changed and (g.reduction.has_accumulated()
                    or any(p.full.grad is not None for p in g.params)):
        index = {id(p): i for i, p in enumerate(g.params)}
        if any(not wanted and (g.reduction.used[index[id(p)]]
                               or p.full.grad is not None) for p, wanted in changed):
            return changed, "no_sync"
    if changed:
        return changed, g.storage.freezing_refusal(len(changed), len(g.params),
                                                   g.trainable_at_build)
    return changed, ""


def follow_freezing(g: FlatGroup, changes: list[tuple[ShardedParam, bool]]) -> None:
    """Take up ``changes`` (from :func:`freezing_changes`, which allowed them)."""
    for p, wanted in changes:
        p.requires_grad = wanted
        p.shard.requires_grad_(wanted)
        p.full.requires_grad_(wanted)
        if wanted:
            p.hook_end_of_backward()
    g.requires_grad = any(p.requires_grad for p in g.params)
    if not g.requires_grad:  # no gradient of it waits (freezing_changes): drop it
        g.reduction.clear(list(range(len(g.params))))
