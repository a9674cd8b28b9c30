"""Per-model runtime state: the units, their order, and one iteration's bookkeeping.

Lives on the root module (``module._shardwise``); nothing here is global, so any number of
sharded models, on any groups, can live in one process.

Note [collective order]
Every rank must issue the same collectives in the same order. Gathers happen in the
order units run (forward, then backward, which autograd executes deterministically), and
prefetches follow the order recorded in the previous iteration, which is identical on
every rank when every rank runs the same code (SPMD). Reductions left for the end of
backward run in the fixed order of ``units``. With ``SHARDWISE_CHECK=1`` every unit's
forward first checks, with one tiny all-reduce, that all ranks are about to run the same
unit, and the root's forward ends with one more, so a divergence (a rank skipping the
first, a middle or the last unit, or running one twice) raises a clear error on every
rank instead of hanging or mixing up shards. Units pinned by ``gathered()`` compute
without communicating and are not checked: ranks may run them different numbers of times.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._comm import Comm
from ._unit import Unit
from ._env import checks_enabled
from .errors import ShardwiseError


class ModelState:
    """Everything shardwise knows about one sharded model."""

    def __init__(self, root: nn.Module, comm: Comm, units: list[Unit], buffer_sync,
                 src_rank: int) -> None:
        self.root = root
        self.comm = comm
        self.units = units  # root first, then in module order
        self.buffers = buffer_sync
        self.src_rank = src_rank
        self.requires_grad_sync = True
        self._prev_order: list[Unit] = []
        self._order: list[Unit] = []
        self._backward_pending = False  # a grad-requiring forward awaits its backward
        self._pending_at_root_start = False
        self._callback_queued = False
        self._buffers_due = False  # a training forward's buffer sync waits for its backward
        self._reducing: Unit | None = None  # the latest unit whose reduction is in flight
        self.checking = False  # SHARDWISE_CHECK, read once per iteration
        self._checked_in_forward = 0  # unit checks in the current root forward
        for i, u in enumerate(units):
            u.model = self
            u.index = i

    # -- forward ---------------------------------------------------------------------
    def recover(self) -> None:
        """Start clean if the last iteration cannot complete.

        Autograd drops the end-of-backward callback when backward raises (an OOM skipped
        by the user, an interrupt), and a forward with gradients whose backward never came
        leaves units gathered with values an optimizer step has since changed. Either way
        the unfinished iteration is abandoned: no gradient of it reaches the shards.
        """
        aborted = self._callback_queued
        stale = self._backward_pending and any(g.is_stale() for u in self.units
                                               for g in u.groups)
        if not (aborted or stale):
            return
        self._callback_queued = False
        self._backward_pending = False
        self._reducing = None
        for u in self.units:
            for g in u.trainable_groups:
                g.drop_reduction()
            u.reshard()
            u.reset_iteration()

    def check_storage(self) -> None:
        """Raise if a parameter was cast or moved after ``shard`` (see FlatGroup.detached)."""
        moved = [name for u in self.units for g in u.groups for name in g.detached()]
        if moved:
            raise ShardwiseError(
                f"{len(moved)} parameter(s) ({', '.join(moved[:3])}"
                f"{', ...' if len(moved) > 3 else ''}) were cast or moved after sw.shard "
                f"(model.to(...), .half(), .bfloat16(), .cuda(), or p.data = ...), so their "
                f"shards left shardwise's storage and training would silently use the old "
                f"values. Cast or move the model before sw.shard, or keep fp32 master weights "
                f"and compute in low precision with sw.shard(model, mixed_precision="
                f"sw.MixedPrecision(param_dtype=torch.bfloat16))")

    def on_root_pre_forward(self) -> None:
        self.check_storage()
        self.checking = checks_enabled()
        self._checked_in_forward = 0
        self.recover()
        self._pending_at_root_start = self._backward_pending
        if not self._backward_pending:
            # A new iteration. Units left gathered by an exception are released first.
            if self._order:
                self._prev_order = self._order
            self._order = []
            for u in self.units:
                u.reshard()
                u.reset_iteration()

    def check_unit(self, unit: Unit) -> None:
        """With ``SHARDWISE_CHECK=1``: raise on every rank unless all ranks are about to
        run ``unit`` (Note [collective order]).

        A unit pinned by ``gathered()`` (or holding no parameters) runs without
        communicating, so ranks may run it a different number of times (``generate``
        stopping at different lengths): it is not checked.
        """
        if unit.pins or not unit.groups:
            return
        self._checked_in_forward += 1
        self._agree_on_step(1, unit.index, f"unit {unit.name}")

    def check_forward_end(self) -> None:
        """With ``SHARDWISE_CHECK=1``: raise on every rank unless all ranks end the
        forward here. Catches a rank that skips the *last* unit, whose peers would
        otherwise wait in that unit's check until the timeout."""
        if self._checked_in_forward:
            self._checked_in_forward = 0
            self._agree_on_step(2, len(self._order),
                                f"the end of the forward after {len(self._order)} unit calls")

    def _agree_on_step(self, kind: int, index: int, what: str) -> None:
        # Every check is the same 4-integer all-reduce, so mismatched checks still pair
        # up across ranks, and any difference shows in the maximum.
        mine = [kind, index, -kind, -index]
        seen = torch.tensor(mine, dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
        if seen.tolist() != mine:
            names = self.comm.all_gather_object(what)
            which = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            raise ShardwiseError(f"ranks diverged in the forward ({which}). Every rank must "
                                 f"run the same units in the same order")

    def record_call(self, unit: Unit) -> None:
        """Note the call and prefetch the unit that ran next last time."""
        pos = len(self._order)
        unit.call_index = pos
        self._order.append(unit)
        prev = self._prev_order
        if pos + 1 < len(prev) and prev[pos] is unit:
            prev[pos + 1].start_gather()

    def on_root_post_forward(self, hooked: bool, opaque: bool = False) -> None:
        if self.checking:
            self.check_forward_end()
        # Note [buffer sync point]
        # BatchNorm saves its running statistics for backward, so overwriting buffers
        # between a forward and its backward would break autograd's version check (and
        # would change what backward reads). Buffers are synchronised when the backward
        # finishes, or right away when no backward will come.
        self._buffers_due |= self.root.training
        if hooked or opaque:
            # An output we cannot search may still lead to a backward: keep what it may
            # need gathered rather than free parameters autograd saved.
            self._backward_pending = True
        elif not self._pending_at_root_start:
            # No backward will come: release everything now.
            self._backward_pending = False
            for u in self.units:
                u.reshard()
                u.reset_iteration()
            self._sync_buffers_if_due()

    def _sync_buffers_if_due(self) -> None:
        if self._buffers_due:
            self._buffers_due = False
            self.buffers.after_training_forward()

    # -- backward --------------------------------------------------------------------
    def ensure_backward_callback(self) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._callback_queued = True

    def on_pre_backward(self, unit: Unit, call_index: int) -> None:
        self.ensure_backward_callback()
        unit.finish_gather()
        if call_index > 0:
            prev = self._order[call_index - 1]
            if prev.forward_calls > prev.backward_calls and not prev.reduced:
                prev.start_gather()

    def on_post_backward(self, unit: Unit) -> None:
        unit.backward_calls += 1
        if unit.backward_calls >= unit.forward_calls and not unit.reduced:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        unit.start_reduce(self.requires_grad_sync)
        unit.reshard()
        # At most two reductions in flight: each holds a unit-sized gradient buffer, and
        # letting them pile up until the end of backward would hold a whole model's.
        if self._reducing is not None:
            for g in self._reducing.trainable_groups:
                g.wait_reduce()
        self._reducing = unit

    def finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, then publish shard gradients."""
        self._callback_queued = False
        for u in reversed(self.units):
            # A unit whose backward never ran here may have run on another rank, so it
            # joins the reduction with zero gradients (see Note [collective order]). So do
            # units whose gradients came without a counted forward (reentrant checkpointing
            # recomputes in backward; a second backward through a retained graph), and
            # units holding gradients accumulated under no_sync.
            if not u.reduced and (u.forward_calls > 0
                                  or any(p.full.grad is not None for p in u.params)
                                  or (self.requires_grad_sync and any(
                                      g.has_accumulated() for g in u.trainable_groups))):
                self._reduce(u)
        self._reducing = None
        reduced = [u for u in self.units if u.reduced]
        if self.requires_grad_sync:
            groups = [g for u in reduced for g in u.trainable_groups]
            if groups:
                # One small all-reduce says which parameters got a gradient anywhere.
                used = torch.tensor([x for g in groups for x in g.used], dtype=torch.int32,
                                    device=groups[0].local.device)
                self.comm.all_reduce(used, op=torch.distributed.ReduceOp.MAX)
                used_list = used.bool().tolist()
                offset = 0
                for g in groups:
                    g.finish_reduce(used_list[offset:offset + len(g.params)])
                    offset += len(g.params)
        for u in self.units:
            for p in u.params:
                if p.full.grad is not None and u.reduced:
                    raise ShardwiseError(
                        f"internal: a gradient for {p.fqns[0]} arrived after its unit "
                        f"{u.name} was reduced; please report this with your model")
            u.reshard()
            u.reset_iteration()
        self._backward_pending = False
        self._sync_buffers_if_due()  # Note [buffer sync point]
