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
- ``heap`` (from the ``rss`` run): the peak of malloc'd bytes in use, every thread's,
  polled from glibc every half millisecond (``HeapPeak``): live tensors and little
  else, without the allocator's cached free memory;
- ``live``: where the peak is, from torch.profiler's allocation events (replayed by
  address), with the phase, operator and the largest allocation sites at the peak. The
  events miss frees done on gloo's worker threads, so its total can run high; ``heap``
  is the figure to compare.
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


class HeapPeak:
    """The peak of malloc'd bytes in use (glibc ``mallinfo2``: heap plus mmapped blocks),
    polled every half millisecond from a thread, minus what was in use at the start.

    Counts every thread's allocations and frees (gloo's worker threads free tensors the
    main thread allocated, which the profiler's allocation events do not see) and none
    of the allocator's cached free memory, which RSS includes.
    """

    def __init__(self) -> None:
        import ctypes
        import threading

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        self._info = libc.mallinfo2
        self.base = self._in_use()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _in_use(self) -> int:
        m = self._info()
        return m.uordblks + m.hblkhd

    def _poll(self) -> None:
        while not self._stop.wait(0.0005):
            self.peak = max(self.peak, self._in_use())

    def stop_mib(self) -> float:
        self._stop.set()
        self._thread.join()
        return (max(self.peak, self._in_use()) - self.base) / 2**20


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
    heap = HeapPeak()
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
              "params": n_params, "heap_mib": heap.stop_mib()}
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
    """The peak of live tensor bytes, and what was live then.

    Replays the profiler's allocation and free events in time order, matched by address,
    so every live byte at the peak has an allocation site. (The allocator's running
    total in the same events also counts blocks that gloo's threads allocate and free
    out of the profiler's sight; on ``sharded_init``'s source rank it read 300 MiB
    above the replay, with no matching allocation event and no trace in RSS.)
    """
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            events.append(e)
    events.sort(key=lambda e: e.start_time_ns)
    live: dict[int, tuple[int, object]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, object]] = {}
    for e in events:
        f = e.extra_fields
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, e)
            total += f.alloc_size
            if total > peak:
                peak, at_peak, peak_event = total, dict(live), e
        elif f.ptr in live:
            total -= live.pop(f.ptr)[0]
    sites: dict[str, int] = {}
    for size, e in at_peak.values():
        sites[_site(e)] = sites.get(_site(e), 0) + size
    top = sorted(sites.items(), key=lambda kv: -kv[1])[:int(os.environ.get("SITES", "6"))]
    return {"live_mib": peak / 2**20, "live_phase": _site(peak_event).split(":")[0],
            "live_op": _site(peak_event),
            "live_sites": [(name, round(b / 2**20, 1)) for name, b in top]}


def _site(event) -> str:
    """'phase: innermost op < its caller' for an allocation event."""
    names, phase, parent = [], "?", event.parent
    while parent is not None:
        if parent.name in ("build", "forward", "backward", "optimizer step"):
            phase = parent.name
        elif len(names) < 2:
            names.append(parent.name)
        parent = parent.parent
    return f"{phase}: {' < '.join(names)}"


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
                          f"peak RSS {r0['peak_mib']:.0f} / {results[1]['peak_mib']:.0f} MiB"
                          f", heap in use {r0['heap_mib']:.0f} / "
                          f"{results[1]['heap_mib']:.0f} MiB")
                print(f"{model_name} {config} {measure}: {detail}", flush=True)
        report(model_name, rows)


def report(model_name: str, rows: dict[str, dict[str, list]]) -> None:
    """One table per model: each measure's rank maximum and its ratio to DDP's."""
    def value(results: list, measure: str) -> float:
        key = {"live": "live_mib", "heap": "heap_mib"}.get(measure, "peak_mib")
        return max(r[key] for r in results)

    for by in rows.values():  # the heap peak comes from the plain (rss) run
        if "rss" in by:
            by["heap"] = by["rss"]
    measures = [m for m in MEASURES + ["heap"] if any(m in v for v in rows.values())]
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
