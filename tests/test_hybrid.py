"""Hybrid sharding on a 2-D mesh (Note [hybrid sharding] in comm/mesh.py): 4 gloo ranks as
(replicate, shard) = (2, 2), against DDP at 4 ranks and FSDP2's HSDP on the same model.

Hybrid sums gradients in pairs, (a+b)+(c+d), DDP in gloo's ring order, so results match
DDP within rounding, not bit for bit. Why these bounds (``OMP_NUM_THREADS=1 python
benchmarks/parity.py --worlds 4``; 10 AdamW steps, fp32, errors as in tests/parity.py;
AMD EPYC):

    model N=4                   loss     normwise  per-tensor
    GPT shardwise (2, 2)        0        2.2e-8    8.4e-7
    GPT FSDP2 HSDP (2, 2)       0        2.2e-8    8.4e-7
    GPT shardwise flat          1.0e-7   2.6e-8    1.9e-6
    GPT FSDP2 flat              1.0e-7   3.9e-8    5.8e-6
    CNN shardwise (2, 2)        1.2e-7   4.4e-8    1.0e-6
    CNN FSDP2 HSDP (2, 2)       1.2e-7   4.4e-8    1.0e-6
    CNN shardwise flat          1.0e-7   4.2e-8    8.1e-7
    CNN FSDP2 flat              1.2e-7   4.6e-8    1.2e-6

shardwise's hybrid and FSDP2's HSDP land on the same figures (both add the pairs the same
way). The bounds are test_parity's N=3 bounds: 4x or more above twice shardwise's worst
figure here (rounding moves by up to 2x between CPUs) and above FSDP2's own flat figures,
far below a real defect (a gradient scaled by the wrong count moves the state by 1e-3 or
more).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from harness import LogCollector, run_ranks
from parity import GPT_CFG, ddp_reference, errors, fsdp2_run, gpt_loss, shardwise_run
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.engine.iteration.state import model_state
from shardwise.models import GPT

LOSS_BOUND = 1e-6        # measured at most 1.2e-7 (hybrid and FSDP2's HSDP)
NORMWISE_BOUND = 2e-7    # measured at most 4.4e-8 (both)
PER_TENSOR_BOUND = 1e-5  # measured at most 1.0e-6 (hybrid), 5.8e-6 (FSDP2 flat at N=4)


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _counts(view: sw.ModelView) -> tuple[dict, dict, dict]:
    return dict(view.comm.bytes), dict(view.comm.sent), dict(view.comm.calls)


def _training(rank, world):
    mesh = _mesh()
    base, ddp_losses, ddp_sd = ddp_reference(rank, "gpt")
    fsdp_losses, fsdp_sd = fsdp2_run(rank, "gpt", base, mesh=mesh)
    model, losses, sd = shardwise_run(rank, "gpt", base, mesh=mesh)
    sw.check_consistency(model)  # buffers and every replica's rows agree

    # Each rank stores half of the model: the shard group's share, whatever R is.
    view = sw.inspect(model)
    assert (view.shard_size, view.replicas, view.world_size) == (2, 2, 4)
    total = sum(p.numel() * p.element_size() for p in base.parameters())
    padding = sum((g.gathered_numel - sum(p.numel for p in g.params)) * g.dtype.itemsize
                  for u in view.units for g in u.groups)
    assert total / 2 <= view.param_bytes <= (total + padding) / 2, (view.param_bytes, total)
    for p in model.parameters():
        assert tuple(p.placements) == (dist.tensor.Replicate(), dist.tensor.Shard(0))

    # Bytes per step: within a node, exactly a flat world of S=2's (the same model sharded
    # over this rank's shard group); across nodes, one sum of each trainable shard.
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len))
    flat = sw.shard(copy.deepcopy(base), group=mesh.get_group("shard"))
    counts, headers = {}, {}
    for name, m in (("hybrid", model), ("flat", flat)):
        gpt_loss(m, x, x).backward()  # the first step records the order prefetches follow
        before = sw.inspect(m)
        channel = model_state(m).comm.channel
        posted = channel.headers
        gpt_loss(m, x, x).backward()
        headers[name] = channel.headers - posted
        after = sw.inspect(m)
        counts[name] = (after.comm.since(before.comm), after, before)
    within, after, before = counts["hybrid"]
    flat_within = counts["flat"][0]
    for kind in ("all_gather", "reduce_scatter"):
        assert within.bytes[kind] == flat_within.bytes[kind], (kind, within, flat_within)
        assert within.sent[kind] == flat_within.sent[kind], (kind, within, flat_within)
    trainable = [g for u in after.units for g in u.groups if g.requires_grad]
    across = after.comm_across.since(before.comm_across)
    shard_bytes = sum(g.shard_numel * g.dtype.itemsize for g in trainable)
    assert across.bytes["all_reduce"] == shard_bytes, (across, shard_bytes)
    assert across.calls["all_reduce"] == len(trainable)
    assert sum(across.calls.values()) == len(trainable)
    # Over every rank of the mesh, so also across nodes, one small control collective:
    # the used-parameter flags'. The order check's headers (Note [checks ride the
    # exchanges]) are point-to-point messages: one with each all-gather of the forward,
    # one at its end, one at the start of the backward; none costs a round trip.
    world = after.comm_world.since(before.comm_world)
    assert {k for k, v in world.calls.items() if v} == {"all_reduce"}, world
    assert world.calls["all_reduce"] == 1, world
    assert world.bytes["all_reduce"] < 1024, world
    assert headers["hybrid"] == len(after.units) + 2, headers
    assert shard_bytes * 2 <= total + padding  # P/S of the model, up to padding

    # Gradient accumulation: nothing crosses nodes (and nothing is reduce-scattered)
    # until the first backward outside no_sync, which reduces both once.
    before = sw.inspect(model)
    with sw.no_sync(model):
        gpt_loss(model, x, x).backward()
        gpt_loss(model, x, x).backward()
    during = sw.inspect(model)
    assert sum(during.comm_across.since(before.comm_across).calls.values()) == 0
    assert during.comm.since(before.comm).calls["reduce_scatter"] == 0
    gpt_loss(model, x, x).backward()
    done = sw.inspect(model)
    assert done.comm_across.since(during.comm_across).calls["all_reduce"] == len(trainable)
    assert done.comm.since(during.comm).calls["reduce_scatter"] == len(trainable)

    if rank != 0:
        return None
    # FSDP2's HSDP adds the same pairs in the same order: the same bits.
    assert torch.equal(losses, fsdp_losses)
    _same(sd, fsdp_sd, "shardwise (2, 2) against FSDP2's HSDP (2, 2)")
    ours = errors(losses, ddp_losses, sd, ddp_sd)
    theirs = errors(fsdp_losses, ddp_losses, fsdp_sd, ddp_sd)
    assert ours.loss <= LOSS_BOUND, ours
    assert ours.normwise <= NORMWISE_BOUND, ours
    assert ours.per_tensor <= PER_TENSOR_BOUND, ours
    return ours, theirs


@pytest.mark.slow
def test_hybrid_training_matches_ddp_and_sends_what_theory_says():
    ours, theirs = run_ranks(_training, 4, timeout=240)[0]
    print(f"GPT (2, 2) against DDP at 4: shardwise {ours}, FSDP2 HSDP {theirs}")


def _full_optimizer_state(model, opt) -> dict:
    """Every parameter's optimizer state as full tensors (a collective)."""
    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            out[f"{name}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return out


def _build(seed: int, **kwargs):
    torch.manual_seed(seed)
    model = sw.shard(GPT(GPT_CFG), **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _steps(model, opt, n: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(n):
        x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len), generator=g)
        gpt_loss(model, x, x).backward()
        opt.step()
        opt.zero_grad()


def _same(a: dict, b: dict, what: str) -> None:
    assert list(a) == list(b), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _consistency_and_checkpoints(rank, world, root):
    mesh = _mesh()
    model, opt = _build(0, mesh=mesh)
    _steps(model, opt, 2, rank)

    # A replica that drifted is named, on every rank.
    p = next(model.parameters())
    kept = p.to_local().clone()
    if rank == 2:
        with torch.no_grad():
            p.to_local().add_(1.0)
    with pytest.raises(sw.DivergenceError, match=r"rows of shard 0: replica 0 \(rank 0\): "
                                                 r"version A; replica 1 \(rank 2\): version B"):
        sw.check_consistency(model)
    with torch.no_grad():
        p.to_local().copy_(kept)
    sw.check_consistency(model)

    # The order check covers the whole mesh: a rank of the other replica that goes its
    # own way is named on every rank, and training goes on.
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len))
    with pytest.raises(sw.ShardwiseError, match=r"ranks diverged .*rank 3: full_state_dict"):
        if rank == 3:
            sw.full_state_dict(model)
        else:
            gpt_loss(model, x, x).backward()
    _steps(model, opt, 1, rank)

    # A backward that raises half-way (a batch skipped) is abandoned; recovering waits for
    # what was in flight but starts no sum across replicas of it. Training goes on.
    def skip(*_):
        raise RuntimeError("skip this batch")

    handle = model.blocks[0].register_full_backward_pre_hook(skip)
    with pytest.raises(RuntimeError, match="skip this batch"):
        gpt_loss(model, x, x).backward()
    handle.remove()
    before = sw.inspect(model)
    with torch.no_grad():
        gpt_loss(model, x, x)
    assert sum(sw.inspect(model).comm_across.since(before.comm_across).calls.values()) == 0
    _steps(model, opt, 1, rank)
    sw.check_consistency(model)

    # The step log counts every group: the shard group's, every rank's, across replicas.
    import logging

    from shardwise._log import logger
    handler = LogCollector()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _steps(model, opt, 1, rank)
    logger.removeHandler(handler)
    logger.setLevel(level)
    lines = [m for m in handler.messages if "step communication" in m]
    if rank == 0:  # shardwise logs from rank 0
        for part in ("all_gather", "reduce_scatter", "world all_reduce",
                     "across replicas all_reduce"):
            assert part in lines[-1], lines

    # The global gradient norm counts each row once, not once per replica: shardwise's
    # and torch's (through DTensor) agree with the norm of the full gradients.
    gpt_loss(model, x, x).backward()
    ours = sw.clip_grad_norm_(model, 1e9)
    theirs = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor()
    full = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]))
    assert torch.allclose(ours, full, rtol=1e-6) and torch.allclose(theirs, full, rtol=1e-6), \
        (ours, theirs, full)
    opt.zero_grad()

    # A deep copy (an EMA, a reference model) is an independent model on the same mesh.
    twin = copy.deepcopy(model)
    _same(sw.full_state_dict(twin, rank0_only=False),
          sw.full_state_dict(model, rank0_only=False), "deep copy")
    assert sw.inspect(twin).replicas == 2

    # modifier_rank is a rank of the whole mesh: rank 3's edit reaches both replicas.
    with sw.gathered(model, modifier_rank=3):
        if rank == 3:
            with torch.no_grad():
                model.ln_f.weight.mul_(0.5)
    sw.check_consistency(model)
    state = sw.full_state_dict(model, rank0_only=False)
    ref = torch.empty_like(state["ln_f.weight"])
    ref.copy_(state["ln_f.weight"])
    dist.broadcast(ref, src=3)
    assert torch.equal(ref, state["ln_f.weight"])
    optim = _full_optimizer_state(model, opt)

    # Saved under (2, 2), each shard once: replica 1's files hold no parameter rows.
    hybrid_dir = os.path.join(root, "hybrid")
    sw.save_checkpoint(hybrid_dir, model, opt)
    with open(os.path.join(hybrid_dir, "checkpoint.json")) as f:
        meta = json.load(f)
    for entry in meta["params"].values():
        assert [n for _, n in entry["pieces"][2:]] == [0, 0], entry["pieces"]
        assert sum(n for _, n in entry["pieces"]) == torch.Size(entry["shape"]).numel()

    def loads_into(what: str, **kwargs) -> None:
        other, other_opt = _build(7, **kwargs)  # other weights: the load must replace them
        sw.load_checkpoint(hybrid_dir, other, other_opt)
        _same(sw.full_state_dict(other, rank0_only=False), state, what)
        _same(_full_optimizer_state(other, other_opt), optim, what + " (optimizer)")

    loads_into("flat at 4")
    loads_into("(2, 2)", mesh=mesh)
    for ranks in ([0], [0, 1, 2]):  # flat at 1 and 3
        group = dist.new_group(ranks)
        if rank in ranks:
            loads_into(f"flat at {len(ranks)}", group=group)
    one_row = DeviceMesh("cpu", [[0, 1]])     # (1, 2)
    one_col = DeviceMesh("cpu", [[2], [3]])   # (2, 1)
    if rank in (0, 1):
        loads_into("(1, 2)", mesh=one_row)
    else:
        loads_into("(2, 1)", mesh=one_col)

    # src_rank is a rank of the whole mesh: every rank ends with rank 3's initial weights.
    torch.manual_seed(rank)
    mine = GPT(GPT_CFG)
    ref = {k: v.clone() for k, v in mine.state_dict().items()}
    for v in ref.values():
        dist.broadcast(v, src=3)
    from_three = sw.shard(mine, mesh=mesh, src_rank=3)
    _same(sw.full_state_dict(from_three, rank0_only=False), ref, "src_rank=3 under (2, 2)")

    # The reverse: saved flat at 4, loaded under (2, 2).
    flat, flat_opt = _build(3)
    _steps(flat, flat_opt, 1, rank)
    flat_dir = os.path.join(root, "flat")
    sw.save_checkpoint(flat_dir, flat, flat_opt)
    hybrid, hybrid_opt = _build(9, mesh=mesh)
    sw.load_checkpoint(flat_dir, hybrid, hybrid_opt)
    _same(sw.full_state_dict(hybrid, rank0_only=False),
          sw.full_state_dict(flat, rank0_only=False), "flat into (2, 2)")
    _same(_full_optimizer_state(hybrid, hybrid_opt), _full_optimizer_state(flat, flat_opt),
          "flat into (2, 2) (optimizer)")
    # ... and training goes on identically from there.
    _steps(hybrid, hybrid_opt, 1, rank)
    _steps(flat, flat_opt, 1, rank)
    a = sw.full_state_dict(hybrid, rank0_only=False)
    b = sw.full_state_dict(flat, rank0_only=False)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5  # summed in another order

    # torch.distributed.checkpoint: a save of model.state_dict() under HSDP loads flat.
    import torch.distributed.checkpoint as dcp

    dcp_dir = os.path.join(root, "dcp")
    dcp.save(model.state_dict(), checkpoint_id=dcp_dir)
    other, _ = _build(11)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir)
    other.load_state_dict(sd)
    _same(sw.full_state_dict(other, rank0_only=False), state, "DCP from (2, 2) to flat")


def test_hybrid_consistency_and_checkpoints_across_layouts(tmp_path):
    run_ranks(_consistency_and_checkpoints, 4, str(tmp_path), timeout=240)


def _bad_meshes(rank, world):
    model = GPT(GPT_CFG)
    with pytest.raises(sw.ShardwiseError, match="not both"):
        sw.shard(model, group=dist.group.WORLD, mesh=_mesh())
    with pytest.raises(sw.ShardwiseError, match="is not a torch.distributed.device_mesh"):
        sw.shard(model, mesh=[[0, 1], [2, 3]])
    cube = init_device_mesh("cpu", (1, 2, 2))
    with pytest.raises(sw.ShardwiseError, match="3 dimensions"):
        sw.shard(model, mesh=cube)
    # A 1-D mesh is group=mesh.get_group().
    line = init_device_mesh("cpu", (4,))
    sharded = sw.shard(model, mesh=line)
    assert sw.inspect(sharded).replicas == 1 and sw.inspect(sharded).shard_size == 4
    # Tensor parallelism first, then sharding over "dp" (FSDP2's 2-D recipe) composes
    # (tests/test_tensor_parallel.py); sharding such a model over a process group instead
    # of the sibling mesh is refused by name, saying what to pass.
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    parallelize_module(mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    with pytest.raises(sw.ShardwiseError, match=r"0\.weight is a DTensor on .*given a "
                                                r"process group.*mesh=mesh\['dp'\]"):
        sw.shard(mlp, group=mesh["dp"].get_group())


def test_bad_meshes_are_refused():
    run_ranks(_bad_meshes, 4, timeout=120)


def _secondary_shards(rank, world):
    """reshard_after_forward=2 at 4 ranks (Note [secondary shards]) against ZeRO-3."""
    torch.manual_seed(0)
    base = GPT(GPT_CFG)
    runs = {}
    for raf in (True, 2):
        model = sw.shard(copy.deepcopy(base), reshard_after_forward=raf)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(100 + rank)
        losses = []
        for _ in range(3):
            x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len), generator=g)
            before = sw.inspect(model)
            loss = gpt_loss(model, x, x)
            between = sw.inspect(model)  # after the forward, before its backward
            loss.backward()
            after = sw.inspect(model)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[raf] = (losses, sw.full_state_dict(model, rank0_only=False), before, between,
                     after)
    (z_losses, z_state, z_before, _, z_after), (losses, state, before, between, after) = \
        runs[True], runs[2]
    assert losses == z_losses  # the same values gathered: every bit of every loss
    _same(state, z_state, "reshard_after_forward=2 against True")

    # Between forward and backward each non-root unit keeps 1/k of itself, but the last,
    # which stays gathered for its backward, which comes first.
    units = [u for u in after.units if not u.is_root]
    full = {u.name: sum(g.gathered_numel * g.dtype.itemsize for g in u.groups) for u in units}
    kept = sum(full[u.name] for u in units[:-1]) // 2
    assert between.kept_bytes == kept, (between.kept_bytes, full)
    assert after.kept_bytes == 0
    # The backward gathers every unit but the last (which stays gathered) within groups
    # of 2: its bytes leave the shard group's all-gathers for the groups' own.
    regathered = sum(full[u.name] for u in units[:-1])
    within = after.comm.since(before.comm)
    z_within = z_after.comm.since(z_before.comm)
    groups = after.comm_regather.since(before.comm_regather)
    assert groups.bytes["all_gather"] == regathered // 2
    assert groups.sent["all_gather"] == regathered // 2  # to the one other rank of the group
    assert within.bytes["all_gather"] == z_within.bytes["all_gather"] - regathered // 4
    assert within.sent["all_gather"] == z_within.sent["all_gather"] - 3 * regathered // 4
    assert z_after.comm_regather is None and z_after.kept_bytes == 0

    for bad, match in ((3, "must divide"), (1, "must divide"), (8, "must divide"),
                       ("2", "expected True, False or an int")):
        with pytest.raises(sw.ShardwiseError, match=match):
            sw.shard(GPT(GPT_CFG), reshard_after_forward=bad)
    same = sw.shard(GPT(GPT_CFG), reshard_after_forward=4)  # groups of 4 are ZeRO-3 itself
    assert sw.inspect(same).comm_regather is None


def test_reshard_after_forward_to_groups_of_k():
    run_ranks(_secondary_shards, 4, timeout=180)
