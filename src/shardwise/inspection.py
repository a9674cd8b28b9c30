"""``inspect``: a read-only snapshot of one sharded model's engine state.

What a rank can learn about its sharded model without touching it: the units and what
they hold, the layout of every parameter in the flat buffers, this rank's bytes, the
iteration phase and the communication counters. For debugging (where does memory go,
what is gathered right now) and for tests, which read the engine through it instead of
through private modules.

Taking a snapshot never communicates and changes nothing: it reads attributes and
copies them into frozen dataclasses of plain values (strings, ints, tuples, dicts of
counts), so holding one keeps no engine object, tensor or process group alive, and a
snapshot does not change when the model goes on training. Take another one for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn

from ._args import require_module
from .comm.collectives import CommStats
from .engine.groups.interface import ParamGroup, tier_totals
from .engine.groups.layout import ALIGN
from .engine.groups.tensor_parallel import tp_of
from .engine.iteration.state import model_state
from .engine.iteration.unit import sharded_param, unit_of
from .errors import ShardwiseError
from .planning.memory import unique_bytes

if TYPE_CHECKING:
    from .engine.iteration.unit import ShardedParam, Unit

# The kinds of collective shardwise counts: each appears in every snapshot, 0 if unused,
# so that a count can be read before the first collective of its kind.
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "scatter")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class ParamView:
    """One original parameter, as this rank stores it."""

    names: tuple[str, ...]       # every qualified name (a tied weight has several)
    shape: tuple[int, ...]       # the full parameter's
    dtype: torch.dtype           # its stored (master) dtype
    requires_grad: bool
    local_rows: int              # rows of dim 0 this rank stores (torch.chunk's split; may be 0)
    padded_numel: int            # elements of each rank's slot, padding rows included
    shard_offset: int            # where the slot starts in the group's shard buffer
    full_offset: int             # where the parameter starts in the group's full buffer
    # What the model holds under its names right now: the DTensor shard, the full
    # parameter (its unit is gathered), or anything else (replaced behind shardwise's back).
    held: Literal["shard", "full", "other"]
    has_full_grad: bool          # a full gradient computed and not yet reduced

    @property
    def name(self) -> str:
        """The first qualified name."""
        return self.names[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GroupView:
    """A unit's parameters of one dtype and one ``requires_grad``: one flat shard buffer
    per rank, gathered in one collective."""

    dtype: torch.dtype           # stored (master) dtype
    compute_dtype: torch.dtype   # gathered in (``MixedPrecision.param_dtype``)
    reduce_dtype: torch.dtype    # gradients reduced in
    requires_grad: bool
    shard_numel: int             # elements of each rank's shard buffer, padding included
    full_numel: int              # elements of the full buffer
    gathered_numel: int          # elements of the all-gather output (every rank's shard)
    full_allocated: bool         # the full parameters hold memory now
    params: tuple[ParamView, ...]
    # Where the shard gathers read and the master shard (with its gradients and optimizer
    # state) live: "device", "cpu" or "disk" (Note [two states, three tiers]).
    params_tier: str = "device"
    optimizer_tier: str = "device"

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's shard buffer."""
        return self.shard_numel * self.dtype.itemsize

    @property
    def full_bytes(self) -> int:
        """Bytes of the full parameters while gathered."""
        return self.full_numel * self.compute_dtype.itemsize


@dataclass(frozen=True)
class PackedView:
    """A unit's frozen tensor-subclass parameters (quantized weights such as torchao's
    ``NF4Tensor``), gathered through FSDP2's extension protocol in one all-gather of bytes
    (Note [packed parameters] in engine/groups/subclass.py)."""

    names: tuple[str, ...]       # the first qualified name of each parameter
    types: tuple[str, ...]       # each one's class name
    numel: int                   # elements the full parameters stand for
    shard_bytes: int             # this rank's packed bytes (its chunks' inner tensors)
    full_bytes: int              # bytes while gathered (0 before the first gather)
    full_allocated: bool         # the gathered form holds memory now


@dataclass(frozen=True)
class UnitView:
    """Parameters gathered and released together (one block, or what the root owns)."""

    name: str                    # the module's qualified name; "<root>" for the root
    module_type: str             # its class name
    is_root: bool
    state: Literal["sharded", "gathering", "gathered"]
    reshard_after_forward: bool | int
    pins: int                    # open ``gathered()`` blocks holding it gathered
    groups: tuple[GroupView, ...]
    packed: tuple[PackedView, ...] = ()  # quantized frozen weights, beside the groups

    @property
    def params(self) -> tuple[ParamView, ...]:
        return tuple(p for g in self.groups for p in g.params)

    @property
    def param_names(self) -> tuple[str, ...]:
        """Every qualified name of its parameters (a tied weight's each)."""
        return tuple(n for p in self.params for n in p.names)

    @property
    def packed_names(self) -> tuple[str, ...]:
        """The first qualified name of each packed parameter."""
        return tuple(n for p in self.packed for n in p.names)

    @property
    def shard_bytes(self) -> int:
        return sum(g.shard_bytes for g in self.groups) + sum(p.shard_bytes
                                                             for p in self.packed)

    @property
    def gathered_bytes(self) -> int:
        """Bytes of its full parameters while gathered (packed ones as gathered: still
        packed, dequantized only inside their own kernels)."""
        return sum(g.full_bytes for g in self.groups) + sum(p.full_bytes
                                                            for p in self.packed)


@dataclass(frozen=True)
class CommView:
    """This rank's collectives since ``shard``, per kind (``all_gather``, ...).

    ``bytes``: input bytes; ``calls``: how many; ``sent``: bytes this rank put on the wire
    itself, known for gloo's point-to-point exchanges only. The model's deep copies share
    its process group and so its counters. A world of one gathers and reduces units
    without collectives, which are then not counted.
    """

    backend: str
    bytes: dict[str, int]
    calls: dict[str, int]
    sent: dict[str, int]

    def since(self, earlier: CommView) -> CommView:
        """What was counted between ``earlier`` and this snapshot.

        Example:
            >>> before = sw.inspect(model).comm
            >>> model(x).sum().backward()
            >>> sw.inspect(model).comm.since(before).calls["reduce_scatter"]
        """
        def minus(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
            return {k: v - then.get(k, 0) for k, v in now.items()}
        return CommView(self.backend, minus(self.bytes, earlier.bytes),
                        minus(self.calls, earlier.calls), minus(self.sent, earlier.sent))


@dataclass(frozen=True)
class ModelView:
    """A sharded model's engine state on this rank; see :func:`inspect`.

    ``str(view)`` is a table of the units and this rank's bytes.
    """

    rank: int                    # in the model's process group
    world_size: int
    phase: Literal["idle", "forward", "awaiting backward", "backward"]
    steps: int                   # backward passes finished since ``shard``
    prefetch: int                # units gathered ahead (``shard(prefetch=)``)
    src_rank: int
    buffers: str                 # the buffer policy: "broadcast", "average" or "local"
    grad_sync: bool              # False inside ``no_sync``
    align: int                   # every slot starts at a multiple of this many elements
    param_bytes: int             # this rank's shard buffers (packed ones included)
    packed_bytes: int            # of which quantized frozen weights (``UnitView.packed``)
    grad_bytes: int              # this rank's gradient shards (``p.grad``), each storage once
    full_bytes: int              # full parameters allocated now (gathered units)
    largest_gathered_bytes: int  # the largest unit's full parameters while gathered
    comm: CommView               # over the model's group (hybrid: this rank's shard group)
    shard_size: int              # ranks a parameter is sharded over (S)
    replicas: int                # ranks holding each shard (R; 1 unless hybrid)
    # Hybrid sharding: the gradient sums across replicas (Note [hybrid sharding]), and
    # the small control collectives over every rank of the mesh (order checks, flags,
    # buffers); None when flat (``comm`` holds everything).
    comm_across: CommView | None
    comm_world: CommView | None
    # reshard_after_forward=k: the backward all-gathers within groups of k ranks (Note
    # [secondary shards]), and the bytes of the parts kept for them now; None and 0
    # otherwise.
    comm_regather: CommView | None
    kept_bytes: int
    # Parameters the model holds that no unit manages (added after ``shard``).
    unmanaged: tuple[str, ...]
    # sw.Offload: where the states live ("params on device, optimizer state on disk in
    # ..."), None when nothing is offloaded; and this rank's bytes per tier of offloaded
    # groups: master shards with room for their gradients, parameter copies, and the
    # optimizer state moved to disk (state the optimizer keeps in host memory is its own).
    offload: str | None
    tier_bytes: dict[str, int]
    # Bytes shardwise's copies moved to and from the offload tiers since ``shard`` (Note
    # [bytes moved]; ``shardwise plan --offload`` predicts them per step).
    moved_bytes: int
    units: tuple[UnitView, ...] = field(repr=False)  # root first, then in module order

    def unit(self, name: str) -> UnitView:
        """The unit named ``name`` (``"<root>"``, ``"blocks.3"``).

        Raises:
            KeyError: no unit has that name; the message lists them.
        """
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit {name!r}; the units are {[u.name for u in self.units]}")

    def param(self, name: str) -> ParamView:
        """The parameter with qualified name ``name`` (any of a tied weight's names).

        Raises:
            KeyError: no managed parameter has that name.
        """
        for u in self.units:
            for p in u.params:
                if name in p.names:
                    return p
        raise KeyError(f"no sharded parameter {name!r}")

    def __str__(self) -> str:
        quantized = f" ({_mib(self.packed_bytes)} quantized)" if self.packed_bytes else ""
        lines = [
            f"sharded model on rank {self.rank} of {self.world_size} ({self.comm.backend}): "
            f"{len(self.units)} units, phase {self.phase}, steps done {self.steps}",
            f"this rank: parameters {_mib(self.param_bytes)}{quantized}, gradients "
            f"{_mib(self.grad_bytes)}, full parameters now {_mib(self.full_bytes)}; "
            f"largest gathered unit {_mib(self.largest_gathered_bytes)}",
            f"{'unit':32s} {'state':10s} {'params':>7s} {'shard':>12s} {'gathered':>12s}",
        ]
        for u in self.units:
            count = len(u.params) + len(u.packed_names)
            lines.append(f"{u.name:32s} {u.state:10s} {count:7d} "
                         f"{_mib(u.shard_bytes):>12s} {_mib(u.gathered_bytes):>12s}")
        if self.offload is not None:
            lines.append(f"offload: {self.offload}; " + ", ".join(
                f"{t} {_mib(n)}" for t, n in self.tier_bytes.items()))
        if self.unmanaged:
            lines.append(f"not managed by shardwise: {', '.join(self.unmanaged)}")
        return "\n".join(lines)


def _held(sp: ShardedParam) -> Literal["shard", "full", "other"]:
    now = [m._parameters.get(attr) for m, attr in sp.slots]
    if all(t is sp.shard for t in now):
        return "shard"
    if all(t is sp.full for t in now):
        return "full"
    return "other"


def _param_view(sp: ShardedParam) -> ParamView:
    # A tensor-parallel parameter's global shape, not its local tensor's (which the
    # group shards: Note [tensor-parallel parameters] in engine/groups/tensor_parallel.py).
    spec = tp_of(sp)
    shape = tuple(spec.shape if spec is not None else sp.shape)
    return ParamView(names=tuple(sp.fqns), shape=shape, dtype=sp.dtype,
                     requires_grad=sp.requires_grad, local_rows=sp.local.shape[0],
                     padded_numel=sp.slot.chunk_numel,
                     shard_offset=sp.slot.offset, full_offset=sp.slot.full_offset,
                     held=_held(sp), has_full_grad=sp.full.grad is not None)


def _unit_view(u: Unit) -> UnitView:
    # Each group describes itself (Note [one interface for a group]); a flat group's
    # parameters are read here, one view each.
    groups, packed = [], []
    for g in u.groups:
        d = g.describe()
        if d.pop("kind") == "packed":
            packed.append(PackedView(**d))
        else:
            groups.append(GroupView(**d, params=tuple(_param_view(p) for p in g.params)))
    return UnitView(name=u.name, module_type=type(u.module).__name__, is_root=u.is_root,
                    state=u.state.value, reshard_after_forward=u.reshard_after_forward,
                    pins=u.pins, groups=tuple(groups), packed=tuple(packed))


def _comm_view(backend: str, stats: CommStats) -> CommView:
    def counts(counter) -> dict[str, int]:
        return {**dict.fromkeys(_KINDS, 0), **counter}
    return CommView(backend, counts(stats.bytes), counts(stats.calls), counts(stats.sent))


def inspect(module: nn.Module) -> ModelView:
    """A read-only snapshot of a sharded model's engine state on this rank.

    Never communicates, so any rank may call it alone, at any moment (inside a hook, in
    the middle of a step, in a debugger); the snapshot holds copies and does not follow
    later changes.

    Args:
        module: the module :func:`shardwise.shard` returned (the root).

    Returns:
        A :class:`ModelView`: the units (names, states, groups, parameters and their
        layout), this rank's bytes of parameters, gradients and full parameters, the
        largest gathered unit, the phase of the iteration and the communication counters.

    Raises:
        ShardwiseError: ``module`` is not sharded, or is a part of a sharded model
            rather than its root.

    Example:
        >>> view = sw.inspect(model)
        >>> [u.name for u in view.units]
        ['<root>', 'blocks.0', 'blocks.1']
        >>> view.phase, view.unit("blocks.0").state
        ('idle', 'sharded')
        >>> print(view)      # a table of the units and this rank's bytes
    """
    require_module(module, "sw.inspect")
    state = model_state(module)
    if state is None:
        name = type(module).__name__
        if unit_of(module) is not None or any(
                sharded_param(p) is not None for p in module.parameters()):
            raise ShardwiseError(
                f"this {name} is part of a sharded model, not its root: sw.inspect takes "
                f"the module sw.shard returned")
        raise ShardwiseError(f"this {name} is not sharded: sw.inspect takes the module "
                             f"sw.shard returned")
    units = tuple(_unit_view(u) for u in state.units)
    groups: list[ParamGroup] = [g for u in state.units for g in u.groups]
    params = [p for u in state.units for p in u.params]
    managed = {id(t) for g in groups for p in g.params for t in (p.shard, p.full)}
    packed_bytes = sum(pv.shard_bytes for u in units for pv in u.packed)
    return ModelView(
        rank=state.comm.rank, world_size=state.comm.world_size, phase=state.phase.value,
        steps=state.steps, prefetch=state.prefetch, src_rank=state.src_rank,
        buffers=state.buffers.policy.value, grad_sync=state.requires_grad_sync,
        align=ALIGN,
        param_bytes=sum(g.shard_bytes for g in groups), packed_bytes=packed_bytes,
        grad_bytes=unique_bytes(sp.shard.grad for sp in params if sp.shard.grad is not None),
        full_bytes=sum(gv.full_bytes for u in units for gv in u.groups if gv.full_allocated)
        + sum(pv.full_bytes for u in units for pv in u.packed if pv.full_allocated),
        largest_gathered_bytes=max((u.gathered_bytes for u in units), default=0),
        comm=_comm_view(state.comm.backend, state.topology.shard.stats),
        comm_world=(None if state.comm is state.topology.shard
                    else _comm_view(state.comm.backend, state.comm.stats)),
        shard_size=state.topology.shard.world_size, replicas=state.topology.replicas,
        comm_across=(None if (across := state.topology.replicate) is None
                     else _comm_view(across.backend, across.stats)),
        comm_regather=(None if (regather := next(
            (g.regather for u in state.units for g in u.groups if g.regather is not None),
            None)) is None else _comm_view(regather.backend, regather.stats)),
        kept_bytes=sum(g.kept_bytes for g in groups),
        unmanaged=tuple(n for n, p in module.named_parameters() if id(p) not in managed),
        offload=next(filter(None, (g.storage.describe() for g in groups)), None),
        tier_bytes=tier_totals(groups),
        moved_bytes=sum(g.moved_bytes for g in groups), units=units)
