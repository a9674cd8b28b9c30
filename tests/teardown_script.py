"""A whole training run's life, ending in ``destroy_process_group``; run by test_teardown.

Prints how many threads the process has left once the group is destroyed: gloo's worker
threads must be gone by then (Note [teardown] in comm/process_group.py).
"""

import os

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.comm.order_check import watch_steps
from shardwise.engine.iteration.state import model_state
from shardwise.models import GPT, GPTConfig

sw.init_distributed()
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=32)
model = sw.shard(GPT(cfg))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # imports torch._dynamo
# As the integrations do: the order check after each optimizer step must leave nothing
# pending (a pending message held gloo's threads past destroy_process_group).
watch_steps(model_state(model).comm, opt)
x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
for _ in range(2):
    model(x, x).backward()
    sw.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
sw.check_consistency(model)
t = torch.ones(8)
dist.all_reduce(t)  # the last collective holds a tensor that dies at shutdown
dist.destroy_process_group()
print(f"rank {os.environ['RANK']}: threads after destroy_process_group: "
      f"{len(os.listdir('/proc/self/task'))}", flush=True)
