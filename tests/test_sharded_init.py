"""sharded_init: partitioned while built, equal to build-then-shard, strictly scoped.

These tests read sharded_init's own record of each partitioned parameter (its piece,
group and src_rank; ``_sharded_init.init_piece``): before ``sw.shard`` there is no sharded
model for ``sw.inspect`` to show.
"""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.modules.module as torch_module
from harness import run_ranks
from loops import train_steps
from torch.overrides import _get_current_function_mode_stack

import shardwise as sw
from shardwise.engine.sharded_init import init_piece

D, V, SEED = 16, 40, 1234


class RopeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        # Computed in __init__, in fp32, never saved: must still equal src_rank's.
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv, persistent=False)
        nn.init.zeros_(self.proj.bias)  # touches an already registered child

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = torch.arange(x.shape[1], dtype=torch.float32)
        angle = torch.outer(t, self.inv_freq).repeat(1, 2)
        q, k = q * angle.cos(), k * angle.cos()
        att = torch.softmax(q @ k.transpose(1, 2) / D ** 0.5, dim=-1)
        return self.proj(att @ v)


class InitBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = RopeAttention()
        self.norm = nn.BatchNorm1d(D)
        self.mlp = nn.Linear(D, D)
        self.mlp.weight.data.mul_(0.5)  # the .data path, after registration

    def forward(self, x):
        x = x + self.attn(x)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return x + torch.tanh(self.mlp(x))


class InitModel(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(8, D))  # owned by the root directly
        self.blocks = nn.ModuleList(InitBlock() for _ in range(layers))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.apply(self._init)  # post-hoc init over partitioned parameters

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _seed(rank, src):
    torch.manual_seed(SEED if rank == src else 77 + rank)


def _train(model):
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = ((torch.randint(0, V, (2, 8), generator=g),) for _ in range(2))
    return train_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                       lambda m, ids: nn.functional.cross_entropy(m(ids).flatten(0, 1),
                                                                  ids.flatten()))


def _equivalence(rank, world):
    src = world - 1
    _seed(rank, src)
    reference = sw.shard(InitModel(), src_rank=src)

    _seed(rank, src)
    with sw.sharded_init(src_rank=src):
        model = InitModel()
    # Built, not yet sharded: every block parameter is a partitioned stand-in.
    pieces = [init_piece(p) for n, p in model.named_parameters() if n.startswith("blocks.")]
    assert pieces and all(pieces)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    held = sum(init_piece(p).piece.numel() * 4 if init_piece(p) else p.numel() * 4
               for p in model.parameters())
    assert held <= full_bytes / world + model.pos.numel() * 4 + 64 * 4 * 30, (held, full_bytes)
    model = sw.shard(model, src_rank=src)

    a = sw.full_state_dict(reference, rank0_only=False)
    b = sw.full_state_dict(model, rank0_only=False)
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k
    for ma, mb in zip(reference.modules(), model.modules()):
        for (n, x), (_, y) in zip(ma.named_buffers(recurse=False), mb.named_buffers(recurse=False)):
            assert torch.equal(x, y) and x.dtype == y.dtype, n  # non-persistent ones too
    assert model.blocks[0].attn.inv_freq.dtype == torch.float32
    assert model.head.weight is model.emb.weight
    sw.check_consistency(model)
    assert _train(reference) == _train(model)


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_init_equals_build_then_shard(world):
    run_ranks(_equivalence, world)


def _registries():
    return (dict(torch_module._global_module_registration_hooks),
            dict(torch_module._global_parameter_registration_hooks),
            dict(torch_module._global_buffer_registration_hooks),
            len(_get_current_function_mode_stack()))


def _partitioned(model):
    return any(init_piece(p) is not None or p.is_meta for p in model.parameters())


def _scope(rank, world):
    before = _registries()
    outside_before = InitModel(1)
    with sw.sharded_init():
        inside = InitModel(1)
        built_in_thread = []
        t = threading.Thread(target=lambda: built_in_thread.append(InitModel(1)))
        t.start()
        t.join()
    assert _registries() == before
    assert _partitioned(inside)
    assert not _partitioned(outside_before)
    assert not _partitioned(built_in_thread[0]), "another thread's model was partitioned"
    assert not _partitioned(InitModel(1)), "a model built after the block was partitioned"

    with pytest.raises(RuntimeError, match="boom"):
        with sw.sharded_init():
            InitModel(1)
            raise RuntimeError("boom")
    assert _registries() == before
    assert not _partitioned(InitModel(1)), "partitioning outlived an exception"

    # Nested blocks: the innermost block's group and src_rank apply.
    inner_group = dist.new_group(list(range(world)))
    with sw.sharded_init():
        outer_model = nn.Sequential(nn.Linear(3, 3))
        with sw.sharded_init(group=inner_group, src_rank=world - 1):
            inner_model = nn.Sequential(nn.Linear(3, 3))
        after_inner = nn.Sequential(nn.Linear(3, 3))
    assert init_piece(outer_model[0].weight).comm.group is None
    assert init_piece(inner_model[0].weight).comm.group is inner_group
    assert init_piece(inner_model[0].weight).src_rank == world - 1
    assert init_piece(after_inner[0].weight).comm.group is None
    assert _registries() == before
    # Everything built inside still shards and runs.
    model = sw.shard(inside)
    _train(model)


def test_sharded_init_scope_rules():
    run_ranks(_scope, 2)


class TouchyInit(nn.Module):
    """Init code that reaches registered parameters in the awkward ways."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=0)
        self.emb.reset_parameters()  # zeroes the padding row through a view
        self.lin = nn.Linear(D, D)
        nn.init.trunc_normal_(self.lin.weight, std=0.02)  # returns early on meta tensors
        self.lin2 = nn.Linear(D, D)
        with torch.no_grad():
            self.lin2.weight[:, 0].zero_()  # write through a view
        self.wide = nn.Sequential(nn.Linear(D, D))
        self.lin.to(torch.float32)  # a cast that changes nothing (it raised on src_rank)
        self.wide.to(torch.float64)  # Module.to(dtype) assigns param.data

    def forward(self, ids):
        x = self.lin2(self.lin(self.emb(ids)))
        return self.wide(x.double()).float()


def _touchy(rank, world):
    _seed(rank, 0)
    reference = sw.shard(TouchyInit())
    _seed(rank, 0)
    with sw.sharded_init():
        model = TouchyInit()
    with pytest.raises(sw.ShardwiseError, match="call sw.shard"):
        sw.load_pretrained(model, {})  # not materialised yet: loud, not a silent no-op
    model = sw.shard(model)
    a = sw.full_state_dict(reference, rank0_only=False)
    b = sw.full_state_dict(model, rank0_only=False)
    for k in a:
        assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k
    assert b["wide.0.weight"].dtype == torch.float64
    assert b["emb.weight"][0].abs().sum() == 0 and b["lin2.weight"][:, 0].abs().sum() == 0
    assert 0.01 < b["lin.weight"].std().item() < 0.03


def test_sharded_init_awkward_init_code():
    run_ranks(_touchy, 2)
