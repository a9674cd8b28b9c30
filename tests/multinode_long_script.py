"""Trains a tiny model for up to two minutes; test_multinode kills one agent meanwhile."""

import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig

sw.init_distributed(timeout=60)
model = sw.shard(GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)))
opt = torch.optim.AdamW(model.parameters())
start = time.time()
step = 0
while time.time() - start < 120:
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    if step == 5:
        print(f"training rank {dist.get_rank()}", flush=True)
    step += 1
    time.sleep(0.02)
