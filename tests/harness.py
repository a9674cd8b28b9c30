"""Run a test function on N real processes (gloo on CPU) and report every rank's failure.

``run_ranks(fn, world_size, *args)`` forks ``world_size`` processes; each initialises a
gloo process group through a FileStore (no ports to collide), sets one intra-op thread,
calls ``fn(rank, world_size, *args)`` and sends back its return value or its traceback.
A rank that fails makes the test fail with the tracebacks of every failed rank; ranks
still running after ``timeout`` seconds are killed and reported as hung.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(AssertionError):
    pass


def _child(fn: Callable, rank: int, world_size: int, args: tuple, workdir: str) -> None:
    code = 0
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(workdir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", traceback.format_exc())
        code = 1
    try:
        with open(os.path.join(workdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        os._exit(code)  # skip pytest's atexit handlers inherited through fork


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240,
              deaths_expected: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    With ``deaths_expected``, a rank that dies (a test killing it on purpose) gives None
    instead of a failure; the others must still finish within 10 s of its death.
    """
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, args, workdir))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        first_failure = None
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            # Once a rank failed, the others are likely blocked in a collective.
            if now > deadline or (first_failure is not None and now - first_failure > 10):
                break
            time.sleep(0.02)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(workdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                results.append(None)
                if r not in hung and not deaths_expected:
                    errors.append(f"--- rank {r} died (exit code {procs[r].exitcode}) ---")
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
