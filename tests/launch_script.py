"""Launched by tests/test_launcher.py under ``shardwise run`` or torchrun.

    launch_script.py MODE FOLDER

``run``: two Resumable steps; rank 0 prints the launcher settings its worker sees.
``loops``: rank 0 runs ``steps(5)``, rank 1 ``steps(8)``; each prints when it raises.
``abandoned``: rank 0 starts a ``Resumable`` while rank 1 runs a forward; rank 0's peer
watch raises with its all-gather pending, and prints when, before re-raising.
The process group's timeout is 120 s: a rank still alive by then hung in its exit.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def main(mode: str, folder: str) -> None:
    sw.init_distributed(timeout=120)
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=32)
    model = sw.shard(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
    if mode == "abandoned":
        # Rank 0 (watching for 2 s) gives up an all-gather, which gloo runs on a worker
        # thread; rank 1 (watching for 60 s) waits on in its forward.
        os.environ["SHARDWISE_PEER_TIMEOUT"] = "2" if rank == 0 else "60"
        try:
            if rank == 0:
                sw.Resumable(folder, model, opt, every=1)  # starts with an all-gather
            else:
                model(x[:, :-1], x[:, 1:])
        except sw.CollectiveError:
            print(f"rank {rank} raised at {time.time():.3f}", flush=True)
            raise
        return
    total = (5 if rank == 0 else 8) if mode == "loops" else 2
    started = time.time()
    try:
        with sw.Resumable(folder, model, opt, every=1) as run:
            for _ in run.steps(total):
                model(x[:, :-1], x[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
    except sw.ShardwiseError:
        print(f"rank {rank} started at {started:.3f} raised at {time.time():.3f}",
              flush=True)
        raise
    if rank == 0:
        print(f"done at step {run.step}: {os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE')}"
              f" restarts {os.environ.get('TORCHELASTIC_MAX_RESTARTS')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
