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
- ``SubclassBytes`` (engine/groups/packed.py), a frozen tensor subclass implementing
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
``refusal()`` in engine/groups/packed.py refuses a tensor subclass that requires grad,
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

from ..._registry import PARAM, attach_to, attached, copy_all_attributes, copy_user_attributes
from ...comm.collectives import Comm
from ...comm.mesh import Topology
from ...errors import ShardwiseError
from .copies import copy_out, padding_gaps, rank_major, write_rank_major
from .exact_reduction import ExactReduction
from .layout import Piece, ShardLayout, Slot, contiguous_stride
from .offload.placement import Placement
from .offload.storage import GroupStorage
from .parts import DeviceStorage, Precision, SecondaryShard, ShardStorage
from .reduce import GradReduction, Group


@dataclass
class Member:
    """One original parameter handed to a group: its names, where it is registered, and
    the tensor (whose values the group's shard takes)."""

    fqns: list[str]
    slots: list[tuple[nn.Module, str]]
    param: nn.Parameter


@dataclass(frozen=True)
class Rows:
    """How a plain parameter is gathered: its rows, in place in the group's shard buffer
    (``slot``: Note [row sharding] in engine/groups/layout.py; ``piece``: this rank's part
    of it). One of the two gather strategies of Note [one group type]."""

    slot: Slot
    piece: Piece


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
    # (None until then, and again after ``leave_full``).
    full: nn.Parameter
    # Its gather strategy: :class:`Rows`, or a tensor subclass's ``SubclassBytes``
    # (engine/groups/packed.py).
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
                                      shape=self.shape, stride=self.shard.stride())


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


class FlatGroup:
    """Parameters of one dtype and one ``requires_grad`` value, sharded by rows.

    ``local`` is this rank's shard buffer (the DTensor parameters' local tensors view
    it); ``full`` holds every full parameter, and its storage is empty while the group
    is sharded. A gather all-gathers the shards into a temporary rank-major buffer and
    copies it out into ``full``; a reduction copies the full gradients into a rank-major
    buffer and reduce-scatters it into this rank's gradient shard. In a world of one the
    shard is already the rank-major buffer, and the gradient buffer already the sum.
    """

    def __init__(self, members: list[Member], topology: Topology, layout: ShardLayout,
                 storage: ShardStorage, precision: Precision, secondary: SecondaryShard,
                 reduction: Callable[[Group], GradReduction]) -> None:
        """``storage``: where the shard lives (on the device, or offloaded: Note [two
        states, three tiers] in engine/groups/offload/__init__.py), made for ``layout``;
        ``precision``: the dtypes it gathers and reduces in; ``secondary``: Note
        [secondary shards] in comm/mesh.py; ``reduction``: the class of its gradient
        reduction (the reproducible mode's: Note [reproducible reduction]). Use
        :func:`flat_group` to make them from ``shard``'s arguments."""
        self.topology = topology
        self.comm = topology.shard
        # Hybrid sharding (Note [hybrid sharding] in comm/mesh.py): the ranks holding the same
        # rows, across which the reduced gradient shard is summed.
        self.replicate = topology.replicate
        self.storage = storage
        self.device = storage.device  # where gathers and reductions run; local may be elsewhere
        self.precision = precision
        self.secondary = secondary
        self.dtype = members[0].param.dtype
        # Reduced when any parameter is trainable (Note [freezing after shard]).
        self.requires_grad = any(m.param.requires_grad for m in members)
        self.trainable_at_build = all(m.param.requires_grad for m in members)
        self.layout = layout
        self.full = torch.empty(layout.full_numel, dtype=precision.compute, device=self.device)
        self.gaps = padding_gaps(layout)
        self.params: list[ShardedParam] = [self._make_param(i, m)
                                           for i, m in enumerate(members)]
        self.free()
        self._gathered: torch.Tensor | None = None  # all-gather output, until copied out
        self._gather_work: Any = None
        self._sending: torch.Tensor | None = None  # read by the all-gather until waited for
        self._gathered_version = -1
        self._full_version = -1  # ``full``'s version counter once filled (keep_edits)
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

    def like(self, members: list[Member]) -> FlatGroup:
        """A new group for ``members`` (a deep copy's), given the same kinds of objects."""
        return FlatGroup(members, self.topology, self.layout, self.storage.like(),
                         Precision(self.precision.compute, self.precision.reduce),
                         self.secondary.like(), type(self.reduction))

    def freezing_changes(self) -> tuple[list[tuple[ShardedParam, bool]], str]:
        """Note [freezing after shard]: the ``requires_grad`` changes made since the last
        root forward, as (parameter, new value), and why they cannot be followed ("" when
        they can: :meth:`follow_freezing`)."""
        changed = []
        for p in self.params:
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
        if changed and (self.reduction.has_accumulated()
                        or any(p.full.grad is not None for p in self.params)):
            index = {id(p): i for i, p in enumerate(self.params)}
            if any(not wanted and (self.reduction.used[index[id(p)]]
                                   or p.full.grad is not None) for p, wanted in changed):
                return changed, "no_sync"
        if changed:
            return changed, self.storage.freezing_refusal(len(changed), len(self.params),
                                                          self.trainable_at_build)
        return changed, ""

    def follow_freezing(self, changes: list[tuple[ShardedParam, bool]]) -> None:
        """Take up ``changes`` (from :meth:`freezing_changes`, which allowed them)."""
        for p, wanted in changes:
            p.requires_grad = wanted
            p.shard.requires_grad_(wanted)
            p.full.requires_grad_(wanted)
            if wanted:
                p.hook_end_of_backward()
        self.requires_grad = any(p.requires_grad for p in self.params)
        if not self.requires_grad:  # no gradient of it waits (freezing_changes): drop it
            self.reduction.clear(list(range(len(self.params))))

    def follow_tensor_hooks(self) -> None:
        """Give each full parameter whose shard has ``register_hook`` hooks the one hook
        that calls them (Note [tensor hooks on shards])."""
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
        slot = self.layout.slots[i]
        rows = slot.local_rows(self.comm.rank)
        local = self.local[slot.offset:slot.offset + rows * slot.row_numel].view(
            rows, *slot.shape[1:])
        with torch.no_grad():
            dt = DTensor.from_local(local, self.topology.mesh, self.topology.placements,
                                    run_check=False, shape=orig.shape,
                                    stride=contiguous_stride(orig.shape))
        shard = nn.Parameter(dt, requires_grad=orig.requires_grad)
        full = nn.Parameter(self.full[slot.full_offset:slot.full_offset + slot.numel]
                            .view(orig.shape), requires_grad=orig.requires_grad)
        # Keep user attributes set on the parameter (e.g. "no weight decay" flags).
        copy_user_attributes(orig, shard, full)
        return ShardedParam(m.fqns, m.slots, orig.shape, orig.dtype, orig.requires_grad,
                            local, shard, full,
                            Rows(slot, self.layout.piece(i, self.comm.rank)), group=self)

    def recast(self, dtype: torch.dtype) -> None:
        """Note [casting after shard]: hold the parameters in ``dtype`` from now on. The
        group must be at rest (sharded, nothing reducing, not offloaded): the caller,
        ``guards._apply``, checked."""
        old = self.dtype
        self.dtype = dtype
        if self.precision.compute == old:  # else mixed precision's param_dtype stays
            self.precision.compute = dtype
        if self.precision.reduce == old:
            self.precision.reduce = dtype
        self.storage.recast(dtype, self.compute_dtype)
        self.full = torch.empty(self.layout.full_numel, dtype=self.compute_dtype,
                                device=self.device)
        for i, p in enumerate(self.params):
            slot = self.layout.slots[i]
            rows = slot.local_rows(self.comm.rank)
            p.local = self.local[slot.offset:slot.offset + rows * slot.row_numel].view(
                rows, *slot.shape[1:])
            p.dtype = dtype
            # The shard keeps its identity (an optimizer built before holds it): its
            # contents are swapped for a DTensor over the new buffer, as torch's own
            # Module._apply swaps a DTensor parameter's, its attributes and our record
            # carried over. Its gradient is cast, as torch casts it.
            grad = p.shard.grad
            with torch.no_grad():
                dt = DTensor.from_local(p.local, self.topology.mesh, self.topology.placements,
                                        run_check=False, shape=p.shape,
                                        stride=contiguous_stride(p.shape))
            shard = nn.Parameter(dt, requires_grad=p.shard.requires_grad)
            copy_all_attributes(p.shard, shard)
            torch.utils.swap_tensors(p.shard, shard)
            if grad is not None:
                p.shard.grad = p.as_dtensor(cast(DTensor, grad).to_local().to(dtype))
            # A new full parameter over the new full buffer: nothing holds the old one
            # while the unit is sharded. Its end-of-backward trigger is registered again.
            old_full = p.full
            p.full = nn.Parameter(self.full[slot.full_offset:slot.full_offset + slot.numel]
                                  .view(p.shape), requires_grad=p.requires_grad)
            copy_all_attributes(old_full, p.full)
            p.hooked = False
            if p.requires_grad:
                p.hook_end_of_backward()
        self.free()

    # -- storage ---------------------------------------------------------------------
    def _alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def free(self, keep_grads: bool = False) -> None:
        """Free the full parameters (and, unless ``keep_grads``, their gradients)."""
        if not keep_grads:
            for p in self.params:
                p.full.grad = None
        storage = self.full.untyped_storage()
        nbytes = storage.size()
        storage.resize_(0)
        if nbytes:
            self.storage.full_freed(nbytes)

    def leave_full(self) -> list[nn.Parameter]:
        """Note [full parameters held after gathered()] in gather.py: leave the full
        buffer, values included, to whatever still references it (a full parameter, a
        view of one, an autograd graph) and take a new, empty one with new full
        parameter objects, registered where the old ones were. Returns the old objects.
        The group must be gathered; the caller reshards it next (which frees only the
        new, empty buffer)."""
        old = [p.full for p in self.params]
        nbytes = self.full.untyped_storage().size()
        self.full = torch.empty(self.layout.full_numel, dtype=self.compute_dtype,
                                device=self.device)
        for p, before in zip(self.params, old):
            slot = p.slot
            p.full = nn.Parameter(self.full[slot.full_offset:slot.full_offset + slot.numel]
                                  .view(p.shape), requires_grad=before.requires_grad)
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
        if not self.full_is_allocated():
            return False
        compute = self.compute_dtype
        with torch.no_grad():
            for p in self.params:
                rows = p.slot.local_rows(self.comm.rank) * p.slot.row_numel
                if not rows:
                    continue
                start = p.slot.full_offset + p.piece.param_offset
                mine = self.full[start:start + rows]
                local = p.local.view(-1)
                seen = local if local.dtype == compute else local.to(compute)
                if torch.equal(mine, seen):
                    continue
                changed = (mine != seen) & ~(mine.isnan() & seen.isnan())
                if bool(changed.any()):
                    local.copy_(torch.where(changed, mine.to(local.dtype), local))
        self.storage.release()
        return self.full._version != self._full_version

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

    def detached(self) -> list[str]:
        """Names of parameters whose shard no longer views ``local``.

        ``model.to(dtype)``, ``.half()``, ``.cuda()`` and ``p.data = ...`` replace a shard's
        storage: the optimizer would then update a tensor that is never gathered.
        """
        home = self.local.untyped_storage().data_ptr()
        out = []
        for p in self.params:
            mine = p.shard._local_tensor if isinstance(p.shard, DTensor) else p.shard
            if (p.shard.dtype != self.dtype or mine.device != self.local.device
                    or mine.untyped_storage().data_ptr() != home):
                out.append(p.fqns[0])
        return out

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
            chunks = None
            if self.comm.rank == shard_src:
                assert values is not None, "src_rank passes the values"
                buf = rank_major(self.layout, self.gaps, self.dtype, self.device)
                for slot, v in zip(self.layout.slots, values):
                    write_rank_major(buf, self.layout, slot, v.to(buf.device, self.dtype))
                chunks = list(buf.chunk(self.comm.world_size))
            with torch.no_grad():
                self.comm.scatter(into, chunks, shard_src)
        if self.replicate is not None:
            with torch.no_grad():
                self.replicate.broadcast(into, replica,
                                         what="the broadcast of initial shards to replicas")
        self.storage.received(into)

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

    def full_value(self, p: ShardedParam, full: torch.Tensor) -> torch.Tensor:
        """Parameter ``p``'s view of a full buffer such as ``gather_full()``'s."""
        return full[p.slot.full_offset:p.slot.full_offset + p.numel].view(p.shape)

    def local_from_full(self, full: torch.Tensor) -> None:
        """Take this rank's rows of every parameter from a full buffer (``full``'s
        layout), as when one rank's edits were broadcast."""
        with torch.no_grad():
            for p in self.params:
                rows = p.slot.local_rows(self.comm.rank) * p.slot.row_numel
                start = p.slot.full_offset + p.piece.param_offset
                p.local.view(-1).copy_(full[start:start + rows])
        self.storage.release()

    # -- gather ----------------------------------------------------------------------
    def shard_version(self) -> int:
        """Changes whenever this rank's shard is written.

        Optimizer steps write through the DTensor parameters, and DTensor's dispatch bumps
        the wrapper's version counter, not its local tensor's; the plain step (Note
        [plain step] in engine/entry_points/plain_step.py) writes through the wrappers' local
        tensors, which have counters of their own; shardwise writes through ``local``. All count.
        """
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
        if regathered is not None:
            self._gathered, self._gather_work = regathered
            return
        src = self.storage.gather_source(version)
        if self.comm.world_size == 1:
            # The rank-major buffer of a world of one is the shard itself: copied out as is.
            self._gathered = src
            return
        self._gathered = torch.empty(self.layout.gathered_numel, dtype=self.compute_dtype,
                                     device=self.device)
        self._sending = src
        self._gather_work = self.comm.all_gather(
            self._gathered, src, async_op=True, what=f"the all-gather of unit {self.unit_name!r}")

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
            self._gather_work.settle(use=fill)
            self._gather_work = None
        self.secondary.settled()
        self._sending = None
        if self._gathered is not None:
            if fill:
                # Note [freeing full parameters]: autograd may hold views of ``full``.
                version = self.full._version
                self._alloc_full()
                copy_out(self._gathered, self.layout, self.full)
                torch._C._autograd._unsafe_set_version_counter((self.full,), (version,))
                self._full_version = version
                if keep:
                    self.secondary.keep(self._gathered, self._gathered_version)
            self._gathered = None

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
        """Bytes of the full parameters while gathered."""
        return self.layout.full_numel * self.compute_dtype.itemsize

    @property
    def kept_bytes(self) -> int:
        """Bytes of the secondary shard held now (Note [secondary shards])."""
        return self.secondary.kept_bytes

    @property
    def moved_bytes(self) -> int:
        return self.storage.moved

    def bytes_by_tier(self) -> dict[str, int]:
        return self.storage.bytes_by_tier()

    def offload_description(self) -> str | None:
        return self.storage.describe()

    def describe(self) -> dict[str, Any]:
        """Plain values for ``sw.inspect``'s ``GroupView`` (its parameters are read
        there, one by one)."""
        params_tier, optimizer_tier = self.storage.tiers()
        return {"kind": "flat", "dtype": self.dtype, "compute_dtype": self.compute_dtype,
                "reduce_dtype": self.reduce_dtype, "requires_grad": self.requires_grad,
                "shard_numel": self.layout.shard_numel, "full_numel": self.layout.full_numel,
                "gathered_numel": self.layout.gathered_numel,
                "full_allocated": self.full_is_allocated(),
                "params_tier": params_tier, "optimizer_tier": optimizer_tier}


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
    [reproducible reduction]); ``placement``: the tiers of an offloaded model (Note [two
    states, three tiers] in engine/groups/offload/__init__.py), ``None`` for all on ``device``.
    """
    assert layout.world_size == topology.shard.world_size and \
        [s.shape for s in layout.slots] == [tuple(p.shape) for p in originals], \
        "the layout was planned for these parameters and this shard group"
    members = [Member(n, s, p) for n, s, p in zip(names, slots, originals)]
    dtype = originals[0].dtype
    storage: ShardStorage = (
        DeviceStorage(layout.shard_numel, dtype, compute_dtype, device) if placement is None
        else GroupStorage(placement, layout.shard_numel, dtype, compute_dtype))
    return FlatGroup(members, topology, layout, storage, Precision(compute_dtype, reduce_dtype),
                     SecondaryShard(regather), ExactReduction if exact else GradReduction)


def sharded_param(t: torch.Tensor) -> ShardedParam | None:
    """The sharded parameter behind a shard or full parameter, or ``None``."""
    return attached(t, PARAM)


def set_sharded_param(t: torch.Tensor, sp: ShardedParam) -> None:
    attach_to(t, PARAM, sp)
