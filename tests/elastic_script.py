"""A resumable training loop under torchrun (tests/test_elastic.py, benchmarks/elastic.py).

Each step trains on global batch ``step`` (the same data at every world size), cut into
M=12 micro-batches by ``sw.micro_batches``; rank 0 prints each step's loss as
``loss <step> <float.hex> world <N>`` and, at the end, ``digest <sha256> world <N>`` of
the full parameters and optimizer state, so runs at different sizes compare exactly.

    torchrun ... tests/elastic_script.py FOLDER STEPS EVERY [--default] [--sleep S]
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.models import GPT, GPTConfig

M = 12  # micro-batches per global batch: divisible by 1, 2, 3, 4, 6 and 12
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 7)
    x = torch.randint(0, CFG.vocab_size, (2 * M, CFG.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of the full state: parameters, buffers, optimizer state (a collective)."""
    h = hashlib.sha256()
    sd = sw.full_state_dict(model, rank0_only=False)
    for k in sorted(sd):
        h.update(k.encode() + sd[k].numpy().tobytes())
    for name, p in model.named_parameters():
        for k, v in sorted(opt.state[p].items()):
            full = v.full_tensor() if isinstance(v, DTensor) else v
            h.update(f"{name}/{k}".encode() + full.numpy().tobytes())
    return h.hexdigest()


def main(folder: str, total: int, every: int, reproducible: bool, sleep: float) -> None:
    sw.init_distributed(timeout=60)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG), reproducible=reproducible)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with sw.Resumable(folder, model, opt, every=every,
                      micro_batches=M if reproducible else None) as run:
        if dist.get_rank() == 0:
            print(f"start {run.step} world {world}", flush=True)
        for step in run.steps(total):
            mine = sw.micro_batches(global_batch(step), M)
            per_micro_batch = []
            for i, (x, y) in enumerate(mine):
                last = i == len(mine) - 1
                with contextlib.nullcontext() if last else sw.no_sync(model):
                    loss = model(x, y)
                    # The default mode averages over ranks, so each rank scales its share.
                    (loss if reproducible else loss / len(mine)).backward()
                per_micro_batch.append(loss.detach())
            opt.step()
            opt.zero_grad()
            mean = (sw.global_mean(per_micro_batch) if reproducible
                    else _mean_over_ranks(per_micro_batch))
            if dist.get_rank() == 0:
                print(f"loss {step} {float(mean).hex()} world {world}", flush=True)
            time.sleep(sleep)
    d = digest(model, opt)
    if dist.get_rank() == 0:
        print(f"digest {d} world {world}", flush=True)
    dist.destroy_process_group()


def _mean_over_ranks(values: list[torch.Tensor]) -> float:
    t = torch.stack(values).sum().reshape(1)
    dist.all_reduce(t)
    return float(t) / M


if __name__ == "__main__":
    args = sys.argv[1:]
    sleep = float(args[args.index("--sleep") + 1]) if "--sleep" in args else 0.0
    main(args[0], int(args[1]), int(args[2]), "--default" not in args, sleep)
