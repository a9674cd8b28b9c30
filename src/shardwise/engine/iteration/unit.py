"""The unit: parameters gathered and released together, and its state machine.

::

              start_gather               forward / backward compute
    SHARDED ──────────────► GATHERING ──► GATHERED ─────────────────► reshard() ─► SHARDED
       ▲                      (async)   finish_gather()                    │
       └───────── start_reduce(): reduce-scatter full grads into shard grads ◄──┘

Every transition is a method of :class:`Unit`; nothing else changes a unit's state. When
the transitions that communicate run, and the waits for them, is decided per model by its
``CommSchedule`` (Note [communication owner] in engine/iteration/state.py).
What keeps a unit gathered between its computations, its residency (:class:`Residency`),
is decided and changed in engine/iteration/residency.py (Note [residency]), which is
also the one way out of it (``release``).

A unit holds one list of groups (Note [one interface for a group] in engine/groups/interface.py),
each gathered by one collective, and walks it once per transition: one
:class:`~shardwise.engine.groups.flat.FlatGroup` per (dtype, requires_grad) of its plain
parameters, so a frozen base weight next to a trainable adapter is never reduce-scattered
and parameters of different dtypes never share a buffer, and one for its frozen tensor
subclasses (Note [one group type] in engine/groups/flat.py).

Note [what the module sees]
While a unit is SHARDED or GATHERING, each of its parameters is registered on its
module(s) as the *shard*: an ``nn.Parameter`` holding a ``DTensor`` with the original
shape, placement ``Shard(0)`` over the unit's device mesh, whose local tensor is a view
of this rank's rows in the flat shard buffer (Note [row sharding] in engine/groups/layout.py).
Code that reads ``p.shape``, ``p.dim()``, ``p.numel()``, builds parameter groups, clips
gradients with ``torch.nn.utils.clip_grad_norm_`` or calls ``state_dict()`` sees the
parameter's global meaning. ``finish_gather`` swaps in the *full* parameter, a plain leaf
``nn.Parameter`` viewing the full buffer with the original shape, because module code
computes with plain tensors; ``reshard`` swaps the shards back. The swap is a dict
assignment in ``module._parameters``, and which of the two a sharded model's module holds
is decided in ``_swap`` only (each group's ``expose``). Five other places write
``module._parameters``, none of them choosing between shard and full:
``FlatGroup.install`` registers the shards once, in place of the originals (``shard``) or of
the copied ones (a deep copy); ``sharded_init`` registers its stand-ins before there is a
shard; a move or cast that changes nothing (engine/entry_points/guards.py) takes the shards out of
torch's reach for the call and puts the same objects back; and ``gathered()`` puts the
full parameter back into a slot that code inside the block replaced. Optimizers hold the
shards, so they never see the swap.

Note [freezing after shard]
A unit's parameters are grouped by ``requires_grad`` when ``shard`` runs, so that a frozen
base is never reduced. A change afterwards is taken up at the next root forward, per
parameter, as FSDP2 takes it: BitFit (only biases trainable), DPO's frozen reference copy
(``ref = copy.deepcopy(model); ref.requires_grad_(False)``) and trainable sets toggled
between iterations. A group's reduction already handles a parameter without a gradient
(one unused in this step, Note [collective order] in engine/iteration/state.py): it adds zeros for
it and hands it no gradient unless some rank computed one. So a group that holds frozen
and trainable parameters is reduced as a whole, zeros included (freezing after ``shard``
saves no communication; freezing before does), and a frozen one is not reduced at all.
A parameter unfrozen for the first time gets its full parameter's end-of-backward
trigger then (``ensure_backward_callback``). What is taken up is the shard's flag, or a
full parameter's where code changed that one while the unit was gathered. While
``no_sync`` gradients wait (in the group's reduction, or in a held unit's ``.grad``), a
parameter unfrozen gets the later micro-batches' gradients and one frozen before any
micro-batch gave it a gradient gets none, as under DDP (a group left with no trainable
parameter drops what its reduction held: zeros); freezing a parameter that already holds
part of the step's sum is refused. Not taken up either: for an offloaded group, anything
but freezing and unfreezing all of a group that was trainable at ``shard`` (its tiers
were planned for that).

Note [flags of a forward without gradients]
A forward under ``torch.no_grad()`` records no graph, so the trainable set means nothing
to it, and it does not take up ``requires_grad`` changes. PEFT's ``disable_adapter()``
switches every adapter's ``requires_grad`` off and on again around the forward it wraps;
TRL's DPO computes the reference log-probabilities that way, under ``no_grad``, between
the policy's forward and its backward. Taken up there, the adapters' groups were frozen
for the backward already awaited (every LoRA gradient lost, silently), and their full
parameters recomputed by activation checkpointing no longer required grad (a different
number of saved tensors). Changes are therefore taken up only by a forward that records
a graph, at its start, as before. Between a forward and its backward autograd decides
by the flag at accumulation: a leaf frozen after its forward gets no gradient. The
engine does the same for a shard frozen then (``FrozenForBackward`` in model_check.py: its
full parameter is frozen for that backward only, and the change is taken up at the next
recording forward); a parameter unfrozen then gets none either, having no place in the
graph.

Note [edits of held parameters]
Under ``no_sync`` a held unit's full parameters stay registered between micro-batches
(Note [gathered across micro-batches] in engine/iteration/state.py), so code that edits
``model.parameters()`` there (``p.mul_`` under ``no_grad``, ``p.copy_``, ``p.data``)
edits them, and later micro-batches compute with the edit, as under DDP. Resharding
dropped them and kept the shards: the edit vanished at the step, silently. So a held
unit that stops being held (``release``, or a settling that finds it may no longer be
held: Note [residency] in engine/iteration/residency.py) and whose shard did not change
meanwhile first copies into the shard this rank's rows of the full parameters wherever
they differ from it (``FlatGroup.keep_edits``; one comparison of this rank's rows, no
collective). Every rank making the same edit keeps its own rows of it: DDP's result. An
edit on some ranks only would leave a model that no rank computed with; an in-place
operation moves the full buffer's version counter whichever rows it touches, so each
rank notes whether one wrote there, and the ranks compare the notes in the exchange of
used-parameter flags that ends the next synced backward (``ModelState._publish_gradients``,
through ``Residencies.take_edits``): a difference raises on every rank, naming the units.
Not seen by that comparison: an edit through ``p.data`` (it moves no version counter) on
some ranks only; it is still kept on the ranks that made it.

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
exactly the values autograd saved, so the counter is restored around it
(``wait_gather`` in engine/groups/flat.py, the only place that writes into ``full`` while
autograd may hold it). The all-gather itself writes into a temporary, or into
``full``'s storage through a tensor of its own (Note [gathering in place] in
engine/groups/flat.py), never through ``full``: gloo bumps its output's counter on a worker
thread, at a moment nobody can wait for.
A full parameter a user keeps past a ``gathered()`` block is not one of these references:
the block's end leaves it its own buffer (Note [full parameters held after gathered()] in
gather.py), so this path frees in place without looking for it.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import torch
import torch.nn as nn

from ..._registry import UNIT, attach_to, attached
from ...comm.collectives import Comm
from ...comm.mesh import Topology
from ..groups.flat import FlatGroup, ShardedParam, set_sharded_param, sharded_param

# Re-exported: the engine's records of a parameter are reached through the unit.
__all__ = ["FlatGroup", "Model", "Residency", "ShardedParam", "Unit", "UnitState",
           "set_sharded_param", "set_unit", "sharded_param", "unit_of"]


class Model(Protocol):
    """What a unit's model is to whoever reaches it through the unit: the module hooks,
    the post-backward function, the order check, ``gathered()``.
    :class:`~shardwise.engine.iteration.state.ModelState` is the one implementation; naming it here
    would make this module and engine/iteration/state.py import each other."""

    comm: Comm
    topology: Topology
    units: list[Unit]
    number: int  # among the sharded models on its group (Note [checks ride the exchanges])
    steps: int  # backwards completed (a block's left-behind parameters, gather.py)

    @property
    def awaiting_backward(self) -> bool: ...

    def recover(self) -> None: ...

    def release_held(self) -> None: ...

    def on_pre_forward(self, unit: Unit, args: tuple, kwargs: dict,
                       module: nn.Module | None = None) -> tuple | None: ...

    def on_post_forward(self, unit: Unit, output: Any,
                        module: nn.Module | None = None) -> Any: ...

    def on_forward_raised(self, module: nn.Module) -> None: ...

    def on_post_backward(self, unit: Unit) -> None: ...

    def ensure_backward_callback(self, accumulating: bool = False) -> None: ...


class UnitState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


class Residency(enum.Enum):
    """What keeps a unit gathered between its computations: settled once per iteration,
    changed by the events of Note [residency] in engine/iteration/residency.py."""

    RESHARDED = "resharded"  # a forward leading to a backward reshards it
    KEPT = "kept"            # gathered from its forward to its reduction
    LAST = "last"            # ran last: KEPT where it runs last again, else RESHARDED
    HOLDING = "holding"      # under no_sync: kept, and HELD from its reduction on
    HELD = "held"            # gathered across no_sync micro-batches
    LENT = "lent"            # a forward returned a full parameter of it


class Unit:
    """A module whose parameters are gathered and released together.

    ``groups`` is its one list of groups (Note [one group type] in
    engine/groups/flat.py); it may be empty (a module with no parameters of its own),
    and its hooks still run so that the order of units is known.
    """

    def __init__(self, module: nn.Module, name: str, groups: list[FlatGroup],
                 reshard_after_forward: bool | int, is_root: bool,
                 cast_inputs: torch.dtype | None = None) -> None:
        self.module = module
        self.name = name or "<root>"
        self.groups = groups
        for g in groups:
            g.unit_name = self.name
            for p in g.params:
                p.unit = self
        self.reshard_after_forward = reshard_after_forward
        self.is_root = is_root
        self.model: Model = None  # type: ignore[assignment]  # set by ModelState
        self.index = 0     # position in the model's units
        self.pins = 0      # open gathered() blocks holding this unit gathered
        self.cast_inputs = cast_inputs  # MixedPrecision.param_dtype
        self.state = UnitState.SHARDED
        # Note [residency] in engine/iteration/residency.py: what keeps it gathered, and
        # the value settled for this iteration, which HELD and LENT return to when they
        # end. Written by engine/iteration/residency.py only.
        self.residency = self.settled = Residency.RESHARDED
        # Its gradients wait, summed by autograd, in the full parameters' ``.grad`` (a
        # HELD unit's, Note [gathered across micro-batches] in engine/iteration/state.py);
        # moved to the reduction when it is released (engine/iteration/residency.py).
        self.deferred = False
        # An in-place edit of its full parameters while held was kept (Note [edits of
        # held parameters]); read and cleared by the model at the next synced backward.
        self.edited = False
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

    def is_stale(self) -> bool:
        """Whether a shard changed (an optimizer step, a load) since the unit was
        gathered: its full parameters hold old values."""
        return any(g.is_stale() for g in self.groups)

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
        """Whether the unit gathers anything."""
        return bool(self.groups)

    @property
    def trainable_groups(self) -> list[FlatGroup]:
        return [g for g in self.groups if g.requires_grad]

    def is_sharded(self) -> bool:
        """Whether the unit is at rest: sharded, not inside a forward, a backward or a
        ``gathered()`` block."""
        return self.state is UnitState.SHARDED

    def is_gathered(self) -> bool:
        return self.state is UnitState.GATHERED

    # -- transitions -----------------------------------------------------------------
    def start_gather(self) -> None:
        """SHARDED -> GATHERING: issue the all-gathers without waiting (prefetch)."""
        if self.state is not UnitState.SHARDED:
            return
        for g in self.groups:
            g.start_gather()
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
            g.read_ahead()

    def reshard(self, keep_grads: bool = False) -> None:
        """-> SHARDED: expose shards again and free the full parameters (and, unless
        ``keep_grads``, their gradients). Reached through ``residency.release``, which
        first ends what keeps the unit gathered (Note [residency]).

        A unit pinned by an open ``gathered()`` block stays gathered.
        """
        if self.state is UnitState.SHARDED or self.pins:
            return
        assert not self.deferred and self.residency is not Residency.HELD, (
            "a held unit is released through engine/iteration/residency.py's release")
        for g in self.groups:
            g.wait_gather(fill=False)  # never free memory a collective still writes
        self._swap(full=False)
        for g in self.groups:
            g.free(keep_grads)
        self.state = UnitState.SHARDED

    def start_reduce(self, sync: bool) -> None:
        """Hand this backward's full gradients to the reduction; see GradReduction.start."""
        for g in self.groups:
            g.start_reduce(sync)
        self.reduced = True

    def _swap(self, full: bool) -> None:
        # Note [what the module sees]
        for g in self.groups:
            g.expose(full)

    def __repr__(self) -> str:
        n = sum(p.numel for p in self.params)
        return f"Unit({self.name!r}, params={n}, state={self.state.value})"


def unit_of(module: nn.Module) -> Unit | None:
    """The unit ``module`` is the root of, or ``None``."""
    return attached(module, UNIT)


def set_unit(module: nn.Module, unit: Unit) -> None:
    attach_to(module, UNIT, unit)
