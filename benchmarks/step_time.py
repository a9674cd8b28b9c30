"""Step time of shardwise against DDP and PyTorch FSDP2, measured in one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py

Reference workload: GPT, 6 layers, d_model 512, 8 heads, vocab 8192, sequence 256, batch 4
per rank, fp32, AdamW. Every system trains the same initial weights on the same data;
the script prints each one's median step time over steps 4-20 as a ratio to DDP, and the
largest loss difference from DDP.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def build(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def wrap_fsdp2(model: GPT) -> GPT:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def run(name: str, model, data, steps: int) -> tuple[list[float], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    times, losses = [], []
    for step in range(steps):
        x, y = data[step]
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"  {name} step {step + 1:2d}: {times[-1]:.3f} s  loss {losses[-1]:.4f}",
                  flush=True)
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--systems", default="ddp,fsdp2,shardwise")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.layers)
    g = torch.Generator().manual_seed(100 + rank)
    data = []
    for _ in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
        data.append((x, torch.roll(x, -1, dims=1)))

    makers = {"ddp": lambda: DDP(build(cfg)), "fsdp2": lambda: wrap_fsdp2(build(cfg)),
              "shardwise": lambda: sw.shard(build(cfg))}
    results = {}
    for name in args.systems.split(","):
        results[name] = run(name, makers[name](), data, args.steps)

    if rank == 0:
        print(f"\nworld {world}, torch {torch.__version__}, threads {torch.get_num_threads()},"
              f" steps 4-{args.steps}")
        base = statistics.median(results["ddp"][0][3:]) if "ddp" in results else None
        for name, (times, losses) in results.items():
            med = statistics.median(times[3:])
            line = f"{name:10s} median {med:.3f} s/step"
            if base:
                dl = max(abs(a - b) for a, b in zip(losses, results["ddp"][1]))
                line += f"  ratio to DDP {med / base:.3f}  max |loss - DDP loss| {dl:.2e}"
            print(line)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
