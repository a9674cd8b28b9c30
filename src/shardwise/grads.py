"""Gradient utilities for sharded models: global norm clipping, gradient accumulation."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from ._args import require_module
from .comm.collectives import Comm
from .comm.order_check import operation
from .engine.groups.reduce import GradReduction
from .engine.groups.tensor_parallel import tp_of
from .engine.iteration.state import model_state
from .errors import ShardwiseError


def _require_state(module: nn.Module, what: str):
    require_module(module, f"sw.{what}")
    state = model_state(module)
    if state is None:
        raise ShardwiseError(f"{what} needs the module passed to sw.shard(); "
                             f"{type(module).__name__} is not a sharded root")
    return state


def _clip_announced(module: nn.Module, max_norm: float, norm_type: float, **_: Any
                    ) -> tuple[Comm, str, int] | None:
    _check_clip_arguments(max_norm, norm_type)  # before any rank communicates
    # The infinity norm reduces with MAX, the others with SUM: the check compares it.
    state = model_state(module)
    if state is None:
        return None  # torch's clip_grad_norm_, which checks nothing
    return state.comm, f"clip_grad_norm_(norm_type={float(norm_type)})", state.number


def _check_clip_arguments(max_norm: object, norm_type: object) -> None:
    """Refuse what would silently change training: a negative ``max_norm`` flips every
    gradient's sign, a NaN one turns them all into NaN."""
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ShardwiseError(f"clip_grad_norm_: {name}={value!r}: expected a number")
    if not float(max_norm) >= 0:  # type: ignore[arg-type]
        raise ShardwiseError(f"clip_grad_norm_: max_norm={max_norm!r}: expected a number "
                             f">= 0 (inf: measure the norm without clipping); a negative "
                             f"one would flip every gradient's sign, NaN would make them "
                             f"NaN")
    if not float(norm_type) > 0:  # type: ignore[arg-type]
        raise ShardwiseError(f"clip_grad_norm_: norm_type={norm_type!r}: expected a "
                             f"positive number (2.0, or float('inf'))")


@operation("clip_grad_norm_", _clip_announced)
def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm over all ranks' shards, in place.

    Args:
        module: the root returned by :func:`shardwise.shard` (an unsharded module falls
            back to ``torch.nn.utils.clip_grad_norm_``).
        max_norm: largest allowed norm.
        norm_type: p of the p-norm; ``float("inf")`` for the largest absolute value.

    Returns:
        The total norm before clipping, identical on every rank. In the reproducible
        mode (``shard(reproducible=True)``) the sum of powers is exact, so the norm is
        the same at every world size; ``torch.nn.utils.clip_grad_norm_`` on the
        parameters sums in fp32 over each rank's rows instead, which differs in the last
        bits from one world size to another: use this function there.

    With tensor parallelism the norm is over the dp and tp ranks together, each element
    of each global gradient counted once (:func:`_norm_ranks`).

    Raises:
        ShardwiseError: for a negative or NaN ``max_norm``, a non-positive ``norm_type``,
            or either not a number; tensor-parallel parameters on several tp meshes;
            nothing is changed.

    Example:
        >>> loss.backward()
        >>> norm = sw.clip_grad_norm_(model, 1.0)
        >>> opt.step()
    """
    state = model_state(module)
    if state is None:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type)
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ShardwiseError(f"norm_type must be positive, got {norm_type}")
    groups = [g for u in state.units for g in u.groups]
    comm, counted = _norm_ranks(state, groups)
    grads = [cast(DTensor, p.shard.grad).to_local() for g in groups for p in g.params
             if p.shard.grad is not None and counted(p)]
    device = groups[0].device if groups else \
        (grads[0].device if grads else torch.device("cpu"))
    # A rank's piece of a parameter may be empty, and the infinity norm of nothing is
    # undefined; empty pieces contribute nothing to any norm.
    nonempty = [g for g in grads if g.numel()]
    if nonempty:
        norms = torch.stack(_norms(groups, norm_type, counted)).to(device)
    else:
        norms = torch.zeros(1, device=device)
    # The model's reduction sums the norms (the reproducible mode's exactly: Note [exact
    # sums]).
    reduction = next((type(g.reduction) for g in groups), GradReduction)
    total = reduction.total_norm(comm, norms, nonempty, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    # Note [clipping by one]
    by_one = any(g.page_release() is not None for g in groups) and bool(coef == 1.0) \
        and not _flushes_denormals()
    for group in groups:
        if not by_one:
            for p in group.params:
                if p.shard.grad is not None:
                    grad = cast(DTensor, p.shard.grad).to_local()
                    grad.mul_(coef.to(grad.dtype))
            group.release_pages()  # Note [the disk tier]: one unit's pages at a time
        group.reduction.note_rescaled()
    return total


def _flushes_denormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormal floats to zero
    (``torch.set_flush_denormal(True)``), under which multiplying by 1 changes them."""
    return bool((torch.tensor([1e-45]) * 1.0)[0] == 0)


# Note [clipping by one]
# A total norm at or under ``max_norm`` clamps the coefficient to exactly 1, and
# multiplying a float by 1 gives back its bits (NaN stays NaN; a NaN norm makes a NaN
# coefficient, which is applied). torch multiplies anyway, to spare a GPU a host sync.
# Gradients on disk pay for that multiply with every page of their files: read, dirtied,
# and written back once more, a shard's worth of reads and writes a step for nothing. So
# where a group keeps disk pages the coefficient is read, and when it is 1 no gradient is
# touched (the sync is nothing beside the I/O). Not when subnormals are flushed to zero
# (``torch.set_flush_denormal(True)``), where multiplying by 1 zeroes them.


def _norm_ranks(state: Any, groups: list) -> tuple[Comm, Callable[[Any], bool]]:
    """The ranks whose gradient rows make up the model's norm, and which of this rank's
    parameters count in it, so that each element of each gradient counts once.

    Over the shard group: replicas (Note [hybrid sharding]) hold the same rows. With
    tensor parallelism (Note [tensor-parallel parameters] in
    engine/groups/tensor_parallel.py) over the shard and tp ranks together, where a
    parameter tp splits counts on every tp rank (each holds other elements) and one it
    replicates (a norm weight under ``SequenceParallel``, a parameter tp leaves alone)
    on tp rank 0 only.

    Raises:
        ShardwiseError: tensor-parallel parameters on several tp meshes (not built yet).
    """
    specs = [(p, spec) for g in groups for p in g.params if (spec := tp_of(p)) is not None]
    if not specs:
        return state.topology.shard, lambda p: True
    if len({spec.mesh for _, spec in specs}) > 1:
        raise ShardwiseError(
            "sw.clip_grad_norm_ does not take tensor-parallel parameters on several tp "
            "meshes yet (docs/status.md): torch.nn.utils.clip_grad_norm_(model."
            "parameters(), ...) gives the global norm when every parameter is a DTensor "
            "on one mesh")
    first, spec = specs[0]
    split = {id(p) for p, s in specs if any(isinstance(pl, Shard) for pl in s.placements)}
    on_first = spec.mesh.get_local_rank() == 0
    comm = _TP_COMMS.get(state)
    if comm is None:  # the shard and tp dims of the shards' mesh, flattened (made once)
        mesh = cast(DTensor, first.shard).device_mesh
        names = mesh.mesh_dim_names
        assert names is not None, "tp meshes are named (refused at shard otherwise)"
        if state.topology.replicas > 1:  # (replicate, shard, tp): not the replicas
            mesh = mesh[names[1:]]
        comm = _TP_COMMS[state] = Comm(mesh._flatten().get_group())
    return comm, lambda p: on_first or id(p) in split


_TP_COMMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _norms(groups: list, norm_type: float,
           counted: Callable[[Any], bool]) -> list[torch.Tensor]:
    """Each non-empty local gradient's norm, of the parameters ``counted``, group by
    group; a disk-offloaded group's pages are let go once read (Note [the disk tier])."""
    out = []
    for group in groups:
        for p in group.params:
            if p.shard.grad is not None and p.shard.grad.to_local().numel() and counted(p):
                out.append(torch.linalg.vector_norm(cast(DTensor, p.shard.grad).to_local(),
                                                    norm_type, dtype=torch.float32))
        group.release_pages()
    return out


@contextlib.contextmanager
def no_sync(module: nn.Module, *, keep_gathered: bool = True) -> Iterator[None]:
    """Accumulate gradients locally, without communicating them, inside the block.

    Backward passes inside keep each unit's *full* gradient (so a rank holds the whole
    model's gradients until the next synchronised backward); the first backward outside
    the block adds its gradients and reduce-scatters the sum. Each trainable unit also
    stays gathered from one micro-batch to the next and through the synced one, whose
    backward reshards it (Note [gathered across micro-batches] in engine/iteration/state.py): no
    gather per micro-batch, as DDP has none, at the cost of holding the full parameters
    beside the full gradients (docs/performance.md). DDP's attribute form works the same
    way: while ``model.require_backward_grad_sync`` is False (nanoGPT sets it per
    micro-step), backward passes accumulate as inside this block.

    Args:
        module: the root returned by :func:`shardwise.shard`.
        keep_gathered: ``False`` reshards every unit after each micro-batch and gathers
            it again for the next, as any step does: only the gradients are held, for
            when full parameters and gradients do not fit together.

    Raises:
        ShardwiseError: when ``module`` is not a sharded root.

    Example:
        >>> for micro in batches[:-1]:
        ...     with sw.no_sync(model):
        ...         model(micro).loss.backward()
        >>> model(batches[-1]).loss.backward()   # reduces all micro-batches
        >>> opt.step()
    """
    state = _require_state(module, "no_sync")
    previous = state.in_no_sync, state.keep_gathered
    state.in_no_sync, state.keep_gathered = True, keep_gathered
    try:
        yield
    finally:
        state.in_no_sync, state.keep_gathered = previous
