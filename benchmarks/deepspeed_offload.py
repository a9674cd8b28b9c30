"""DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer state on NVMe) on the model
of ``benchmarks/offload.py --end-to-end``, for comparison. CPU build; not a dependency of
shardwise, so it runs from a separate environment:

    python -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0
    /tmp/dsvenv/bin/pip install numpy ninja py-cpuinfo hjson packaging psutil pydantic \\
        tqdm msgpack einops safetensors
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install --no-build-isolation --no-deps deepspeed==0.19.8
    apt-get install libaio-dev     # DeepSpeed's async I/O op needs it
    OMP_NUM_THREADS=1 /tmp/dsvenv/bin/torchrun --standalone --nproc_per_node 2 \\
        benchmarks/deepspeed_offload.py 34 2048 3 /nvme/dir

DeepSpeed picks its CPU accelerator, communicates over gloo, and JIT-compiles its CPU Adam,
async I/O and shared-memory ops on first use (minutes, cached afterwards). Arguments:
layers, width, steps, folder. Prints the build time, then per step the times and the
training's peak RSS (``VmHWM`` reset once built, as in benchmarks/offload.py).
"""

from __future__ import annotations

import os
import sys
import time

import deepspeed  # type: ignore[import-not-found]
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from shardwise.models import GPT, GPTConfig  # noqa: E402


def status(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(key)


def main() -> None:
    layers, width, steps, folder = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                    sys.argv[4])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {
            "stage": 3,
            # Buffers large enough for the largest parameter (8192 x 2048).
            "offload_param": {"device": "nvme", "nvme_path": folder, "pin_memory": False,
                              "buffer_count": 5, "buffer_size": 2e7},
            "offload_optimizer": {"device": "nvme", "nvme_path": folder, "pin_memory": False},
            "stage3_max_live_parameters": 1e8, "stage3_prefetch_bucket_size": 1e7,
            # The optimizer steps (and holds in memory) this many elements at a time;
            # at the default 1e9 rank 0 ran out of memory while building.
            "sub_group_size": 2e7,
        },
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
    }
    cfg = GPTConfig(vocab_size=8192, seq_len=8, n_layer=layers, n_head=16, d_model=width)
    start = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme"):
        model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=model.parameters())
    built = time.perf_counter() - start
    n = sum(p.ds_numel for p in model.parameters())
    if rank == 0:
        print(f"deepspeed: {n / 1e9:.2f}B parameters, built in {built:.0f} s, peak RSS "
              f"{status('VmHWM'):.0f} MiB", flush=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=g)
        t0 = time.perf_counter()
        loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        print(f"deepspeed rank {rank} step {step}: loss {loss.item():.4f}, forward+backward "
              f"{t1 - t0:.1f} s, step {t2 - t1:.1f} s, training's peak RSS "
              f"{status('VmHWM'):.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
