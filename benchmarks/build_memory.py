"""Resident memory while a model too big for one rank is built: after ``sharded_init``
and after ``shard``, as the increase over the process's own start (Note [freed memory]
in src/shardwise/engine/groups/alloc.py).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/build_memory.py 32
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/build_memory.py \
        2 --whole --vocab 131072

The first argument is the number of layers of a GPT 768 wide with a vocabulary of 16384
(913 MiB of fp32 parameters at 32 layers). Each rank prints its current and peak RSS
increase (``/proc/self/statm``, ``VmHWM``) after each phase, and the time both took.
With ``--whole`` every rank builds the whole model (no ``sharded_init``), as a model
loaded by ``from_pretrained`` on every rank is, and the figures after ``shard`` are what
sharding adds above it: the root unit (embeddings and head) is the largest group, so
``--vocab`` makes it large.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
from procstat import reset_peak, status_mib

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def rss_now() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rss_peak() -> float:
    return status_mib("VmHWM")  # the peak since the start or the last reset_peak()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layers", type=int, nargs="?", default=32)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--whole", action="store_true",
                        help="build the whole model on every rank, then shard it")
    args = parser.parse_args()
    sw.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=64, n_layer=args.layers, n_head=12,
                    d_model=768)
    now0, peak0 = rss_now(), rss_peak()
    start = time.perf_counter()
    with contextlib.nullcontext() if args.whole else sw.sharded_init():
        model = GPT(cfg)
    built = rss_now() - now0, rss_peak() - peak0
    if args.whole:  # what shard adds above the built model
        reset_peak()
        now0 = peak0 = rss_now()
    model = sw.shard(model)
    took = time.perf_counter() - start
    sharded = rss_now() - now0, rss_peak() - peak0
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    phase = "building" if args.whole else "sharded_init"
    print(f"rank {rank}: model {size:.0f} MiB | after {phase} +{built[0]:.0f} MiB "
          f"(peak +{built[1]:.0f}) | after shard +{sharded[0]:.0f} MiB (peak "
          f"+{sharded[1]:.0f}) | {took:.1f} s", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
