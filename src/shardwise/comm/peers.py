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

What the waiting rank concludes from the notes, and when:
- a peer whose process is gone (its note names its host and pid; on this host the pid is
  checked) raises a ``CollectiveError`` at once;
- a peer in a different shardwise operation, its note unchanged for
  ``SHARDWISE_PEER_TIMEOUT`` seconds (default 30; 0 turns the watch off), raises: the
  ranks diverged (the collective given up on stays pending, and must not hold the
  process at its exit: Note [abandoned waits] in comm/process_group.py);
- a peer outside shardwise for that long cannot be told apart: it may be working on its
  own (writing a sample, evaluating a consolidated copy, a slow data loader), which DDP
  waits for and which must never kill the job, or waiting in a collective of its own
  (``dist.barrier()``), which no note shows. So the waiting rank warns, naming what each
  rank does and what to do (first the likeliest cause, a rank whose data ran out, and its
  fixes), repeats a short warning every ``SHARDWISE_PEER_TIMEOUT`` seconds, and goes on
  waiting; if the process group's timeout ends the wait, the error carries
  the same text;
- a peer busy in the same kind of operation (a slow rank still computing its forward) is
  waited for, as long as the process group's timeout allows.

``ShardwiseTrainer`` never met the old rule (raise after ``SHARDWISE_PEER_TIMEOUT`` of a
peer outside shardwise) when a rank stalled between steps: transformers' ``Trainer``
begins each step with a torch all-gather of the token count
(``average_tokens_across_devices``), so its ranks meet in a torch collective, which waits
like DDP, before they enter shardwise's forward. A plain loop's first collective is the
forward's own; it now waits too. Under NCCL, waits do not
block the host, so the watch does not apply; the NCCL watchdog ends a hang there.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._env import peer_timeout
from ..errors import CollectiveError
from .process_group import keep_groups_at_exit

_KEY = "shardwise/activity/{}"
_LOOK_AFTER = 2.0      # seconds a wait lasts before the peers' notes are read
_SLICE = 1.0  # seconds
_HOST = socket.gethostname()


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
                "version": self.version, "host": _HOST, "pid": os.getpid()}


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


def wait_watched(wait_slice: Callable[[float | None], bool], comm: Any, what: str
                 ) -> str | None:
    """Wait, raising early when the peers are elsewhere in shardwise or dead, and warning
    when they are outside shardwise (Note [peer watch]).

    ``wait_slice(seconds)`` waits up to ``seconds`` (``None``: until done) and says
    whether the wait is over. Returns the last warning given (``None``: none), for a
    caller whose wait ends in an error of its own (the process group's timeout) to repeat
    it; a wait of :func:`sliced` that fails after a warning raises it here."""
    limit = peer_timeout()
    if limit == 0 or comm.world_size == 1 or "gloo" not in comm.backend:
        wait_slice(None)
        return None
    watch = _Watch(comm, what, limit)
    try:
        while not wait_slice(_SLICE):
            now = time.monotonic()
            if now - watch.start >= _LOOK_AFTER:
                try:
                    watch.look(now)
                except BaseException:
                    # The wait is given up on, its collective still pending: Note
                    # [abandoned waits] in comm/process_group.py.
                    keep_groups_at_exit()
                    raise
    except RuntimeError as err:
        if watch.warning is None:
            raise
        raise CollectiveError(f"{watch.warning}. The wait then ended: {err}") from err
    except KeyboardInterrupt:
        keep_groups_at_exit()  # Ctrl-C leaves the collective pending too
        raise
    return watch.warning


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


class _Watch:
    """One watched wait: what each peer's note said since when, and the warnings given."""

    def __init__(self, comm: Any, what: str, limit: float) -> None:
        self.comm, self.what, self.limit = comm, what, limit
        self.start = time.monotonic()
        self.seen: dict[int, tuple[str, float]] = {}
        self.warning: str | None = None
        self._warned_at = -math.inf

    def look(self, now: float) -> None:
        """Raise if a peer is dead, or has been in another shardwise operation for
        ``limit`` seconds; warn (every ``limit`` seconds) if one has been outside shardwise
        that long: it may be working on its own (writing a sample, evaluating a copy, a
        slow data loader), which must not kill the job, or waiting in a collective of its
        own (``dist.barrier()``), which this rank cannot see."""
        store = _store()
        if store is None:
            return
        notes, dead, elsewhere, outside = self._read(store, now)
        if not (dead or elsewhere or outside):
            return
        waited = f"rank {self.comm.rank}: waited {now - self.start:.0f} s in {self.what}"
        lines = "; ".join(f"rank {r} " + _say(n) for r, n in sorted(notes.items()))
        if dead:
            raise CollectiveError(
                f"{waited}, but rank(s) {dead} exited (their processes are gone). {lines}. "
                f"{LEFT_EARLY}")
        if elsewhere:
            raise CollectiveError(
                f"{waited}, which its peers are not in: {lines}. Every rank must run "
                f"the model's forward and backward and shardwise's collective operations "
                f"together, in the same order. The process group cannot be used after "
                f"this error: let it end the program (dist.destroy_process_group() would "
                f"wait for the abandoned collective until the process group's timeout)")
        if now - self._warned_at < self.limit:
            return
        self._warned_at = now
        if self.warning is not None:
            # Every later warning is short: the first one said the cause and the fixes.
            warnings.warn(f"shardwise: {waited}; still waiting for rank(s) {outside}: "
                          f"{lines} (the first warning of this wait says why)",
                          RuntimeWarning, stacklevel=2)
            return
        # The first warning leads with the likeliest cause, a rank whose data ran out
        # (uneven data: it left the loop and waits in dist.barrier() or the end of the
        # script), and its fixes, before the other cause and the rule of patience.
        self.warning = (
            f"{waited}, which rank(s) {outside} are not in: {lines}. Likely cause: the "
            f"ranks ran different numbers of batches and rank(s) {outside} ran out of "
            f"data first (they wait in dist.barrier() or at the end of the script, and "
            f"the ranks are stuck). Fix: give every rank the same number of batches: cut "
            f"one global batch per step with sw.micro_batches(batch, M), or use "
            f"drop_last=True in the DataLoader, or DistributedSampler, whose padding "
            f"gives every rank the same count. The other likely cause: one rank runs the "
            f"model alone (`if rank == 0: evaluate(model)` while the others wait in "
            f"dist.barrier()): gather on every rank first (`with sw.gathered(model):` on "
            f"every rank, then evaluate on one) or evaluate a consolidated copy "
            f"(docs/troubleshooting.md). If the rank is busy on purpose (writing a "
            f"sample, a slow data loader), this rank waits for it, as DDP would; if it "
            f"is stuck, this wait ends at the process group's timeout "
            f"(sw.init_distributed(timeout=...)). SHARDWISE_PEER_TIMEOUT (now "
            f"{self.limit:g} s) sets how long a peer may be away before this warning")
        warnings.warn(f"shardwise: {self.warning}", RuntimeWarning, stacklevel=2)

    def _read(self, store: Any, now: float
              ) -> tuple[dict[int, dict], list[int], list[int], list[int]]:
        """Every peer's note, and the peers dead, in another shardwise operation for
        ``limit`` seconds, and outside shardwise for ``limit`` seconds."""
        mine = ACTIVITY.kind
        notes: dict[int, dict] = {}
        dead: list[int] = []
        elsewhere: list[int] = []
        outside: list[int] = []
        for r, (raw, note) in _notes(self.comm, store).items():
            notes[r] = note
            if _gone(note):
                dead.append(r)
                continue
            first = self.seen.setdefault(r, (raw, now))
            if first[0] != raw:
                self.seen[r] = (raw, now)
                continue
            if note["kind"] != mine and now - first[1] >= self.limit:
                (outside if note["kind"] is None else elsewhere).append(r)
        return notes, dead, elsewhere, outside


def _notes(comm: Any, store: Any) -> dict[int, tuple[str, dict]]:
    """Each peer's note, as written and as read, by its rank in ``comm``."""
    out: dict[int, tuple[str, dict]] = {}
    for r in range(comm.world_size):
        g = comm.global_rank(r)
        key = _KEY.format(g)
        try:
            if g == dist.get_rank() or not store.check([key]):
                continue
            raw = store.get(key).decode()
            out[r] = raw, json.loads(raw)
        except Exception:  # noqa: BLE001 - no note to read: nothing to conclude
            continue
    return out


# What to do about a rank that left, in every error that names one (docs/parameters.md
# promises the rank and the fix for uneven data).
LEFT_EARLY = (
    "A rank that stops early leaves its peers waiting. If its data ran out first (the "
    "ranks ran different numbers of batches), give every rank the same number of "
    "batches: cut one global batch per step with sw.micro_batches(batch, M), or use "
    "drop_last=True in the DataLoader, or DistributedSampler, whose padding gives every "
    "rank the same count. If it failed, look for that rank's own error")


def departed(comm: Any, patience: float = 0.0) -> tuple[list[int], str]:
    """The ranks of ``comm`` whose processes are known to have exited, and what every
    peer's note says; waits up to ``patience`` seconds for one to be (a connection is
    closed a moment before the process that closed it is gone). ``([], "")`` when no
    note can be read: a world of one, NCCL, the watch off, or peers on other hosts whose
    notes are no evidence (Note [peer watch])."""
    store = _store() if _publishing and dist.is_initialized() else None
    if store is None or comm.world_size == 1:
        return [], ""
    end = time.monotonic() + patience
    while True:
        notes = {r: note for r, (_, note) in _notes(comm, store).items()}
        gone = [r for r, note in sorted(notes.items()) if _gone(note)]
        if gone or time.monotonic() >= end or not any(n.get("host") == _HOST
                                                      for n in notes.values()):
            break
        time.sleep(0.05)
    return gone, "; ".join(f"rank {r} " + _say(n) for r, n in sorted(notes.items()))


def _gone(note: dict) -> bool:
    """Whether the note's process is known to have exited: on this host, no process of
    its pid, or one that has exited and waits for its parent to reap it (a zombie: a
    rank of a launcher that has not looked yet). Elsewhere there is no such evidence;
    gloo's broken connections tell."""
    if note.get("host") != _HOST or not isinstance(note.get("pid"), int):
        return False
    try:
        os.kill(note["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # it exists, as another user's process
    try:
        with open(f"/proc/{note['pid']}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False  # not Linux, or it went between the two looks: the next look tells
    return state in ("Z", "X")


def _say(note: dict) -> str:
    if note["kind"] is None:
        return f"is not in a shardwise operation; it last finished {note['last']}"
    return f"is in {note['doing']}"
