"""The interface of a group of parameters: what the rest of shardwise may ask of one.

Note [one interface for a group]
A unit gathers and releases its parameters in *groups*, each moved by one collective: a
:class:`~shardwise.engine.groups.flat.FlatGroup` of plain parameters of one dtype and one
``requires_grad`` (a flat buffer sharded by rows), or of frozen tensor subclasses
(gathered as bytes through FSDP2's extension protocol): one group type, whose
parameters' gather strategy decides how they move (Note [one group type] in
engine/groups/flat.py). :class:`ParamGroup` is what the rest of shardwise may ask of a
group:

- the unit's transitions: ``start_gather`` / ``wait_gather``, ``expose`` (which form the
  modules hold: Note [what the module sees] in engine/iteration/unit.py), ``free``, ``drop_kept``,
  ``read_ahead`` and ``start_reduce`` (nothing for a frozen group);
- what a unit's residency asks (Note [residency] in engine/iteration/residency.py):
  ``may_be_held`` (its full parameters may stay gathered across ``no_sync``
  micro-batches: not offloaded, not quantized) and ``grads_may_wait`` (its accumulated
  gradients may wait in the full parameters' ``.grad``, where autograd sums them as its
  reduction would);
- a checkpoint's needs: ``page_release``, the callback that drops the group's pages from
  memory once a checkpoint has read or written them (``None`` when it keeps none: only a
  disk tier does, Note [the disk tier]); ``streams_state`` / ``adopt_state`` for
  optimizer state that lives in its files;
- what ``sw.inspect`` and the memory figures read: ``shard_bytes``, ``full_bytes``,
  ``kept_bytes``, ``bytes_by_tier`` (offloaded storage per tier), ``moved_bytes`` (Note
  [bytes moved]) and ``describe()`` (plain values only, its ``"kind"`` among them:
  ``"flat"`` for plain rows or ``"packed"`` for tensor subclasses, which ``inspect``
  shows apart);
- ``storage``, the part it was given for where its shard lives
  (engine/groups/parts.py's ``ShardStorage``), which answers for its mode: its
  ``describe()`` (``None`` on the device, else the tiers in words), its tiers, its
  refusals of casts and of ``requires_grad`` changes.

A unit keeps one list of groups and walks it once per transition; how a group does each
step (mixed precision, offload, the secondary shard, the reproducible reduction) is an
object the group was given when built (engine/groups/flat.py's ``flat_group``), so neither the
unit nor the checkpoint, ``inspect``, ``clip_grad_norm_`` or ``gathered()`` asks which
modes are on: they ask the group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from .parts import ShardStorage


class ParamGroup(Protocol):
    """One collective's worth of a unit's parameters (Note [one interface for a group])."""

    unit_name: str        # the unit's name, for the group's collectives and messages
    storage: ShardStorage  # where its shard lives: a part it was given
    requires_grad: bool   # its gradients are reduced after backward
    by_rows: bool         # plain rows, else tensor subclasses (Note [one group type])

    @property
    def params(self) -> Sequence[Any]: ...

    # -- transitions -----------------------------------------------------------------
    def start_gather(self) -> None: ...

    def wait_gather(self, fill: bool = True, keep: bool = False) -> None: ...

    def expose(self, full: bool) -> None: ...

    def free(self, keep_grads: bool = False) -> None: ...

    def drop_kept(self) -> None: ...

    def read_ahead(self) -> None: ...

    def start_reduce(self, sync: bool) -> None: ...

    def full_is_allocated(self) -> bool: ...

    def is_stale(self) -> bool: ...

    # -- residency (Note [residency] in engine/iteration/residency.py) -----------------
    def may_be_held(self) -> bool: ...

    def grads_may_wait(self) -> bool: ...

    # -- checkpoints -------------------------------------------------------------------
    def page_release(self) -> Callable[[], None] | None: ...

    def release_pages(self) -> None: ...

    @property
    def streams_state(self) -> bool: ...

    def adopt_state(self, p: Any, key: str, value: Any) -> Any: ...

    # -- figures -----------------------------------------------------------------------
    @property
    def shard_bytes(self) -> int: ...

    @property
    def full_bytes(self) -> int: ...

    @property
    def kept_bytes(self) -> int: ...

    @property
    def moved_bytes(self) -> int: ...

    def bytes_by_tier(self) -> dict[str, int]: ...

    def describe(self) -> dict[str, Any]: ...


class BufferGroup(ParamGroup, Protocol):
    """A group whose full parameters view one buffer of the compute dtype (a flat group):
    what ``gathered()`` reads and writes, and what a full state dict gathers."""

    full: torch.Tensor
    dtype: torch.dtype

    @property
    def compute_dtype(self) -> torch.dtype: ...

    def gather_full(self) -> torch.Tensor: ...

    def full_value(self, p: Any, full: torch.Tensor) -> torch.Tensor: ...

    def local_from_full(self, full: torch.Tensor) -> None: ...


def tier_totals(groups: Sequence[ParamGroup]) -> dict[str, int]:
    """Bytes per tier of every group's offloaded storage (Note [two states, three tiers]
    in engine/groups/offload/__init__.py): zeros for tiers nothing is on."""
    out = {"device": 0, "cpu": 0, "disk": 0}
    for g in groups:
        for tier, n in g.bytes_by_tier().items():
            out[tier] += n
    return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
