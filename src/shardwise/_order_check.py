"""The collective-order check: ranks agree on what they are about to do, or all raise.

Note [collective order] in _state.py says why every rank must issue the same collectives
in the same order. When ranks diverge anyway (a rank that caught an exception and went
on, skipped a unit, or alone called ``full_state_dict``), their next collectives pair up
wrongly; under gloo, two collectives of different sizes abort the process (SIGABRT
inside gloo) instead of raising. So before each unit's forward, at the end of the root's
forward, at the start of a backward and before each public operation that communicates,
every rank contributes what it is about to do to one tiny all-reduce: all such checks
have the same size, so mismatched ones still pair up, and any difference shows in the
maximum. Every rank then raises one error naming what each rank was doing.

On by default under gloo (about 0.2 ms per check, measured in BENCHMARKS.md; a step of
the reference workload has 9), off under NCCL, where reading the result would stall the
host on every unit. ``SHARDWISE_CHECK=1`` turns it on everywhere (with the consistency
checks of ``consistency.maybe_check``), ``SHARDWISE_CHECK=0`` off everywhere.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch

from ._agree import same_everywhere
from ._comm import Comm
from ._env import check_setting
from .errors import ShardwiseError

if TYPE_CHECKING:
    from ._unit import Unit

_UNIT, _END_FORWARD, _BACKWARD, _OPERATION, _OPTIMIZER_STEP = 1, 2, 3, 4, 5


def order_checks_enabled(comm: Comm) -> bool:
    """Whether ranks check the order of what they do (read at each use): as
    ``SHARDWISE_CHECK`` says, and by default under gloo."""
    if comm.world_size == 1:
        return False
    setting = check_setting()
    return "gloo" in comm.backend if setting is None else setting


class OrderCheck:
    """One root forward's checks: one per unit that communicates, one at its end."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._checked = 0  # unit checks in the current root forward

    def unit(self, unit: Unit) -> None:
        """Raise on every rank unless all ranks are about to run ``unit``.

        A unit pinned by ``gathered()`` runs without communicating, so ranks may run it
        a different number of times (``generate`` stopping at different lengths): it is
        not checked. A unit without parameters is, for it prefetches the next one,
        unless every unit that has parameters is pinned.
        """
        if unit.pins or (not unit.groups and all(u.pins for u in unit.model.units
                                                 if u.groups)):
            return
        # The first check of a forward is where a rank running the model alone waits
        # first: only that wait watches the peers (Note [peer watch]).
        watch = self._checked == 0
        self._checked += 1
        _agree(self.comm, _UNIT, unit.index, f"unit {unit.name}", watch)

    def end_forward(self, calls: int) -> None:
        """Raise on every rank unless all ranks end the forward here. Catches a rank that
        skips the *last* unit, whose peers would otherwise wait in that unit's check."""
        if self._checked:
            self._checked = 0
            _agree(self.comm, _END_FORWARD, calls,
                   f"the end of the forward after {calls} unit calls")

    def backward(self) -> None:
        """Raise on every rank unless all ranks start a backward here."""
        _agree(self.comm, _BACKWARD, 0, "the backward")


def announce(comm: Comm | None, operation: str) -> None:
    """Raise on every rank unless all ranks are about to start ``operation`` (a public
    function that communicates), when order checks are on."""
    if comm is not None and order_checks_enabled(comm):
        _agree(comm, _OPERATION, zlib.crc32(operation.encode()) & 0x3FFFFFFF, operation,
               watch=True)


def watch_steps(comm: Comm, optimizer: torch.optim.Optimizer):
    """After each ``optimizer.step()``, raise on every rank unless all ranks have taken
    as many steps, when order checks are on. For the integrations, which drive the
    optimizer: a rank that skipped a step (a caught exception, a data loader that ran
    out early) would otherwise train on silently, diverged. One check as small as a
    unit's; a rank that skipped the step meets it with its next forward's check, which
    names both.

    Returns:
        The hook's handle (``.remove()`` stops the checks).
    """
    taken = [0]

    def after_step(*_: object) -> None:
        taken[0] += 1
        if order_checks_enabled(comm):
            _agree(comm, _OPTIMIZER_STEP, taken[0], f"optimizer step {taken[0]}")

    return optimizer.register_step_post_hook(after_step)


def _agree(comm: Comm, kind: int, index: int, what: str, watch: bool = False) -> None:
    if same_everywhere(comm, [kind, index], f"the order check before {what}", watch):
        return
    names = comm.all_gather_object(what, what="the order check's error report")
    which = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
    raise ShardwiseError(
        f"ranks diverged ({which}). Every rank must run the same units and call "
        f"shardwise's collective operations (full_state_dict, gathered, "
        f"save_checkpoint, ...) in the same order")
