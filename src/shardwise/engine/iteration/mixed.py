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
Anything else goes on to DTensor's own dispatch, with torch's table back for the call
(Note [one table for every thread]). Outside forwards the table is as torch left it:
optimizer steps and ``clip_grad_norm_`` on shards never meet the handler. Operations not
in the list still get DTensor's message.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...errors import ShardwiseError

_aten = torch.ops.aten
_OPS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
        _aten.embedding.default, _aten.convolution.default, _aten.add.Tensor,
        _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor,
        _aten.native_layer_norm.default)
# The ModelStates whose forward runs (a few at most); weakly, so that a model whose
# forward raised (and never ended) is not kept alive by it.
_RUNNING: weakref.WeakSet[Any] = weakref.WeakSet()

# Note [one table for every thread]
# DTensor's table is one dict for the whole process (its C++ dispatch reads the
# dispatcher's attribute at each call), shared by every thread. So ours is a copy of
# torch's table with our handlers added, put in its place while any forward runs and
# torch's put back when the last one ends; every swap, and what decides it, happens under
# one lock. Before, our handlers were written into torch's dict at each forward and
# deleted after (8.7 us a forward, most of it hashing the ops, which torch does in
# Python), and a call falling through to DTensor's own dispatch deleted its entry and
# wrote it back: two threads calling one op met a KeyError, and a call returning after
# the forward ended put the handler back for good. A call falling through now puts
# torch's table back while it runs (the lock is not held meanwhile: the op may be a
# collective another thread's call waits on); ``_falling`` counts such calls, and ours
# returns when the last one does, if a forward still runs. Another thread's operation in
# that window meets torch's table: it only misses our clearer error.
_lock = threading.Lock()
_torch_table: dict[Any, Any] | None = None  # torch's table, while ours stands in for it
_ours: dict[Any, Any] = {}  # that table with our handlers, while installed
_falling = 0  # calls running DTensor's own dispatch, with torch's table back


def _table() -> dict[Any, Any]:
    return DTensor._op_dispatcher._custom_op_handlers


def _set_table(table: dict[Any, Any]) -> None:
    DTensor._op_dispatcher._custom_op_handlers = table


def forward_started(state: Any) -> None:
    """A forward of ``state``'s model starts (not inside ``gathered()``); our handlers
    stand in front of torch's while any such forward runs."""
    global _torch_table, _ours
    with _lock:
        _RUNNING.add(state)
        if _torch_table is None:
            _torch_table = _table()
            _ours = {**_torch_table, **_OURS}  # dict copies reuse the stored hashes
            if not _falling:
                _set_table(_ours)


def forward_ended(state: Any) -> None:
    """That forward returned, or raised (Note [a forward that raised] in
    engine/iteration/state.py): torch's table goes back once none runs."""
    global _torch_table
    with _lock:
        _RUNNING.discard(state)
        if not _RUNNING and _torch_table is not None:
            if _table() is _ours:
                _set_table(_torch_table)
            _torch_table = None


def _check(op_call: Any, args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
    global _falling
    flat = [*args, *kwargs.values()]
    if any(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.numel() > 1
           for t in flat):
        for t in flat:
            if isinstance(t, DTensor):
                found = _owner(t)
                if found is not None:
                    raise _error(op_call, *found)
    torch_table = _torch_table
    previous = torch_table.get(op_call) if torch_table is not None else None
    if previous is not None:  # a handler of torch's own (convolution's)
        return previous(op_call, args, kwargs)
    # DTensor's own dispatch, which our table would send back here.
    with _lock:
        _falling += 1
        if _torch_table is not None and _table() is _ours:
            _set_table(_torch_table)
    try:
        return op_call(*args, **kwargs)
    finally:
        with _lock:
            _falling -= 1
            if not _falling and _torch_table is not None and _table() is _torch_table:
                _set_table(_ours)


_OURS = dict.fromkeys(_OPS, _check)


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
