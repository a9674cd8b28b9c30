"""Resident memory while a model too big for one rank is built: after ``sharded_init``
and after ``shard``, as the increase over the process's own start (Note [freed memory]
in src/shardwise/engine/groups/alloc.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/build_memory.py 32

The argument is the number of layers of a GPT 768 wide with a vocabulary of 16384
(913 MiB of fp32 parameters at 32 layers). Each rank prints its current and peak RSS
increase (``/proc/self/statm``, ``ru_maxrss``) after each phase, and the time both took.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    sw.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(vocab_size=16384, seq_len=64, n_layer=layers, n_head=12, d_model=768)
    now0, peak0 = rss_now(), rss_peak()
    start = time.perf_counter()
    with sw.sharded_init():
        model = GPT(cfg)
    built = rss_now() - now0, rss_peak() - peak0
    model = sw.shard(model)
    took = time.perf_counter() - start
    sharded = rss_now() - now0, rss_peak() - peak0
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(f"rank {rank}: model {size:.0f} MiB | after sharded_init +{built[0]:.0f} MiB "
          f"(peak +{built[1]:.0f}) | after shard +{sharded[0]:.0f} MiB (peak "
          f"+{sharded[1]:.0f}) | {took:.1f} s", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
