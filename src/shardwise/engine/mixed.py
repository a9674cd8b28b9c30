"""A shard met by plain tensors inside a forward: named, instead of DTensor's error.

Note [a unit's parameter used outside it]
A unit's parameters are full only while that unit computes (its forward, its backward,
or inside ``gathered()``); elsewhere its modules hold the shards, DTensors. A parent
that reads a child unit's weight in its own forward (``F.linear(x,
self.linear1.weight)`` with ``units=nn.Linear``) hands a shard to an operation on plain
tensors, and DTensor refused with "got mixed torch.Tensor and DTensor", naming neither
the parameter nor a fix. It cannot be made to work quietly: nothing runs when an
attribute is read, and gathering inside the operation would be a collective that the
backward, which needs the full value again, has no hook to repeat. So while a forward of
a sharded model runs, the operations that combine a parameter with activations (matrix
products, embedding, convolution, normalisation, elementwise arithmetic) pass through a
handler in DTensor's table of special operations (consulted before its check, Note
[rank-local scalars] in comm/scalars.py), which raises a ShardwiseError naming the
parameter, its unit and the fixes when a shard of a running model meets a plain tensor.
Anything else goes on to DTensor's own dispatch, with the handler taken out of the table
for the call. Outside forwards the table is as torch left it: optimizer steps and
``clip_grad_norm_`` on shards never meet the handler. Operations not in the list still
get DTensor's message.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import ShardwiseError

_aten = torch.ops.aten
_OPS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
        _aten.embedding.default, _aten.convolution.default, _aten.add.Tensor,
        _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor,
        _aten.native_layer_norm.default)
# The ModelStates whose forward runs (a few at most); weakly, so that a model whose
# forward raised (and never ended) is not kept alive by it.
_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()
_previous: dict[Any, Any] = {}  # the handlers ours stand in front of, while installed


def forward_started(state: Any) -> None:
    """A forward of ``state``'s model starts (not inside ``gathered()``)."""
    _RUNNING.add(state)
    if not _previous:
        handlers = DTensor._op_dispatcher._custom_op_handlers
        for op in _OPS:
            _previous[op] = handlers.get(op)
            handlers[op] = _check
    # A forward that raised never reached forward_ended; its model's next forward ends
    # for both.


def forward_ended(state: Any) -> None:
    """That forward returned: the table goes back to torch's once none runs."""
    _RUNNING.discard(state)
    if not _RUNNING and _previous:
        _restore()


def _restore() -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op, prev in _previous.items():
        if handlers.get(op) is _check:
            if prev is None:
                del handlers[op]
            else:
                handlers[op] = prev
    _previous.clear()


def _check(op_call: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    flat = [*args, *kwargs.values()]
    if any(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() > 1
           for t in flat):
        for t in flat:
            if isinstance(t, DTensor):
                found = _owner(t)
                if found is not None:
                    raise _error(op_call, *found)
    previous = _previous.get(op_call)
    if previous is not None:
        return previous(op_call, args, kwargs)
    # DTensor's own dispatch, which the table entry would send back here.
    handlers = DTensor._op_dispatcher._custom_op_handlers
    del handlers[op_call]
    try:
        return op_call(*args, **kwargs)
    finally:
        if _previous:
            handlers[op_call] = _check


def _owner(t: DTensor) -> tuple[str, str] | None:
    """(parameter name, unit name) of the running model's shard that ``t`` views."""
    local = t._local_tensor
    storage = local.untyped_storage()._cdata
    offset = local.storage_offset()
    for state in list(_RUNNING):
        for unit in state.units:
            for g in unit.groups:
                if g.local.untyped_storage()._cdata != storage:
                    continue
                for p in g.params:
                    start = p.local.storage_offset()
                    if start <= offset < start + max(p.local.numel(), 1):
                        return p.fqns[0], unit.name
                return f"a parameter of unit {unit.name!r}", unit.name
    return None


def _error(op: Any, param: str, unit: str) -> ShardwiseError:
    return ShardwiseError(
        f"{param} was used directly by an operation ({op}) outside the forward of its "
        f"unit {unit!r}, e.g. a parent's forward computing with a child unit's weight "
        f"(F.linear(x, self.child.weight)). A unit's parameters are full only while that "
        f"unit computes; elsewhere each rank holds its rows (a DTensor), which do not mix "
        f"with plain tensors. Call the child module instead of reading its weight, or "
        f"make the module that uses the weight the unit (a units= under which {unit!r} "
        f"is not a unit of its own)")
