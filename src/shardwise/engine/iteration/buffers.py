"""Buffers: replicated state kept identical across ranks by a stated policy.

Buffers are never sharded. They are synchronised from ``src_rank`` when a model is
sharded, and after every training-mode step by the model's policy: when the backward of a
training-mode forward finishes, or right after a training-mode forward that has no backward
(Note [buffer sync point]):

- ``"broadcast"``: every rank takes ``src_rank``'s buffers. ``src_rank``'s values evolve
  exactly as under DistributedDataParallel with ``broadcast_buffers=True``.
- ``"average"``: floating-point buffers become the mean over ranks (BatchNorm statistics
  then reflect every rank's data); integer buffers are taken from ``src_rank``.
- ``"local"``: nothing is synchronised; ``check_consistency`` reports the divergence.

Every buffer travels at every such point, one message per dtype. Change
detection by autograd version counters is not an option: BatchNorm's kernel updates its
running statistics in place without bumping them.

Note [buffers added after shard]
``shard`` makes every buffer ``src_rank``'s, but a buffer registered afterwards
(``module.register_buffer(...)``) or replaced (``module.buf = tensor``) holds whatever
each rank put there, and the first forward would use it unsynchronised (the policy's
sync comes after the forward). So each root forward first compares the buffers'
identities with those of the last look (a walk of the modules, as the check for added
parameters does) and, when one is new, every rank takes ``src_rank``'s values of the new
ones, under the policy (``"local"``: none). Ranks that changed different buffers would
meet different collectives: the broadcast is announced to the order check first.
In-place updates (BatchNorm's statistics) keep the identity and are the policy's to sync.

Note [buffer sync point]
BatchNorm saves its running statistics for backward, so overwriting buffers between a
forward and its backward would break autograd's version check (and would change what
backward reads). Buffers are synchronised when the backward finishes, or right away when
no backward will come: the engine says when a forward starts, when it ends and when a
backward finishes (:class:`BufferSync`'s ``forward_started``, ``forward_ended``,
``step_ended``), and the sync waits in between. A forward inside ``gathered()`` (every
unit pinned) may run on one rank alone and communicates nothing, buffers included: the
block's exit makes them agree (the modifier's) or refuses what changed (read-only).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
import torch.nn as nn

from ...comm.collectives import Comm
from ...comm.order_check import announce, operation
from ...errors import ShardwiseError
from ...exact.reduce import exact_average
from .state import owning_state


class BufferPolicy(str, enum.Enum):
    """How a model keeps its buffers identical in training (``sw.shard(buffers=...)``).

    A ``str`` enum, so ``"broadcast"``, ``"average"`` and ``"local"`` work as well.
    """

    BROADCAST = "broadcast"
    AVERAGE = "average"
    LOCAL = "local"


def named_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every buffer of ``module`` (persistent and not), skipping ``None`` slots."""
    return [(n, b) for n, b in module.named_buffers() if b is not None]


def buffer_policy(policy: object) -> BufferPolicy:
    """``policy`` as a :class:`BufferPolicy`; a ShardwiseError naming the choices if it
    is none."""
    try:
        return BufferPolicy(policy)
    except ValueError:
        raise ShardwiseError(
            f"buffers={policy!r} is not a buffer policy; choose one of "
            f"{', '.join(repr(p.value) for p in BufferPolicy)}") from None


class BufferSync:
    """Applies one model's buffer policy."""

    def __init__(self, root: nn.Module, comm: Comm, policy: str | BufferPolicy,
                 src_rank: int, exact: bool = False) -> None:
        self.policy = buffer_policy(policy)
        self.root = root
        self.comm = comm
        self.src_rank = src_rank
        self._known = self._identities()  # Note [buffers added after shard]
        self.exact = exact  # reproducible mode: "average" sums exactly (exact/reduce.py)
        self._due = False  # a training forward's sync waits for its backward

    # -- when (Note [buffer sync point]) ----------------------------------------------
    def forward_started(self, model: int, communicates: bool) -> None:
        """A forward of the model numbered ``model`` starts; ``communicates``: not one
        inside ``gathered()``, which may run on one rank alone."""
        if communicates:
            self.sync_new(model)

    def forward_ended(self, training: bool, communicates: bool) -> None:
        """A forward ended: a training-mode one that communicates owes a sync, made by
        :meth:`step_ended` once its backward finished or none will come."""
        self._due |= training and communicates

    def step_ended(self) -> None:
        """A backward finished, or a forward ended that none will follow: sync what is
        owed."""
        if self._due:
            self._due = False
            self.after_training_forward()

    def broadcast_all(self) -> None:
        """Every rank takes ``src_rank``'s buffers, all of them."""
        self.comm.broadcast_tensors([b for _, b in named_buffers(self.root)], self.src_rank,
                                    "the broadcast of buffers")
        self._known = self._identities()

    def sync_new(self, model: int) -> None:
        """Note [buffers added after shard]: before a root forward, every rank takes
        ``src_rank``'s values of the buffers registered or replaced since the last look
        (unless the policy is ``"local"``)."""
        now = self._identities()
        if now == self._known:
            return
        changed = [b for key, b in now.items() if self._known.get(key, (None,))[0] != b[0]]
        self._known = now
        if self.policy is BufferPolicy.LOCAL or not changed:
            return
        announce(self.comm, "the broadcast of buffers added or replaced after sw.shard",
                 model)
        self.comm.broadcast_tensors([t for _, t in changed], self.src_rank,
                                    "the broadcast of buffers added or replaced after "
                                    "sw.shard")

    def _identities(self) -> dict[tuple[int, str], tuple[int, torch.Tensor]]:
        """Every buffer by (module, name): the tensor's identity, and the tensor."""
        return {(id(m), n): (id(b), b) for m in self.root.modules()
                for n, b in m._buffers.items() if b is not None}

    def after_training_forward(self) -> None:
        if self.policy is BufferPolicy.LOCAL:
            return
        buffers = [b for _, b in named_buffers(self.root)]
        if not buffers:
            return
        if self.policy is BufferPolicy.BROADCAST:
            self.comm.broadcast_tensors(buffers, self.src_rank,
                                        "the broadcast of buffers after the forward")
            return
        floating = [b for b in buffers if b.is_floating_point() or b.is_complex()]
        exact = [b for b in buffers if not (b.is_floating_point() or b.is_complex())]
        if self.exact:
            exact_average(self.comm, floating, "buffers after the forward")
        else:
            self.comm.average_tensors(floating, "the averaging of buffers after the forward")
        self.comm.broadcast_tensors(exact, self.src_rank,
                                    "the broadcast of buffers after the forward")


def comm_for(module: nn.Module, group: dist.ProcessGroup | None) -> Comm:
    """The group a module-level operation talks over: ``group``, else the sharded
    model's, else the world."""
    state = owning_state(module)
    if group is None and state is not None:
        return state.comm
    if not dist.is_initialized():
        raise ShardwiseError("torch.distributed is not initialised: call sw.init_distributed()")
    return Comm(group)


@operation("sync_buffers", lambda module, src_rank, group: (
    comm_for(module, group), f"sync_buffers(src_rank={src_rank!r})", None))
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
    comm = comm_for(module, group)
    if type(src_rank) is not int or not 0 <= src_rank < comm.world_size:
        raise ShardwiseError(f"src_rank={src_rank} is not a rank of a group of "
                             f"{comm.world_size}")
    comm.broadcast_tensors([b for _, b in named_buffers(module)], src_rank)
