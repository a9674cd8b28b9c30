"""Tensor parallelism composed with sharding (issue 53 item 1), against FSDP2.

torch's ``parallelize_module`` over ``mesh["tp"]`` first, then ``sw.shard(model,
mesh=mesh["dp"])`` (Note [tensor-parallel parameters] in
engine/groups/tensor_parallel.py); the reference is FSDP2's ``fully_shard`` over
``mesh["dp"]`` after the same plan, on the same Llama-style model and data, at (dp, tp) =
(2, 2) on 4 ranks and (4, 2) on 8. Each spawned group runs several checks: every rank
costs a torch import.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import shardwise as sw

VOCAB, DIM, HEADS, HIDDEN, SEQ, LAYERS = 32, 16, 4, 32, 8, 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: the local ones under tensor parallelism (HEADS / tp).
        q, k, v = (f(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(DIM), Attention()
        self.mlp_norm, self.mlp = RMSNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _block_plan(sequence_parallel: bool) -> dict:
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
                "mlp.down": RowwiseParallel()}
    # Sequence-parallel norms: the residual stream is sharded on the sequence dim, the
    # norms' weights are replicated DTensors (their gradients Partial until reduced).
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"attn_norm": SequenceParallel(), "attn": gather,
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(), "mlp": gather,
            "mlp.gate": ColwiseParallel(), "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1))}


def tensor_parallel(model: Llama, tp_mesh, sequence_parallel: bool) -> Llama:
    """torch's own TP plan for the model; with ``sequence_parallel``, every parameter is
    a DTensor (embedding and head too), as torchtitan plans a Llama."""
    for block in model.blocks:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    return model


def _batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dp_rank + step)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: nn.Module, dp_rank: int, steps: int, clip: bool) -> tuple[list, list]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(steps):
        x, y = _batch(dp_rank, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if clip:
            # A max_norm below the norm: clipping changes every gradient.
            norms.append(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses, norms


def _parity(rank: int, world: int, dp: int, tp: int, sequence_parallel: bool):
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    base = Llama()
    clip = sequence_parallel  # torch's clip takes gradients on one mesh only

    ref = tensor_parallel(copy.deepcopy(base), mesh["tp"], sequence_parallel)
    for block in ref.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(ref, mesh=mesh["dp"])
    ref_losses, ref_norms = _train(ref, dp_rank, 3, clip)
    ref_params = {n: _full(p) for n, p in ref.named_parameters()}

    ours = tensor_parallel(copy.deepcopy(base), mesh["tp"], sequence_parallel)
    ours = sw.shard(ours, mesh=mesh["dp"])
    for n, p in ours.named_parameters():
        assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), n
        assert p.shape == base.get_parameter(n).shape, n
        if isinstance(ref.get_parameter(n), DTensor) and ref.get_parameter(n).device_mesh.ndim == 2:
            # The dp shard on dim 0, the tp placement kept: FSDP2's placements.
            assert p.placements == ref.get_parameter(n).placements, (n, p.placements)
            assert p.to_local().shape == ref.get_parameter(n).to_local().shape, n
    losses, norms = _train(ours, dp_rank, 3, clip)
    params = {n: _full(p) for n, p in ours.named_parameters()}
    full_sd = sw.full_state_dict(ours, rank0_only=False)
    ref_sd = {k: _full(v) for k, v in ref.state_dict().items()}
    return ([float(v) for v in losses], [float(v) for v in ref_losses],
            [float(v) for v in norms], [float(v) for v in ref_norms],
            {n: float((params[n] - ref_params[n]).abs().max()) for n in params},
            {k: float((full_sd[k] - ref_sd[k]).abs().max()) for k in ref_sd},
            sorted(full_sd) == sorted(ref_sd))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parity_with_fsdp2_at_2x2(sequence_parallel):
    for out in run_ranks(_parity, 4, 2, 2, sequence_parallel, timeout=300):
        losses, ref_losses, norms, ref_norms, params, sd, same_keys = out
        print(losses, ref_losses, norms, ref_norms, max(params.values()), max(sd.values()))
        assert same_keys
        assert losses == ref_losses and norms == ref_norms
        assert max(params.values()) == 0 and max(sd.values()) == 0, (params, sd)
