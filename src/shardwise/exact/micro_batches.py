"""Micro-batches and means of the reproducible mode, the same at every world size.

For ``sw.shard(model, reproducible=True)``: a global batch split into micro-batches the
same way at every world size, and a mean over them that does not depend on the world
size either. Note [reproducible reduction] in
exact/reduce.py says how gradients are summed; docs/reproducible.md what is guaranteed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._args import shown
from ..comm.collectives import Comm
from ..errors import ShardwiseError


def _rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _split(batch: Any, count: int, path: str) -> list[Any]:
    """``batch`` cut into ``count`` equal parts along dim 0, keeping its structure."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() and batch.shape[0] == 0:
            raise ShardwiseError(f"micro_batches: {path} has 0 rows: an empty batch (the "
                                 f"data ran out, or a loader's last, partial batch) has "
                                 f"nothing to cut into {count} micro-batches, and the "
                                 f"ranks would run none; skip it, or use drop_last=True "
                                 f"in the DataLoader")
        if batch.dim() == 0 or batch.shape[0] % count:
            size = "a 0-dim tensor" if batch.dim() == 0 else f"{batch.shape[0]} rows"
            raise ShardwiseError(f"micro_batches: {path} has {size}, which does not split "
                                 f"into {count} equal micro-batches")
        return list(batch.chunk(count))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, count, f"{path}[{k!r}]") for k, v in batch.items()}
        return [type(batch)({k: v[i] for k, v in parts.items()})  # type: ignore[call-arg]
                for i in range(count)]
    if isinstance(batch, (tuple, list)):
        cut = [_split(v, count, f"{path}[{i}]") for i, v in enumerate(batch)]
        return [type(batch)(c[i] for c in cut) for i in range(count)]
    raise ShardwiseError(f"micro_batches: {path} is a {type(batch).__name__}; pass tensors, "
                         f"or tuples, lists or dicts of them")


def micro_batches(batch: Any, count: int, group: dist.ProcessGroup | None = None) -> list[Any]:
    """This rank's micro-batches of a global batch, the same split at every world size.

    ``batch`` (every rank passes the same global batch) is cut along dim 0 into ``count``
    equal micro-batches, numbered in order; rank r of N takes numbers
    ``[r*count/N, (r+1)*count/N)``. Run forward and backward once per micro-batch, under
    ``sw.no_sync`` for all but the last; the gradient is then the mean over the
    ``count`` micro-batches, with the same bits at any N dividing ``count``. Backpropagate
    each micro-batch's loss undivided: divided by ``len()`` of the result (``count/N``) it
    would depend on N, and a reproducible model that returns its loss raises at the
    synced backward (Note [a divided loss] in engine/iteration/exact_checks.py).

    Args:
        batch: a tensor, or a tuple, list or dict of tensors (nested), of equal length
            along dim 0.
        count: micro-batches per global batch (M).
        group: the model's process group (default: the world).

    Raises:
        ShardwiseError: the world size does not divide ``count``, a tensor's length
            does not split into ``count`` equal parts, a tensor has no rows, the tensors'
            lengths differ, or the batch holds no tensor.

    Example:
        >>> model = sw.shard(GPT(cfg), reproducible=True)
        >>> mine = sw.micro_batches((x, y), count=8)       # 8 // N micro-batches here
        >>> for i, (xb, yb) in enumerate(mine):
        ...     with sw.no_sync(model) if i < len(mine) - 1 else contextlib.nullcontext():
        ...         model(xb, yb).backward()
    """
    if type(count) is not int or count < 1:
        raise ShardwiseError(f"micro_batches: count={count!r}: expected a positive integer")
    rank, world = _rank_and_world(group)
    if count % world:
        divisors = [d for d in range(1, count + 1) if count % d == 0]
        raise ShardwiseError(f"micro_batches: {count} micro-batches do not split over "
                             f"{world} ranks; the world size must divide them (here: "
                             f"{divisors})")
    per_rank = count // world
    parts = _split(batch, count, "batch")
    _check_lengths(batch)
    return parts[rank * per_rank:(rank + 1) * per_rank]


def _check_lengths(batch: Any) -> None:
    """Every tensor of ``batch`` has the same length along dim 0: cut into equal parts,
    tensors of different lengths would pair rows that do not belong together."""
    lengths: dict[str, int] = {}

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.dim():
                lengths[path] = obj.shape[0]
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{path}[{k!r}]")
        elif isinstance(obj, (tuple, list)):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    walk(batch, "batch")
    if not lengths:  # 0-dim tensors were refused by _split: there is no tensor at all
        raise ShardwiseError(f"micro_batches: the batch holds no tensor ({shown(batch)}), so "
                             f"there is nothing to cut into micro-batches; pass the global "
                             f"batch: a tensor, or a tuple, list or dict of tensors")
    if len(set(lengths.values())) > 1:
        said = ", ".join(f"{p}: {n}" for p, n in lengths.items())
        raise ShardwiseError(f"micro_batches: the batch's tensors have different lengths "
                             f"along dim 0 ({said}); their micro-batches would pair rows "
                             f"that do not belong together. Pass tensors of one length")


def global_mean(values: Sequence[torch.Tensor | float],
                group: dist.ProcessGroup | None = None) -> float:
    """The mean of every rank's per-micro-batch ``values`` (losses, say), the same at every
    world size: ranks' values are put in micro-batch order and summed in that order in
    float64 (a communication; every rank calls it).

    Args:
        values: this rank's values, one per micro-batch, in the order
            :func:`micro_batches` gave them (scalars or 1-element tensors).
        group: the model's process group (default: the world).

    Raises:
        ShardwiseError: ranks passed different numbers of values, or none at all.

    Example:
        >>> losses = [model(xb, yb) for xb, yb in sw.micro_batches((x, y), 8)]
        >>> sw.global_mean(losses)     # the same float at N = 1, 2, 4 and 8
    """
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not all(
            (isinstance(v, torch.Tensor) and v.numel() == 1)
            or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        raise ShardwiseError(f"global_mean: values must be a list of numbers or 1-element "
                             f"tensors, one per micro-batch, got {values!r:.80}")
    mine = [float(v.detach().float().item()) if isinstance(v, torch.Tensor) else float(v)
            for v in values]
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone = Comm(group).all_gather_object(mine, what="global_mean's exchange")
    if len({len(v) for v in everyone}) > 1:
        raise ShardwiseError(f"global_mean: ranks passed {[len(v) for v in everyone]} values; "
                             f"every rank must pass one per micro-batch it ran")
    flat = [v for rank_values in everyone for v in rank_values]
    if not flat:  # checked after the exchange: every rank raises, none waits alone
        raise ShardwiseError("global_mean: every rank passed an empty list of values, whose "
                             "mean does not exist (it would be nan); pass one value per "
                             "micro-batch this rank ran (sw.micro_batches gives each rank "
                             "at least one)")
    total = torch.zeros((), dtype=torch.float64)
    for v in flat:  # in micro-batch order: the same sum at every world size
        total += v
    return float(total / len(flat))
