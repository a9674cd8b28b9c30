"""Buffers: replicated state kept identical across ranks by a stated policy.

Buffers are never sharded. They are synchronised from ``src_rank`` when a model is
sharded, and after every training-mode step by the model's policy: when the backward of a
training-mode forward finishes, or right after a training-mode forward that has no backward
(see Note [buffer sync point] in _state.py):

- ``"broadcast"``: every rank takes ``src_rank``'s buffers. ``src_rank``'s values evolve
  exactly as under DistributedDataParallel with ``broadcast_buffers=True``.
- ``"average"``: floating-point buffers become the mean over ranks (BatchNorm statistics
  then reflect every rank's data); integer buffers are taken from ``src_rank``.
- ``"local"``: nothing is synchronised; :func:`check_consistency` reports the divergence.

Every buffer travels at every such point, one message per dtype. Change
detection by autograd version counters is not an option: BatchNorm's kernel updates its
running statistics in place without bumping them.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ._comm import Comm
from .errors import DivergenceError, ShardwiseError

POLICIES = ("broadcast", "average", "local")


def _named_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, b) for n, b in module.named_buffers() if b is not None]


class BufferSync:
    """Applies one model's buffer policy."""

    def __init__(self, root: nn.Module, comm: Comm, policy: str, src_rank: int) -> None:
        if policy not in POLICIES:
            raise ShardwiseError(f"buffers={policy!r} is not a buffer policy; choose one of "
                                 f"{', '.join(repr(p) for p in POLICIES)}")
        self.root = root
        self.comm = comm
        self.policy = policy
        self.src_rank = src_rank

    def broadcast_all(self) -> None:
        """Every rank takes ``src_rank``'s buffers, all of them."""
        self.comm.broadcast_tensors([b for _, b in _named_buffers(self.root)], self.src_rank)

    def after_training_forward(self) -> None:
        if self.policy == "local":
            return
        buffers = [b for _, b in _named_buffers(self.root)]
        if not buffers:
            return
        if self.policy == "broadcast":
            self.comm.broadcast_tensors(buffers, self.src_rank)
            return
        floating = [b for b in buffers if b.is_floating_point() or b.is_complex()]
        exact = [b for b in buffers if not (b.is_floating_point() or b.is_complex())]
        self.comm.average_tensors(floating)
        self.comm.broadcast_tensors(exact, self.src_rank)


def tensor_digest(t: torch.Tensor) -> str:
    """A hash of a tensor's raw bytes: any difference, even in one bit, changes it."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    raw = data.view(torch.uint8)
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=16).hexdigest()


def _comm_for(module: nn.Module, group) -> Comm:
    state = module.__dict__.get("_shardwise")
    if group is None and state is not None:
        return state.comm
    if not dist.is_initialized():
        raise ShardwiseError("torch.distributed is not initialised: call sw.init_distributed()")
    return Comm(group)


def sync_buffers(module: nn.Module, src_rank: int = 0, group=None) -> None:
    """Make every rank's buffers (persistent and not) equal to ``src_rank``'s.

    Args:
        module: any module, sharded or not.
        src_rank: rank in ``group`` whose buffers everyone takes.
        group: process group; default the model's group (sharded) or the world.

    Raises:
        ShardwiseError: when ``src_rank`` is not in the group, or torch.distributed is not
            initialised.

    Example:
        >>> tokenizer.load_state_dict(sd)   # on rank 0 only
        >>> sw.sync_buffers(tokenizer)      # now every rank has rank 0's statistics
    """
    comm = _comm_for(module, group)
    if not 0 <= src_rank < comm.world_size:
        raise ShardwiseError(f"src_rank={src_rank} is not a rank of a group of "
                             f"{comm.world_size}")
    comm.broadcast_tensors([b for _, b in _named_buffers(module)], src_rank)


def _replicated(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor that should be identical on all ranks: buffers, unsharded parameters."""
    out = [(n, p) for n, p in module.named_parameters() if "_shardwise_param" not in p.__dict__]
    return out + _named_buffers(module)


def check_consistency(module: nn.Module, group=None) -> None:
    """Check that every buffer and replicated parameter is bit-identical on every rank.

    Compares a hash of each tensor's raw bytes, so any difference is caught.

    Args:
        module: any module, sharded or not (for a sharded one, its buffers).
        group: process group; default the model's group (sharded) or the world.

    Raises:
        DivergenceError: on every rank, naming each differing tensor, its dtype and shape,
            and which ranks hold which version.
        ShardwiseError: when torch.distributed is not initialised.

    Example:
        >>> sw.check_consistency(model)   # after training steps, before saving
    """
    comm = _comm_for(module, group)
    mine = {n: (str(t.dtype).replace("torch.", ""), tuple(t.shape), tensor_digest(t))
            for n, t in _replicated(module)}
    everyone = comm.all_gather_object(mine)
    names = sorted(set().union(*[set(d) for d in everyone]))
    problems = []
    for name in names:
        versions: dict[object, list[int]] = {}
        for rank, d in enumerate(everyone):
            versions.setdefault(d.get(name), []).append(rank)
        if len(versions) > 1:
            parts = []
            for k, (v, ranks) in enumerate(versions.items()):
                what = "missing" if v is None else f"{v[0]} {list(v[1])} version {chr(65 + k)}"
                parts.append(f"ranks {ranks}: {what}")
            problems.append(f"  {name}: " + "; ".join(parts))
    if problems:
        raise DivergenceError(f"{len(problems)} replicated tensor(s) differ across the "
                              f"{comm.world_size} ranks:\n" + "\n".join(problems))


def checks_enabled() -> bool:
    """Whether ``SHARDWISE_CHECK=1`` is set (read at each call: no process-wide switch)."""
    return os.environ.get("SHARDWISE_CHECK", "0") not in ("", "0")


def maybe_check(module: nn.Module) -> None:
    """Run :func:`check_consistency` when the environment sets ``SHARDWISE_CHECK=1``.

    Called after ``shard``, after ``load_pretrained`` and after a ``gathered`` block with
    a modifier exits (``save_checkpoint`` checks always). Read at each call, so it is no
    process-wide switch that a model could set for another.
    """
    if checks_enabled():
        check_consistency(module)
