"""The DDP habit with a sharded model: rank 0 saves, every rank loads the same file.

A file of one rank's rows (``torch.save(model.state_dict())`` or of
``optimizer.state_dict()`` on rank 0) is refused on every rank before anything changes
(Note [rows of one rank]); full state dicts (``sw.full_state_dict`` and
``sw.full_optimizer_state_dict``) are the DDP habit's format: equal to DDP's, loadable at
any world size, by an unsharded optimizer, and by a plain process.
"""

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from loops import train_steps
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=16)  # 40 rows: 3 pads


def _data(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=g)
    return x, x.roll(-1, 1)


def _steps(model, opt, steps, rank=None):
    rank = dist.get_rank() if rank is None else rank
    return train_steps(model, opt, (_data(rank, s) for s in steps))


def _global_steps(model, opt, steps, world):
    """What DDP over ``world`` ranks does, in one process: the mean loss over every rank's
    equal share is the mean over their concatenation."""
    batches = [tuple(torch.cat(parts) for parts in zip(*(_data(r, s) for r in range(world))))
               for s in steps]
    return train_steps(model, opt, batches)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _gpt(seed):
    torch.manual_seed(seed)
    return GPT(CFG)


def _local_state(model, opt):
    """Copies of this rank's rows of every parameter and optimizer state tensor."""
    params = {n: p.to_local().clone() for n, p in model.named_parameters()}
    state = {(i, k): (v.to_local() if isinstance(v, DTensor) else v).clone()
             for i, st in opt.state_dict()["state"].items() for k, v in st.items()}
    return params, state


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _full_optimizer_equal(a, b, exact=True):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        assert a["state"][i].keys() == b["state"][i].keys()
        for k, v in a["state"][i].items():
            w = b["state"][i][k]
            assert type(v) is torch.Tensor and v.device.type == "cpu", (i, k, type(v))
            if exact:
                assert torch.equal(v, w), (i, k)
            else:
                # DDP all-reduces whole gradients, shardwise reduce-scatters rows: the sums
                # round differently in the last bits, and three AdamW steps carry that.
                torch.testing.assert_close(v, w, rtol=1e-4, atol=1e-6)


def _rank0_files(rank, world, folder, load_from):
    base = _gpt(rank)  # each rank builds other weights: rank 0's must win
    model, opt = sw.shard(copy.deepcopy(base)), None
    opt = _opt(model)
    ddp = DDP(copy.deepcopy(_gpt(0)))
    ddp_opt = _opt(ddp)
    _steps(model, opt, range(3))
    _steps(ddp, ddp_opt, range(3))

    # 1. rank 0's own rows, loaded on every rank: refused everywhere, nothing changed.
    raw = os.path.join(folder, f"raw{world}.pt")
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, raw)
    dist.barrier()
    ck = torch.load(raw)  # weights_only, as torch.load is by default
    before = _local_state(model, opt)
    assert not any(hasattr(v, "_shardwise_rows")  # the tag rides the saved values only
                   for st in opt.state.values() for v in st.values())
    with pytest.raises(sw.ShardwiseError) as e:
        model.load_state_dict(ck["model"])
    model_error = str(e.value)
    with pytest.raises(sw.ShardwiseError) as e:
        opt.load_state_dict(ck["optimizer"])
    opt_error = str(e.value)
    for text, what, names in ((model_error, "model", "tok_emb.weight"),
                              (opt_error, "optimizer", "tok_emb.weight['exp_avg']")):
        assert f"rank 0 of {world}" in text and f"{what}.state_dict()" in text, text
        assert names in text and "nothing was changed" in text, text
        assert "sw.full_optimizer_state_dict" in text and "sw.save_checkpoint" in text, text
        assert f"rank(s) {list(range(1, world))}" in text, text  # the ranks it concerns
    # Into a submodule too (the load's own module checks what lies below it).
    block = {k[len("blocks.0."):]: v for k, v in ck["model"].items() if k.startswith("blocks.0.")}
    with pytest.raises(sw.ShardwiseError, match=f"rows of rank 0 of {world}"):
        model.blocks[0].load_state_dict(block)
    after = _local_state(model, opt)
    _same(before[0], after[0])
    _same(before[1], after[1])
    # A file per rank, loaded by the rank that saved it, is this rank's rows: it loads.
    own = os.path.join(folder, f"own{world}-{rank}.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, own)
    ck = torch.load(own)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    after = _local_state(model, opt)
    _same(before[0], after[0])
    _same(before[1], after[1])

    # 2. Full state dicts: DDP's, on rank 0 only.
    sd = sw.full_state_dict(model)
    osd = sw.full_optimizer_state_dict(model, opt)
    if rank != 0:
        assert sd == {} and osd == {}
    else:
        ref = ddp_opt.state_dict()
        _full_optimizer_equal(osd, ref, exact=False)
        for k, v in ddp.module.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-6)  # as above
        torch.save({"model": sd, "optimizer": osd}, os.path.join(folder, f"full{world}.pt"))
    dist.barrier()

    # 3. Resumed from the full file on every rank, with other weights and a fresh
    # optimizer: equal, bit for bit, to the run that went on.
    _steps(model, opt, range(3, 5))
    went_on = (sw.full_state_dict(model, rank0_only=False),
               sw.full_optimizer_state_dict(model, opt, rank0_only=False))
    resumed = sw.shard(_gpt(100 + rank))
    ropt = _opt(resumed)
    ck = torch.load(os.path.join(folder, f"full{world}.pt"))
    resumed.load_state_dict(ck["model"])
    ropt.load_state_dict(ck["optimizer"])
    _steps(resumed, ropt, range(3, 5))
    _same(went_on[0], sw.full_state_dict(resumed, rank0_only=False))
    _full_optimizer_equal(went_on[1],
                          sw.full_optimizer_state_dict(resumed, ropt, rank0_only=False))

    # 4. Another world size's full file loads here: each rank holds its rows of it.
    if load_from is not None:
        other = sw.shard(_gpt(7))
        oopt = _opt(other)
        ck = torch.load(os.path.join(folder, load_from))
        other.load_state_dict(ck["model"])
        oopt.load_state_dict(ck["optimizer"])
        _full_optimizer_equal(ck["optimizer"],
                              sw.full_optimizer_state_dict(other, oopt, rank0_only=False))
        _same(ck["model"], sw.full_state_dict(other, rank0_only=False))
        _steps(other, oopt, range(3, 4))  # and it trains
    return went_on if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("rank_files"))
    went_on = run_ranks(_rank0_files, 2, folder, None)[0]
    run_ranks(_rank0_files, 3, folder, "full2.pt")
    return folder, went_on


def test_rank0_files_refused_full_dicts_resume(runs):
    """The multi-rank checks above ran at world size 2, then 3 (loading the file of 2)."""


def test_full_dicts_resume_an_unsharded_model(runs):
    """A full file loads into a plain model and optimizer in one process, which then
    trains as the sharded run went on (DDP's arithmetic, up to rounding)."""
    folder, went_on = runs
    model = _gpt(5)
    opt = _opt(model)
    ck = torch.load(os.path.join(folder, "full2.pt"))
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    _full_optimizer_equal(ck["optimizer"], opt.state_dict())
    _global_steps(model, opt, range(3, 5), world=2)
    _full_optimizer_equal(went_on[1], opt.state_dict(), exact=False)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(went_on[0][k], v, rtol=1e-4, atol=1e-6)


def test_a_plain_process_loads_the_full_file(runs):
    """sample.py's load: a process without torch.distributed, torch.load's defaults."""
    folder, _ = runs
    code = f"""
import sys, torch
ck = torch.load({os.path.join(folder, 'full2.pt')!r})
assert "torch.distributed.tensor" not in sys.modules
tensors = [v for v in ck["model"].values()] + [
    v for st in ck["optimizer"]["state"].values() for v in st.values()]
assert all(type(v) is torch.Tensor for v in tensors)
from shardwise.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=16))
model.load_state_dict(ck["model"])
torch.optim.AdamW(model.parameters()).load_state_dict(ck["optimizer"])
print("loaded")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr


def _configs(rank, world, folder):
    """Mixed precision, offloaded state (host memory, disk) and the reproducible mode:
    the full optimizer state dict round-trips exactly, and rank 0's rows are refused."""
    configs = [
        dict(mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16)),
        dict(offload=sw.Offload(optimizer="cpu")),
        dict(offload=sw.Offload(params="disk", optimizer="disk",
                                folder=os.path.join(folder, "disk"))),
        dict(reproducible=True),
    ]
    for kwargs in configs:
        model = sw.shard(_gpt(0), **kwargs)
        opt = _opt(model)
        _steps(model, opt, range(2))
        full = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
        went_on = copy.deepcopy(full)
        other = sw.shard(_gpt(9), **kwargs)
        oopt = _opt(other)
        other.load_state_dict(sw.full_state_dict(model, rank0_only=False))
        oopt.load_state_dict(full)
        _full_optimizer_equal(went_on, sw.full_optimizer_state_dict(other, oopt,
                                                                     rank0_only=False))
        _full_optimizer_equal(went_on, full)  # the caller's dict is left as it was
        _steps(model, opt, range(2, 3))
        _steps(other, oopt, range(2, 3))
        _full_optimizer_equal(sw.full_optimizer_state_dict(model, opt, rank0_only=False),
                              sw.full_optimizer_state_dict(other, oopt, rank0_only=False))
        _same(sw.full_state_dict(model, rank0_only=False),
              sw.full_state_dict(other, rank0_only=False))  # resumed equals went on
        with pytest.raises(sw.ShardwiseError, match="another sharded model"):
            sw.full_optimizer_state_dict(other, opt)  # every rank raises, nothing gathered
        raw = opt.state_dict() if rank == 0 else None
        box = [raw]
        dist.broadcast_object_list(box, src=0)  # rank 0's rows, as a file would bring
        with pytest.raises(sw.ShardwiseError, match="rows of rank 0 of 2"):
            oopt.load_state_dict(box[0])
        del model, opt, other, oopt


def test_mixed_precision_offload_reproducible(tmp_path):
    run_ranks(_configs, 2, str(tmp_path))


def test_a_plain_process_cannot_use_rank_0s_rows(runs):
    """The documented answer for a file of rank 0's rows in a plain process: torch.load
    asks for torch.distributed.tensor, and then the values are rank 0's rows (tagged so),
    which a plain model refuses."""
    folder, _ = runs
    code = f"""
import torch
path = {os.path.join(folder, 'raw2.pt')!r}
try:
    torch.load(path)
    raise SystemExit("loaded without torch.distributed.tensor")
except Exception as e:
    assert "torch.distributed.tensor" in str(e), e
import torch.distributed.tensor
ck = torch.load(path)
assert ck["model"]["tok_emb.weight"]._shardwise_rows == (0, 2)
from shardwise.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=16))
try:
    model.load_state_dict(ck["model"])
    raise SystemExit("a plain model took rank 0's rows")
except RuntimeError as e:
    assert "DTensor" in str(e), e
print("refused")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "refused" in out.stdout, out.stderr


def _hybrid(rank, world):
    """Under hybrid sharding a rank's rows are its shard rank's: rank 0's file is refused
    on the ranks of shard rank 1 (every rank raises), and the full optimizer state dict
    of the (2, 2) mesh loads into a flat model at 4 ranks and gathers back equal."""
    from torch.distributed.device_mesh import init_device_mesh

    model = sw.shard(_gpt(0), mesh=init_device_mesh("cpu", (2, 2)))
    opt = _opt(model)
    _steps(model, opt, range(2))
    box = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # rank 0's rows, as a file would bring them
    with pytest.raises(sw.ShardwiseError, match=r"rank\(s\) \[1, 3\]: .*rows of rank 0 of 2"):
        opt.load_state_dict(box[0])
    full = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
    flat = sw.shard(_gpt(3))
    flat_opt = _opt(flat)
    flat_opt.load_state_dict(full)
    _full_optimizer_equal(full, sw.full_optimizer_state_dict(flat, flat_opt, rank0_only=False))


def test_hybrid_sharding_rows_follow_the_shard_rank():
    run_ranks(_hybrid, 4)


def _ranks_load_different_formats(rank, world):
    """Rank 0 loads the full state dicts (plain tensors), rank 1 its own rows (DTensors):
    both meet the rows check's agreement, and load the same values."""
    model = sw.shard(_gpt(0))
    opt = _opt(model)
    _steps(model, opt, range(2))
    full = (sw.full_state_dict(model, rank0_only=False),
            sw.full_optimizer_state_dict(model, opt, rank0_only=False))
    own = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
    expected = _local_state(model, opt)
    _steps(model, opt, range(2, 4))  # moves away from what is loaded
    sd, opt_sd = full if rank == 0 else own
    model.load_state_dict(sd)
    opt.load_state_dict(opt_sd)
    got = _local_state(model, opt)
    _same(got[0], expected[0])
    _same(got[1], expected[1])
    # A dict that does not fit the optimizer, on one rank: refused on every rank.
    bad = {**opt_sd, "param_groups": opt_sd["param_groups"][:0]} if rank == 1 else opt_sd
    with pytest.raises(sw.ShardwiseError, match=r"rank\(s\) \[1\]: it holds 0 parameters"):
        opt.load_state_dict(bad)
    _steps(model, opt, range(4, 5))  # the ranks are still in step
    return True


def test_ranks_loading_different_formats_meet():
    # Before: rank 1 waited in the agreement that rank 0, whose dict held no DTensor,
    # skipped (a hang), and a dict that did not fit the optimizer on one rank alone left
    # the others waiting the same way.
    assert run_ranks(_ranks_load_different_formats, 2, timeout=90) == [True, True]
