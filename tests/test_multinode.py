"""Two torchrun agents on loopback (``--nnodes 2``) train exactly as one agent with all
the processes does: flat (one process each), and hybrid (two processes each, mesh (2, 2)
with the replicate dim across agents, as on real nodes; docs/multi-node.md)."""

import os
import re
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(__file__), "multinode_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, script_args: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, SCRIPT, *script_args]


def _digest(outputs: str, world: int) -> str:
    found = re.findall(rf"digest ([0-9a-f]{{64}}) world {world}\b", outputs)
    assert len(found) == 1, outputs[-3000:]
    return found[0]


@pytest.mark.parametrize("per_node,script_args", [(1, ()), (2, ("--mesh", "2,2"))],
                         ids=["flat", "hybrid"])
def test_two_agents_train_like_one(per_node, script_args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    world = 2 * per_node
    one = subprocess.run(_torchrun("--standalone", "--nproc_per_node", str(world),
                                   script_args=script_args),
                         env=env, capture_output=True, text=True, timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    port = str(_free_port())
    agents = [subprocess.Popen(_torchrun("--nnodes", "2", "--nproc_per_node", str(per_node),
                                         "--node_rank", str(node), "--master_addr",
                                         "127.0.0.1", "--master_port", port,
                                         script_args=script_args),
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
              for node in (0, 1)]
    outs = [a.communicate(timeout=180) for a in agents]
    for a, (_, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    assert _digest("".join(o for o, _ in outs), world) == _digest(one.stdout, world)


def test_killing_one_agent_ends_the_whole_job_within_seconds():
    # Before Note [orphaned workers], the killed agent's worker trained on to the end of
    # the job (measured: 90 s of a 90 s job) and the other agent waited with it.
    import signal
    import time

    long_script = os.path.join(os.path.dirname(__file__), "multinode_long_script.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    port = str(_free_port())
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node",
         "1", "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", port,
         long_script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    try:
        line = ""
        while "training rank" not in line:  # both train once rank 0 has printed
            line = agents[0].stdout.readline()
            assert line or agents[0].poll() is None, "the job ended before training"
        os.kill(agents[1].pid, signal.SIGKILL)
        start = time.monotonic()
        agents[0].communicate(timeout=150)
        # The job would train on for nearly 120 s; it ended in seconds on a quiet machine,
        # and 60 leaves room for a loaded one (issue 51 item 9).
        assert time.monotonic() - start < 60
        assert agents[0].returncode != 0  # the surviving agent reports the failure
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
