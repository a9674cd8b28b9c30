"""Weights out of a sharded model into a plain copy: ``sw.full_parameters`` against
``sw.full_state_dict``.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/streaming.py

A GPT of 12 blocks of width 768, vocabulary 16384, untied head (110M parameters, 441 MB
in fp32: the root unit holds the embedding and the head, 101 MB, a block 28 MB), sharded
over the ranks (gloo, CPU). Every rank holds an unsharded copy of the model (the
generation copy an RL trainer keeps) and loads the sharded model's weights into it, by
three paths, interleaved over ``--repeats`` rounds:

- ``stream``: ``for name, w in sw.full_parameters(model): params[name].copy_(w)``, the
  loop an inference engine's ``load_weights`` runs;
- ``stream rank0_only``: the same with ``rank0_only=True`` (only rank 0 keeps a copy
  up to date; the others take part in the gathers);
- ``full_state_dict``: ``plain.load_state_dict(sw.full_state_dict(model,
  rank0_only=False))``, the whole model gathered first.

Reported per path and rank: the median wall time, and the peak of malloc'd bytes in use
above what was in use before the path started (``HeapPeak`` of benchmarks/memory.py,
polled every half millisecond: the copy and the shards are already there, so this is
what the path itself adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from memory import HeapPeak

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=16384, seq_len=64, n_layer=12, n_head=12, d_model=768,
                tie_weights=False)


def stream(model: torch.nn.Module, plain: torch.nn.Module, rank0_only: bool) -> None:
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, w in sw.full_parameters(model, rank0_only=rank0_only):
            params[name].copy_(w)


def whole(model: torch.nn.Module, plain: torch.nn.Module) -> None:
    plain.load_state_dict(sw.full_state_dict(model, rank0_only=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sw.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    torch.manual_seed(1)
    plain = GPT(CFG)
    view = sw.inspect(model)
    paths = {"stream": lambda: stream(model, plain, False),
             "stream rank0_only": lambda: stream(model, plain, True),
             "full_state_dict": lambda: whole(model, plain)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    peaks: dict[str, float] = dict.fromkeys(paths, 0.0)
    for run in paths.values():  # warm up: each path once
        run()
    reference = sw.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(p, reference[n]) for n, p in plain.named_parameters())
    del reference
    for _ in range(args.repeats):
        for name, run in paths.items():
            dist.barrier()
            heap = HeapPeak()
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
            peaks[name] = max(peaks[name], heap.stop_mib())
    report = {
        "rank": rank, "world": dist.get_world_size(),
        "params": sum(p.numel() for p in plain.parameters()),
        "model_mib": sum(p.numel() * p.element_size() for p in plain.parameters()) / 2**20,
        "largest_unit_mib": max(g.full_bytes for u in view.units for g in u.groups) / 2**20,
        "seconds": {k: round(statistics.median(v), 3) for k, v in times.items()},
        "all_seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "peak_mib": {k: round(v, 1) for k, v in peaks.items()},
    }
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
