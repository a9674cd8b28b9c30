"""gathered(), buffer policies, check_consistency, and the absence of global state."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks
from loops import assert_at_rest, train_steps

import shardwise as sw
from shardwise.models import SmallCNN

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def _cnn(rank_seed: int) -> SmallCNN:
    torch.manual_seed(rank_seed)
    return SmallCNN()


def _batches(rank, steps, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g))
            for _ in range(steps)]


def _train(model, batches):
    train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                lambda m, x, y: F.cross_entropy(m(x), y))


def _gathered_checks(rank, world):
    model = sw.shard(_cnn(rank))
    before = sw.full_state_dict(model, rank0_only=False)

    # Reading: full shapes and values, nested blocks, nothing left behind.
    with sw.gathered(model):
        assert model.head.weight.shape == (10, 32)
        torch.testing.assert_close(model.head.weight, before["head.weight"], rtol=0, atol=0)
        with sw.gathered(model.blocks[0]) as inner:
            assert inner is model.blocks[0]
            assert model.blocks[0].conv.weight.shape == (16, 3, 3, 3)
        assert model.blocks[0].conv.weight.shape == (16, 3, 3, 3)  # outer still holds it
    assert_at_rest(model)
    with sw.gathered([model.head.weight]) as (full,):
        assert full.shape == (10, 32)
    # One parameter, as DeepSpeed's GatheredParameters takes it. Before: DTensor's
    # "Attempted to unbind along the sharded dimension 0" (the shard was iterated).
    with sw.gathered(model.head.weight) as full:
        torch.testing.assert_close(full, before["head.weight"], rtol=0, atol=0)
    assert_at_rest(model)

    # Read-only: a write on one rank, to a parameter or a buffer, raises on every rank.
    for target, writer in (("head.weight", 1), ("blocks.0.bn.running_mean", 0)):
        with pytest.raises(sw.ReadOnlyGatherError, match=target.replace(".", r"\.")):
            with sw.gathered(model):
                if rank == writer:
                    tensor = model.get_parameter(target) if "weight" in target \
                        else model.get_buffer(target)
                    with torch.no_grad():
                        tensor.add_(1.0)
        assert_at_rest(model)
        sw.check_consistency(model)  # the written buffer was restored on the writing rank
    # A write that changes no value is refused too; before, the message named nothing
    # ("written inside a read-only sw.gathered() block: . Pass ..."). The head's weight
    # and bias share one buffer, whose version counter cannot tell them apart.
    with pytest.raises(sw.ReadOnlyGatherError, match=r"block: one of the parameters "
                                                     r"head\.weight, head\.bias \(by an "
                                                     r"in-place operation that changed no"):
        with sw.gathered(model):
            if rank == 1:
                with torch.no_grad():
                    model.head.weight.add_(0.0)
    after = sw.full_state_dict(model, rank0_only=False)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed by a read-only block"

    # modifier_rank=1: rank 1's edits of parameters and buffers win everywhere.
    with sw.gathered(model, modifier_rank=1):
        with torch.no_grad():
            model.head.weight.fill_(float(rank + 1))
            model.blocks[1].bn.running_var.fill_(float(rank + 3))
    sd = sw.full_state_dict(model, rank0_only=False)
    assert torch.equal(sd["head.weight"], torch.full((10, 32), 2.0))
    assert torch.equal(model.blocks[1].bn.running_var, torch.full((32,), 4.0))
    sw.check_consistency(model)
    assert_at_rest(model)

    # An exception leaves the model sharded, and propagates.
    with pytest.raises(ValueError, match="boom"):
        with sw.gathered(model, modifier_rank=0):
            raise ValueError("boom")
    assert_at_rest(model)

    # The model still trains afterwards.
    _train(model, _batches(rank, 2))
    sw.check_consistency(model)


@pytest.mark.parametrize("world", [2, 3])
def test_gathered(world):
    run_ranks(_gathered_checks, world)


def _policies(rank, world):
    batches = _batches(rank, 5, seed=1)  # different data on every rank
    models = {p: sw.shard(_cnn(0), buffers=p) for p in ("broadcast", "average", "local")}
    for m in models.values():
        _train(m, batches)
    sw.check_consistency(models["broadcast"])
    sw.check_consistency(models["average"])
    with pytest.raises(sw.DivergenceError, match=r"blocks\.0\.bn\.running_mean") as err:
        sw.check_consistency(models["local"])
    assert "float32 [16]" in str(err.value) and "ranks [" in str(err.value)

    # "average" is the mean of what each rank computes alone (one step, same weights).
    avg = sw.shard(_cnn(0), buffers="average")
    local = sw.shard(_cnn(0), buffers="local")
    x = batches[0][0]
    with torch.no_grad():  # no backward coming: buffers are synchronised right away
        avg(x)
        local(x)
    mean = local.blocks[0].bn.running_mean.clone()
    dist.all_reduce(mean)
    # Default fp32 tolerance (rtol 1.3e-6); measured 1.8e-7 (one rounding of the mean).
    torch.testing.assert_close(avg.blocks[0].bn.running_mean, mean / world)
    # "broadcast" keeps src_rank's own evolution, like DDP's broadcast_buffers.
    src = local.blocks[0].bn.running_mean.clone()
    dist.broadcast(src, 0)
    bc = sw.shard(_cnn(0), buffers="broadcast")
    out = bc(x)
    assert not torch.equal(bc.blocks[0].bn.running_mean, src) or rank == 0  # not yet
    out.sum().backward()  # the step's backward finishes: now synchronised
    assert torch.equal(bc.blocks[0].bn.running_mean, src)


@pytest.mark.parametrize("world", [2, 3])
def test_buffer_policies(world):
    run_ranks(_policies, world)


class WithRope(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        # Differs per rank on purpose: shard() must hand out src_rank's values.
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float64) + rank,
                             persistent=False)
        self.register_buffer("count", torch.tensor(rank), persistent=True)

    def forward(self, x):
        return self.lin(x) * self.inv_freq.float()


def _scope(rank, world):
    m = sw.shard(WithRope(rank), src_rank=world - 1)
    assert m.inv_freq.dtype == torch.float64
    assert torch.equal(m.inv_freq, torch.arange(4, dtype=torch.float64) + world - 1)
    assert m.count.item() == world - 1
    sw.check_consistency(m)

    # A model built after another was sharded is an ordinary model.
    later = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    assert not sw.is_sharded(later)
    assert later[0].weight.shape == (5, 3) and vars(later[0].weight) == {}  # nothing attached
    ref = copy.deepcopy(later)
    x = torch.randn(4, 3)
    assert torch.equal(later(x), ref(x))

    # Two sharded models with different settings live side by side.
    a = sw.shard(_cnn(0), buffers="local")
    b = sw.shard(_cnn(0), buffers="broadcast", reshard_after_forward=False)
    _train(a, _batches(rank, 2))
    _train(b, _batches(rank, 2))
    sw.check_consistency(b)
    with pytest.raises(sw.DivergenceError):
        sw.check_consistency(a)
    assert sw.inspect(a).buffers == "local" and sw.inspect(b).buffers == "broadcast"

    # A model sharded on a sub-group leaves the other ranks alone.
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        c = sw.shard(_cnn(rank), group=sub)
        assert sw.inspect(c).world_size == 2
        _train(c, _batches(rank, 2))
        sw.check_consistency(c)
        assert c.head.weight.to_local().shape == (5, 32)  # half the rows: a group of 2
    else:
        assert not sw.is_sharded(_cnn(rank))
    # sync_buffers on an unsharded module.
    plain = nn.BatchNorm1d(3)
    plain.running_mean.fill_(float(rank))
    sw.sync_buffers(plain, src_rank=1)
    assert torch.equal(plain.running_mean, torch.ones(3))


def test_scope_and_no_global_state():
    run_ranks(_scope, 3)


def _tokenizer_example(rank, world):
    import frozen_tokenizer

    return frozen_tokenizer.main(["--steps", "2"])


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_tokenizer_example(world):
    result = run_ranks(_tokenizer_example, world)[0]
    assert result["way1_ok"] and result["way2_ok"]
    # The re-enacted failure is real, and loud.
    assert not result["naive_tokens_agree"]
    for i in range(3):  # every BatchNorm3d's statistics; the parameters were broadcast
        assert f"blocks.{i}.bn.running_mean" in result["naive_error"]
        assert f"blocks.{i}.bn.running_var" in result["naive_error"]
    assert "weight" not in result["naive_error"] and "codebook" not in result["naive_error"]


def _env_check(rank, world, path):
    import shardwise.consistency as consistency

    calls = []
    real = consistency.check_consistency
    consistency.check_consistency = lambda module, group=None: calls.append(type(module).__name__) \
        or real(module, group)
    for env in ("0", "1"):
        os.environ["SHARDWISE_CHECK"] = env
        calls.clear()
        model = sw.shard(_cnn(rank))                     # after shard
        sw.load_pretrained(model, path)                  # after load_pretrained
        with sw.gathered(model.head, modifier_rank=0):   # after a modifier block
            pass
        with sw.gathered(model):                         # read-only: no check
            pass
        expected = ["SmallCNN", "SmallCNN", "Linear"] if env == "1" else []
        assert calls == expected, (env, calls)


def test_shardwise_check_env(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "cnn.safetensors")
    save_file(_cnn(0).state_dict(), path)
    run_ranks(_env_check, 2, path)


def _skipped_step(rank, world):
    torch.manual_seed(0)
    model = sw.shard(_cnn(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = _batches(rank, 3)
    for i, (x, y) in enumerate(batches):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if not (rank == 1 and i == 1):  # rank 1 skips one step (a caught exception, say)
            opt.step()
        opt.zero_grad()
    sw.check_consistency(model)  # buffers agree: the skipped step does not show there
    if rank == 2:
        opt.param_groups[0]["lr"] = 5e-3
    with pytest.raises(sw.DivergenceError) as err:
        sw.check_consistency(model, optimizer=opt)
    message = str(err.value)
    assert "optimizer step count: ranks [0, 2]: 3; ranks [1]: 2" in message, message
    if world > 2:
        assert "optimizer.param_groups[0].lr: ranks [0, 1]: 0.01; ranks [2]: 0.005" in message


def test_check_consistency_compares_optimizers(world=3):
    """Before: a rank that skipped optimizer.step() passed check_consistency."""
    run_ranks(_skipped_step, world)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
            if hasattr(b, "shift"):
                x = x + b.shift
        return x


def _buffers_after_shard(rank, world, policy):
    torch.manual_seed(0)
    model = sw.shard(Shifted(), buffers=policy)
    x = torch.ones(2, 4)
    # Registered after shard, with a value of each rank's own (say, from its RNG).
    model.blocks[0].register_buffer("shift", torch.full((4,), float(rank + 1)))
    first = model(x)
    # Replaced after shard: module.buf = tensor.
    model.blocks[0].shift = torch.full((4,), 10.0 * (rank + 1))
    second = model(x)
    everyone = [None] * world
    dist.all_gather_object(everyone, (first, second, model.blocks[0].shift))
    return everyone


@pytest.mark.parametrize("policy", ["broadcast", "average"])
def test_buffers_registered_or_replaced_after_shard_are_src_ranks_before_use(policy):
    """Issue 30 item 4: the first forward used each rank's own value before."""
    everyone = run_ranks(_buffers_after_shard, 2, policy)[0]
    (first0, second0, shift0), (first1, second1, shift1) = everyone
    assert torch.equal(first0, first1) and torch.equal(second0, second1)
    assert torch.equal(shift0, torch.full((4,), 10.0)) and torch.equal(shift1, shift0)


def _local_buffers_stay(rank, world):
    torch.manual_seed(0)
    model = sw.shard(Shifted(), buffers="local")
    model.blocks[0].register_buffer("shift", torch.full((4,), float(rank + 1)))
    model(torch.ones(2, 4))
    assert torch.equal(model.blocks[0].shift, torch.full((4,), float(rank + 1)))


def test_local_buffers_registered_after_shard_stay_each_ranks():
    run_ranks(_local_buffers_stay, 2)
