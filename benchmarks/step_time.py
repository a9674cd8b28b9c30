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

World of one, the hook overhead (issue 12's GPU measure; it runs on the CPU as well):

    torchrun --standalone --nproc_per_node 1 benchmarks/step_time.py --systems plain,shardwise,fsdp2

``plain`` is the unsharded model with no wrapper; ratios are against ``--reference``
(default ``ddp``, else ``plain``). ``--device cuda`` (the default when a GPU is present)
runs on the GPU with NCCL, synchronises before reading the clock and reports each
system's peak ``torch.cuda.max_memory_allocated``; ``--layers``, ``--d-model``,
``--batch`` and ``--seq`` scale the workload up to fill it.
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


def wrap_fsdp2(model, blocks=None):
    """FSDP2: ``fully_shard`` on each block (default: ``model.blocks``), then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks if blocks is None else blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def compile_blocks(model: GPT) -> GPT:
    for block in model.blocks:
        block.compile()
    return model


def call_model(model, batch) -> torch.Tensor:
    """The default step's loss: the model called on the batch, ``model(x, y)``."""
    return model(*batch)


class System:
    """One system's model, optimizer and record, kept across rounds.

    ``loss_fn(model, batch)`` computes a step's loss from the batch (a tuple of tensors,
    moved to the device); ``unchecked`` runs the steps with ``SHARDWISE_CHECK=0`` (default:
    for the system named ``unchecked``).
    """

    def __init__(self, name: str, model, device: torch.device, loss_fn=call_model,
                 unchecked: bool | None = None) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.loss_fn = loss_fn
        self.unchecked = name == "unchecked" if unchecked is None else unchecked
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        self.times: list[list[float]] = []  # per round
        self.losses: list[float] = []
        self.step = 0
        self.peak = 0  # bytes, CUDA only

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, data, steps: int) -> None:
        # "unchecked" is shardwise without the collective-order check (on by default
        # under gloo), to measure what the check costs.
        if self.unchecked:
            os.environ["SHARDWISE_CHECK"] = "0"
        else:
            os.environ.pop("SHARDWISE_CHECK", None)
        times = []
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(steps):
            batch = tuple(t.to(self.device) for t in data[self.step])
            self.sync()
            dist.barrier()
            t0 = time.perf_counter()
            loss = self.loss_fn(self.model, batch)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.sync()
            times.append(time.perf_counter() - t0)
            self.losses.append(loss.item())
            self.step += 1
        self.times.append(times)
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))


# Every system starts from the same weights, built on the CPU (shardwise moves its shards
# to the process group's device itself).
MAKERS = {
    "plain": lambda cfg, dev: build(cfg).to(dev),
    "ddp": lambda cfg, dev: DDP(build(cfg).to(dev)),
    "fsdp2": lambda cfg, dev: wrap_fsdp2(build(cfg).to(dev)),
    "shardwise": lambda cfg, dev: sw.shard(build(cfg)),
    "unchecked": lambda cfg, dev: sw.shard(build(cfg)),
    "ddp_compiled": lambda cfg, dev: DDP(compile_blocks(build(cfg).to(dev))),
    "fsdp2_compiled": lambda cfg, dev: wrap_fsdp2(compile_blocks(build(cfg).to(dev))),
    "compiled": lambda cfg, dev: sw.shard(compile_blocks(build(cfg))),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per system and round")
    parser.add_argument("--warmup", type=int, default=2, help="first-round steps not timed")
    parser.add_argument("--systems", default="ddp,fsdp2,shardwise",
                        help="of ddp, fsdp2, shardwise, unchecked (shardwise with "
                             "SHARDWISE_CHECK=0), ddp_compiled, fsdp2_compiled, compiled, "
                             "plain (the unsharded model, unwrapped)")
    parser.add_argument("--reference", default=None,
                        help="the system ratios are taken against (default: ddp if it "
                             "runs, else plain)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    names = args.systems.split(",")
    args.reference = args.reference or ("ddp" if "ddp" in names else "plain")
    unknown = set(names) - set(MAKERS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {sorted(MAKERS)}")
    sw.init_distributed(backend="nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, seq_len=args.seq)
    g = torch.Generator().manual_seed(100 + rank)
    data = []
    for _ in range(args.rounds * args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g)
        data.append((x, torch.roll(x, -1, dims=1)))
    systems = [System(name, MAKERS[name](cfg, device), device) for name in names]
    run_rounds(systems, data, args.rounds, args.steps)
    if rank == 0:
        report(systems, args, world)
    dist.destroy_process_group()


def run_rounds(systems: list[System], data, rounds: int, steps: int) -> None:
    """``rounds`` rounds of ``steps`` steps of every system in turn, the order rotating."""
    rank = dist.get_rank()
    for r in range(rounds):
        # Rotate the order so that no system always runs first (or last) in a round.
        for s in systems[r % len(systems):] + systems[:r % len(systems)]:
            s.run(data, steps)
            if rank == 0:
                print(f"  round {r + 1} {s.name:10s} median "
                      f"{statistics.median(s.times[-1]):.3f} s/step", flush=True)


def round_median(s: System, r: int, warmup: int) -> float:
    """System ``s``'s median step time in round ``r`` (the first round's warm-up left out)."""
    return statistics.median(s.times[r][warmup:] if r == 0 else s.times[r])


def compare(s: System, ref: System, warmup: int) -> tuple[list[float], float]:
    """Per-round ratios of ``s``'s median step time to ``ref``'s, and the largest
    difference between their losses over all steps."""
    ratios = [round_median(s, r, warmup) / round_median(ref, r, warmup)
              for r in range(len(s.times))]
    return ratios, max(abs(a - b) for a, b in zip(s.losses, ref.losses))


def report(systems: list[System], args, world: int) -> None:
    """Per-round medians, each round's ratio to DDP, and the median of those ratios."""
    def med(s: System, r: int) -> float:
        return round_median(s, r, args.warmup)

    print(f"\nworld {world}, torch {torch.__version__}, device {systems[0].device}, threads "
          f"{torch.get_num_threads()}, {args.rounds} interleaved rounds of {args.steps} steps")
    by_name = {s.name: s for s in systems}
    for s in systems:
        line = f"{s.name:14s} " + "  ".join(f"{med(s, r):.3f}" for r in range(args.rounds))
        line += " s/step"
        if s.peak:
            line += f", peak allocated {s.peak / 2**20:.0f} MiB"
        refs = [args.reference] + (["ddp_compiled"] if "compiled" in s.name else [])
        for ref_name in refs:
            ref = by_name.get(ref_name)
            if ref is None or ref is s:
                continue
            ratios, dl = compare(s, ref, args.warmup)
            line += (f"; ratio to {ref_name} per round "
                     f"{' '.join(f'{x:.3f}' for x in ratios)}, median "
                     f"{statistics.median(ratios):.3f}, max |loss - its loss| {dl:.2e}")
        print(line)


if __name__ == "__main__":
    main()
