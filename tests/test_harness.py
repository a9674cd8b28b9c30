"""The harness's forks from pytest's process (Note [forking from pytest's process] in
tests/harness.py; issue 51 item 9).

Under load, a test that failed while holding a ``TCPStore`` left it in pytest's process,
kept by the failure's frames; every later rank inherited it through ``fork``, and a
rank's ``gc.collect()`` (accelerate's ``free_memory``) destroyed it there: the store's
destructor joined a thread the fork had not copied, and the rank hung until the harness
killed it at 300 s.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time

import pytest
import torch.distributed as dist
from harness import ForkHazard, RankFailure, c10d_threads, forking, other_threads, run_ranks


def _collects(rank, world):
    gc.collect()  # as accelerate's free_memory does
    dist.barrier()  # no rank leaves while another still connects
    return True


def _store_in_a_cycle() -> None:
    """A master TCPStore reachable only from a cycle, as a failed test's store is from
    its frame, its exception and the exception's traceback."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    frame_like: dict = {"store": store}
    frame_like["self"] = frame_like


def test_garbage_holding_a_store_does_not_hang_a_rank_that_collects():
    # Before: both ranks hung in the store's destructor until the harness's timeout.
    enabled = gc.isenabled()
    gc.disable()  # the garbage stays until the fork, as it did under load
    try:
        _store_in_a_cycle()
        assert "pt_tcpstore_uv" in other_threads()
        assert run_ranks(_collects, 2, timeout=60) == [True, True]
    finally:
        if enabled:
            gc.enable()
    assert c10d_threads() == []  # destroyed in pytest's process, where its thread is


class _Finalized:
    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.cycle = self

    def __del__(self) -> None:
        open(os.path.join(self.folder, f"finalized-in-{os.getpid()}"), "w").close()


def test_ranks_never_collect_what_they_inherited(tmp_path):
    # Garbage with no thread is not collected before the fork; a rank that collects
    # must not finalise it (a finaliser that closes or deletes what pytest's process
    # still uses would act on the parent's behalf). Before: each rank finalised it.
    enabled = gc.isenabled()
    gc.disable()
    try:
        _Finalized(str(tmp_path))
        assert run_ranks(_collects, 2, timeout=60) == [True, True]
        assert os.listdir(tmp_path) == []
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert os.listdir(tmp_path) == [f"finalized-in-{os.getpid()}"]  # here, once


def test_a_child_of_os_fork_never_collects_what_it_inherited(tmp_path):
    # The same through `with forking(): pid = os.fork()`: the child leaves the block too,
    # and must not unfreeze what it inherited there.
    enabled = gc.isenabled()
    gc.disable()
    try:
        _Finalized(str(tmp_path))
        with forking():
            pid = os.fork()
        if pid == 0:
            try:
                gc.collect()
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert os.listdir(tmp_path) == []
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert os.listdir(tmp_path) == [f"finalized-in-{os.getpid()}"]


def test_a_live_store_in_pytests_process_is_refused_before_forking():
    # Before: the ranks forked with the store's server inside them.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                          timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(ForkHazard, match=r"threads of torch.distributed: "
                                             r"\['pt_tcpstore_uv'\]"):
            run_ranks(_collects, 2, timeout=60)
    finally:
        del store
    assert c10d_threads() == []


def test_a_process_group_in_pytests_process_is_refused_before_forking():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ForkHazard, match=r"a default process group is initialised"):
            run_ranks(_collects, 2, timeout=60)
    finally:
        dist.destroy_process_group()
    assert c10d_threads() == []


def _aborts(rank, world):
    dist.barrier()
    if rank == 0:
        print("about to abort", file=sys.stderr, flush=True)
        os.abort()  # as a C++ assertion or a corrupted heap ends a rank
    dist.barrier()


def test_a_rank_killed_by_a_signal_leaves_its_last_words_in_the_failure(capfd):
    # Note [a rank's last words]: before, CI's log ended in "rank 0 died (exit code -6)".
    with pytest.raises(RankFailure) as info:
        run_ranks(_aborts, 2, timeout=60)
    said = str(info.value)
    assert "rank 0 died (exit code -6)" in said
    assert "about to abort" in said
    # faulthandler's stack names the line that aborted
    assert "Fatal Python error: Aborted" in said and "in _aborts" in said
    assert "about to abort" in capfd.readouterr().err  # still shown with the test


def _one_sleeps(rank, world):
    if rank == 1:
        time.sleep(600)  # a rank that never comes back, as one stuck in a collective
    return rank


def test_a_hung_rank_is_reported_with_where_it_waited():
    # Note [a rank's last words]: before, "ranks [1] still running after 3s: killed".
    with pytest.raises(RankFailure) as info:
        run_ranks(_one_sleeps, 2, timeout=3)
    said = str(info.value)
    assert "ranks [1] still running after 3s: killed" in said
    assert "where rank 1 was" in said and "in _one_sleeps" in said
