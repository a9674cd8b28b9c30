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
(engine/groups/offload/step.py) so that only one unit's state is resident.
"""

from .placement import TIERS, Offload, Placement
from .storage import GroupStorage

__all__ = ["TIERS", "GroupStorage", "Offload", "Placement"]
