"""A few training steps under torchrun; prints a digest of the losses and final state.

Run by tests/test_multinode.py once as two agents (``--nnodes 2``) and once as one agent
with all the processes: the digests must be identical. ``--mesh R,S`` shards hybrid on an
(R, S) mesh (R rows of S ranks: with ``--nproc_per_node S``, one row per agent).
"""

import hashlib
import sys

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig

sw.init_distributed()
rank = dist.get_rank()
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
mesh = None
if "--mesh" in sys.argv:
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(int(n) for n in sys.argv[sys.argv.index("--mesh") + 1].split(","))
    mesh = init_device_mesh("cpu", shape)
model = sw.shard(GPT(cfg), mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for step in range(4):
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + rank))
    loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.detach())
sd = sw.full_state_dict(model)
# Every rank's losses: a replica that diverged shows in the digest too.
everyone = [torch.zeros(len(losses)) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, torch.stack(losses))
if rank == 0:
    h = hashlib.sha256(torch.stack(everyone).numpy().tobytes())
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].numpy().tobytes())
    print(f"digest {h.hexdigest()} world {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
