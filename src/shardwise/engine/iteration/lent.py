"""Full parameters a forward returns to its caller: found in any output, copied, or refused.

Note [returned parameters]
A unit whose forward returns one of its own full parameters, or a view of one
(DeepSpeed's ``test_ext_param_return``: ``return out, self.bias``), lends it to the
caller, who computes with it after the unit returned. Resharding the unit then would
free the storage under that tensor (Note [freeing full parameters] in engine/iteration/unit.py):
the next read was a segmentation fault. Such a unit stays gathered until its backward
(as under ``reshard_after_forward=False``) or, without one, the end of the forward. A
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
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from ..._registry import copy_all_attributes
from ...errors import ShardwiseError

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


def lends(unit: Any, output: Any, tensors: list[torch.Tensor], unsearched: bool) -> bool:
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


def full_owners(units: Iterable[Any]) -> dict[int, Any]:
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
