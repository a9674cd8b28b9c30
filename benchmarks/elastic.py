"""Long runs and failures (issue 35): how often a shrunken job finishes with the bits of
an uninterrupted one, and what a checkpoint every K steps costs.

    python benchmarks/elastic.py shrink [--runs 20] [--default] [--seed S] [--torchrun]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/elastic.py \\
        save-cost [--steps 6 --saves 3]

``shrink``: two agents of 2 ranks on loopback, launched by ``shardwise run``
(``--torchrun``: plain torchrun, without TORCH_DISABLE_SHARE_RDZV_TCP_STORE), run
tests/elastic_script.py (reproducible mode, M=12, a checkpoint every 3 steps;
``--default``: the default mode), with the settings of docs/long-runs.md; agent 1 and
its workers are SIGKILLed after a random step, and agent 0 must finish at world 2 with
the uninterrupted world-4 run's losses and final state (tests/elastic_agents.py
``problems``). Each run prints its kill step, so a failure can be replayed; the summary
counts the runs that passed.

``save-cost``: the reference GPT (6 layers, d_model 512, sequence 256, 4 sequences per
rank, AdamW) at this world size: the median step without saving, the median
``Resumable.save()`` (synchronous: ``background=False``; benchmarks/background_save.py
measures background saves), and what one save every K steps adds to a step.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def shrink(args: argparse.Namespace) -> None:
    import elastic_agents

    total, every = 14, 3
    rng = random.Random(args.seed)
    extra = ("--default",) if args.default else ()
    passed, worst = 0, 0.0
    for i in range(args.runs):
        kill_at = rng.randint(every + 1, total - 4)
        started = time.monotonic()
        with tempfile.TemporaryDirectory() as root:
            try:
                run = elastic_agents.shrink(root, total, every, kill_at, extra,
                                            launcher=args.launcher)
                found = elastic_agents.problems(run, total, every, exact=not args.default,
                                                rel=1e-5)
            except AssertionError as e:
                found = [str(e)[-500:]]
        if args.default and not found:
            got, want = elastic_agents.losses(run.text), elastic_agents.losses(run.alone)
            for s, (v, w) in got.items():
                if w == 2:
                    worst = max(worst, abs(float.fromhex(v) / float.fromhex(want[s][0]) - 1))
        passed += not found
        print(f"run {i}: kill after step {kill_at}: {'ok' if not found else found} "
              f"({time.monotonic() - started:.0f} s)", flush=True)
    print(f"{passed}/{args.runs} runs finished at world 2 "
          f"{'within 1e-5' if args.default else 'bit-identical'} (seed {args.seed}, "
          f"{'shardwise run' if args.launcher == 'shardwise' else 'plain torchrun'})")
    if args.default:
        print(f"largest relative loss difference after the restart: {worst:.2e}")


def save_cost(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models import GPT, GPTConfig

    sw.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=6, d_model=512, seq_len=256)
    model = sw.shard(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1),
                      generator=torch.Generator().manual_seed(rank))
    folder = tempfile.mkdtemp(prefix="sw-save-cost-") if rank == 0 else None
    folder = [folder]
    dist.broadcast_object_list(folder)
    steps, saves = [], []
    with sw.Resumable(folder[0], model, opt, every=10**9, background=False) as run:
        for step in run.steps(args.steps + 1):
            dist.barrier()
            t = time.perf_counter()
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            if step:  # the first step builds the optimizer state
                steps.append(time.perf_counter() - t)
        for _ in range(args.saves):
            dist.barrier()
            t = time.perf_counter()
            run.save()
            saves.append(time.perf_counter() - t)
    if rank == 0:
        step, save = statistics.median(steps), statistics.median(saves)
        params = sum(p.numel() for p in model.parameters())
        print(f"world {dist.get_world_size()}, {params / 1e6:.1f}M parameters: step "
              f"{step * 1e3:.0f} ms, save {save * 1e3:.0f} ms (median of {len(steps)} "
              f"steps, {len(saves)} saves)")
        for k in (1, 10, 50, 100, 500):
            print(f"  every={k:<4} adds {save / k * 1e3:7.1f} ms a step "
                  f"({100 * save / (k * step):6.2f}%)")
        import shutil
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("shrink")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--default", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torchrun", dest="launcher", action="store_const", const="torchrun",
                   default="shardwise", help="launch with plain torchrun")
    p = sub.add_parser("save-cost")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--saves", type=int, default=3)
    args = parser.parse_args()
    shrink(args) if args.what == "shrink" else save_cost(args)


if __name__ == "__main__":
    main()
