"""What the collective-order check costs a training step, on one model, step by step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/check_cost.py \\
        [--workload llama] [--pairs 40]

One sharded model (a workload of ``workloads.py``, the small Llama by default) trains with
the check on and off in alternating order (on, off, off, on, ...: each step of one kind
sits next to one of the other, so a drift of the machine's speed cancels). Each step is
timed on every rank after a barrier; a step's time is its slowest rank's. Printed: the
median step with the check on and off, their ratio, and the median of the paired
differences (each "on" step against its neighbouring "off" step) as a share of a step,
with the spread of those differences (quartiles). Uses only the public API and
``SHARDWISE_CHECK``, so it runs at any commit that has ``workloads.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from workloads import WORKLOADS

import shardwise as sw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="llama", choices=sorted(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = WORKLOADS[args.workload]
    model = w.build()
    model = sw.shard(model, units=w.units(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1234 + rank)
    batch = w.batch(g)  # the same batch every step: the data plays no part here

    def step(check: bool) -> float:
        os.environ["SHARDWISE_CHECK"] = "1" if check else "0"
        dist.barrier()
        start = time.perf_counter()
        w.loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        took = torch.tensor([time.perf_counter() - start])
        os.environ.pop("SHARDWISE_CHECK")
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(took)

    for i in range(args.warmup):
        step(i % 2 == 0)
    on, off, diffs = [], [], []
    for i in range(args.pairs):
        first = i % 2 == 0  # on-off, then off-on
        a = step(first)
        b = step(not first)
        t_on, t_off = (a, b) if first else (b, a)
        on.append(t_on)
        off.append(t_off)
        diffs.append((t_on - t_off) / t_off)
    if rank == 0:
        q = statistics.quantiles(diffs, n=4)
        print(f"{args.workload}, {dist.get_world_size()} ranks, {args.pairs} pairs of steps "
              f"(torch {torch.__version__})")
        print(f"check on:  median {statistics.median(on) * 1e3:.1f} ms per step")
        print(f"check off: median {statistics.median(off) * 1e3:.1f} ms per step")
        print(f"ratio of medians: {statistics.median(on) / statistics.median(off):.4f}")
        print(f"paired difference: median {statistics.median(diffs) * 100:+.2f}% of a step "
              f"(quartiles {q[0] * 100:+.2f}% to {q[2] * 100:+.2f}%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
