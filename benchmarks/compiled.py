"""torch.compile: compiled shardwise against compiled and eager DDP, interleaved.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/compiled.py \
        [--model gpt|llama] [--steps 9]

Four models built alike: DDP and ``sw.shard``, each eager and under ``torch.compile``
(inductor; the sharded model compiled whole, after sharding: Note [compile] in
engine/iteration/hooks.py). Each step runs each model once, in turn; the first two steps (compile
time) are left out of the medians. ``gpt`` is the reference workload (GPT 6x512, vocabulary
8192, sequence 256, batch 4 per rank); ``llama`` a small Hugging Face Llama (4 layers,
hidden 256, sequence 128, batch 4). Prints medians, ratios to compiled DDP and the first
three losses of each (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw

KINDS = ("ddp", "ddp compiled", "shardwise", "shardwise compiled")


def _build(model: str) -> tuple[torch.nn.Module, int, int]:
    torch.manual_seed(0)
    if model == "gpt":
        from shardwise.models import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=8192, seq_len=256, n_layer=6, n_head=8,
                             d_model=512)), 8192, 256
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)), 8192, 128


def _loss(model: torch.nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    y = torch.roll(x, -1, 1)
    if kind == "gpt":
        return model(x, y)
    return model(input_ids=x, labels=x).loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args()
    sw.init_distributed()
    rank = dist.get_rank()
    models = {}
    for kind in KINDS:
        base, vocab, seq = _build(args.model)
        m = DDP(base) if kind.startswith("ddp") else sw.shard(base)
        models[kind] = torch.compile(m) if kind.endswith("compiled") else m
    opts = {k: torch.optim.AdamW(m.parameters(), lr=3e-4) for k, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}
    losses: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.steps):
        x = torch.randint(0, vocab, (4, seq), generator=g)
        for kind in KINDS:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = _loss(models[kind], args.model, x)
            loss.backward()
            opts[kind].step()
            opts[kind].zero_grad()
            times[kind].append(time.perf_counter() - t0)
            cpu[kind].append(time.process_time() - c0)
            losses[kind].append(loss.item())
    if rank == 0:
        med = {k: statistics.median(t[2:]) for k, t in times.items()}
        busy = {k: statistics.median(t[2:]) for k, t in cpu.items()}
        print(f"{args.model}, {dist.get_world_size()} ranks, medians of steps 3-{args.steps} "
              f"(rank 0)")
        for kind in KINDS:
            print(f"{kind:20s} {med[kind] * 1e3:8.1f} ms  {med[kind] / med['ddp compiled']:.3f}x "
                  f"compiled DDP   CPU {busy[kind] * 1e3:8.1f} ms  "
                  f"{busy[kind] / busy['ddp compiled']:.3f}x   losses {losses[kind][:3]}")


if __name__ == "__main__":
    main()
