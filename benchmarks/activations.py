"""Peak memory and time of a training step with and without activation checkpointing.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/activations.py

A GPT where activations dominate: 8 blocks of width 256, vocabulary 4096, sequences of
1024 tokens, batch 2 per rank (7.4M parameters, 28 MiB in fp32; a step's activations
several hundred MiB), sharded over the ranks (gloo, CPU), AdamW. Four models, built
alike and each sharded by itself, the recipe of docs/performance.md ("Activation
checkpointing") applied before ``sw.shard``:

- ``none``: no checkpointing;
- ``full``: every block wrapped by ``checkpoint_wrapper`` (non-reentrant): a block keeps
  its input only, and its forward runs again in the backward;
- ``selective``: the same with ``context_fn=create_selective_checkpoint_contexts(policy)``,
  the policy keeping the outputs of the matmuls and of attention and recomputing the rest;
- ``selective_attention``: a policy keeping attention's outputs only (the matmuls are
  recomputed, attention is not).

Each step is measured after a warm-up step (AdamW's state exists): the peak of malloc'd
bytes in use during the step above what was in use before it (``HeapPeak`` of
benchmarks/memory.py), and its wall time; ``--steps`` steps per model, interleaved, the
median time and the largest peak reported.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.distributed as dist
from memory import HeapPeak
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import shardwise as sw
from shardwise.models import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=4096, seq_len=1024, n_layer=8, n_head=4, d_model=256)
BATCH = 2

SAVED = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default}


ATTENTION = {op for op in SAVED if "attention" in str(op)}


def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def attention_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION else CheckpointPolicy.PREFER_RECOMPUTE


def build(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(CFG)
    if variant != "none":
        chosen = attention_policy if variant == "selective_attention" else policy
        wrap = checkpoint_wrapper if variant == "full" else functools.partial(
            checkpoint_wrapper,
            context_fn=functools.partial(create_selective_checkpoint_contexts, chosen))
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap,
                                       check_fn=lambda m: isinstance(m, Block))
    return sw.shard(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    sw.init_distributed()
    rank = dist.get_rank()
    variants = ["none", "full", "selective", "selective_attention"]
    models = {v: build(v) for v in variants}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-4) for v, m in models.items()}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, CFG.vocab_size, (BATCH, CFG.seq_len + 1), generator=g)
               for _ in range(args.steps + 1)]
    times: dict[str, list[float]] = {v: [] for v in variants}
    peaks = dict.fromkeys(variants, 0.0)
    losses: dict[str, list[float]] = {v: [] for v in variants}
    for i, batch in enumerate(batches):
        x, y = batch[:, :-1], batch[:, 1:]
        for v in variants:
            dist.barrier()
            heap = HeapPeak()
            t0 = time.perf_counter()
            loss = models[v](x, y)
            loss.backward()
            opts[v].step()
            opts[v].zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            peak = heap.stop_mib()
            losses[v].append(loss.item())
            if i:  # the first step allocates AdamW's state: a warm-up
                times[v].append(elapsed)
                peaks[v] = max(peaks[v], peak)
    assert all(losses[v] == losses["none"] for v in variants), losses  # the same bits
    report = {"rank": rank, "world": dist.get_world_size(),
              "params": sum(p.numel() for p in models["none"].parameters()),
              "tokens_per_rank": BATCH * CFG.seq_len,
              "peak_mib": {v: round(p, 1) for v, p in peaks.items()},
              "seconds": {v: round(statistics.median(t), 3) for v, t in times.items()},
              "all_seconds": {v: [round(s, 3) for s in t] for v, t in times.items()}}
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
