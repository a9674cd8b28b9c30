#!/usr/bin/env bash
# Issue 12's GPU checks and measures as one prepared run, for a machine with a GPU and a
# CUDA build of torch already installed (it installs nothing):
#
#     bash benchmarks/gpu.sh
#
# 1. tests/cuda_check.py: a world of one NCCL rank trains like the unsharded model (fp32
#    and bf16), checkpoints, gathered() and sharded_init on CUDA.
# 2. benchmarks/step_time.py on the GPU, world of one: the plain model, shardwise and
#    FSDP2 in interleaved rounds (the hook overhead; issue 12's target is 1.03x), each
#    with its peak torch.cuda.max_memory_allocated. The workload is the reference GPT
#    scaled up (24 layers, d_model 2048, sequence 1024, batch 8: about 1.3B parameters,
#    ~21 GB of fp32 AdamW state) so that the GPU, not the host, sets the pace.
# 3. benchmarks/offload.py's placements on the GPU, world of one (issue 32): peak host RSS
#    and step time with everything on the device, optimizer state in pinned host memory
#    (ZeRO-Offload), both in host memory, and both on disk, at 8 and 16 layers.
# Not yet run: no GPU was available when it was written (f7034ee); BENCHMARKS.md has no GPU
# figure yet.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
timeout 300 python tests/cuda_check.py
timeout 500 torchrun --standalone --nproc_per_node 1 benchmarks/step_time.py --device cuda \
    --systems plain,shardwise,fsdp2 --layers 24 --d-model 2048 --seq 1024 --batch 8 --steps 6
offload_dir=$(mktemp -d)
for placement in none device/cpu cpu/cpu disk/disk; do
    for layers in 8 16; do
        timeout 300 torchrun --standalone --nproc_per_node 1 benchmarks/offload.py \
            --child "$layers" "$placement" "$offload_dir" | grep RESULT
    done
done
rm -rf "$offload_dir"
