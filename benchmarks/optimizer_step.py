"""The optimizer step alone: shardwise, FSDP2 and DDP on the same model, interleaved.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/optimizer_step.py \
        [--optimizer adamw] [--rounds 15]

A small Hugging Face Llama (4 layers, hidden 256, vocabulary 8192), one forward and backward
per model to create gradients, then ``--rounds`` rounds in which each model's
``opt.step()`` is timed once, in turn. DDP steps every element of each parameter; the
sharded models step 1/N of them, so the fair target for a sharded step is DDP's time
times 1/N. Prints the medians and the ratio of each sharded step to that target (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))


def _timed(opt: torch.optim.Optimizer) -> float:
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    sw.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    models = {"ddp": DDP(_llama()), "shardwise": sw.shard(_llama())}
    fsdp = _llama()
    for layer in fsdp.model.layers:
        fully_shard(layer)
    models["fsdp2"] = fully_shard(fsdp)
    x = torch.randint(0, 8192, (1, 64), generator=torch.Generator().manual_seed(rank))
    opts = {}
    for name, m in models.items():
        m(input_ids=x, labels=x).loss.backward()
        opts[name] = OPTIMIZERS[args.optimizer](m.parameters())
        opts[name].step()  # creates the state
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(args.rounds):
        for name, opt in opts.items():
            dist.barrier()
            times[name].append(_timed(opt))
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    if rank == 0:
        target = med["ddp"] / world
        print(f"{args.optimizer}, {world} ranks, {args.rounds} rounds; median ms per step")
        print(f"DDP (all elements)       {med['ddp']:7.2f}   target for 1/{world}: "
              f"{target:.2f}")
        for name in ("shardwise", "fsdp2"):
            print(f"{name:24s} {med[name]:7.2f}   {med[name] / target:.2f}x the target")


if __name__ == "__main__":
    main()
