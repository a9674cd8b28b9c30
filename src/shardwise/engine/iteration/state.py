"""Per-model runtime state: one iteration's phase and events, and the model's
communication: the order its units ran in and the gathers and reductions in flight.

Lives on the root module (``_registry.model_state``); nothing here is global, so any
number of sharded models, on any groups, can live in one process. Every hook event is one
``on_*`` method of :class:`ModelState`; ``engine/iteration/hooks.py`` only forwards to them.
When the model's units gather and reduce is decided by its :class:`CommSchedule` (Note
[communication owner]).

::

    IDLE ──root forward──► FORWARD ──output needs grad──► AWAITING_BACKWARD
      ▲                       │ (no grad: release all)         │ first gradient
      └───────────────────────┴──◄── finish_backward ◄── BACKWARD ◄┘

Note [collective order]
Every rank must issue the same collectives in the same order. Gathers happen in the
order units run (forward, then backward, which autograd executes deterministically), and
prefetches follow the order recorded in the previous iteration, which is identical on
every rank when every rank runs the same code (SPMD). Reductions left for the end of
backward run in the fixed order of ``units``. Under gloo (or with ``SHARDWISE_CHECK=1``)
ranks check that they run the same units, end the forward and start a backward together
(``comm/order_check.py``; under gloo without a round trip, Note [checks ride the exchanges]),
so a divergence (a rank skipping the first, a middle or the last unit, or running one
twice) raises a clear error on every rank instead of hanging, aborting or mixing up
shards. Units pinned by ``gathered()`` compute without communicating and are not
checked: ranks may run them different numbers of times (``comm/order_check.py``).

Note [communication owner]
The all-gathers and reduce-scatters of one sharded model, and the waits for them, are
scheduled by one object, the model's :class:`CommSchedule` (``ModelState.schedule``), as
FSDP2's ``FSDPCommContext`` is shared by the states of one root. Its groups say *how* a
unit's bytes move: ``FlatGroup.start_gather`` issues an all-gather and
``FlatGroup.wait_gather`` waits for it and copies it out (engine/groups/flat.py);
``GradReduction.start`` issues a reduce-scatter, ``advance`` and ``wait`` wait for it
(engine/groups/reduce.py); each keeps its buffers and the collective's handle. The
schedule says *when*, and waits:

- the order: the units this forward called and those the previous one did, which
  prefetches follow (Note [collective order]);
- the gathers: a unit's gather is waited for where the unit computes, in its forward
  or its backward, or issued and waited for then if no prefetch issued it (``gather``);
  after it, the ``prefetch`` units that ran next in the previous forward (in forward)
  or before it in this one (in backward) are issued without waiting (``called``,
  ``prefetch_backward``), and the schedule knows which of those are still in flight
  (``in_flight``);
- the reductions: a unit's is started once its gradients are complete (``reduce``),
  the previous unit's waited for then, so that at most two reductions hold a
  unit-sized buffer at once; at the end of backward every one is waited for before its
  rows are handed to the parameters (``publish``), so the optimizer step never meets a
  reduction in flight and waits for none. ``GradReduction.finish`` refuses to publish a
  reduction nobody waited for. An abandoned iteration's are dropped (``abandon``).

It does not own which units stay gathered (Note [residency] in
engine/iteration/residency.py), nor the collectives that are waited for where they are
issued: the order check's and the buffers' exchanges, the used-parameter flags that end
a backward, ``clip_grad_norm_``'s all-reduce. Nor two waits outside an iteration's
schedule: ``gathered()`` gathers its units at once (gather.py), and a unit resharded
while its prefetch is in flight (a forward abandoned) waits for it in ``Unit.reshard``,
so that no collective writes into freed memory; the schedule then forgets it. A
``no_sync`` backward's ``start`` only adds into the accumulator and sends nothing.

Where CUDA streams and events would live: here. On a GPU the schedule would hold an
all-gather stream, so that the next unit's gather and copy-in overlap this unit's
computation, a reduce-scatter stream (and one for the sum across replicas, Note [hybrid
sharding] in comm/mesh.py), the event each issued collective records, which ``gather``
and ``publish`` would make the computing stream wait for instead of blocking the host,
and the event the optimizer step records, which the next forward's gathers would wait
for, since they read the shards the step wrote. Under gloo on CPU a collective runs on
gloo's own threads and its handle's wait is all there is, so none of these exist yet.

Note [a forward inside gathered]
A forward that computes on pinned units alone (the model, or the unit called, whole inside
``gathered()``) communicates nothing, so it may run on one rank (the documented one-rank
evaluation), also between a training forward and its backward. It must then leave nothing
behind that decides later collectives: it runs no order check and prefetches nothing, and
calls of pinned units are never recorded in the order, which becomes the previous order
that decides the next forward's prefetches and which unit stays gathered for its backward
(LAST, Note [residency] in engine/iteration/residency.py). Before, rank 0's evaluation
before the first training step gave it an order its peers lacked: it prefetched where
they gathered on demand and kept the last block gathered where they resharded it, so its
next forward diverged (a hang with the order check off). An evaluation joining a forward
whose backward was awaited appended its calls to that forward's order, with the same
result one step later.

Note [forward entries]
A forward of the model starts at its *entry*, the module whose call starts it while no
forward of the model runs, and ends when that call returns (or raises, Note [a forward
that raised]). Every entry runs the same events as the root's call (order check, new
iteration or joining one whose backward is awaited, phase), so every rank issues the
same collectives whichever module it called. There are three kinds:

- the root, the usual one;
- a unit called on its own, outside the root's forward (``model[0](x)``, a chunked-loss
  head called on slices of the root's output), as FSDP2 allows. Between its call and its
  return the unit is gathered, prefetches and reshards as inside the root's forward,
  its outputs are hooked and its inputs wrapped, so its backward gathers it again and
  reduces its gradients with the rest. It may compute with a parameter owned by a unit
  outside it: a head tied to the embedding (``assign_units`` gives a shared parameter to
  the innermost unit holding every use, the root). Those owners (``_borrowed``) are
  gathered before the entry and before its backward, and stay gathered until the
  iteration ends, as the root does;
- a module standing for the root of a wrapper: a root whose forward only hands its
  inputs to one child (a PEFT ``PeftModel`` wrapping the ``LlamaForCausalLM`` it adapts,
  through its ``LoraModel``) is not always entered through that forward:
  ``PeftModel.generate`` calls the inner model's ``generate``, whose loop calls the inner
  model itself. The root unit's parameters (the embedding, the final norm, the head)
  were then used without the root's forward hook, as DTensor shards, and the first op
  mixing them with the inputs failed ("got mixed torch.Tensor and DTensor"). So each
  module of that chain (a module owning no parameter itself whose parameters all live in
  one child, not a unit, descending from the root; ``engine/iteration/hooks.py``,
  ``wrapped_models``) is an entry for the root unit: its call, outside a forward, is the
  root's forward. Called inside one (``PeftModel.forward`` calls it), it does nothing.
  ``generate`` on the inner model sees the markers of ``mark_collective_forward`` and
  turns on ``synced_gpus``, so ranks whose sequences stop at different lengths run the
  same number of forwards, as for a sharded model that is not wrapped.

``_entry`` is the unit the running forward started as (the root for the first and the
last kind) and ``_entry_module`` the module whose call started it: only that call's end
ends the forward. Every rank must enter through the same modules in the same order; the
order check covers these calls.

Note [a forward that raised]
A forward whose entry raised (its own code, a unit inside it, a hook: the order check
finding ranks diverged) never reaches its end. Left so, the phase stayed FORWARD with
the entry set, so the next call of a unit did not start a forward of its own, and
DTensor's table kept our handler (Note [a unit's parameter used outside it] in
engine/iteration/mixed.py) for every operation of the process. Every entry (a unit's module, or
a wrapper's, Note [forward entries]) therefore has a forward hook that torch calls also
when the call raises (``always_call``): ``on_forward_raised`` ends the forward that call
started, releasing its units, or returning to the awaited backward when the forward
joined one (unless ranks diverged meanwhile: that iteration is abandoned too, as every
collective it left in flight is). The partial order it
recorded is dropped, so that it decides no prefetch.

Note [gathered across micro-batches]
Under ``no_sync`` (or ``require_backward_grad_sync=False``) a micro-batch's backward
sends nothing, and the next micro-batch computes with the same parameters. Resharding
each unit after its backward and gathering it again for the next forward and backward
was the whole of accumulation's cost over DDP (docs/performance.md, "Gradient
accumulation"). So a trainable unit (within the limits below) stays gathered (its
residency is HOLDING, then HELD: Note [residency] in engine/iteration/residency.py): its
forward does not reshard it, and neither the end of the backward nor the next forward's
start releases it. Its gradients stay in the full parameters' ``.grad``, where autograd
adds the next micro-batch's, as DDP's do (``Unit.deferred``, where every group answers
``grads_may_wait``): the same additions, in the same order and dtype, as the
accumulator's (engine/groups/reduce.py), which the synced backward then scales and reduces, so
the result is the same bits. Where autograd would sum differently (the reproducible
mode, a reduce dtype other than the compute dtype) or the accumulator already holds part
of the step, its reduction moves them into the accumulator instead; releasing a unit
whose gradients wait in ``.grad`` moves them there first. The synced micro-batch's
forward leaves it gathered too (it is held), and that backward's reduction reshards it
as any step does, so after the optimizer step every unit is sharded again. The cost is
memory: the full parameters beside the full gradients the accumulator holds anyway. So
a unit is held only when its frozen parameters are no larger than its trainable ones
(a LoRA base would hold its whole full weight for a small adapter's gradients) and none
is quantized or offloaded, and ``sw.no_sync(model, keep_gathered=False)`` reshards as
before. A held unit is let go, with no collective,
where its full parameters would be wrong or in the way: a shard changed since it was
gathered (an optimizer step inside ``no_sync``; ``Residencies.release_all`` checks at
the next forward), a forward without backward or one that raised, an aborted backward, a
checkpoint read or written, ``load_state_dict`` and entering ``sw.gathered``
(``Residencies.release_held``), and the end of a synced backward (a held unit that no
micro-batch gave a gradient to is still reduced, with zeros, on every rank that deferred
it, so that ranks agree on who reduces). An aborted backward's gradients that autograd already added
to a held unit's ``.grad`` stay in the step's sum, as they do in DDP's ``.grad``. Each of these
happens on every rank alike, so every rank gathers the same units afterwards (Note
[collective order]); ``model.state_dict()``, which one rank may call alone, changes
nothing and hands out the shards of held units (engine/entry_points/state_dict.py).

Note [held units on one rank]
Whether a held unit stays gathered for the next micro-batch is decided by each rank
alone, without a collective, and two things decided it differently on some ranks only.
A forward that raised released every held unit, so a rank that caught an exception in a
micro-batch's forward gathered them all again while its peers computed with theirs, and
every rank failed with an order-check error blaming "a branch that chooses modules by
rank"; under DDP the same loop goes on. So a forward that raised keeps the held units
whose shards did not change (``on_forward_raised``): what it gathered itself is
released, what was held before it stays, and the ranks stay in step wherever the
raising forward gathered nothing (under gloo a rank whose raising forward did gather is
told apart by the order check, as before). A unit whose shard changed since it was
gathered (an edit of the shards, an optimizer step, on this rank inside ``no_sync``) is
gathered again; where that happened on some ranks only, they diverge, and the order
check's notes say so: the forward's first unit note names the units this rank gathers
again and why (``Residencies.regathering``), and the error's advice leads with that cause.

Note [a backward that records a graph]
A backward with ``create_graph=True`` that accumulates into the parameters
(``loss.backward(create_graph=True)``) gives gradients that carry a graph through the full
parameters, which the engine frees after each unit's backward and whose reduced shards
carry no graph: the second backward read freed storage (a bare ``setStorage`` error). It
is refused at its first hook, before anything changes, on every rank running it. (DDP's
own optimizer step then fails on such gradients: "a leaf Variable that requires grad is
being used in an in-place operation".) A gradient penalty,
``torch.autograd.grad(loss, x, create_graph=True)``, accumulates into no parameter and
is supported (Note [a backward that accumulates nothing]).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn as nn

from ..._registry import STATE, attach_to, attached, instance_attribute
from ...comm.collectives import Comm
from ...comm.mesh import Topology
from ...comm.order_check import ModelChecks
from ...comm.peers import ACTIVITY
from ...comm.step_log import StepLog
from ...errors import ShardwiseError
from . import mixed
from .autograd import AsideBackward, in_backward, output_tensors, prepare_inputs
from .exact_checks import DropoutWarning, LossSeeds
from .model_check import FrozenForBackward, check_model
from .residency import Residencies, copy_lent, full_owners, lends, release
from .running_stats import RunningStats
from .unit import FlatGroup, Unit, UnitState, sharded_param


class Phase(enum.Enum):
    """Where one model is in its training iteration."""

    IDLE = "idle"                            # every unit sharded, nothing in flight
    FORWARD = "forward"                      # inside the root's forward
    AWAITING_BACKWARD = "awaiting backward"  # a forward whose output needs grad is done
    BACKWARD = "backward"                    # backward runs; the end callback is queued


@dataclass(frozen=True)
class Settings:
    """What ``shard`` was given that the engine runs by; a deep copy runs by the same."""

    reshard_after_forward: bool | int
    prefetch: int  # units gathered ahead of the one computing
    reproducible: bool  # Note [reproducible reduction] in exact/reduce.py
    cast_inputs: torch.dtype | None  # MixedPrecision.param_dtype
    src_rank: int


class CommSchedule:
    """When one sharded model's units gather and reduce, and the waits for them (Note
    [communication owner]): the order its units ran in, the gathers issued ahead of
    their units, the reductions in flight."""

    def __init__(self, units: list[Unit], prefetch: int) -> None:
        self.units = units
        self.prefetch = prefetch  # units gathered ahead of the one computing
        self.previous: list[Unit] = []  # the calls of the previous forward
        self.order: list[Unit] = []  # this forward's calls that communicate
        self._ahead: list[Unit] = []  # gathers issued before their unit computes
        self._reducing: Unit | None = None  # the latest unit whose reduction is in flight

    # -- the order (Note [collective order]) ---------------------------------------------
    def new_iteration(self) -> None:
        """A new iteration's forward starts: this forward's order becomes the previous
        one, unless it recorded none (Note [a forward inside gathered])."""
        if self.order:
            self.previous = self.order
        self.order = []

    def forget(self, previous: bool = False) -> None:
        """Drop this forward's order (its forward was abandoned: a partial order must not
        decide the next prefetches) and, with ``previous``, the previous one (ranks
        diverged: their orders may differ, so no rank prefetches in the next forward)."""
        self.order = []
        if previous:
            self.previous = []

    # -- gathers ---------------------------------------------------------------------------
    def gather(self, unit: Unit, keep: bool = False) -> None:
        """``unit`` computes now: wait for its gather (issued here if no prefetch did) and
        expose its full parameters (``Unit.finish_gather``; ``keep``: Note [secondary
        shards] in comm/mesh.py)."""
        unit.finish_gather(keep=keep)
        if unit in self._ahead:
            self._ahead.remove(unit)

    def called(self, unit: Unit) -> None:
        """A forward called ``unit`` (which communicates): record it in the order, and
        issue the gathers of the ``prefetch`` units that ran after it last time."""
        pos = len(self.order)
        self.order.append(unit)
        prev = self.previous
        if pos < len(prev) and prev[pos] is unit:
            for nxt in prev[pos + 1:pos + 1 + self.prefetch]:
                self._issue(nxt)
            if pos + 1 + self.prefetch < len(prev):  # offloaded shards: read one further
                prev[pos + 1 + self.prefetch].read_ahead()

    def prefetch_backward(self, unit: Unit, call_index: int) -> None:
        """The backward of ``unit``'s ``call_index``-th call starts: issue the gathers of
        the ``prefetch`` units this forward called before it whose backward is still to
        come. By this forward's order only: a backward of a forward whose iteration an
        earlier backward ended (FSDP2's chunked loss: a backward per slice through the
        head called on its own, then the root's) finds a later forward's order."""
        order = self.order
        if not (call_index < len(order) and order[call_index] is unit):
            return
        for prev in reversed(order[max(0, call_index - self.prefetch):call_index]):
            if prev.owes_backward():
                self._issue(prev)
        if call_index - self.prefetch - 1 >= 0:  # offloaded shards: read one further
            order[call_index - self.prefetch - 1].read_ahead()

    def _issue(self, unit: Unit) -> None:
        if unit.is_sharded():  # else gathered already, or its gather is in flight
            unit.start_gather()
            self._ahead = self.in_flight() + [unit]

    def in_flight(self) -> list[Unit]:
        """The units whose gathers were issued ahead and not waited for yet, in the order
        they were issued. A unit resharded meanwhile (its forward abandoned, or its
        backward never came) waited for its own in ``Unit.reshard``."""
        return [u for u in self._ahead if u.state is UnitState.GATHERING]

    # -- reductions ------------------------------------------------------------------------
    def reduce(self, unit: Unit, sync: bool) -> None:
        """``unit``'s gradients are complete: start its reduction (``Unit.start_reduce``;
        without ``sync`` it only accumulates) and wait for the previous unit's."""
        unit.start_reduce(sync)
        # At most two reductions in flight: each holds a unit-sized gradient buffer, and
        # letting them pile up until the end of backward would hold a whole model's. (A
        # sum across replicas, Note [hybrid sharding], holds only the shard: it goes on.)
        if self._reducing is not None:
            for g in self._reducing.trainable_groups:
                g.reduction.advance()
        self._reducing = unit

    def backward_ended(self) -> None:
        """Every reduction of the backward is started: none waits for a next one."""
        self._reducing = None

    def publish(self, groups: list[FlatGroup], used: list[bool]) -> None:
        """Wait for each group's reduction and hand its parameters their gradient shards
        (``GradReduction.finish``), before the optimizer step. ``used``: per parameter of
        ``groups``, in order, whether any rank computed a gradient for it."""
        offset = 0
        for g in groups:
            g.reduction.wait()
            g.reduction.finish(used[offset:offset + len(g.params)])
            offset += len(g.params)

    def reductions_in_flight(self) -> list[Unit]:
        """The units whose reductions were started and not waited for yet."""
        return [u for u in self.units
                if any(g.reduction.in_flight() for g in u.trainable_groups)]

    def abandon(self) -> None:
        """The iteration cannot complete: drop its reductions (those in flight are waited
        for and their results thrown away; what ``no_sync`` accumulated stays)."""
        self._reducing = None
        for u in self.units:
            for g in u.trainable_groups:
                g.reduction.drop()


class ModelState:
    """One sharded model's phase and its events. What the events also drive belongs to
    the objects that own it: when units gather and reduce, and the order they ran in
    (``CommSchedule``, Note [communication owner]), the buffers' sync (``BufferSync``,
    engine/iteration/buffers.py), the order checks (``ModelChecks``, comm/order_check.py), the
    step log (comm/step_log.py), the dropout warning
    (engine/iteration/exact_checks.py), what keeps units gathered and the parameters a
    forward returns (``Residencies``, engine/iteration/residency.py), a backward set aside
    (``AsideBackward``, engine/iteration/autograd.py)."""

    def __init__(self, root: nn.Module, topology: Topology, units: list[Unit],
                 buffer_sync: Any, settings: Settings) -> None:
        self.root = root
        self.topology = topology
        self.comm: Comm = topology.world  # every rank of the model (Note [hybrid sharding])
        self.units = units  # root first, then in module order
        self.buffers = buffer_sync
        self.settings = settings
        self.src_rank = settings.src_rank
        self.in_no_sync = False  # inside sw.no_sync
        # sw.no_sync(keep_gathered=): Note [gathered across micro-batches]
        self.keep_gathered = True
        # Note [communication owner]: the order, the gathers and reductions in flight
        self.schedule = CommSchedule(units, settings.prefetch)
        self.phase = Phase.IDLE
        self._joins_pending = False  # this forward started while a backward was awaited
        self._entry: Unit | None = None  # what the running forward started as
        self._entry_module: nn.Module | None = None  # whose call started it
        self._pinned = False  # the running forward computes on pinned units alone
        self._borrowed_cache: dict[int, list[Unit]] = {}
        # Note [flags of a forward without gradients] in engine/iteration/unit.py
        self.frozen = FrozenForBackward()
        # Note [a backward that accumulates nothing] in engine/iteration/autograd.py
        self.aside = AsideBackward(units)
        self.residency = Residencies(units, self)  # Note [residency]
        self.steps = 0  # backwards finished: the step count in Note [peer watch]'s notes
        # reproducible=True: Note [reproducible running statistics]
        self.running_stats = RunningStats(root, self.comm) if settings.reproducible else None
        channel = self.comm.channel
        self.number = channel.models  # among the models on its group, in creation order
        channel.models += 1
        self.checks = ModelChecks(self.comm, self.number)  # Note [collective order]
        self.log = StepLog(topology, next(  # Note [secondary shards]
            (g.regather for u in units for g in u.groups if g.regather is not None), None))
        self.dropout = DropoutWarning(root) if settings.reproducible else None
        # Note [a divided loss] in engine/iteration/exact_checks.py
        self.loss_seeds = LossSeeds(units) if settings.reproducible else None
        for i, u in enumerate(units):
            u.model = self
            u.index = i

    # Note [DDP's sync attribute]
    # DDP's own switch for gradient accumulation is an attribute, and nanoGPT sets it
    # before each micro-step's forward: `model.require_backward_grad_sync = (micro_step
    # == steps - 1)`. On a sharded root it is a plain attribute that nothing read, so
    # every micro-step reduced its gradients: the same sums, but a reduce-scatter per
    # micro-step where DDP sends none, and no error. It is read wherever sw.no_sync's flag
    # is, so False there means exactly what sw.no_sync means.
    @property
    def requires_grad_sync(self) -> bool:
        """Whether a backward reduces its gradients: not inside ``sw.no_sync``, nor while
        the root's ``require_backward_grad_sync`` is set to False (Note [DDP's sync
        attribute])."""
        return not self.in_no_sync and bool(
            instance_attribute(self.root, "require_backward_grad_sync", True))

    @property
    def previous_order(self) -> list[Unit]:
        """The units the previous forward ran, in order (Note [collective order])."""
        return self.schedule.previous

    @property
    def prefetch(self) -> int:
        """Units gathered ahead of the one computing (``shard``'s ``prefetch``)."""
        return self.schedule.prefetch

    @property
    def awaiting_backward(self) -> bool:
        """Whether a forward's backward has not finished (full parameters may be saved)."""
        return self.phase in (Phase.AWAITING_BACKWARD, Phase.BACKWARD)

    def release_held(self) -> None:
        """Release the units held across micro-batches (no communication), before
        something reads or writes the shards: a checkpoint, ``load_state_dict``,
        ``gathered()``. Every rank must call it at the same point (Note [gathered across
        micro-batches])."""
        if self.phase is Phase.IDLE:
            self.residency.release_held()

    def recover(self) -> None:
        """Start clean if the last iteration cannot complete.

        Autograd drops the end-of-backward callback when backward raises (an OOM skipped
        by the user, an interrupt), and a forward with gradients whose backward never came
        leaves units gathered with values an optimizer step has since changed. Either way
        the unfinished iteration is abandoned: no gradient of it reaches the shards.
        """
        aborted = self.phase is Phase.BACKWARD
        stale = self.phase is Phase.AWAITING_BACKWARD and any(
            g.is_stale() for u in self.units for g in u.groups)
        if not (aborted or stale):
            return
        self.phase = Phase.IDLE
        self.schedule.abandon()
        self.aside.abandon()
        self.frozen.thaw()
        self.residency.release_all()

    # -- forward events ----------------------------------------------------------------
    def on_pre_forward(self, unit: Unit, args: tuple, kwargs: dict,
                       module: nn.Module | None = None) -> tuple | None:
        """A unit's forward starts: gather it, prefetch the next, wrap its inputs.
        ``module``: the module called, when it stands for the root unit (Note [forward
        entries]); it counts only outside a forward."""
        if in_backward():  # Note [recompute] in engine/iteration/autograd.py
            self.schedule.gather(unit)
            return None
        if module is not None and self.phase is Phase.FORWARD:
            return None
        if unit.is_root or self.phase is not Phase.FORWARD:
            self._start_forward(unit, module or unit.module)  # Note [forward entries]
        if self._order_checked(unit):
            # Note [held units on one rank]: the forward's first note says it.
            again, self.residency.regathering = self.residency.regathering, []
            self.checks.unit(unit.index, unit.name if not again else
                             f"{unit.name} (gathered again: {', '.join(again[:3])}, whose "
                             f"shards changed on this rank since the previous micro-batch "
                             f"under sw.no_sync)")
        if unit is self._entry and not unit.is_root:
            for owner in self._borrowed(unit):
                self.schedule.gather(owner)
        self.schedule.gather(unit, keep=torch.is_grad_enabled() and not unit.is_root)
        self._record_call(unit)
        return prepare_inputs(unit, args, kwargs)

    def _all_pinned(self, entry: Unit) -> bool:
        """Whether every unit a forward entered at ``entry`` may gather is pinned by
        ``gathered()``: it then runs whole on each rank, without collectives. For the
        root that is every unit holding parameters; for a unit called on its own, the
        units inside it and those it borrows from (Note [forward entries])."""
        scope = self.units if entry.is_root else self._nested(entry) + self._borrowed(entry)
        return all(u.pins for u in scope if u.holds_params)

    def _nested(self, unit: Unit) -> list[Unit]:
        """``unit`` and the units inside its module."""
        inside = {id(m) for m in unit.module.modules()}
        return [u for u in self.units if id(u.module) in inside]

    def _borrowed(self, unit: Unit) -> list[Unit]:
        """The units outside ``unit`` owning a parameter registered inside it: a weight
        tied to one elsewhere belongs to the innermost unit holding both
        (``assign_units``), so an output head tied to the embedding computes with a
        parameter of the root. Cached: the model's structure is fixed at ``shard``."""
        if unit.index not in self._borrowed_cache:
            nested = {id(u) for u in self._nested(unit)}
            owners: list[Unit] = []
            for m in unit.module.modules():
                for p in m._parameters.values():
                    sp = sharded_param(p) if p is not None else None
                    if (sp is not None and sp.unit is not None and id(sp.unit) not in nested
                            and all(sp.unit is not o for o in owners)):
                        owners.append(sp.unit)
            self._borrowed_cache[unit.index] = sorted(owners, key=lambda u: u.index)
        return self._borrowed_cache[unit.index]

    def _order_checked(self, unit: Unit) -> bool:
        """Whether the order check covers this call of ``unit``. A unit pinned by
        ``gathered()`` runs without communicating, so ranks may run it a different number
        of times (``generate`` stopping at different lengths): it is not checked. A unit
        without parameters is, for it prefetches the next one, unless the forward runs
        pinned whole (then no check runs at all: one joining a forward whose backward is
        awaited must not feed that forward's check, which only this rank would)."""
        return not unit.pins and not self._pinned

    def on_post_forward(self, unit: Unit, output: Any,
                        module: nn.Module | None = None) -> Any:
        """A unit's forward ended: hook its outputs for backward, reshard what may go.
        Returns what replaces the output, or ``None`` (Note [returned parameters] in
        engine/iteration/residency.py). ``module``: as for :meth:`on_pre_forward`."""
        if in_backward():  # Note [recompute]
            return None
        if module is not None and module is not self._entry_module:
            return None  # an entry called inside the running forward
        hooked = False
        tensors, unsearched = output_tensors(output)
        opaque = unsearched and torch.is_grad_enabled()  # without a gradient no backward
        if torch.is_grad_enabled():
            index = unit.call_index
            for t in tensors:
                if t.requires_grad:
                    hooked = True
                    # A leaf is a parameter returned as it is (Note [returned
                    # parameters]): a hook on it would stay for every later backward.
                    if not t.is_leaf:
                        t.register_hook(lambda grad, i=index: self.on_pre_backward(unit, i))
        if unit.is_root:
            if self.loss_seeds is not None:
                self.loss_seeds.watch(output)  # Note [a divided loss]
            return self._end_forward(unit, hooked, opaque, output)
        # Note [residency] in engine/iteration/residency.py
        self.residency.after_forward(unit, lends(unit, output, tensors, unsearched),
                                     hooked)
        if unit is self._entry:
            return self._end_forward(unit, hooked, opaque, output)
        return None

    def _start_forward(self, entry: Unit, module: nn.Module) -> None:
        """A forward of the model starts at ``entry``: the root, or a unit called on its
        own (Note [forward entries])."""
        # Note [a backward that accumulates nothing] in engine/iteration/autograd.py: one
        # that raised never reached its end callback; no backward runs while a forward
        # starts.
        self.aside.forget()
        # Note [flags of a forward without gradients] in engine/iteration/unit.py
        recording = torch.is_grad_enabled()
        check_model(self.root, self.units, self.residency, follow_flags=recording)
        if recording:  # Note [tensor hooks on shards] in engine/groups/flat.py
            for u in self.units:
                for g in u.trainable_groups:
                    g.follow_tensor_hooks()
        pinned = self._all_pinned(entry)
        self.buffers.forward_started(self.number, communicates=not pinned)
        if self.dropout is not None:
            self.dropout.forward_started()
        # Note [gathered across micro-batches]: held units stay only after an iteration
        # that ended as it should on every rank; else ranks may hold different ones.
        keep_held = self.phase is Phase.IDLE
        if self.checks.diverged():
            # Ranks diverged since the last forward: the orders they recorded may differ,
            # and prefetches follow them. Every rank forgets its order, so the next
            # forward prefetches nothing on every rank.
            self.schedule.forget(previous=True)
            keep_held = False
        self.recover()
        self._joins_pending = self.phase is Phase.AWAITING_BACKWARD
        # Note [a forward inside gathered]: no collective, so nothing to check; joining
        # an awaited backward, the check of that backward's forward stays.
        self.checks.start_forward(communicates=not pinned, joins=self._joins_pending)
        if not self._joins_pending:
            # A new iteration. Units left gathered by an exception are released first.
            self.schedule.new_iteration()
            self.residency.release_all(keep_held)
            self.residency.settle(new_iteration=True)  # Note [residency]
        self._entry, self._entry_module = entry, module
        self._pinned = pinned
        self.phase = Phase.FORWARD
        if not pinned:  # last: whatever raised before left the table as it was
            mixed.forward_started(self)  # Note [a unit's parameter used outside it]
        ACTIVITY.enter("model", f"the forward of step {self.steps + 1}")

    def _record_call(self, unit: Unit) -> None:
        """Note the call and prefetch the ``prefetch`` units that ran next last time. The
        order holds only calls that communicate: not a pinned unit's, nor any call of a
        forward inside ``gathered()`` (Note [a forward inside gathered])."""
        unit.record_call(len(self.schedule.order))
        if self._pinned or unit.pins:
            return
        self.schedule.called(unit)  # Note [communication owner]

    def _end_forward(self, entry: Unit, hooked: bool, opaque: bool, output: Any) -> Any:
        """The forward's entry unit (Note [forward entries]) returned; what
        replaces its output, or ``None``."""
        self._entry = self._entry_module = None
        mixed.forward_ended(self)
        if not self._pinned:  # a pinned forward runs on this rank alone: nothing to check
            self.checks.end_forward(len(self.schedule.order))
        # Note [buffer sync point] in engine/iteration/buffers.py
        self.buffers.forward_ended(self.root.training, communicates=not self._pinned)
        if hooked or opaque or self._joins_pending:
            # An output we cannot search may still lead to a backward: keep what it may
            # need gathered rather than free parameters autograd saved.
            self.phase = Phase.AWAITING_BACKWARD
            ACTIVITY.enter("model", f"the forward of step {self.steps + 1}, awaiting its "
                                    f"backward")
            if self._pinned:
                return None
            # Note [returned parameters] in engine/iteration/residency.py: the backward frees
            try:
                return copy_lent(output, full_owners(self.units), entry.name,
                                      None)
            except ShardwiseError:
                if not self._joins_pending:  # the caller gets no output to run backward on
                    self._abandon(f"a forward refused (after step {self.steps})")
                raise
        ACTIVITY.leave(f"a forward without backward (after step {self.steps})")
        self.phase = Phase.IDLE  # no backward will come: release everything now
        try:
            if self._pinned:
                self.residency.release_all()
                return None
            # Note [returned parameters] in engine/iteration/residency.py; refuses after releasing
            return copy_lent(output, full_owners(self.units), entry.name,
                                  self.residency.release_all)
        finally:
            self.buffers.step_ended()

    def on_forward_raised(self, module: nn.Module) -> None:
        """A call of ``module`` (a unit's, or an entry's, Note [forward entries]) raised,
        in its forward or a hook before it; the exception goes on. If that call started
        the running forward (Note [a forward that raised]), end it here."""
        if module is not self._entry_module or self.phase is not Phase.FORWARD:
            return
        self._entry = self._entry_module = None
        mixed.forward_ended(self)
        if self._joins_pending and not self.checks.diverging():
            ACTIVITY.leave(f"a forward that raised (after step {self.steps})")
            self.phase = Phase.AWAITING_BACKWARD  # the awaited backward may still come
            return
        # Note [held units on one rank]: what was held before this forward stays.
        self._abandon(f"a forward that raised (after step {self.steps})",
                      keep_held=not self.checks.diverging())

    def _abandon(self, why: str, keep_held: bool = False) -> None:
        """No backward can follow the forward that just ended: release everything (but,
        with ``keep_held``, the units held across micro-batches)."""
        ACTIVITY.leave(why)
        self.checks.abandon()
        self.phase = Phase.IDLE
        self.schedule.forget()
        self.residency.release_all(keep_held)

    # -- backward events ---------------------------------------------------------------
    def ensure_backward_callback(self, accumulating: bool = False) -> None:
        """Queue :meth:`finish_backward` once per backward (the first gradient's hook).
        ``accumulating``: called as a gradient reached a parameter. A backward that
        reaches no parameter is not the iteration's (Note [a backward that accumulates
        nothing])."""
        if self.phase is not Phase.BACKWARD:
            if self.aside.running:
                if not accumulating:
                    return
                self.aside.forget()  # a parameter's gradient came after all: a real one
            elif not accumulating and not self.aside.accumulates():
                self.aside.start()
                return
            if torch.is_grad_enabled():
                # Note [a backward that records a graph]
                raise ShardwiseError(
                    "a backward with create_graph=True that accumulates into the "
                    "parameters (loss.backward(create_graph=True), a double backward "
                    "through the weights) reached a sharded model: the graph it records "
                    "computes with the full parameters that the engine frees after each "
                    "unit's backward. This is not supported yet; nothing was changed. "
                    "torch.autograd.grad(loss, inputs, create_graph=True) (a gradient "
                    "penalty) is supported")
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self.phase = Phase.BACKWARD
            self.frozen.freeze(self.units)
            ACTIVITY.enter("model", f"the backward of step {self.steps + 1}")
            self.checks.backward(self.requires_grad_sync)

    def on_pre_backward(self, unit: Unit, call_index: int) -> None:
        """Gradients reach a unit's output: gather it, prefetch the one before it."""
        self.ensure_backward_callback()
        if not unit.is_root:  # Note [forward entries]
            for owner in self._borrowed(unit):
                self.schedule.gather(owner)
        self.schedule.gather(unit)
        self.schedule.prefetch_backward(unit, call_index)

    def on_post_backward(self, unit: Unit) -> None:
        """Gradients reached a unit's inputs: reduce it once every call's backward ran."""
        if self.aside.running:  # Note [a backward that accumulates nothing]
            return
        if unit.record_backward() and not self.aside.reduce_at_end:
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        # The order check's headers so far (the backward's own, Note [checks ride the
        # exchanges]) are compared before any gradient is taken: a backward that ranks
        # did not run together then aborts before it adds to what no_sync accumulated.
        channel = self.comm.channel
        if channel.pending():
            channel.settle()
        sync = self.requires_grad_sync
        if self.residency.at_reduction(unit, sync):
            # Note [gathered across micro-batches]: the next micro-batch computes with
            # these very parameters, and adds to these very gradients where it can.
            return
        # Free the full parameters before the gradients are copied into the reduction
        # buffer, not after: at the root's reduction, at the end of the backward, that
        # is the difference between holding the root's parameters, gradients and buffer
        # at once or only the last two (BENCHMARKS.md, live tensor bytes).
        release(unit, keep_grads=True)
        self.schedule.reduce(unit, sync)  # Note [communication owner]
        release(unit)

    def finish_backward(self) -> None:
        """End-of-backward callback: reduce what is left, then publish shard gradients."""
        for u in reversed(self.units):
            if not u.reduced and self._needs_reduction(u):
                self._reduce(u)
        self.schedule.backward_ended()
        self.aside.reduce_at_end = False
        self.frozen.thaw()
        if self.requires_grad_sync:
            self._publish_gradients([u for u in self.units if u.reduced])
        for u in self.units:
            late = [p.fqns[0] for p in u.params
                    if p.full.grad is not None and u.reduced and not u.deferred]
            if late:
                raise ShardwiseError(
                    f"internal: a gradient for {late[0]} arrived after its unit {u.name} "
                    f"was reduced; please report this with your model")
        self.residency.backward_ended(self.requires_grad_sync)
        self.phase = Phase.IDLE
        self.steps += 1
        if self.running_stats is not None and self.requires_grad_sync:
            self.running_stats.replay()
        ACTIVITY.leave(f"the backward of step {self.steps}")
        self.buffers.step_ended()  # Note [buffer sync point] in engine/iteration/buffers.py
        self.log.step_ended()

    def mid_step(self) -> bool:
        """Reproducible mode: whether a step's micro-batches are half summed (exact
        accumulators or BatchNorm records waiting for the reducing backward), so that a
        copy or a checkpoint now would miss them."""
        if self.running_stats is not None and self.running_stats.pending():
            return True
        return any(g.reduction.holds_partial_step()
                   for u in self.units for g in u.trainable_groups)

    def _needs_reduction(self, u: Unit) -> bool:
        if any(g.reduction.reduces_every_backward for g in u.trainable_groups):
            return True  # every backward is a micro-batch of every unit's mean (a zero term)
        # A unit whose backward never ran here may have run on another rank, so it joins
        # the reduction with zero gradients (Note [collective order]). So do units whose
        # gradients came without a counted forward (reentrant checkpointing recomputes in
        # backward; a second backward through a retained graph), and units holding
        # gradients accumulated under no_sync.
        # A held unit's gradients deferred in .grad count as accumulated on every rank
        # that deferred them, whether or not this rank's .grad is None (Note [gathered
        # across micro-batches]): ranks must agree on who reduces without a collective.
        return (u.forward_calls > 0 or any(p.full.grad is not None for p in u.params)
                or (self.requires_grad_sync
                    and (u.deferred
                         or any(g.reduction.has_accumulated() for g in u.trainable_groups))))

    def _publish_gradients(self, reduced: list[Unit]) -> None:
        """Wait for the reductions and hand each parameter its gradient shard."""
        groups = [g for u in reduced for g in u.trainable_groups]
        if not groups:
            return
        # One small all-reduce says which parameters got a gradient anywhere; for each
        # unit, whether an in-place edit of its held full parameters was kept on some rank
        # and not on another (Note [edits of held parameters] in engine/iteration/unit.py); and, in
        # the reproducible mode, whether a rank's loss was divided (Note [a divided loss]).
        edited = self.residency.take_edits()
        flags = [int(x) for g in groups for x in g.reduction.used]
        n, k = len(flags), len(edited)
        flags += [int(e) for e in edited] + [int(not e) for e in edited]
        if self.loss_seeds is not None:
            flags.append(self.loss_seeds.answer(groups))
        used = torch.tensor(flags, dtype=torch.int32, device=groups[0].device)
        self.comm.all_reduce(used, op=torch.distributed.ReduceOp.MAX,
                             what="the exchange of used-parameter flags ending the backward")
        values = used.tolist()
        if self.loss_seeds is not None:
            self.loss_seeds.settle(values.pop(), groups)
        split = [u.name for i, u in enumerate(self.units)
                 if values[n + i] and values[n + k + i]]
        if split:
            raise ShardwiseError(
                f"the full parameters of unit(s) {split[:3]} were changed in place between "
                f"micro-batches under sw.no_sync on some ranks and not on others, so no "
                f"rank computed with the model the step would update. Make the same edit "
                f"on every rank, or edit after the step (Note [edits of held parameters])")
        self.schedule.publish(groups, [bool(v) for v in values[:n]])


def model_state(module: nn.Module) -> ModelState | None:
    """The state of a sharded root, or ``None``."""
    return attached(module, STATE)


def owning_state(module: nn.Module) -> ModelState | None:
    """The state of the sharded model ``module`` is the root of, or a part of (found
    through the first of its parameters that is a shard: a Lightning user's ``self.net``
    inside the sharded LightningModule), or ``None``."""
    state = model_state(module)
    if state is not None:
        return state
    for p in module.parameters():
        sp = sharded_param(p)
        if sp is not None and sp.unit is not None:
            return cast(ModelState, sp.unit.model)
    return None


def set_model_state(module: nn.Module, state: ModelState) -> None:
    attach_to(module, STATE, state)
