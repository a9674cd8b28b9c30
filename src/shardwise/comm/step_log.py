"""Each step's communication in the log (``SHARDWISE_LOG=info``), over every group it used.

After each backward the model logs, per group it communicates over and per kind of
collective, the bytes fed in and the calls made since the last log, and the order check's
headers (Note [checks ride the exchanges] in comm/channel.py) sent meanwhile.
"""

from __future__ import annotations

import logging

from .._log import logger
from .collectives import Comm
from .mesh import Topology


def comm_groups(topology: Topology, regather: Comm | None) -> list[tuple[str, Comm]]:
    """Every group a model communicates over, each once, labelled for a log: the model's
    group (hybrid: the shard group and, as "world", every rank), "across replicas" (Note
    [hybrid sharding]) and "within groups of k" (``regather``, Note [secondary
    shards])."""
    out = [("", topology.shard)]
    if topology.world is not topology.shard:
        out.append(("world", topology.world))
    if topology.replicate is not None and topology.replicate is not topology.world:
        out.append(("across replicas", topology.replicate))
    if regather is not None:
        out.append(("within groups of k", regather))
    return out


class StepLog:
    """One model's step log: what its groups' counters held at the last line."""

    def __init__(self, topology: Topology, regather: Comm | None) -> None:
        self.topology = topology
        self.regather = regather  # the group of k ranks the model's backward may gather in
        self._logged: dict[str, tuple[int, int]] = {}  # counters at the last line
        self._headers = topology.world.channel.headers  # the order check's, then

    def step_ended(self) -> None:
        """Log the communication since the last step (bytes fed into each kind of
        collective, calls made)."""
        if not logger.isEnabledFor(logging.INFO):
            return
        now = {}
        for label, comm in comm_groups(self.topology, self.regather):
            stats = comm.stats
            prefix = f"{label} " if label else ""
            now.update({prefix + k: (stats.bytes[k], stats.calls[k]) for k in stats.bytes})
        last = self._logged
        parts = [f"{k} {(b - last.get(k, (0, 0))[0]) / 2**20:.1f} MiB in "
                 f"{c - last.get(k, (0, 0))[1]} calls" for k, (b, c) in sorted(now.items())
                 if c != last.get(k, (0, 0))[1]]
        self._logged = now
        channel = self.topology.world.channel  # Note [checks ride the exchanges]
        if channel.headers != self._headers:
            parts.append(f"order-check headers {channel.headers - self._headers}")
            self._headers = channel.headers
        logger.info("step communication: %s", ", ".join(parts))
