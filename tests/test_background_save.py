"""Background saves (Note [background saves] in checkpoint/background.py): the state at the
call, bit for bit, while training goes on; the call's own refusals; a rank killed or
failing during the thread's write leaves the previous or the new checkpoint whole; one
save in flight; ``Resumable`` killed mid-write resumes as an uninterrupted run; a program
that ends with a save in flight commits it.

Real ranks (tests/harness.py); the crash points are Note [save protocol]'s, as in
tests/test_checkpoint_protocol.py, reached here on the save's thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import elastic_script as es
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks
from test_checkpoint import full_disk
from test_checkpoint_protocol import _assert_same, _base, _contents, _loaded, _named, _trained
from test_offload import _plain
from test_offload import _state as _rows
from test_offload import _steps as _offload_steps

import shardwise as sw
import shardwise.checkpoint.save as save
from shardwise.checkpoint._lock import FolderLock
from shardwise.comm.collectives import Comm
from shardwise.models import GPT

# The steps a background save passes on its thread (the others are the call's).
THREAD_STEPS = save.SAVE_STEPS[save.SAVE_STEPS.index("data-tmp"):]


def _train_more(model, opt, steps, seed=7):
    """Steps on other data: every parameter, moment and BatchNorm statistic changes."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, 16, 16, generator=g)
        F.cross_entropy(model(x), torch.arange(4) % 10).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt):
    """The full state, on every rank (collectives)."""
    return (sw.full_state_dict(model, rank0_only=False),
            sw.full_optimizer_state_dict(model, opt, rank0_only=False))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _collectives_by_thread():
    """Record, per thread, the process groups of torch's collectives and shardwise's
    ``Comm`` calls (to show the save's thread never uses the training's group)."""
    seen: list[tuple[str, str, object]] = []
    c10d = dist.distributed_c10d
    for name in ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                 "isend", "irecv"):
        real = getattr(c10d, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((threading.current_thread().name, _name, kwargs.get("group")))
            return _real(*args, **kwargs)

        setattr(c10d, name, spy)
    real_run = Comm._run

    def comm_spy(self, what, *args, **kwargs):
        seen.append((threading.current_thread().name, f"Comm: {what}", self.group))
        return real_run(self, what, *args, **kwargs)

    Comm._run = comm_spy
    return seen


def _during_training(rank, world, folder):
    """Test 1 at world 2: saved in the background while 3 more steps train; what loads is
    the state at the call. Then the one save in flight, and a load right after a save."""
    seen = _collectives_by_thread()
    model, opt = _trained(2)
    at_call = _snapshot(model, opt)
    extra = {"step": 2, "loader": [1, 2, 3]}
    # The thread writes only once training has changed everything (a fast write could
    # otherwise end before the first step).
    gate, real = threading.Event(), save.Writer.write

    def gated(self, name, tensor):
        if threading.current_thread().name == "shardwise-save":
            assert gate.wait(120)
        return real(self, name, tensor)

    save.Writer.write = gated
    handle = sw.save_checkpoint(folder, model, opt, extra=extra, background=True)
    assert isinstance(handle, sw.SaveHandle) and handle.path == folder
    assert not handle.done() and "writing" in repr(handle)
    extra["step"] = 99  # changes nothing saved: the call kept a copy
    extra["loader"].append(4)
    _train_more(model, opt, 3)
    gate.set()
    handle.wait()
    save.Writer.write = real
    assert handle.done() and "committed" in repr(handle)
    handle.wait()  # again: returns at once
    assert not _same(_snapshot(model, opt), at_call)  # training did change the state
    thread_groups = {g for t, _, g in seen if t == "shardwise-save"}
    assert thread_groups and None not in thread_groups, thread_groups  # used, not WORLD
    assert not [w for t, w, _ in seen if t == "shardwise-save" and w.startswith("Comm")]

    fresh, fresh_opt = _trained(0)
    assert sw.load_checkpoint(folder, fresh, fresh_opt) == {"step": 2, "loader": [1, 2, 3]}
    assert _same(_snapshot(fresh, fresh_opt), at_call)

    # Two saves back to back: the second waits for the first; a load right after a
    # background save (no wait()) sees it.
    more = folder + "-more"
    first = sw.save_checkpoint(more, model, opt, extra={"v": 1}, background=True)
    second = sw.save_checkpoint(more, model, opt, extra={"v": 2}, background=True)
    assert first.done()
    assert sw.load_checkpoint(more, fresh, fresh_opt) == {"v": 2}
    assert second.done()
    assert _same(_snapshot(fresh, fresh_opt), _snapshot(model, opt))
    data, other = _contents(more)
    assert other == [] and len(data) == 2, (data, other)  # the new one and keep_previous's
    return at_call


def _at_world_3(rank, world, folder, at_call):
    model, opt = _trained(0)
    sw.save_checkpoint(folder + "-3", model, opt, background=True)  # a side group at 3
    sw.load_checkpoint(folder + "-saved-at-2", model, opt)
    return _same(_snapshot(model, opt), at_call)


def test_a_background_save_holds_the_state_at_the_call(tmp_path):
    folder = str(tmp_path / "ck")
    at_call = run_ranks(_during_training, 2, folder)[0]
    os.rename(folder, folder + "-saved-at-2")
    assert run_ranks(_at_world_3, 3, folder, at_call) == [True] * 3
    # And in a world of one, into an unsharded model: the same state.
    model, opt = _trained(0, shard=False)
    sw.load_checkpoint(folder + "-saved-at-2", model, opt)
    assert all(torch.equal(v, at_call[0][k]) for k, v in model.state_dict().items())


def _disk_tier(rank, world, tiers, folder):
    """A model whose parameters and AdamW state live in files (the disk tier): the staging
    reads them into memory, page by page released, and what loads is the state at the
    call."""
    model, opt = _plain(("disk", "disk"), tiers)
    _offload_steps(model, opt, 0, 2)
    at_call = _rows(model, opt)
    handle = sw.save_checkpoint(folder, model, opt, background=True)
    _offload_steps(model, opt, 2, 2)
    handle.wait()
    fresh, fresh_opt = _plain(("disk", "disk"), tiers)
    sw.load_checkpoint(folder, fresh, fresh_opt)
    got = _rows(fresh, fresh_opt)
    return got.keys() == at_call.keys() and all(torch.equal(got[k], v)
                                                for k, v in at_call.items())


def test_a_disk_offloaded_model_saves_in_the_background(tmp_path):
    tiers = str(tmp_path / "tiers")
    os.makedirs(tiers)
    assert run_ranks(_disk_tier, 2, tiers, str(tmp_path / "ck")) == [True, True]


def _refusals(rank, world, root):
    """What a synchronous save refuses up front, a background one refuses from the call,
    on every rank, before returning a handle."""
    model, opt = _trained(1)
    good = os.path.join(root, "good")
    sw.save_checkpoint(good, model, opt, extra={"v": 1}, background=True).wait()
    said = {}
    calls = {
        "extra": lambda: sw.save_checkpoint(good, model, opt, background=True,
                                            extra={"loss": object() if rank else 1.0}),
        "file": lambda: sw.save_checkpoint(os.path.join(root, "a_file"), model, opt,
                                           background=True),
        "paths": lambda: sw.save_checkpoint(os.path.join(root, f"p{rank}"), model, opt,
                                            background=True),
        "flag": lambda: sw.save_checkpoint(good, model, opt, background="yes"),
    }
    for name, call in calls.items():
        with pytest.raises(sw.ShardwiseError) as err:
            call()
        said[name] = str(err.value)
    # Another job holds the folder.
    if rank == 0:
        lock = FolderLock(good)
        lock.acquire()
    with pytest.raises(sw.ShardwiseError, match="is being written by another save"):
        sw.save_checkpoint(good, model, opt, background=True)
    if rank == 0:
        lock.release()
    # Buffers that differ across ranks.
    with torch.no_grad():
        model.blocks[0].bn.running_mean.add_(rank)
    with pytest.raises(sw.DivergenceError):
        sw.save_checkpoint(good, model, opt, background=True)
    assert sw.load_checkpoint(good, model, opt) == {"v": 1}
    assert _named(good) is not None and len(_contents(good)[0]) == 1
    return said


def test_the_call_itself_refuses_what_a_synchronous_save_refuses(tmp_path):
    open(tmp_path / "a_file", "w").close()
    for said in run_ranks(_refusals, 2, str(tmp_path)):
        assert "rank(s) [1]" in said["extra"] and "extra" in said["extra"]
        assert "rank(s) [0]: cannot create" in said["file"]
        assert "p0" in said["paths"] and "p1" in said["paths"]  # the order check's words
        assert "background must be True or False" in said["flag"]


def _quiet_store():
    """No peer-watch notes (Note [peer watch]): a SIGKILL from the save's thread can land
    while the main thread writes its note into the harness's FileStore, and a record cut
    short there makes every later reader of that store spin for ever (torch's FileStore
    reads until the record's end). The survivors learn of the death from gloo's closed
    connections instead."""
    os.environ["SHARDWISE_PEER_TIMEOUT"] = "0"


def _crash(rank, world, folder, step, victim, mode):
    """The victim stops at ``step`` on its save's thread while its main thread trains."""
    _quiet_store()

    def reached(name):
        if name == step and rank == victim:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at {name}")

    save._reached = reached
    model, opt = _trained(3)
    handle = sw.save_checkpoint(folder, model, opt, extra={"v": 2}, background=True)
    trained = "ok"
    try:
        _train_more(model, opt, 2)
    except sw.ShardwiseError as e:  # the victim died under the training's collectives
        trained = type(e).__name__
    try:
        handle.wait()
    except sw.ShardwiseError as e:
        return trained, "raised", str(e)
    return trained, "ok", ""


CRASHES = [(victim, step, mode) for mode in ("kill", "raise") for victim in (0, 1)
           for step in THREAD_STEPS
           if victim == 0 or step in ("data-tmp", "data-written", "reports", "agreed")]


def test_a_rank_stopped_during_the_write_leaves_the_previous_or_the_new_checkpoint(tmp_path):
    base = str(tmp_path / "base")
    run_ranks(_base, 2, base)
    old, previous = _loaded(base), _named(base)
    model, opt = _trained(3, shard=False)
    new = ({"v": 2}, model.state_dict(), opt.state_dict())
    for victim, step, mode in CRASHES:
        where = f"rank {victim} stopped by {mode} at {step!r} on the save's thread"
        folder = str(tmp_path / f"case-{victim}-{step}-{mode}")
        os.system(f"cp -r {base} {folder}")
        print(where, flush=True)  # shown when the test fails
        results = run_ranks(_crash, 2, folder, step, victim, mode, timeout=60,
                            deaths_expected=True)
        committed = save.SAVE_STEPS.index(step) >= save.SAVE_STEPS.index(
            "committed" if victim == 0 else "reports")
        _assert_same(_loaded(folder), new if committed else old, where)
        survivor = results[1 - victim]
        if mode == "raise" and step not in ("agreed", "tidied"):
            # An error before the last agreement: wait() raises on every rank; inside an
            # agreement (writing a file, the commit) each names it.
            agreed = step in ("data-tmp", "meta-tmp", "committed")
            for r, res in enumerate(results):
                assert res[1] == "raised", (where, r, res)
                assert "injected failure" in res[2] or (r != victim and not agreed), (
                    where, r, res)
        elif mode == "kill" and step not in ("agreed", "tidied"):
            assert survivor[1] == "raised", (where, survivor)  # never a hang, never "ok"
        else:  # past the last agreement: the others' saves succeeded
            assert survivor[1] == "ok", (where, survivor)
        data, other = _contents(folder)
        if results[0] is not None:  # rank 0 lived: it tidied, as after a synchronous save
            assert other == [] and data == {_named(folder), previous}, (where, data, other)


def _write_fails_on_rank_1(rank, world, folder):
    """Test 3: a full disk on rank 1, its file half written on its thread."""
    model, opt = _trained(2)
    sw.save_checkpoint(folder, model, opt, extra={"v": 1})
    sw.save_checkpoint(folder, model, opt, extra={"v": 2})
    with full_disk(rank):
        handle = sw.save_checkpoint(folder, model, opt, extra={"v": 3}, background=True)
        _train_more(model, opt, 1)
        with pytest.raises(sw.ShardwiseError) as err:
            handle.wait()
        said = str(err.value)
        # A failure that no wait() takes is raised by the next save, on every rank, which
        # then does nothing; the one after goes ahead.
        sw.save_checkpoint(folder, model, opt, extra={"v": 4}, background=True)
        with pytest.raises(sw.ShardwiseError, match="no wait\\(\\) took its error") as later:
            sw.save_checkpoint(folder, model, opt, extra={"v": 5}, background=True)
        sw.save_checkpoint(folder, model, opt, extra={"v": 5}, background=True)  # a load too
        with pytest.raises(sw.ShardwiseError, match="(?s)load_checkpoint.*no wait\\(\\) took"):
            sw.load_checkpoint(folder, model, opt)
    assert sw.load_checkpoint(folder, model, opt) == {"v": 2}  # nothing half-committed
    data, other = _contents(folder)
    assert other == [] and data == {_named(folder)}, (data, other)  # the failed ones' gone
    sw.save_checkpoint(folder, model, opt, extra={"v": 6}, background=True)
    assert sw.load_checkpoint(folder, model, opt) == {"v": 6}
    return said, str(later.value)


def test_a_write_failing_on_one_rank_fails_wait_on_every_rank(tmp_path):
    for said, later in run_ranks(_write_fails_on_rank_1, 2, str(tmp_path / "ck")):
        assert "rank(s) [1]: OSError" in said and "No space left" in said, said
        assert "No space left" in later and "rank(s) [0, 1]" in later, later


def _resumable(rank, world, folder, total, kill_at_save, background):
    """A Resumable loop (every=2) on the reference of tests/elastic_script.py, default
    mode; with ``kill_at_save``, rank 1 is SIGKILLed on its thread, half-way through
    writing that save (numbered from 1)."""
    if kill_at_save:
        _quiet_store()
        saves = [0]

        def reached(name):
            if name == "prepared":
                saves[0] += 1
            if name == "data-tmp" and rank == 1 and saves[0] == kill_at_save:
                os.kill(os.getpid(), signal.SIGKILL)

        save._reached = reached
    torch.manual_seed(0)
    model = sw.shard(GPT(es.CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = {}
    try:
        with sw.Resumable(folder, model, opt, every=2, background=background) as run:
            resumed = run.resumed_from
            for step in run.steps(total):
                x, y = es.global_batch(step)
                loss = model(x[rank::world], y[rank::world])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[step] = loss.item()
                time.sleep(0.02)  # the save's thread writes meanwhile
    except sw.ShardwiseError as e:  # rank 0 after rank 1 was killed
        return "failed", str(e)
    return resumed, losses, es.digest(model, opt)


def test_resumable_killed_during_a_background_save_resumes_as_if_uninterrupted(tmp_path):
    folder, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    results = run_ranks(_resumable, 2, folder, 8, 2, True, deaths_expected=True)
    assert results[1] is None and results[0][0] == "failed", results
    steps = sorted(e for e in os.listdir(folder) if e.startswith("step-"))
    assert "step-00000002" in steps  # the save of step 4 never committed
    resumed = run_ranks(_resumable, 2, folder, 8, 0, True)
    uninterrupted = run_ranks(_resumable, 2, fresh, 8, 0, False)  # synchronous saves
    for r in range(2):
        assert resumed[r][0] == os.path.join(folder, "step-00000002"), resumed[r][0]
        assert uninterrupted[r][0] is None
        assert resumed[r][1] == {s: v for s, v in uninterrupted[r][1].items() if s >= 2}
        assert resumed[r][2] == uninterrupted[r][2]  # every bit of the final state
    assert sorted(e for e in os.listdir(folder) if e.startswith("step-")) == [
        "step-00000006", "step-00000008"]


_EXIT_SCRIPT = """
import sys, time
import torch
import shardwise as sw
import shardwise.checkpoint.save as save
from shardwise.models import SmallCNN

def slow(name):
    if name == "data-tmp":
        time.sleep(1.0)    # the program ends while the thread is still writing

save._reached = slow
sw.init_distributed()      # a world of one
model = sw.shard(SmallCNN())
handle = sw.save_checkpoint(sys.argv[1], model, extra={"last": True}, background=True)
print("returned", handle.done(), flush=True)
"""


def test_a_program_that_ends_with_a_save_in_flight_commits_it(tmp_path):
    folder = str(tmp_path / "ck")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, folder], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "returned False" in out.stdout, out.stdout
    from shardwise.models import SmallCNN

    assert sw.load_checkpoint(folder, SmallCNN()) == {"last": True}
