"""Train a small GPT with shardwise on every rank of a torchrun job.

    torchrun --standalone --nproc_per_node 2 examples/train_gpt.py

The data is synthetic but learnable (each token follows from the previous one by a fixed
rule, with 10% noise), so the loss falls well below log(vocab).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig


def batches(rank: int, cfg: GPTConfig, batch: int):
    g = torch.Generator().manual_seed(rank)
    while True:
        x = torch.empty(batch, cfg.seq_len + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, cfg.vocab_size, (batch,), generator=g)
        for t in range(1, cfg.seq_len + 1):
            x[:, t] = (x[:, t - 1] * 7 + 3) % cfg.vocab_size
        noise = torch.rand(x.shape, generator=g) < 0.1
        x[noise] = torch.randint(0, cfg.vocab_size, (int(noise.sum()),), generator=g)
        yield x[:, :-1], x[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=512, seq_len=64, n_layer=4, n_head=4, d_model=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = sw.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if rank == 0:
        print(f"GPT with {n_params / 1e6:.2f}M parameters on {world} ranks; "
              f"chance loss is {math.log(cfg.vocab_size):.2f}")
    data = batches(rank, cfg, args.batch)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        if step == args.steps:
            mem = state_bytes(model, opt)  # before zero_grad, so gradients count
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0 and (step % 5 == 0 or step == 1):
            print(f"step {step:3d}  loss {loss.item() / world:.3f}  "
                  f"({(time.perf_counter() - start) / step:.2f} s/step)", flush=True)

    full = n_params * 4 * 4  # fp32 parameters, gradients, and AdamW's two moments
    for r in range(world):
        if r == rank:
            print(f"rank {r}: params {mem['params'] / 2**20:.2f} MiB, grads "
                  f"{mem['grads'] / 2**20:.2f} MiB, optimizer {mem['optimizer'] / 2**20:.2f} MiB"
                  f" = {mem['total'] / 2**20:.2f} MiB ({mem['total'] / full:.2f} of the "
                  f"{full / 2**20:.2f} MiB an unsharded rank holds)", flush=True)
        dist.barrier()
    sw.check_consistency(model)  # raises on every rank, naming any tensor that differs
    if rank == 0:
        print(f"consistency check: every buffer identical on all {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
