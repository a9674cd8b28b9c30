"""What the collective-order check costs a training step, on one model, step by step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/check_cost.py \\
        [--workload llama] [--pairs 40]
    ... benchmarks/check_cost.py --sizes nano,small,ref [--micro 4] [--pairs 20]
    ... benchmarks/check_cost.py --headers 2000

One sharded model (a workload of ``workloads.py``, the small Llama by default) trains with
the check on and off in alternating order (on, off, off, on, ...: each step of one kind
sits next to one of the other, so a drift of the machine's speed cancels). Each step is
timed on every rank after a barrier; a step's time is its slowest rank's. Printed: the
median step with the check on and off, their ratio, and the median of the paired
differences (each "on" step against its neighbouring "off" step) as a share of a step,
with the spread of those differences (quartiles), and the order-check headers posted per
step (Note [checks ride the exchanges] in comm/channel.py) with the paired difference
per header in microseconds.

``--sizes`` runs the same on ``shardwise.models.GPT`` s of growing size instead, each
step ``--micro`` micro-batches (all but the last under ``sw.no_sync``, as nanoGPT's loop
does): ``nano`` is nanoGPT's CPU configuration (shakespeare_char, 4 layers, 4 heads,
width 128, vocab 65, sequence 64, batch 12: 0.8M parameters), ``small`` 4 layers of 256
(sequence 128, batch 8), ``ref`` step_time.py's reference GPT (6 layers of 512, sequence
256, batch 1: the reference's 4 sequences per rank in 4 micro-batches). ``--headers N``
times one header's messages through ``dist.isend``/``irecv`` and straight through the
process group (Note [header cost] in comm/channel.py), then N headers posted and settled
back to back with no model (the check's own cost per header: no compute to overlap).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from workloads import WORKLOADS

import shardwise as sw
from shardwise.comm.channel import END_FORWARD
from shardwise.engine.iteration.state import model_state
from shardwise.models import GPT, GPTConfig

# name: (GPTConfig fields, batch per micro-batch)
SIZES = {
    "nano": (dict(vocab_size=65, seq_len=64, n_layer=4, n_head=4, d_model=128), 12),
    "small": (dict(vocab_size=8192, seq_len=128, n_layer=4, n_head=4, d_model=256), 8),
    "ref": (dict(), 1),
}


def paired(step, pairs: int, warmup: int) -> tuple[list[float], list[float], list[float]]:
    """``step(check)`` in on-off, off-on pairs: the on times, off times, differences."""
    for i in range(warmup):
        step(i % 2 == 0)
    on, off, diffs = [], [], []
    for i in range(pairs):
        first = i % 2 == 0  # on-off, then off-on
        a = step(first)
        b = step(not first)
        t_on, t_off = (a, b) if first else (b, a)
        on.append(t_on)
        off.append(t_off)
        diffs.append(t_on - t_off)
    return on, off, diffs


def timed(model, run) -> callable:
    """A step function for :func:`paired`: ``run()`` with the check on or off, timed on
    every rank after a barrier (its slowest rank's time); counts the headers posted."""
    channel = model_state(model).comm.channel
    counts: list[int] = []
    cpu: dict[bool, list[float]] = {True: [], False: []}

    def step(check: bool) -> float:
        os.environ["SHARDWISE_CHECK"] = "1" if check else "0"
        dist.barrier()
        before = channel.headers
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        took = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu])
        if check:
            counts.append(channel.headers - before)
        os.environ.pop("SHARDWISE_CHECK")
        # A step lasts as long as its slowest rank; CPU time: the mean over ranks.
        dist.all_reduce(took[:1], op=dist.ReduceOp.MAX)
        dist.all_reduce(took[1:], op=dist.ReduceOp.SUM)
        cpu[check].append(float(took[1]) / dist.get_world_size())
        return float(took[0])
    step.counts = counts  # type: ignore[attr-defined]
    step.cpu = cpu  # type: ignore[attr-defined]
    return step


def summary(name: str, on, off, diffs, headers: int, cpu: dict[bool, list[float]]) -> str:
    rel = [d / o for d, o in zip(diffs, off)]
    q = statistics.quantiles(rel, n=4)
    per = statistics.median(diffs) / headers * 1e6 if headers else float("nan")
    cpu_on, cpu_off = statistics.median(cpu[True]), statistics.median(cpu[False])
    return (f"| {name} | {statistics.median(on) * 1e3:.1f} | {statistics.median(off) * 1e3:.1f} "
            f"| {statistics.median(rel) * 100:+.2f}% ({q[0] * 100:+.2f}% to {q[2] * 100:+.2f}%) "
            f"| {headers} | {per:.0f} | {cpu_on * 1e3:.1f} / {cpu_off * 1e3:.1f} "
            f"({(cpu_on / cpu_off - 1) * 100:+.1f}%) | "
            f"{(cpu_on - cpu_off) / headers * 1e6 if headers else float('nan'):.0f} |")


HEADER = ("| model | check on, ms/step | check off, ms/step | paired difference, median "
          "(quartiles) | headers per step | difference per header, µs | CPU ms/step on / "
          "off (mean of ranks, medians) | CPU per header, µs |\n|---|---|---|---|---|---|---|---|")


def sizes(args, rank: int) -> None:
    rows = []
    for name in args.sizes.split(","):
        fields, batch = SIZES[name]
        cfg = GPTConfig(**fields)
        torch.manual_seed(0)
        model = sw.shard(GPT(cfg))
        n = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1234 + rank)
        x = torch.randint(0, cfg.vocab_size, (args.micro, batch, cfg.seq_len), generator=g)
        y = torch.roll(x, -1, dims=2)

        def run() -> None:
            for m in range(args.micro):
                ctx = sw.no_sync(model) if m < args.micro - 1 else contextlib.nullcontext()
                with ctx:
                    (model(x[m], y[m]) / args.micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step = timed(model, run)
        on, off, diffs = paired(step, args.pairs, args.warmup)
        rows.append(summary(f"{name} ({n / 1e6:.2f}M, {args.micro} micro-batches)", on, off,
                            diffs, statistics.median(step.counts), step.cpu))
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        print(f"\n{dist.get_world_size()} ranks, {args.pairs} pairs of steps per model, "
              f"torch {torch.__version__}\n{HEADER}\n" + "\n".join(rows))


def headers(args, rank: int) -> None:
    """Headers posted and settled back to back: the check's own cost per header."""
    torch.manual_seed(0)
    model = sw.shard(GPT(GPTConfig(**SIZES["nano"][0])))
    channel = model_state(model).comm.channel
    os.environ["SHARDWISE_CHECK"] = "1"
    # One header's messages, through torch's wrappers and straight to the process group
    # (Note [header cost] in comm/channel.py), in alternating blocks.
    group, peer = dist.group.WORLD, 1 - rank
    out, inbox = torch.zeros(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    ways = {"dist.irecv + dist.isend, then wait": lambda i: [
                dist.irecv(inbox, peer, tag=i), dist.isend(out, peer, tag=i)],
            "group.recv + group.send, then wait": lambda i: [
                group.recv([inbox], peer, i), group.send([out], peer, i)]}
    spent: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(10):
        for label, issue in (list(ways.items())[::1 if r % 2 else -1]):
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.headers // 10):
                for w in issue(i % 1000 + 1):
                    w.wait()
            spent[label].append((time.perf_counter() - start) / (args.headers // 10))
    if rank == 0:
        for label, ts in spent.items():
            print(f"{label}: median {statistics.median(ts) * 1e6:.1f} µs per header "
                  f"(10 alternating blocks)", flush=True)
    for label, settle_each in (("post, then settle each", True), ("post all, settle once", False)):
        times = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for i in range(args.headers):
                channel.post(END_FORWARD, i, 0, "a benchmark header")
                if settle_each:
                    channel.settle()
            channel.settle()
            times.append((time.perf_counter() - start) / args.headers)
        if rank == 0:
            print(f"{label}: median {statistics.median(times) * 1e6:.1f} µs per header "
                  f"({args.headers} headers, 5 repeats)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="llama", choices=sorted(WORKLOADS))
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--sizes", default=None, help=f"GPTs, of {', '.join(SIZES)}")
    parser.add_argument("--micro", type=int, default=4, help="--sizes: micro-batches per step")
    parser.add_argument("--headers", type=int, default=0,
                        help="time this many headers back to back instead")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.headers:
        headers(args, rank)
    elif args.sizes:
        sizes(args, rank)
    else:
        w = WORKLOADS[args.workload]
        model = w.build()
        model = sw.shard(model, units=w.units(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(1234 + rank)
        batch = w.batch(g)  # the same batch every step: the data plays no part here

        def run() -> None:
            w.loss_fn(model, batch).backward()
            opt.step()
            opt.zero_grad()
        step = timed(model, run)
        on, off, diffs = paired(step, args.pairs, args.warmup)
        if rank == 0:
            print(f"{args.workload}, {dist.get_world_size()} ranks, {args.pairs} pairs of "
                  f"steps (torch {torch.__version__})\n{HEADER}")
            print(summary(args.workload, on, off, diffs, statistics.median(step.counts),
                          step.cpu))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
