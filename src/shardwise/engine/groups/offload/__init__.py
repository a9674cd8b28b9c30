"""Offload: where a sharded model's parameter shards and optimizer state live.

``sw.shard(model, offload=sw.Offload(params=..., optimizer=..., folder=...))`` places two
states, each on one of three tiers, nearest first: ``"device"`` (the default), ``"cpu"``
(host memory; pinned on CUDA) and ``"disk"`` (files in a folder per rank).

Note [two states, three tiers]
The *optimizer* tier holds what the optimizer steps: the master shards (the DTensor
parameters' local tensors), their gradients and the optimizer's state, so the step runs
where the state is. The *parameters* tier holds what a gather reads: the master shards
themselves when both tiers are the same, otherwise a copy in the compute dtype, refreshed
from the master whenever the master's version moved (an optimizer step, a load, a
``gathered(modifier_rank=)`` edit). A copy farther away than the master would add a copy
and save nothing, so ``params`` may not be farther than ``optimizer``: the allowed pairs
are (device, device), (device, cpu), (device, disk), (cpu, cpu), (cpu, disk),
(disk, disk). A gather never hands an offloaded tensor to a collective: it stages it into
a fresh buffer on the device, in the compute dtype, which is the copy the all-gather of
an unoffloaded group reads too, so the gathered bits are the same.

Note [the disk tier]
Each offloaded buffer is a file of its own, reserved in full when created
(``posix_fallocate``: a full disk fails then, by name, not with a SIGBUS mid-step),
mapped shared, and unlinked at once: the data lives exactly as long as the process, a
crash leaves nothing behind that a later run could read, and no run ever reads a file it
did not write. Tensors view the mappings, so every ordinary access (``state_dict()``,
``clip_grad_norm_``, a checkpoint) sees the values. Memory stays bounded because the
engine drops a buffer's pages from the process (``MADV_DONTNEED``: for a shared file
mapping the page cache keeps the data) as soon as a unit is done with them, and asks for
the next unit's pages ahead (``MADV_WILLNEED``). The optimizer steps one unit at a time
(Note [stepping unit by unit] in engine/groups/offload/storage.py) so that only one
unit's state is resident.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ....errors import ShardwiseError
from ..alloc import bound_heap
from .disk import DiskFolder
from .storage import TIERS, Tiers


def _tier(value: object, what: str) -> str:
    if value is None:
        return "device"
    if not isinstance(value, str) or value not in TIERS:
        raise ShardwiseError(f"Offload({what}={value!r}): expected None (the device), "
                             f"'cpu' (host memory) or 'disk' (files in folder=)")
    return value


@dataclass(frozen=True)
class Offload:
    """Where a sharded model's parameter shards and optimizer state live.

    Args:
        params: where the parameter shards that gathers read live between uses:
            ``None`` (the device), ``"cpu"`` (host memory) or ``"disk"``.
        optimizer: where the optimizer state lives, with the master shards it updates
            and their gradients: the optimizer step runs there. Same values.
        folder: with ``"disk"``, the folder for the files; each rank uses its own
            subfolder ``rank<r>``, owns it while it runs and leaves nothing behind.

    Raises:
        ShardwiseError: for an unknown tier, ``"disk"`` without ``folder`` (or a
            ``folder`` without ``"disk"``), or ``params`` farther than ``optimizer``
            (the optimizer's tier holds the master shards; a parameter copy farther
            away would be one more copy and save nothing).

    Example:
        >>> sw.shard(model, offload=sw.Offload(optimizer="cpu"))            # ZeRO-Offload
        >>> sw.shard(model, offload=sw.Offload(params="disk", optimizer="disk",
        ...                                    folder="/nvme/run1"))         # ZeRO-Infinity
    """

    params: str | None = None
    optimizer: str | None = None
    folder: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        params = _tier(self.params, "params")
        optimizer = _tier(self.optimizer, "optimizer")
        if TIERS.index(params) > TIERS.index(optimizer):
            raise ShardwiseError(
                f"Offload(params={self.params!r}, optimizer={self.optimizer!r}): the "
                f"optimizer's tier holds the master shards the step updates, so parameters "
                f"farther away than it would only add a copy. Offload the optimizer at least "
                f"as far: Offload(params={self.params!r}, optimizer={self.params!r})")
        uses_disk = "disk" in (params, optimizer)
        if uses_disk and self.folder is None:
            raise ShardwiseError("Offload(... 'disk' ...) needs folder=: a directory on a "
                                 "fast local disk (NVMe), where each rank keeps its files")
        if self.folder is not None:
            if not uses_disk:
                raise ShardwiseError(f"Offload(folder={self.folder!r}) is only used with "
                                     f"'disk'; pass params='disk' or optimizer='disk', or "
                                     f"drop folder=")
            if not isinstance(self.folder, (str, os.PathLike)):
                raise ShardwiseError(f"Offload(folder={self.folder!r}): expected a path")

    @property
    def param_tier(self) -> str:
        return _tier(self.params, "params")

    @property
    def optimizer_tier(self) -> str:
        return _tier(self.optimizer, "optimizer")

    def resolve(self, device: torch.device, rank: int) -> Tiers | None:
        """This rank's placement (``None``: nothing offloaded). Takes the rank's disk
        folder, which raises if another process holds it."""
        if self.param_tier == self.optimizer_tier == "device":
            return None
        folder = None
        if self.folder is not None:
            folder = DiskFolder.for_rank(os.fspath(self.folder), rank)
            bound_heap()  # Note [a fixed mmap threshold] in engine/groups/alloc.py
        return Tiers(self.param_tier, self.optimizer_tier, device, folder)


__all__ = ["TIERS", "Offload", "Tiers"]
