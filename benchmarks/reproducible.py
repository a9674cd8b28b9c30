"""What the reproducible mode costs against the default, on the reference workload.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/reproducible.py \\
        [--rounds 3 --steps 4 --micro 4 --model gpt|llama --systems ddp,reproducible,...]

The reference GPT (6 layers, d_model 512, sequence 256), or with ``--model llama``
workloads.py's small Hugging Face Llama (sequences of 64 tokens), with 4 sequences per rank and
step, cut into ``--micro`` micro-batches per rank: all but the last backward under
``sw.no_sync`` (DDP: ``no_sync()``), the last one reducing. Systems, in interleaved
rounds (step_time.py's ``run_rounds``): ``ddp``, ``shardwise`` (default mode, each
micro-batch's loss divided by their number), ``reproducible`` (``shard(...,
reproducible=True)``, Note [reproducible reduction]). Printed: step times and their
ratios, the bytes each rank fed into collectives per step
(``sw.inspect``), the bytes the gradient accumulators held just before the reducing
backward (read from the engine's own buffers: fp32 rank-major buffers by default, the
exact partials in the reproducible mode: Note [float64 partials]).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import workloads
from step_time import System, build, run_rounds
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.engine.iteration.state import model_state
from shardwise.integrations._units import no_split_units
from shardwise.models import GPTConfig


def accumulator_bytes(model) -> int:
    """Bytes held by the gradient accumulators of a shardwise model right now."""
    state = model_state(model)
    total = 0
    for u in state.units:
        for g in u.trainable_groups:
            r = g.reduction
            if r._buf is not None:
                total += r._buf.numel() * r._buf.element_size()
            acc = getattr(r, "_acc", None)  # the reproducible mode's ExactReduction
            if acc is not None:  # a Partial: its value and kept errors
                held = [acc.value] + [t for pair in acc.errors for t in pair]
                total += sum(t.numel() * t.element_size() for t in held)
    return total


def _call(model, x, y):
    """The reference GPT's loss, or (``y`` None) a Hugging Face causal LM's."""
    return model(x, y) if y is not None else model(input_ids=x, labels=x).loss


def make_loss(micro: int, reproducible: bool, held: list[int]):
    """A step_time loss function that runs ``micro`` micro-batches and returns the last
    one's loss (whose backward, run by System.run, reduces)."""
    def loss_fn(model, batch):
        parts = [p if len(p) == 2 else (p[0], None)
                 for p in zip(*(t.chunk(micro) for t in batch))]
        sync_off = model.no_sync if isinstance(model, DDP) else (lambda: sw.no_sync(model))
        for x, y in parts[:-1]:
            with sync_off():
                loss = _call(model, x, y)
                (loss if reproducible else loss / micro).backward()
        if not isinstance(model, DDP):
            held.append(accumulator_bytes(model))
        x, y = parts[-1]
        loss = _call(model, x, y)
        return loss if reproducible else loss / micro
    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per rank")
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama"],
                        help="llama: workloads.py's small Hugging Face Llama, 4 sequences "
                             "of 64 tokens per rank and step")
    parser.add_argument("--systems", default="ddp,shardwise,reproducible",
                        help="which to run (ddp always runs: the ratios are to it)")
    args = parser.parse_args()
    sw.init_distributed(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(n_layer=6, d_model=512, seq_len=256)
    g = torch.Generator().manual_seed(100 + rank)
    data: list[tuple[torch.Tensor, ...]] = []
    for _ in range(args.rounds * args.steps):
        if args.model == "llama":
            data.append((workloads.tokens(g, 4, 64),))
        else:
            x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
            data.append((x, torch.roll(x, -1, dims=1)))
    units = no_split_units if args.model == "llama" else (lambda model: None)

    def model() -> torch.nn.Module:
        return workloads.llama() if args.model == "llama" else build(cfg)

    def shard(reproducible: bool):
        m = model()
        return sw.shard(m, units=units(m), reproducible=reproducible)

    device = torch.device("cpu")
    held: dict[str, list[int]] = {"shardwise": [], "reproducible": []}
    systems = [
        System("ddp", DDP(model()), device, make_loss(args.micro, False, [])),
        System("shardwise", shard(False), device,
               make_loss(args.micro, False, held["shardwise"])),
        System("reproducible", shard(True), device,
               make_loss(args.micro, True, held["reproducible"])),
    ]
    wanted = set(args.systems.split(",")) | {"ddp"}
    systems = [s for s in systems if s.name in wanted]
    counted = {}
    for s in systems[1:]:
        before = sw.inspect(s.model).comm
        s.run(data, 1)  # one step, counted, before the timed rounds
        counted[s.name] = sw.inspect(s.model).comm.since(before)
        s.times.clear()
        s.losses.clear()
        s.step = 0
    run_rounds(systems, data, args.rounds, args.steps)
    if rank != 0:
        dist.destroy_process_group()
        return

    def med(s: System, r: int) -> float:
        return statistics.median(s.times[r][args.warmup:] if r == 0 else s.times[r])

    print(f"\n{args.model}, world {world}, {args.micro} micro-batches per rank, "
          f"{args.rounds} interleaved rounds of {args.steps} steps")
    ddp = systems[0]
    print("| system | median s/step per round | median ratio to DDP | collective input per "
          "step | accumulators before the reduction |")
    print("|---|---|---|---|---|")
    for s in systems:
        ratios = [med(s, r) / med(ddp, r) for r in range(args.rounds)]
        c = counted.get(s.name)
        moved = ("" if c is None else ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(c.bytes.items()) if v))
        acc = f"{max(held[s.name]) / 2**20:.0f} MiB" if s.name in held else ""
        print(f"| {s.name} | {' '.join(f'{med(s, r):.3f}' for r in range(args.rounds))} | "
              f"{statistics.median(ratios):.3f} | {moved} | {acc} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
