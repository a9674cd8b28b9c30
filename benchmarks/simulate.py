"""The engine at world sizes no machine here has: torch's fake process group.

    OMP_NUM_THREADS=1 python benchmarks/simulate.py            # worlds 8, 64 and 512

A 1.27B-parameter GPT (24 blocks, d_model 2048, vocab 32000, tied head) is built under
``sw.sharded_init`` and sharded in one process that plays rank 0 of a world of N; the
fake backend's collectives move nothing but every shape, buffer and copy is real. One
AdamW training step (batch 1 x 16 tokens) runs. For each world the script reports what
rank 0 holds (parameters, gradients, optimizer state, from the storage actually
allocated) against ``shardwise.planning.planner.plan`` and against the unpadded theory P/N, and
the bytes rank 0 fed into each kind of collective during the step against the ZeRO-3
theory: all-gathers of 2x the unit parameter bytes divided by N (the root unit once:
it stays gathered from its forward to its backward; from the second step on, so does the
unit that ran last, which this one-step run does not reach), and a reduce-scatter input
of 1x the parameter bytes. Each world runs in a fresh process so that one's memory does not
carry into the next.

    OMP_NUM_THREADS=1 python benchmarks/simulate.py --meshes 8x8,64x8,512x8

Hybrid sharding (Note [hybrid sharding] in comm/mesh.py) on a (R, S) mesh from
``init_device_mesh``, and flat ZeRO-3 over the same R*S ranks, the same step. A row of the
mesh is taken as a node of S ranks. Per rank: state bytes against ``planner.plan`` (over
S for hybrid, R*S for flat), input bytes of the collectives within a node and of those
spanning nodes against ``planner.comm_plan``, and what ring algorithms send for them. How
"spanning nodes" is counted: by group, not by hop. Hybrid's all-gathers and
reduce-scatters run within a node and its all-reduce of each gradient shard across the R
replicas spans nodes; flat ZeRO-3's all-gathers and reduce-scatters run over all R*S
ranks, so with R > 1 all of them span nodes (a ring over node-contiguous ranks puts only
one hop in S between nodes, but every hop of the ring carries the same bytes, so the
slowest link, between nodes, sets the pace). Both also all-reduce a few bytes over the
world per step (the collective-order check): listed separately.
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
from shardwise.planning.memory import state_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.planning.planner import plan

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

MESH_WORKER = r"""
import json, sys, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
import shardwise as sw
from shardwise.planning.memory import state_bytes
from shardwise.models import GPT, GPTConfig
from shardwise.planning.planner import comm_plan, plan

layout, R, S = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
world = R * S
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
cfg = GPTConfig(vocab_size=32000, seq_len=128, n_layer=24, n_head=16, d_model=2048)
shards, replicas = (S, R) if layout == "hybrid" else (world, 1)
with torch.device("meta"):
    meta = GPT(cfg)
    planned, planned_comm = plan(meta, shards), comm_plan(meta, replicas, shards)
t0 = time.perf_counter()
# Built over the whole world, then sharded on the mesh: equal to building on rank 0.
with sw.sharded_init():
    model = GPT(cfg)
if layout == "hybrid":
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))
    model = sw.shard(model, mesh=mesh)
else:
    model = sw.shard(model)
built = time.perf_counter() - t0
view = sw.inspect(model)
assert (view.shard_size, view.replicas) == (shards, replicas), view
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (1, 16))
model(x, x).backward()           # warm-up step: the order and the optimizer state
opt.step(); opt.zero_grad(set_to_none=False)
before = sw.inspect(model)
t0 = time.perf_counter()
model(x, x).backward()
opt.step()
step = time.perf_counter() - t0
after = sw.inspect(model)
within = after.comm.since(before.comm).bytes
across = (after.comm_across.since(before.comm_across).bytes
          if after.comm_across is not None else {})
print("RESULT " + json.dumps({
    "layout": layout, "R": R, "S": S, "built_s": built, "step_s": step,
    "got": state_bytes(model, opt),
    "planned": [planned.parameters, planned.gradients, planned.optimizer],
    "planned_comm": planned_comm.as_dict(), "within": within, "across": across}))
"""


def _worker(code: str, *argv: object) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env,
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(out.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{argv} failed")
    return json.loads(lines[0][7:])


def _mesh_row(r: dict) -> str:
    """One Markdown row: the measured figures, each against the plan."""
    mib = 2 ** 20
    hybrid = r["layout"] == "hybrid"
    n = r["R"] * r["S"]
    group = r["S"] if hybrid else n
    got, pc = r["got"], r["planned_comm"]
    ag, rs = r["within"]["all_gather"], r["within"]["reduce_scatter"]
    ar = r["across"].get("all_reduce", 0)
    checks = r["within"]["all_reduce"]  # the world group's order check: spans nodes
    state_ok = [got["params"], got["grads"], got["optimizer"]] == r["planned"]
    comm_ok = (ag, rs, ar) == (pc["all_gather"], pc["reduce_scatter"], pc["all_reduce"])
    spans = r["R"] > 1
    in_node, across = (ag + rs, ar) if hybrid or not spans else (0, ag + rs)
    # Ring algorithms: an all-gather sends the shard to the group's other ranks, a
    # reduce-scatter (g-1)/g of its input, an all-reduce over R replicas 2(R-1)/R.
    ring = (group - 1) * ag + (group - 1) * rs / group
    ring_across = 2 * (r["R"] - 1) * ar / r["R"] if hybrid else (ring if spans else 0)
    ring_in = ring if hybrid or not spans else 0
    name = f"hybrid ({r['R']}, {r['S']})" if hybrid else f"flat {n}"
    return (f"| {name} | {n} | {got['params'] / mib:.1f} | {got['grads'] / mib:.1f} | "
            f"{got['optimizer'] / mib:.1f} | {'yes' if state_ok else 'NO'} | "
            f"{ag / mib:.1f} | {rs / mib:.1f} | {ar / mib:.1f} | "
            f"{'yes' if comm_ok else 'NO'} | {in_node / mib:.1f} | {across / mib:.1f} | "
            f"{ring_in / mib:.1f} | {ring_across / mib:.1f} | {checks} | "
            f"{r['built_s']:.0f} | {r['step_s']:.1f} |")


def meshes(spec: str) -> None:
    """Hybrid on each ``RxS`` mesh of ``spec`` and flat ZeRO-3 on R*S ranks, as a
    Markdown table (MiB per rank; the plan columns say whether the measured bytes equal
    ``planner.plan`` and ``planner.comm_plan`` exactly)."""
    print("| layout | ranks | params/rank MiB | grads MiB | AdamW MiB | = plan | "
          "all-gather in MiB | reduce-scatter in MiB | all-reduce across in MiB | "
          "= comm plan | within a node MiB | spanning nodes MiB | ring sent within MiB | "
          "ring sent spanning MiB | world checks B | build s | step s |")
    print("|" + "---|" * 17, flush=True)
    for item in spec.split(","):
        r, s = map(int, item.lower().split("x"))
        for layout in ("hybrid", "flat"):
            print(_mesh_row(_worker(MESH_WORKER, layout, r, s)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="8,64,512")
    parser.add_argument("--meshes", help="RxS,...: hybrid meshes against flat ZeRO-3 at "
                                         "R*S ranks instead of --worlds, e.g. 8x8,64x8")
    args = parser.parse_args()
    if args.meshes:
        meshes(args.meshes)
        return
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
