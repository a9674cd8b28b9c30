"""Tokens per second of greedy generation: sharded, inside ``sw.gathered``, and unsharded.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/generation.py

Reference GPT (6 layers, d_model 512, vocab 8192), batch 1, a 16-token prompt, 32 new
tokens, no KV cache (every step reruns the whole sequence, identically in all three
modes). Sharded generation all-gathers every unit for every token; inside
``with sw.gathered(model):`` the units are gathered once and each token is local compute.
Each mode runs ``--repeats`` times; the median is reported, and the three modes must
produce the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sw.init_distributed()
    cfg = GPTConfig()
    torch.manual_seed(0)
    plain = GPT(cfg).eval()
    torch.manual_seed(0)
    model = sw.shard(GPT(cfg)).eval()
    prompt = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    n = args.new_tokens

    def gathered():
        with sw.gathered(model):
            return greedy(model, prompt, n)

    results = {"unsharded (every rank holds the model)": timed(lambda: greedy(plain, prompt, n),
                                                               args.repeats),
               "sharded (gathers every unit per token)": timed(lambda: greedy(model, prompt, n),
                                                               args.repeats),
               "sw.gathered (gathers once)": timed(gathered, args.repeats)}
    tokens = [out for _, out in results.values()]
    same = all(torch.equal(tokens[0], t) for t in tokens)
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}, torch {torch.__version__}, {n} new tokens, "
              f"median of {args.repeats}")
        base = results["unsharded (every rank holds the model)"][0]
        for name, (t, _) in results.items():
            print(f"{name:42s} {n / t:8.1f} tokens/s  ({t / base:.2f}x the unsharded time)")
        print(f"same tokens in all modes: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
