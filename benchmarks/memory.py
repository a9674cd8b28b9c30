"""Peak memory per rank while building and training: RSS and live tensor bytes.

    OMP_NUM_THREADS=1 python benchmarks/memory.py                   # both models, RSS + live
    OMP_NUM_THREADS=1 python benchmarks/memory.py --models second --measures live

Two models, fp32, AdamW, 2 ranks on CPU with gloo, batch 1 per rank:

- ``reference``: 158M parameters, GPT with 16 blocks, d_model 896, vocab 4096 (tied), 64
  tokens;
- ``second``: 139M parameters, GPT with 16 blocks, d_model 768, vocab 16384, *untied*
  head, 64 tokens.

Configurations, each in fresh processes (``torchrun``) so that its peaks are its own:

- ddp:            build the whole model on every rank, DistributedDataParallel;
- fsdp2_meta:     build on the meta device, ``fully_shard`` per block and root, ``to_empty``;
- sharded_init:   build under ``sw.sharded_init()``, then ``sw.shard``;
- build_then_shard: build the whole model on every rank, then ``sw.shard``.

Measures:

- ``rss``: peak resident set size (``ru_maxrss``) after building and after two steps,
  with glibc's default allocator settings;
- ``rss_mmap``: the same with ``MALLOC_MMAP_THRESHOLD_=131072``, which makes glibc serve
  every block of 128 KiB or more with its own mmap, returned to the OS when freed (by
  default glibc raises that threshold dynamically, so freed large blocks stay in the
  heap and in RSS);
- ``live``: the peak of live tensor bytes (torch's CPU allocator total, read from the
  profiler's allocation events over building and two steps), with the phase and the
  operator where it happened. Independent of the allocator's caching.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS = ["ddp", "fsdp2_meta", "sharded_init", "build_then_shard"]
MODELS = {
    "reference": dict(vocab_size=4096, seq_len=64, n_layer=16, n_head=14, d_model=896),
    "second": dict(vocab_size=16384, seq_len=64, n_layer=16, n_head=12, d_model=768,
                   tie_weights=False),
}
MEASURES = ["rss", "rss_mmap", "live"]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(config: str, model_name: str, steps: int, live: bool) -> None:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    import shardwise as sw
    from shardwise.models import GPTConfig

    sw.init_distributed()
    rank = dist.get_rank()
    cfg = GPTConfig(**MODELS[model_name])
    profiler = (profile(activities=[ProfilerActivity.CPU], profile_memory=True) if live
                else contextlib.nullcontext())
    with profiler as prof:
        with record_function("build"):
            model = build(config, cfg)
        n_params = sum(p.numel() for p in model.parameters())
        built = peak_mib()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
            with record_function("forward"):
                loss = model(x, x.roll(-1, 1))
            with record_function("backward"):
                loss.backward()
            with record_function("optimizer step"):
                opt.step()
                opt.zero_grad(set_to_none=True)
    report = {"config": config, "rank": rank, "built_mib": built, "peak_mib": peak_mib(),
              "params": n_params}
    if live:
        report.update(live_peak(prof))
    print("RESULT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


def build(config: str, cfg):
    import torch

    import shardwise as sw
    from shardwise.models import GPT

    torch.manual_seed(0)
    if config == "ddp":
        return torch.nn.parallel.DistributedDataParallel(GPT(cfg))
    if config == "fsdp2_meta":
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
        return model
    if config == "sharded_init":
        with sw.sharded_init():
            model = GPT(cfg)
        return sw.shard(model)
    if config == "build_then_shard":
        return sw.shard(GPT(cfg))
    raise SystemExit(f"unknown configuration {config}")


def live_peak(prof) -> dict:
    """The largest total of live tensor bytes any allocation reached, and where."""
    from torch._C._profiler import _EventType

    best = None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.extra_fields.alloc_size > 0:
            if best is None or e.extra_fields.total_allocated > best.extra_fields.total_allocated:
                best = e
    path, parent = [], best.parent if best is not None else None
    while parent is not None:
        path.append(parent.name)
        parent = parent.parent
    phase = next((p for p in reversed(path) if p in ("build", "forward", "backward",
                                                    "optimizer step")), "?")
    return {"live_mib": best.extra_fields.total_allocated / 2**20 if best else 0.0,
            "live_phase": phase, "live_op": " < ".join(path[:3])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=CONFIGS)
    parser.add_argument("--model", choices=list(MODELS), default="reference")
    parser.add_argument("--live", action="store_true")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--measures", default=",".join(MEASURES))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.steps, args.live)
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    for model_name in args.models.split(","):
        rows: dict[str, dict[str, list]] = {}
        for measure in args.measures.split(","):
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
            if measure == "rss_mmap":
                env["MALLOC_MMAP_THRESHOLD_"] = "131072"
            for config in args.configs.split(","):
                cmd = [torchrun, "--standalone", "--nproc_per_node", "2", __file__, "--worker",
                       config, "--model", model_name, "--steps", str(args.steps)]
                out = subprocess.run(cmd + (["--live"] if measure == "live" else []),
                                     env=env, capture_output=True, text=True)
                results = sorted((json.loads(line[7:]) for line in out.stdout.splitlines()
                                  if line.startswith("RESULT ")), key=lambda r: r["rank"])
                if out.returncode != 0 or len(results) != 2:
                    print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
                    raise SystemExit(f"{model_name} {config} {measure} failed")
                rows.setdefault(config, {})[measure] = results
                r0 = results[0]
                detail = (f"live {r0['live_mib']:.0f} MiB in {r0['live_phase']} "
                          f"({r0['live_op']})" if measure == "live" else
                          f"peak RSS {r0['peak_mib']:.0f} / {results[1]['peak_mib']:.0f} MiB")
                print(f"{model_name} {config} {measure}: {detail}", flush=True)
        report(model_name, rows)


def report(model_name: str, rows: dict[str, dict[str, list]]) -> None:
    """One table per model: each measure's rank maximum and its ratio to DDP's."""
    def value(results: list, measure: str) -> float:
        key = "live_mib" if measure == "live" else "peak_mib"
        return max(r[key] for r in results)

    measures = [m for m in MEASURES if any(m in v for v in rows.values())]
    print(f"\n{model_name}: " + ", ".join(f"{m} MiB (x DDP)" for m in measures))
    for config, by in rows.items():
        cells = []
        for m in measures:
            if m not in by:
                cells.append("-")
                continue
            v = value(by[m], m)
            base = value(rows["ddp"][m], m) if "ddp" in rows and m in rows["ddp"] else None
            cells.append(f"{v:8.0f} ({v / base:.2f})" if base else f"{v:8.0f}")
        print(f"  {config:18s} " + "  ".join(f"{c:>16s}" for c in cells))
    print(flush=True)


if __name__ == "__main__":
    main()
