"""What a background checkpoint costs the training loop, against a synchronous save.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/background_save.py \\
        [--rounds 8 --steps 3 --folder /tmp]

The reference workload (benchmarks/workloads.py ``gpt``: GPT, 6 layers, d_model 512,
vocab 8192, sequence 256, batch 4 per rank, fp32, AdamW) is sharded over the ranks and
trained. Each round measures:

- the synchronous save: ``sw.save_checkpoint(folder, model, opt)``, from a barrier to its
  return (every rank returns after the commit), the slowest rank's time;
- a background save's *call*: the time ``sw.save_checkpoint(..., background=True)``
  blocks (the checks and the staging copy);
- its *stall*: the wall time of the call plus the training steps taken until the write
  ended (at least ``--steps``), minus as many steps' time measured in the same round
  without a write in flight (``--steps`` of them; the two runs alternate which goes
  first); the slowest rank's. Whether a write is still in flight is asked of every rank
  before each step (one small all-reduce, in both runs), so all ranks take the same
  steps;
- its *extra CPU*: the same difference in this process's CPU time (every thread), the
  slowest rank's: what the save takes from training on a machine with no spare core,
  and a figure that another process's load on the machine disturbs far less than the
  wall times.

Printed: each round, then the medians over rounds with each figure's ratio to the
synchronous save (medians of the rounds' ratios). Issue 53's goal: a stall of at most 10%
of the synchronous save. The thread competes with training for the CPU: on a machine with
as many cores as ranks, what it computes (the SHA-256 of every file, the copies into the
page cache) is taken from the training steps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from step_time import GPTConfig, build  # noqa: E402
from workloads import gpt_batch  # noqa: E402

import shardwise as sw  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3,
                        help="steps timed without a write in flight, per round")
    parser.add_argument("--folder", default=None, help="where to save (default: a "
                        "temporary folder under $TMPDIR)")
    args = parser.parse_args()

    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = sw.shard(build(GPTConfig()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    batch = gpt_batch(g)
    root = [tempfile.mkdtemp(prefix="sw-bg-save-", dir=args.folder) if rank == 0 else None]
    dist.broadcast_object_list(root)
    folder = os.path.join(root[0], "ckpt")

    def step() -> float:
        started = time.perf_counter()
        model(*batch).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - started

    def anyone(flag: bool) -> bool:
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def slowest(value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    for _ in range(3):  # warm up: the optimizer state exists, the allocator settled
        anyone(False)
        step()
    sw.save_checkpoint(folder, model, opt)  # the folder, and a checkpoint to replace
    sw.save_checkpoint(folder, model, opt, background=True).wait()  # the side group

    rows = []
    for r in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        sw.save_checkpoint(folder, model, opt)
        sync = slowest(time.perf_counter() - t)

        def quiet(k: int) -> tuple[float, float]:
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            for _ in range(k):
                anyone(False)
                step()
            return time.perf_counter() - started, time.process_time() - cpu

        def loud() -> tuple[float, float, float, int]:
            dist.barrier()
            started, cpu = time.perf_counter(), time.process_time()
            handle = sw.save_checkpoint(folder, model, opt, background=True)
            call = time.perf_counter() - started
            k = 0
            while anyone(not handle.done()) or k < args.steps:
                step()
                k += 1
            handle.wait()
            return time.perf_counter() - started, time.process_time() - cpu, call, k

        # Alternate which goes first, so that a drift of the machine's load hits both.
        if r % 2 == 0:
            without, without_cpu = quiet(args.steps)
            with_write, with_cpu, call, k = loud()
        else:
            with_write, with_cpu, call, k = loud()
            without, without_cpu = quiet(args.steps)
        per_step = without / args.steps
        stall = slowest(with_write - k * per_step)
        cpu = slowest(with_cpu - k * without_cpu / args.steps)
        call, per_step = slowest(call), slowest(per_step)
        rows.append((sync, call, k, stall, cpu, per_step))
        if rank == 0:
            print(f"round {r}: sync {sync * 1e3:.0f} ms; background: call {call * 1e3:.0f} "
                  f"ms, {k} steps ({per_step * 1e3:.0f} ms each without a write), stall "
                  f"{stall * 1e3:.0f} ms = {100 * stall / sync:.1f}% of sync, extra CPU "
                  f"{cpu * 1e3:.0f} ms = {100 * cpu / sync:.1f}%", flush=True)
    if rank == 0:
        sync, call, steps, stall, cpu, base = (statistics.median(c) for c in zip(*rows))
        params = sum(p.numel() for p in model.parameters())
        print(f"\nworld {world}, {params / 1e6:.1f}M parameters, AdamW, {os.cpu_count()} "
              f"CPUs; medians of {args.rounds} rounds:")
        print("| sync save | background call | call / sync | stall | stall / sync | "
              "extra CPU | extra CPU / sync | steps timed | step without a write |")
        print("|---|---|---|---|---|---|---|---|---|")
        ratio = [statistics.median(r[i] / r[0] for r in rows) for i in (1, 3, 4)]
        print(f"| {sync * 1e3:.0f} ms | {call * 1e3:.0f} ms | {100 * ratio[0]:.1f}% | "
              f"{stall * 1e3:.0f} ms | {100 * ratio[1]:.1f}% | {cpu * 1e3:.0f} ms | "
              f"{100 * ratio[2]:.1f}% | {steps:.0f} | {base * 1e3:.0f} ms |")
        shutil.rmtree(root[0], ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
