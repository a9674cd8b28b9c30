"""How far shardwise and PyTorch FSDP2 land from DDP on the parity tests' models and data.

    OMP_NUM_THREADS=1 python benchmarks/parity.py [--worlds 2,3,4]

Prints, for each model at each world size (default 2 and 3), the error measures of
``tests/parity.py`` (largest relative loss difference, norm-wise and largest per-tensor
relative state difference after 10 AdamW steps) for shardwise and for FSDP2 against DDP; at 4 ranks
also for both systems' hybrid sharding on a (2, 2) mesh. The bounds in
``tests/test_parity.py`` and ``tests/test_hybrid.py`` are justified from these figures.
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
    runs = {"shardwise": shardwise_run(rank, name, base)[1:],
            "FSDP2": fsdp2_run(rank, name, base)}
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        runs["shardwise (2,2)"] = shardwise_run(rank, name, base, mesh=mesh)[1:]
        runs["FSDP2 HSDP (2,2)"] = fsdp2_run(rank, name, base, mesh=mesh)
    if rank != 0:
        return None
    return {system: errors(losses, ddp_losses, sd, ddp_sd)
            for system, (losses, sd) in runs.items()}


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,3", help="world sizes, comma-separated")
    worlds = [int(w) for w in parser.parse_args().worlds.split(",")]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    print(f"CPU: {cpu}")
    print(f"{'model':5} {'N':>2} {'system':16} {'loss':>9} {'normwise':>9} "
          f"{'per-tensor':>10}")
    for name in ("gpt", "cnn"):
        for world in worlds:
            for system, e in run_ranks(_measure, world, name, timeout=600)[0].items():
                print(f"{name:5} {world:>2} {system:16} {e.loss:9.2e} {e.normwise:9.2e} "
                      f"{e.per_tensor:10.2e}", flush=True)


if __name__ == "__main__":
    main()
