"""Where a training step's time goes, for DDP and for shardwise, on one workload.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/step_profile.py \\
        [--workload cnn] [--steps 20] [--reproducible]

Both systems train the same model (a workload of ``workloads.py``) on the same batch,
alternating step by step after a warm-up; ``torch.profiler`` records every timed step
(CPU activities). Printed for rank 0, per system and per step on average: wall time and
the self time of the operators, grouped as compute (``aten::`` operators but copies),
copies (``aten::copy_``, ``cat``, ``fill_``, ``zero_``, allocations, clones), issuing
communication (``gloo:*`` and ``c10d::*`` calls: the time to hand a message or a
collective to gloo, not the wait for it) and other operators (the largest printed: the
DTensor dispatch, autograd functions, the optimizer's bookkeeping); then the number of
communication calls. The last column is wall time minus all operators' self time: Python
(hooks, shardwise's own code), waiting for peers (``Work.wait`` is not an operator) and
time the process was not scheduled (2 ranks share 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from workloads import WORKLOADS

import shardwise as sw

COPIES = {"aten::copy_", "aten::cat", "aten::fill_", "aten::zero_", "aten::zeros",
          "aten::empty", "aten::empty_strided", "aten::clone", "aten::contiguous"}


def category(name: str) -> str:
    if name.startswith(("gloo:", "c10d::", "c10d:", "nccl:")) or "wait" in name.lower() \
            or name.startswith(("ProcessGroup", "dist.")):
        return "communication"
    if name in COPIES:
        return "copies"
    if name.startswith("aten::"):
        return "compute"
    return "other ops"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="cnn", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reproducible", action="store_true",
                        help="also profile shardwise with reproducible=True (one micro-batch "
                             "per rank)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    w = WORKLOADS[args.workload]
    systems = {}
    base = w.build()
    systems["ddp"] = DDP(base)
    model = w.build()
    systems["shardwise"] = sw.shard(model, units=w.units(model))
    if args.reproducible:
        model = w.build()
        systems["reproducible"] = sw.shard(model, units=w.units(model), reproducible=True)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in systems.items()}
    g = torch.Generator().manual_seed(1 + rank)
    batch = w.batch(g)

    def step(name: str) -> None:
        w.loss_fn(systems[name], batch).backward()
        opts[name].step()
        opts[name].zero_grad()

    for _ in range(3):
        for name in systems:
            step(name)
    totals: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    calls: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    others: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    walls: dict[str, float] = collections.Counter()
    for i in range(args.steps):
        for name in (list(systems) if i % 2 == 0 else list(reversed(systems))):
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                step(name)
                walls[name] += time.perf_counter() - start
            for e in prof.key_averages():
                cat = category(e.key)
                totals[name][cat] += e.self_cpu_time_total / 1e3
                if cat == "communication":
                    calls[name][e.key] += e.count
                if cat == "other ops":
                    others[name][e.key] += e.self_cpu_time_total / 1e3
    if rank == 0:
        n = args.steps
        print(f"{args.workload}, {dist.get_world_size()} ranks, {n} profiled steps each, "
              f"rank 0, milliseconds per step")
        print("| system | wall | compute | copies | issuing communication | other ops | "
              "Python, waits, unscheduled |")
        print("|---|---|---|---|---|---|---|")
        for name in systems:
            t = {k: v / n for k, v in totals[name].items()}
            wall = walls[name] * 1e3 / n
            rest = wall - sum(t.values())
            print(f"| {name} | {wall:.1f} | {t['compute']:.1f} | {t['copies']:.1f} | "
                  f"{t['communication']:.1f} | {t['other ops']:.1f} | {rest:.1f} |")
        for name in systems:
            top = ", ".join(f"{k} {v / n:.1f}" for k, v in calls[name].most_common(8))
            print(f"{name} communication calls per step: {top}")
            top = ", ".join(f"{k} {v / n:.1f} ms" for k, v in others[name].most_common(5))
            print(f"{name} largest other ops per step: {top}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
