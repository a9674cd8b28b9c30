"""A unit's residency: what keeps its full parameters gathered between its computations,
settled once per iteration, and the one place where torch's entry points change it;
full parameters a forward lends its caller (LENT) found in any output, copied, or refused.

Note [residency]
A unit is gathered for its forward and for its backward (the state machine of
engine/iteration/unit.py). Its *residency* (``Unit.residency``, a :class:`Residency`) is
what keeps it gathered in between:

- RESHARDED: nothing (``reshard_after_forward=True``, the default). A forward whose
  output leads to a backward reshards it and the backward gathers it again; a forward
  whose output leads to none reshards it only if it is frozen, since nothing would gather
  a trainable one again for a backward that may still reach it.
- KEPT: its backward. It stays gathered from its forward to its reduction
  (``reshard_after_forward=False``; the root, gathered once a step).
- LAST: it ran last in the previous forward, so its backward comes first, right after the
  loss, and resharding it would only gather it again at once (torchtitan keeps its last
  block gathered by hand for this reason). KEPT where this forward calls it at the same
  position and its output leads to a backward; else RESHARDED.
- HOLDING: gradients accumulate (``sw.no_sync``, or ``require_backward_grad_sync=False``)
  and the unit may be held: KEPT, and its reduction holds it (HELD) instead of resharding
  it.
- HELD: gathered across micro-batches (Note [gathered across micro-batches] in
  engine/iteration/state.py). Neither its forward, nor its ``no_sync`` reduction, nor the
  end of that backward, nor the next forward's start reshards it; its gradients wait in
  the full parameters' ``.grad`` (``Unit.deferred``) where its groups allow it.
- LENT: a forward returned one of its full parameters (Note [returned parameters]):
  gathered until its reduction, or until the forward ends when no backward follows.

Who settles it, and when. :meth:`Residencies.settle` decides every unit's value at the
first forward of an iteration, from the unit's setting (``reshard_after_forward``, the
root), the previous forward's order (which unit ran last), the sync flag (``sw.no_sync``
and DDP's attribute, Note [DDP's sync attribute] in engine/iteration/state.py),
``keep_gathered``, and what the unit's groups answer (Note [one interface for a group] in
engine/groups/interface.py): a unit may be held where every group ``may_be_held`` (not
offloaded, not quantized) and its frozen groups are no larger than its trainable ones.
Within an iteration it settles again only when one of these changed: the sync flag or
``keep_gathered`` (``sw.no_sync`` entered between a forward and its backward), the
previous order (forgotten when ranks diverged), the trainable set (``requires_grad``
changes a forward takes up). A HELD unit stays HELD through a settling while it may
still be held (else its edits are kept, below, and it takes the settled value); a LENT
one stays LENT until the iteration ends, or until it would be HOLDING. The value is read
where a unit's computation ends, :meth:`Residencies.after_forward` and
:meth:`Residencies.at_reduction`, which ask no mode: only the facts of that computation
(whether the output leads to a backward or holds a full parameter, whether gradients
are on). Where a HELD unit's gradients wait is asked of its groups when they arrive
(``grads_may_wait``: whether autograd's sums in ``.grad`` are the reduction's), since
what the reduction holds changes within an iteration.

Events that change it: a forward returning a full parameter makes a RESHARDED or LAST
unit LENT (others stay gathered anyway); a ``no_sync`` reduction of a gathered HOLDING or
HELD unit holds it; :func:`release` reshards a unit and returns HELD and LENT to the
settled value (``Unit.settled``). Every reshard outside the unit goes through
:func:`release`, which is where a held unit's deferred gradients move to the reduction
and where edits of its full parameters are kept.

What torch's entry points do to it (docs/parameters.md, "Torch's entry points"):

- ``zero_grad`` drops the gradients that held units and reductions wait with
  (:meth:`Residencies.clear_grads`, Note [zero_grad reaches held gradients] in
  engine/entry_points/zero_grad.py); the values stay: a HELD unit's parameters did not
  change.
- ``requires_grad_`` is taken up by a forward that records a graph (``check_model``,
  Note [freezing after shard] in engine/iteration/unit.py), which unsettles the values
  (:meth:`Residencies.unsettle`): a unit whose frozen part outgrows its trainable part
  stops being held at that forward, released after it as its settled value says.
- In-place edits of a HELD unit's full parameters between micro-batches are kept in its
  shard when it stops being HELD (Note [edits of held parameters] in
  engine/iteration/unit.py), and ``model.state_dict()`` hands out a HELD unit's shards
  (engine/entry_points/state_dict.py).
- ``gathered()``: entering it releases every HELD unit (:meth:`Residencies.release_held`,
  as a checkpoint and ``load_state_dict`` do); a pin outranks any value (``Unit.reshard``
  leaves a pinned unit gathered) and changes none; the block's end releases what it
  gathered.
- A forward under ``no_grad`` releases each unit it ran, HELD ones too (no backward
  needs them). A forward that raised releases what it gathered and keeps what was HELD
  before it (Note [held units on one rank] in engine/iteration/state.py); a forward
  without backward, an aborted backward, a synced backward's end and ranks diverging
  release everything (:meth:`Residencies.release_all`).

Note [returned parameters]
A unit whose forward returns one of its own full parameters, or a view of one
(DeepSpeed's ``test_ext_param_return``: ``return out, self.bias``), lends it to the
caller, who computes with it after the unit returned. Resharding the unit then would
free the storage under that tensor (Note [freeing full parameters] in engine/iteration/unit.py):
the next read was a segmentation fault. Such a unit stays gathered until its backward
(as under ``reshard_after_forward=False``) or, without one, the end of the forward: its
residency is LENT (:func:`lends` tells, :meth:`Residencies.after_forward` sets it). A
forward that ends without a backward to come releases every unit, so the tensors of its
output that view a full parameter (the entry's own return, or one it passed on) are
replaced by copies (:func:`copy_lent`). So are they when a backward is awaited, since its
end releases every unit too: the units stay gathered until then, and a copy of a tensor
that requires grad stays in the graph (``clone``), so a loss computed with the returned
parameter still reaches it. Before, ``out, bias = model(x)`` read after the backward was
a segmentation fault. A returned parameter is a leaf: no backward hook is put on it,
which would stay on the parameter for every later backward.

The search must see every tensor the output holds, not only those of tuples, lists and
mappings: a parameter inside a custom object, a dataclass, a read-only mapping or a
tuple subclass was missed, freed, and read (SIGSEGV). So :func:`find` opens containers,
pytree nodes, objects' attributes (``__dict__``, ``__slots__``), functions' closures, and
anything else through what the garbage collector sees it reference; :func:`copy_lent`
rebuilds what it can and then searches its result again. A lent tensor still reachable
(inside a closure, an object whose type cannot be rebuilt) is refused with an error
naming the unit and the parameter, after every unit was released: no output can leave a
view of freed storage behind. Modules, types and Python modules are not opened: a
model's own modules hold its parameters by design (they are swapped back to shards), and
a type or a module leads to everything.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from ..._registry import copy_all_attributes
from ...errors import ShardwiseError
from .unit import Residency, Unit, sharded_param

_LENDS = (Residency.RESHARDED, Residency.LAST)  # what lending a full parameter changes


class Conditions(Protocol):
    """What a model's residencies are settled by (``ModelState`` is the one)."""

    keep_gathered: bool  # sw.no_sync(keep_gathered=)

    @property
    def requires_grad_sync(self) -> bool: ...

    @property
    def previous_order(self) -> list[Unit]: ...


def may_be_held(unit: Unit) -> bool:
    """Whether ``unit`` may stay gathered across ``no_sync`` micro-batches (Note
    [gathered across micro-batches] in engine/iteration/state.py): every group may be
    held, and its frozen parameters are no larger than its trainable ones, whose
    accumulated gradients are held anyway."""
    groups = unit.groups
    if not groups or not all(g.may_be_held() for g in groups):
        return False
    trainable = sum(g.full_bytes for g in groups if g.requires_grad)
    return sum(g.full_bytes for g in groups) - trainable <= trainable


def release(unit: Unit, keep_grads: bool = False) -> None:
    """Reshard ``unit`` (``Unit.reshard``), ending what kept it gathered: a HELD unit's
    edits are kept and its deferred gradients handed to the reduction; HELD and LENT
    return to the settled value. ``keep_grads``: the caller hands the gradients, the
    step's sum, to the reduction itself."""
    if keep_grads:
        unit.deferred = False
    if unit.is_sharded() or unit.pins:
        return
    if unit.residency is Residency.HELD:
        _unhold(unit)
    elif unit.residency is Residency.LENT:
        unit.residency = unit.settled
    if unit.deferred:  # to the accumulator, not away
        unit.deferred = False
        for g in unit.groups:
            g.start_reduce(False)
    unit.reshard(keep_grads)


def _unhold(unit: Unit) -> None:
    """A HELD unit stops being held: what code edited in its full parameters since its
    gather goes to its shard (Note [edits of held parameters] in
    engine/iteration/unit.py), unless the shard changed meanwhile."""
    if not unit.is_stale():
        unit.edited |= any([g.keep_edits() for g in unit.groups])
    unit.residency = unit.settled


class Residencies:
    """One model's residency decisions (Note [residency]) and the gradients its units
    hold across ``no_sync`` micro-batches."""

    def __init__(self, units: list[Unit], model: Conditions) -> None:
        self.units = units
        self.model = model
        self.settles = 0  # times settled: once per iteration, unless something changed
        self.accumulated = False  # a no_sync reduction ran since the last synced one
        # Held units released as stale, for the next unit note (Note [held units on one
        # rank] in engine/iteration/state.py).
        self.regathering: list[str] = []
        self._basis: tuple | None = None  # what the values were settled by; None: unsettled
        self._last_index = -1  # where the unit that ran last ran

    def _conditions(self) -> tuple:
        prev = self.model.previous_order
        return (self.model.requires_grad_sync, self.model.keep_gathered,
                prev[-1] if prev else None, len(prev))

    def settle(self, new_iteration: bool) -> None:
        """Decide every unit's residency: at the first forward of an iteration
        (``new_iteration``: LENT ends), and when what it depends on changed."""
        self._basis = basis = self._conditions()
        sync, keep, last, ran = basis
        self._last_index = ran - 1
        self.settles += 1
        for u in self.units:
            may_hold = keep and may_be_held(u)
            if may_hold and not sync:
                settled = Residency.HOLDING
            elif u.is_root or not u.reshard_after_forward:
                settled = Residency.KEPT
            elif u is last:
                settled = Residency.LAST
            else:
                settled = Residency.RESHARDED
            u.settled = settled
            if u.residency is Residency.HELD:
                if may_hold:
                    continue
                _unhold(u)  # stays gathered for now, as its settled value says
            elif u.residency is Residency.LENT and not new_iteration and settled in _LENDS:
                continue
            u.residency = settled

    def unsettle(self) -> None:
        """Something the values depend on changed where :meth:`_current` cannot see it
        (the trainable set): the next read settles again."""
        self._basis = None

    def _current(self) -> None:
        if self._basis != self._conditions():
            self.settle(new_iteration=False)

    def after_forward(self, unit: Unit, lends: bool, hooked: bool) -> None:
        """A unit's forward ended (not the root's, which the forward's end handles): keep
        it gathered or reshard it, as its residency says. ``lends``: the output holds a
        full parameter of it; ``hooked``: it leads to a backward."""
        self._current()
        if lends:  # Note [returned parameters]
            if unit.residency in _LENDS:
                unit.residency = Residency.LENT
        elif not torch.is_grad_enabled():
            release(unit)  # no backward will need it
            return
        elif unit.residency in _LENDS:
            runs_last = (unit.residency is Residency.LAST and hooked
                         and unit.call_index == self._last_index)
            # Without a hooked output nothing would gather the unit again before its
            # backward: a frozen one may go, a trainable one stays until backward ends.
            if not runs_last and (hooked or not any(g.requires_grad for g in unit.groups)):
                release(unit)
                return
        # Stays gathered: the part kept for a backward gather (Note [secondary shards])
        # would only take memory.
        unit.drop_kept()

    def at_reduction(self, unit: Unit, sync: bool) -> bool:
        """A unit's gradients are complete. Under ``no_sync`` a HOLDING or HELD unit is
        held: its gradients wait in ``.grad`` where its groups allow, else go to the
        reduction. Returns whether it was (nothing else is to be done with it)."""
        self._current()
        if not sync:
            self.accumulated = True
        if sync or unit.residency not in (Residency.HOLDING, Residency.HELD) \
                or not unit.is_gathered():
            return False
        if all(g.grads_may_wait() for g in unit.groups if g.requires_grad):
            unit.deferred = unit.reduced = True
        else:
            unit.start_reduce(False)
        unit.residency = Residency.HELD
        return True

    def release_all(self, keep_held: bool = False) -> None:
        """Reshard every unit and forget the iteration's bookkeeping. ``keep_held``: a
        HELD unit stays, unless its shard changed since its gather (Note [held units on
        one rank])."""
        keep_gathered = self.model.keep_gathered
        for u in self.units:
            keep = keep_held and keep_gathered and u.residency is Residency.HELD
            stale = keep and u.is_stale()
            if stale:
                self.regathering.append(u.name)
            if not keep or stale:
                release(u)
            u.reset_iteration()

    def release_held(self) -> None:
        """Reshard the HELD units (no communication), before something reads or writes
        the shards: a checkpoint, ``load_state_dict``, ``gathered()``."""
        for u in self.units:
            if u.residency is Residency.HELD:
                release(u)

    def backward_ended(self, sync: bool) -> None:
        """After a synced backward nothing stays held (a held unit no micro-batch gave a
        gradient to would otherwise outlive the step); after a ``no_sync`` one the
        HELD units stay."""
        self.release_all(keep_held=not sync)
        if sync:
            self.accumulated = False

    def take_edits(self) -> list[bool]:
        """Whether an in-place edit of each unit's held full parameters was kept since
        the last call (Note [edits of held parameters] in engine/iteration/unit.py)."""
        edited = [u.edited for u in self.units]
        for u in self.units:
            u.edited = False
        return edited

    def holds_grads(self) -> bool:
        """Whether gradients of ``no_sync`` micro-batches wait in the engine: in a held
        unit's full parameters or in a reduction (Note [zero_grad reaches held
        gradients] in engine/entry_points/zero_grad.py)."""
        return self.accumulated and any(
            u.deferred or any(g.reduction.has_accumulated() for g in u.trainable_groups)
            for u in self.units)

    def clear_grads(self, tensors: list[torch.Tensor]) -> None:
        """``zero_grad`` reached ``tensors`` (shards or full parameters): drop what the
        engine holds of their gradients, before anything reduces it (Note [zero_grad
        reaches held gradients] in engine/entry_points/zero_grad.py). Raises, with
        nothing changed, where a mode cannot drop part of what it holds."""
        if not self.holds_grads():
            return
        wanted = {id(sp) for t in tensors if (sp := sharded_param(t)) is not None}
        plan = []
        for u in self.units:
            for g in u.trainable_groups:
                which = [i for i, p in enumerate(g.params) if id(p) in wanted]
                if which:
                    plan.append((g, which))
        for g, which in plan:
            refusal = g.reduction.clear_refusal(which)
            if refusal:
                raise ShardwiseError(refusal)
        for g, which in plan:
            for i in which:
                g.params[i].full.grad = None  # a held unit's, deferred there
            g.reduction.clear(which)


# -- full parameters lent to a forward's caller (Note [returned parameters]) ------------
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, range, slice)
# Never opened (see the Note): what they reference is not part of an output.
_CLOSED = (nn.Module, type, types.ModuleType, types.FrameType, types.CodeType,
           torch.Generator, torch.Tensor)


def storage_key(t: torch.Tensor) -> int | None:
    """An identity of the storage under a plain tensor, or ``None`` for a shard."""
    if isinstance(t, DTensor):
        return None
    return t.untyped_storage()._cdata


def _children(x: Any) -> Iterable[Any]:
    """What ``x`` holds, for the search (never tensors' or closed objects' insides)."""
    if isinstance(x, Mapping):
        return list(x.values())
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if type(x) in SUPPORTED_NODES:
        return tree_flatten(x)[0]
    if isinstance(x, types.FunctionType):
        return [c.cell_contents for c in x.__closure__ or () if _filled(c)] + list(
            x.__defaults__ or ())
    if isinstance(x, types.MethodType):
        return [x.__func__, x.__self__]
    return [r for r in gc.get_referents(x) if not isinstance(r, types.FunctionType)
            or r.__closure__]  # a function without a closure holds only globals


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def find(output: Any, keys: Callable[[int], bool]) -> list[torch.Tensor]:
    """The plain tensors reachable from ``output`` whose storage ``keys`` accepts."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [output]
    while stack:
        x = stack.pop()
        if isinstance(x, _PLAIN) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            key = storage_key(x)
            if key is not None and keys(key):
                found.append(x)
        elif not isinstance(x, _CLOSED):
            stack.extend(_children(x))
    return found


def lends(unit: Unit, output: Any, tensors: list[torch.Tensor], unsearched: bool) -> bool:
    """Whether a forward's ``output`` views the full parameters of ``unit`` (which then
    stays gathered). ``tensors``: those ``output_tensors`` found in it; ``unsearched``:
    whether it met something it could not open, searched here."""
    if not any(g.by_rows for g in unit.groups):
        return False
    fulls = full_owners([unit])
    if any(storage_key(t) in fulls for t in tensors):
        return True
    return unsearched and bool(find(output, fulls.__contains__))


def copy_lent(output: Any, owners: dict[int, Any], entry: str,
              release: Callable[[], None] | None) -> Any:
    """``output`` with every tensor viewing a full parameter replaced by a copy (Note
    [returned parameters]), or ``None`` when none does; calls ``release`` once the
    copies are made. A copy of a tensor that requires grad, under grad mode, stays in
    the graph: gradients reach the parameter through it.

    Args:
        output: what the forward entered at unit ``entry`` returned.
        owners: the flat groups of the gathered units, by their full buffer's storage
            key (:func:`full_owners`).
        entry: the name of that unit, for the error.
        release: frees the full parameters; ``None`` when a backward is awaited (they
            are freed when it ends).

    Raises:
        ShardwiseError: a lent tensor sits where it cannot be replaced (a closure, an
            object whose type cannot be rebuilt); every unit is released first (by
            ``release``, or, when a backward is awaited, by the caller: the model state
            abandons that iteration, which no output can now reach).
    """
    lent = {id(t) for t in find(output, owners.__contains__)}
    if not lent:
        if release is not None:
            release()
        return None
    seen: dict[int, Any] = {}
    replaced = _replace(output, lent, seen)
    left = find(replaced, owners.__contains__)
    if release is not None:
        release()
    if left:
        raise ShardwiseError(
            f"the forward of unit {entry!r} returned {_name(owners, left[0])} "
            f"inside an object shardwise cannot rebuild with a copy of it "
            f"({_holder(replaced, left[0])}): the full parameters are freed when the "
            f"forward ends (or its backward, when one follows), so reading it then would "
            f"read freed memory. Return the parameter in a tensor, list, tuple, dict or "
            f"dataclass, return parameter.detach().clone(), or run the forward inside "
            f"`with sw.gathered(model):`")
    return replaced


def _replace(x: Any, lent: set[int], seen: dict[int, Any]) -> Any:
    """``x`` with the tensors in ``lent`` replaced by copies: containers holding one are
    rebuilt (lists, mutable mappings and objects' attributes in place)."""
    if isinstance(x, _PLAIN):
        return x
    if id(x) in seen:
        return seen[id(x)]
    seen[id(x)] = x  # a cycle leads back to the object itself
    if isinstance(x, torch.Tensor):
        if id(x) not in lent:
            out: Any = x
        elif x.requires_grad and torch.is_grad_enabled():
            out = x.clone()  # in the graph: a gradient through it reaches the parameter
        else:
            out = x.detach().clone()
    elif isinstance(x, _CLOSED):
        out = x
    elif isinstance(x, list):
        x[:] = [_replace(v, lent, seen) for v in x]
        out = x
    elif isinstance(x, MutableMapping):
        for k in list(x):
            x[k] = _replace(x[k], lent, seen)
        out = x
    elif isinstance(x, (set, frozenset)):
        items = [_replace(v, lent, seen) for v in x]
        out = x if all(v in x for v in items) else type(x)(items)
    elif isinstance(x, Mapping):  # read-only: a mapping proxy, a frozen mapping
        values = {k: _replace(v, lent, seen) for k, v in x.items()}
        out = x if all(values[k] is x[k] for k in x) else _rebuild(x, values)
    elif isinstance(x, tuple):
        items = [_replace(v, lent, seen) for v in x]
        out = x if all(a is b for a, b in zip(items, x)) else _rebuild_tuple(x, items)
    elif type(x) in SUPPORTED_NODES:  # a dataclass or class registered with pytree
        leaves, spec = tree_flatten(x)
        new = [_replace(v, lent, seen) for v in leaves]
        out = x if all(a is b for a, b in zip(new, leaves)) else tree_unflatten(new, spec)
    else:
        _replace_attributes(x, lent, seen)
        out = x
    seen[id(x)] = out
    return out


def _rebuild_tuple(x: tuple, items: list) -> Any:
    """A tuple of ``x``'s type holding ``items``: a named tuple through its fields, any
    other subclass without its own ``__new__`` (which may take other arguments), its
    attributes copied; ``x`` itself when its type refuses (the search after finds it)."""
    if type(x) is tuple:
        return tuple(items)
    try:
        if hasattr(x, "_fields"):
            return type(x)(*items)
        out = tuple.__new__(type(x), items)
    except TypeError:  # a structseq (torch.return_types) takes its items at once
        try:
            return type(x)(items)
        except Exception:
            return x
    if hasattr(x, "__dict__"):
        copy_all_attributes(x, out)
    return out


def _rebuild(x: Mapping, values: dict) -> Any:
    """A read-only mapping of ``x``'s type holding ``values``; a dict if it takes none."""
    try:
        return type(x)(values)  # type: ignore[call-arg]
    except Exception:  # a constructor of its own: the values still reach the caller
        return values


def _replace_attributes(x: Any, lent: set[int], seen: dict[int, Any]) -> None:
    """Replace lent tensors among an object's attributes, in place (frozen dataclasses
    and properties are written past, as their attributes are the object's data)."""
    names = list(getattr(x, "__dict__", {}))
    for cls in type(x).__mro__:
        names += [s for s in getattr(cls, "__slots__", ()) if s not in ("__dict__",
                                                                      "__weakref__")]
    for name in names:
        try:
            value = object.__getattribute__(x, name)
        except AttributeError:  # an unset slot
            continue
        new = _replace(value, lent, seen)
        if new is not value:
            object.__setattr__(x, name, new)


def _holder(output: Any, t: torch.Tensor) -> str:
    """The type of what holds ``t`` in ``output``, for the error."""
    seen: set[int] = set()
    stack = [output]
    while stack:
        x = stack.pop()
        if isinstance(x, _PLAIN) or id(x) in seen or isinstance(x, _CLOSED):
            continue
        seen.add(id(x))
        kids = list(_children(x))
        if any(k is t for k in kids):
            return type(x).__qualname__
        stack.extend(kids)
    return "an object"


def full_owners(units: Iterable[Unit]) -> dict[int, Any]:
    """The groups of ``units`` whose full parameters view their full buffer (plain
    rows), by the storage key of that buffer."""
    return {g.full.untyped_storage()._cdata: g for u in units for g in u.groups if g.by_rows}


def _name(owners: dict[int, Any], t: torch.Tensor) -> str:
    """The full parameter ``t`` views, for the error."""
    group = owners[t.untyped_storage()._cdata]
    offset = t.storage_offset()
    for p in group.params:
        start = p.full.storage_offset()
        if start <= offset < start + max(p.full.numel(), 1):
            return f"the full parameter {p.fqns[0]}"
    return "a full parameter"
