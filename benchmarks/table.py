"""One table of step-time ratios, before and after, measured one run after the other.

    python benchmarks/table.py --before f335e27 [--workloads llama,bert,cnn,gpt,accum]
        [--systems ddp,fsdp2,shardwise,shardwise_reproducible] [--rounds 3 --steps 6]
        [--out table.md]

For each workload, ``benchmarks/workloads.py`` (this tree's script) runs twice at 2 ranks
under ``torchrun``: first with the shardwise of commit ``--before`` (checked out into a
temporary git worktree and put first on ``PYTHONPATH``), then with this tree's. DDP and
FSDP2 run in both, so each shardwise ratio is to the DDP measured beside it in the same
run; the two runs of a workload follow each other directly, so both see the same machine.
Prints (and writes to ``--out``, atomically) one Markdown table: workload, system, median
ratio to DDP before and after, the per-round ratios, the largest loss difference from DDP.

The ratios compare across runs because each is taken against its own run's DDP; absolute
times are printed by each run too (its stdout is echoed) for a reader who wants them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROW = re.compile(r"^\| (\S+) \| ([0-9.]+) \| ([0-9. ]+); \*\*([0-9.]+)\*\* \| (\S+) \|$")


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


def run(src: Path, workload: str, args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """One workloads.py run with shardwise from ``src``; its table rows by system."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(src))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", str(HERE / "workloads.py"), "--workloads", workload,
           "--systems", args.systems, "--rounds", str(args.rounds), "--steps",
           str(args.steps)]
    print(f"\n$ PYTHONPATH={src} {' '.join(cmd[2:])}", flush=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=HERE)
    rows: dict[str, tuple[str, ...]] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        m = ROW.match(line.strip())
        if m:
            rows[m[1]] = (m[4], m[3].strip(), m[5])
    if proc.wait() != 0:
        raise SystemExit(f"workloads.py failed for {workload} with shardwise from {src} "
                         f"(exit {proc.returncode}); its output is above")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare against")
    parser.add_argument("--workloads", default="llama,bert,cnn,gpt,accum")
    parser.add_argument("--systems", default="ddp,fsdp2,shardwise,shardwise_reproducible")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    after = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                           capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                           capture_output=True, text=True, check=True).stdout.strip()
    after += " (with uncommitted changes in src)" if dirty else ""
    started = time.time()
    results: list[tuple[str, dict, dict]] = []
    with checkout(args.before) as tree:
        for i, w in enumerate(args.workloads.split(",")):
            print(f"\n# workload {w} ({i + 1}/{len(args.workloads.split(','))}), "
                  f"{(time.time() - started) / 60:.1f} min so far", flush=True)
            results.append((w, run(tree / "src", w, args), run(ROOT / "src", w, args)))
    load = os.getloadavg()
    lines = [f"Before: {args.before}; after: {after}. Median over rounds of each round's "
             f"ratio of median step times to DDP's in the same run ({args.rounds} rounds of "
             f"{args.steps} steps); load average at the end {load[0]:.2f}, "
             f"{load[1]:.2f}, {load[2]:.2f}; {(time.time() - started) / 60:.0f} min.", "",
             "| workload | system | before | after | after, per round | max abs loss diff "
             "from DDP (after) |", "|---|---|---|---|---|---|"]
    for w, before, now in results:
        for system in args.systems.split(",")[1:]:
            b, a = before.get(system), now.get(system)
            lines.append(f"| {w} | {system} | {b[0] + 'x' if b else '—'} | "
                         f"{'**' + a[0] + 'x**' if a else '—'} | {a[1] if a else '—'} | "
                         f"{a[2] if a else '—'} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out is not None:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
