"""Byte accounting of training state: what each rank actually stores, and what a
device has free (the default budget of ``units="auto"``)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's: its local part),
    each counted once: views and tied weights are not counted twice."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()  # what this rank stores
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def state_bytes(module: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameter, gradient and optimizer-state storage this rank holds.

    Counts each underlying storage once (a sharded model's shards share one padded flat
    buffer per unit, which is counted whole, padding included). Works the same for sharded
    and unsharded modules, so the two can be compared.

    Example:
        >>> state_bytes(model, opt)
        {'params': 4194560, 'grads': 4194560, 'optimizer': 8389120, 'total': 16778240}
    """
    params = list(module.parameters())
    out = {"params": unique_bytes(params),
           "grads": unique_bytes(p.grad for p in params if p.grad is not None),
           "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = unique_bytes(v for s in optimizer.state.values() for v in s.values())
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def gathered_unit_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes each unit's full parameters take while it is gathered, by unit name.

    For a module that is not sharded, the whole module is one unit (``"<root>"``).

    Example:
        >>> max(gathered_unit_bytes(model).values())   # the largest all-gather's output
        1051136
    """
    from ..engine.iteration.state import model_state

    state = model_state(module)
    if state is None:
        return {"<root>": sum(p.numel() * p.element_size() for p in module.parameters())}
    return {u.name: sum(g.layout.full_numel * g.full.element_size() for g in u.groups
                        if g.by_rows) for u in state.units}


# units="auto"'s default budget takes this fraction of a rank's free memory for gathered
# parameters. The rest is for what the budget does not count and cannot know at shard
# time: activations, the computing unit's full gradients and the reduction buffers
# (about one more unit), the all-gather's temporary, and the allocator's slack.
AUTO_BUDGET_FRACTION = 0.25


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device`` now: CUDA's ``mem_get_info``, else the host's
    ``MemAvailable`` (Linux ``/proc/meminfo``), for all processes on the host together.

    Raises:
        OSError: when the host's available memory cannot be read (not Linux).

    Example:
        >>> free_memory(torch.device("cpu")) > 0
        True
    """
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    raise OSError("/proc/meminfo has no MemAvailable line")
