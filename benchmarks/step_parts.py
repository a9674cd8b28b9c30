"""Where shardwise's step time goes: median forward, backward and optimizer step.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/step_parts.py

The reference workload of ``step_time.py`` (GPT 6x512, vocab 8192, sequence 256, batch 4
per rank, fp32 AdamW), shardwise alone, six timed steps after two warm-up steps. Run it on
two commits back to back to see what a change costs, part by part.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def main() -> None:
    sw.init_distributed()
    cfg = GPTConfig(vocab_size=8192, seq_len=256, n_layer=6, n_head=8, d_model=512)
    torch.manual_seed(0)
    model = sw.shard(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    parts: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    for step in range(8):
        x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(x, x)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step >= 2:
            parts["forward"].append(t1 - t0)
            parts["backward"].append(t2 - t1)
            parts["step"].append(t3 - t2)
    if dist.get_rank() == 0:
        med = {k: statistics.median(v) for k, v in parts.items()}
        print("  ".join(f"{k} {v:.3f} s" for k, v in med.items()),
              f" total {sum(med.values()):.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
