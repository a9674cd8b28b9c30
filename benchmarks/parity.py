"""How far shardwise and PyTorch FSDP2 land from DDP on the parity tests' models and data.

    OMP_NUM_THREADS=1 python benchmarks/parity.py

Prints, for each model at 2 and 3 ranks, the error measures of ``tests/parity.py``
(largest relative loss difference, norm-wise and largest per-tensor relative state
difference after 10 AdamW steps) for shardwise and for FSDP2 against DDP. The bounds in
``tests/test_parity.py`` are justified from these figures.
"""

from __future__ import annotations

import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from harness import run_ranks  # noqa: E402
from parity import ddp_reference, errors, fsdp2_run, shardwise_run  # noqa: E402


def _measure(rank: int, world: int, name: str):
    base, ddp_losses, ddp_sd = ddp_reference(rank, name)
    _, sw_losses, sw_sd = shardwise_run(rank, name, base)
    fsdp_losses, fsdp_sd = fsdp2_run(rank, name, base)
    if rank != 0:
        return None
    return errors(sw_losses, ddp_losses, sw_sd, ddp_sd), \
        errors(fsdp_losses, ddp_losses, fsdp_sd, ddp_sd)


def main() -> None:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print(f"CPU: {cpu}")
    print(f"{'model':5} {'N':>2} {'system':9} {'loss':>9} {'normwise':>9} {'per-tensor':>10}")
    for name in ("gpt", "cnn"):
        for world in (2, 3):
            ours, fsdp = run_ranks(_measure, world, name)[0]
            for system, e in (("shardwise", ours), ("FSDP2", fsdp)):
                print(f"{name:5} {world:>2} {system:9} {e.loss:9.2e} {e.normwise:9.2e} "
                      f"{e.per_tensor:10.2e}", flush=True)


if __name__ == "__main__":
    main()
