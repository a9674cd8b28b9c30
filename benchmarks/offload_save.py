"""The memory and time of saving, then loading, a disk-offloaded model's checkpoint.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/offload_save.py \
        [--layers 12] [--width 1024] [--folder DIR]

Each rank builds a GPT (vocabulary 8192) under ``sw.sharded_init``, shards it with
everything on disk (``sw.Offload(params="disk", optimizer="disk")``), runs one AdamW step
so that the optimizer state exists, then saves a checkpoint, and loads it into a second
model built the same way (its own tier folder). It prints its state's bytes on disk, and
for the save and the load their peak RSS above the RSS before each (``VmHWM``, reset
through ``/proc/self/clear_refs``: file-backed pages count) and their time. Run it
against two commits (``PYTHONPATH=<worktree>/src``) to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
from procstat import reset_peak, status_mib

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def _measured(fn) -> str:
    before = status_mib("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    return f"peak RSS +{status_mib('VmHWM') - before:.0f} MiB over {before:.0f} MiB, {took:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--folder", default=None, help="for the disk tier and the checkpoint")
    args = ap.parse_args()
    sw.init_distributed()
    rank = dist.get_rank()
    # One folder for every rank: the checkpoint path must be the same on each.
    root = args.folder or os.path.join(tempfile.gettempdir(), "shardwise_offload_save")
    if rank == 0:
        shutil.rmtree(os.path.join(root, "checkpoint"), ignore_errors=True)
    dist.barrier()
    cfg = GPTConfig(vocab_size=8192, seq_len=8, n_layer=args.layers, n_head=16,
                    d_model=args.width)
    def build(tier: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        with sw.sharded_init():
            model = GPT(cfg)
        model = sw.shard(model, offload=sw.Offload(params="disk", optimizer="disk",
                                                   folder=os.path.join(root, tier)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, opt = build("tier")
    x = torch.randint(0, 8192, (1, 8))
    model(x, torch.roll(x, -1, 1)).backward()
    opt.step()
    opt.zero_grad()
    ckpt = os.path.join(root, "checkpoint")
    save = _measured(lambda: sw.save_checkpoint(ckpt, model, opt))
    state = sum(sw.inspect(model).tier_bytes.values()) / 2**20
    other, other_opt = build("tier2")
    load = _measured(lambda: sw.load_checkpoint(ckpt, other, other_opt))
    print(f"rank {rank}: state on disk {state:.0f} MiB; save: {save}; load: {load}",
          flush=True)
    dist.barrier()
    if rank == 0 and args.folder is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
