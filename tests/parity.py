"""Shared parity helpers: the same data and training loop for every system, and the
error measures the parity tests bound (and ``benchmarks/parity.py`` reports).

Error measures against a reference state dict (DDP's):
- ``normwise``: ||a - b|| / ||b|| over all floating tensors taken together, as FSDP2's
  own parity tests measure;
- ``per_tensor``: the largest max|a - b| / max|b| of any one tensor (stricter: a small
  tensor's rounding is not diluted by the big ones).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from loops import train_steps
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.models import GPT, GPTConfig, SmallCNN

STEPS = 10
GPT_CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=2, d_model=32)


def gpt_batches(rank: int, steps: int = STEPS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def cnn_batches(rank: int, steps: int = STEPS) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2000 + rank)
    for _ in range(steps):
        yield torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


def gpt_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return m(x, y)


def cnn_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(x), y)


# name -> (build, batches(rank), loss_fn)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
    "gpt": (lambda: GPT(GPT_CFG), gpt_batches, gpt_loss),
    "cnn": (SmallCNN, cnn_batches, cnn_loss),
}


def train(model: nn.Module, batches, loss_fn) -> torch.Tensor:
    """AdamW steps over ``batches``; the losses, one per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # fp32 losses, exactly: each went through a Python float, which holds any fp32 value.
    return torch.tensor(train_steps(model, opt, batches, loss_fn), dtype=torch.float32)


@dataclass
class Errors:
    loss: float        # largest relative loss difference over the steps
    normwise: float
    per_tensor: float


def errors(losses: torch.Tensor, ref_losses: torch.Tensor, sd: dict, ref_sd: dict) -> Errors:
    assert list(sd) == list(ref_sd), (list(sd), list(ref_sd))
    diff_sq = ref_sq = per_tensor = 0.0
    for k, ref in ref_sd.items():
        ours = sd[k]
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, k
        if not ref.is_floating_point():
            assert torch.equal(ours, ref), k
            continue
        d = (ours.double() - ref.double())
        diff_sq += d.pow(2).sum().item()
        ref_sq += ref.double().pow(2).sum().item()
        per_tensor = max(per_tensor, (d.abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    loss = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
    return Errors(loss, math.sqrt(diff_sq / ref_sq), per_tensor)


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def build_for_rank(rank: int, build: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(rank)  # every rank builds different weights: src_rank's must win
    return build()


def ddp_reference(rank: int, name: str) -> tuple[nn.Module, torch.Tensor, dict]:
    """The model, DDP's losses, and DDP's state on this rank after training."""
    build, batches, loss_fn = MODELS[name]
    base = build_for_rank(rank, build)
    ddp = DDP(copy.deepcopy(base))
    losses = train(ddp, batches(rank), loss_fn)
    return base, losses, cpu_state(ddp.module)


def shardwise_run(rank: int, name: str, base: nn.Module,
                  mesh=None) -> tuple[nn.Module, torch.Tensor, dict]:
    """shardwise's model, losses and consolidated state (rank 0's; ``{}`` elsewhere);
    ``mesh``: a 2-D mesh for hybrid sharding."""
    _, batches, loss_fn = MODELS[name]
    model = sw.shard(copy.deepcopy(base), mesh=mesh)
    losses = train(model, batches(rank), loss_fn)
    return model, losses, sw.full_state_dict(model)


def fsdp2_run(rank: int, name: str, base: nn.Module, mesh=None) -> tuple[torch.Tensor, dict]:
    """FSDP2 (``fully_shard`` per block, then the root) on the same model and data;
    ``mesh``: a 2-D mesh for its hybrid sharding (HSDP)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    _, batches, loss_fn = MODELS[name]
    model = copy.deepcopy(base)
    with torch.no_grad():  # FSDP2 keeps each rank's own initial values; DDP takes rank 0's
        for t in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(t, src=0)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, batches(rank), loss_fn)
    sd = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
          for k, v in model.state_dict().items()}
    return losses, sd
