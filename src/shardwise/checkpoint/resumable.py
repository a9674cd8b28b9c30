"""``Resumable``: a training loop that survives restarts, at whatever world size it gets.

Note [resumable runs]
A run folder holds one checkpoint folder per saved step (``step-00000040``), each written
by :func:`save_checkpoint` and therefore complete or absent (Note [atomic save]). On start
every rank takes rank 0's list of the step folders that hold a ``checkpoint.json`` and
loads the newest that loads; one that fails its checks is skipped with a warning, never
half-read, because a failed load changes nothing. The world size may differ from the
one that saved: parameters and optimizer state reshard, and in the reproducible mode the
next steps give the same bits as an uninterrupted run (docs/long-runs.md).

What a checkpoint cannot reshard is a random stream per rank. ``load_checkpoint`` restores
each rank's RNG states at the same world size; at another one every rank takes rank 0's
saved states when every rank had the same states at the save (all ranks seeded alike, the
common case) and is warned otherwise, since per-rank streams have no meaning at another
size. Data order is the loop's: the step (and the epoch and the offset in it) say which
global batch comes next, and ``sw.micro_batches`` cuts it for this world size, so the
global batch never depends on the number of ranks.

Rank 0 holds the run folder's lock for the life of the object, so a second job pointed at
the same folder is refused by name before it loads or writes anything (Note [one
writer]). A failure inside ``with run:`` is written to ``failures/`` in the folder and
carries a note naming the step reached and the last checkpoint; the next attempt reports
it, and says so when attempts keep failing without getting past a checkpoint.

Saves run in the background by default (Note [background saves] in background.py): a
save returns once the state is staged, and the loop trains on while a thread writes.
One is in flight at a time: the next save, and ``close()`` (the end of ``with run:``),
wait for it first, and the older checkpoints are pruned only once it is committed (a
step folder being written has no ``checkpoint.json`` yet, and pruning would take it for
the debris of a lost timeline). A kill while it is in flight leaves the previous
checkpoint, from which the next attempt resumes, as after a kill during a synchronous
save. ``background=False`` saves in the loop's time instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch
import torch.nn as nn

from .._args import require_bool, require_module, require_optimizer
from .._fs import kind, open_dir
from .._log import logger
from ..comm.agree import agreed
from ..errors import ShardwiseError
from ._files import read_json, write_json_atomic
from ._format import has_metadata, remove_checkpoint
from ._lock import FolderLock
from ._paths import path_argument
from ._rng import portable_rng, restore_portable_rng
from ._targets import comm_of
from ._tensor_parallel import checkpoint_comm
from .background import SaveHandle
from .load import load_checkpoint
from .save import save_checkpoint

_STEP = re.compile(r"^step-(\d{8,})$")
_KEY = "shardwise.resumable"
_FAILURES = "failures"
_HISTORY = "failures.json"


class Resumable:
    """A training loop's position, saved every ``every`` steps and found again on restart.

    On construction it loads the newest complete checkpoint in ``folder`` (any world size;
    Note [resumable runs]), or starts at step 0 when there is none. ``steps(total)`` then
    yields the step numbers still to run and saves after every ``every``-th step and
    after the last, keeping the newest ``keep`` checkpoints. Called by every rank.

    Args:
        folder: the run folder (created if needed); one job at a time may use it.
        model: the model, sharded or not.
        optimizer: optional optimizer over ``model.parameters()``.
        every: save after each step number that is a multiple of it (a positive int).
        keep: how many checkpoints to keep (at least 1; default 2).
        scheduler: optional LR scheduler, saved and restored with the step (its
            ``state_dict()`` must be JSON: plain schedulers' are).
        micro_batches: the reproducible mode's count M of micro-batches per global batch:
            a world size that does not divide it is refused before anything loads.
        steps_per_epoch: global batches per epoch, for :attr:`epoch` and
            :attr:`step_in_epoch`.
        background: save in the background (default): the loop stops for the staging
            copy only, and one save is in flight at a time (Note [resumable runs]).
            False: every save is written before the loop goes on.

    Attributes:
        step: the next step to run (0 on a fresh start).
        state: a JSON dict saved with every checkpoint and restored (a data loader's
            position, counters): yours to fill.
        resumed_from: the checkpoint folder loaded, or None.

    Raises:
        ShardwiseError: on every rank, for a bad argument, a world size that does not
            divide ``micro_batches`` (naming the sizes that do), a folder another job
            holds, or a scheduler state that is not JSON.

    Example:
        >>> with sw.Resumable("runs/gpt", model, opt, every=50) as run:
        ...     for step in run.steps(1000):
        ...         x, y = batch(step)            # the global batch of this step
        ...         loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, folder: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, *, every: int,
                 keep: int = 2, scheduler: Any = None, micro_batches: int | None = None,
                 steps_per_epoch: int | None = None, background: bool = True) -> None:
        self.folder = path_argument(folder, "Resumable")
        require_module(model, "Resumable", "model")
        require_bool(background, "Resumable", "background")
        self.background = background
        self._pending: tuple[SaveHandle, int, float, float] | None = None
        self._saved = 0  # the step of the last background save waited for
        if optimizer is not None:
            require_optimizer(optimizer, "Resumable")
        for name, value, optional in (("every", every, False), ("keep", keep, False),
                                      ("micro_batches", micro_batches, True),
                                      ("steps_per_epoch", steps_per_epoch, True)):
            if value is None and optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ShardwiseError(f"Resumable: {name} must be an int of at least 1, "
                                     f"not {value!r}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.every, self.keep, self.steps_per_epoch = every, keep, steps_per_epoch
        # A tensor-parallel model's checkpoints span its dp and tp ranks, one rank 0 among
        # them (Note [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
        self._comm = checkpoint_comm(model, comm_of(model))
        self.rank, self.world = ((self._comm.rank, self._comm.world_size)
                                 if self._comm is not None else (0, 1))
        if micro_batches is not None and micro_batches % self.world:
            sizes = [n for n in range(1, micro_batches + 1) if micro_batches % n == 0]
            raise ShardwiseError(
                f"Resumable: the world size {self.world} does not divide micro_batches="
                f"{micro_batches}, so the reproducible mode cannot give the bits of the "
                f"saved run at this size; world sizes that do: {sizes}. Nothing was loaded")
        if scheduler is not None:
            _json_state(scheduler)
        self.step = 0
        self.state: dict[str, Any] = {}
        self.resumed_from: str | None = None
        self._lock: FolderLock | None = None
        self._unloadable: set[int] = set()  # steps skipped at start: removed at a save
        self._take_folder()
        try:
            self._resume()
        except BaseException:
            self.close()
            raise

    # -- the loop -----------------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield the step numbers ``self.step, ..., total - 1``, saving after every
        ``every``-th step and after the last one.

        Raises:
            ShardwiseError: ``total`` is not a non-negative int; on every rank, when the
                ranks' ``total``, ``every`` or ``keep`` differ (naming each rank's).
        """
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ShardwiseError(f"Resumable.steps: total must be an int >= 0, not {total!r}")
        # Ranks whose loops differ (steps(5) against steps(8), every=2 against every=3)
        # would part at the first save only one of them makes, and only the peer watch
        # would name them, after SHARDWISE_PEER_TIMEOUT. One small all-gather, once per
        # loop, names them at once, on every rank.
        loops = self._everyone((total, self.every, self.keep))
        if len(set(loops)) > 1:
            said = "; ".join(f"rank {r}: steps({t}) with every={e}, keep={k}"
                             for r, (t, e, k) in enumerate(loops))
            raise ShardwiseError(
                f"Resumable.steps: the ranks run different loops ({said}). Saves are "
                f"collective, so every rank must pass the same total to steps() and the "
                f"same every= and keep= to Resumable; compute them from values every rank "
                f"shares (not from a rank's own data length)")
        while self.step < total:
            yield self.step
            self.step += 1
            if self.step % self.every == 0 or self.step == total:
                self.save()

    @property
    def epoch(self) -> int:
        """The epoch of the next step (needs ``steps_per_epoch``)."""
        return self.step // self._per_epoch()

    @property
    def step_in_epoch(self) -> int:
        """The next step's offset in its epoch, in global batches (needs
        ``steps_per_epoch``)."""
        return self.step % self._per_epoch()

    def save(self) -> None:
        """Save now as ``step-<step>`` and remove checkpoints beyond the newest ``keep``.
        In the background (the default), this waits for the previous save, stages the
        state and returns; the pruning follows once the save is committed (at the next
        save, :meth:`wait` or :meth:`close`).

        Raises:
            ShardwiseError: as :func:`save_checkpoint`; the previous background save
                failed (on every rank).
        """
        self.wait()
        extra = {_KEY: {"step": self.step, "world_size": self.world,
                        "scheduler": (_json_state(self.scheduler)
                                      if self.scheduler is not None else None),
                        "rng": self._rng()},
                 "state": self.state}
        started = time.monotonic()
        handle = save_checkpoint(self._path(self.step), self.model, self.optimizer,
                                 extra=extra, keep_previous=False,
                                 background=self.background)
        if handle is not None:
            self._pending = (handle, self.step, started, time.monotonic() - started)
            return
        logger.info("Resumable: saved step %d in %.2f s", self.step,
                    time.monotonic() - started)
        step = self.step
        agreed(self._comm, "Resumable: removing old checkpoints", lambda: self._prune(step))

    def wait(self) -> None:
        """Wait for the background save in flight, if any, then remove checkpoints beyond
        the newest ``keep``. Called by every rank (the pruning's errors are agreed).

        Raises:
            ShardwiseError: the save failed (on every rank; the folder keeps the
                previous checkpoints).
        """
        if self._settle():
            step = self._saved
            agreed(self._comm, "Resumable: removing old checkpoints",
                   lambda: self._prune(step))

    def close(self) -> None:
        """Wait for the background save in flight and prune (as :meth:`wait`: every rank
        calls it), then release the run folder (also done by ``with``; the OS releases
        it at exit). A ``with`` block left by an exception waits and prunes without any
        collective instead, since the other ranks may be elsewhere.

        Raises:
            ShardwiseError: the background save in flight failed (the folder is released
                all the same).
        """
        try:
            self.wait()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def _finish_in_flight(self) -> None:
        """:meth:`wait` without a collective: rank 0 prunes on its own."""
        if self._settle():
            with contextlib.suppress(OSError):
                self._prune(self._saved)

    def _settle(self) -> bool:
        """Wait for the save in flight; whether there was one (and it committed)."""
        if self._pending is None:
            return False
        (handle, step, started, stalled), self._pending = self._pending, None
        handle.wait()
        self._saved = step
        logger.info("Resumable: saved step %d in the background (committed %.2f s after "
                    "the call, which held the loop %.3f s)", step,
                    time.monotonic() - started, stalled)
        return True

    def __enter__(self) -> Resumable:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if error is not None and not isinstance(error, GeneratorExit):
                try:  # the save in flight first: the note names the last checkpoint
                    self._finish_in_flight()
                except ShardwiseError as e:
                    error.add_note(f"shardwise.Resumable: the background save in flight "
                                   f"failed too: {e}")
                self._record_failure(error)
        finally:
            self.close()

    # -- start --------------------------------------------------------------------------

    def _take_folder(self) -> None:
        def take() -> None:
            if self.rank == 0:
                os.makedirs(self.folder, exist_ok=True)
                failures = os.path.join(self.folder, _FAILURES)
                found = kind(failures)
                if found is None:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(failures)
                elif found != "dir":
                    raise ShardwiseError(
                        f"Resumable: {failures} is {_WHAT[found]}; Resumable writes its "
                        f"failure records there and deletes them once reported, so it "
                        f"must be a folder of the run's own, never a link. Remove it (it "
                        f"is made again), or point Resumable at another folder")
                lock = FolderLock(self.folder)
                lock.acquire()
                self._lock = lock
        agreed(self._comm, f"Resumable({self.folder!r})", take)

    def _resume(self) -> None:
        found = self._shared(lambda: self._complete_steps() if self.rank == 0 else None)
        self._report_failures()
        failed: list[str] = []
        for step in reversed(found):
            path = self._path(step)
            try:
                extra = load_checkpoint(path, self.model, self.optimizer)
            except ShardwiseError as e:
                logger.warning("Resumable: skipping %s, which does not load: %s", path, e)
                failed.append(f"{path}: {e}")
                self._unloadable.add(step)
                continue
            self._apply(extra, path)
            return
        if failed:
            # Starting over would train from scratch and then prune the checkpoints that
            # did not load: never silently. Say why each one failed instead.
            raise ShardwiseError(
                "Resumable: no checkpoint in " + self.folder + " loads into this model and "
                "optimizer, so nothing was loaded (a changed model, or damaged files?). "
                "Point Resumable at a new folder to start over, or fix what is named:\n"
                + "\n".join(failed))
        logger.info("Resumable: no checkpoint in %s; starting at step 0", self.folder)

    def _apply(self, extra: Any, path: str) -> None:
        mine = extra.get(_KEY) if isinstance(extra, dict) else None
        if not isinstance(mine, dict) or not isinstance(mine.get("step"), int):
            raise ShardwiseError(f"Resumable: {path} was not saved by Resumable (its extra "
                                 f"has no {_KEY!r} record); point Resumable at a folder of "
                                 f"its own")
        self.step = mine["step"]
        self.state = extra.get("state") or {}
        if self.scheduler is not None and mine.get("scheduler") is not None:
            self.scheduler.load_state_dict(mine["scheduler"])
        if mine.get("world_size") != self.world:
            self._reseed(mine.get("rng") or {})
        self.resumed_from = path
        logger.warning("Resumable: resumed at step %d from %s (saved at world size %s, "
                       "now %d)", self.step, path, mine.get("world_size"), self.world)

    def _rng(self) -> dict[str, Any]:
        """Rank 0's RNG states, and whether every rank's equal them."""
        states, digest = portable_rng()
        digests = self._everyone(digest)
        return {**states, "same": len(set(digests)) == 1}

    def _reseed(self, rng: dict[str, Any]) -> None:
        if not rng.get("same"):
            logger.warning(
                "Resumable: the ranks had different RNG states at the save, and per-rank "
                "random streams cannot be carried to another world size; random ops "
                "(dropout, sampling) will not repeat the uninterrupted run's draws")
            return
        restore_portable_rng(rng)

    # -- files --------------------------------------------------------------------------

    def _path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step:08d}")

    def _steps_on_disk(self) -> list[int]:
        return sorted(int(m.group(1)) for e in os.listdir(self.folder)
                      if (m := _STEP.match(e)))

    def _complete_steps(self) -> list[int]:
        return [s for s in self._steps_on_disk()
                if has_metadata(self._path(s))]

    def _prune(self, saved: int) -> None:
        """Rank 0, after saving step ``saved``: keep the newest ``keep`` complete
        checkpoints up to it; remove the rest, and every folder of a later step (left by
        a timeline that was lost: it did not load, or was never completed)."""
        if self.rank != 0:
            return
        complete = [s for s in self._complete_steps()
                    if s <= saved and s not in self._unloadable]
        kept = set(complete[-self.keep:])
        for s in self._steps_on_disk():
            if s not in kept:
                # Only what save_checkpoint wrote, never through a link (Note [what
                # shardwise deletes] in _fs.py).
                with contextlib.suppress(OSError):
                    remove_checkpoint(self._path(s))

    # -- failures -----------------------------------------------------------------------

    def _record_failure(self, error: BaseException) -> None:
        """Write this rank's failure and say on the exception where the run stood."""
        last = self._complete_steps_quietly()
        record: dict[str, Any] = {"step": self.step, "rank": self.rank, "world_size": self.world,
                  "restart": _env_int("TORCHELASTIC_RESTART_COUNT"),
                  "error": f"{type(error).__name__}: {error}"[:2000],
                  "last_checkpoint": last[-1] if last else None, "time": time.time()}
        failures = os.path.join(self.folder, _FAILURES)
        with contextlib.suppress(OSError):
            if kind(failures) == "dir":  # never through a link (checked at start too)
                write_json_atomic(os.path.join(failures,
                                               f"rank{self.rank}-{os.getpid()}.json"), record)
        history = self._history() + [record]
        note = (f"shardwise.Resumable: failed at step {self.step} on rank {self.rank} "
                f"(last checkpoint: {_step_name(record['last_checkpoint'])} in "
                f"{self.folder}).")
        restarts = _env_int("TORCHELASTIC_MAX_RESTARTS")
        if restarts is not None:
            note += (f" This was restart {record['restart']} of the {restarts} torchrun "
                     f"allows.")
        stuck = _stuck(history)
        if stuck is not None:
            note += (f" {stuck} attempts in a row failed without getting past "
                     f"{_step_name(record['last_checkpoint'])}: restarting will not help; "
                     f"fix the cause above (earlier errors in {self.folder}/{_HISTORY}).")
        error.add_note(note)

    def _report_failures(self) -> None:
        """Rank 0: fold the previous attempts' failure files into the history and say
        what they were."""
        if self.rank != 0:
            return
        new = _take_failure_records(os.path.join(self.folder, _FAILURES))
        if not new:
            return
        history = (self._history() + sorted(new, key=lambda r: r.get("time", 0)))[-50:]
        write_json_atomic(os.path.join(self.folder, _HISTORY), history)
        first = min(new, key=lambda r: r.get("time", 0))
        logger.warning("Resumable: the previous attempt failed at step %s on rank %s: %s",
                       first.get("step"), first.get("rank"), first.get("error"))

    def _history(self) -> list[dict[str, Any]]:
        try:
            history = read_json(os.path.join(self.folder, _HISTORY))
        except (OSError, ValueError):
            return []
        return history if isinstance(history, list) else []

    def _complete_steps_quietly(self) -> list[int]:
        try:
            return self._complete_steps()
        except OSError:
            return []

    # -- collectives --------------------------------------------------------------------

    def _everyone(self, value: Any) -> list[Any]:
        if self._comm is None or self.world == 1:
            return [value]
        return self._comm.all_gather_object(value, what="Resumable")

    def _shared(self, rank0_value) -> Any:
        """Rank 0's value of ``rank0_value()``, on every rank (errors agreed)."""
        mine = agreed(self._comm, f"Resumable({self.folder!r})", rank0_value)
        return self._everyone(mine)[0]

    def _per_epoch(self) -> int:
        if self.steps_per_epoch is None:
            raise ShardwiseError("Resumable: epoch and step_in_epoch need steps_per_epoch=")
        return self.steps_per_epoch


_RECORD = re.compile(r"rank\d+-\d+\.json")
_RECORD_KEYS = {"step", "rank", "world_size", "restart", "error", "last_checkpoint", "time"}
_WHAT = {"link": "a symbolic link", "file": "a file", "other": "not a folder"}


def _take_failure_records(directory: str) -> list[dict[str, Any]]:
    """Read and remove the failure records in ``directory``: files named as
    ``_record_failure`` names them and holding what it writes, nothing else, never
    through a link (Note [what shardwise deletes] in _fs.py)."""
    fd = open_dir(directory)
    if fd is None:
        return []
    records = []
    try:
        for name in sorted(os.listdir(fd)):
            if not _RECORD.fullmatch(name) or kind(name, fd) != "file":
                continue
            try:
                with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd), "rb") as f:
                    record = json.loads(f.read(1 << 20))
            except (OSError, ValueError):
                continue
            if not (isinstance(record, dict) and set(record) == _RECORD_KEYS):
                continue
            records.append(record)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)
    return records


def _json_state(scheduler: Any) -> Any:
    """The scheduler's state as JSON values (raising in words if it has others)."""
    state = scheduler.state_dict()
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise ShardwiseError(f"Resumable: the scheduler's state_dict() is not JSON ({e}); "
                             f"save it yourself in run.state, or pass scheduler=None") from e


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _step_name(step: int | None) -> str:
    return "none" if step is None else f"step {step}"


def _stuck(history: list[dict[str, Any]]) -> int | None:
    """How many attempts in a row ended with the same last checkpoint as the latest one
    (None if fewer than two): a loop that restarts without progress."""
    last = history[-1].get("last_checkpoint") if history else None
    restarts: set[Any] = set()
    for record in reversed(history):
        if record.get("last_checkpoint") != last:
            break
        restarts.add(record.get("restart"))
    return len(restarts) if len(restarts) >= 2 else None
