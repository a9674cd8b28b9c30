"""Where a training step's time goes, for DDP and for shardwise, on one workload.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/step_profile.py \\
        [--workload cnn] [--steps 20] [--reproducible] [--unchecked] [--functions]

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

``--unchecked`` also profiles shardwise with ``SHARDWISE_CHECK=0`` (the collective-order
check's share), ``--kept`` with ``reshard_after_forward=False`` (no gather in the backward).
``--compiled`` compiles every system's model whole (``torch.compile``, inductor) after
wrapping or sharding it, as ``workloads.py``'s ``_compiled`` systems do, and warms up
longer (the compile); DDP is then compiled DDP, the baseline of issue 54's item 3.
``--functions`` runs the same steps again under ``cProfile`` instead of ``torch.profiler``
(``--no-ops``: only that; ``--cpu``: CPU time of the process, robust to a loaded machine,
instead of wall time) and prints, per shardwise system and per micro-batch (a step of the
``accum`` workload runs ``--micro`` + 1 of them), the time spent in each part of shardwise's
step: the hooks as a whole, the order check (posting headers; waiting for and comparing the
peers' headers, which includes waiting for a peer that is behind), the gathers (issuing;
waiting and copying out, which includes the order check's settle before an exchange's data),
the gradients' copy into the reduction buffer (the accumulation under ``no_sync``), the
reduce-scatter and publishing at the synced backward's end; then the largest shardwise
functions by own time. cProfile's own overhead inflates Python-heavy parts: compare systems,
not absolute figures.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from workloads import WORKLOADS

import shardwise as sw

# (label, [(file suffix, function name)]): each part's cumulative time is the sum over its
# functions (nested ones are not both listed, so a part is not counted twice).
PARTS = [
    ("hooks, all of shardwise's forward and backward work",
     [("engine/iteration/state.py", "on_pre_forward"),
      ("engine/iteration/state.py", "on_post_forward"),
      ("engine/iteration/state.py", "on_pre_backward"),
      ("engine/iteration/state.py", "on_post_backward"),
      ("engine/iteration/state.py", "finish_backward")]),
    ("order check: post headers", [("comm/channel.py", "post")]),
    ("order check: settle (wait for + compare peers' headers)", [("comm/channel.py", "settle")]),
    ("order check: note (OrderCheck.unit/end_forward/backward)",
     [("comm/order_check.py", "unit"), ("comm/order_check.py", "backward")]),
    ("gather: issue (start_gather)", [("engine/iteration/unit.py", "start_gather")]),
    ("gather: wait + copy-out (wait_gather, incl. settle)",
     [("engine/groups/flat.py", "wait_gather")]),
    ("gradients into the reduction buffer (Reduction.start)",
     [("engine/groups/reduce.py", "start")]),
    ("reshard (free full params)", [("engine/iteration/unit.py", "reshard")]),
    ("synced end: reduce-scatter wait + publish",
     [("engine/iteration/state.py", "_publish_gradients")]),
    ("model checks (check_model)", [("engine/iteration/model_check.py", "check_model")]),
    ("reproducible: a micro-batch's term (ExactReduction.start, incl. the add passes)",
     [("engine/groups/exact_reduction.py", "start")]),
    ("reproducible: of which the add passes (add_pieces)", [("exact/partial.py", "add_pieces")]),
    ("reproducible: the exchange's sums (Exchange.result)", [("exact/partial.py", "result")]),
]

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
    parser.add_argument("--unchecked", action="store_true",
                        help="also profile shardwise with SHARDWISE_CHECK=0")
    parser.add_argument("--functions", action="store_true",
                        help="also time shardwise's parts with cProfile (see above)")
    parser.add_argument("--kept", action="store_true",
                        help="also profile shardwise with reshard_after_forward=False")
    parser.add_argument("--cpu", action="store_true",
                        help="--functions: CPU time (time.process_time: every thread of the "
                             "process, waits for peers not counted), not wall time; robust "
                             "to a loaded machine")
    parser.add_argument("--no-ops", action="store_true",
                        help="skip the torch.profiler table (with --functions)")
    parser.add_argument("--compiled", action="store_true",
                        help="compile every system's model whole (torch.compile) first")
    parser.add_argument("--micro", type=int, default=4,
                        help="accum: micro-batches under no_sync before the synced one")
    args = parser.parse_args()
    import workloads
    workloads.MICRO = args.micro
    micro = args.micro + 1 if args.workload == "accum" else 1
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
    if args.unchecked:
        model = w.build()
        systems["unchecked"] = sw.shard(model, units=w.units(model))
    if args.kept:
        model = w.build()
        systems["kept"] = sw.shard(model, units=w.units(model), reshard_after_forward=False)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in systems.items()}
    if args.compiled:
        systems = {k: torch.compile(m) for k, m in systems.items()}
    g = torch.Generator().manual_seed(1 + rank)
    batch = w.batch(g)

    def step(name: str) -> None:
        if name == "unchecked":
            os.environ["SHARDWISE_CHECK"] = "0"
        else:
            os.environ.pop("SHARDWISE_CHECK", None)
        w.loss_fn(systems[name], batch).backward()
        opts[name].step()
        opts[name].zero_grad()

    for _ in range(6 if args.compiled else 3):  # a compile's recompiles settle by then
        for name in systems:
            step(name)
    totals: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    calls: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    others: dict[str, collections.Counter] = {n: collections.Counter() for n in systems}
    walls: dict[str, float] = collections.Counter()
    for i in range(0 if args.no_ops else args.steps):
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
    if rank == 0 and not args.no_ops:
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
    if args.functions:
        functions(systems, step, args.steps, micro, rank, args.cpu)
    dist.destroy_process_group()


def functions(systems: dict, step, steps: int, micro: int, rank: int, cpu: bool) -> None:
    """Time shardwise's parts with cProfile, per micro-batch (see the module's text)."""
    clock = time.process_time if cpu else time.perf_counter
    profiles = {n: cProfile.Profile(clock) for n in systems if n != "ddp"}
    walls: dict[str, float] = collections.Counter()
    for i in range(steps):
        for name in (list(systems) if i % 2 == 0 else list(reversed(systems))):
            dist.barrier()
            prof = profiles.get(name)
            start = clock()
            if prof is not None:
                prof.enable()
            step(name)
            if prof is not None:
                prof.disable()
            walls[name] += clock() - start
    if rank != 0:
        return
    per = steps * micro
    kind = "CPU" if cpu else "wall"
    print(f"\ncProfile, rank 0, {steps} steps of {micro} micro-batches, {kind} milliseconds "
          f"per micro-batch (ddp unprofiled: {walls['ddp'] * 1e3 / per:.1f} ms)")
    names = list(profiles)
    print("| part | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    print(f"| {kind} (profiled) | " + " | ".join(f"{walls[n] * 1e3 / per:.1f}" for n in names)
          + " |")
    tables = {n: pstats.Stats(p).stats for n, p in profiles.items()}  # type: ignore[attr-defined]

    def cumulative(n: str, funcs: list[tuple[str, str]]) -> float:
        return sum(v[3] for (f, _, fn), v in tables[n].items()
                   if "shardwise" in f and any(f.endswith(s) and fn == name
                                               for s, name in funcs))
    for label, funcs in PARTS:
        print(f"| {label} | " + " | ".join(f"{cumulative(n, funcs) * 1e3 / per:.2f}"
                                           for n in names) + " |")
    for n in names:
        own = sorted(((v[2], f"{f.split('shardwise/')[-1]}:{fn}", v[1])
                      for (f, _, fn), v in tables[n].items() if "shardwise" in f),
                     reverse=True)[:10]
        print(f"{n} largest own times per micro-batch: " + ", ".join(
            f"{where} {t * 1e3 / per:.2f} ms ({c / per:.0f} calls)" for t, where, c in own))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
