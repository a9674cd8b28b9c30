"""Process-group setup.

Note [teardown]
``torch.distributed.nn.functional`` binds ``group.WORLD`` as the *default value* of ten
functions when it is first imported. Imported after ``init_process_group`` (it is, by
``torch._dynamo``, which every ``torch.optim`` optimizer imports on construction), those
defaults hold the world group forever, so ``destroy_process_group`` cannot free it: the
gloo worker threads live on into interpreter shutdown. Each keeps the last collective it
ran, and when that work's tensors are finally released the thread needs the GIL, which a
finalizing interpreter refuses by ending the thread; C++ then calls ``std::terminate``
("terminate called without an active exception", SIGABRT) after the program's last line.
Importing the module while no group exists binds ``None`` instead (which means the same
group in every one of those functions), so the group dies at ``destroy_process_group``.
A ``DeviceMesh`` holds its group the same way; see ``Comm.mesh``.
``tests/test_teardown.py`` checks that no gloo thread survives it.

Note [a store per attempt]
Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``, its default) the workers meet in a
TCP store that the rank-0 agent hosts for the whole job: it outlives restarts, and
torch's ``env://`` path reads and writes the same keys (``default_pg/0/...``) on every
attempt. A restarted worker can therefore read a key an earlier attempt's worker left:
gloo then dials that dead worker's address (``connectFullMesh failed ... Connection
refused``), and a store-based barrier counts arrivals of the earlier attempt. Nothing in
a worker's environment numbers the attempts the same way on every node (each agent
counts its own restarts, and a node that joins late starts at 0), so the workers agree
on a fresh name themselves before the process group uses the store: every rank but 0
writes a random nonce under its rank; rank 0 draws a random generation, answers each
nonce it reads with ``nonce:generation``, and waits until every rank has confirmed that
pair. A rank accepts only an answer carrying its own nonce and rank 0 only a
confirmation carrying its own generation, so a value left by an earlier attempt is never
taken for one of this attempt. The process group then lives under
``shardwise/<run id>/<generation>/`` in the store, where no earlier attempt wrote.
``tests/test_elastic.py`` restarts workers in a store that holds an earlier attempt's
keys.

Note [abandoned waits]
The peer watch (Note [peer watch] in comm/peers.py) raises while a collective is still
pending: its peers went elsewhere and will never join it. Gloo runs that collective on a
worker thread that waits for the peers until the process group's timeout, and
``ProcessGroupGloo``'s destructor joins that thread. The group is freed at interpreter
shutdown (or by ``destroy_process_group``), so a rank that raised and let the error end
the program sat in shutdown, its traceback printed, until the timeout (10 minutes by
default), and torchrun, which ends the job when a worker exits, waited with it. Gloo's
``abort()`` does not stop the thread either (measured: it still waits for the peers).
So once a wait is abandoned, :func:`keep_groups_at_exit` registers an ``atexit``
function that keeps every process group alive past the interpreter's shutdown: no
destructor joins, the process exits with the program's own status within a second, and
the operating system ends gloo's threads with it. (``os._exit`` would also end at once,
but it would lose the exit status and the buffers of the program's own open files.)
Nothing else changes: a program that catches the error and goes on is unaffected until
it exits. ``destroy_process_group`` of such a group still waits (torch joins there
too), so the error says to let it end the program instead. ``tests/test_launcher.py``
launches a rank that gives up an all-gather this way and times the job's end (130 s
before, at a 120 s group timeout; within seconds now).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import signal
import sys
import time
import uuid

import torch
import torch.distributed as dist

from ..errors import ShardwiseError

if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401  Note [teardown]


# Collectives that wait longer than this fail instead of hanging: torch's defaults (30
# minutes for gloo, 10 for NCCL) make a diverged run sit idle for half an hour. Ten
# minutes still covers a slow first checkpoint or a large load on one rank.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


_keep_registered = False


def keep_groups_at_exit() -> None:
    """Note [abandoned waits]: a pending collective was given up on; the process must
    not join its gloo thread at exit. Idempotent."""
    global _keep_registered
    if not _keep_registered:
        _keep_registered = True
        atexit.register(_keep_groups)


def _keep_groups() -> None:
    """Hold one reference to every live process group that the interpreter's shutdown
    never drops, so that no group's destructor runs (Note [abandoned waits])."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", {}) or {})
    if not groups:
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(groups))


def _die_with_agent() -> None:
    """Note [orphaned workers]: end this worker when its torchrun agent dies.

    torchrun's agent watches its workers, but nothing watches the agent: killed alone
    (SIGKILL, an OOM killer), it leaves its worker running, and the job goes on without
    anyone to restart or stop it (measured: to the end of the job). Linux can send a
    signal to a process when its parent dies; the worker then stops, its peers' next
    collective fails within seconds, and their agents end the job. Linux only (a no-op
    elsewhere); if the agent is already gone, the worker stops at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the agent died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def init_distributed(backend: str | None = None,
                     timeout: datetime.timedelta | float | None = None) -> None:
    """Initialise ``torch.distributed`` from the environment ``torchrun`` sets.

    Without that environment (a plain ``python script.py``) this makes a world of one
    process, so the same script runs unchanged on one process. A no-op when
    ``torch.distributed`` is already initialised. Under torchrun the worker also asks
    Linux to stop it if its agent dies (Note [orphaned workers]).

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default ``"nccl"`` when CUDA is available, else
            ``"gloo"``.
        timeout: collective timeout, a ``timedelta`` or seconds; default
            ``DEFAULT_TIMEOUT`` (10 minutes): a rank waiting longer in a collective
            raises instead of hanging. Raise it if one rank may legitimately work alone
            for longer (a very large load or save).

    Raises:
        ShardwiseError: for a backend this build of torch lacks.

    Example:
        >>> import shardwise as sw
        >>> sw.init_distributed()   # under `torchrun --nproc_per_node 2 train.py`
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not dist.is_nccl_available():
        raise ShardwiseError("backend 'nccl' is not available in this build of torch; use "
                             "'gloo'")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    kwargs: dict = {"timeout": (timeout if isinstance(timeout, datetime.timedelta)
                                else datetime.timedelta(seconds=float(timeout)))}
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_agent()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempt_store(kwargs["timeout"], rank, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)


def attempt_store(timeout: datetime.timedelta, rank: int, world: int) -> dist.Store:
    """The job's shared store, under a name no earlier attempt used (Note [a store per
    attempt]).

    Raises:
        ShardwiseError: some ranks did not arrive within ``timeout`` (naming them).
    """
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timeout)
    root = f"shardwise/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt"
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        generation = uuid.uuid4().hex
        _answer_every_rank(base, root, generation, world, deadline)
    else:
        nonce = uuid.uuid4().hex
        base.set(f"{root}/nonce/{rank}", nonce)
        answer = _poll(base, f"{root}/answer/{rank}", deadline,
                       lambda v: v.startswith(nonce + ":"))
        if answer is None:
            raise ShardwiseError(f"rank {rank} waited {timeout} for rank 0 to name this "
                                 f"attempt's store prefix (Note [a store per attempt]); "
                                 f"did rank 0 start?")
        generation = answer.split(":", 1)[1]
        base.set(f"{root}/confirm/{rank}", f"{nonce}:{generation}")
    return dist.PrefixStore(f"{root}/{generation}/", base)


def _answer_every_rank(base: dist.Store, root: str, generation: str, world: int,
                       deadline: float) -> None:
    """Rank 0's side: answer each rank's latest nonce until all confirm this generation."""
    answered: dict[int, str] = {}
    waiting = set(range(1, world))
    pause = _Backoff()
    while waiting:
        for r in sorted(waiting):
            nonce = _value(base, f"{root}/nonce/{r}")
            if nonce is None:
                continue
            if answered.get(r) != nonce:  # new, or a rank that wrote after an old value
                base.set(f"{root}/answer/{r}", f"{nonce}:{generation}")
                answered[r] = nonce
            if _value(base, f"{root}/confirm/{r}") == f"{nonce}:{generation}":
                waiting.discard(r)
        if waiting and time.monotonic() > deadline:
            raise ShardwiseError(f"rank 0 waited for ranks {sorted(waiting)} to join this "
                                 f"attempt's store prefix (Note [a store per attempt]); "
                                 f"did they start?")
        if waiting:
            pause()


def _value(store: dist.Store, key: str) -> str | None:
    """``key``'s value, or None when it is not set (without blocking)."""
    if not store.check([key]):
        return None
    return store.get(key).decode()


def _poll(store: dist.Store, key: str, deadline: float, accept) -> str | None:
    """Wait for ``key`` to hold a value ``accept`` takes; None at the deadline."""
    pause = _Backoff()
    while time.monotonic() < deadline:
        v = _value(store, key)
        if v is not None and accept(v):
            return v
        pause()
    return None


class _Backoff:
    """Sleeps from 5 ms growing to 100 ms: quick when peers are ready, and light on the
    store when a thousand ranks poll it while one of them starts late."""

    def __init__(self) -> None:
        self.seconds = 0.005

    def __call__(self) -> None:
        time.sleep(self.seconds)
        self.seconds = min(0.1, self.seconds * 1.5)
