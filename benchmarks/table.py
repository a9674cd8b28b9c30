"""One table of step-time ratios, before and after, measured one run after the other.

    python benchmarks/table.py --before f335e27 [--workloads llama,bert,cnn,gpt,accum]
        [--systems ddp,fsdp2,shardwise,...] [--rounds 3 --steps 5] [--out table.md]

By default every workload (llama, bert, cnn, gpt, accum) and the systems ddp, fsdp2,
shardwise, shardwise_unchecked, shardwise_reproducible, ddp_compiled, fsdp2_compiled and
shardwise_compiled (workloads.py's docstring describes them). For each workload,
``benchmarks/workloads.py`` (this tree's script) runs twice at 2 ranks under
``torchrun``: first with the shardwise of commit ``--before`` (checked out into a
temporary git worktree and put first on ``PYTHONPATH``), then with this tree's. DDP and
FSDP2 run in both, so each shardwise ratio is to the DDP measured beside it in the same
run (the compiled systems': to compiled DDP); the two runs of a workload follow each
other directly, so both see the same machine.

Before starting it prints an estimate of the run time (rounds x steps x systems x
workloads, from step times measured on the 2-core machine of BENCHMARKS.md, plus each
compiled system's compile, cold in a workload's first run and from inductor's caches in
its second, and each run's start), and before each workload the time so
far and what remains at the pace measured so far. At the end it prints (and writes to
``--out``, atomically) one Markdown table under a line naming both commits and the exact
command: workload, system, its baseline, median ratio to the baseline before and after,
the per-round ratios and the largest loss difference from the baseline (after). A system
that did not run (an option the before commit lacks, a compile that failed, a run that
ended early) shows ``n/a`` with the reason; the table is still made.

The ratios compare across runs because each is taken against its own run's baseline;
absolute times are printed by each run too (its stdout is echoed) for a reader who wants
them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = ("llama", "bert", "cnn", "gpt", "accum")
SYSTEMS = ("ddp", "fsdp2", "shardwise", "shardwise_unchecked", "shardwise_reproducible",
           "ddp_compiled", "fsdp2_compiled", "shardwise_compiled")
RATIOS = re.compile(r"^([0-9. ]+); \*\*([0-9.]+)\*\*$")

# For the estimate: DDP's eager step on the 2-core machine of BENCHMARKS.md (2 ranks, one
# thread each, nothing else running), seconds; the other systems' steps on average about
# SLOWER times that (with these, 4 systems at 3 rounds of 6 steps give the 14 minutes
# that table took at 972d531); a compiled system's first step (dynamo, AOTAutograd,
# inductor) about COMPILE_S more than its steps in the first run of a workload and
# RECOMPILE_S in the second, which finds the first's graphs and kernels in inductor's
# caches on disk; one torchrun start with imports and building the models about START_S.
# The compile times are guesses for a quiet machine from first steps measured at load
# average 6-7 (DDP, FSDP2, shardwise compiled: cnn 47, 67, 14 s cold and 2-3 s cached;
# llama 95, 28, 3 s cold; bert 56, 54, 3 s cold; gpt 17-19, 8-9, 5-6 s cached; accum 53,
# 30, 18-45 s cold and 61 s for DDP cached: its micro-batches under no_sync and the
# Hugging Face layers recompile in the first step). Coarse: a loaded machine takes
# longer, which the progress lines show.
STEP_S = {"llama": 0.14, "bert": 0.3, "cnn": 0.06, "gpt": 1.9, "accum": 1.4}
SLOWER = 1.25
COMPILE_S = {"llama": 30.0, "bert": 30.0, "cnn": 25.0, "gpt": 25.0, "accum": 40.0}
RECOMPILE_S = {"llama": 5.0, "bert": 5.0, "cnn": 2.0, "gpt": 5.0, "accum": 20.0}
START_S = 20.0


def baseline(system: str) -> str:
    """The system ``system``'s ratios are taken against (as workloads.py's)."""
    return "ddp_compiled" if system.endswith("_compiled") and system != "ddp_compiled" else "ddp"


def estimate(workloads: list[str], systems: list[str], rounds: int, steps: int) -> dict:
    """Estimated seconds per workload, both runs (before and after) together."""
    out = {}
    for w in workloads:
        step = STEP_S.get(w, 1.0)
        compiled = sum(s.endswith("_compiled") for s in systems)
        out[w] = (2 * START_S + compiled * (COMPILE_S.get(w, 50.0) + RECOMPILE_S.get(w, 20.0))
                  + 2 * sum(rounds * steps * step * (1.0 if s == "ddp" else SLOWER)
                            for s in systems))
    return out


def parse_row(line: str) -> tuple[str, dict] | None:
    """A row of workloads.py's table: its system and ``baseline``, ``median`` (the median
    ratio, or None), ``rounds`` (the per-round ratios, or the reason there are none) and
    ``loss`` (largest loss difference from the baseline); None for any other line."""
    cells = [c.strip() for c in line.strip().split("|")]
    if len(cells) != 7 or cells[0] or cells[-1]:
        return None
    system, base, _, ratios, loss = cells[1:6]
    if system not in SYSTEMS and not system.startswith(("shardwise", "ddp", "fsdp2")):
        return None
    m = RATIOS.match(ratios)
    if m:
        return system, {"baseline": base, "median": m[2], "rounds": m[1].strip(),
                        "loss": loss}
    if ratios.startswith("n/a"):
        return system, {"baseline": base, "median": None, "rounds": ratios, "loss": loss}
    return None


def cell(row: dict | None, missing: str) -> str:
    """A before or after cell: the median ratio, or ``n/a`` and why."""
    if row is None:
        return f"n/a ({missing})"
    return f"{row['median']}x" if row["median"] is not None else row["rounds"]


def markdown(results: list[tuple[str, dict, dict, str, str]], systems: list[str]) -> list[str]:
    """The table's lines: one row per workload and system but DDP (every ratio's
    reference); ``results`` holds per workload the before and after rows and why each
    run's missing rows are missing."""
    lines = ["| workload | system | ratio to | before | after | after, per round | max abs "
             "loss diff from baseline (after) |", "|---|---|---|---|---|---|---|"]
    for w, before, after, why_before, why_after in results:
        for system in systems:
            if system == "ddp":
                continue
            b, a = before.get(system), after.get(system)
            shown = cell(a, why_after)
            if a is not None and a["median"] is not None:
                shown = f"**{shown}**"
            rounds = a["rounds"] if a is not None and a["median"] is not None else "n/a"
            lines.append(f"| {w} | {system} | {baseline(system)} | {cell(b, why_before)} | "
                         f"{shown} | {rounds} | {a['loss'] if a is not None else 'n/a'} |")
    return lines


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """A temporary worktree of ``commit`` (removed on exit, also after a failure)."""
    with tempfile.TemporaryDirectory(prefix="shardwise-before-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(path), commit], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(path)], check=False)


def run(src: Path, workload: str, args: argparse.Namespace) -> tuple[dict, str]:
    """One workloads.py run with shardwise from ``src``: its table rows by system, and
    why rows are missing (the run's end, if it failed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", str(HERE / "workloads.py"), "--workloads", workload,
           "--systems", args.systems, "--rounds", str(args.rounds), "--steps",
           str(args.steps)]
    print(f"\n$ PYTHONPATH={src} {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=HERE)
    rows: dict[str, dict] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        parsed = parse_row(line)
        if parsed is not None:
            rows[parsed[0]] = parsed[1]
    if proc.wait() != 0:
        print(f"\n!! workloads.py failed for {workload} with shardwise from {src} (exit "
              f"{proc.returncode}); its output is above, its systems show n/a", flush=True)
        return rows, f"run failed, exit {proc.returncode}"
    return rows, "not run"


def commit_of(ref: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref],
                          capture_output=True, text=True, check=True).stdout.strip()


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated, of workloads.py's; ddp is added first if "
                             "missing, and ddp_compiled before the compiled ones")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per system and round")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    command = "python benchmarks/table.py " + shlex.join(sys.argv[1:])
    workloads = args.workloads.split(",")
    systems = args.systems.split(",")
    if set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(set(workloads) - set(WORKLOADS))}")
    if args.steps <= 2:
        parser.error("--steps must be more than workloads.py's 2 untimed warm-up steps")
    # Every ratio needs its baseline in the same run.
    if any(baseline(s) == "ddp_compiled" for s in systems) and "ddp_compiled" not in systems:
        systems.insert(next(i for i, s in enumerate(systems) if s.endswith("_compiled")),
                       "ddp_compiled")
    if "ddp" not in systems:
        systems.insert(0, "ddp")
    args.systems = ",".join(systems)
    before = commit_of(args.before)
    after = commit_of("HEAD")
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                           capture_output=True, text=True, check=True).stdout.strip()
    after += " (with uncommitted changes in src)" if dirty else ""
    guess = estimate(workloads, systems, args.rounds, args.steps)
    print(f"{len(workloads)} workloads x {len(systems)} systems x {args.rounds} rounds x "
          f"{args.steps} steps, before ({before}) and after ({after}): about "
          f"{minutes(sum(guess.values()))} on a quiet 2-core machine ("
          + ", ".join(f"{w} {minutes(t)}" for w, t in guess.items()) + ")", flush=True)
    started = time.time()
    results: list[tuple[str, dict, dict, str, str]] = []
    with checkout(before) as tree:
        for i, w in enumerate(workloads):
            spent = time.time() - started
            done = sum(guess[v] for v in workloads[:i])
            pace = spent / done if done else 1.0  # measured against estimated, so far
            left = pace * sum(guess[v] for v in workloads[i:])
            print(f"\n# workload {w} ({i + 1}/{len(workloads)}): {minutes(spent)} so far, "
                  f"about {minutes(left)} to go", flush=True)
            rows_before, why_before = run(tree / "src", w, args)
            rows_after, why_after = run(ROOT / "src", w, args)
            results.append((w, rows_before, rows_after, why_before, why_after))
    load = os.getloadavg()
    header = (f"Before: {before}; after: {after}. `{command}`: median over rounds of each "
              f"round's ratio of median step times to the baseline's in the same run "
              f"({args.rounds} round{'s' * (args.rounds > 1)} of {args.steps} steps, "
              f"the first round's first 2 left out); load average at the end "
              f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}; "
              f"{minutes(time.time() - started)}.")
    text = "\n".join([header, "", *markdown(results, systems)]) + "\n"
    print("\n" + text)
    if args.out is not None:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
