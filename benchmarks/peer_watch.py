"""What the peer watch and the collective-order check cost a training step (Note [peer
watch] in src/shardwise/comm/peers.py, Note [collective order] in engine/iteration/state.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/peer_watch.py

Per training step the watch adds two writes of a rank's note into the store (into the
model, out of it) and one watched wait (the first order check of the forward, waited in
one-second slices instead of at once). Both are timed here in isolation, interleaved in
rounds so that a busy machine slows all variants alike: ``store.set`` of a note, and the
order check's 32-byte all-reduce called synchronously, issued asynchronously and waited
plainly, and waited through ``wait_watched``. The script prints microseconds per
operation (medians over rounds) and what that makes per step of the reference workload
and of the small Llama.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.comm.collectives import Comm
from shardwise.comm.peers import ACTIVITY, wait_watched

ROUNDS, N = 7, 400


def main() -> None:
    sw.init_distributed()
    comm = Comm(None)
    store = dist.distributed_c10d._get_default_store()
    note = json.dumps(ACTIVITY.describe())
    t = torch.zeros(4, dtype=torch.int64)
    plain, unwatched, watched, sets = [], [], [], []
    for _ in range(ROUNDS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(N):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        plain.append((time.perf_counter() - start) / N)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(N):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()
        unwatched.append((time.perf_counter() - start) / N)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(N):
            wait_watched(dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), comm,
                         "a benchmark")
        watched.append((time.perf_counter() - start) / N)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(N):
            store.set(f"shardwise/benchmark/{dist.get_rank()}", note)
        sets.append((time.perf_counter() - start) / N)
    if dist.get_rank() == 0:
        p, u, w, s = (statistics.median(x) * 1e6 for x in (plain, unwatched, watched, sets))
        print(f"order check all-reduce, synchronous: {p:.1f} us; issued asynchronously and "
              f"waited plainly: {u:.1f} us; waited through wait_watched: {w:.1f} us "
              f"({w - p:+.1f} us)")
        print(f"store.set of a note: {s:.1f} us (two per step)")
        for name, step_ms in (("reference workload", 440.0), ("small Llama", 137.0)):
            extra = 2 * s + (w - p)
            print(f"{name}: {extra:.0f} us per step, {100 * extra / (step_ms * 1e3):.3f}% "
                  f"of a {step_ms:.0f} ms step")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
