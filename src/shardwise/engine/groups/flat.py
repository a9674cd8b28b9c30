"""A flat group: a unit's parameters of one kind, in one flat buffer per rank, moved by
one collective: plain parameters of one dtype and ``requires_grad`` by rows, or frozen
tensor subclasses as bytes (Note [one group type]).

Its modes are objects it is given (engine/groups/parts.py, engine/groups/reduce.py), made
once by :func:`flat_group` from what ``shard`` was told; the group itself branches on none.
Note [DTensor parameters] and Note [freeing full parameters] in engine/iteration/unit.py say
what its two buffers are to the modules and to autograd.

Note [one group type]
Every sharded parameter has one record, :class:`ShardedParam`, found from its shard or its
full form by one lookup (:func:`sharded_param`), and a *gather strategy*, decided at
``shard`` from the parameter itself, as FSDP2's ``FSDPParam`` decides between its plain
path and the extension protocol for each parameter:

- :class:`Rows`, a plain parameter: its shard is its rows (Note [row sharding] in
  engine/groups/layout.py), in place in the group's shard buffer of the parameter's dtype.
  That buffer is what the all-gather sends (cast to the compute dtype under mixed
  precision); the full parameter views the gathered buffer, copied out parameter after
  parameter; its gradient is reduce-scattered back into rows of the same layout.
- ``SubclassBytes`` (engine/groups/subclass.py), a frozen tensor subclass implementing
  FSDP2's extension protocol (a QLoRA base's ``NF4Tensor``, Note [packed parameters]):
  its shard is its inner tensors' bytes; ``fsdp_pre_all_gather`` says what it sends,
  which travels as bytes, and ``fsdp_post_all_gather`` builds the full tensor from what
  was gathered, and refills it in place at later gathers.

Why the two differ. Rows are numbers a rank computes with and reduces: each parameter's
slot holds ``ceil(rows / N)`` rows, zero-padded, so that every rank's shard has one size
and one all-gather gives a rank-major buffer, and each slot starts aligned (Note
[alignment]) so that elementwise kernels take each element down the same vectorised
path whichever parameters are its neighbours; gradients are reduced in that layout. A
subclass's bytes are not numbers anyone adds: packed 4-bit codes and their scales move
exactly, never through a cast, a NaN canonicalisation or a reduction, so they are viewed
as ``uint8`` and packed into one byte buffer (the protocol's inputs may be of several
dtypes). They cannot be padded by rows: a subclass chunk cannot hold padding rows (NF4's
blocks of scales), so a weight whose rows and blocks do not split into N equal chunks is
divided by elements of its inner tensors instead, each padded to ``ceil(numel / N)``
(Note [uneven packed parameters]); slots are aligned only so that views of any dtype
start at a multiple of its size. A group holds parameters of one strategy (and, for rows,
of one dtype and ``requires_grad``), so that its one collective has one element type: the
compute dtype, or bytes.

Trainable tensor subclasses. An FP8 training weight is where the two strategies would
meet: torchao's ``WeightWithDynamicFloat8CastTensor`` wraps the high-precision weight, its
``fsdp_pre_all_gather`` casts this rank's part to float8 (all-reducing the weight's amax
over the shard mesh: a collective inside the gather, which every rank reaches in the
same order since a group's gather is one) so that the all-gather moves a quarter of the
bytes, and its ``fsdp_post_all_gather`` builds a ``Float8TrainingTensor`` for the matmul.
It would need:

- gradients of the subclass: autograd accumulates into the full parameter a gradient of
  the weight's shape in the high-precision dtype, a plain tensor, which the full
  parameter must take (``requires_grad``) and the end-of-backward trigger must see
  (``hook_end_of_backward``);
- a reduce-scatter of that plain gradient into rows: the parameter's shard must then be
  rows of its high-precision master (a :class:`Rows` slot, in a buffer the reduction
  knows), with the subclass wrapping the local rows, so that its gather takes the
  protocol's path and its reduction the rows' path;
- the optimizer stepping the master in high precision: the shard the optimizer holds is
  the DTensor of those rows, stepped as any plain shard (Note [plain step] in
  engine/entry_points/plain_step.py), and the next ``fsdp_pre_all_gather`` casts the new
  values again; nothing float8 is ever stepped or saved (a checkpoint holds the rows).

What keeps that door open today is a refusal at ``shard``, before anything changes:
``subclass_refusal()`` in engine/groups/subclass.py (through :func:`refusal`, which
``shard`` asks of every parameter) refuses a tensor subclass that requires grad,
naming it ("shardwise gathers tensor subclasses through the extension protocol for
frozen weights only"), rather than gathering it as frozen bytes whose gradient would be
lost. Lifting it means giving ``SubclassBytes`` a rows side for its gradient and master,
not another kind of group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, SupportsIndex, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..._registry import (
    PARAM,
    TENSOR_PARALLEL,
    attach_to,
    attached,
    copy_all_attributes,
    copy_user_attributes,
)
from ...comm.collectives import Comm
from ...comm.mesh import Topology
from ...errors import ShardwiseError
from .copies import (
    copy_out,
    padding_gaps,
    round_chunks,
    round_span,
    scatter_rounds,
)
from .exact_reduction import ExactReduction
from .layout import Piece, ShardLayout, Slot, build_layout, contiguous_stride
from .parts import DeviceStorage, Placement, Precision, SecondaryShard, ShardStorage
from .reduce import GradReduction, Group
from .subclass import (
    ByteStorage,
    cuts_agreed,
    group_view,
    not_gathered,
    received,
    send_bytes,
    store_layout,
    subclass_refusal,
    subclass_shard,
    twin_shard,
    uses_protocol,
)
from .tensor_parallel import TpSpec


@dataclass
class Member:
    """One original parameter handed to a group: its names, where it is registered, and
    the tensor (whose values the group's shard takes)."""

    fqns: list[str]
    slots: list[tuple[nn.Module, str]]
    param: torch.Tensor


@dataclass(frozen=True)
class Rows:
    """How a plain parameter is gathered: its rows, in place in the group's shard buffer
    (``slot``: Note [row sharding] in engine/groups/layout.py; ``piece``: this rank's part
    of it). One of the two gather strategies of Note [one group type]."""

    slot: Slot
    piece: Piece
    # A tensor-parallel parameter's: its slot holds its local tensor (Note
    # [tensor-parallel parameters] in engine/groups/tensor_parallel.py).
    tp: TpSpec | None = None

    def local_of(self, shard: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows, a view of a group's shard buffer ``shard``."""
        s = self.slot
        rows = s.local_rows(rank)
        return shard[s.offset:s.offset + rows * s.row_numel].view(rows, *s.shape[1:])

    def full_of(self, full: torch.Tensor) -> torch.Tensor:
        """The full parameter's view of a group's full buffer ``full``."""
        s = self.slot
        view = full[s.full_offset:s.full_offset + s.numel].view(s.shape)
        return view if self.tp is None else self.tp.compute_form(view)

    def shard_form(self, local: torch.Tensor, topology: Topology) -> DTensor:
        """What users and optimizers hold of ``local`` (this rank's rows): a DTensor of
        the full shape on the model's mesh; a tensor-parallel parameter's, on the dp and
        tp dims together."""
        shape = torch.Size(self.slot.shape)
        with torch.no_grad():
            if self.tp is not None:
                assert topology.given is not None, "refused at shard otherwise"
                return self.tp.shard_form(local, topology.given, topology.placements)
            return DTensor.from_local(local, topology.mesh, topology.placements,
                                      run_check=False, shape=shape,
                                      stride=contiguous_stride(shape))

    def mine_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s rows in a group's full buffer ``full``, flat."""
        start = self.slot.full_offset + self.piece.param_offset
        return full[start:start + self.slot.local_rows(rank) * self.slot.row_numel]


@dataclass
class ShardedParam:
    """One original parameter: every place it is registered, its shard, its full form, and
    how it is gathered (``gather``: Note [one group type]). The one record of a sharded
    parameter, plain or a tensor subclass; :func:`sharded_param` finds it."""

    fqns: list[str]
    slots: list[tuple[nn.Module, str]]
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    # This rank's part, a view of the group's shard buffer: its rows, or a tensor
    # subclass's bytes (its slots, one after another).
    local: torch.Tensor
    shard: nn.Parameter   # what the module and the optimizer hold while sharded
    # The full parameter while gathered; a tensor subclass's is built at its first gather
    # (until then, and again after ``leave_full``, an empty one on the meta device:
    # ``not_gathered`` in engine/groups/subclass.py).
    full: nn.Parameter
    # Its gather strategy: :class:`Rows`, or a tensor subclass's ``SubclassBytes``
    # (engine/groups/subclass.py).
    gather: Any
    unit: Any = None  # its Unit (engine/iteration/unit.py, which imports this module)
    group: Any = None  # the group holding it
    hooked: bool = False  # ``full`` carries the end-of-backward trigger (hook_end_of_backward)
    proxies_hooks: bool = False  # ``full`` calls the shard's hooks (Note [tensor hooks on shards])
    # ``full``'s AccumulateGrad node, held (Note [a backward that accumulates nothing]).
    accumulator: Any = None

    @property
    def slot(self) -> Slot:
        """A plain parameter's slot in its group's layout (its :class:`Rows`)."""
        return self.gather.slot

    @property
    def piece(self) -> Piece:
        """This rank's part of a plain parameter (its :class:`Rows`)."""
        return self.gather.piece

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def by_rows(self) -> bool:
        """Whether it is gathered by rows (:class:`Rows`): its shard a DTensor of its rows,
        its gradient reduce-scattered; else a tensor subclass, gathered as bytes."""
        return type(self.gather) is Rows

    def hook_end_of_backward(self) -> None:
        """Give ``full`` the end-of-backward trigger (its model's
        ``ensure_backward_callback``), unless it has it: the one place it is registered,
        by the build for each trainable parameter, and for a full parameter unfrozen
        (Note [freezing after shard]), recast or replaced later."""
        if self.hooked:
            return
        assert self.unit is not None, "hooked once its unit and model are built"
        model = self.unit.model
        self.full.register_post_accumulate_grad_hook(
            lambda _p: model.ensure_backward_callback(accumulating=True))
        self.hooked = True

    # A sharded parameter belongs to one model: copying or pickling a shard, a submodule or
    # anything else reaching this record alone would copy the unit's state and process
    # group, or crash on a freed full parameter. A whole-model deep copy never gets here
    # (engine/clone.py maps every shard to its copy beforehand).
    def __deepcopy__(self, memo: dict) -> NoReturn:
        raise ShardwiseError(
            f"{self.fqns[0]} is a parameter of a sharded model, which is deep-copied as a "
            f"whole: copy.deepcopy(model) gives an independent sharded copy. For values, "
            f"use p.detach().clone() or sw.full_state_dict(model)")

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise ShardwiseError(
            f"{self.fqns[0]} is a parameter of a sharded model, which cannot be pickled "
            f"(torch.save of the model, a submodule or a parameter). Save weights instead: "
            f"sw.save_checkpoint(path, model, optimizer) to resume, "
            f"sw.full_state_dict(model) for one consolidated state dict, or "
            f"torch.save(model.state_dict(), per_rank_file) for this rank's rows")

    def as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows) as a DTensor sharded like the parameter."""
        dt = cast(DTensor, self.shard)
        spec = dt._spec
        # Note [a gradient's DTensor]
        # Every synced backward wraps each parameter's reduced rows as its shard's
        # ``.grad`` (zero_grad sets it to None). ``DTensor.from_local`` runs an autograd
        # function and builds a new spec each time: 22 us a call against 2 for the
        # constructor it ends in (benchmarks/compiled.py's Llama: 39 parameters, about
        # 1.5 ms of a step's CPU). Rows of the parameter's dtype get the parameter's own
        # spec (its mesh, placements, global shape, stride and dtype: what from_local
        # would build) and the fresh view from_local makes; anything else (another
        # dtype or shape, rows on another device than the mesh's, which from_local
        # moves) goes through from_local.
        with torch.no_grad():
            if (spec.tensor_meta is not None and local.dtype == spec.tensor_meta.dtype
                    and local.shape == dt._local_tensor.shape
                    and local.device.type == spec.mesh.device_type):
                # requires_grad as from_local gives it under no_grad: False.
                return DTensor(local.view_as(local), spec, requires_grad=False)
            return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False,
                                      shape=self.shard.shape, stride=self.shard.stride())


# Note [tensor hooks on shards]
# Autograd computes with a unit's full parameters, so hooks registered on the shards (what
# ``model.parameters()`` yields) were never called. ``register_hook`` on a shard now runs
# where it runs under DDP: on each backward's local gradient of the whole parameter, before
# it is accumulated and reduced, its return value replacing the gradient; the engine
# registers one hook on the full parameter that calls the shard's hooks in order (taken up
# at each forward that records a graph). ``register_post_accumulate_grad_hook`` on a shard
# runs as under FSDP2: once the reduced gradient shard is in ``p.grad``, at the end of each
# synchronised backward, with the shard as its argument, so that an optimizer stepped
# inside the hook (the optimizer-in-backward idiom) steps on the averaged gradient. Under
# ``no_sync`` it runs once a step, at the synchronised backward, when the shard's ``.grad``
# changes (DDP runs it after every micro-batch, on the local gradient).
def _run_shard_hooks(shard: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The shard's ``register_hook`` hooks, in order, on its full parameter's gradient
    (Note [tensor hooks on shards])."""
    for hook in list((shard._backward_hooks or {}).values()):
        out = hook(grad)
        if out is not None:
            grad = out
    return grad


# Note [gathering in place]
# An all-gather writes every rank's shard, rank after rank; the full buffer holds every
# parameter whole, parameter after parameter. The two orders are one when the group is a
# single parameter whose chunk of rows is a whole number of alignment blocks (Note
# [row sharding] in engine/groups/layout.py): its full buffer is padded to the world's
# chunks as the shards are, so the rank-major order is the full one. An embedding or an
# untied head given a unit of its own (Note [the embeddings' own units] in
# planning/units.py) nearly always is: 64 elements divide a chunk of rows as wide as a
# model's hidden size. Such a group gathers
# straight into the full buffer's memory, allocated when the gather is issued, and
# ``wait_gather`` has nothing to copy: the unit's gathered form exists once, not twice,
# while it is gathered (for a QLoRA embedding of 501 MiB, the excess over issue 54's
# target). The all-gather writes through a tensor of its own over that storage, so that
# gloo's bump of its output's version counter, on a worker thread, never reaches
# ``full``'s (Note [freeing full parameters] in engine/iteration/unit.py). Memory a
# collective still writes is never freed: ``reshard`` waits for the gather first, and a
# gather left to gloo when ranks diverged (Note [checks ride the exchanges] in
# comm/channel.py), which nobody waits for, keeps the buffer: the group takes a new,
# empty one (``leave_full``), and the old one is freed with gloo's work.


class FlatGroup:
    """One collective's worth of a unit's parameters, in one flat buffer per rank: plain
    parameters of one dtype and one ``requires_grad`` value, gathered by rows, or frozen
    tensor subclasses, gathered as bytes (Note [one group type]).

    ``local`` is this rank's shard buffer (the DTensor parameters' local tensors view
    it, or the subclasses' inner tensors do); ``full`` is the gathered form (every full
    parameter, or the subclasses' gathered bytes), and its storage is empty while the
    group is sharded. A gather all-gathers what each parameter's strategy sends (the
    shard itself, for rows) into a temporary rank-major buffer and copies it out into
    ``full``, from which the subclasses' strategies build their full tensors; a
    reduction copies the full gradients into a rank-major buffer and reduce-scatters it
    into this rank's gradient shard. In a world of one the shard is already the
    rank-major buffer, and the gradient buffer already the sum.
    """

    def __init__(self, members: list[Member], topology: Topology, layout: ShardLayout,
                 storage: ShardStorage, precision: Precision, secondary: SecondaryShard,
                 reduction: Callable[[Group], GradReduction],
                 make: Callable[[FlatGroup, int, Member], ShardedParam] | None = None) -> None:
        """``storage``: where the shard lives (on the device, or offloaded: Note [two
        states, three tiers] in engine/groups/offload/__init__.py), made for ``layout``;
        ``precision``: the dtypes it gathers and reduces in; ``secondary``: Note
        [secondary shards] in comm/mesh.py; ``reduction``: the class of its gradient
        reduction (the reproducible mode's: Note [reproducible reduction]); ``make``: the
        record of member i of this group, for tensor subclasses (their bytes in
        ``layout``); by default a plain parameter's rows. Use :func:`flat_group` and
        :func:`subclass_group` to make them from ``shard``'s arguments."""
        self.topology = topology
        self.comm = topology.shard
        # Hybrid sharding (Note [hybrid sharding] in comm/mesh.py): the ranks holding the same
        # rows, across which the reduced gradient shard is summed.
        self.replicate = topology.replicate
        self.storage = storage
        self.device = storage.device  # where gathers and reductions run; local may be elsewhere
        self.precision = precision
        self.secondary = secondary
        self.dtype = storage.master.dtype
        # Reduced when any parameter is trainable (Note [freezing after shard]).
        self.requires_grad = any(m.param.requires_grad for m in members)
        self.trainable_at_build = all(m.param.requires_grad for m in members)
        self.layout = layout
        # Its parameters' strategy (Note [one group type]): rows, whose shard is what the
        # all-gather sends, laid out as planned; else subclasses, whose inputs' layout
        # is known at the first gather, and whose full tensors hold storage of their own.
        self.by_rows = make is None
        self.gather_layout: ShardLayout | None = layout if self.by_rows else None
        self._sizes: list[list[tuple[torch.Size, torch.dtype]]] = []
        self._extra: list[tuple[torch.Tensor, int]] = []
        self.full = torch.empty(layout.full_numel if self.by_rows else 0,
                                dtype=precision.compute, device=self.device)
        self.gaps = padding_gaps(layout)
        self.gathers_in_place = (self.by_rows and self.comm.world_size > 1
                                 and len(layout.slots) == 1
                                 and layout.slots[0].chunk_numel == layout.shard_numel
                                 and layout.gathered_numel == layout.full_numel)
        self.params: list[ShardedParam] = [(make or FlatGroup._make_param)(self, i, m)
                                           for i, m in enumerate(members)]
        self.free()
        self._gathered: torch.Tensor | None = None  # all-gather output, until copied out
        self._gather_work: Any = None
        self._sending: torch.Tensor | None = None  # read by the all-gather until waited for
        # The shard whose rows the copy-out reads, where the all-gather skipped this
        # rank's part of ``_gathered`` (Note [own rows from the shard]).
        self._own_rows: torch.Tensor | None = None
        self._gathered_version = -1
        self._full_version: tuple[int, ...] = ()  # once filled: _versions (keep_edits)
        # Used by trainable groups only.
        self.reduction: GradReduction = reduction(self)
        self.unit_name = "?"  # set by its Unit; names the group's collectives

    # -- what it was given, as the rest of the engine reads it -----------------------
    @property
    def local(self) -> torch.Tensor:
        """This rank's shard buffer (on the device, or on an offload tier)."""
        return self.storage.master

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.precision.reduce

    @property
    def regather(self) -> Comm | None:
        """The group of k ranks its backward gathers in (Note [secondary shards])."""
        return self.secondary.comm

    def twin(self) -> FlatGroup:
        """An independent copy (``copy.deepcopy`` of the model, Note [deep copy] in
        engine/clone.py): the same kinds of objects, its own copy of this rank's shard,
        new shards over it, the same slots until the caller remaps them, nothing
        gathered. No communication."""
        storage = self.storage.like()
        with torch.no_grad():
            storage.master.copy_(self.local)
        members = [Member(list(p.fqns), p.slots, p.shard) for p in self.params]
        make = None if self.by_rows else functools.partial(_subclass_twin, self)
        return FlatGroup(members, self.topology, self.layout, storage,
                         Precision(self.precision.compute, self.precision.reduce),
                         self.secondary.like(), type(self.reduction), make)

    def follow_tensor_hooks(self) -> None:
        """Give each full parameter whose shard has ``register_hook`` hooks the one hook
        that calls them (Note [tensor hooks on shards])."""
        if not self.by_rows:
            return  # frozen: no gradient to hook
        for p in self.params:
            if p.shard._backward_hooks and not p.proxies_hooks:
                p.full.register_hook(functools.partial(_run_shard_hooks, p.shard))
                p.proxies_hooks = True

    def cast_refusal(self) -> str | None:
        """Why the group cannot be cast to another dtype now that it is at rest (Note
        [casting after shard] in engine/entry_points/casts.py), or ``None``."""
        return self.storage.cast_refusal(self.unit_name) or self.reduction.cast_refusal()

    @property
    def steps_in_place(self) -> bool:
        """Whether an optimizer may step its shards' local tensors where they are (Note
        [plain step] in engine/entry_points/plain_step.py): not an offloaded group's."""
        return self.storage.steps_in_place

    def _make_param(self, i: int, m: Member) -> ShardedParam:
        orig = m.param
        tp = attached(orig, TENSOR_PARALLEL)  # a stand-in's: Note [tensor-parallel parameters]
        rows = Rows(self.layout.slots[i], self.layout.piece(i, self.comm.rank), tp)
        local = rows.local_of(self.local, self.comm.rank)
        shard = nn.Parameter(rows.shard_form(local, self.topology),
                             requires_grad=orig.requires_grad)
        full = nn.Parameter(rows.full_of(self.full), requires_grad=orig.requires_grad)
        # Keep user attributes set on the parameter (e.g. "no weight decay" flags).
        copy_user_attributes(orig, shard, full)
        if tp is not None:
            attach_to(shard, TENSOR_PARALLEL, tp)  # for a deep copy's group (twin)
        return ShardedParam(m.fqns, m.slots, torch.Size(rows.slot.shape), orig.dtype,
                            orig.requires_grad, local, shard, full, rows, group=self)

    # -- storage ---------------------------------------------------------------------
    def _alloc_full(self) -> None:
        assert self.gather_layout is not None, "gathered once"
        if self.full.numel() != self.gather_layout.full_numel:  # a subclass group's first
            self.full = torch.empty(self.gather_layout.full_numel, dtype=self.full.dtype,
                                    device=self.device)
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        for t, n in self._extra:  # what fsdp_post_all_gather allocated, refilled in place
            if t.untyped_storage().size() != n:
                t.untyped_storage().resize_(n)

    def free(self, keep_grads: bool = False) -> None:
        """Free the full parameters (and, unless ``keep_grads``, their gradients)."""
        if not keep_grads:
            for p in self.params:
                p.full.grad = None
        storage = self.full.untyped_storage()
        nbytes = storage.size()
        storage.resize_(0)
        for t, _ in self._extra:
            t.untyped_storage().resize_(0)
        if nbytes:
            self.storage.full_freed(nbytes)

    def leave_full(self) -> list[nn.Parameter]:
        """Note [full parameters held after gathered()] in gather.py: leave the full
        buffer, values included, to whatever still references it (a full parameter, a
        view of one, an autograd graph) and take a new, empty one with new full
        parameter objects, registered where the old ones were. Returns the old objects.
        The group must be gathered; the caller reshards it next (which frees only the
        new, empty buffer). A subclass group's full tensors are built again at the next
        gather (Note [one group type])."""
        old = [p.full for p in self.params]
        if not self.by_rows:
            self.full = torch.empty(0, dtype=self.full.dtype, device=self.device)
            self._extra = []
            for p in self.params:
                p.full, p.gather.allocated = not_gathered(p.dtype), []
            return old
        nbytes = self.full.untyped_storage().size()
        self.full = torch.empty(self.layout.full_numel, dtype=self.compute_dtype,
                                device=self.device)
        for p, before in zip(self.params, old):
            p.full = nn.Parameter(p.gather.full_of(self.full),
                                  requires_grad=before.requires_grad)
            copy_all_attributes(before, p.full)  # the user's flags and our record
            p.hooked = False
            if p.requires_grad:
                p.hook_end_of_backward()
            before.grad = None  # as free() drops it
            for module, attr in p.slots:
                if module._parameters.get(attr) is before:
                    module._parameters[attr] = p.full
        self.full.untyped_storage().resize_(0)  # views are made: nothing to hold yet
        if nbytes:  # no longer ours: counted as freed, as free() counts it
            self.storage.full_freed(nbytes)
        return old

    def keep_edits(self) -> bool:
        """Note [edits of held parameters] in engine/iteration/unit.py: copy into the shard this
        rank's rows of the full parameters where code changed them since the gather.
        Returns whether an in-place operation wrote to the full parameters (their
        version counter moved: every rank making the same edit sees it, whichever rows
        it touched)."""
        if not self.by_rows or not self.full_is_allocated():
            return False
        compute = self.compute_dtype
        with torch.no_grad():
            for p in self.params:
                mine = p.gather.mine_of(self.full, self.comm.rank)
                if not mine.numel():
                    continue
                local = p.local.view(-1)
                seen = local if local.dtype == compute else local.to(compute)
                if torch.equal(mine, seen):
                    continue
                changed = (mine != seen) & ~(mine.isnan() & seen.isnan())
                if bool(changed.any()):
                    local.copy_(torch.where(changed, mine.to(local.dtype), local))
        self.storage.release()
        return _versions(self, self.full._version) != self._full_version

    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def expose(self, full: bool) -> None:
        """Register the full parameters (``full``) or the shards on their modules (Note
        [what the module sees] in engine/iteration/unit.py)."""
        for p in self.params:
            tensor = p.full if full else p.shard
            if not full and p.full.requires_grad != p.requires_grad \
                    and p.shard.requires_grad == p.requires_grad:
                # Note [flags of a forward without gradients] in engine/iteration/unit.py: a flag
                # code set on the full parameter while it was registered goes to the
                # shard, where it is taken up and where code sets it next.
                p.shard.requires_grad_(p.full.requires_grad)
                p.full.requires_grad_(p.requires_grad)
            for module, attr in p.slots:
                module._parameters[attr] = tensor

    def install(self) -> None:
        """Register each shard in place of its parameter on every module holding it."""
        for sp in self.params:
            set_sharded_param(sp.shard, sp)
            set_sharded_param(sp.full, sp)
            for m, attr in sp.slots:
                m._parameters[attr] = sp.shard

    def fill_local(self, values: list[torch.Tensor] | None, src: int) -> None:
        """Set every rank's shard from world rank ``src``'s full ``values``: a scatter
        over ``src``'s shard group, then (hybrid) a broadcast to the other replicas."""
        replica, shard_src = self.topology.source(src)
        into = self.storage.receiving()  # an offloaded shard is received on the device
        if self.topology.replica_index == replica:
            mine = self.comm.rank == shard_src
            assert values is not None or not mine, "src_rank passes the values"
            with torch.no_grad():
                if not self.by_rows:
                    chunks = list(self._shares(values).chunk(self.comm.world_size)) \
                        if values is not None and mine else None
                    self.comm.scatter(into, chunks, shard_src)
                else:
                    scatter_rows(self, into, values if mine else None, shard_src)
        if self.replicate is not None:
            with torch.no_grad():
                self.replicate.broadcast(into, replica,
                                         what="the broadcast of initial shards to replicas")
        self.storage.received(into)

    def _shares(self, values: list[torch.Tensor]) -> torch.Tensor:
        """Every rank's shard of the subclasses' full ``values``, rank after rank: each
        one's shares, divided as its cut says, one parameter at a time (a placeholder's
        bytes are made only as they are copied: Note [quantize while loading] in
        engine/groups/quantize.py)."""
        grid = torch.zeros(self.comm.world_size, self.layout.shard_numel, dtype=self.dtype,
                           device=self.device)
        for p, v in zip(self.params, values):
            p.gather.write_shares(grid, p.fqns[0], v)
        return grid.view(-1)

    @property
    def data_parallel_size(self) -> int:
        """How many ranks' gradients a reduction averages: the shard group's, times the
        replicas' under hybrid sharding."""
        return self.comm.world_size * self.topology.replicas

    def gather_full(self) -> torch.Tensor:
        """A fresh full buffer with every full parameter, in ``dtype`` (a collective)."""
        gathered = torch.empty(self.layout.gathered_numel, dtype=self.dtype,
                               device=self.device)
        self.comm.all_gather(gathered, self.storage.readable())
        out = torch.empty(self.layout.full_numel, dtype=self.dtype, device=self.device)
        copy_out(gathered, self.layout, out)
        return out

    def gather_values(self, params: list[ShardedParam] | None = None, keep: bool = True,
                      what: str = "an all-gather") -> dict[int, torch.Tensor]:
        """``params``' full values (all of the group's when None), by id, freshly gathered
        into memory of their own, the group's own gathered form untouched: in the master
        dtype, or the subclasses' full tensors. One all-gather over the shard group: of
        the shard as it is when ``params`` are all the group's, else of each rank's slot
        of each, laid out as a group of those parameters alone would be (the same rows
        per rank: ``torch.chunk``'s split depends on the world size only). Where nothing
        is ``keep``, nothing is copied out."""
        return _gather_values(self, params, keep, what)

    def full_value(self, p: ShardedParam, full: torch.Tensor) -> torch.Tensor:
        """Parameter ``p``'s view of a full buffer such as ``gather_full()``'s."""
        return p.gather.full_of(full)

    def local_from_full(self, full: torch.Tensor) -> None:
        """Take this rank's rows of every parameter from a full buffer (``full``'s
        layout), as when one rank's edits were broadcast."""
        with torch.no_grad():
            for p in self.params:
                p.local.view(-1).copy_(p.gather.mine_of(full, self.comm.rank))
        self.storage.release()

    # -- gather ----------------------------------------------------------------------
    def shard_version(self) -> int:
        """Changes whenever this rank's shard is written.

        Optimizer steps write through the DTensor parameters, and DTensor's dispatch bumps
        the wrapper's version counter, not its local tensor's; the plain step (Note
        [plain step] in engine/entry_points/plain_step.py) writes through the wrappers' local
        tensors, which have counters of their own; shardwise writes through ``local``. All count.
        A group of tensor subclasses is written only through ``local`` (a load,
        ``gathered(modifier_rank=)``): frozen, nothing steps them.
        """
        if not self.by_rows:
            return self.local._version
        return self.local._version + sum(
            p.shard._version + cast(DTensor, p.shard)._local_tensor._version
            for p in self.params)

    def start_gather(self) -> None:
        # The full buffer is allocated only at the copy-out: a prefetched unit holds the
        # all-gather output alone until it is needed.
        version = self.shard_version()
        self._gathered_version = version
        regathered = self.secondary.start_gather(version, self.layout.gathered_numel,
                                                 self.compute_dtype, self.unit_name)
        self._own_rows = None
        if regathered is not None:
            self._gathered, self._gather_work = regathered
            return
        src = self._send(version)
        if self.comm.world_size == 1:
            # The rank-major buffer of a world of one is the shard itself: copied out as is.
            self._gathered = src
            return
        self._gathered = self._gather_output()
        self._sending = src
        # Note [own rows from the shard] in engine/groups/copies.py: unless the output is
        # kept (a secondary shard is taken from it) or is the full buffer (Note
        # [gathering in place]: nothing is copied out, so the exchange writes them).
        self._gather_work = self.comm.all_gather(
            self._gathered, src, async_op=True, what=f"the all-gather of unit {self.unit_name!r}",
            skip_own=self.by_rows and not self.secondary.keeps and not self.gathers_in_place)
        if self._gather_work.own_skipped:
            self._own_rows = src

    def _gather_output(self) -> torch.Tensor:
        """Where this rank's all-gather writes: the full buffer's memory when the
        rank-major order is the full one (Note [gathering in place]), else a buffer of
        its own that ``wait_gather`` copies out."""
        if self.gathers_in_place:
            self._alloc_full()
            # A tensor of its own over the full buffer's storage: gloo bumps *its*
            # version counter, on its worker thread, never ``full``'s.
            return self.full.new_empty(0).set_(self.full.untyped_storage())
        assert self.gather_layout is not None
        return torch.empty(self.gather_layout.gathered_numel, dtype=self.compute_dtype,
                           device=self.device)

    def _send(self, version: int) -> torch.Tensor:
        """What this rank's all-gather sends (Note [one group type]): the shard itself,
        every parameter's rows in place (in the compute dtype); or what each subclass's
        strategy gives, as bytes."""
        if self.by_rows:
            return self.storage.gather_source(version)
        send, self.gather_layout, self._sizes = send_bytes(
            self.params, self.comm.world_size, self.device, self.gather_layout, self._sizes)
        self.storage.release()  # Note [packed bytes offloaded]: read, so dropped
        return send

    def publish_grad(self, p: ShardedParam, rows: torch.Tensor) -> None:
        """Hand ``p`` its reduced rows as its shard's ``.grad``, or add them to it (on the
        optimizer's tier)."""
        self.storage.publish(p, rows)

    def is_stale(self) -> bool:
        """Whether the shard changed since the full parameters were gathered (or a
        prefetch was issued)."""
        gathered = self.full_is_allocated() or self._gathered is not None
        return gathered and self.shard_version() != self._gathered_version

    def wait_gather(self, fill: bool = True, keep: bool = False) -> None:
        """Wait for an issued all-gather and, if ``fill``, copy it out into the full
        parameters (``fill=False`` when resharding: the values are not needed). ``keep``:
        a forward's gather, whose backward gathers again within the group of k ranks
        (Note [secondary shards])."""
        if self._gather_work is not None:
            ended = self._gather_work.settle(use=fill)
            self._gather_work = None
            if not ended and self._gathered is not None and self._gathered_into_full():
                # Note [gathering in place]: gloo may still write into the full buffer.
                self.leave_full()
                self._gathered = None
        self.secondary.settled()
        self._sending = None
        own, self._own_rows = self._own_rows, None
        if self._gathered is not None:
            if fill:
                # Note [freeing full parameters]: autograd may hold views of ``full``.
                version = self.full._version
                if not self._gathered_into_full():
                    self._alloc_full()
                    assert self.gather_layout is not None
                    copy_out(self._gathered, self.gather_layout, self.full,
                             None if own is None else (self.comm.rank, own))
                    torch._C._autograd._unsafe_set_version_counter((self.full,), (version,))
                self._full_version = _versions(self, version)
                if not self.by_rows:
                    self._build_full()
                if keep:
                    self.secondary.keep(self._gathered, self._gathered_version)
            self._gathered = None

    def _gathered_into_full(self) -> bool:
        """Whether the all-gather output waited for is the full buffer's own memory."""
        assert self._gathered is not None
        return (self._gathered.untyped_storage()._cdata == self.full.untyped_storage()._cdata
                and self.full_is_allocated())

    def _build_full(self) -> None:
        """Each subclass's full tensor from the gathered bytes: built at its first
        gather, refilled in place after (Note [packed parameters])."""
        assert self.gather_layout is not None
        for p, outputs in zip(self.params, received(self.params, self.gather_layout,
                                                    self._sizes, self.full)):
            new = p.gather.after_gather(p, outputs, self.full)
            if new is not None:
                p.full = new
                set_sharded_param(new, p)
                self._extra += p.gather.allocated

    def drop_kept(self) -> None:
        """Forget the secondary shard (its backward ran, or never will)."""
        self.secondary.drop()

    def read_ahead(self) -> None:
        """Start reading an offloaded shard from disk for a gather soon (Note [the disk
        tier])."""
        self.storage.prefetch(gather=True)

    def start_reduce(self, sync: bool) -> None:
        """Hand this backward's full gradients to the reduction (a trainable group)."""
        if self.requires_grad:
            self.reduction.start(sync)

    # -- checkpoints -------------------------------------------------------------------
    def page_release(self) -> Callable[[], None] | None:
        """What drops this group's pages once a checkpoint read or wrote them (Note [the
        disk tier]); ``None`` when the group keeps none."""
        return self.storage.release if self.storage.on_disk else None

    def release_pages(self) -> None:
        self.storage.release()

    @property
    def streams_state(self) -> bool:
        """Whether its parameters' optimizer state lives in its files, read one tensor
        at a time by a load (Note [streamed load] in checkpoint/load.py)."""
        return self.storage.streams_state

    def adopt_state(self, p: ShardedParam, key: str, value: DTensor) -> DTensor:
        """Parameter ``p``'s optimizer state ``key``, moved to where the group keeps it."""
        return self.storage.adopt_state(p, key, value)

    # -- figures -----------------------------------------------------------------------
    @property
    def shard_bytes(self) -> int:
        return self.local.numel() * self.local.element_size()

    @property
    def full_bytes(self) -> int:
        """Bytes of the full parameters while gathered (a subclass group's: the
        gathered bytes and what the protocol allocated; 0 before its first gather)."""
        gathered = self.gather_layout.full_numel if self.gather_layout is not None else 0
        return gathered * self.compute_dtype.itemsize + sum(n for _, n in self._extra)

    @property
    def kept_bytes(self) -> int:
        """Bytes of the secondary shard held now (Note [secondary shards])."""
        return self.secondary.kept_bytes

    @property
    def moved_bytes(self) -> int:
        return self.storage.moved

    def bytes_by_tier(self) -> dict[str, int]:
        return self.storage.bytes_by_tier()

    def may_be_held(self) -> bool:
        """Whether its full parameters may stay gathered across ``no_sync``
        micro-batches (Note [residency] in engine/iteration/residency.py): not offloaded,
        and not tensor subclasses (a quantized base would stay gathered for an adapter's
        gradients)."""
        return self.by_rows and self.storage.describe() is None

    def grads_may_wait(self) -> bool:
        """Whether its gradients accumulated under ``no_sync`` may wait in the full
        parameters' ``.grad`` (Note [gathered across micro-batches] in
        engine/iteration/state.py): autograd's sums there are its reduction's only where
        that adds in the same dtype, one micro-batch after the other, from empty. Not the
        reproducible mode's exact sums, nor another reduce dtype, nor once the reduction
        holds part of the step. Frozen tensor subclasses have no gradient to wait."""
        return not self.by_rows or (not self.reduction.exact and self.reduce_dtype ==
                                    self.compute_dtype and not self.reduction.has_accumulated())

    def describe(self) -> dict[str, Any]:
        """Plain values for ``sw.inspect``'s ``GroupView`` (its parameters are read
        there, one by one), or, for tensor subclasses, its ``PackedView``."""
        if not self.by_rows:
            return group_view(self.params, self.shard_bytes, self.full_bytes,
                              self.full_is_allocated())
        params_tier, optimizer_tier = self.storage.tiers()
        return {"kind": "flat", "dtype": self.dtype, "compute_dtype": self.compute_dtype,
                "reduce_dtype": self.reduce_dtype, "requires_grad": self.requires_grad,
                "shard_numel": self.layout.shard_numel, "full_numel": self.layout.full_numel,
                "gathered_numel": self.layout.gathered_numel,
                "full_allocated": self.full_is_allocated(),
                "params_tier": params_tier, "optimizer_tier": optimizer_tier}


def _gather_values(g: FlatGroup, params: list[ShardedParam] | None, keep: bool,
                   what: str) -> dict[int, torch.Tensor]:
    """:meth:`FlatGroup.gather_values`."""
    world = g.comm.world_size
    wanted = g.params if params is None else params
    if not g.by_rows:
        send = g._send(g.shard_version())
        layout = g.gather_layout
    elif len(wanted) == len(g.params):
        layout, send = g.layout, g.storage.readable()
    else:
        layout, send = _rows_of(g, wanted)
    assert layout is not None
    gathered = send
    if world > 1 or g.by_rows:
        gathered = torch.empty(layout.gathered_numel, dtype=g.dtype, device=g.device)
        g.comm.all_gather(gathered, send, what=what)
    del send
    if not keep:
        return {}
    full = torch.empty(layout.full_numel, dtype=g.dtype, device=g.device)
    copy_out(gathered, layout, full)
    if not g.by_rows:
        ids = {id(p) for p in wanted}
        return {id(p): p.gather.value(p, outs)[0] for p, outs
                in zip(g.params, received(g.params, layout, g._sizes, full))
                if id(p) in ids}
    return {id(p): full[s.full_offset:s.full_offset + s.numel].view(p.shape)
            for p, s in zip(wanted, layout.slots)}


def _versions(g: FlatGroup, buffer_version: int) -> tuple[int, ...]:
    """The full buffer's version counter (``buffer_version``) and each tensor-parallel
    full parameter's: a write through a DTensor moves its own counter, not the buffer's
    (DTensor writes its local tensor below autograd)."""
    return (buffer_version,
            *(p.full._version for p in g.params if isinstance(p.full, DTensor)))


def scatter_rows(g: FlatGroup, into: torch.Tensor, values: list[torch.Tensor] | None,
                 src: int) -> None:
    """Rank ``src``'s full ``values`` (``None`` elsewhere) into every rank's rows of
    ``into``, its shard of ``g``, round by round (Note [scatter in rounds] in
    engine/groups/copies.py); the padding between slots is zeroed here."""
    for a, b in g.layout.padding(g.comm.rank):
        into[a:b].zero_()
    for slots in scatter_rounds(g.layout, g.dtype.itemsize):
        lo, hi = round_span(g.layout, slots)
        if hi == lo:  # parameters of no elements: nothing to send
            continue
        chunks = (None if values is None
                  else round_chunks(g.layout, slots, values, g.dtype, g.device))
        g.comm.scatter(into[lo:hi], chunks, src, what="the scatter of initial shards")


def _rows_of(g: FlatGroup, params: list[ShardedParam]) -> tuple[ShardLayout, torch.Tensor]:
    """Each rank's slot of each of ``params`` (some of ``g``'s), laid out as a group of
    those parameters alone would be, and this rank's part of it."""
    layout = build_layout([tuple(p.shape) for p in params], g.comm.world_size)
    local = g.storage.readable()
    send = torch.zeros(layout.shard_numel, dtype=g.dtype, device=g.device)
    for p, s in zip(params, layout.slots):
        send[s.offset:s.offset + s.chunk_numel].copy_(
            local[p.slot.offset:p.slot.offset + p.slot.chunk_numel])
    return layout, send


def flat_group(names: list[list[str]], slots: list[list[tuple[nn.Module, str]]],
               originals: list[nn.Parameter], layout: ShardLayout, topology: Topology,
               device: torch.device, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
               regather: Comm | None = None, exact: bool = False,
               placement: Placement | None = None) -> FlatGroup:
    """A :class:`FlatGroup` of ``originals`` with ``shard``'s settings turned into the
    objects it is given: the one place a flat group's modes are chosen.

    ``layout``: the originals' layout over the shard group, as planned (``group_specs``
    in planning/units.py: computed once); ``regather``: the group of k ranks a non-root
    unit's backward gathers in under ``reshard_after_forward=k`` (Note [secondary
    shards] in comm/mesh.py); ``exact``: the reproducible mode's reduction (Note
    [reproducible reduction]); ``placement``: where the model's states live, which makes
    the shard's storage (``Placement`` in engine/groups/parts.py), ``None`` for all on
    ``device``.
    """
    assert layout.world_size == topology.shard.world_size and \
        [s.shape for s in layout.slots] == [tuple(p.shape) for p in originals], \
        "the layout was planned for these parameters and this shard group"
    members = [Member(n, s, p) for n, s, p in zip(names, slots, originals)]
    dtype = originals[0].dtype
    storage: ShardStorage = (
        DeviceStorage(layout.shard_numel, dtype, compute_dtype, device) if placement is None
        else placement.storage(layout.shard_numel, dtype, compute_dtype))
    return FlatGroup(members, topology, layout, storage, Precision(compute_dtype, reduce_dtype),
                     SecondaryShard(regather), ExactReduction if exact else GradReduction)


def _plain(p: torch.Tensor) -> bool:
    return type(p) is nn.Parameter and type(p.data) is torch.Tensor


def gathers_bytes(p: torch.Tensor) -> bool:
    """Whether parameter ``p`` is gathered as a tensor subclass's bytes (``SubclassBytes``)
    rather than by rows (:class:`Rows`): the strategy of Note [one group type], decided
    from the parameter, as FSDP2 decides between its plain path and the protocol."""
    return not _plain(p) and uses_protocol(p)


def refusal(name: str, p: torch.Tensor) -> str | None:
    """Why parameter ``name`` cannot be sharded, or ``None``: a plain parameter is
    gathered by rows; anything else must be a frozen tensor subclass implementing the
    extension protocol (``subclass_refusal`` in engine/groups/subclass.py says why not)."""
    return None if _plain(p) else subclass_refusal(name, p)


def subclass_group(names: list[list[str]], slots: list[list[tuple[nn.Module, str]]],
                   originals: list[torch.Tensor], topology: Topology, device: torch.device,
                   compute_dtype: torch.dtype | None, src_rank: int, exact: bool = False,
                   placement: Placement | None = None) -> FlatGroup:
    """A :class:`FlatGroup` of frozen tensor subclasses (Note [packed parameters] in
    engine/groups/subclass.py), each gathered as bytes by its ``SubclassBytes``, holding
    ``src_rank``'s values: the one place such a group is made. ``compute_dtype``:
    MixedPrecision's ``param_dtype``, for the protocol; ``exact``: the model's reduction
    (the same kind in every group, though this one reduces nothing); ``placement``: the
    tiers of an offloaded model (Note [packed bytes offloaded])."""
    cuts = cuts_agreed([n[0] for n in names], originals, topology, compute_dtype)
    layout = store_layout(cuts)
    firsts = [0]
    for c in cuts:
        firsts.append(firsts[-1] + len(c.names))

    def make(g: FlatGroup, i: int, m: Member) -> ShardedParam:
        c = cuts[i]
        span, shard, gather = subclass_shard(
            m.fqns, m.param, c, g.local, list(layout.slots[firsts[i]:firsts[i + 1]]),
            topology, device, compute_dtype)
        return ShardedParam(m.fqns, m.slots, m.param.shape, m.param.dtype, False, span,
                            shard, not_gathered(m.param.dtype), gather, group=g)

    members = [Member(n, s, p) for n, s, p in zip(names, slots, originals)]
    g = FlatGroup(members, topology, layout, ByteStorage(layout.shard_numel, device),
                  Precision(torch.uint8, torch.uint8), SecondaryShard(None),
                  ExactReduction if exact else GradReduction, make)
    g.fill_local(originals if topology.world.rank == src_rank else None, src_rank)
    if placement is not None:
        views = {id(t): t for p in g.params for t in [p.local, *p.gather.views()]}
        g.storage.place(placement, list(views.values()))  # type: ignore[attr-defined]
    return g


def _subclass_twin(old: FlatGroup, g: FlatGroup, i: int, m: Member) -> ShardedParam:
    """Parameter i of ``g``, a copy of the subclass group ``old`` (:meth:`FlatGroup.twin`)."""
    p = old.params[i]
    span, shard, gather = twin_shard(p.local, p.shard, p.gather, old.local, g.local,
                                     old.topology)
    return ShardedParam(list(p.fqns), p.slots, p.shape, p.dtype, False, span, shard,
                        not_gathered(p.dtype), gather, group=g)


def sharded_param(t: torch.Tensor) -> ShardedParam | None:
    """The sharded parameter behind a shard or full parameter, or ``None``."""
    return attached(t, PARAM)


def set_sharded_param(t: torch.Tensor, sp: ShardedParam) -> None:
    attach_to(t, PARAM, sp)
