"""Long runs that lose ranks and come back (docs/long-runs.md).

- ``sw.Resumable`` (Note [resumable runs]): a run that fails at world 3 resumes at world 2
  from its newest checkpoint that loads, skipping a partial and a corrupt one, and ends
  with the bits of an uninterrupted run; failures carry the step reached, and a loop that
  keeps failing says so; a second job on the folder and a world size that does not divide
  M are refused before anything loads.
- ``sw.init_distributed`` under torchrun's shared store (Note [a store per attempt]): a
  restart never reads a key an earlier attempt left.
- Two torchrun agents of 2 ranks (slow): one is killed at a random step and the other
  finishes at world 2; an agent that joins late brings the job back to world 4. The
  reproducible mode ends bit-identical to an uninterrupted world-4 run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import subprocess
import sys

import elastic_agents
import elastic_script as es
import pytest
import torch
from harness import LogCollector, run_ranks

import shardwise as sw
from shardwise.models import GPT


def _build(world: int):
    torch.manual_seed(0)
    model = sw.shard(GPT(es.CFG), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return model, opt, sched


def _train(run, model, opt, sched, total: int, fail_at: int | None = None) -> list[float]:
    losses = []
    for step in run.steps(total):
        if step == fail_at:
            raise RuntimeError("the loader lost its file")
        per_micro_batch = []
        mine = sw.micro_batches(es.global_batch(step), es.M)
        for i, (x, y) in enumerate(mine):
            last = i == len(mine) - 1
            with contextlib.nullcontext() if last else sw.no_sync(model):
                loss = model(x, y)
                loss.backward()
            per_micro_batch.append(loss.detach())
        opt.step()
        opt.zero_grad()
        sched.step()
        run.state["seen"] = run.state.get("seen", 0) + 1
        losses.append(sw.global_mean(per_micro_batch))
    return losses


def _fails_at_world_3(rank: int, world: int, folder: str) -> list[str]:
    model, opt, sched = _build(world)
    with pytest.raises(sw.ShardwiseError, match=r"does not divide micro_batches=8.*"
                                                r"\[1, 2, 4, 8\]. Nothing was loaded"):
        sw.Resumable(folder, model, opt, every=3, micro_batches=8)
    os.environ.update(TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="3")
    notes = []
    with pytest.raises(RuntimeError) as failed, \
            sw.Resumable(folder, model, opt, every=3, scheduler=sched, micro_batches=es.M) as run:
        assert run.step == 0 and run.resumed_from is None
        _train(run, model, opt, sched, 10, fail_at=7)
    notes += failed.value.__notes__
    # A restart (its agent's first) that fails at the same step again: no progress.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    model, opt, sched = _build(world)
    with pytest.raises(RuntimeError) as failed, \
            sw.Resumable(folder, model, opt, every=3, scheduler=sched, micro_batches=es.M) as run:
        assert run.step == 6
        _train(run, model, opt, sched, 10, fail_at=7)
    notes += failed.value.__notes__
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        del os.environ[name]
    torch.distributed.barrier()
    if rank == 0:  # a save killed before its commit, and a checkpoint that was damaged
        os.makedirs(os.path.join(folder, "step-00000009", "data-killed"))
        os.makedirs(os.path.join(folder, "step-00000008"))
        with open(os.path.join(folder, "step-00000008", "checkpoint.json"), "w") as f:
            f.write("{not json")
    return notes


def _resumes_at_world_2(rank: int, world: int, folder: str, fresh: str):
    model, opt, sched = _build(world)
    logs = LogCollector()
    logging.getLogger("shardwise").addHandler(logs)
    with sw.Resumable(folder, model, opt, every=3, scheduler=sched,
                      micro_batches=es.M) as run:
        assert run.resumed_from == os.path.join(folder, "step-00000006")
        assert (run.step, run.state, sched.last_epoch) == (6, {"seen": 6}, 6)
        # Another job pointed at the same folder is refused while this one holds it.
        with pytest.raises(sw.ShardwiseError, match="being written by another save"):
            sw.Resumable(folder, model, opt, every=3)
        resumed = _train(run, model, opt, sched, 10)
    kept = sorted(e for e in os.listdir(folder) if e.startswith("step-"))
    after = es.digest(model, opt)
    # A model the checkpoints do not fit (here: one layer fewer) is refused, naming each
    # checkpoint; starting over would silently train from scratch and prune them.
    other = sw.shard(GPT(dataclasses.replace(es.CFG, n_layer=1)), reproducible=True)
    with pytest.raises(sw.ShardwiseError, match=r"no checkpoint in .* loads(.|\n)*"
                                                r"step-00000010(.|\n)*step-00000009"):
        sw.Resumable(folder, other, every=3)
    assert sorted(e for e in os.listdir(folder) if e.startswith("step-")) == kept
    model, opt, sched = _build(world)
    with sw.Resumable(fresh, model, opt, every=5, scheduler=sched) as run:
        uninterrupted = _train(run, model, opt, sched, 10)
    logging.getLogger("shardwise").removeHandler(logs)
    return resumed, uninterrupted[6:], after, es.digest(model, opt), kept, "\n".join(logs.messages)


def test_a_run_that_failed_at_world_3_resumes_at_world_2_with_the_same_bits(tmp_path):
    folder, fresh = str(tmp_path / "run"), str(tmp_path / "fresh")
    notes = run_ranks(_fails_at_world_3, 3, folder)
    first, second = notes[0][0], notes[0][1]
    assert "failed at step 7 on rank 0 (last checkpoint: step 6" in first
    assert "This was restart 0 of the 3 torchrun allows" in first
    assert "2 attempts in a row failed without getting past step 6" in second
    assert len(os.listdir(os.path.join(folder, "failures"))) == 3  # one file per rank

    got = run_ranks(_resumes_at_world_2, 2, folder, fresh)
    resumed, uninterrupted, after, reference, kept, logs = got[0]
    assert resumed == uninterrupted and after == reference
    assert got[1][2] == after
    assert "skipping" in logs and "step-00000008" in logs           # the damaged one
    assert "previous attempt failed at step 7" in logs
    assert "resumed at step 6" in logs and "saved at world size 3, now 2" in logs
    assert kept == ["step-00000009", "step-00000010"]  # keep=2; the partial 9 rewritten


def _store_script(delay_rank0: float, folder: str) -> str:
    # The ranks start together once every one has imported torch and shardwise (40 s on
    # a loaded machine, issue 51 item 9), and rank 0 delay_rank0 later: the others reach
    # the store first. The 20 s then time the rendezvous alone, not the imports. Not
    # longer: with a store without attempts, gloo's retries found rank 0's new address
    # within 60 s, and the test passed.
    return (f"import os, time, torch, torch.distributed as d, shardwise as sw\n"
            f"folder, rank = {folder!r}, int(os.environ['RANK'])\n"
            f"open(os.path.join(folder, str(rank)), 'w').close()\n"
            f"while len(os.listdir(folder)) < int(os.environ['WORLD_SIZE']):\n"
            f"    time.sleep(0.05)\n"
            f"if rank == 0:\n"
            f"    time.sleep({delay_rank0})\n"
            f"sw.init_distributed(timeout=20)\n"
            f"x = torch.ones(1); d.all_reduce(x); print('sum', int(x.item()))\n"
            f"d.destroy_process_group()\n")


# torchrun's agent store, hosted in a process of its own: a store made in pytest's
# process outlived a failure of this test in its traceback, and every rank forked later
# inherited its server thread (Note [forking from pytest's process] in tests/harness.py).
_STORE_HOST = ("import datetime, sys, torch.distributed as d\n"
               "s = d.TCPStore('127.0.0.1', 0, is_master=True,\n"
               "               timeout=datetime.timedelta(seconds=300))\n"
               "print(s.port, flush=True)\n"
               "sys.stdin.read()  # until the test closes it, or its process ends\n")


def test_a_restart_reads_no_key_of_an_earlier_attempt(tmp_path):
    # torchrun's shared store outlives restarts. Before Note [a store per attempt], the
    # second attempt's rank 1 read rank 0's address from the first attempt and dialled
    # a dead process: gloo's connectFullMesh failed, and the job hung past its timeout.
    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)

    def attempt(world: int, delay_rank0: float) -> list[str]:
        folder = tmp_path / f"attempt-{world}"
        folder.mkdir()
        procs = [subprocess.Popen(
            [sys.executable, "-c", _store_script(delay_rank0, str(folder))],
            env=dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(r), TORCHELASTIC_USE_AGENT_STORE="True",
                     TORCHELASTIC_RUN_ID="job"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world)]
        try:
            return [p.communicate(timeout=300)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
                p.wait()

    try:
        port = int(host.stdout.readline())
        assert all("sum 3" in out for out in attempt(3, 0.0))
        outs = attempt(2, 2.0)  # rank 0 comes late: the others see the old keys first
        assert all("sum 2" in out for out in outs), outs
    finally:
        host.kill()
        host.wait()


# -- two torchrun agents (slow) ---------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reproducible", "default"])
def test_losing_an_agent_the_other_finishes_at_world_2(tmp_path, mode):
    total, every = 14, 3
    kill_at = random.randint(every + 1, total - 4)
    print(f"killing agent 1 after step {kill_at}")  # shown when the test fails: replayable
    run = elastic_agents.shrink(str(tmp_path), total, every, kill_at,
                                ("--default",) if mode == "default" else ())
    # The default mode's sums depend on the world size. Measured at f33d709 (4 runs of
    # `benchmarks/elastic.py shrink --default`): the losses after the restart at world 2
    # differ from the world-4 run's by at most 7.6e-8 relative. 1e-5 leaves two orders of
    # magnitude for other x86 CPUs and kill points, and is far below a wrong resume (a
    # step's loss moves by more than 1e-3 here).
    found = elastic_agents.problems(run, total, every, exact=mode == "reproducible",
                                    rel=1e-5)
    assert not found, f"kill after step {kill_at}: {found}\n{run.text[-4000:]}"


@pytest.mark.slow
def test_an_agent_that_joins_late_brings_the_job_back_to_world_4(tmp_path):
    total, every = 16, 3
    join_after = random.randint(every + 1, 8)
    print(f"agent 1 joins after step {join_after}")
    run = elastic_agents.grow(str(tmp_path), total, every, join_after)
    found = elastic_agents.problems(run, total, every, exact=True)
    assert not found, f"join after step {join_after}: {found}\n{run.text[-4000:]}"
    # Steps before the restart ran at world 2: the same bits there too.
    got, want = elastic_agents.losses(run.text), elastic_agents.losses(run.alone)
    assert {s: v for s, (v, _) in got.items()} == {s: v for s, (v, _) in want.items()}
