"""Peak RSS per rank while building and training a model whose AdamW state dominates.

    OMP_NUM_THREADS=1 python benchmarks/memory.py            # runs every configuration

About 158M parameters in 16 identical blocks (GPT, d_model 896, vocab 4096), batch 1 x 64
tokens per rank, fp32, AdamW, 2 ranks on CPU with gloo. Each configuration runs in fresh
processes (``torchrun``) so that peak RSS (``ru_maxrss``) is its own:

- ddp:            build the whole model on every rank, DistributedDataParallel;
- fsdp2_meta:     build on the meta device, ``fully_shard`` per block and root, ``to_empty``;
- sharded_init:   build under ``sw.sharded_init()``, then ``sw.shard``;
- build_then_shard: build the whole model on every rank, then ``sw.shard``.

Each rank reports its peak RSS after building and after two training steps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS = ["ddp", "fsdp2_meta", "sharded_init", "build_then_shard"]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(config: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    sw.init_distributed()
    rank = dist.get_rank()
    cfg = GPTConfig(vocab_size=4096, seq_len=64, n_layer=16, n_head=14, d_model=896)
    torch.manual_seed(0)
    if config == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(GPT(cfg))
    elif config == "fsdp2_meta":
        from torch.distributed.fsdp import fully_shard

        with torch.device("meta"):
            model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.reset_parameters()
        model.apply(GPT._init_weights)
    elif config == "sharded_init":
        with sw.sharded_init():
            model = GPT(cfg)
        model = sw.shard(model)
    elif config == "build_then_shard":
        model = sw.shard(GPT(cfg))
    else:
        raise SystemExit(f"unknown configuration {config}")
    n_params = sum(p.numel() for p in model.parameters())
    built = peak_mib()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
        model(x, x.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    report = {"config": config, "rank": rank, "built_mib": built, "peak_mib": peak_mib(),
              "local_params": n_params}
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=CONFIGS)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    for config in args.configs.split(","):
        out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", __file__,
                              "--worker", config, "--steps", str(args.steps)],
                             env=env, capture_output=True, text=True)
        results = [json.loads(line[7:]) for line in out.stdout.splitlines()
                   if line.startswith("RESULT ")]
        if out.returncode != 0 or len(results) != 2:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{config} failed")
        rows.append((config, sorted(results, key=lambda r: r["rank"])))
        print(f"{config}: " + ", ".join(f"rank {r['rank']} built {r['built_mib']:.0f} MiB, "
                                        f"peak {r['peak_mib']:.0f} MiB" for r in results[:2]),
              flush=True)
    base = max(r["peak_mib"] for r in dict(rows)["ddp"]) if "ddp" in dict(rows) else None
    print(f"\n{'configuration':18s} {'peak RSS rank 0/1 (MiB)':>26s} {'after build':>18s}"
          f" {'vs DDP':>8s}")
    for config, rs in rows:
        peak = max(r["peak_mib"] for r in rs)
        ratio = f"{peak / base:.2f}" if base else "-"
        print(f"{config:18s} {rs[0]['peak_mib']:12.0f} / {rs[1]['peak_mib']:<11.0f}"
              f" {rs[0]['built_mib']:8.0f} / {rs[1]['built_mib']:<8.0f} {ratio:>8s}")


if __name__ == "__main__":
    main()
