"""Contract details from shared/API.md not covered elsewhere."""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import run_ranks

import shardwise as sw
from shardwise.models import GPT, Block, GPTConfig, SmallCNN

CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=3, n_head=2, d_model=16)


def test_init_distributed_without_torchrun_is_a_world_of_one():
    code = ("import shardwise as sw, torch.distributed as d; sw.init_distributed(timeout=30); "
            "sw.init_distributed(); print(d.get_world_size(), d.get_backend())")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["1", "nccl" if torch.cuda.is_available() else "gloo"]


def test_the_public_names_are_exported():
    """Every name of ``__all__`` is the package's, the background save's handle (issue 53)
    among them, and Resumable's ``background=`` is checked like every flag."""
    assert [n for n in sw.__all__ if not hasattr(sw, n)] == []
    assert "SaveHandle" in sw.__all__ and sw.SaveHandle is sw.checkpoint.SaveHandle
    with pytest.raises(sw.ShardwiseError, match="Resumable: background must be True or False"):
        sw.Resumable("unused-run", nn.Linear(2, 2), every=1, background="yes")
    assert not os.path.exists("unused-run")


def _units_by_class_and_callable(rank, world):
    model = GPT(CFG)
    assert sw.shard(model, units=(Block, nn.LayerNorm)) is model  # the same object
    names = [u.name for u in sw.inspect(model).units]
    # Explicit predicates take every match, nested ones too (a LayerNorm inside a Block).
    assert "blocks.0" in names and "ln_f" in names and "blocks.0.ln1" in names
    x = torch.randint(0, 32, (2, 8))
    model(x, x).backward()  # nested units gather and reduce independently
    assert all(p.grad is not None for p in model.parameters())
    pick = sw.shard(GPT(CFG), units=lambda name, m: name in ("blocks.0", "blocks.2"))
    assert [u.name for u in sw.inspect(pick).units] == ["<root>", "blocks.0", "blocks.2"]
    with pytest.raises(sw.ShardwiseError, match="units="):
        sw.shard(GPT(CFG), units=3)
    with pytest.raises(sw.ShardwiseError, match="already sharded"):
        sw.shard(model)


def test_units_by_class_tuple_and_callable():
    run_ranks(_units_by_class_and_callable, 2)


def _gathered_pass_through_and_lists(rank, world):
    plain = nn.Linear(3, 3)
    with sw.gathered(plain) as m:
        assert m is plain
    t = torch.ones(2)
    with sw.gathered([t]) as (same,):
        assert same is t
    pick = sw.shard(GPT(CFG))
    with sw.gathered([pick.lm_head.weight], modifier_rank=1) as (full,):
        with torch.no_grad():
            full.fill_(float(rank))
    assert torch.equal(sw.full_state_dict(pick, rank0_only=False)["lm_head.weight"],
                       torch.ones(CFG.vocab_size, CFG.d_model))


def test_gathered_passes_unsharded_through_and_takes_parameter_lists():
    run_ranks(_gathered_pass_through_and_lists, 2)


def _inf_norm(rank, world):
    torch.manual_seed(0)
    ref = GPT(CFG)
    ours = sw.shard(copy.deepcopy(ref))
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))
    ours(x, x).backward()
    ref(x, x).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    expect = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3, norm_type=float("inf"))
    got = sw.clip_grad_norm_(ours, 1e-3, norm_type=float("inf"))
    torch.testing.assert_close(got, expect)  # a maximum: no rounding to allow for


@pytest.mark.parametrize("world", [2, 3])
def test_clip_grad_norm_infinity_norm_is_the_global_max(world):
    run_ranks(_inf_norm, world)


def _unsharded_rank0_only(rank, world):
    sd = sw.full_state_dict(nn.Linear(2, 2))
    assert (sd == {}) == (rank != 0)


def test_full_state_dict_of_unsharded_module_honours_rank0_only():
    run_ranks(_unsharded_rank0_only, 2)


def _mixed_precision_dtypes(rank, world):
    mp = sw.shard(SmallCNN(), mixed_precision=sw.MixedPrecision(torch.bfloat16))
    groups = [g for u in sw.inspect(mp).units for g in u.groups]
    assert {g.reduce_dtype for g in groups} == {torch.float32}  # fp32 reduction by default
    assert torch.bfloat16 in {g.compute_dtype for g in groups}
    low = sw.shard(SmallCNN(), mixed_precision=sw.MixedPrecision(torch.bfloat16,
                                                                 torch.bfloat16))
    assert torch.bfloat16 in {g.reduce_dtype for u in sw.inspect(low).units
                              for g in u.groups}
    mp(torch.randn(2, 3, 16, 16)).sum().backward()
    assert mp.blocks[0].bn.running_mean.dtype == torch.float32  # buffers keep their dtype
    assert all(p.grad.dtype == torch.float32 for p in mp.parameters() if p.grad is not None)
    with pytest.raises(sw.ShardwiseError, match="mixed_precision"):
        with sw.gathered(mp, modifier_rank=0):
            pass


def test_mixed_precision_keeps_buffer_and_master_dtypes():
    run_ranks(_mixed_precision_dtypes, 2)


def _load_pretrained_buffers(rank, world):
    model = sw.shard(SmallCNN(), buffers="local")
    model.blocks[0].bn.running_var.fill_(float(rank + 1))  # differs per rank
    sd = {k: v for k, v in SmallCNN().state_dict().items() if "running_var" not in k}
    sw.load_pretrained(model, sd, strict=False)
    sw.check_consistency(model)  # identical everywhere, though the source lacked them


def test_load_pretrained_leaves_identical_buffers():
    run_ranks(_load_pretrained_buffers, 2)


def test_nonsense_that_would_silently_change_training_is_refused():
    """Issue 31 item 7: each of these was accepted before and changed training."""
    model = nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    grad = model.weight.grad.clone()
    for max_norm in (-1.0, float("nan"), "1.0"):
        with pytest.raises(sw.ShardwiseError, match="max_norm"):
            sw.clip_grad_norm_(model, max_norm)
    assert torch.equal(model.weight.grad, grad)  # neither flipped nor NaN
    assert sw.clip_grad_norm_(model, float("inf")) > 0  # measuring only: allowed

    x, y = torch.arange(8).view(4, 2), torch.arange(6)
    with pytest.raises(sw.ShardwiseError, match=r"different lengths.*batch\[0\]: 4, "
                                                r"batch\[1\]: 6"):
        sw.micro_batches((x, y), 2)
    assert len(sw.micro_batches({"x": x, "y": torch.arange(4)}, 2)) == 2

    before = model.weight.detach().clone()
    with pytest.raises(sw.ShardwiseError, match=r"weight: the source holds torch.int64, the "
                                                r"model torch.float32"):
        sw.load_pretrained(model, {"weight": torch.ones(3, 4, dtype=torch.int64),
                                   "bias": torch.zeros(3)})
    assert torch.equal(model.weight, before)  # nothing loaded
    with pytest.warns(UserWarning, match=r"2 from float64 to float32"):
        sw.load_pretrained(model, {"weight": torch.ones(3, 4, dtype=torch.float64),
                                   "bias": torch.zeros(3, dtype=torch.float64)})
    assert torch.equal(model.weight, torch.ones(3, 4)) and not torch.equal(before, model.weight)


class Lit(nn.Module):
    """As a LightningModule holds the user's network, and ShardwiseStrategy shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN()

    def forward(self, x):
        return self.net(x)


def _on_a_submodule(rank, world):
    torch.manual_seed(0)
    lm = sw.shard(Lit())
    whole = sw.full_state_dict(lm, rank0_only=False)
    part = sw.full_state_dict(lm.net, rank0_only=False)  # a bare KeyError before
    assert part.keys() == {k[len("net."):] for k in whole}
    assert all(torch.equal(part[k], whole["net." + k]) for k in part)
    with sw.gathered(lm.net) as net:
        assert not isinstance(net.head.weight, torch.distributed.tensor.DTensor)
        assert torch.equal(net.head.weight.detach(), whole["net.head.weight"])
    torch.manual_seed(1)
    new = SmallCNN().state_dict()
    sw.load_pretrained(lm.net, new)  # keys relative to the submodule
    got = sw.full_state_dict(lm.net, rank0_only=False)
    assert all(torch.equal(got[k], new[k]) for k in new)
    sw.sync_buffers(lm.net)
    sw.check_consistency(lm.net)


def test_operations_on_a_submodule_of_a_sharded_model():
    """Issue 30 item 5: what Lightning users call on self.net."""
    run_ranks(_on_a_submodule, 2)


def _bad_arguments(rank, world):
    """Issue 31 item 6: each of these raised a bare exception from inside shardwise
    (AttributeError: ... '__dict__', TypeError, ...)."""
    calls = {
        "shard": lambda m: sw.shard(m),
        "is_sharded": lambda m: sw.is_sharded(m),
        "gathered": lambda m: sw.gathered(m).__enter__(),
        "sync_buffers": lambda m: sw.sync_buffers(m),
        "check_consistency": lambda m: sw.check_consistency(m),
        "full_state_dict": lambda m: sw.full_state_dict(m),
        "load_pretrained": lambda m: sw.load_pretrained(m, {}),
        "save_checkpoint": lambda m: sw.save_checkpoint("unused-ck", m),
        "load_checkpoint": lambda m: sw.load_checkpoint("unused-ck", m),
        "clip_grad_norm_": lambda m: sw.clip_grad_norm_(m, 1.0),
        "no_sync": lambda m: sw.no_sync(m).__enter__(),
        "inspect": lambda m: sw.inspect(m),
        "per_rank": lambda m: sw.per_rank(m),
    }
    for name, call in calls.items():
        for bad in (None, "model"):
            try:
                call(bad)
            except sw.ShardwiseError as e:
                assert "module" in str(e), (name, str(e))
            else:
                raise AssertionError(f"{name}({bad!r}) was accepted")
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(sw.ShardwiseError, match=r"src_rank='0'.*an int"):
        sw.shard(model, src_rank="0")
    with pytest.raises(sw.ShardwiseError, match=r"mixed_precision='bf16'.*sw.MixedPrecision"):
        sw.shard(model, mixed_precision="bf16")
    with pytest.raises(sw.ShardwiseError, match=r"param_dtype='bf16'.*torch.bfloat16"):
        sw.MixedPrecision(param_dtype="bf16")
    with pytest.raises(sw.ShardwiseError, match=r"reduce_dtype=torch.int32"):
        sw.MixedPrecision(reduce_dtype=torch.int32)
    for call, said in ((lambda: sw.check_consistency(model, optimizer="x"), "optimizer must"),
                       (lambda: sw.save_checkpoint("unused", model, "x"), "optimizer must"),
                       (lambda: sw.sync_buffers(model, group="g"), "group must"),
                       (lambda: sw.shard(model, group="g"), "group must"),
                       (lambda: sw.sharded_init(src_rank="0").__enter__(), "src_rank='0'"),
                       (lambda: sw.global_mean("x"), "values must"),
                       (lambda: sw.global_mean(None), "values must")):
        with pytest.raises(sw.ShardwiseError, match=said):
            call()
    assert not sw.is_sharded(model)  # nothing was changed by the refusals


def test_public_functions_refuse_bad_arguments_in_words():
    run_ranks(_bad_arguments, 2)


def test_micro_batches_of_an_empty_batch_are_refused():
    """Issue 51 item 6: a batch of 0 rows gave micro-batches of 0 rows, and a step of
    nothing."""
    for batch, path in ((torch.zeros(0, 3), "batch"),
                        ((torch.zeros(0, 3), torch.zeros(0)), "batch[0]"),
                        ({"x": torch.zeros(0, 5, dtype=torch.long)}, "batch['x']")):
        with pytest.raises(sw.ShardwiseError) as err:
            sw.micro_batches(batch, 2)
        said = str(err.value)
        assert f"micro_batches: {path} has 0 rows: an empty batch" in said, said
        assert "drop_last=True" in said, said


def _nonsense(rank, world, root):
    """Issue 41 item 10: values that meant nothing were accepted (an empty batch, the nan
    mean of no values, a truthy string for a flag, a prefetch of 10**9 units); each is
    refused in words, on every rank, before anything changes."""
    with pytest.raises(sw.ShardwiseError, match=r"the batch holds no tensor \(list \[\]\)"):
        sw.micro_batches([], 2)
    with pytest.raises(sw.ShardwiseError, match="holds no tensor"):
        sw.micro_batches({"x": ()}, 2)
    with pytest.raises(sw.ShardwiseError, match=r"every rank passed an empty list.*nan"):
        sw.global_mean([])
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(sw.ShardwiseError, match=r"prefetch=1000000000: the model has 3 "
                                                r"unit\(s\), so prefetch is at most 3 "
                                                r"\(from 2 on, every other unit is already "
                                                r"gathered ahead"):
        sw.shard(model, prefetch=10**9)  # the root and each entry
    with pytest.raises(sw.ShardwiseError, match=r"prefetch=3: the model has 2 unit"):
        sw.shard(model, units=lambda name, m: name == "0", prefetch=3)
    assert not sw.is_sharded(model)
    torch.manual_seed(0)
    sw.shard(model, units=lambda name, m: name == "0", prefetch=2)  # 2 units: allowed
    full = sw.full_state_dict(model, rank0_only=False)
    for call, said in (
            (lambda: sw.save_checkpoint(root, model, keep_previous="no"),
             r"save_checkpoint: keep_previous must be True or False, got str 'no'"),
            (lambda: sw.load_pretrained(model, full, strict="false"),
             r"load_pretrained: strict must be True or False, got str 'false'"),
            (lambda: sw.full_state_dict(model, rank0_only=0),
             r"full_state_dict: rank0_only must be True or False, got int 0")):
        with pytest.raises(sw.ShardwiseError, match=said):
            call()
    assert not os.path.exists(root)  # nothing was written
    after = sw.full_state_dict(model, rank0_only=False)  # and the group is still usable
    assert all(torch.equal(after[k], v) for k, v in full.items())


def test_nonsense_arguments_are_refused_in_words(tmp_path):
    run_ranks(_nonsense, 2, str(tmp_path / "ckpt"))
