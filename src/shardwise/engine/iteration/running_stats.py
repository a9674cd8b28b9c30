"""BatchNorm's running statistics in the reproducible mode.

Note [reproducible running statistics]
Under ``reproducible=True`` the gradients of a step do not depend on the world size
(Note [reproducible reduction] in exact/reduce.py), but BatchNorm's running statistics
would: each rank's kernel folds in only the micro-batches that rank ran, in its order.
So for every BatchNorm module that tracks them, each training forward also records the
micro-batch's own statistics (mean and unbiased variance per channel, from that
micro-batch alone), and the statistics at the step's first micro-batch. When
the step's gradients are reduced (the first backward outside ``no_sync``), ranks exchange
their records, put them in micro-batch order (``order``: "contiguous", rank r holding
micro-batches r*k..(r+1)*k-1 as ``sw.micro_batches`` hands them out, or "round robin",
rank r holding r, r+N, ... as accelerate's sampler deals batches to the Trainer) and
every rank replays BatchNorm's update
``r = (1 - momentum) * r + momentum * s`` over all of them from the recorded start, in
that order, then counts them in ``num_batches_tracked``: the same arithmetic on the same
values at every world size, including one. The kernel's own updates in between are
overwritten. Cumulative averaging (``momentum=None``) is refused.

The record is read from the kernel rather than computed again: the forward's pre-hook
hands the module zeroed running statistics of its own, so that the kernel's update leaves
``momentum * mean`` and ``momentum * variance`` of the micro-batch in them, which are
recorded (the replay adds them as they are); the forward hook then gives the module its
own statistics back, updated as the kernel would have updated them. These products
depend on the micro-batch alone, as the replay needs. Fresh tensors, not the module's
zeroed in place: the kernel saves the statistics it was given for its backward, so they
must not change after the forward. Computing the mean and variance again read the
activation twice more: 11 ms of a 60 ms forward and backward of the CNN of
benchmarks/workloads.py, one rank.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...comm.collectives import Comm
from ...errors import ShardwiseError
from .autograd import in_backward

# Each BatchNorm module's records, found through the module: the hook is a plain function,
# so that a deep copy of the model (copying its modules' hooks) records into the copy's
# own RunningStats, which engine/clone.py makes.
_OWNER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKED = "_shardwise_running_stats_hook"


def _before(module: nn.Module, args: tuple) -> None:
    stats = _OWNER.get(module)
    if stats is not None:
        stats.before(module, args)


def _after(module: nn.Module, args: tuple, output: object) -> None:
    stats = _OWNER.get(module)
    if stats is not None:
        stats.after(module, output)


class RunningStats:
    """The records of one model's BatchNorm modules between two reductions."""

    def __init__(self, root: nn.Module, comm: Comm) -> None:
        self.comm = comm
        self.modules = [m for m in root.modules()
                        if isinstance(m, _BatchNorm) and m.track_running_stats]
        for m in self.modules:
            if m.momentum is None:
                raise ShardwiseError(
                    f"reproducible=True: {type(m).__name__} with momentum=None (a cumulative "
                    f"average) is not supported; give it a momentum")
            _OWNER[m] = self
            if not getattr(m, _HOOKED, False):
                m.register_forward_pre_hook(_before)
                # always_call: a forward that raises gets its statistics back too.
                m.register_forward_hook(_after, always_call=True)
                setattr(m, _HOOKED, True)
        self.order = "contiguous"  # or "round robin" (ShardwiseTrainer)
        self._start: dict[nn.Module, tuple[torch.Tensor, ...]] = {}
        self._seen: dict[nn.Module, list[torch.Tensor]] = {}
        self._held: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}

    def pending(self) -> bool:
        """Whether records wait for the next reduction."""
        return bool(self._start)

    def before(self, module: nn.Module, args: tuple) -> None:
        """A forward pre-hook of ``module``: hand it zeroed running statistics, in which
        the kernel leaves the micro-batch's (read by :meth:`after`)."""
        # A recomputation inside backward (activation checkpointing) is not a new
        # micro-batch.
        if not module.training or in_backward() or not args:
            return
        bn = module
        assert isinstance(bn, _BatchNorm) and bn.running_mean is not None
        assert bn.running_var is not None and bn.num_batches_tracked is not None
        if bn not in self._start:
            self._start[bn] = (bn.running_mean.detach().clone(),
                               bn.running_var.detach().clone(),
                               bn.num_batches_tracked.detach().clone())
        self._held[bn] = (bn.running_mean, bn.running_var)
        bn.running_mean = torch.zeros_like(bn.running_mean)
        bn.running_var = torch.zeros_like(bn.running_var)

    def after(self, module: nn.Module, output: object) -> None:
        """A forward hook of ``module``: record ``momentum`` times the micro-batch's mean
        and variance, and give it back its own statistics, updated as the kernel updates
        them (unchanged when the forward raised: ``output`` is then None)."""
        held = self._held.pop(module, None)
        if held is None:
            return
        bn = module
        assert isinstance(bn, _BatchNorm) and bn.momentum is not None
        assert bn.running_mean is not None and bn.running_var is not None
        products = torch.stack([bn.running_mean, bn.running_var]).float()
        bn.running_mean, bn.running_var = held
        if output is None:
            return
        self._seen.setdefault(bn, []).append(products.cpu())
        with torch.no_grad():
            for own, product in zip(held, products):
                own.mul_(1.0 - bn.momentum).add_(product.to(own.dtype))

    def replay(self) -> None:
        """Set every recorded module's statistics from all ranks' records, in
        micro-batch order (a collective, when the model has BatchNorm modules)."""
        if not self.modules:
            return
        # A module whose forwards all raised recorded nothing (its statistics are back).
        recorded = [m for m in self.modules if m in self._seen]
        mine = [torch.stack(self._seen[m]) for m in recorded]
        everyone = ([mine] if self.comm.world_size == 1 else self.comm.all_gather_object(
            mine, what="the exchange of BatchNorm statistics (reproducible mode)"))
        counts = {tuple(t.shape[0] for t in r) for r in everyone}
        if len(counts) > 1:
            raise ShardwiseError("reproducible=True: ranks ran different BatchNorm modules, "
                                 "or different numbers of training forwards, in this step")
        with torch.no_grad():
            for j, bn in enumerate(recorded):
                assert isinstance(bn, _BatchNorm) and bn.momentum is not None
                start_mean, start_var, count = self._start[bn]
                mean, var = start_mean.float().cpu(), start_var.float().cpu()
                if self.order == "round robin":  # micro-batch i*N + r is rank r's i-th
                    steps = torch.stack([r[j] for r in everyone], dim=1).flatten(0, 1)
                else:
                    steps = torch.cat([r[j] for r in everyone])
                keep = 1.0 - bn.momentum
                for s in steps:  # s: momentum times the micro-batch's statistics
                    mean = keep * mean + s[0]
                    var = keep * var + s[1]
                assert bn.running_mean is not None and bn.running_var is not None
                assert bn.num_batches_tracked is not None
                bn.running_mean.copy_(mean)
                bn.running_var.copy_(var)
                bn.num_batches_tracked.copy_(count + steps.shape[0])
        self._start.clear()
        self._seen.clear()
