"""Background saves: the ``SaveHandle`` of ``save_checkpoint(..., background=True)``, the one
save a process has in flight, and the side process group its thread talks over.

Note [background saves]
``save_checkpoint(..., background=True)`` does synchronously everything that reads the
model or may refuse the call, and leaves the rest to a thread:

- *In the call* (the training's process group, every rank): the order check, the buffer
  check, the agreed preparation, which now also copies every tensor this rank writes
  into host memory of the save's own (the staging: Note [streamed save] says why the
  synchronous save needs no copy; training changes the shards and optimizer state in
  place right after this call returns, so here a copy it must be, CPU tensors included),
  the metadata that does not depend on the files, the path agreement, rank 0's lock and
  the new data folder (steps ``begin`` to ``data-folder`` of Note [save protocol]). So a
  bad ``extra``, diverged buffers, a path that is a file or another job's folder, a call
  inside the forward, all raise from the call itself, on every rank, as they do from a
  synchronous save, and the lock is held before it returns.
- *In the thread* (steps ``data-tmp`` to ``tidied``): each rank's data file from the
  staged copies, the agreements, the reports, rank 0's commit and tidying, in the same
  order, with the same crash points, so a kill at any moment leaves the previous or the
  new checkpoint whole (tests/test_background_save.py stops a rank at those steps). The
  thread reads nothing of the model or the optimizer.

**Side group, not the store, not the training's group.** The thread's agreements are
collectives; on the training's process group they would interleave with the training's
all-gathers and reduce-scatters in an order no rank controls, and the collective-order
check (comm/order_check.py) and the peer watch would see them as divergence. Through the
store, every agreement would be a poll, and a peer that died would be noticed only at a
timeout. So the thread talks over a gloo group of its own, over the same ranks, made the
first time these ranks save in the background, from the main thread, inside the call,
where every rank is (``dist.new_group`` needs them all): a dead peer closes its
connections and the survivors' thread fails at once. Its collectives are plain
``torch.distributed`` ones, without the order check's channel or the peer watch (whose
notes say what the *main* threads do: training, which would look like divergence). It is
kept by ranks, not by model (one save is in flight per process, below, so one group per
set of ranks is all it needs), and held weakly: ``destroy_process_group`` frees it with
the others (Note [teardown] in comm/process_group.py). Its timeout is the training
group's.

**One in flight per process.** The staged copy is one checkpoint's worth of this rank's
state in host memory; two saves in flight would hold two. A save or load (any folder, any
model) first waits for the previous background save. If that save failed and no
``wait()`` took its error, the later call raises it, on every rank (inside the call's
first agreement, so no collective is added), and does nothing else: a lost checkpoint is
never silent. The staging is refused up front when the copy would not fit in the memory
the OS says is available (``MemAvailable``), on every rank, naming the sizes. The copy
goes into memory allocated for it and freed when the write ends: a buffer kept between
saves would copy a little faster (no page faults) but hold a checkpoint's worth of
memory for the life of the process (BENCHMARKS.md, "Background checkpoints"). The
thread computes what a synchronous save computes (each file's SHA-256, the copies into
the page cache); where no core is spare, it takes that CPU time from training.

**Exit with a save in flight.** The thread is not a daemon: the interpreter waits for it
when the program ends (Python joins such threads before ``atexit`` functions), so a
script whose last line started a background save still commits it; then an ``atexit``
function logs a failure nobody took with ``wait()``. A process that is killed, or ends
with ``os._exit``, stops the thread wherever it is, which the protocol makes safe: the
previous checkpoint stays. ``dist.destroy_process_group()`` destroys the side group too,
so call ``wait()`` before it (``Resumable`` waits when it closes).
"""

from __future__ import annotations

import atexit
import datetime
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._log import logger
from ..comm.collectives import Comm
from ..errors import ShardwiseError


class SaveHandle:
    """A checkpoint being written in the background, returned by
    ``sw.save_checkpoint(..., background=True)`` once this rank's state is staged in host
    memory (Note [background saves] in checkpoint/background.py).

    Attributes:
        path: the checkpoint folder.

    Example:
        >>> handle = sw.save_checkpoint("ckpt", model, opt, background=True)
        >>> train_some_more()             # the model may change: the save has its copy
        >>> handle.wait()                 # committed (or raises, on every rank)
    """

    def __init__(self, path: str, rank: int, ranks: tuple[int, ...]) -> None:
        self.path = path
        self._rank = rank
        self._ranks = ranks  # the global ranks of the group that saved
        self._error: BaseException | None = None
        self._taken = False  # a wait() raised the error (or saw none)
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the write has ended, committed or failed. Local: no collective, no
        wait."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Return once the checkpoint is committed (at once if it already is).

        Raises:
            ShardwiseError: the write failed: on every rank when the failure was agreed
                (a full or read-only disk on some rank, naming it and the cause), or on
                the ranks whose peer died during the write (the previous checkpoint is
                then what the folder holds).
        """
        if self._thread is not None:
            self._thread.join()
        self._taken = True
        if self._error is not None:
            raise self._error

    def __repr__(self) -> str:
        state = ("writing" if not self.done() else
                 "failed" if self._error is not None else "committed")
        return f"SaveHandle({self.path!r}, {state})"

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except ShardwiseError as e:
            self._error = e
        except BaseException as e:  # noqa: BLE001 - wait() raises it, on the caller's thread
            error = ShardwiseError(
                f"save_checkpoint({self.path!r}) in the background failed on rank "
                f"{self._rank}: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._error = error


class SideComm:
    """The background thread's collectives: plain gloo ones, on a group of their own
    (Note [background saves]); what ``agreed`` and the save protocol need of a ``Comm``."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_gather_object(self, obj: Any, what: str = "an exchange of metadata") -> list[Any]:
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ValueError) as err:
            raise ShardwiseError(
                f"rank {self.rank}: {what} between the ranks' background save threads "
                f"failed ({err}): another rank's process ended or was killed during "
                f"the save, or its process group was destroyed (call wait() on the "
                f"handle before dist.destroy_process_group()); the folder holds the "
                f"previous checkpoint, or the new one if it was committed") from err
        return out


_lock = threading.Lock()
_in_flight: SaveHandle | None = None
_side_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_atexit_registered = False


def _ranks_of(comm: Comm | None) -> tuple[int, ...]:
    if comm is None or not dist.is_initialized():
        return (0,)
    group = comm.group if comm.group is not None else dist.group.WORLD
    return tuple(dist.get_process_group_ranks(group))


def _registered(group: dist.ProcessGroup) -> bool:
    world = getattr(dist.distributed_c10d, "_world", None)
    return group in (getattr(world, "pg_map", None) or {})


def _timeout_of(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The gloo timeout ``group`` was made with (None: unknown, torch's default)."""
    try:
        pg = group if group is not None else dist.group.WORLD
        return pg._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
    except (AttributeError, RuntimeError, ValueError):
        return None


def side_comm(comm: Comm | None) -> SideComm | None:
    """The side group over ``comm``'s ranks, made now if these ranks have none (every rank
    of ``comm`` calls this, from the main thread: it is collective the first time).
    None in a world of one."""
    if comm is None or comm.world_size == 1:
        return None
    ranks = _ranks_of(comm)
    group = _side_groups.get(ranks)
    if group is None or not _registered(group):
        whole = len(ranks) == dist.get_world_size()
        group = dist.new_group(list(ranks), backend="gloo", timeout=_timeout_of(comm.group),
                               use_local_synchronization=not whole)
        _side_groups[ranks] = group
    return SideComm(group, comm.rank, comm.world_size)


def start(path: str, comm: Comm | None, write: Callable[[], None]) -> SaveHandle:
    """Run ``write`` (the rest of the save) on a thread; its handle, now this process's
    save in flight."""
    global _in_flight, _atexit_registered
    handle = SaveHandle(path, comm.rank if comm is not None else 0, _ranks_of(comm))
    thread = threading.Thread(target=handle._run, args=(write,), name="shardwise-save",
                              daemon=False)  # the interpreter waits for it at exit
    handle._thread = thread
    with _lock:
        _in_flight = handle
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_report_at_exit)
    thread.start()
    return handle


def finish_previous(comm: Comm | None) -> str | None:
    """Before a save or load: wait for this process's background save in flight, if any.
    Returns its error if no ``wait()`` took it, which the caller raises inside its first
    agreement, so that every rank raises it (Note [background saves]); None otherwise."""
    global _in_flight
    with _lock:
        handle, _in_flight = _in_flight, None
    if handle is None:
        return None
    if handle._thread is not None:
        handle._thread.join()
    error = None if handle._taken else handle._error
    handle._taken = True
    if error is None:
        return None
    if handle._ranks != _ranks_of(comm):  # another group saved it: its ranks differ
        logger.error("the background save into %s failed: %s", handle.path, error)
        return None
    return (f"the background save into {handle.path!r} failed and no wait() took its "
            f"error, so this call did nothing; call it again to go on. The error: {error}")


def in_flight() -> SaveHandle | None:
    """This process's background save, if one is still referenced (finished or not)."""
    return _in_flight


def _report_at_exit() -> None:
    """At exit (the thread has been joined by then): a failure nobody took is logged."""
    handle = _in_flight
    if handle is None or handle._taken:
        return
    if handle._thread is not None and handle._thread.is_alive():
        handle._thread.join()
    if handle._error is not None:
        logger.error("shardwise: the background save into %s failed, and no wait() took "
                     "its error: %s", handle.path, handle._error)
