"""What each rank is doing, so that a rank stuck waiting learns why within seconds.

Note [peer watch]
A rank that runs a shardwise operation alone (``if rank == 0: evaluate(model)``, the
others already in ``dist.barrier()``) waits in a collective its peers never join; the
process group's timeout (10 minutes by default) would end it, saying nothing of the
peers. Instead, every rank keeps a note of what it is doing in shardwise (a model's
forward or backward, a public operation such as ``save_checkpoint``, or nothing since it
last finished one) and writes it into the process group's store when its kind changes:
twice per training step (into the model, out of it), one small ``set`` each, plus two
per public operation. Under NCCL, where the watch does not apply, and in a world of one,
nothing is written. (A thread publishing in the background would cost the main thread
nothing, but it would outlive ``destroy_process_group``: Note [teardown].)

A watched wait, under gloo, waits in slices of a second; once it has lasted a few seconds
it reads the peers' notes. Two kinds are watched: the order check's headers (Note
[checks ride the exchanges] in comm/channel.py), which are point-to-point messages that cannot
be waited for in slices (a gloo point-to-point wait that times out breaks the group), so a
header not there within a few milliseconds is waited for on a helper thread while this
thread watches; and the collectives of public operations (their order check under other
backends, their metadata all-gathers), waited in slices (gloo's collectives survive a
wait that times out; what a sliced wait costs more than a plain one is in BENCHMARKS.md,
"Peer watch", from ``benchmarks/peer_watch.py``). Every unit's data waits only once its
header matched, so it never waits for a peer that is elsewhere. A rank alone elsewhere in
a backward (whose exchanges carry no header), or any wait with ``SHARDWISE_CHECK=0``, ends
at the process group's timeout, as before.

A peer that is not in a shardwise operation, or in a different one, and whose note has
not changed for ``SHARDWISE_PEER_TIMEOUT`` seconds (default 30; 0 turns the watch off)
makes the waiting rank raise a ``CollectiveError`` that says what every rank is doing. A
peer busy in the same kind of operation (a slow rank still computing its forward) is
waited for, as long as the process group's timeout allows. Under NCCL, waits do not
block the host, so the watch does not apply; the NCCL watchdog ends a hang there.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._env import peer_timeout
from ..errors import CollectiveError

_KEY = "shardwise/activity/{}"
_LOOK_AFTER = 2.0      # seconds a wait lasts before the peers' notes are read
_SLICE = 1.0  # seconds


class Activity:
    """This process's note of what it is doing in shardwise."""

    def __init__(self) -> None:
        self.kind: str | None = None   # "model" or an operation's name; None: nothing
        self.doing = ""                # e.g. "the backward of step 12"
        self.last = "nothing yet"      # the last thing it finished
        self.version = 0

    def enter(self, kind: str, doing: str) -> None:
        changed = kind != self.kind
        self.kind, self.doing = kind, doing
        self.version += 1
        if changed:
            _publish(self)

    def leave(self, finished: str) -> None:
        changed = self.kind is not None
        self.kind, self.doing, self.last = None, "", finished
        self.version += 1
        if changed:
            _publish(self)

    @contextmanager
    def operation(self, name: str) -> Iterator[None]:
        """Note a public operation for its duration (restoring what was noted before:
        ``full_state_dict`` inside a training step leaves the step noted)."""
        before = (self.kind, self.doing)
        self.enter(name, name)
        try:
            yield
        finally:
            if before[0] is None:
                self.leave(name)
            else:
                self.enter(before[0], before[1])

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "doing": self.doing, "last": self.last,
                "version": self.version}


ACTIVITY = Activity()
_publishing = False  # set once a gloo group of several ranks exists (enable_publishing)


def enable_publishing() -> None:
    """Start writing the note into the store (a gloo group of several ranks exists)."""
    global _publishing
    if not _publishing:
        _publishing = True
        _publish(ACTIVITY)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def _publish(activity: Activity) -> None:
    if not _publishing or not dist.is_initialized() or peer_timeout() == 0:
        return
    store = _store()
    if store is None:
        return
    try:
        store.set(_KEY.format(dist.get_rank()), json.dumps(activity.describe()))
    except Exception:  # noqa: BLE001 - a note that cannot be written only weakens the watch
        pass


def wait_watched(wait_slice: Callable[[float | None], bool], comm: Any, what: str) -> None:
    """Wait, raising early when the peers are elsewhere (Note [peer watch]).

    ``wait_slice(seconds)`` waits up to ``seconds`` (``None``: until done) and says
    whether the wait is over."""
    limit = peer_timeout()
    if limit == 0 or comm.world_size == 1 or "gloo" not in comm.backend:
        wait_slice(None)
        return
    start = time.monotonic()
    seen: dict[int, tuple[str, float]] = {}
    while not wait_slice(_SLICE):
        now = time.monotonic()
        if now - start >= _LOOK_AFTER:
            _look(comm, what, now, start, seen, limit)


def sliced(work: Any) -> Callable[[float | None], bool]:
    """``wait_watched``'s slices of a collective's ``work`` (gloo's collectives survive
    a wait that times out)."""
    def wait_slice(seconds: float | None) -> bool:
        if seconds is None:
            work.wait()
            return True
        try:
            work.wait(timedelta(seconds=seconds))
            return True
        except RuntimeError as err:
            if "Operation timed out" not in str(err):  # a real failure: a peer died
                raise
            return False
    return wait_slice


def _look(comm: Any, what: str, now: float, start: float,
          seen: dict[int, tuple[str, float]], limit: float) -> None:
    """Raise if a peer has been elsewhere, unchanged, for ``limit`` seconds."""
    store = _store()
    if store is None:
        return
    mine = ACTIVITY.kind
    notes: dict[int, dict] = {}
    elsewhere = []
    for r in range(comm.world_size):
        g = comm.global_rank(r)
        key = _KEY.format(g)
        try:
            if g == dist.get_rank() or not store.check([key]):
                continue
            raw = store.get(key).decode()
        except Exception:  # noqa: BLE001 - no note to read: nothing to conclude
            continue
        note = json.loads(raw)
        notes[r] = note
        first = seen.setdefault(r, (raw, now))
        if first[0] != raw:
            seen[r] = (raw, now)
            continue
        if note["kind"] != mine and now - first[1] >= limit:
            elsewhere.append(r)
    if elsewhere:
        lines = [f"rank {r} " + _say(n) for r, n in sorted(notes.items())]
        raise CollectiveError(
            f"rank {comm.rank}: waited {now - start:.0f} s in {what}, which its peers "
            f"are not in. " + "; ".join(lines) + ". Every rank must run the model's "
            f"forward and backward and shardwise's collective operations together. To "
            f"evaluate on one rank, gather the parameters on every rank first "
            f"(`with sw.gathered(model): ...` on every rank, then evaluate on one) or "
            f"evaluate a consolidated copy (docs/troubleshooting.md). If a rank is busy "
            f"elsewhere on purpose (evaluating alone), have the others wait for it in "
            f"dist.barrier(), or raise SHARDWISE_PEER_TIMEOUT (now {limit:g} s; 0 turns "
            f"this check off). The process group cannot be used after this error")


def _say(note: dict) -> str:
    if note["kind"] is None:
        return f"is not in a shardwise operation; it last finished {note['last']}"
    return f"is in {note['doing']}"
