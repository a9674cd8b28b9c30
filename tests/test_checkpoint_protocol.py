"""The save protocol under failure and concurrency: a crash at any step, on any rank, in
any way, leaves the new or the previous checkpoint, loadable exactly, and no debris once
a save succeeds; two writers never both write; a reader beside a writer always loads a
whole checkpoint (Note [save protocol] in checkpoint/save.py, Note [one writer] in
checkpoint/_lock.py)."""

import multiprocessing as mp
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from harness import forking, run_ranks

import shardwise as sw
import shardwise.checkpoint._files as files
import shardwise.checkpoint.save as save
from shardwise.checkpoint._lock import LOCK, FolderLock
from shardwise.models import SmallCNN

MODES = ("exit", "kill", "raise")


def _trained(steps, rank=0, shard=True):
    """SmallCNN (BatchNorm buffers) and AdamW (sharded moments, a step count) after
    ``steps`` identical steps: the same state at any world size."""
    torch.manual_seed(0)
    model = SmallCNN()
    if shard:
        model = sw.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 3, 16, 16, generator=g)
        F.cross_entropy(model(x), torch.arange(4) % 10).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _base(rank, world, folder):
    """Two saves: the folder holds a current and a previous checkpoint."""
    for v in (0, 1):
        model, opt = _trained(v + 1)
        sw.save_checkpoint(folder, model, opt, extra={"v": v})


def _record_steps(rank, world, folder):
    seen = []
    save._reached = seen.append
    model, opt = _trained(3)
    sw.save_checkpoint(folder, model, opt, extra={"v": 2})
    return seen


def _crash(rank, world, folder, step, victim, mode):
    def reached(name):
        if name == step and rank == victim:
            if mode == "exit":
                os._exit(3)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at {name}")

    save._reached = reached
    model, opt = _trained(3)
    try:
        sw.save_checkpoint(folder, model, opt, extra={"v": 2})
    except Exception as e:  # noqa: BLE001 - the parent checks what each rank saw
        return type(e).__name__, isinstance(e, sw.ShardwiseError)
    return "ok", True


def _loaded(folder):
    """(extra, model state, optimizer state) loaded at world 1 into an unsharded model."""
    model, opt = _trained(0, shard=False)
    extra = sw.load_checkpoint(folder, model, opt)
    return extra, model.state_dict(), opt.state_dict()


def _assert_same(a, b, where):
    assert a[0] == b[0], where
    for k, v in a[1].items():
        assert torch.equal(v, b[1][k]), (where, k)
    assert a[2]["param_groups"] == b[2]["param_groups"], where
    for i, st in a[2]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b[2]["state"][i][k]), (where, i, k)


def _contents(folder):
    """What is in the folder besides checkpoint.json: data folders and anything else."""
    entries = sorted(os.listdir(folder))
    data = {e for e in entries if e.startswith("data-")}
    other = [e for e in entries if e not in data and e != "checkpoint.json"]
    return data, other


def _named(folder):
    return save._committed_data(folder)


@pytest.mark.slow
def test_a_crash_at_every_step_keeps_the_new_or_the_previous_checkpoint(tmp_path):
    base = str(tmp_path / "base")
    run_ranks(_base, 2, base)
    old = _loaded(base)
    previous = _named(base)
    untouched = _contents(base)[0]
    reference = str(tmp_path / "reference")
    run_ranks(_base, 2, reference)
    seen = run_ranks(_record_steps, 2, reference)
    new = _loaded(reference)
    assert old[0] == {"v": 1} and new[0] == {"v": 2}
    # Every step of the protocol is passed, in order; rank 1 passes the shared ones.
    assert tuple(seen[0]) == save.SAVE_STEPS
    assert set(seen[1]) < set(seen[0])

    cases = 0
    for victim in (0, 1):
        for step in seen[victim]:
            for mode in MODES:
                where = f"rank {victim} stopped by {mode} at {step!r}"
                folder = str(tmp_path / f"case-{victim}-{step}-{mode}")
                os.system(f"cp -r {base} {folder}")
                results = run_ranks(_crash, 2, folder, step, victim, mode, timeout=60,
                                    deaths_expected=True)
                cases += 1
                # The survivors (and a victim that raised) end in a ShardwiseError or
                # succeed; none hangs (run_ranks would report it).
                for r, res in enumerate(results):
                    if res is None:
                        assert r == victim and mode != "raise", where
                    elif r != victim:
                        assert res[1], (where, r, res)
                        if step in ("agreed", "tidied"):  # after the final agreement
                            assert res[0] == "ok", (where, r, res)
                committed = save.SAVE_STEPS.index(step) >= save.SAVE_STEPS.index(
                    "committed" if victim == 0 else "reports")
                got = _loaded(folder)
                _assert_same(got, new if committed else old, where)
                data, other = _contents(folder)
                if results[0] is not None:  # rank 0 lived
                    assert other == [], (where, other)
                    locked = save.SAVE_STEPS.index(step) >= save.SAVE_STEPS.index(
                        "locked" if victim == 0 else "data-tmp")
                    # Once it had the lock, it tidied: the committed data and the data
                    # it replaced (if it replaced any) are left. Before, it touched nothing.
                    want = {_named(folder), previous} if locked else untouched
                    assert data == want, (where, data, want)
                # The next save removes whatever a dead rank 0 left, and keeps the
                # checkpoint it replaces.
                before = _named(folder)
                model, opt = _trained(0, shard=False)
                sw.save_checkpoint(folder, model, opt, extra={"v": 3})
                data, other = _contents(folder)
                assert other == [] and data == {_named(folder), before}, (where, data, other)
    assert cases == 3 * (len(seen[0]) + len(seen[1]))


def _save_while_locked(rank, world, folder):
    model, opt = _trained(1)
    with pytest.raises(sw.ShardwiseError, match="is being written by another save") as err:
        sw.save_checkpoint(folder, model, opt, extra={"v": 9})
    return str(err.value)


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    folder = str(tmp_path / "ck")
    run_ranks(_base, 2, folder)
    before = _loaded(folder)
    lock = FolderLock(folder)  # another job's rank 0, in the middle of its save
    lock.acquire()
    try:
        messages = run_ranks(_save_while_locked, 2, folder)
    finally:
        lock.release()
    for m in messages:  # every rank, naming the holder
        assert f"held by pid {os.getpid()}" in m, m
    _assert_same(_loaded(folder), before, "after a refused save")
    assert not os.path.exists(os.path.join(folder, LOCK))
    # The holder gone, a save goes ahead.
    run_ranks(_base, 2, folder)


def _writer(folder, saves, keep_previous, outcomes):
    torch.set_num_threads(1)
    models = [_trained(s, shard=False) for s in (1, 2)]
    ok = refused = 0
    for i in range(saves):
        model, opt = models[i % 2]
        try:
            sw.save_checkpoint(folder, model, opt, extra={"state": i % 2},
                               keep_previous=keep_previous)
            ok += 1
        except sw.ShardwiseError as e:
            assert "is being written by another save" in str(e), str(e)
            refused += 1
    outcomes.put(("writer", ok, refused))


def _reader(folder, stop, outcomes):
    torch.set_num_threads(1)
    expected = [_trained(s, shard=False)[0].state_dict() for s in (1, 2)]
    model, opt = _trained(0, shard=False)
    loads = 0
    while not stop.is_set() or loads == 0:
        extra = sw.load_checkpoint(folder, model, opt)  # any error fails the test
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[extra["state"]][k]), k
        loads += 1
    outcomes.put(("reader", loads, 0))


@pytest.mark.parametrize("keep_previous", [True, False])
def test_concurrent_writers_and_a_reader(tmp_path, keep_previous):
    """Two jobs saving into one folder, and a third loading from it all the while: each
    save either succeeds or is refused by the lock; every load gets a whole checkpoint
    (before: a bare FileNotFoundError in 1 save of 30, "missing" in 258 loads of 615)."""
    folder = str(tmp_path / "ck")
    model, opt = _trained(1, shard=False)
    sw.save_checkpoint(folder, model, opt, extra={"state": 0})
    ctx = mp.get_context("fork")
    outcomes, stop = ctx.Queue(), ctx.Event()
    writers = [ctx.Process(target=_writer, args=(folder, 15, keep_previous, outcomes))
               for _ in range(2)]
    reader = ctx.Process(target=_reader, args=(folder, stop, outcomes))
    with forking():  # Note [forking from pytest's process] in tests/harness.py
        for p in [reader, *writers]:
            p.start()
    try:
        # Generous: 15 saves each take a few seconds at a load average of 20 on 2 cores.
        for p in writers:
            p.join(600)
        stop.set()
        reader.join(120)
    finally:
        for p in [reader, *writers]:
            if p.is_alive():  # hung: reported by the exit codes below, never left running
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in [reader, *writers]), [p.exitcode for p in
                                                               [reader, *writers]]
    results = [outcomes.get(timeout=5) for _ in range(3)]
    saved = sum(r[1] for r in results if r[0] == "writer")
    refused = sum(r[2] for r in results if r[0] == "writer")
    loads = sum(r[1] for r in results if r[0] == "reader")
    assert saved > 0 and saved + refused == 30 and loads > 0, results
    data, other = _contents(folder)
    assert other == [] and len(data) == (2 if keep_previous else 1), (data, other)


def test_a_data_file_removed_between_the_check_and_the_read(tmp_path, monkeypatch):
    """A save with ``keep_previous=False`` commits and removes the data folder a load is
    checking, between the load seeing a data file and opening it to hash it: the load
    starts again and reads the new checkpoint (before: a bare FileNotFoundError, seen
    once by test_concurrent_writers_and_a_reader in CI)."""
    folder = str(tmp_path / "ck")
    sw.save_checkpoint(folder, *_trained(1, shard=False), extra={"state": 1})
    newer = _trained(2, shard=False)
    real, raced = files.sha256_file, []

    def racing(path, *args, **kwargs):
        if not raced:  # the first data file the load hashes: the other job saves now
            raced.append(path)
            sw.save_checkpoint(folder, *newer, extra={"state": 2}, keep_previous=False)
            assert not os.path.exists(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "sha256_file", racing)
    got = _loaded(folder)
    assert raced and got[0] == {"state": 2}
    _assert_same(got, ({"state": 2}, newer[0].state_dict(), newer[1].state_dict()),
                 "after the load started again")
