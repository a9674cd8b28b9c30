"""The engine at world sizes no machine here has: torch's fake process group.

    OMP_NUM_THREADS=1 python benchmarks/simulate.py            # worlds 8, 64 and 512

A 1.27B-parameter GPT (24 blocks, d_model 2048, vocab 32000, tied head) is built under
``sw.sharded_init`` and sharded in one process that plays rank 0 of a world of N; the
fake backend's collectives move nothing but every shape, buffer and copy is real. One
AdamW training step (batch 1 x 16 tokens) runs. For each world the script reports what
rank 0 holds (parameters, gradients, optimizer state, from the storage actually
allocated) against ``shardwise.planner.plan`` and against the unpadded theory P/N, and
the bytes rank 0 fed into each kind of collective during the step against the ZeRO-3
theory: all-gathers of 2x the unit parameter bytes divided by N (the root unit once:
it stays gathered from its forward to its backward; from the second step on, so does the
unit that ran last, which this one-step run does not reach), and a reduce-scatter input
of 1x the parameter bytes. Each world runs in a fresh process so that one's memory does not
carry into the next.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import shardwise as sw
from shardwise.memory import state_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.planner import plan

world = int(sys.argv[1])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
cfg = GPTConfig(vocab_size=32000, seq_len=128, n_layer=24, n_head=16, d_model=2048)
with torch.device("meta"):
    planned = plan(GPT(cfg), world)
t0 = time.perf_counter()
with sw.sharded_init():
    model = GPT(cfg)
model = sw.shard(model)
built = time.perf_counter() - t0
n = sum(p.numel() for p in model.parameters())
root_bytes = sw.inspect(model).units[0].gathered_bytes  # fp32: stored = gathered dtype
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (1, 16))
model(x, x).backward()           # warm-up step: optimizer state appears at its end
opt.step(); opt.zero_grad(set_to_none=False)
before = sw.inspect(model).comm
t0 = time.perf_counter()
model(x, x).backward()
opt.step()
step = time.perf_counter() - t0
sent = sw.inspect(model).comm.since(before).bytes
got = state_bytes(model, opt)
print("RESULT " + json.dumps({
    "world": world, "params": n, "built_s": built, "step_s": step, "root_bytes": root_bytes,
    "got": got, "planned": [planned.parameters, planned.gradients, planned.optimizer],
    "sent": sent}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="8,64,512")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    print(f"{'world':>6} {'params/rank MiB':>16} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'= plan':>7} {'vs P/N':>7} {'all-gather in':>14} {'theory':>8} "
          f"{'reduce-scatter in':>18} {'theory':>8} {'step s':>7}")
    for world in map(int, args.worlds.split(",")):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", WORKER, str(world)], env=env,
                             capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"world {world} failed")
        r = json.loads(lines[0][7:])
        p_bytes = r["params"] * 4
        got = r["got"]
        matches = [got["params"], got["grads"], got["optimizer"]] == r["planned"]
        # Theory, per rank: parameters, gradients P/N each, AdamW 2P/N; all-gather input
        # (2P - root)/N (the root unit is gathered once per step); reduce-scatter input P.
        ag_theory = (2 * p_bytes - r["root_bytes"]) / world
        mib = 2 ** 20
        print(f"{world:6d} {got['params'] / mib:16.1f} {got['grads'] / mib:10.1f} "
              f"{got['optimizer'] / mib:10.1f} {'yes' if matches else 'NO':>7} "
              f"{got['params'] / (p_bytes / world):7.3f} "
              f"{r['sent'].get('all_gather', 0) / mib:14.1f} {ag_theory / mib:8.1f} "
              f"{r['sent'].get('reduce_scatter', 0) / mib:18.1f} {p_bytes / mib:8.1f} "
              f"{r['step_s']:7.1f}", flush=True)
        print(f"       ({r['params'] / 1e9:.2f}B parameters; built under sharded_init in "
              f"{r['built_s']:.0f} s; whole run {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
