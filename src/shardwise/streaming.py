"""``full_parameters()``: a sharded model's full weights, streamed one unit at a time.

Note [streamed full parameters]
An RL trainer sends its policy's weights to an inference engine (vLLM's
``load_weights``, which takes an iterable of ``(name, tensor)`` and copies each one
at once) or to a plain generation copy after every few steps. ``full_state_dict``
would hold the whole model on a rank; ``full_parameters`` hands out the parameters in
``named_parameters`` order, gathering the groups of one unit at a time:

- Consecutive parameters of one unit make a *run*, gathered together. A unit's
  parameters may come in two runs (the root's embedding first, its final norm and head
  last): each run gathers only the rows of its own parameters (``FlatGroup.gather_values``), so
  the root crosses the links once in all, as under ``full_state_dict``. A group whose
  parameters all belong to the run is gathered from its shard as it is; quantized groups
  are always gathered whole (their bytes travel through the extension protocol). Ranks
  that keep nothing (``rank0_only``) do not copy the gathered rows out.
- Values are fresh tensors, never the engine's full buffers: the units stay sharded
  (``sw.inspect`` shows the model at rest throughout), nothing of the training state
  changes, and the values are the master shards' (``full_state_dict``'s values, bit for
  bit; the master dtype under mixed precision). Each yielded tensor is a view of its
  run's buffer and belongs to the caller: it stays valid after the iterator moves on,
  and the buffer is freed when the caller drops the run's last tensor. Memory is one
  run's buffer, plus the previous run's while the caller still holds one of its tensors
  (a ``for`` loop's variable does, until the next item), plus the all-gather's temporary.
- After each run every rank says whether it goes on or stopped (one all-reduce of a
  flag per rank, watched: Note [peer watch]); closing the iterator (``break``, an
  exception in the loop, ``close()``) votes "stopped". Every rank stopping at the same
  run ends quietly; some stopping while others go on raises a ``ShardwiseError`` on
  every rank naming who stopped where, instead of a hang in the next gather. With
  ``rank0_only`` the other ranks yield nothing, so rank 0's vote decides: its early stop
  ends every rank's iteration quietly.
- Ranks start together: the start is an announced operation (Note [collective order]),
  whose text names the parameters, so ranks streaming different submodules raise
  instead of pairing unrelated gathers.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ._args import require_bool, require_module
from .comm.collectives import Comm
from .comm.order_check import announce
from .comm.peers import ACTIVITY
from .engine.groups.flat import ShardedParam
from .engine.groups.tensor_parallel import tp_of
from .engine.iteration.state import ModelState, Phase, owning_state
from .engine.iteration.unit import Unit, sharded_param
from .errors import ShardwiseError

_NAME = "full_parameters"


@dataclass
class _Entry:
    """One ``(name, parameter)`` of ``named_parameters``, and where its values are."""

    name: str
    sharded: ShardedParam | None  # plain or a tensor subclass (Note [one group type])
    plain: torch.Tensor | None  # a parameter the engine does not manage


@dataclass
class _Run:
    """Consecutive entries of one unit (``unit is None``: unmanaged parameters)."""

    unit: Unit | None
    entries: list[_Entry]


def full_parameters(module: nn.Module, *, rank0_only: bool = False, dequantize: bool = True,
                    remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The full parameters of a sharded model, one unit gathered at a time.

    Yields ``(name, tensor)`` in ``module.named_parameters()`` order with its names
    (relative to ``module``), each tensor plain, of the full shape, and equal bit for bit
    to :func:`full_state_dict`'s value of that name, for sending weights to an inference
    engine (``llm.load_weights(sw.full_parameters(model))``) or loading a plain copy of
    the model for generation, without holding the whole model on any rank. Every rank
    must iterate it to the end, or close it (``break``, ``it.close()``), at the same
    point; ranks that part ways raise a :class:`ShardwiseError` on every rank (Note
    [streamed full parameters] in ``streaming.py``).

    The tensors are on the device the model gathers on (the GPU under NCCL, CPU under
    gloo), in the master dtype (fp32 under ``MixedPrecision``), and belong to the caller:
    each is a view of its unit's freshly gathered buffer, valid after the iterator moves
    on; the buffer is freed once the caller drops that unit's last tensor. Copy them, as
    ``load_weights`` does, and memory stays near one unit. The model itself is not
    touched: its units stay sharded.

    Args:
        module: a sharded model, or a submodule of one (names relative to it; every rank
            passes the same submodule).
        rank0_only: yield only on rank 0 of the model's group; the other ranks yield
            nothing but take part in every gather (iterate them to the end too: ``for _
            in sw.full_parameters(model, rank0_only=True): pass``). Rank 0 may stop early;
            the others then stop with it.
        dequantize: a quantized frozen weight (torchao's ``NF4Tensor``) comes dequantized
            (``get_original_weight()``, in the weight's dtype); ``False``: the full
            quantized tensor, as ``full_state_dict`` gives it.
        remove_duplicate: as ``named_parameters``: a tied weight under its first name
            only (``True``), or under each of its names, the same tensor (``False``).

    Returns:
        An iterator of ``(name, tensor)``; nothing communicates before its first item is
        asked for.

    Raises:
        ShardwiseError: when ``module`` is not a sharded model or a part of one, holds
            DTensor parameters that are not its shards or shards of another model, is
            in a forward or between a forward and its backward, or holds a quantized
            weight that cannot be dequantized (with ``dequantize=True``); on every rank
            when ranks do not start, go on or stop together.

    Example:
        >>> plain = dict(generation_copy.named_parameters())
        >>> with torch.no_grad():
        ...     for name, w in sw.full_parameters(model):
        ...         plain[name].copy_(w)
    """
    require_module(module, _NAME)
    for value, argument in ((rank0_only, "rank0_only"), (dequantize, "dequantize"),
                            (remove_duplicate, "remove_duplicate")):
        require_bool(value, _NAME, argument)
    state = owning_state(module)
    if state is None:
        raise ShardwiseError(
            f"{_NAME}: {type(module).__name__} is not a sharded model nor a part of one "
            f"(none of its parameters is a shard). Pass the model sw.shard returned; an "
            f"unsharded model's weights are module.named_parameters()")
    runs = _plan(module, state, dequantize, remove_duplicate)
    _check_phase(state)
    return _stream(state, runs, rank0_only, dequantize)


def _plan(module: nn.Module, state: ModelState, dequantize: bool,
          remove_duplicate: bool) -> list[_Run]:
    """The runs to gather, checked before anything communicates (every rank sees the
    same parameters, so every rank raises alike)."""
    entries: list[_Entry] = []
    foreign, pieces, opaque = [], [], []
    for name, p in module.named_parameters(remove_duplicate=remove_duplicate):
        sp = sharded_param(p)
        if sp is not None and (sp.unit is None or sp.unit.model is not state):
            foreign.append(name)
        elif sp is None and isinstance(p, DTensor):
            pieces.append(name)
        elif (sp is not None and not sp.by_rows and dequantize
              and not hasattr(sp.gather.kind, "get_original_weight")):
            opaque.append(f"{name} ({sp.gather.kind.__name__})")
        entries.append(_Entry(name, sp, p if sp is None else None))
    if foreign:
        raise ShardwiseError(
            f"{_NAME}: {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''} "
            f"belong(s) to another sharded model than {entries[0].name}'s; stream each "
            f"sharded model by itself")
    if pieces:
        raise ShardwiseError(
            f"{_NAME} would yield this rank's rows for {', '.join(pieces[:3])}"
            f"{', ...' if len(pieces) > 3 else ''}: DTensors that are not shards of this "
            f"model (a parameter replaced after sw.shard). Replace parameters before "
            f"sw.shard, or load values with model.load_state_dict(sd)")
    if opaque:
        raise ShardwiseError(
            f"{_NAME} cannot dequantize {', '.join(opaque[:3])}: only weights with "
            f"get_original_weight() (torchao's NF4Tensor) are dequantized. Pass "
            f"dequantize=False to receive the quantized tensors as they are")
    runs: list[_Run] = []
    for e in entries:
        unit = e.sharded.unit if e.sharded is not None else None
        if runs and runs[-1].unit is unit:
            runs[-1].entries.append(e)
        else:
            runs.append(_Run(unit, [e]))
    return runs


def _check_phase(state: ModelState) -> None:
    if state.phase is not Phase.IDLE:
        where = ("inside a forward" if state.phase is Phase.FORWARD else
                 "between a forward and its backward" if state.phase is
                 Phase.AWAITING_BACKWARD else "inside a backward")
        raise ShardwiseError(
            f"{_NAME} was called {where} of the sharded model; stream the weights between "
            f"training steps (after optimizer.step(), or after a forward under "
            f"torch.no_grad())")


def _stream(state: ModelState, runs: list[_Run], rank0_only: bool,
            dequantize: bool) -> Iterator[tuple[str, torch.Tensor]]:
    comm = state.comm
    keep = not rank0_only or comm.rank == 0
    with ACTIVITY.operation(f"{_NAME}()"):  # Note [peer watch]: noted while suspended too
        _check_phase(state)
        names = [e.sharded.fqns[0] if e.sharded is not None else e.name
                 for r in runs for e in r.entries]
        fingerprint = zlib.crc32("\n".join(names).encode()) & 0xFFFFFFFF
        announce(comm, f"{_NAME}() of {len(names)} parameters ({names[0] if names else ''}"
                       f"{', ...' if len(names) > 1 else ''}; {fingerprint:08x})",
                 state.number)
        for run in runs:
            items = _gathered(run, keep, dequantize)
            try:
                while items:
                    yield items.pop(0)  # handed out, then no longer held here
            except BaseException:  # close() (GeneratorExit) or an error thrown in
                items.clear()
                _go_on(comm, True, rank0_only, run)  # raises if others go on
                raise
            if not _go_on(comm, False, rank0_only, run):
                return


def _gathered(run: _Run, keep: bool, dequantize: bool) -> list[tuple[str, torch.Tensor]]:
    """The run's ``(name, full tensor)`` items (an empty list where nothing is kept);
    every rank gathers the same groups, in the unit's order."""
    values: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        if run.unit is not None:
            wanted = {id(e.sharded) for e in run.entries if e.sharded is not None}
            for g in run.unit.groups:
                mine = [p for p in g.params if id(p) in wanted]
                if mine:
                    values.update(g.gather_values(
                        mine, keep, f"{_NAME}: the all-gather of unit {g.unit_name!r}'s "
                                    f"parameters"))
        if not keep:
            return []
        for e in run.entries:  # Note [tensor-parallel parameters]: a collective over tp
            if e.sharded is not None and (tp := tp_of(e.sharded)) is not None:
                values[id(e.sharded)] = tp.full_tensor(values[id(e.sharded)])
        out = []
        for e in run.entries:
            if e.sharded is not None:
                value = values[id(e.sharded)]
                if dequantize and not e.sharded.by_rows:
                    value = value.get_original_weight()  # type: ignore[attr-defined]
            else:
                assert e.plain is not None
                value = e.plain.detach().clone()
            out.append((e.name, value))
    return out


def _go_on(comm: Comm, stopped: bool, rank0_only: bool, run: _Run) -> bool:
    """After ``run``: whether the iteration goes on (Note [streamed full parameters]).
    ``stopped``: this rank's caller closed the iterator. Every rank learns who stopped;
    when some did and others did not (with ``rank0_only``: some other than rank 0
    alone), every rank raises."""
    if comm.world_size == 1:
        return not stopped
    flags = torch.zeros(comm.world_size, dtype=torch.int32, device=comm.device)
    flags[comm.rank] = int(stopped)
    comm.all_reduce(flags, what=f"{_NAME}: whether every rank goes on", watch=True)
    stoppers = [r for r, f in enumerate(flags.tolist()) if f]
    if not stoppers:
        return True
    if len(stoppers) == comm.world_size or (rank0_only and stoppers == [0]):
        return False
    others = [r for r in range(comm.world_size) if r not in stoppers]
    last = run.entries[-1].name
    raise ShardwiseError(
        f"{_NAME}: rank(s) {stoppers} closed the iterator after {last} while rank(s) "
        f"{others} went on: every rank must iterate to the end, or stop at the same "
        f"point (with rank0_only=True, rank 0 alone may stop early). Nothing of the "
        f"model was changed")
