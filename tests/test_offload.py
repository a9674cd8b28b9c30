"""Offload (``sw.Offload``, engine/groups/offload/): every placement trains to the same bits as
no offload, at 2 and 3 ranks and on a hybrid mesh, and what cannot work is refused.

Exactness is bit for bit, not within a tolerance: an offloaded state holds the same values
as the device's would, the optimizer runs the same kernels on them (unit by unit for the
disk tier, which for per-parameter optimizers is the same arithmetic), and gathers read
the same compute-dtype copy. On this CPU-only machine every tier is host memory, so the
copies between tiers are real copies between separate tensors, and the disk tier is real
files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time

import pytest
import torch
from harness import forking, run_ranks
from parity import GPT_CFG, gpt_batches
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.models import GPT


@pytest.fixture
def folder():
    """A folder for the disk tier, removed after the test."""
    path = tempfile.mkdtemp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


PLACEMENTS = [(None, "cpu"), ("cpu", "cpu"), (None, "disk"), ("cpu", "disk"),
              ("disk", "disk")]


def _offload(params, optimizer, folder):
    if params is None and optimizer is None:
        return None
    disk = "disk" in (params, optimizer)
    return sw.Offload(params=params, optimizer=optimizer, folder=folder if disk else None)


def _state(model, opt) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter, gradient and optimizer state, copied."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param/{name}"] = p.to_local().detach().clone()
        for k, v in opt.state[p].items():
            v = v.to_local() if isinstance(v, DTensor) else v
            out[f"opt/{name}/{k}"] = v.detach().clone()
    return out


def _train(variant: str, placement, folder, mesh=None, steps: int = 3):
    """A few steps of ``variant``; losses and the final local state."""
    torch.manual_seed(0)
    kwargs = {}
    if variant == "mixed":
        kwargs["mixed_precision"] = sw.MixedPrecision(param_dtype=torch.bfloat16)
    if variant == "reproducible":
        kwargs["reproducible"] = True
    model = sw.shard(GPT(GPT_CFG), offload=_offload(*placement, folder), mesh=mesh, **kwargs)
    if variant == "mixed":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    everyone = list(zip(*[gpt_batches(r, steps) for r in range(world)]))
    losses = []
    for step in range(steps):
        x, y = everyone[step][rank]
        if variant == "reproducible":  # every rank's batches make the global one
            global_batch = tuple(torch.cat(t) for t in zip(*everyone[step]))
            parts = sw.micro_batches(global_batch, 2 * world)
        else:
            parts = [(x[:1], y[:1]), (x[1:], y[1:])]  # two micro-batches, no_sync
        per = []
        for i, (xb, yb) in enumerate(parts):
            last = i == len(parts) - 1
            with contextlib.nullcontext() if last else sw.no_sync(model):
                loss = model(xb, yb)
                (loss if variant == "reproducible" else loss / len(parts)).backward()
            per.append(loss.detach())
        if variant == "plain":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            sw.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(per).float())
    if placement == ("disk", "disk") and variant == "plain":
        _check_tiers(model)
    return torch.stack(losses), _state(model, opt)


def _check_tiers(model) -> None:
    """Where the engine says the states are: AdamW's two moments were moved into the
    files beside the master shards and their gradients (each one shard's size; the
    reduced rows were written straight to the gradients' file, Note [reduced rows
    written once]); nothing stays on the device."""
    view = sw.inspect(model)
    assert view.offload.startswith("params on disk, optimizer state on disk"), view.offload
    assert {(g.params_tier, g.optimizer_tier) for u in view.units for g in u.groups} == \
        {("disk", "disk")}
    assert view.tier_bytes == {"device": 0, "cpu": 0, "disk": 4 * view.param_bytes}, \
        (view.tier_bytes, view.param_bytes)


def _same(a, b, what: str) -> None:
    la, sa = a
    lb, sb = b
    assert torch.equal(la, lb), f"{what}: losses {la.tolist()} != {lb.tolist()}"
    assert sa.keys() == sb.keys(), what
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), f"{what}: {k} differs"


def _every_placement(rank, world, folder):
    checked = 0
    for variant in ("plain", "mixed", "reproducible"):
        ref = _train(variant, (None, None), folder)
        for placement in PLACEMENTS:
            _same(_train(variant, placement, folder), ref, f"{variant} {placement}")
            checked += 1
    # Nothing stays in the folder: the files are unlinked as soon as they are mapped.
    left = [f for f in os.listdir(os.path.join(folder, f"rank{rank}")) if f != ".lock"]
    assert left == [], left
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_every_placement_trains_to_the_same_bits(world, folder):
    assert run_ranks(_every_placement, world, folder) == [15] * world


def _hybrid(rank, world, folder):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = _train("plain", (None, None), folder, mesh=mesh)
    for placement in [(None, "cpu"), ("disk", "disk")]:
        _same(_train("plain", placement, folder, mesh=mesh), ref, f"hybrid {placement}")


def test_hybrid_mesh_offloaded_trains_to_the_same_bits(folder):
    run_ranks(_hybrid, 4, folder)


def _reduced_rows_written_once(rank, world, folder):
    """Note [reduced rows written once]: after ``zero_grad()`` a disk-offloaded group's
    reduced rows go straight to the gradients' file, and each gradient views its slot
    there (no file of parked rows, 4 shards' bytes on disk, not 5); backward passes
    summed without ``no_sync`` or ``zero_grad`` park theirs and add them at the end, to
    the same bits as in memory."""
    from shardwise.engine.iteration.state import model_state

    runs = {}
    for placement in [(None, None), ("disk", "disk"), ("cpu", "cpu")]:
        torch.manual_seed(0)
        model = sw.shard(GPT(GPT_CFG), offload=_offload(*placement, folder))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = list(gpt_batches(rank, 4))
        losses = []
        for step in range(2):
            for x, y in batches[2 * step:2 * step + 2]:  # two synced backward passes
                loss = model(x, y)
                loss.backward()
                losses.append(loss.detach())
                if placement != (None, None) and step == 0 and len(losses) == 1:
                    groups = [g for u in model_state(model).units for g in u.groups]
                    assert all(g.storage._parked is None for g in groups)
                    for g in groups:
                        # On disk, the gradients' file; on the CPU tier, the one host
                        # tensor the group's rows were parked in (not a copy each).
                        where = {p.shard.grad.to_local().untyped_storage().data_ptr()
                                 for p in g.params}
                        if placement == ("disk", "disk"):
                            assert where == {g.storage._grads.untyped_storage().data_ptr()}
                        assert len(where) == 1, g.unit_name
            sw.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
        if placement == ("disk", "disk"):
            view = sw.inspect(model)
            # The second backward of each step parked its rows (the first's gradients
            # were there): a file the size of the shard for each group.
            assert view.tier_bytes["disk"] == 5 * view.param_bytes
        runs[placement] = (torch.stack(losses), _state(model, opt))
    for placement in [("disk", "disk"), ("cpu", "cpu")]:
        _same(runs[placement], runs[(None, None)], f"summed backward passes, {placement}")


def test_reduced_rows_are_written_once_to_the_gradients_file(folder):
    run_ranks(_reduced_rows_written_once, 2, folder)


def _evict(folder) -> None:
    """Write this process's tier files back and drop them from the page cache (their
    descriptors are in /proc/self/fd; the files are unlinked)."""
    where = os.path.realpath(folder)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(where) and target.endswith(".bin (deleted)"):
            os.fsync(int(fd))
            os.posix_fadvise(int(fd), 0, 0, os.POSIX_FADV_DONTNEED)


def _disk_reads() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def _backward_reads_only_shards(rank, world, folder):
    """Note [writes that read nothing]: from a cold page cache, a forward and backward
    read the master shards their gathers stage and nothing more; writing the reduced rows
    into the gradients' file read the old gradients' pages first when it went through
    the mapping (twice the shards' bytes)."""
    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG), offload=_offload("disk", "disk", folder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = list(gpt_batches(rank, 2))
    for x, y in batches:
        _evict(folder)
        before = _disk_reads()
        model(x, y).backward()
        read = _disk_reads() - before
        opt.step()
        opt.zero_grad()
    from shardwise.engine.iteration.state import model_state

    page = os.sysconf("SC_PAGE_SIZE")
    stores = [g.storage for u in model_state(model).units for g in u.groups]
    shards = sum(-(-s.master.numel() * s.master.element_size() // page) * page
                 for s in stores)
    # A gradients' file ending inside a page: that page is read to keep its tail.
    tails = page * sum(s._grads is not None for s in stores)
    assert 0 < read <= shards + tails, (read, shards, tails)


def test_a_backward_reads_from_disk_only_the_shards_it_gathers(folder):
    run_ranks(_backward_reads_only_shards, 2, folder)


def _clip_by_one(rank, world, folder):
    """Note [clipping by one]: a norm under ``max_norm`` leaves the gradients on disk
    untouched (their pages neither read nor dirtied again), to the same bits as in
    memory, where they are multiplied by 1."""
    runs = {}
    for placement in [(None, None), ("disk", "disk")]:
        torch.manual_seed(0)
        model = sw.shard(GPT(GPT_CFG), offload=_offload(*placement, folder))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, written = [], []
        for x, y in gpt_batches(rank, 2):
            loss = model(x, y)
            loss.backward()
            losses.append(loss.detach())
            if placement == ("disk", "disk"):
                _evict(folder)
                with open("/proc/self/io") as f:
                    before = {k: int(v) for k, v in (line.split(": ") for line in f)}
            sw.clip_grad_norm_(model, 1e9)
            if placement == ("disk", "disk"):
                with open("/proc/self/io") as f:
                    after = {k: int(v) for k, v in (line.split(": ") for line in f)}
                written.append(after["write_bytes"] - before["write_bytes"])
            opt.step()
            opt.zero_grad()
        # The second clip writes nothing (the first may write a page of something lazily
        # made, such as a module's bytecode cache: far less than the gradients' files).
        assert written == [] or (written[1] == 0 and written[0] <= 4096), written
        runs[placement] = (torch.stack(losses), _state(model, opt))
    _same(runs[("disk", "disk")], runs[(None, None)], "clipped by one on disk")


def test_clipping_by_one_leaves_gradients_on_disk_untouched(folder):
    run_ranks(_clip_by_one, 2, folder)


def test_offload_arguments_are_checked():
    with pytest.raises(sw.ShardwiseError, match="'cpu'"):
        sw.Offload(params="gpu")
    with pytest.raises(sw.ShardwiseError, match="needs folder="):
        sw.Offload(optimizer="disk")
    with pytest.raises(sw.ShardwiseError, match="only used with 'disk'"):
        sw.Offload(optimizer="cpu", folder="/tmp/x")
    with pytest.raises(sw.ShardwiseError, match="farther"):
        sw.Offload(params="disk", optimizer="cpu", folder="/tmp/x")
    with pytest.raises(sw.ShardwiseError, match="farther"):
        sw.Offload(params="cpu")


def _plain(placement, folder):
    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG), offload=_offload(*placement, folder))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _steps(model, opt, first: int, count: int) -> list[float]:
    rank = torch.distributed.get_rank()
    losses = []
    for x, y in list(gpt_batches(rank, first + count))[first:]:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _save_placed(rank, world, folder, ckpt):
    for name, placement in (("device", (None, None)), ("disk", ("disk", "disk")),
                            ("cpu", (None, "cpu"))):
        model, opt = _plain(placement, folder)
        _steps(model, opt, 0, 2)
        sw.save_checkpoint(os.path.join(ckpt, name), model, opt)


def _load_placed(rank, world, folder, ckpt):
    """Every checkpoint, saved at 2 ranks on any tier, loads at 3 ranks on any tier to
    the same state, and the next step gives the same bits."""
    results = {}
    for saved in ("device", "disk", "cpu"):
        for placement in ((None, None), ("disk", "disk"), ("cpu", "cpu"), (None, "disk")):
            model, opt = _plain(placement, folder)
            sw.load_checkpoint(os.path.join(ckpt, saved), model, opt)
            if placement[1] == "disk":
                # Note [streamed load]: the loaded AdamW moments went straight into the
                # tier's files, as a step would have put them (not into memory first).
                view = sw.inspect(model)
                state = [v for p in model.parameters() for v in opt.state[p].values()
                         if isinstance(v, DTensor)]
                assert state and view.tier_bytes["disk"] >= 2 * view.param_bytes
                assert all(_in_tier_files(v) for v in state)
            losses = _steps(model, opt, 2, 1)
            results[(saved, placement)] = (torch.tensor(losses), _state(model, opt))
    ref = results[("device", (None, None))]
    for key, got in results.items():
        _same(got, ref, f"saved on {key[0]}, loaded {key[1]}")
    return len(results)


def _in_tier_files(v: DTensor) -> bool:
    """Whether a state tensor lives in a disk tier's shared file mapping (its pages come
    from /proc/self/maps lines naming a file, not anonymous memory)."""
    addr = v.to_local().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return len(fields) >= 6 and fields[5].startswith("/")
    return False


def test_checkpoints_round_trip_across_placements_and_world_sizes(folder, tmp_path):
    run_ranks(_save_placed, 2, folder, str(tmp_path))
    assert run_ranks(_load_placed, 3, folder, str(tmp_path)) == [12] * 3


class _Lookahead(torch.optim.SGD):
    """A subclass: not one of the optimizers known to step unit by unit exactly."""


def _refusals(rank, world, folder):
    placement = ("disk", "disk")
    # An optimizer not known to update each parameter on its own: refused by name, and
    # nothing changed.
    model, _ = _plain(placement, folder)
    opt = _Lookahead(model.parameters(), lr=0.1)
    before = _state(model, opt)
    x, y = next(gpt_batches(rank, 1))
    model(x, y).backward()
    with pytest.raises(sw.ShardwiseError, match="_Lookahead cannot step disk-offloaded"):
        opt.step()
    after = _state(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Step pre-hooks would run after the units stepped: refused.
    opt = torch.optim.AdamW(model.parameters())
    opt.register_step_pre_hook(lambda *a: None)
    with pytest.raises(sw.ShardwiseError, match="step pre-hooks"):
        opt.step()
    # A closure is evaluated once, and its loss returned.
    model, opt = _plain(placement, folder)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and torch.is_tensor(loss) and loss.item() > 0
    assert all(p.grad is not None for p in model.parameters())  # given back after the step
    # The fused host AdamW steps unit by unit to the same bits as on the device.
    runs = []
    for where in ((None, None), placement):
        model, _ = _plain(where, folder)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        losses = _steps(model, opt, 0, 2)
        runs.append((torch.tensor(losses), _state(model, opt)))
    _same(runs[1], runs[0], "fused AdamW on disk")


def test_what_cannot_step_disk_offloaded_state_is_refused(folder):
    run_ranks(_refusals, 2, folder)


def test_disk_folder_is_owned_and_leftovers_are_never_read(folder):
    from shardwise.engine.groups.offload.disk import DiskFolder

    path = os.path.join(folder, "rank0")
    with forking():  # Note [forking from pytest's process] in tests/harness.py
        pid = os.fork()
    if pid == 0:  # an earlier process made the folder (and died)
        try:
            DiskFolder(path)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    with open(os.path.join(path, "0000001-master.bin"), "wb") as f:
        f.write(b"\x7f" * 4096)  # what a crashed run could have left
    held = DiskFolder(path)
    assert os.listdir(path) == [".lock"]
    buf = held.buffer(1000, torch.float32, "master")
    assert torch.equal(buf.tensor, torch.zeros(1000))  # fresh, never the old bytes
    assert os.listdir(path) == [".lock"]  # unlinked as soon as mapped
    buf.tensor.fill_(2.5)
    buf.release()  # dropped from memory, kept by the file
    assert torch.equal(buf.tensor, torch.full((1000,), 2.5))
    # Another holder (another process, or this one through another descriptor).
    with pytest.raises(sw.ShardwiseError, match="in use by another process"):
        DiskFolder(path)
    # A holder killed with SIGKILL leaves the folder free and nothing in it.
    other = os.path.join(folder, "rank1")
    with forking():
        pid = os.fork()
    if pid == 0:  # the child takes the folder, fills a buffer, and waits to be killed
        try:
            DiskFolder(other).buffer(1 << 20, torch.float32, "master").tensor.fill_(1)
            with open(os.path.join(folder, "ready"), "w"):
                pass
            signal.pause()
        finally:
            os._exit(1)
    deadline = time.monotonic() + 120  # generous: the machine may be loaded
    while not os.path.exists(os.path.join(folder, "ready")):
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            raise AssertionError("the child holding the folder died before taking it")
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the child holding the folder hung before taking it")
        time.sleep(0.01)
    with pytest.raises(sw.ShardwiseError, match="in use by another process"):
        DiskFolder(other)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    DiskFolder(other)
    assert os.listdir(other) == [".lock"]


def _plan_matches(rank, world, folder):
    """The planner's bytes per tier and bytes moved per step are the engine's, for every
    placement, with a frozen unit beside trainable ones, at an uneven world size."""
    from shardwise.planning.planner import plan

    with torch.device("meta"):
        meta = GPT(GPT_CFG)
    meta.blocks[0].requires_grad_(False)
    for placement in PLACEMENTS:
        offload = _offload(*placement, folder)
        torch.manual_seed(0)
        model = GPT(GPT_CFG)
        model.blocks[0].requires_grad_(False)
        model = sw.shard(model, offload=offload)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        moved = []
        for x, y in gpt_batches(rank, 3):
            before = sw.inspect(model).moved_bytes
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
            moved.append(sw.inspect(model).moved_bytes - before)
        if rank == 0:  # the plan is rank 0's, which holds the most rows
            expected = plan(meta, world, "adamw", offload=offload)
            assert sw.inspect(model).tier_bytes == expected.tiers, placement
            # From the second step on (the first creates state and copies), every step
            # moves the same bytes.
            assert moved[1] == moved[2] == expected.moved_per_step, (placement, moved,
                                                                    expected.moved_per_step)
            assert expected.moved_minimum <= expected.moved_per_step


def test_planner_figures_equal_the_engines(folder):
    run_ranks(_plan_matches, 3, folder)


def test_plan_command_shows_bytes_per_tier(capsys):
    import json

    from shardwise.cli import main

    main(["plan", "--model", "shardwise.models:gpt", "--kwargs", '{"n_layer": 2}',
          "--world", "2", "--offload", "device,disk", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["offload"] == "params device, optimizer disk"
    assert got["tiers"]["disk"] > got["tiers"]["device"] > 0 and got["tiers"]["cpu"] == 0
    assert got["moved_per_step"] > got["moved_minimum"] > 0
    with pytest.raises(SystemExit):
        main(["plan", "--model", "shardwise.models:gpt", "--world", "2",
              "--offload", "disk,cpu"])
    assert "farther away" in capsys.readouterr().err
    assert main(["plan", "--params", "1e9", "--layers", "8", "--world", "2",
                 "--offload", "cpu,cpu"]) != 0
    assert "--offload needs --model" in capsys.readouterr().err


def test_a_full_offload_folder_says_the_real_sizes_and_cause(folder, monkeypatch):
    """Issue 41 item 10: a small buffer on a full disk said "no room for 0.0 MiB". The
    disk is made full by refusing every allocation, as a full disk does (ENOSPC), and by
    reporting no space free."""
    import errno
    from types import SimpleNamespace

    from shardwise.engine.groups.offload.disk import DiskFolder

    held = DiskFolder(os.path.join(folder, "rank0"))
    held.buffer(1000, torch.float32, "master")  # 4000 bytes, before the disk filled up

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    blocks = os.statvfs(held.path).f_frsize
    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=0, f_frsize=blocks, f_files=1000, f_favail=10))
    empty = held.buffer(0, torch.float32, "state")  # a rank with no rows: no file at all
    assert empty.tensor.numel() == 0
    with pytest.raises(sw.ShardwiseError) as err:
        held.buffer(10, torch.float32, "exp_avg")
    said = str(err.value)
    assert "0.0 MiB" not in said, said
    assert f"no room for this rank's exp_avg buffer (40 bytes, {blocks} bytes on the disk)" \
        in said or f"(40 bytes, {blocks / 1024:.3g} KiB on the disk)" in said, said
    assert "the disk is full: 0 bytes free" in said, said
    assert "already take 3.91 KiB" in said and "shardwise plan" in said, said
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=10**6, f_frsize=blocks, f_files=1000, f_favail=0))
    with pytest.raises(sw.ShardwiseError, match="no free inodes"):
        held.buffer(10, torch.float32, "exp_avg")


def _truncated_tier_file(rank, world, folder):
    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG), offload=_offload("disk", "disk", folder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = list(gpt_batches(rank, 2))
    model(*batches[0]).backward()
    opt.step()
    opt.zero_grad()
    # Another program cuts a tier file short through the process's descriptors (the files
    # are unlinked once mapped: /proc/<pid>/fd is the only way in).
    mine = os.path.realpath(os.path.join(folder, f"rank{rank}"))

    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            return ""
    fds = sorted((target(fd), fd) for fd in os.listdir("/proc/self/fd")
                 if target(fd).startswith(mine + "/") and "master" in target(fd)
                 and target(fd).endswith(".bin (deleted)"))
    assert fds, "the tier files are open"
    os.truncate(f"/proc/self/fd/{fds[0][1]}", 0)  # the first unit's master, on each rank
    with pytest.raises(sw.ShardwiseError, match="truncated from outside"):
        model(*batches[1]).backward()
        opt.step()
    return True


@pytest.mark.slow
def test_a_tier_file_truncated_from_outside_is_refused_not_a_sigbus(folder):
    """Note [tier files changed from outside]: each rank names the cut file before its
    next read of it, instead of dying of SIGBUS."""
    assert run_ranks(_truncated_tier_file, 2, folder) == [True, True]
