"""QLoRA's step against PEFT + bitsandbytes, side by side: tokens per second per core.

    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py write FOLDER --preset small --layers 2
    OMP_NUM_THREADS=1 python benchmarks/qlora_speed.py FOLDER --bnb-python bnbvenv/bin/python \\
        [--world 1 2] [--rounds 3] [--steps 4] [--seq 64]

Issue 54 item 5. Each round runs, one after the other on the same machine: PEFT +
bitsandbytes in one process (``qlora_anchor_bnb.py``, from the environment of
``--bnb-python``: shardwise does not depend on bitsandbytes; how to make that environment
is in that script's docstring), then shardwise at each ``--world`` (``qlora_load.py run``:
``sharded_init(quantize="nf4")``, PEFT LoRA, ``shard``, ``load_pretrained``). Both train
the same LoRA (r 16 on q_proj and v_proj) of the same base from FOLDER with AdamW on one
random sequence of ``--seq`` tokens a step and process (a rank), bf16 compute. The first
step of each process is left out (warm-up). Each process or rank has one core
(``OMP_NUM_THREADS=1``) and trains its own sequence, so tokens per second per core is
``seq / step time`` for every system. Prints each round's median step time per system,
then one Markdown table: median over rounds, tokens per second per core, ratio to
bitsandbytes' (above 1: faster than bitsandbytes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from qlora_load import run as run_shardwise

HERE = os.path.dirname(os.path.abspath(__file__))


def run_bnb(python: str, folder: str, steps: int, seq: int) -> list[float]:
    """One PEFT + bitsandbytes process; its step times."""
    out = subprocess.run(
        [python, os.path.join(HERE, "qlora_anchor_bnb.py"), folder, "--steps", str(steps),
         "--seq", str(seq)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE},
        stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode:
        sys.exit(f"the bitsandbytes run failed (exit {out.returncode}); its stderr is above")
    row = next(json.loads(line) for line in out.stdout.splitlines() if line.startswith("{"))
    print(json.dumps(row), flush=True)
    return row["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--bnb-python", required=True,
                    help="python of an environment with bitsandbytes (qlora_anchor_bnb.py)")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in shardwise's ranks only (repeatable), e.g. "
                         "MALLOC_MMAP_THRESHOLD_=33554432 (docs/qlora.md, speed)")
    args = ap.parse_args()
    if any("=" not in e for e in args.env):
        ap.error("--env takes NAME=VALUE")
    env = dict(e.split("=", 1) for e in args.env)
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step is warm-up")
    systems = ["peft+bitsandbytes, 1 process"] + [f"shardwise, {w} ranks" for w in args.world]
    medians: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(args.rounds):
        print(f"round {r + 1} of {args.rounds}", file=sys.stderr, flush=True)
        medians[systems[0]].append(statistics.median(
            run_bnb(args.bnb_python, args.folder, args.steps, args.seq)[1:]))
        for w, name in zip(args.world, systems[1:]):
            rows = run_shardwise(args.folder, w, args.steps, args.seq, env=env)
            # A step ends when the slowest rank's does: each step's largest time.
            per_step = [max(r["step_s"][i] for r in rows) for i in range(1, args.steps)]
            medians[name].append(statistics.median(per_step))
        print("round medians (s): " + ", ".join(f"{s} {m[-1]:.3f}" for s, m in medians.items()),
              flush=True)
    base = args.seq / statistics.median(medians[systems[0]])
    extra = "".join(f" --env {e}" for e in args.env)
    print(f"\n`qlora_speed.py {args.folder} --world {' '.join(map(str, args.world))} "
          f"--rounds {args.rounds} --steps {args.steps} --seq {args.seq}{extra}`\n")
    print("| system | step s (median of rounds) | rounds | tokens/s per core | "
          "against bitsandbytes |")
    print("|---|---|---|---|---|")
    for s, m in medians.items():
        step = statistics.median(m)
        tps = args.seq / step
        print(f"| {s} | {step:.3f} | {', '.join(f'{x:.3f}' for x in m)} | {tps:.1f} | "
              f"{tps / base:.2f}x |")


if __name__ == "__main__":
    main()
