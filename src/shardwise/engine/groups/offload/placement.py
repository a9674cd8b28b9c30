"""``Offload`` (what the user asks for) and ``Placement`` (what one rank resolved it to).

Note [two states, three tiers] in engine/groups/offload/__init__.py says what each state is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ....errors import ShardwiseError
from ..alloc import bound_heap
from .disk import DiskFolder

TIERS = ("device", "cpu", "disk")  # nearest first


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

    def resolve(self, device: torch.device, rank: int) -> Placement | None:
        """This rank's placement (``None``: nothing offloaded). Takes the rank's disk
        folder, which raises if another process holds it."""
        if self.param_tier == self.optimizer_tier == "device":
            return None
        folder = None
        if self.folder is not None:
            folder = DiskFolder.for_rank(os.fspath(self.folder), rank)
            bound_heap()  # Note [a fixed mmap threshold] in engine/groups/alloc.py
        return Placement(self.param_tier, self.optimizer_tier, device, folder)


@dataclass(frozen=True)
class Placement:
    """One rank's tiers: the compute device, and the disk folder when one is used."""

    params: str
    optimizer: str
    device: torch.device
    folder: DiskFolder | None

    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor; pinned when the device is a GPU, so that copies to it
        and from it can run asynchronously."""
        pin = self.device.type == "cuda"
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def describe(self) -> str:
        where = f" in {self.folder.path}" if self.folder is not None else ""
        return f"params on {self.params}, optimizer state on {self.optimizer}{where}"
