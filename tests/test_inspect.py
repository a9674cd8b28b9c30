"""``sw.inspect``: a read-only snapshot of the engine, taken without any collective."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.planning.memory import gathered_unit_bytes, state_bytes

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _through_a_step(rank, world):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    view = sw.inspect(model)
    assert (view.rank, view.world_size, view.steps, view.phase) == (rank, world, 0, "idle")
    assert [u.name for u in view.units] == ["<root>", "blocks.0", "blocks.1"]
    assert view.units[0].is_root and view.unit("blocks.1").module_type == "Block"
    assert view.param("lm_head.weight").names == ("tok_emb.weight", "lm_head.weight")
    assert "lm_head.weight" in view.unit("<root>").param_names
    names = [n for u in view.units for n in u.param_names]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert all(p.held == "shard" for u in view.units for p in u.params) and not view.unmanaged
    with pytest.raises(KeyError, match="blocks.0"):
        view.unit("blocks.7")

    # Layout: each rank's rows, padded slots aligned, the buffer sizes they add up to.
    for u in view.units:
        for g in u.groups:
            assert g.gathered_numel == world * g.shard_numel
            for p in g.params:
                rows = torch.chunk(torch.arange(p.shape[0]), world)
                assert p.local_rows == (len(rows[rank]) if rank < len(rows) else 0)
                assert p.shard_offset % view.align == 0 and p.full_offset % view.align == 0
                assert p.padded_numel * world >= p.numel
                assert p.shard_offset + p.padded_numel <= g.shard_numel

    # Bytes: what planning/memory.py counts from the tensors themselves.
    assert view.param_bytes == state_bytes(model)["params"] and view.grad_bytes == 0
    assert view.largest_gathered_bytes == max(gathered_unit_bytes(model).values())
    assert view.full_bytes == 0

    # Phases and unit states, seen from hooks; taking a snapshot sends nothing.
    seen = {}

    def snap(key):
        def hook(*_):
            before = sw.inspect(model).comm
            seen[key] = sw.inspect(model)
            assert sw.inspect(model).comm.since(before).calls == dict.fromkeys(before.calls, 0)
        return hook

    model.blocks[1].register_forward_pre_hook(snap("forward"))
    model.blocks[0].register_full_backward_pre_hook(snap("backward"))
    loss = model(x, x)
    after_forward = sw.inspect(model)
    loss.backward()
    done = sw.inspect(model)
    assert seen["forward"].phase == "forward"
    assert seen["forward"].unit("blocks.1").state == "gathered"
    assert seen["forward"].full_bytes > 0
    assert after_forward.phase == "awaiting backward"
    assert seen["backward"].phase == "backward"
    assert (done.phase, done.steps) == ("idle", 1)
    assert all(u.state == "sharded" and not any(g.full_allocated for g in u.groups)
               for u in done.units)
    assert done.grad_bytes == state_bytes(model)["grads"] > 0
    counted = done.comm.since(view.comm)
    if world > 1:
        assert counted.calls["all_gather"] > 0 and counted.calls["reduce_scatter"] == 3
    opt.step()

    # A snapshot is a copy: frozen, and later steps do not change it.
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.phase = "forward"  # type: ignore[misc]
    done.comm.calls["all_gather"] = -1  # its own dict: the engine's counters are untouched
    assert sw.inspect(model).comm.calls["all_gather"] >= 0
    model(x, x).backward()
    assert done.steps == 1 and sw.inspect(model).steps == 2

    with sw.no_sync(model):
        assert not sw.inspect(model).grad_sync
    with sw.gathered(model):
        pinned = sw.inspect(model)
        assert all(u.state == "gathered" and u.pins == 1 for u in pinned.units)
        assert all(p.held == "full" for u in pinned.units for p in u.params)
    table = str(pinned)
    assert "blocks.1" in table and "gathered" in table and f"rank {rank} of {world}" in table

    # Only a sharded root has a snapshot.
    with pytest.raises(sw.ShardwiseError, match="part of a sharded model, not its root"):
        sw.inspect(model.blocks[0])
    with pytest.raises(sw.ShardwiseError, match="is not sharded"):
        sw.inspect(nn.Linear(2, 2))

    # A parameter added after shard is named (the next forward refuses it).
    model.extra = nn.Parameter(torch.zeros(3))
    assert sw.inspect(model).unmanaged == ("extra",)


@pytest.mark.parametrize("world", [1, 2])
def test_inspect_follows_a_step_without_communicating(world):
    run_ranks(_through_a_step, world)


def _one_rank_alone(rank, world):
    model = sw.shard(GPT(CFG))
    if rank == 0:  # no collective: rank 1 is not there to meet it, and nothing hangs
        for _ in range(3):
            assert sw.inspect(model).world_size == world
    torch.distributed.barrier()


def test_one_rank_may_inspect_alone():
    run_ranks(_one_rank_alone, 2, timeout=60)
