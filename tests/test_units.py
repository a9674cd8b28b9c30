"""Unit choice and the guard against casting or moving a model after ``shard``."""

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn(self.conv(x)))


class MiniResNet(nn.Module):
    """torchvision's ResNet shape: stages are nn.Sequential s of blocks, no ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.layer2 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _same_outputs(model, ref, x):
    model.train(), ref.train()
    out, expect = model(x), ref(x)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)


def _default_units(rank, world):
    torch.manual_seed(0)
    ref = MiniResNet()
    model = sw.shard(copy.deepcopy(ref))
    names = [u.name for u in sw.inspect(model).units]
    assert names == ["<root>", "layer1.0", "layer1.1", "layer2.0", "layer2.1"], names
    _same_outputs(model, ref, torch.randn(2, 3, 6, 6))

    stack_ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                              nn.Linear(8, 2))
    stack = sw.shard(copy.deepcopy(stack_ref))
    names = [u.name for u in sw.inspect(stack).units]
    assert names == ["<root>", "0", "2", "4"], names  # activations hold nothing to gather
    _same_outputs(stack, stack_ref, torch.randn(3, 4))

    # A ModuleList wins over Sequentials inside its entries.
    names = [u.name for u in sw.inspect(sw.shard(GPT(CFG))).units]
    assert names == ["<root>", "blocks.0", "blocks.1"], names


def test_default_units_follow_modulelist_or_sequential():
    run_ranks(_default_units, 2)


def _units_matching_nothing(rank, world):
    for units in (nn.Conv2d, lambda name, module: False):
        with pytest.raises(sw.ShardwiseError, match="matched no submodule of GPT"):
            sw.shard(GPT(CFG), units=units)
    alone = sw.shard(GPT(CFG), units=())  # the root alone, asked for explicitly
    assert [u.name for u in sw.inspect(alone).units] == ["<root>"]


def test_units_matching_nothing_raise():
    run_ranks(_units_matching_nothing, 2)


class TopHeavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(1024, 1024)  # 1.05M parameters in the root
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


def _dominant_unit_warning(rank, world):
    with pytest.warns(UserWarning, match=re.escape("unit '<root>' holds 100%")):
        sw.shard(TopHeavy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sw.shard(TopHeavy(), units=())          # asked for: silent
        sw.shard(nn.Sequential(*(nn.Linear(512, 512) for _ in range(4))))  # balanced
        sw.shard(GPT(CFG))                      # small models: silent


def test_warns_when_one_unit_holds_most_of_the_model():
    run_ranks(_dominant_unit_warning, 2)


def _cast_after_shard(rank, world):
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    model = sw.shard(GPT(CFG))
    model(x, x).backward()
    # Casts are applied to the shards (test_module_habits trains after one), the
    # gradients waiting in them included; moves raise at once, with nothing changed.
    model.double()
    assert all(p.dtype == p.grad.dtype == torch.float64 for p in model.parameters())
    model(x, x).backward()
    model.to(torch.float32)
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(sw.ShardwiseError, match="cannot be moved after sw.shard"):
        model.to("meta")
    model(x, x).backward()
    w = model.blocks[0].fc.weight
    w.data = w.data.double()  # a shard's data replaced: caught at the next forward
    with pytest.raises(sw.ShardwiseError, match="were cast or moved after sw.shard"):
        model(x, x)


def test_cast_after_shard_is_applied_and_a_replaced_shard_raises():
    run_ranks(_cast_after_shard, 2)


def _reduction_states(rank, world):
    from shardwise.engine.groups.reduce import Reduction
    from shardwise.engine.iteration.state import model_state

    model = sw.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    reduction = model_state(model).units[1].groups[0].reduction
    assert reduction.state is Reduction.IDLE
    # keep_gathered=False: a held unit's gradients would wait in .grad instead (Note
    # [gathered across micro-batches]), leaving the reduction idle until the synced step
    with sw.no_sync(model, keep_gathered=False):
        model(torch.ones(2, 4)).sum().backward()
    assert reduction.state is Reduction.ACCUMULATING
    model(torch.ones(2, 4)).sum().backward()
    assert reduction.state is Reduction.IDLE  # reduced and published
    reduction.start(sync=True)                # by hand: a world of one's sum is ready
    assert reduction.state is Reduction.REDUCED
    with pytest.raises(sw.ShardwiseError, match="cannot go from reduced to reduced"):
        reduction.start(sync=True)  # before: the pending rows were silently overwritten
    reduction.drop()
    assert reduction.state is Reduction.IDLE


def test_gradient_reduction_moves_only_along_its_states():
    """GradReduction's states (shardwise.engine.groups.reduce.Reduction) and their checked moves,
    in a world of one (this tests the module itself, so it reaches into it)."""
    run_ranks(_reduction_states, 1)


class _Lending(nn.Module):
    """Returns its own bias for the parent to use (DeepSpeed's test_ext_param_return)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), self.lin.bias


class _Lender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Lending() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            out, bias = b(x)
            x = out + bias
        return x.sum()


def _residency(rank, world):
    """Note [residency] in engine/iteration/residency.py: each unit's residency is settled
    once per iteration (not at each unit's forward), and each entry point changes it as
    the Note and docs/parameters.md's table say (this tests the engine itself, so it
    reaches into it)."""
    from shardwise.engine.iteration.state import model_state
    from shardwise.engine.iteration.unit import Residency as R

    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    state = model_state(model)
    units, res = state.units, state.residency
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1"]
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def values():
        return [u.residency for u in units]

    def settled(step):  # runs ``step`` and counts the settlings it made
        before = res.settles
        step()
        return res.settles - before

    # A plain step: settled once, at its forward. With no previous order nothing ran last.
    assert settled(lambda: model(x, x).backward()) == 1
    assert values() == [R.KEPT, R.RESHARDED, R.RESHARDED]
    loss = model(x, x)  # now blocks.1 ran last: kept for its backward, which comes first
    assert values() == [R.KEPT, R.RESHARDED, R.LAST]
    assert [u.is_gathered() for u in units] == [True, False, True]
    assert settled(loss.backward) == 0
    assert all(u.is_sharded() for u in units)
    opt.step()

    # no_sync micro-batches: HOLDING until their reduction, then HELD across micro-batches.
    with sw.no_sync(model):
        loss = model(x, x)
        assert values() == [R.HOLDING] * 3 and all(u.is_gathered() for u in units)
        assert settled(loss.backward) == 0
    assert values() == [R.HELD] * 3 and all(u.is_gathered() for u in units)
    assert all(u.deferred for u in units)  # gradients wait in .grad (Unit.deferred)
    # A forward that raises keeps what was held before it (Note [held units on one rank]).
    with pytest.raises(IndexError):
        model(x + CFG.vocab_size, x)
    assert values() == [R.HELD] * 3 and all(u.is_gathered() for u in units)
    # DDP's attribute, nanoGPT's way: one settling per micro-batch, never one per unit.
    for i in range(3):
        model.require_backward_grad_sync = i == 2
        loss = model(x, x)
        assert values() == [R.HELD] * 3  # the synced one too: it was held before
        assert settled(loss.backward) == 0
    del model.require_backward_grad_sync
    assert not any(u.residency is R.HELD for u in units)
    assert all(u.is_sharded() for u in units)
    opt.step()

    # zero_grad drops the held gradients; the units stay HELD, their parameters unchanged.
    with sw.no_sync(model):
        model(x, x).backward()
    model.zero_grad()
    assert values() == [R.HELD] * 3
    assert all(p.full.grad is None for u in units for p in u.params)
    # An in-place edit of a held unit's full parameters is kept in its shard when a
    # release ends the hold (here a checkpoint's, release_held).
    with torch.no_grad():
        model.blocks[0].fc.bias.add_(1.0)
    edited = model.blocks[0].fc.bias.detach().clone()
    state.release_held()
    assert all(u.is_sharded() and u.residency is u.settled for u in units)
    assert units[1].edited
    torch.testing.assert_close(model.blocks[0].fc.bias.to_local(), edited, rtol=0, atol=0)
    # gathered() releases held units first; a pin changes no value.
    with sw.no_sync(model):
        model(x, x).backward()
    with sw.gathered(model):
        assert not any(u.residency is R.HELD for u in units)
    # A forward under no_grad releases what it ran.
    with torch.no_grad():
        model(x)
    assert all(u.is_sharded() for u in units)
    model(x, x).backward()  # the synced step
    opt.zero_grad()

    # no_sync entered between a forward and its backward: the backward's reduction
    # settles again (the sync flag changed) and holds; left the other way, it reduces.
    loss = model(x, x)
    with sw.no_sync(model):
        assert settled(loss.backward) == 1
    assert values() == [R.HELD] * 3
    with sw.no_sync(model):
        loss = model(x, x)
    assert settled(loss.backward) == 1 and all(u.is_sharded() for u in units)
    opt.zero_grad()

    # requires_grad: a unit frozen between steps is not held; its forward settles once.
    model.blocks[1].requires_grad_(False)
    with sw.no_sync(model):
        assert settled(lambda: model(x, x).backward()) == 1
    assert values() == [R.HELD, R.HELD, R.LAST] and units[2].is_sharded()
    model(x, x).backward()
    model.blocks[1].requires_grad_(True)

    # A forward returning a unit's parameter lends it (LENT) until its reduction.
    lender = sw.shard(_Lender())
    lstate = model_state(lender)
    loss = lender(torch.ones(2, 4))
    assert [u.residency for u in lstate.units[1:]] == [R.LENT, R.LENT]
    assert all(u.is_gathered() for u in lstate.units)
    loss.backward()
    assert [u.residency for u in lstate.units[1:]] == [R.RESHARDED, R.RESHARDED]
    assert all(u.is_sharded() for u in lstate.units)


def test_residency_is_settled_once_per_iteration_and_changed_by_entry_points():
    run_ranks(_residency, 1)


def test_batchnorm_shares_its_block_group_unless_mixed_precision_splits_them():
    """Note [one group per dtypes]: a conv-BatchNorm block is one flat group (one gather,
    one reduce-scatter) in full precision; mixed precision keeps BatchNorm's parameters in
    fp32, a group of their own."""
    from shardwise.planning.units import discover_params, group_specs

    block = BasicBlock(4)
    records = discover_params(block, [""])
    specs = group_specs(records, None, None, 2)
    assert len(specs) == 1
    assert [r.fqns for r in specs[0].records] == [["conv.weight"], ["conv.bias"],
                                                  ["bn.weight"], ["bn.bias"]]
    assert (specs[0].compute_dtype, specs[0].reduce_dtype) == (torch.float32, torch.float32)
    for param_dtype, reduce_dtype in ((torch.bfloat16, None), (None, torch.bfloat16)):
        specs = group_specs(records, param_dtype, reduce_dtype, 2)
        assert [[r.fqns[0] for r in s.records] for s in specs] == [
            ["conv.weight", "conv.bias"], ["bn.weight", "bn.bias"]]
        assert (specs[1].compute_dtype, specs[1].reduce_dtype) == (torch.float32, torch.float32)
        assert specs[0].compute_dtype == (param_dtype or torch.float32)
        assert specs[0].reduce_dtype == (reduce_dtype or torch.float32)
