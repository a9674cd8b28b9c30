"""Offload: peak resident memory and step time against depth, per placement.

    OMP_NUM_THREADS=1 python benchmarks/offload.py [--layers 8 16 32] [--folder DIR]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/offload.py \
        --end-to-end 34 2048 3 --folder /nvme/dir

For each depth and placement, two ranks (torchrun, gloo) build a GPT 512 wide (vocabulary
8192, 8-token sequences, batch 1: activations stay small beside the parameters) under
``sw.sharded_init``, shard it with that ``sw.Offload``, and run 5 AdamW steps with
``sw.clip_grad_norm_``. Each rank reports its resident memory once built, then its peak
RSS above that in the first step (which creates the optimizer state) and in steps 2-5
(``VmHWM``, reset through ``/proc/self/clear_refs``: file-backed pages count, as the
kernel counts them), its step time (median of steps 2-5) and its bytes per tier
(``sw.inspect``); the table shows the larger rank's figures. A flat column for
``disk/disk`` is the claim: the peak does not grow with depth. The other placements'
peaks grow with the training state.

``--end-to-end LAYERS WIDTH STEPS`` (under torchrun) builds a GPT that wide and deep under
``sharded_init``, shards it with everything on disk, and prints per step the time, the
peak RSS (``VmHWM``, the whole run), the disk I/O, the bytes moved (Note [bytes moved])
and the size of the rank's files: 34 layers 2048 wide have 1.73B parameters, whose fp32
training state (27.7 GB) is larger than a 24 GiB machine; 70 layers have 3.54B (56.7 GB).

``--compare LAYERS WIDTH STEPS`` (under torchrun) trains the ``--end-to-end`` shape at
fewer layers twice, in memory and all on disk, says whether the losses and final
parameters are bit-identical, and prints the disk run's bytes per step, measured from a
cold page cache (each step starts with the rank's files written back and dropped from
the cache), beside the planner's figure::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/offload.py \
        --compare 2 2048 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from procstat import reset_peak, status_mib

PLACEMENTS = {"none": (None, None), "device/cpu": (None, "cpu"), "cpu/cpu": ("cpu", "cpu"),
              "disk/disk": ("disk", "disk")}
DEFAULT = ["none", "cpu/cpu", "disk/disk"]  # device/cpu is cpu/cpu plus a copy on a CPU


def child(layers: int, placement: str, folder: str) -> None:
    import torch

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    sw.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(vocab_size=8192, seq_len=8, n_layer=layers, n_head=8, d_model=512)
    params, optimizer = PLACEMENTS[placement]
    offload = None if params is None and optimizer is None else sw.Offload(
        params=params, optimizer=optimizer, folder=folder if "disk" in placement else None)
    torch.manual_seed(0)
    with sw.sharded_init():
        model = GPT(cfg)
    model = sw.shard(model, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    reset_peak()
    base = status_mib("VmRSS")
    times, first = [], 0.0
    for step in range(5):
        x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
        start = time.perf_counter()
        model(x, torch.roll(x, -1, 1)).backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if step == 0:  # the first step creates the optimizer state: measured apart
            first = status_mib("VmHWM")
            reset_peak()
    view = sw.inspect(model)
    print("RESULT " + json.dumps({
        "rank": rank, "layers": layers, "placement": placement, "peak_mib": status_mib("VmHWM"),
        "first_mib": first, "base_mib": base,
        "step_s": statistics.median(times[1:]),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "largest_gathered_mib": view.largest_gathered_bytes / 2**20,
        "tier_mib": {k: v / 2**20 for k, v in view.tier_bytes.items()}}), flush=True)
    torch.distributed.destroy_process_group()


def _io() -> dict[str, int]:
    """This process's block I/O so far (``/proc/self/io``): what reached the disk, page
    cache hits excluded; writes are counted when the process dirties file pages."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _evict(folder: str) -> None:
    """Write this process's tier files back and drop them from the page cache, so that
    the next step's ``/proc/self/io`` counts every page it reads from the disk and every
    page it dirties: the bytes a model too large for the page cache would move. The files
    are unlinked (Note [the disk tier]); their mappings' descriptors are in
    ``/proc/self/fd``."""
    where = os.path.realpath(folder)
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(where) and target.endswith(".bin (deleted)"):
            os.fsync(int(fd))
            os.posix_fadvise(int(fd), 0, 0, os.POSIX_FADV_DONTNEED)


def end_to_end(layers: int, width: int, steps: int, folder: str) -> None:
    """A model whose fp32 training state (16 bytes a parameter) exceeds the machine's
    memory, built under sharded_init straight into the disk tier, trained a few steps."""
    import torch

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    sw.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(vocab_size=8192, seq_len=8, n_layer=layers, n_head=16, d_model=width)
    start = time.perf_counter()
    torch.manual_seed(0)
    with sw.sharded_init():
        model = GPT(cfg)
    model = sw.shard(model, offload=sw.Offload(params="disk", optimizer="disk", folder=folder))
    built = time.perf_counter() - start
    n = sum(p.numel() for p in model.parameters())
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    if rank == 0:
        planned = _plan(cfg, torch.distributed.get_world_size(), folder)
        print(f"{n / 1e9:.2f}B parameters: fp32 training state {16 * n / 2**30:.1f} GiB, "
              f"machine memory {total / 2**30:.1f} GiB; built in {built:.0f} s, peak RSS so "
              f"far {status_mib('VmHWM'):.0f} MiB; planned for rank 0: files "
              f"{planned.tiers['disk'] / 2**30:.1f} GiB, moved per step "
              f"{planned.moved_per_step / 2**30:.1f} GiB (least possible "
              f"{planned.moved_minimum / 2**30:.1f} GiB)", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    reset_peak()  # from here, the training's peak
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
        io0, moved0 = _io(), sw.inspect(model).moved_bytes
        t0 = time.perf_counter()
        loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        t1 = time.perf_counter()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        io1 = _io()
        view = sw.inspect(model)
        disk, moved = view.tier_bytes["disk"], view.moved_bytes - moved0
        read, written = (io1[k] - io0[k] for k in ("read_bytes", "write_bytes"))
        print(f"rank {rank} step {step}: loss {loss.item():.4f}, forward+backward "
              f"{t1 - t0:.1f} s, clip+step {t2 - t1:.1f} s, disk read {read / 2**30:.1f} "
              f"GiB, written {written / 2**30:.1f} GiB (this process), moved "
              f"{moved / 2**30:.1f} GiB (Note [bytes moved]), training's peak RSS "
              f"{status_mib('VmHWM'):.0f} MiB, this rank's files {disk / 2**30:.1f} GiB",
              flush=True)
    torch.distributed.destroy_process_group()


def _plan(cfg, world: int, folder: str):
    """The planner's figures for this model, all on disk (Note [bytes moved])."""
    import torch

    import shardwise as sw
    from shardwise.models import GPT
    from shardwise.planning.planner import plan

    with torch.device("meta"):
        meta = GPT(cfg)
    return plan(meta, world, "adamw",
                offload=sw.Offload(params="disk", optimizer="disk", folder=folder))


def compare(layers: int, width: int, steps: int, folder: str) -> None:
    """The end-to-end model's shape at fewer layers, trained in memory and with
    everything on disk from the same initial values and batches: whether the losses and
    the final parameters are bit-identical, and the disk run's bytes per step (the
    engine's counter, ``/proc/self/io`` from a cold page cache, and the planner's
    figure)."""
    import torch

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    sw.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = GPTConfig(vocab_size=8192, seq_len=8, n_layer=layers, n_head=16, d_model=width)
    runs = {}
    for name in ("memory", "disk"):
        torch.manual_seed(0)
        with sw.sharded_init():
            model = GPT(cfg)
        offload = sw.Offload(params="disk", optimizer="disk", folder=folder) \
            if name == "disk" else None
        model = sw.shard(model, offload=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        g = torch.Generator().manual_seed(rank)
        losses, moved, io = [], [], []
        for _ in range(steps):
            x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
            if name == "disk":
                _evict(folder)
            before, io0 = sw.inspect(model).moved_bytes, _io()
            loss = model(x, torch.roll(x, -1, 1))
            loss.backward()
            sw.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            io1 = _io()
            losses.append(loss.detach())
            moved.append(sw.inspect(model).moved_bytes - before)
            io.append((io1["read_bytes"] - io0["read_bytes"],
                       io1["write_bytes"] - io0["write_bytes"]))
        params = [p.to_local().detach().clone() for p in model.parameters()]
        runs[name] = (torch.stack(losses), params, moved, io)
        del model, opt
    (lm, pm, _, _), (ld, pd, moved, io) = runs["memory"], runs["disk"]
    same = torch.equal(lm, ld) and all(torch.equal(a, b) for a, b in zip(pm, pd))
    n = sum(t.numel() for t in pm)
    print(f"rank {rank}: {layers} layers {width} wide, {steps} steps; losses in memory "
          f"{lm.tolist()}, on disk {ld.tolist()}: "
          f"{'bit-identical' if same else 'DIFFERENT'} (losses and {n} parameter "
          f"elements)", flush=True)
    expected = _plan(cfg, world, folder)
    for step, (m, (r, w)) in enumerate(zip(moved, io)):
        print(f"rank {rank} step {step}: moved {m / 2**20:.1f} MiB (planned for rank 0: "
              f"{expected.moved_per_step / 2**20:.1f} MiB, least possible "
              f"{expected.moved_minimum / 2**20:.1f} MiB), /proc/self/io read "
              f"{r / 2**20:.1f} MiB, written {w / 2**20:.1f} MiB", flush=True)
    torch.distributed.destroy_process_group()
    if not same:
        sys.exit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--placements", nargs="+", default=DEFAULT, choices=list(PLACEMENTS))
    ap.add_argument("--folder", default=None)
    ap.add_argument("--child", nargs=3, metavar=("LAYERS", "PLACEMENT", "FOLDER"))
    ap.add_argument("--end-to-end", nargs=3, type=int, metavar=("LAYERS", "WIDTH", "STEPS"),
                    help="under torchrun: train a model bigger than memory, all on disk")
    ap.add_argument("--compare", nargs=3, type=int, metavar=("LAYERS", "WIDTH", "STEPS"),
                    help="under torchrun: the --end-to-end shape at fewer layers, in memory "
                         "and on disk: bit-identical?, and bytes moved per step")
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare, folder=args.folder or tempfile.mkdtemp())
        return
    if args.end_to_end:
        end_to_end(*args.end_to_end, folder=args.folder or tempfile.mkdtemp())
        return
    if args.child:
        child(int(args.child[0]), args.child[1], args.child[2])
        return
    folder = args.folder or tempfile.mkdtemp(prefix="shardwise-offload-")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    print(f"{'layers':>6} {'params':>8} {'placement':>10} {'built':>9} {'1st step':>10} "
          f"{'steps 2-5':>10} "
          f"{'gathered unit':>14} {'step':>8}  bytes per tier (rank 0)")
    for layers in args.layers:
        for placement in args.placements:
            out = subprocess.run(
                [torchrun, "--standalone", "--nproc_per_node", "2", __file__,
                 "--child", str(layers), placement, folder],
                capture_output=True, text=True, check=True).stdout
            rows = [json.loads(line[7:]) for line in out.splitlines()
                    if line.startswith("RESULT ")]
            r0 = min(rows, key=lambda r: r["rank"])
            peak = max(r["peak_mib"] - r["base_mib"] for r in rows)
            first = max(r["first_mib"] - r["base_mib"] for r in rows)
            base = max(r["base_mib"] for r in rows)
            tiers = ", ".join(f"{k} {v:.0f} MiB" for k, v in r0["tier_mib"].items() if v)
            print(f"{layers:>6} {r0['params_m']:>7.1f}M {placement:>10} {base:>5.0f} MiB "
                  f"+{first:>5.0f} MiB +{peak:>5.0f} MiB "
                  f"{r0['largest_gathered_mib']:>10.1f} MiB {r0['step_s']:>7.2f}s  "
                  f"{tiers or '-'}", flush=True)


if __name__ == "__main__":
    main()
