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
module(s) as the *shard*: a 1-D ``nn.Parameter`` view of this rank's piece of the flat
buffer, under the original name. ``finish_gather`` swaps in the *full* parameter, a leaf
``nn.Parameter`` viewing the all-gather output with the original shape; ``reshard`` swaps
the shards back. The swap is a dict assignment in ``module._parameters`` and happens in
``_swap`` only. Optimizers hold the shards, so they never see the swap.

Note [freeing full parameters]
Autograd saves references to full parameters in forward. Freeing them after forward must
not invalidate those references, so the full buffer's *storage* is resized to zero and
later refilled in place by the next all-gather: every view, including the saved ones,
sees the refilled values (see Note [version counters] in _comm.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn as nn

from ._comm import Comm
from ._layout import FlatLayout, Piece, Span, build_layout


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
    span: Span
    piece: Piece
    shard: nn.Parameter
    full: nn.Parameter
    unit: "Unit | None" = None

    @property
    def numel(self) -> int:
        return self.span.numel


class FlatGroup:
    """Parameters of one dtype and one ``requires_grad`` value, in one padded flat buffer.

    ``local`` holds this rank's shard (the optimizer's parameters view it); ``full`` is the
    all-gathered buffer, whose storage is empty while the group is sharded.
    """

    def __init__(self, names: list[list[str]], slots: list[list[tuple[nn.Module, str]]],
                 originals: list[nn.Parameter], comm: Comm, device: torch.device,
                 compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        self.comm = comm
        self.dtype = originals[0].dtype
        self.requires_grad = originals[0].requires_grad
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.layout: FlatLayout = build_layout([p.numel() for p in originals], comm.world_size)
        self.local = torch.zeros(self.layout.shard_numel, dtype=self.dtype, device=device)
        self.full = torch.empty(self.layout.total_numel, dtype=compute_dtype, device=device)
        # Mixed precision gathers a low-precision copy of the shard.
        self._gather_in = (None if compute_dtype == self.dtype else
                           torch.empty(self.layout.shard_numel, dtype=compute_dtype, device=device))
        self._gaps = _gaps(self.layout)
        self.params: list[ShardedParam] = []
        for i, orig in enumerate(originals):
            span, piece = self.layout.spans[i], self.layout.piece(i, comm.rank)
            shard = nn.Parameter(self.local[piece.shard_offset:piece.shard_offset + piece.numel],
                                 requires_grad=orig.requires_grad)
            full = nn.Parameter(self.full[span.offset:span.offset + span.numel].view(orig.shape),
                                requires_grad=orig.requires_grad)
            # Keep user attributes set on the parameter (e.g. "no weight decay" flags).
            user = {k: v for k, v in orig.__dict__.items() if not k.startswith("_shardwise")}
            shard.__dict__.update(user)
            full.__dict__.update(user)
            self.params.append(ShardedParam(names[i], slots[i], orig.shape, orig.dtype,
                                            orig.requires_grad, span, piece, shard, full))
        self._free_full()
        self._gather_work = None
        self._gathered_version = -1
        # Gradient reduction state (trainable groups only).
        self.used = [False] * len(self.params)  # had a local gradient since the last sync
        self._accum: torch.Tensor | None = None
        self._reduce_in: torch.Tensor | None = None
        self._reduce_out: torch.Tensor | None = None
        self._reduce_work = None

    # -- storage ---------------------------------------------------------------------
    def _alloc_full(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.full.numel() * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_full(self) -> None:
        self.full.untyped_storage().resize_(0)

    def full_is_allocated(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def detached(self) -> list[str]:
        """Names of parameters whose shard no longer views ``local``.

        ``model.to(dtype)``, ``.half()``, ``.cuda()`` and ``p.data = ...`` replace a shard's
        storage: the optimizer would then update a tensor that is never gathered.
        """
        home = self.local.untyped_storage().data_ptr()
        return [p.fqns[0] for p in self.params
                if p.shard.dtype != self.dtype or p.shard.device != self.local.device
                or p.shard.untyped_storage().data_ptr() != home]

    def fill_local(self, flat_full: torch.Tensor | None, src: int) -> None:
        """Set every rank's shard from rank ``src``'s padded flat buffer (a scatter)."""
        chunks = None
        if self.comm.rank == src:
            chunks = list(flat_full.to(self.dtype).chunk(self.comm.world_size))
        with torch.no_grad():
            self.comm.scatter(self.local, chunks, src)

    def flat_from(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """A padded flat buffer holding ``tensors`` (one per parameter) at their offsets."""
        flat = torch.zeros(self.layout.total_numel, dtype=self.dtype, device=self.local.device)
        for p, t in zip(self.params, tensors):
            flat[p.span.offset:p.span.offset + p.numel].copy_(t.detach().reshape(-1))
        return flat

    # -- gather ----------------------------------------------------------------------
    def start_gather(self) -> None:
        self._gathered_version = self.local._version  # optimizer steps bump it
        self._alloc_full()
        src = self.local
        if self._gather_in is not None:
            src = self._gather_in
            with torch.no_grad():
                src.copy_(self.local)
        self._gather_work = self.comm.all_gather(self.full, src, async_op=True)

    def is_stale(self) -> bool:
        """Whether the shard changed since the full parameters were gathered."""
        return self.full_is_allocated() and self.local._version != self._gathered_version

    def drop_reduction(self) -> None:
        """Forget an unfinished reduction (its backward was aborted)."""
        self.wait_reduce()
        self._reduce_out = None

    def wait_gather(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None

    # -- reduce ----------------------------------------------------------------------
    def start_reduce(self, sync: bool) -> None:
        """Move the full gradients into the reduction buffer; reduce-scatter if ``sync``.

        Outside ``no_sync`` the gradients are scaled by 1/N while copied, then summed, as
        DistributedDataParallel does, so results match it bit for bit at N=2.
        """
        inv_n = 1.0 / self.comm.world_size
        buf = self._accum
        if buf is None:
            buf = torch.empty(self.layout.total_numel, dtype=self.reduce_dtype,
                              device=self.local.device)
            for start, end in self._gaps:
                buf[start:end].zero_()
        with torch.no_grad():
            for i, p in enumerate(self.params):
                region = buf[p.span.offset:p.span.offset + p.numel].view(p.shape)
                grad = p.full.grad
                p.full.grad = None
                seen = self.used[i] and self._accum is not None
                if grad is None:
                    if not seen:
                        region.zero_()
                    if sync and seen:
                        region.mul_(inv_n)
                    continue
                self.used[i] = True
                if seen:
                    region.add_(grad)
                    if sync:
                        region.mul_(inv_n)
                elif sync:
                    torch.mul(grad, inv_n, out=region)
                else:
                    region.copy_(grad)
        if not sync:
            self._accum = buf
            return
        self._accum = None
        self._reduce_in = buf
        self._reduce_out = torch.empty(self.layout.shard_numel, dtype=self.reduce_dtype,
                                       device=self.local.device)
        self._reduce_work = self.comm.reduce_scatter(self._reduce_out, buf, async_op=True)

    def has_accumulated(self) -> bool:
        """Whether gradients accumulated under ``no_sync`` await their reduction."""
        return self._accum is not None

    def wait_reduce(self) -> None:
        if self._reduce_work is not None:
            self._reduce_work.wait()
            self._reduce_work = None
            self._reduce_in = None

    def finish_reduce(self, used_anywhere: list[bool]) -> None:
        """Accumulate the reduced shard into each shard parameter's ``.grad``.

        A parameter no rank computed a gradient for keeps its ``.grad`` untouched, as under
        DistributedDataParallel with ``find_unused_parameters=True``.
        """
        self.wait_reduce()
        out = self._reduce_out
        self._reduce_out = None
        if out is None:
            return
        if out.dtype != self.dtype:
            out = out.to(self.dtype)
        for i, p in enumerate(self.params):
            if not used_anywhere[i]:
                continue
            g = out[p.piece.shard_offset:p.piece.shard_offset + p.piece.numel]
            if p.shard.grad is None:
                p.shard.grad = g
            else:
                p.shard.grad.add_(g)
        self.used = [False] * len(self.params)


def _gaps(layout: FlatLayout) -> list[tuple[int, int]]:
    """Ranges of the padded flat buffer that belong to no parameter."""
    gaps, cursor = [], 0
    for span in layout.spans:
        if span.offset > cursor:
            gaps.append((cursor, span.offset))
        cursor = max(cursor, span.offset + span.numel)
    if cursor < layout.total_numel:
        gaps.append((cursor, layout.total_numel))
    return gaps


class Unit:
    """A module whose parameters are gathered and released together.

    ``groups`` may be empty (a module with no parameters of its own); its hooks still
    run so that the order of units is known.
    """

    def __init__(self, module: nn.Module, name: str, groups: list[FlatGroup],
                 reshard_after_forward: bool, is_root: bool) -> None:
        self.module = module
        self.name = name or "<root>"
        self.groups = groups
        for g in groups:
            for p in g.params:
                p.unit = self
        self.reshard_after_forward = reshard_after_forward
        self.is_root = is_root
        self.model = None  # the ModelState that owns this unit, set by it
        self.index = 0     # position in the model's units
        self.pins = 0      # open gathered() blocks holding this unit gathered
        self.cast_inputs: torch.dtype | None = None  # MixedPrecision.param_dtype
        self.state = UnitState.SHARDED
        self.reset_iteration()

    def reset_iteration(self) -> None:
        """Forget the bookkeeping of one forward/backward."""
        self.forward_calls = 0      # grad-enabled forwards since the last backward ended
        self.backward_calls = 0     # of those, how many have finished their backward
        self.reduced = False        # gradients handed to the reduction this backward
        self.call_index = -1

    @property
    def params(self) -> list[ShardedParam]:
        return [p for g in self.groups for p in g.params]

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
        self.state = UnitState.GATHERING

    def finish_gather(self) -> None:
        """-> GATHERED: wait for the all-gathers and expose full parameters."""
        if self.state is UnitState.GATHERED:
            return
        self.start_gather()
        for g in self.groups:
            g.wait_gather()
        self._swap(full=True)
        self.state = UnitState.GATHERED

    def reshard(self) -> None:
        """-> SHARDED: expose shards again and free the full parameters.

        A unit pinned by an open ``gathered()`` block stays gathered.
        """
        if self.state is UnitState.SHARDED or self.pins:
            return
        for g in self.groups:
            g.wait_gather()  # never free memory a collective is still writing
        self._swap(full=False)
        for g in self.groups:
            for p in g.params:
                p.full.grad = None
            g._free_full()
        self.state = UnitState.SHARDED

    def start_reduce(self, sync: bool) -> None:
        """Hand this backward's full gradients to the reduction; see FlatGroup.start_reduce."""
        for g in self.trainable_groups:
            g.start_reduce(sync)
        self.reduced = True

    def _swap(self, full: bool) -> None:
        # Note [what the module sees]
        for g in self.groups:
            for p in g.params:
                tensor = p.full if full else p.shard
                for module, attr in p.slots:
                    module._parameters[attr] = tensor

    def __repr__(self) -> str:
        n = sum(p.numel for p in self.params)
        return f"Unit({self.name!r}, params={n}, state={self.state.value})"
