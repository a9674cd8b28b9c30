"""What a flat group is given: its precision, where its shard lives, its secondary shard.

A :class:`~shardwise.engine.groups.flat.FlatGroup` branches on no mode (Note [one interface for
a group] in engine/groups/interface.py). Mixed precision is a :class:`Precision`; the shard's home
is a :class:`ShardStorage`: :class:`DeviceStorage` here, or the storage a :class:`Placement`
makes for its tiers, which answers the same calls;
``reshard_after_forward=k`` is a :class:`SecondaryShard` over the group of k ranks, which
without one keeps nothing; the reduction is the class the group is given
(engine/groups/reduce.py's, or the reproducible mode's in engine/groups/exact_reduction.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch.distributed.tensor import DTensor

from ...comm.collectives import Comm


@dataclass
class Precision:
    """The dtypes a group gathers in and reduces in (``MixedPrecision``'s
    ``param_dtype`` and ``reduce_dtype``, or the parameters' own)."""

    compute: torch.dtype
    reduce: torch.dtype


class ShardStorage(Protocol):
    """Where a flat group's shard (and its gradients) live, and how a gather reads it."""

    master: torch.Tensor  # the shard buffer the DTensor parameters view
    device: torch.device  # where gathers and reductions run
    moved: int            # Note [bytes moved]; 0 on the device

    @property
    def on_disk(self) -> bool:
        """The group has pages to drop (Note [the disk tier])."""

    @property
    def streams_state(self) -> bool:
        """The optimizer's state of its parameters lives in the group's files."""

    def gather_source(self, version: int) -> torch.Tensor: ...

    def readable(self) -> torch.Tensor: ...

    def receiving(self) -> torch.Tensor: ...

    def received(self, into: torch.Tensor) -> None: ...

    def park(self, out: torch.Tensor, params: list[Any]) -> torch.Tensor: ...

    def publish(self, p: Any, rows: torch.Tensor) -> None: ...

    def release(self) -> None: ...

    def prefetch(self, gather: bool = False) -> None: ...

    def full_freed(self, nbytes: int) -> None: ...

    def freezing_refusal(self, changed: int, total: int, trainable_at_build: bool) -> str:
        """Why ``changed`` of the group's ``total`` parameters cannot change
        ``requires_grad`` now (Note [freezing after shard] in engine/iteration/unit.py), as
        what follows "changed after sw.shard" in the refusal; "" when it is followed."""

    def cast_refusal(self, unit_name: str) -> str | None: ...

    def adopt_state(self, p: Any, key: str, value: DTensor) -> DTensor: ...

    @property
    def steps_in_place(self) -> bool: ...

    def bytes_by_tier(self) -> dict[str, int]: ...

    def tiers(self) -> tuple[str, str]: ...

    def describe(self) -> str | None: ...

    def like(self) -> ShardStorage: ...

    def recast(self, dtype: torch.dtype, compute: torch.dtype) -> None: ...


# torch.optim optimizers whose update of a parameter reads only that parameter, its
# gradient, its own state and the group's hyperparameters: what Note [plain step] in
# engine/entry_points/plain_step.py and a tier stepping part of an optimizer's parameters
# at a time (Note [stepping unit by unit] in engine/groups/offload/storage.py) rely on.
PER_PARAMETER = frozenset({"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD",
                           "NAdam", "RAdam", "RMSprop", "Rprop"})


class OptimizerStep(Protocol):
    """A placement's own part of every optimizer step (Note [the optimizer step] in
    engine/entry_points/step.py): what its tiers need before the optimizer's own call and
    after it. One object per kind of placement, the same for all its instances. Every
    part's ``after`` runs after every step, whatever its ``before`` returned, so an
    ``after`` must do nothing for a step its ``before`` did not touch; and at most one
    part may take a step over (the first ``before`` that returns arguments ends the
    round: the offload package's is the only part today)."""

    def before(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
               ) -> tuple[tuple, dict] | None:
        """Run what the step needs first; the arguments that make the optimizer's own
        call change nothing when this step did its work, else ``None``."""

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None: ...


class Placement(Protocol):
    """Where one rank keeps a model's two states, its parameter shards and its optimizer
    state, each on a tier (``"device"`` the nearest): what ``shard`` resolved its
    arguments to (Note [two states, three tiers] in engine/groups/offload/__init__.py).
    ``None`` in its place is every state on the device, in a :class:`DeviceStorage`. The
    engine asks it for a group's storage and for its part of the optimizer step, and
    names no tier."""

    @property
    def params(self) -> str:
        """The tier the parameter shards that gathers read live on."""

    @property
    def optimizer(self) -> str:
        """The tier of the master shards, their gradients and the optimizer's state."""

    @property
    def folder(self) -> Any:
        """Where a tier on disk keeps this rank's files (an object whose ``buffer``
        makes one), or ``None`` when no state is on disk."""

    def storage(self, numel: int, dtype: torch.dtype, compute_dtype: torch.dtype
                ) -> ShardStorage:
        """The home of a flat group's shard of ``numel`` elements on these tiers."""

    def optimizer_step(self) -> OptimizerStep | None:
        """Its part of every optimizer step, or ``None``."""


class DeviceStorage:
    """A shard that lives on the device, with a copy in the compute dtype for gathers when
    mixed precision asks for one."""

    moved = 0
    on_disk = False
    streams_state = False

    def __init__(self, numel: int, dtype: torch.dtype, compute: torch.dtype,
                 device: torch.device) -> None:
        self.numel = numel
        self.device = device
        self.master = torch.zeros(numel, dtype=dtype, device=device)
        self._gather_in: torch.Tensor | None = None
        self.recast(dtype, compute)

    def recast(self, dtype: torch.dtype, compute: torch.dtype) -> None:
        """Hold the shard in ``dtype`` (Note [casting after shard] in
        engine/entry_points/casts.py)."""
        self.master = self.master.to(dtype)  # padding included: still zeros
        self._gather_in = (None if compute == dtype else
                           torch.empty(self.numel, dtype=compute, device=self.device))

    def gather_source(self, version: int) -> torch.Tensor:
        """This rank's shard in the compute dtype, for an all-gather."""
        if self._gather_in is None:
            return self.master
        with torch.no_grad():
            self._gather_in.copy_(self.master)
        return self._gather_in

    def readable(self) -> torch.Tensor:
        return self.master

    def receiving(self) -> torch.Tensor:
        """Where initial shards are received: the shard itself."""
        return self.master

    def received(self, into: torch.Tensor) -> None:
        pass

    def park(self, out: torch.Tensor, params: list[Any]) -> torch.Tensor:
        return out

    def publish(self, p: Any, rows: torch.Tensor) -> None:
        """Hand ``p`` its reduced rows as its shard's ``.grad``, or add them to it."""
        if p.shard.grad is None:
            p.shard.grad = p.as_dtensor(rows)
        else:
            with torch.no_grad():
                cast(DTensor, p.shard.grad).to_local().add_(rows)

    def release(self) -> None:
        pass

    def prefetch(self, gather: bool = False) -> None:
        pass

    def full_freed(self, nbytes: int) -> None:
        pass

    def freezing_refusal(self, changed: int, total: int, trainable_at_build: bool) -> str:
        return ""

    def cast_refusal(self, unit_name: str) -> str | None:
        return None

    @property
    def steps_in_place(self) -> bool:
        """Whether an optimizer may step the shard's local tensors where they are (Note
        [plain step] in engine/entry_points/plain_step.py)."""
        return True

    def adopt_state(self, p: Any, key: str, value: DTensor) -> DTensor:
        return value

    def bytes_by_tier(self) -> dict[str, int]:
        return {}

    def tiers(self) -> tuple[str, str]:
        return "device", "device"

    def describe(self) -> str | None:
        return None

    def like(self) -> DeviceStorage:
        return DeviceStorage(self.numel, self.master.dtype,
                             self.master.dtype if self._gather_in is None
                             else self._gather_in.dtype, self.device)


class SecondaryShard:
    """Note [secondary shards] in comm/mesh.py: under ``reshard_after_forward=k`` a
    non-root unit's backward all-gathers within a group of k ranks, from this rank's part
    of the gathered buffer kept since forward. ``SecondaryShard(None)`` keeps nothing."""

    def __init__(self, comm: Comm | None) -> None:
        self.comm = comm
        self._kept: torch.Tensor | None = None
        self._version = -1
        self._sending: torch.Tensor | None = None  # read by the exchange until waited for

    def like(self) -> SecondaryShard:
        return SecondaryShard(self.comm)

    def start_gather(self, version: int, numel: int, dtype: torch.dtype,
                     unit_name: str) -> tuple[torch.Tensor, Any] | None:
        """The all-gather from the kept part, issued, as (output, work); ``None`` when
        nothing is kept or the shard changed since (an optimizer step ran)."""
        kept, self._kept = self._kept, None
        if kept is None or version != self._version:
            return None
        assert self.comm is not None
        out = torch.empty(numel, dtype=dtype, device=kept.device)
        self._sending = kept
        work = self.comm.all_gather(
            out, kept, async_op=True,
            what=f"the all-gather of unit {unit_name!r} within its group of "
                 f"{self.comm.world_size} ranks (reshard_after_forward)")
        return out, work

    def settled(self) -> None:
        self._sending = None

    @property
    def keeps(self) -> bool:
        """Whether a forward's gathered buffer is kept from (its part for this rank)."""
        return self.comm is not None

    def keep(self, gathered: torch.Tensor, version: int) -> None:
        """Keep this rank's part of a forward's ``gathered`` buffer for its backward."""
        if self.comm is None:
            return
        self._kept = gathered.chunk(self.comm.world_size)[self.comm.rank].clone()
        self._version = version

    def drop(self) -> None:
        self._kept = None

    @property
    def kept_bytes(self) -> int:
        return 0 if self._kept is None else self._kept.numel() * self._kept.element_size()
