"""The unit: parameters gathered and released together, and its state machine.

::

              start_gather               forward / backward compute
    SHARDED ──────────────► GATHERING ──► GATHERED ─────────────────► reshard() ─► SHARDED
       ▲                      (async)   finish_gather()                    │
       └───────── start_reduce(): reduce-scatter full grads into shard grads ◄──┘

Every transition is a method of :class:`Unit`; nothing else changes a unit's state.

A unit holds one :class:`FlatGroup` per (dtype, requires_grad) of its parameters, so a
frozen base weight next to a trainable adapter is never reduce-scattered, and parameters
of different dtypes never share a buffer.

Note [what the module sees]
While a unit is SHARDED or GATHERING, each of its parameters is registered on its
module(s) as the *shard*: an ``nn.Parameter`` holding a ``DTensor`` with the original
shape, placement ``Shard(0)`` over the unit's device mesh, whose local tensor is a view of
this rank's rows in the flat shard buffer (Note [row sharding] in engine/layout.py). Code that
reads ``p.shape``, ``p.dim()``, ``p.numel()``, builds parameter groups, clips gradients
with ``torch.nn.utils.clip_grad_norm_`` or calls ``state_dict()`` sees the parameter's
global meaning. ``finish_gather`` swaps in the *full* parameter, a plain leaf
``nn.Parameter`` viewing the full buffer with the original shape, because module code
computes with plain tensors; ``reshard`` swaps the shards back. The swap is a dict
assignment in ``module._parameters``, and which of the two a sharded model's module holds
is decided in ``_swap`` only. Five other places write ``module._parameters``, none of
them choosing between shard and full: ``FlatGroup.install``, and ``PackedGroup.install``
for tensor-subclass parameters (engine/packed.py), register the shards once, in place of
the originals (``shard``) or of the copied ones (a deep copy);
``sharded_init`` registers its stand-ins before there is a shard; a move or cast that
changes nothing (engine/guards.py) takes the shards out of torch's reach for the call and
puts the same objects back; and ``gathered()`` puts the full parameter back into a slot
that code inside the block replaced. Optimizers hold the shards, so they never see the
swap.

Note [freezing after shard]
A unit's parameters are grouped by ``requires_grad`` when ``shard`` runs, so that a frozen
base is never reduced. A change afterwards is taken up at the next root forward, per
parameter, as FSDP2 takes it: BitFit (only biases trainable), DPO's frozen reference copy
(``ref = copy.deepcopy(model); ref.requires_grad_(False)``) and trainable sets toggled
between iterations. A group's reduction already handles a parameter without a gradient
(one unused in this step, Note [collective order] in engine/state.py): it adds zeros for
it and hands it no gradient unless some rank computed one. So a group that holds frozen
and trainable parameters is reduced as a whole, zeros included (freezing after ``shard``
saves no communication; freezing before does), and a frozen one is not reduced at all.
A parameter unfrozen for the first time gets its full parameter's end-of-backward
trigger then (``ensure_backward_callback``). What is taken up is the shard's flag, or a
full parameter's where code changed that one while the unit was gathered. Not taken up:
a change while ``no_sync`` gradients wait in the group's reduction (they were summed for
the old set), and, for an offloaded group, anything but freezing and unfreezing all of
a group that was trainable at ``shard`` (its tiers were planned for that).

Note [DTensor parameters]
Why DTensor, and what it costs. PyTorch's own tools (``clip_grad_norm_``, the optimizers,
``torch.distributed.checkpoint``, accelerate, transformers) understand DTensor, so a
parameter keeps its meaning without any shardwise-specific code in the user's loop. The
cost: a parameter's rows are no longer a contiguous slice of the gathered buffer, so every
gather copies the gathered (rank-major) buffer out into the full (parameter-major) one,
one strided copy per parameter, and every reduction copies gradients in the other way
(which the flat layout paid already: gradients were copied into the reduction buffer
then too), and optimizer steps run through DTensor's dispatch. Losses stay bit-identical
to DDP's at 2 ranks; what the change cost per step is in benchmarks/HISTORY.md (the
layout's cost) and BENCHMARKS.md.

Note [freeing full parameters]
Autograd saves references to full parameters in forward. Freeing them after forward must
not invalidate those references, so the full buffer's *storage* is resized to zero and
later refilled in place by the next gather's copy-out: every view, including the saved
ones, sees the refilled values. The refill bumps the buffer's autograd version counter,
which would make autograd believe the saved tensors were modified in place; it writes
exactly the values autograd saved, so the counter is restored around it (``wait_gather``,
the only place that writes into ``full`` while autograd may hold it). The all-gather
itself writes into a temporary, never into ``full``: gloo bumps its output's counter on
a worker thread, at a moment nobody can wait for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, SupportsIndex, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._registry import (
    PARAM,
    UNIT,
    attach_to,
    attached,
    copy_all_attributes,
    copy_user_attributes,
)
from ..comm.collectives import Comm
from ..comm.mesh import Topology
from ..errors import ShardwiseError
from .alloc import freed
from .copies import copy_out, padding_gaps, rank_major, write_rank_major
from .exact_reduction import ExactReduction
from .layout import Piece, ShardLayout, Slot, build_layout, contiguous_stride
from .offload.placement import Placement
from .offload.storage import GroupStorage
from .packed import PackedGroup
from .reduce import GradReduction


class Model(Protocol):
    """What a unit's model is to whoever reaches it through the unit: the module hooks,
    the post-backward function, the order check, ``gathered()``.
    :class:`~shardwise.engine.state.ModelState` is the one implementation; naming it here would
    make this module and engine/state.py import each other."""

    comm: Comm
    topology: Topology
    units: list[Unit]
    number: int  # among the sharded models on its group (Note [checks ride the exchanges])

    @property
    def awaiting_backward(self) -> bool: ...

    def recover(self) -> None: ...

    def on_pre_forward(self, unit: Unit, args: tuple, kwargs: dict,
                       module: nn.Module | None = None) -> tuple | None: ...

    def on_post_forward(self, unit: Unit, output: Any,
                        module: nn.Module | None = None) -> Any: ...

    def on_forward_raised(self, module: nn.Module) -> None: ...

    def on_post_backward(self, unit: Unit) -> None: ...

    def ensure_backward_callback(self) -> None: ...


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass
class ShardedParam:
    """One original parameter: every place it is registered, its shard and its full form."""

    fqns: list[str]
    slots: list[tuple[nn.Module, str]]
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool
    slot: Slot
    piece: Piece
    local: torch.Tensor   # this rank's rows, a view of the group's shard buffer
    shard: nn.Parameter   # the DTensor parameter the module and the optimizer hold
    full: nn.Parameter
    unit: Unit | None = None
    group: FlatGroup | None = None
    hooked: bool = False  # ``full`` carries the end-of-backward trigger (engine/build.py)

    @property
    def numel(self) -> int:
        return self.slot.numel

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
        with torch.no_grad():
            dt = cast(DTensor, self.shard)
            return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False,
                                      shape=self.shape, stride=self.shard.stride())


class FlatGroup:
    """Parameters of one dtype and one ``requires_grad`` value, sharded by rows.

    ``local`` is this rank's shard buffer (the DTensor parameters' local tensors view
    it); ``full`` holds every full parameter, and its storage is empty while the group
    is sharded. A gather all-gathers the shards into a temporary rank-major buffer and
    copies it out into ``full``; a reduction copies the full gradients into a rank-major
    buffer and reduce-scatters it into this rank's gradient shard. In a world of one the
    shard is already the rank-major buffer, and the gradient buffer already the sum.
    """

    def __init__(self, names: list[list[str]], slots: list[list[tuple[nn.Module, str]]],
                 originals: list[nn.Parameter], topology: Topology,
                 device: torch.device, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, regather: Comm | None = None,
                 exact: bool = False, placement: Placement | None = None) -> None:
        """``regather``: the group of k ranks a non-root unit's backward gathers in under
        ``reshard_after_forward=k`` (Note [secondary shards] in comm/mesh.py); ``exact``:
        the reproducible mode's reduction (Note [reproducible reduction]); ``placement``:
        the tiers of an offloaded model (Note [two states, three tiers] in
        engine/offload/__init__.py), ``None`` for all on ``device``."""
        self.topology = topology
        self.device = device  # where gathers and reductions run; local may be elsewhere
        self.placement = placement
        self.comm = comm = topology.shard
        # Hybrid sharding (Note [hybrid sharding] in comm/mesh.py): the ranks holding the same
        # rows, across which the reduced gradient shard is summed.
        self.replicate = topology.replicate
        self.dtype = originals[0].dtype
        # Reduced when any parameter is trainable (Note [freezing after shard]).
        self.requires_grad = any(o.requires_grad for o in originals)
        self.trainable_at_build = all(o.requires_grad for o in originals)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.layout: ShardLayout = build_layout([tuple(p.shape) for p in originals],
                                                comm.world_size)
        self.store = (None if placement is None else
                      GroupStorage(placement, self.layout.shard_numel, self.dtype,
                                   compute_dtype))
        self.local = (self.store.master if self.store is not None else
                      torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device))
        self.full = torch.empty(self.layout.full_numel, dtype=compute_dtype, device=device)
        # Mixed precision gathers a low-precision copy of the shard (an offloaded group
        # stages one per gather: GroupStorage.gather_source).
        self._gather_in = (None if compute_dtype == self.dtype or self.store is not None else
                           torch.empty(self.layout.shard_numel, dtype=compute_dtype,
                                       device=device))
        self.gaps = padding_gaps(self.layout)
        self.params: list[ShardedParam] = []
        for i, orig in enumerate(originals):
            self.params.append(self._make_param(i, orig, names[i], slots[i]))
        self._free_full()
        self._gathered: torch.Tensor | None = None  # all-gather output, until copied out
        self._gather_work = None
        self._sending: torch.Tensor | None = None  # read by the all-gather until waited for
        self._gathered_version = -1
        # reshard_after_forward=k (Note [secondary shards]): the k ranks' group, this
        # rank's part of the gathered buffer kept from forward to backward, and its
        # version.
        self.regather = regather
        self.exact = exact  # Note [reproducible reduction] in exact/reduce.py
        self._kept: torch.Tensor | None = None
        self._kept_version = -1
        self._kept_sending: torch.Tensor | None = None
        # Used by trainable groups only. The reproducible mode's is its own class: the
        # default path (engine/reduce.py) reads without it.
        self.reduction: GradReduction = (ExactReduction if exact else GradReduction)(self)
        self.unit_name = "?"  # set by its Unit; names the group's collectives

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
        if changed and self.reduction.has_accumulated():
            return changed, "no_sync"
        if changed and self.store is not None and (len(changed) < len(self.params)
                                                   or not self.trainable_at_build):
            return changed, "offload"
        return changed, ""

    def follow_freezing(self, changes: list[tuple[ShardedParam, bool]]) -> None:
        """Take up ``changes`` (from :meth:`freezing_changes`, which allowed them)."""
        for p, wanted in changes:
            p.requires_grad = wanted
            p.shard.requires_grad_(wanted)
            p.full.requires_grad_(wanted)
            if wanted and not p.hooked:
                assert p.unit is not None
                model = p.unit.model
                p.full.register_post_accumulate_grad_hook(
                    lambda _p: model.ensure_backward_callback())
                p.hooked = True
        self.requires_grad = any(p.requires_grad for p in self.params)

    def _make_param(self, i: int, orig: nn.Parameter, names: list[str],
                    slots: list[tuple[nn.Module, str]]) -> ShardedParam:
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
        return ShardedParam(names, slots, orig.shape, orig.dtype, orig.requires_grad, slot,
                            self.layout.piece(i, self.comm.rank), local, shard, full,
                            group=self)

    def recast(self, dtype: torch.dtype) -> None:
        """Note [casting after shard]: hold the parameters in ``dtype`` from now on. The
        group must be at rest (sharded, nothing reducing, not offloaded): the caller,
        ``guards._apply``, checked."""
        old = self.dtype
        self.local = self.local.to(dtype)  # padding included: still zeros
        self.dtype = dtype
        if self.compute_dtype == old:  # else mixed precision's param_dtype stays
            self.compute_dtype = dtype
        if self.reduce_dtype == old:
            self.reduce_dtype = dtype
        self.full = torch.empty(self.layout.full_numel, dtype=self.compute_dtype,
                                device=self.device)
        self._gather_in = (None if self.compute_dtype == dtype else
                           torch.empty(self.layout.shard_numel, dtype=self.compute_dtype,
                                       device=self.device))
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
            shard.__dict__.update(p.shard.__dict__)
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
                assert p.unit is not None
                model = p.unit.model
                p.full.register_post_accumulate_grad_hook(
                    lambda _p: model.ensure_backward_callback())
                p.hooked = True
        self._free_full()

    # -- storage ---------------------------------------------------------------------
    def _alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = storage.size()
        storage.resize_(0)
        if nbytes and self.store is not None and self.store.on_disk:
            # Note [a fixed mmap threshold]: free chunks left in the heap from before the
            # threshold was fixed would keep what each unit frees.
            freed(nbytes)

    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

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
        # An offloaded shard is received on the device and then moved to its tier.
        into = self.local if self.store is None else torch.zeros_like(self.local,
                                                                      device=self.device)
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
        if self.store is not None:
            with torch.no_grad():
                self.local.copy_(into)
            self.store.release()

    @property
    def data_parallel_size(self) -> int:
        """How many ranks' gradients a reduction averages: the shard group's, times the
        replicas' under hybrid sharding."""
        return self.comm.world_size * self.topology.replicas

    def gather_full(self) -> torch.Tensor:
        """A fresh full buffer with every full parameter, in ``dtype`` (a collective)."""
        gathered = torch.empty(self.layout.gathered_numel, dtype=self.dtype,
                               device=self.device)
        src = self.local
        if self.store is not None:
            src = self.local.to(self.device, copy=True)
            self.store.release()
        self.comm.all_gather(gathered, src)
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
        if self.store is not None:
            self.store.release()

    # -- gather ----------------------------------------------------------------------
    def shard_version(self) -> int:
        """Changes whenever this rank's shard is written.

        Optimizer steps write through the DTensor parameters, and DTensor's dispatch bumps
        the wrapper's version counter, not its local tensor's; the plain step (Note
        [plain step] in engine/plain_step.py) writes through the wrappers' local tensors,
        which have counters of their own; shardwise writes through ``local``. All count.
        """
        return self.local._version + sum(
            p.shard._version + cast(DTensor, p.shard)._local_tensor._version
            for p in self.params)

    def start_gather(self) -> None:
        # The full buffer is allocated only at the copy-out: a prefetched unit holds the
        # all-gather output alone until it is needed.
        if self._kept is not None:
            kept, self._kept = self._kept, None
            if self.shard_version() == self._kept_version:  # else an optimizer step ran
                assert self.regather is not None
                self._gathered_version = self._kept_version
                self._gathered = torch.empty(self.layout.gathered_numel,
                                             dtype=self.compute_dtype, device=kept.device)
                self._kept_sending = kept  # read by the exchange until it is waited for
                self._gather_work = self.regather.all_gather(
                    self._gathered, kept, async_op=True,
                    what=f"the all-gather of unit {self.unit_name!r} within its group of "
                         f"{self.regather.world_size} ranks (reshard_after_forward)")
                return
        self._gathered_version = self.shard_version()
        src = self._gather_source()
        if self.comm.world_size == 1:
            # The rank-major buffer of a world of one is the shard itself: copied out as is.
            self._gathered = src
            return
        self._gathered = torch.empty(self.layout.gathered_numel, dtype=self.compute_dtype,
                                     device=self.device)
        self._sending = src
        self._gather_work = self.comm.all_gather(
            self._gathered, src, async_op=True, what=f"the all-gather of unit {self.unit_name!r}")

    def _gather_source(self) -> torch.Tensor:
        """This rank's shard on the device, in the compute dtype, for an all-gather."""
        if self.store is not None:
            return self.store.gather_source(self._gathered_version)
        if self._gather_in is None:
            return self.local
        with torch.no_grad():
            self._gather_in.copy_(self.local)
        return self._gather_in

    def publish_grad(self, p: ShardedParam, rows: torch.Tensor) -> None:
        """Hand ``p`` its reduced rows as its shard's ``.grad``, or add them to it; an
        offloaded group's gradients live on the optimizer's tier."""
        if self.store is not None:
            self.store.publish(p, rows)
        elif p.shard.grad is None:
            p.shard.grad = p.as_dtensor(rows)
        else:
            with torch.no_grad():
                cast(DTensor, p.shard.grad).to_local().add_(rows)

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
        self._kept_sending = self._sending = None
        if self._gathered is not None:
            if fill:
                # Note [freeing full parameters]: autograd may hold views of ``full``.
                version = self.full._version
                self._alloc_full()
                copy_out(self._gathered, self.layout, self.full)
                torch._C._autograd._unsafe_set_version_counter((self.full,), (version,))
                if keep and self.regather is not None:
                    parts = self._gathered.chunk(self.regather.world_size)
                    self._kept = parts[self.regather.rank].clone()
                    self._kept_version = self._gathered_version
            self._gathered = None

    def drop_kept(self) -> None:
        """Forget the secondary shard (its backward ran, or never will)."""
        self._kept = None

    @property
    def kept_bytes(self) -> int:
        """Bytes of the secondary shard held now (Note [secondary shards])."""
        return 0 if self._kept is None else self._kept.numel() * self._kept.element_size()


class Unit:
    """A module whose parameters are gathered and released together.

    ``groups`` may be empty (a module with no parameters of its own); its hooks still
    run so that the order of units is known.
    """

    def __init__(self, module: nn.Module, name: str, groups: list[FlatGroup],
                 reshard_after_forward: bool | int, is_root: bool,
                 cast_inputs: torch.dtype | None = None,
                 packed: list[PackedGroup] | None = None) -> None:
        self.module = module
        self.name = name or "<root>"
        self.groups = groups
        # Frozen tensor subclasses (Note [packed parameters] in engine/packed.py): gathered
        # and released with the groups, but not in ``groups`` or ``params``, which the
        # reduction, checkpoints and ``gathered()`` read; those refuse them by name.
        self.packed = packed or []
        for g in groups:
            g.unit_name = self.name
            for p in g.params:
                p.unit = self
        for pg in self.packed:
            pg.unit_name = self.name
        self.reshard_after_forward = reshard_after_forward
        self.is_root = is_root
        self.model: Model = None  # type: ignore[assignment]  # set by ModelState
        self.index = 0     # position in the model's units
        self.pins = 0      # open gathered() blocks holding this unit gathered
        self.cast_inputs = cast_inputs  # MixedPrecision.param_dtype
        self.state = UnitState.SHARDED
        self.reset_iteration()

    def reset_iteration(self) -> None:
        """Forget the bookkeeping of one forward/backward."""
        self.drop_kept()
        self.forward_calls = 0      # grad-enabled forwards since the last backward ended
        self.backward_calls = 0     # of those, how many have finished their backward
        self.reduced = False        # gradients handed to the reduction this backward
        self.call_index = -1

    # -- bookkeeping: only these methods change it (see the module docstring) -------
    def record_call(self, index: int) -> None:
        """This forward called the unit as the ``index``-th unit call."""
        self.call_index = index

    def record_forward(self) -> None:
        """A grad-enabled forward of the unit ran: one more backward is owed."""
        self.forward_calls += 1

    def record_backward(self) -> bool:
        """One of its forwards' backward finished; whether its gradients are now
        complete (every forward's backward ran) and not yet handed to the reduction."""
        self.backward_calls += 1
        return self.backward_calls >= self.forward_calls and not self.reduced

    def owes_backward(self) -> bool:
        """Whether a forward's backward has not reached this unit yet."""
        return self.forward_calls > self.backward_calls and not self.reduced

    def pin(self) -> None:
        """A ``gathered()`` block holds the unit gathered until :meth:`unpin`."""
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1

    @property
    def params(self) -> list[ShardedParam]:
        return [p for g in self.groups for p in g.params]

    @property
    def holds_params(self) -> bool:
        """Whether the unit gathers anything (plain or packed parameters)."""
        return bool(self.groups or self.packed)

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [g for g in self.groups if g.requires_grad]

    # -- transitions -----------------------------------------------------------------
    def start_gather(self) -> None:
        """SHARDED -> GATHERING: issue the all-gathers without waiting (prefetch)."""
        if self.state is not UnitState.SHARDED:
            return
        for g in self.groups:
            g.start_gather()
        for pg in self.packed:
            pg.start_gather()
        self.state = UnitState.GATHERING

    def finish_gather(self, keep: bool = False) -> None:
        """-> GATHERED: wait for the all-gathers and expose full parameters. ``keep``: a
        forward's gather, for which a unit resharded to groups of k ranks keeps its
        part (Note [secondary shards])."""
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        for g in self.groups:
            g.wait_gather(keep=keep)
        for pg in self.packed:
            pg.wait_gather()
        self._swap(full=True)
        self.state = UnitState.GATHERED

    def drop_kept(self) -> None:
        """Forget the parts kept for a backward gather (Note [secondary shards])."""
        for g in self.groups:
            g.drop_kept()

    def read_ahead(self) -> None:
        """Start reading offloaded shards from disk, without waiting, for a gather soon
        (Note [the disk tier]); nothing for shards in memory."""
        for g in self.groups:
            if g.store is not None:
                g.store.prefetch(gather=True)

    def reshard(self, keep_grads: bool = False) -> None:
        """-> SHARDED: expose shards again and free the full parameters (and, unless
        ``keep_grads``, their gradients).

        A unit pinned by an open ``gathered()`` block stays gathered.
        """
        if self.state is UnitState.SHARDED or self.pins:
            return
        for g in self.groups:
            g.wait_gather(fill=False)  # never free memory a collective still writes
        for pg in self.packed:
            pg.wait_gather(fill=False)
        self._swap(full=False)
        for g in self.groups:
            if not keep_grads:
                for p in g.params:
                    p.full.grad = None
            g._free_full()
        for pg in self.packed:
            pg._free_full()
        self.state = UnitState.SHARDED

    def start_reduce(self, sync: bool) -> None:
        """Hand this backward's full gradients to the reduction; see GradReduction.start."""
        for g in self.trainable_groups:
            g.reduction.start(sync)
        self.reduced = True

    def _swap(self, full: bool) -> None:
        # Note [what the module sees]
        for g in self.groups:
            for p in g.params:
                tensor = p.full if full else p.shard
                for module, attr in p.slots:
                    module._parameters[attr] = tensor
        for pg in self.packed:
            for pp in pg.params:
                packed = pp.full if full else pp.shard
                assert packed is not None, "a packed group's full tensors exist once gathered"
                for module, attr in pp.slots:
                    module._parameters[attr] = packed

    def __repr__(self) -> str:
        n = sum(p.numel for p in self.params)
        return f"Unit({self.name!r}, params={n}, state={self.state.value})"


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` is the root of, or ``None``."""
    return attached(module, UNIT)


def set_unit(module: nn.Module, unit: Unit) -> None:
    attach_to(module, UNIT, unit)


def sharded_param(t: torch.Tensor) -> ShardedParam | None:
    """The sharded parameter behind a shard or full parameter, or ``None``."""
    return attached(t, PARAM)


def set_sharded_param(t: torch.Tensor, sp: ShardedParam) -> None:
    attach_to(t, PARAM, sp)
