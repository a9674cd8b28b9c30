"""``SHARDWISE_CHECK=1``: ranks agree on every unit they run, or all of them raise.

See Note [collective order] in _state.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._comm import Comm
from .errors import ShardwiseError

if TYPE_CHECKING:
    from ._unit import Unit


class OrderCheck:
    """One root forward's checks: one per unit that communicates, one at its end."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self._checked = 0  # unit checks in the current root forward

    def start_forward(self) -> None:
        self._checked = 0

    def unit(self, unit: Unit) -> None:
        """Raise on every rank unless all ranks are about to run ``unit``.

        A unit pinned by ``gathered()`` (or holding no parameters) runs without
        communicating, so ranks may run it a different number of times (``generate``
        stopping at different lengths): it is not checked.
        """
        if unit.pins or not unit.groups:
            return
        self._checked += 1
        self._agree(1, unit.index, f"unit {unit.name}")

    def end_forward(self, calls: int) -> None:
        """Raise on every rank unless all ranks end the forward here. Catches a rank that
        skips the *last* unit, whose peers would otherwise wait in that unit's check."""
        if self._checked:
            self._checked = 0
            self._agree(2, calls, f"the end of the forward after {calls} unit calls")

    def _agree(self, kind: int, index: int, what: str) -> None:
        # Every check is the same 4-integer all-reduce, so mismatched checks still pair
        # up across ranks, and any difference shows in the maximum.
        mine = [kind, index, -kind, -index]
        seen = torch.tensor(mine, dtype=torch.int64, device=self.comm.device)
        self.comm.all_reduce(seen, op=torch.distributed.ReduceOp.MAX)
        if seen.tolist() != mine:
            names = self.comm.all_gather_object(what)
            which = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
            raise ShardwiseError(f"ranks diverged in the forward ({which}). Every rank must "
                                 f"run the same units in the same order")
