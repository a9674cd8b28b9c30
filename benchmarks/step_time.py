"""Step time of shardwise against DDP and PyTorch FSDP2, in interleaved rounds of one run.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/step_time.py

Reference workload: GPT, 6 layers, d_model 512, 8 heads, vocab 8192, sequence 256, batch 4
per rank, fp32, AdamW. Every system trains the same initial weights on the same data.
All systems are built first; then each round runs ``--steps`` steps of every system in
turn (the order rotates between rounds), so slow phases of a shared machine hit all of
them alike. The script prints each system's median step time per round, the per-round
ratio to DDP and the median of those ratios, and the largest loss difference from DDP.

``--systems`` also takes ``ddp_compiled``, ``fsdp2_compiled`` and ``compiled`` (shardwise):
each block is compiled with ``torch.compile`` (inductor) before the model is wrapped or
sharded, the path shardwise documents. Their ratios are also given against
``ddp_compiled`` when it runs, and their losses are compared with its losses.
"""

from __future__ import annotations

import argparse
import os
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


def compile_blocks(model: GPT) -> GPT:
    for block in model.blocks:
        block.compile()
    return model


class System:
    """One system's model, optimizer and record, kept across rounds."""

    def __init__(self, name: str, model) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.times: list[list[float]] = []  # per round
        self.losses: list[float] = []
        self.step = 0

    def run(self, data, steps: int) -> None:
        # "unchecked" is shardwise without the collective-order check (on by default
        # under gloo), to measure what the check costs.
        if self.name == "unchecked":
            os.environ["SHARDWISE_CHECK"] = "0"
        else:
            os.environ.pop("SHARDWISE_CHECK", None)
        times = []
        for _ in range(steps):
            x, y = data[self.step]
            dist.barrier()
            t0 = time.perf_counter()
            loss = self.model(x, y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            self.losses.append(loss.item())
            self.step += 1
        self.times.append(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per system and round")
    parser.add_argument("--warmup", type=int, default=2, help="first-round steps not timed")
    parser.add_argument("--systems", default="ddp,fsdp2,shardwise",
                        help="of ddp, fsdp2, shardwise, unchecked (shardwise with "
                             "SHARDWISE_CHECK=0), ddp_compiled, fsdp2_compiled, compiled")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=args.layers)
    g = torch.Generator().manual_seed(100 + rank)
    data = []
    for _ in range(args.rounds * args.steps):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
        data.append((x, torch.roll(x, -1, dims=1)))

    makers = {"ddp": lambda: DDP(build(cfg)), "fsdp2": lambda: wrap_fsdp2(build(cfg)),
              "shardwise": lambda: sw.shard(build(cfg)),
              "unchecked": lambda: sw.shard(build(cfg)),
              "ddp_compiled": lambda: DDP(compile_blocks(build(cfg))),
              "fsdp2_compiled": lambda: wrap_fsdp2(compile_blocks(build(cfg))),
              "compiled": lambda: sw.shard(compile_blocks(build(cfg)))}
    systems = [System(name, makers[name]()) for name in args.systems.split(",")]
    for r in range(args.rounds):
        # Rotate the order so that no system always runs first (or last) in a round.
        for s in systems[r % len(systems):] + systems[:r % len(systems)]:
            s.run(data, args.steps)
            if rank == 0:
                print(f"  round {r + 1} {s.name:10s} median "
                      f"{statistics.median(s.times[-1]):.3f} s/step", flush=True)
    if rank == 0:
        report(systems, args, world)
    dist.destroy_process_group()


def report(systems: list[System], args, world: int) -> None:
    """Per-round medians, each round's ratio to DDP, and the median of those ratios."""
    def med(s: System, r: int) -> float:
        times = s.times[r][args.warmup:] if r == 0 else s.times[r]
        return statistics.median(times)

    print(f"\nworld {world}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    by_name = {s.name: s for s in systems}
    for s in systems:
        line = f"{s.name:14s} " + "  ".join(f"{med(s, r):.3f}" for r in range(args.rounds))
        line += " s/step"
        refs = ["ddp"] + (["ddp_compiled"] if "compiled" in s.name else [])
        for ref_name in refs:
            ref = by_name.get(ref_name)
            if ref is None or ref is s:
                continue
            ratios = [med(s, r) / med(ref, r) for r in range(args.rounds)]
            dl = max(abs(a - b) for a, b in zip(s.losses, ref.losses))
            line += (f"; ratio to {ref_name} per round "
                     f"{' '.join(f'{x:.3f}' for x in ratios)}, median "
                     f"{statistics.median(ratios):.3f}, max |loss - its loss| {dl:.2e}")
        print(line)


if __name__ == "__main__":
    main()
