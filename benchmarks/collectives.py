"""gloo's all-gather and reduce-scatter against shardwise's point-to-point exchanges.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/collectives.py

For units of 4, 17 and 50 MB (the all-gather's output and the reduce-scatter's input: a
small unit, the reference GPT's root unit, half its whole model), the fastest of five
runs of torch's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` on gloo (gloo
has no reduce-scatter: torch clones the input, all-reduces it and copies a chunk out),
and of ``Comm.all_gather`` and ``Comm.reduce_scatter``, which under gloo send each peer
its part directly (Note [gloo exchanges] in ``shardwise/comm/collectives.py``). Ranks are idle
otherwise, so this is the collectives' own speed; in training they share the cores with
compute. The results must be equal: checked.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardwise.comm.collectives import Comm


def fastest(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = Comm(None)
    if rank == 0:
        print(f"world {world}, gloo, torch {torch.__version__}; ms (MB/s of the unit)")
        print(f"{'unit MB':>8} {'gloo all-gather':>18} {'exchange':>16} {'speed-up':>8} "
              f"{'gloo reduce-scatter':>20} {'exchange':>16} {'speed-up':>8}")
    for mb in (4, 17, 50):
        n = mb * 2**20 // 4 // world * world
        shard = torch.randn(n // world, generator=torch.Generator().manual_seed(rank))
        full = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        theirs, ours = torch.empty(n), torch.empty(n)
        t_ag = fastest(lambda: dist.all_gather_into_tensor(theirs, shard))
        x_ag = fastest(lambda: comm.all_gather(ours, shard))
        assert torch.equal(theirs, ours)
        rs_theirs, rs_ours = torch.empty(n // world), torch.empty(n // world)
        t_rs = fastest(lambda: dist.reduce_scatter_tensor(rs_theirs, full))
        x_rs = fastest(lambda: comm.reduce_scatter(rs_ours, full))
        if world == 2:
            assert torch.equal(rs_theirs, rs_ours)
        else:  # the sum in rank order, not gloo's ring order
            torch.testing.assert_close(rs_theirs, rs_ours)
        if rank == 0:
            unit = n * 4 / 2**20

            def cell(t: float) -> str:
                return f"{t * 1e3:7.1f} ({unit / t:5.0f})"
            print(f"{unit:8.1f} {cell(t_ag):>18} {cell(x_ag):>16} "
                  f"{t_ag / x_ag:7.1f}x {cell(t_rs):>20} {cell(x_rs):>16} "
                  f"{t_rs / x_rs:7.1f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
