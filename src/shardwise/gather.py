"""``gathered()``: full parameters on demand, read-only unless one rank is named to modify.

Note [read-only detection]
A write to a parameter is detected through autograd version counters, which in-place
operations bump: one integer comparison per flat buffer on exit, never a checksum. Full
parameters of one flat group share their buffer's counter, so the counter says *that*
a group was written; only then (the error path) are its parameters compared against a
fresh gather of the untouched shards to name *which*. Writes through ``.data`` bypass
version counters and are not seen. Buffers are small, and some kernels update them without
bumping their counter (BatchNorm's running statistics), so they are compared by value
against a snapshot taken on entry. Ranks agree on the outcome with one small all-reduce,
so every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._args import shown
from .comm.agree import any_rank
from .comm.collectives import Comm
from .comm.order_check import announce
from .comm.peers import ACTIVITY
from .consistency import maybe_check
from .engine.groups.interface import BufferGroup
from .engine.groups.tensor_parallel import refuse
from .engine.iteration.buffers import named_buffers
from .engine.iteration.residency import release
from .engine.iteration.unit import ShardedParam, Unit, sharded_param
from .errors import ReadOnlyGatherError, ShardwiseError


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: a NaN equals itself, and -0.0 differs from 0.0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel full parameter's local tensor (its bytes in the buffer), else
    ``t``: compared locally, never redistributed."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _written_params(comm: Comm, groups: list[BufferGroup], suspects: list[bool]) -> list[str]:
    """What was written among the gathered parameters (error path): the parameters whose
    full values no longer match the shards, or, for a group written without any value
    changing (``add_(0.0)``), every parameter of the group, for its version counter is
    all there is to tell which (Note [read-only detection])."""
    anywhere = comm.all_gather_object([i for i, s in enumerate(suspects) if s])
    union = sorted(set().union(*map(set, anywhere)))
    names = []
    for i in union:
        g = groups[i]
        fresh = g.gather_full().to(g.compute_dtype)
        changed = [p.fqns[0] for p in g.params
                   if not _same_bytes(_local(g.full_value(p, fresh)), _local(p.full))]
        if changed:
            names += [f"parameter {n}" for n in changed]
        else:
            some = [p.fqns[0] for p in g.params]
            if len(some) == 1:
                names.append(f"parameter {some[0]} (by an in-place operation that changed "
                             f"no value: in a read-only block any in-place operation "
                             f"counts)")
            else:
                names.append(f"one of the parameters {', '.join(some[:4])}"
                             f"{', ...' if len(some) > 4 else ''} (by an in-place operation "
                             f"that changed no value: in a read-only block any in-place "
                             f"operation counts, and these share one version counter, "
                             f"which tells only that one of them was written)")
        with torch.no_grad():
            g.full.copy_(fresh)  # an enclosing gathered() block sees the original values
    return names


# Note [saved after the block]
# Inside a gathered() block the module's parameters are full tensors, and code may use
# them directly (``x @ model.head.weight.T``), not through a module call. Autograd then
# saves them for the backward; if that backward runs after the block, the block has
# freed their storage (the unit is sharded again), and torch failed with "setStorage:
# ... out of bounds for storage of size 0". A module call is safe: the engine gathers a
# unit again before its backward. So while a block is open, what autograd saves from
# its full parameters is wrapped, and unwrapping it for a backward whose storage is gone
# raises a ShardwiseError saying what to do. Gathering again there would be a collective
# inside autograd on values an optimizer may have changed since: refused, not done.
# Since Note [full parameters held after gathered()] the storage is never gone, so the
# rule is stated directly: after the block, a saved tensor is unwrapped only while its
# unit is gathered (by an enclosing block, or by the engine for the unit's backward) or
# during the backward the block left awaited (a forward with gradients ran inside it).


# Note [full parameters held after gathered()]
# Code inside a block may keep a full parameter, or a view of one, past its end:
# ``w = model.head.weight``, ``p.detach()`` (``.cpu()`` of a CPU tensor is the tensor
# itself), a unit's forward returning ``self.bias`` (Note [returned parameters] in
# engine/iteration/residency.py). The unit's resharding resized their storage to zero (Note
# [freeing full parameters] in engine/iteration/unit.py) and the next read was a
# segmentation fault. So at the end of the block each unit it gathered leaves its full
# buffer, values and all, to whatever still references it, and takes a new, empty one with
# new full parameter
# objects (``FlatGroup.leave_full``): what was kept reads the values it had in the block
# (a copy, made by nobody), and the old buffer is freed with its last reference, at once
# when there is none. The forward and backward path is unchanged: it frees in place as
# before. An autograd graph built in the block by a module call, whose backward runs
# after the block, still works: the engine gathers the unit into its new buffer before
# that backward, the graph computes with the old buffer's values (the same, or the
# iteration is abandoned, ``recover``), and the gradients it accumulates into the old
# parameter objects are passed on to the new ones (:func:`_pass_on_grad`), where the
# reduction takes them; so are those of a direct use (``x @ w.T``) in that backward.
# ``_LEFT_AT`` says which backward that is: the step the model was in when the block left
# a backward awaited; any later backward through a kept object leaves its gradient
# there, and the object's end-of-backward trigger is removed, so that a user's own
# backward through it starts nothing of the model's. The old objects keep their record
# (``sharded_param``), so an optimizer holding them is still refused (``_refuse_full``
# in engine/entry_points/guards.py). The cost, on this path only: per group, a new empty buffer (its
# allocation momentarily adds one group's full size) and new parameter objects.
_LEFT_AT: weakref.WeakKeyDictionary[Unit, int] = weakref.WeakKeyDictionary()


def _left_behind(old: torch.Tensor, sp: ShardedParam) -> None:
    """Make ``old``, a full parameter object a block's end replaced, pass the gradients
    autograd accumulates into it to the parameter (:func:`_pass_on_grad`), and only
    them: its end-of-backward trigger goes (a user's own backward through a kept
    parameter must not end a backward of the model)."""
    hooks = getattr(old, "_post_accumulate_grad_hooks", None)  # torch's, per tensor
    if hooks is not None:
        hooks.clear()
    if old.requires_grad:
        old.register_post_accumulate_grad_hook(lambda o: _pass_on_grad(o, sp))


def _awaited(unit: Unit) -> bool:
    """Whether the backward a block left awaited, having run forwards with ``unit``'s
    full parameters, has not ended yet (Note [full parameters held after gathered()])."""
    step = _LEFT_AT.get(unit)
    return step is not None and unit.model.awaiting_backward and unit.model.steps == step


def _pass_on_grad(old: torch.Tensor, sp: ShardedParam) -> None:
    """A gradient accumulated into a full parameter object left behind by a block goes
    to the parameter's current one, where the reduction takes it, during the backward
    that block left awaited (Note [full parameters held after gathered()]); else it
    stays (a user's own computation with a kept parameter)."""
    if old.grad is None or sp.full is old or not _awaited(sp.unit):
        return
    grad, old.grad = old.grad, None
    sp.full.grad = grad if sp.full.grad is None else sp.full.grad + grad
    sp.unit.model.ensure_backward_callback(accumulating=True)


class _Saved:
    """A tensor autograd saved from a gathered full parameter (of ``group``)."""

    def __init__(self, tensor: torch.Tensor, session: _GatherSession, unit: Unit) -> None:
        self.tensor = tensor
        self.session = session
        self.unit = unit

    def unpack(self) -> torch.Tensor:
        # The tensor keeps its values after the block, and its gradient reaches the
        # shards during the backward the block left awaited (Note [full parameters held
        # after gathered()]); any other backward would compute with values an optimizer
        # may have changed since.
        if self.session.ended and not (_awaited(self.unit) or self._gathered()):
            raise ShardwiseError(
                "a parameter gathered by sw.gathered() was used directly in a computation "
                "whose backward runs after the block ended, when its full value no longer "
                "exists. Call backward() inside the `with sw.gathered(...)` block, or use "
                "the parameter through its module (the module's backward gathers it again)")
        return self.tensor

    def _gathered(self) -> bool:
        """Whether the tensor views its unit's full buffer, allocated (an enclosing
        block holds the unit, or the engine gathered it for its backward)."""
        key = self.tensor.untyped_storage()._cdata
        # An in-place gather allocates the buffer when issued (Note [gathering in place]
        # in engine/groups/flat.py): gathered once nothing is in flight into it.
        return any(g.full.untyped_storage()._cdata == key and g.full_is_allocated()
                   and g._gathered is None for g in self.unit.groups)


class _Slot(NamedTuple):
    """One registration of a gathered parameter: ``module._parameters[attr]``."""

    param: ShardedParam
    module: nn.Module
    attr: str


def _tensors(target: object) -> list[torch.Tensor]:
    """The parameters ``gathered()`` was given: one tensor, or an iterable of them; a
    ShardwiseError for anything else (a string iterates into characters)."""
    if isinstance(target, torch.Tensor):
        # One parameter, as DeepSpeed's GatheredParameters takes it. Never iterated: a
        # shard is a DTensor, whose iteration unbinds the sharded dimension 0 (an error).
        return [target]
    items = None
    if not isinstance(target, (str, bytes)):
        try:
            items = list(target)  # type: ignore[call-overload]
        except TypeError:
            pass
    if items is None or not all(isinstance(p, torch.Tensor) for p in items):
        raise ShardwiseError(f"sw.gathered: module_or_params must be a module (an "
                             f"nn.Module) or an iterable of parameters, got {shown(target)}")
    return items


class _GatherSession:
    """One ``gathered()`` block: what it gathers, what it snapshots, how it ends."""

    def __init__(self, target: nn.Module | torch.Tensor | Iterable[torch.Tensor],
                 modifier_rank: int | None) -> None:
        self.module = target if isinstance(target, nn.Module) else None
        self.modifier_rank = modifier_rank
        self.params: list[torch.Tensor]
        if self.module is not None:
            self.params = list(self.module.parameters())
            names = {id(p): n for n, p in self.module.named_parameters()}
        else:
            self.params = _tensors(target)
            names = {id(p): sp.fqns[0] if (sp := sharded_param(p)) is not None else
                     f"tensor {i}" for i, p in enumerate(self.params)}
        self.single = isinstance(target, torch.Tensor)
        if modifier_rank is not None:  # read-only blocks take them (compute's DTensors)
            refuse((sp for p in self.params if (sp := sharded_param(p)) is not None),
                   "sw.gathered(modifier_rank=...)", "edits would be broadcast over the "
                   "dp ranks of each tp coordinate; load_state_dict takes new values")
        # Units in order of first appearance among the arguments: the same on every rank.
        self.units: list[Unit] = []
        for p in self.params:
            sp = sharded_param(p)
            unit = sp.unit if sp is not None else None
            if unit is not None and all(unit is not u for u in self.units):
                self.units.append(unit)
        self.plain: list[tuple[str, torch.Tensor]] = [
            (names.get(id(p), "?"), p) for p in self.params if sharded_param(p) is None]
        # Plain rows, whose full parameters view one buffer per group (Note [read-only
        # detection]); tensor subclasses, each with a full tensor of its own (Note
        # [tensor-subclass parameters in gathered()]).
        self.groups: list[BufferGroup] = [g for u in self.units for g in u.groups
                                          if g.by_rows]
        # Tensor-subclass parameters (Note [tensor-subclass parameters in gathered()]).
        self.subclasses = [g for u in self.units for g in u.groups if not g.by_rows]
        self.newly: list[Unit] = []
        self.comm: Comm | None = None
        self.ended = False
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    @property
    def passthrough(self) -> bool:
        """Nothing to gather and nobody to talk to: the block just yields its argument."""
        return not self.units and not dist.is_initialized()

    def value(self) -> object:
        """What the block yields: the module, the full tensors in argument order, or for
        one tensor its full tensor."""
        if self.module is not None:
            return self.module
        full = [sp.full if (sp := sharded_param(p)) is not None else p for p in self.params]
        return full[0] if self.single else full

    def enter(self) -> None:
        """Check the arguments, gather and pin the units, snapshot what may be written."""
        self.comm = self.units[0].model.comm if self.units else Comm(None)
        r = self.modifier_rank
        # The rank that modifies decides who broadcasts: ranks given different ones must
        # not meet in a broadcast (they would hang), so the check compares it too.
        announce(self.comm, "gathered()" if r is None else f"gathered(modifier_rank={r!r})",
                 self.units[0].model.number if self.units else None)
        if r is not None and (type(r) is not int or not 0 <= r < self.comm.world_size):
            raise ShardwiseError(f"modifier_rank={r!r} is not a rank (an int) of a group of "
                                 f"{self.comm.world_size}")
        for u in self.units:
            u.model.recover()
            if u.model.awaiting_backward:
                raise ShardwiseError("gathered() was entered between a forward and its "
                                     "backward; use it outside training steps")
            # A unit held across no_sync micro-batches may hold values older than its
            # shard (an optimizer step since): every rank lets it go here, alike (Note
            # [gathered across micro-batches] in engine/iteration/state.py).
            u.model.release_held()
            if r is not None and any(g.compute_dtype != g.dtype for g in u.groups):
                raise ShardwiseError("gathered(..., modifier_rank=...) is not supported "
                                     "with mixed_precision: full parameters are in "
                                     "param_dtype")
        self.newly = [u for u in self.units if not u.is_gathered()]
        for u in self.newly:
            u.finish_gather()
        for u in self.units:
            u.pin()  # a forward inside the block must not reshard what it holds
        for g in self.subclasses:  # their own types here, as under FSDP2
            for pp in g.params:
                pp.gather.users_type(pp.full)
        # Note [saved after the block]
        storages = {g.full.untyped_storage()._cdata: u for u in self.units for g in u.groups
                    if g.by_rows}
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: _Saved(t, self, u) if (u := storages.get(t.untyped_storage()._cdata))
            is not None else t,
            lambda saved: saved.unpack() if isinstance(saved, _Saved) else saved)
        self._saved_hooks.__enter__()
        self.group_versions = [g.full._version for g in self.groups]
        # A tensor-parallel parameter computes as a DTensor around its view of the buffer,
        # and a write through it moves the DTensor's version counter, not the buffer's
        # (DTensor writes its local tensor below autograd), as a tensor subclass does.
        self.tp_versions = [[(pp, pp.full._version) for pp in g.params
                             if isinstance(pp.full, DTensor)] for g in self.groups]
        self.subclass_versions = [(pp, _version(pp)) for g in self.subclasses
                                  for pp in g.params]
        # Note [tensor-subclass parameters in gathered()]: what a write may reach of the
        # shards.
        self.subclass_kept = [(t, t.detach().clone()) for g in self.subclasses
                              for pp in g.params for t in _shared_inner(pp)]
        buffers = named_buffers(self.module) if self.module is not None else []
        self.buffer_snapshot = ([(n, b, b.detach().clone()) for n, b in buffers]
                                if r is None else [])
        self.plain_versions = [(n, p, p._version) for n, p in self.plain]

    def release(self) -> None:
        """Unpin, and reshard what this block gathered (no communication)."""
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        self.ended = True
        for u in self.units:
            u.unpin()
        for u in self.newly:
            if not u.pins:  # else an enclosing block holds it: that block's end does this
                if u.model.awaiting_backward:  # Note [full parameters held after gathered()]
                    _LEFT_AT[u] = u.model.steps
                else:
                    _LEFT_AT.pop(u, None)
                for g in u.groups:
                    for sp, old in zip(g.params, g.leave_full()):
                        _left_behind(old, sp)
            release(u)  # Note [residency] in engine/iteration/residency.py
        for g in self.subclasses:  # what the engine still holds computes its own way
            for pp in g.params:
                if not pp.full.is_meta and not any(u.pins for u in self.units):
                    pp.gather.engines_type(pp.full)

    def exit(self) -> None:
        """Verify a read-only block or apply the modifier's edits, then release."""
        # Every parameter the block's code put something else in place of, whatever its
        # gather strategy (Note [one group type] in engine/groups/flat.py).
        replaced = [_Slot(sp, m, a) for u in self.units for g in u.groups for sp in g.params
                    for m, a in sp.slots if m._parameters.get(a) is not sp.full]
        assert self.comm is not None
        try:
            if self.modifier_rank is None:
                self._verify_read_only(replaced)
            else:
                _apply_modifications(self.comm, self.groups,
                                     [s for s in replaced if s.param.by_rows], self.module,
                                     self.plain, self.modifier_rank)
                if self.comm.rank != self.modifier_rank:
                    # Only the modifier's edits count: another rank's write into what its
                    # shard shares with the full tensor goes (rank r's then arrive).
                    _restore(self.subclass_kept)
                _apply_subclass_edits(self.comm, self.subclass_versions,
                                      [s for s in replaced if not s.param.by_rows],
                                      self.modifier_rank)
        finally:
            for slot in replaced:
                slot.module._parameters[slot.attr] = slot.param.full
            self.release()
        if self.modifier_rank is not None and self.module is not None:
            maybe_check(self.module)

    def _verify_read_only(self, replaced: list[_Slot]) -> None:
        """Note [read-only detection]: raise on every rank if any rank wrote."""
        assert self.comm is not None
        suspects = [g.full._version != v or any(pp.full._version != pv for pp, pv in tp)
                    for g, v, tp in zip(self.groups, self.group_versions, self.tp_versions)]
        now = dict(named_buffers(self.module)) if self.module is not None else {}
        local = [f"buffer {n}" for n, b, old in self.buffer_snapshot
                 if now.get(n) is not b or not _same_bytes(b, old)]
        local += [f"parameter {n}" for n, p, v in self.plain_versions if p._version != v]
        local += [f"parameter {s.param.fqns[0]} (replaced)" for s in replaced]
        local += [f"parameter {pp.fqns[0]}" for pp, v in self.subclass_versions
                  if _version(pp) != v]
        if not any_rank(self.comm, bool(local) or any(suspects),
                        "the agreement on writes in gathered()"):
            return
        with torch.no_grad():  # buffers go back to what every rank held on entry
            for n, b, old in self.buffer_snapshot:
                if now.get(n) is b and not _same_bytes(b, old):
                    b.copy_(old)
            # Tensor-subclass shards, then their full values (a gather of every rank's
            # bytes), go back to what they were on entry.
            _restore(self.subclass_kept)
        for g in self.subclasses:
            g.start_gather()
            g.wait_gather()
        local += _written_params(self.comm, self.groups, suspects)
        everyone = self.comm.all_gather_object(local)
        msgs = sorted(set().union(*map(set, everyone)))
        raise ReadOnlyGatherError(
            "written inside a read-only sw.gathered() block: " + ", ".join(msgs) +
            ". Pass modifier_rank=<rank> to keep one rank's edits; parameter shards were "
            "left unchanged")


@contextlib.contextmanager
def gathered(module_or_params: nn.Module | torch.Tensor | Iterable[torch.Tensor],
             modifier_rank: int | None = None) -> Iterator[object]:
    """Make full parameters available inside the block.

    Every unit that holds one of the given parameters is gathered (nested blocks reuse an
    enclosing gather). Inside, the module's attributes are the full parameters.

    With ``modifier_rank=None`` the block is read-only: an in-place write, on any rank, to
    a gathered parameter or to a buffer of the module (or replacing one) raises
    :class:`ReadOnlyGatherError` on exit on every rank, naming the tensor; the shards stay
    as they were and written buffers are restored (a written *unsharded* parameter is
    reported, not restored). With ``modifier_rank=r``, rank r's parameters *and buffers* are what
    every rank holds after the block. Unsharded modules and tensors pass through
    unchanged (with ``modifier_rank`` they are broadcast from rank r). A tensor-parallel
    parameter is gathered over the dp ranks into what the module computes with: a
    DTensor on the tp mesh (Note [tensor-parallel parameters] in
    engine/groups/tensor_parallel.py); read-only blocks only.

    If an exception leaves the block, the units it gathered are resharded without any
    communication and the exception propagates.

    Args:
        module_or_params: a module, a parameter, or an iterable of parameters.
        modifier_rank: the rank whose edits are kept, or ``None`` for read-only.

    Yields:
        The module; for one parameter its full tensor; for an iterable the list of full
        tensors in the same order.

    Raises:
        ReadOnlyGatherError: a read-only block was written to.
        ShardwiseError: ``modifier_rank`` out of range, used with mixed precision or
            tensor-parallel parameters, or the block was entered while the model awaits
            its backward.

    Example:
        >>> with sw.gathered(model.lm_head, modifier_rank=0):
        ...     if dist.get_rank() == 0:
        ...         model.lm_head.weight.zero_()
    """
    session = _GatherSession(module_or_params, modifier_rank)
    if session.passthrough:
        yield session.value()
        return
    with ACTIVITY.operation("gathered()"):  # Note [peer watch]
        session.enter()
    try:
        yield session.value()
    except BaseException:
        session.release()
        raise
    with ACTIVITY.operation("the end of gathered()"):
        session.exit()


def _apply_modifications(comm: Comm, groups: list[BufferGroup], replaced: list[_Slot],
                         module: nn.Module | None, plain: list[tuple[str, torch.Tensor]],
                         src: int) -> None:
    """Make rank ``src``'s full parameters and buffers everyone's, and reshard them."""
    problems = []
    if comm.rank == src:
        for sp, m, a in replaced:
            new = m._parameters.get(a)
            if new is None or tuple(new.shape) != tuple(sp.shape):
                problems.append(f"{sp.fqns[0]} was replaced by a tensor of shape "
                                f"{None if new is None else tuple(new.shape)}, expected "
                                f"{tuple(sp.shape)}")
            else:
                with torch.no_grad():
                    sp.full.copy_(new)
    if any_rank(comm, bool(problems), "the agreement on gathered()'s edits"):
        detail = "; ".join(problems) if problems else f"see the error on rank {src}"
        raise ShardwiseError(f"gathered(modifier_rank={src}) cannot keep the edits: {detail}")
    with torch.no_grad():
        for g in groups:
            comm.broadcast(g.full, src)
            g.local_from_full(g.full)
        if module is not None:
            comm.broadcast_tensors([b for _, b in named_buffers(module)], src)
        if plain:
            comm.broadcast_tensors([p.data for _, p in plain], src)


# Note [tensor-subclass parameters in gathered()]
# A frozen tensor-subclass parameter (a quantized weight, in QLoRA) is gathered with its
# unit, through the extension protocol and its gather strategy (Note [packed parameters]
# in engine/groups/subclass.py), which gathered() asks, naming no format: inside the block
# the module holds the full subclass tensor (an NF4Tensor: ``w.get_original_weight()``
# dequantizes it, for inference or to merge an adapter). Writes are detected by the full
# tensor's version counter, which an in-place operation on the subclass bumps (its inner
# tensors' counters do not move: the subclass writes them below autograd). Some of the
# full tensor's inner tensors are the shard's own (NF4's scaler mean and lookup table come
# from ``fsdp_pre_all_gather``'s metadata, not the all-gather), so a write reaches the
# shard: a block keeps a copy of those (a few bytes); a read-only one restores them, then
# gathers the full values again, so the shards are unchanged and an enclosing block sees
# the values of its entry. With ``modifier_rank=r`` rank r's written full tensors (in
# place, ``w.copy_(merged)``, which for an NF4Tensor quantizes a float value with the
# weight's block sizes; or replaced by a value ``copy_`` accepts) are broadcast inner
# tensor by inner tensor, and every rank keeps its share (``SubclassBytes.take_full``, the
# rule of Note [packed checkpoints]); the other ranks first restore their copies, so that
# a write of theirs to a weight rank r left alone does not stay in their shard. A weight
# divided by bytes (Note [uneven packed parameters] in engine/groups/subclass.py) is the
# same full subclass tensor, rebuilt around the gathered bytes: none of its inner tensors
# is the shard's, so a read-only block's regather alone restores it, and ``take_full``
# keeps each rank's element ranges.
def _restore(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Put back each tensor's snapshot where it changed."""
    with torch.no_grad():
        for t, old in kept:
            if not _same_bytes(t, old):
                t.copy_(old)


def _version(pp: ShardedParam) -> int:
    return -1 if pp.full.is_meta else pp.full._version


def _shared_inner(pp: ShardedParam) -> list[torch.Tensor]:
    """The full tensor's inner tensors that are the shard's own storage."""
    if pp.full.is_meta or pp.group is None:
        return []
    names, _ = pp.full.__tensor_flatten__()  # type: ignore[attr-defined]
    local = pp.group.local.untyped_storage().data_ptr()
    return [t for n in names
            if (t := getattr(pp.full, n)).untyped_storage().data_ptr() == local]


def _apply_subclass_edits(comm: Comm, versions: list[tuple[ShardedParam, int]],
                          replaced: list[_Slot], src: int) -> None:
    """Note [tensor-subclass parameters in gathered()]: rank ``src``'s written
    tensor-subclass parameters become every rank's, each keeping its share."""
    problems: list[str] = []
    written = []
    if comm.rank == src:
        with torch.no_grad():
            for pp, m, a in replaced:
                new = m._parameters.get(a)
                try:
                    pp.full.copy_(new)  # type: ignore[arg-type]
                except Exception as err:
                    problems.append(f"{pp.fqns[0]} was replaced by {shown(new)}, which its "
                                    f"{type(pp.full).__qualname__} cannot copy ({err})")
        written = [i for i, (pp, v) in enumerate(versions) if _version(pp) != v]
        problems += [why for i in written if (why := (pp := versions[i][0]).gather.full_problem(
            pp.fqns[0], pp.shape, pp.full)) is not None]
    everyone = comm.all_gather_object((problems, written),
                                      what="gathered()'s tensor-subclass edits")
    problems, written = everyone[src]
    if problems or any(p for p, _ in everyone):
        detail = "; ".join(problems) if problems else f"see the error on rank {src}"
        # The words are the strategy's: its parameters' kind is known to the user by them.
        raise ShardwiseError(versions[0][0].gather.edits_refusal(src, detail))
    with torch.no_grad():
        for i in written:
            pp = versions[i][0]
            assert pp.full is not None
            names, _ = pp.full.__tensor_flatten__()
            comm.broadcast_tensors([getattr(pp.full, n) for n in names], src)
            pp.gather.take_full(pp.full)
