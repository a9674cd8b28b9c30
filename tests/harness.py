"""Run a test function on N real processes (gloo on CPU) and report every rank's failure.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each initialises a
gloo process group through a FileStore (no ports to collide), sets one intra-op thread,
calls ``fn(rank, world_size, *args)`` and sends back its return value or its traceback.
A rank that fails makes the test fail with the tracebacks of every failed rank; ranks
still running after ``timeout`` seconds are killed and reported as hung.

Note [forking from pytest's process]: a forked child gets a copy of every object of
pytest's process but only the thread that forked. An object whose destructor joins a
thread of its own (a ``TCPStore`` server, a process group's gloo threads) hangs forever
when the child destroys it; a child's ``gc.collect()`` (accelerate's ``free_memory``
calls one) does exactly that to garbage it inherited, such as the frames of a failed
test that made a store (issue 51 item 9: two QLoRA Trainer ranks hung 300 s each).
So every fork from pytest's process goes through :func:`forking`, which

- first collects this process's garbage when threads other than this one exist, so
  that such an object is destroyed here, where its threads are;
- then refuses to fork while a thread is still there (a live store or process group, a
  pool), naming it, instead of forking a child that may hang in it;
- and freezes the garbage collector's view of every object that exists at the fork
  (``gc.freeze``), so that no child ever collects, and so destroys, what it inherited.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any


class RankFailure(AssertionError):
    pass


class ForkHazard(AssertionError):
    """pytest's process holds what a forked child must not inherit (Note [forking from
    pytest's process])."""


def other_threads() -> list[str]:
    """The names of this process's threads other than the calling one (Linux's
    /proc/self/task: native threads too, which ``threading`` does not list)."""
    me = threading.get_native_id()
    python = {t.native_id: t.name for t in threading.enumerate()}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux: only the threads Python knows
        return [name for tid, name in python.items() if tid != me]
    names = []
    for tid in map(int, tasks):
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                native = f.read().strip()
        except OSError:  # ended meanwhile
            continue
        names.append(f"{python[tid]} (Python thread)" if tid in python else native)
    return sorted(names)


def fork_hazards() -> list[str]:
    """What pytest's process holds that a forked child must not inherit; empty if none.
    Collects garbage first when threads exist, so that garbage holding them goes."""
    found = []
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        found.append("a default process group is initialised in pytest's process "
                     "(create process groups inside the ranks, or destroy it in `finally`)")
    threads = c10d_threads()
    if threads:
        gc.collect()  # a failed test's frames holding a TCPStore: destroyed here
        for _ in range(20):  # a thread that was just joined may linger for a moment
            threads = c10d_threads()
            if not threads:
                break
            time.sleep(0.05)
    if threads:
        found.append(f"threads of torch.distributed: {threads} (a TCPStore's is "
                     f"'pt_tcpstore_uv', a process group's 'pt_gloo_runloop'); close what "
                     f"started them in `finally`, or create it in a subprocess or the ranks")
    return found


# The threads of torch.distributed's objects, whose destructors join them: a child that
# inherited such an object and destroyed it would wait for ever (the fork copies no
# thread). Other libraries' threads stay alive in the parent and their objects are never
# collected in a child (gc.freeze, in forking()): jemalloc's background thread, which
# pyarrow starts at import (datasets, TRL), is one every full run has.
_C10D_THREADS = ("pt_",)


def c10d_threads() -> list[str]:
    """The names of this process's torch.distributed threads (``pt_...``)."""
    return [t for t in other_threads() if t.startswith(_C10D_THREADS)]


@contextlib.contextmanager
def forking() -> Iterator[None]:
    """Around every fork from pytest's process (Note [forking from pytest's process]):
    refuse while a thread or a process group exists here; keep everything that exists
    at the fork out of the children's garbage collections."""
    found = fork_hazards()
    if found:
        raise ForkHazard("pytest's process holds what a forked child must not inherit "
                         "(Note [forking from pytest's process] in tests/harness.py; it "
                         "may be left by an earlier test):\n- " + "\n- ".join(found))
    ours = gc.get_freeze_count() == 0  # not undoing a freeze someone else made
    parent = os.getpid()
    gc.freeze()
    try:
        yield
    finally:
        # Here, the parent collects its own garbage as before; a child of os.fork() that
        # leaves the block keeps what it inherited frozen.
        if ours and os.getpid() == parent:
            gc.unfreeze()


def _child(fn: Callable, rank: int, world_size: int, args: tuple, workdir: str) -> None:
    code = 0
    # Note [a rank's last words]: this rank's standard error goes to a file the parent
    # reads back, and a fatal signal's Python stacks (faulthandler) with it.
    err = os.open(os.path.join(workdir, f"rank{rank}.err"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(err, 2)
    os.close(err)
    # Python's writes too (pytest pointed sys.stderr at its own capture), in order.
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's
    faulthandler.enable(file=2, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=2, all_threads=True)  # a hung rank's stacks
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Every rank connected before any runs the test: a rank whose test needs no
        # collective (and exits at once) closed its sockets while a slower peer was still
        # connecting its full mesh, failing it with "Connection closed by peer" (seen
        # under load, 2 runs in ~10).
        dist.barrier()
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
        code = 1
    try:
        with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        os._exit(code)  # skip pytest's atexit handlers inherited through fork


# Note [a rank's last words]
# A rank killed by a signal (an abort in gloo's or torch's C++ code, a corrupted heap)
# writes no result; its only trace is what it printed on standard error: a C++ message
# ("terminate called after ...") and faulthandler's stacks of every thread. Under
# pytest those went to the terminal between progress dots, and CI keeps only the end of
# its log, so a rank that died once in CI left "exit code -6" and nothing else. Each
# rank's standard error therefore goes to a file; the parent writes it back to its own
# standard error (pytest shows it with the test, as before) and puts its last lines in
# the failure. A rank still running at the deadline is first asked for its stacks
# (SIGUSR1, which faulthandler answers), so a hang says where each rank waited.
LAST_WORDS = 60


def _relay(workdir: str, rank: int) -> str:
    """Write what ``rank`` printed on standard error to this process's, and return it."""
    try:
        with open(os.path.join(workdir, f"rank{rank}.err"), "rb") as f:
            data = f.read()
    except FileNotFoundError:  # the rank died before it opened the file
        return ""
    view = memoryview(data)
    while view:  # a pipe may take less than the whole at once
        view = view[os.write(2, view):]
    return data.decode(errors="replace")


# Seconds the other ranks get to finish after one fails or dies. 10 s was enough on a quiet
# machine, but not at a load average of 20 on 2 cores (issue 51 item 9), where a rank
# that is about to raise its own error may get little CPU for many seconds.
GRACE = 30


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240,
              deaths_expected: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    With ``deaths_expected``, a rank that dies (a test killing it on purpose) gives None
    instead of a failure; the others must still finish within ``GRACE`` s of its death.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, args, workdir))
                 for r in range(world_size)]
        with forking():
            for p in procs:
                p.start()
        deadline = time.monotonic() + timeout
        first_failure = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            # Once a rank failed, the others are likely blocked in a collective.
            if now > deadline or (first_failure is not None and now - first_failure > GRACE):
                break
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:  # where each hung rank waits, on its standard error, then kill it
            with contextlib.suppress(ProcessLookupError):
                os.kill(procs[r].pid, signal.SIGUSR1)
        if hung:
            time.sleep(1.0)  # faulthandler writes from its signal handler at once
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        said = [_relay(workdir, r) for r in range(world_size)]
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                if r not in hung and not deaths_expected:
                    last = "\n".join(said[r].splitlines()[-LAST_WORDS:])
                    errors.append(f"--- rank {r} died (exit code {procs[r].exitcode}); "
                                  f"the end of its standard error: ---\n{last}")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"--- rank {r} failed ---\n{value}")
            results.append(value if status == "ok" else None)
        if hung:
            errors.append(f"--- ranks {hung} still running after "
                          f"{'a failure elsewhere' if first_failure else f'{timeout}s'}: "
                          f"killed ---")
            for r in hung:
                last = "\n".join(said[r].splitlines()[-LAST_WORDS:])
                errors.append(f"--- where rank {r} was, the end of its standard error: "
                              f"---\n{last}")
        if errors:
            raise RankFailure("\n".join(errors))
        return results


class LogCollector(logging.Handler):
    """A logging handler that keeps every message (attach it to the "shardwise" logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_fresh(module: str, fn: str, env: dict[str, str], timeout: float = 600) -> None:
    """Run ``module.fn()`` (a test module next to this file) in a fresh interpreter with
    ``env`` added to the environment; fail with its stderr if it fails. For what cannot
    run in pytest's forked ranks (inductor's compile workers do not survive a fork)."""
    import subprocess
    import sys

    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {module}; {module}.{fn}()"
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                         env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
