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
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist

from ..errors import ShardwiseError

if dist.is_available() and not dist.is_initialized():
    import torch.distributed.nn.functional  # noqa: F401  Note [teardown]


# Collectives that wait longer than this fail instead of hanging: torch's defaults (30
# minutes for gloo, 10 for NCCL) make a diverged run sit idle for half an hour. Ten
# minutes still covers a slow first checkpoint or a large load on one rank.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


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
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
