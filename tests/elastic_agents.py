"""Two torchrun agents of 2 ranks on loopback, running tests/elastic_script.py: what
tests/test_elastic.py and benchmarks/elastic.py drive (docs/long-runs.md has the same
command lines).

``shrink`` kills one agent, workers and all, once the job has logged a given step at
world 4, and lets the other finish at world 2; ``grow`` starts one agent and a second
one once the first has logged a given step at world 2. ``problems`` says how a finished
run differs from the uninterrupted world-4 run.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

SCRIPT = os.path.join(os.path.dirname(__file__), "elastic_script.py")
# The waits below only catch a hang: generous, since launching 4 workers took minutes on
# a loaded machine (issue 51 item 9).
# torchrun's agents share one worker store across rounds by default, and an agent that
# joins a later round then waits forever for that store's address, which the rank-0
# agent publishes only in the first round (DistStoreError: wait timeout ... MASTER_ADDR).
# Without sharing, each round publishes a fresh store.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass
class Run:
    """A finished two-agent run: its logs (every agent's), return codes, and the
    uninterrupted run's log."""
    text: str
    codes: list[int | None]
    alone: str
    world_after: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent(port: int, host: bool, folder: str, total: int, every: int, log: str,
          extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
          launcher: str = "torchrun") -> subprocess.Popen:
    """One agent of 2 workers. ``is_host`` names the agent that hosts the rendezvous
    store: on one machine both match the endpoint, and two hosts would each wait for the
    other. ``launcher="shardwise"``: through ``shardwise run``, which sets
    ``FRESH_STORE`` itself (Note [launcher defaults] in shardwise/launcher.py)."""
    launch = (["shardwise.cli", "run"] if launcher == "shardwise"
              else ["torch.distributed.run"])
    cmd = [sys.executable, "-m", *launch, "--nnodes=1:2",
           "--nproc-per-node=2", "--max-restarts=3", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}",
           f"--rdzv-conf=is_host={int(host)},last_call_timeout=2",
           SCRIPT, folder, str(total), str(every), "--sleep", "0.3", *extra]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (they run in sessions of their own)."""
    subprocess.run(["pkill", "-9", "-P", str(p.pid)], check=False)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)


def losses(text: str) -> dict[int, tuple[str, int]]:
    """Each step's last logged loss (a restart repeats steps) and the world that ran it."""
    return {int(s): (v, int(w)) for s, v, w in re.findall(r"loss (\d+) (\S+) world (\d)", text)}


def uninterrupted(folder: str, total: int, extra: tuple[str, ...] = ()) -> str:
    """The same job on one agent of 4 workers, never interrupted: its log."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=4", SCRIPT, folder, str(total), str(total),
                          *extra], env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=400)
    if out.returncode != 0:
        raise AssertionError(out.stderr[-3000:])
    return out.stdout


def _read(logs: list[str]) -> str:
    return "".join(open(log).read() for log in logs)


def _wait_for_step(logs: list[str], step: int, world: int, agents, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(s >= step and w == world for s, (_, w) in losses(_read(logs)).items()):
        if time.monotonic() > deadline or agents[0].poll() is not None:
            raise AssertionError(f"step {step} at world {world} never came:\n"
                                 f"{_read(logs)[-3000:]}")
        time.sleep(0.05)


def shrink(root: str, total: int, every: int, kill_at: int, extra: tuple[str, ...] = (),
           launcher: str = "torchrun") -> Run:
    """Kill agent 1 once step ``kill_at`` ran at world 4; agent 0 goes on alone."""
    alone = uninterrupted(os.path.join(root, "alone"), total, extra)
    port, folder = free_port(), os.path.join(root, "run")
    logs = [os.path.join(root, f"agent{n}.log") for n in (0, 1)]
    agents = [agent(port, n == 0, folder, total, every, logs[n], extra, launcher=launcher)
              for n in (0, 1)]
    try:
        _wait_for_step(logs, kill_at, 4, agents, 300)
        kill_tree(agents[1])
        agents[0].wait(timeout=300)
    finally:
        for a in agents:
            kill_tree(a)
    return Run(open(logs[0]).read(), [agents[0].returncode], alone, 2)


def grow(root: str, total: int, every: int, join_after: int) -> Run:
    """Start agent 0 alone (world 2); start agent 1 once step ``join_after`` ran."""
    alone = uninterrupted(os.path.join(root, "alone"), total)
    port, folder = free_port(), os.path.join(root, "run")
    logs = [os.path.join(root, f"agent{n}.log") for n in (0, 1)]
    agents = [agent(port, True, folder, total, every, logs[0], env=FRESH_STORE)]
    try:
        _wait_for_step(logs[:1], join_after, 2, agents, 300)
        agents.append(agent(port, False, folder, total, every, logs[1], env=FRESH_STORE))
        for a in agents:
            a.wait(timeout=300)
    finally:
        for a in agents:
            kill_tree(a)
    return Run(_read(logs), [a.returncode for a in agents], alone, 4)


def problems(run: Run, total: int, every: int, exact: bool, rel: float = 0.0) -> list[str]:
    """How ``run`` differs from the uninterrupted run: it must succeed, resume at a
    multiple of ``every`` at its final world size, and log the uninterrupted losses from
    there on (equal when ``exact``, else within ``rel``) and, when ``exact``, its digest."""
    if any(c != 0 for c in run.codes):
        return [f"exit codes {run.codes}"]
    starts = re.findall(rf"start (\d+) world {run.world_after}", run.text)
    if not starts:
        return [f"never restarted at world {run.world_after}"]
    start = int(starts[-1])
    got, want = losses(run.text), losses(run.alone)
    out = [] if start % every == 0 else [f"resumed at step {start}, not a checkpoint's"]
    for s in range(start, total):
        if got.get(s, (None, 0))[1] != run.world_after:
            out.append(f"step {s} did not run at world {run.world_after}")
        elif exact and got[s][0] != want[s][0]:
            out.append(f"step {s}: loss {got[s][0]} != {want[s][0]}")
        elif not exact and abs(float.fromhex(got[s][0]) / float.fromhex(want[s][0]) - 1) > rel:
            out.append(f"step {s}: loss {got[s][0]} not within {rel} of {want[s][0]}")
    if exact and re.findall(r"digest (\w+)", run.text) != re.findall(r"digest (\w+)", run.alone):
        out.append("final state differs from the uninterrupted run's")
    return out
