"""Everyday PyTorch habits on a sharded model (issue 20), each against a reference.

Each of these crashed a rank, raised an unrelated error or returned wrong values before:
``copy.deepcopy(model)`` (EMA, DPO reference models), moves and casts that change nothing
(``model.to("cpu")``, ``.float()``), ``torch.save(model.state_dict())`` and
``model.load_state_dict`` of a full state dict.
"""

import copy
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_ranks
from loops import train_steps
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import shardwise as sw
from shardwise.models import GPT, GPTConfig, SmallCNN

CFG = GPTConfig(vocab_size=40, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _batch(rank: int, step: int):
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len),
                      generator=torch.Generator().manual_seed(100 * rank + step))
    return x, torch.roll(x, -1, dims=1)


def _step(model, opt, batch) -> float:
    return train_steps(model, opt, [batch])[0]


def _max_diff(ours, ref_sd) -> float:
    sd = sw.full_state_dict(ours, rank0_only=False)
    assert list(sd) == list(ref_sd)
    return max((sd[k].double() - v.double()).abs().max().item() for k, v in ref_sd.items())


# -- 1. copies ------------------------------------------------------------------------
def _copies(rank, world):
    torch.manual_seed(rank)  # different weights per rank: rank 0's win under both
    base = GPT(CFG)
    ddp, ours = DDP(copy.deepcopy(base)), sw.shard(copy.deepcopy(base))
    ema_ref = AveragedModel(ddp.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    calls = sum(sw.inspect(ours).comm.calls.values())
    ema = AveragedModel(ours, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # a deep copy
    assert sum(sw.inspect(ours).comm.calls.values()) == calls  # each rank copies rows
    assert sw.is_sharded(ema.module)
    with sw.gathered(ours):  # the copy has units of its own: gathering ours leaves them
        assert all(u.state == "gathered" for u in sw.inspect(ours).units)
        assert all(u.state == "sharded" for u in sw.inspect(ema.module).units)
    w, w_ema = ours.tok_emb.weight, ema.module.tok_emb.weight
    assert isinstance(w_ema, DTensor) and w_ema.to_local().data_ptr() != w.to_local().data_ptr()

    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, ours)]
    out = {"loss": []}
    for step in range(4):
        for m, opt, avg, inner in ((ddp, opts[0], ema_ref, ddp.module),
                                   (ours, opts[1], ema, ours)):
            _step(m, opt, _batch(rank, step))
            avg.update_parameters(inner)
    out["ema"] = _max_diff(ema.module, ema_ref.module.state_dict())
    with torch.no_grad():
        out["ema_forward"] = (ema(*_batch(rank, 9)) - ema_ref(*_batch(rank, 9))).abs().item()
    out["model"] = _max_diff(ours, ddp.module.state_dict())  # the original is untouched

    # A copy of a trained model trains on its own, and the original goes on training:
    # each against its DDP twin (the copy's hooks drive the copy's units).
    twin, ddp_twin = copy.deepcopy(ours), DDP(copy.deepcopy(ddp.module))
    twin_opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp_twin, twin)]
    for step in range(2):
        _step(ddp, opts[0], _batch(rank, 10 + step))
        _step(ours, opts[1], _batch(rank, 10 + step))
        _step(ddp_twin, twin_opts[0], _batch(rank, 20 + step))
        _step(twin, twin_opts[1], _batch(rank, 20 + step))
    out["twin"] = _max_diff(twin, ddp_twin.module.state_dict())
    out["after_copy"] = _max_diff(ours, ddp.module.state_dict())

    # What cannot be copied or pickled says what to call instead.
    with pytest.raises(sw.ShardwiseError, match=r"save_checkpoint.*full_state_dict"):
        torch.save(ours, io.BytesIO())
    with pytest.raises(sw.ShardwiseError, match=r"save_checkpoint.*full_state_dict"):
        torch.save(ours.blocks[0], io.BytesIO())
    with pytest.raises(sw.ShardwiseError, match=r"only the whole model can be copied"):
        copy.deepcopy(ours.blocks[0])
    _step(ours, opts[1], _batch(rank, 30))  # and the model still trains
    return out


def test_deepcopy_is_an_independent_sharded_model_and_ema_matches_ddp():
    for out in run_ranks(_copies, 2):  # before: SIGSEGV in the deep copy
        # Measured 0.0: the EMA's lerp is elementwise, on the same aligned rows.
        assert out["ema"] == 0.0 and out["ema_forward"] == 0.0
        assert out["model"] == 0.0
        assert out["twin"] == 0.0 and out["after_copy"] == 0.0


# -- 2. moves and casts ---------------------------------------------------------------
def _cnn_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)


def _cnn_step(model, opt, batch, between=None) -> None:
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    if between is not None:
        between(model)  # with gradients in the shards
    opt.step()
    opt.zero_grad()


def _no_op_moves(model) -> None:
    for move in (lambda: model.to("cpu"), model.cpu, model.float,
                 lambda: model.to(torch.float32), lambda: model.to(torch.device("cpu")),
                 lambda: model.to("cpu", torch.float32, non_blocking=True)):
        assert move() is model
    assert model.blocks[0].float() is model.blocks[0]


def _moves_and_casts(rank, world):
    torch.manual_seed(rank)
    base = SmallCNN()
    ddp, ours = DDP(copy.deepcopy(base)), sw.shard(copy.deepcopy(base))
    _no_op_moves(ours)  # before any step, as Lightning does
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, ours)]
    for step in range(2):
        _cnn_step(ddp, opts[0], _cnn_batch(rank, step))
        _cnn_step(ours, opts[1], _cnn_batch(rank, step), between=_no_op_moves)
    _no_op_moves(ours)
    sd = sw.full_state_dict(ours, rank0_only=False)
    assert all(type(v) is torch.Tensor for v in sd.values())
    exact = {"no-op": _max_diff(ours, ddp.module.state_dict())}

    before = sw.full_state_dict(ours, rank0_only=False)
    real = (lambda: ours.to("meta"), lambda: ours.to_empty(device="cpu"),
            lambda: ours.to(memory_format=torch.channels_last))
    for move in real:
        with pytest.raises(sw.ShardwiseError, match="cannot be moved after sw.shard"):
            move()
    after = sw.full_state_dict(ours, rank0_only=False)
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())
    _cnn_step(ddp, opts[0], _cnn_batch(rank, 5))
    _cnn_step(ours, opts[1], _cnn_batch(rank, 5))
    exact["after_refused"] = _max_diff(ours, ddp.module.state_dict())
    return exact


def test_moves_and_casts_that_change_nothing_are_no_ops_and_real_moves_raise_first():
    # Rank 0's: DDP's other ranks keep their own BatchNorm statistics until the next
    # forward's broadcast, where shardwise makes them rank 0's at once.
    exact = run_ranks(_moves_and_casts, 2)[0]  # before: "parameters were added"
    assert exact == {"no-op": 0.0, "after_refused": 0.0}


def _casts(rank, world):
    """Issue 41 item 7: ``model.to(torch.float64)`` after sw.shard raised ("cannot be cast
    or moved"), where FSDP2 casts the shards. Now the shards are cast in shardwise's
    storage and keep their identity: an optimizer built before the cast steps them, and
    training equals DDP's on the model cast before wrapping."""
    torch.manual_seed(0)
    base = SmallCNN()
    ddp, ours = DDP(copy.deepcopy(base).double()), sw.shard(copy.deepcopy(base))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ddp, ours)]  # before
    shards = list(ours.parameters())
    ours.eval()
    with torch.no_grad():
        ours(_cnn_batch(rank, 0)[0])  # a forward without backward may leave a unit gathered
    ours.train()
    assert ours.to(torch.float64) is ours
    assert list(ours.parameters()) == shards
    assert all(p.dtype == torch.float64 and p.to_local().dtype == torch.float64
               for p in ours.parameters())
    assert all(b.dtype == torch.float64 for b in ours.buffers() if b.is_floating_point())
    for step in range(3):
        x, y = _cnn_batch(rank, step)
        _cnn_step(ddp, opts[0], (x.double(), y))
        _cnn_step(ours, opts[1], (x.double(), y))
    sd = sw.full_state_dict(ours, rank0_only=False)
    assert all(v.dtype == ddp.module.state_dict()[k].dtype for k, v in sd.items())
    diff = _max_diff(ours, ddp.module.state_dict())

    # What cannot be cast is refused, with nothing changed.
    gpt = sw.shard(GPT(CFG))
    with pytest.raises(sw.ShardwiseError, match=r"blocks\.0\.qkv\.weight would be cast "
                                                r"without .*cast the whole unit"):
        gpt.blocks[0].qkv.half()
    with sw.gathered(gpt):
        with pytest.raises(sw.ShardwiseError, match="open sw.gathered"):
            gpt.double()
    assert all(p.dtype == torch.float32 for p in gpt.parameters())
    gpt.blocks[0].half()  # a whole unit casts
    assert {p.dtype for p in gpt.blocks[0].parameters()} == {torch.float16}
    return diff


@pytest.mark.parametrize("world", [2, 3])
def test_casts_after_shard_are_applied_to_the_shards_and_train_as_ddp(world):
    # Rank 0's, as above (BatchNorm statistics). At 3 ranks the reduce-scatter adds
    # three ranks' gradients in another order than DDP's all-reduce: float64 rounding,
    # amplified a little by AdamW's division, far below 1e-12.
    diff = run_ranks(_casts, world)[0]
    assert diff == 0.0 if world == 2 else diff < 1e-12, diff


def _full_state_dict_rows(rank, world):
    model = sw.shard(GPT(CFG))
    lin = model.blocks[0].fc  # a shard replaced by a DTensor of its own: what .cpu() did
    w = lin.weight
    lin._parameters["weight"] = nn.Parameter(DTensor.from_local(
        w.to_local().clone(), w.device_mesh, w.placements, shape=w.shape, stride=w.stride()))
    with pytest.raises(sw.ShardwiseError, match=r"this rank's rows .*blocks\.0\.fc\.weight"):
        sw.full_state_dict(model)
    lin._parameters["weight"] = w
    assert sw.full_state_dict(model, rank0_only=False)["blocks.0.fc.weight"].shape == w.shape


def test_full_state_dict_never_returns_a_dtensor():
    run_ranks(_full_state_dict_rows, 2)  # before: returned rank r's rows as a DTensor


# -- 3. checkpoint habits -------------------------------------------------------------
def _save_per_rank(rank, world, folder):
    torch.manual_seed(0)
    model = sw.shard(SmallCNN())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _cnn_step(model, opt, _cnn_batch(rank, 0))
    sd = model.state_dict()
    assert all(isinstance(sd[k], DTensor) for k, _ in model.named_parameters())
    torch.save(sd, os.path.join(folder, f"rank{rank}.pt"))
    snapshot = copy.deepcopy(sd)  # the "best model so far" habit
    _cnn_step(model, opt, _cnn_batch(rank, 1))
    model.load_state_dict(snapshot)
    return sw.full_state_dict(model, rank0_only=False)


def _load_per_rank(rank, world, folder):
    torch.manual_seed(1 + rank)  # other weights everywhere: the files must win
    model = sw.shard(SmallCNN())
    sd = torch.load(os.path.join(folder, f"rank{rank % 2}.pt"))  # weights_only by default
    if world != 2:
        with pytest.raises(sw.ShardwiseError, match=r"saved at.*sw\.load_checkpoint"):
            model.load_state_dict(sd)
        return None
    model.load_state_dict(sd)
    return sw.full_state_dict(model, rank0_only=False)


def test_torch_save_of_state_dict_per_rank_loads_back_at_the_same_world_size(tmp_path):
    saved = run_ranks(_save_per_rank, 2, str(tmp_path))[0]  # before: invalid python storage
    loaded = run_ranks(_load_per_rank, 2, str(tmp_path))[0]
    assert list(loaded) == list(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    run_ranks(_load_per_rank, 3, str(tmp_path))  # another world size: a clear error


def _load_full(rank, world):
    torch.manual_seed(0)
    ref = SmallCNN()
    F.cross_entropy(ref(_cnn_batch(0, 0)[0]), _cnn_batch(0, 0)[1]).backward()  # BN stats
    full = {k: v.clone() for k, v in ref.state_dict().items()}
    mine = {k: v + rank if "running" in k else v for k, v in full.items()}  # rank r's stats
    torch.manual_seed(1 + rank)
    model = sw.shard(SmallCNN())
    assert not model.load_state_dict(mine).missing_keys
    got = sw.full_state_dict(model, rank0_only=False)
    assert list(got) == list(full)
    for k, v in full.items():  # rows from each rank's dict, buffers rank 0's on every rank
        assert torch.equal(got[k], v), k

    # strict semantics: missing and unexpected keys reported, the rest loaded
    del mine["head.weight"]
    mine["extra"] = torch.zeros(1)
    keys = r'(?s)Missing key.*"head\.weight".*Unexpected.*"extra"'
    with pytest.raises(RuntimeError, match=keys) as e:
        model.load_state_dict(mine)
    assert "While copying" not in str(e.value)  # no error but the keys
    with torch.no_grad():
        model.blocks[0].conv.weight.zero_()
    keys = model.load_state_dict(mine, strict=False)
    assert keys.missing_keys == ["head.weight"] and keys.unexpected_keys == ["extra"]
    assert torch.equal(sw.full_state_dict(model, rank0_only=False)["blocks.0.conv.weight"],
                       full["blocks.0.conv.weight"])
    bad = dict(full, **{"head.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match=r"size mismatch for head\.weight"):
        model.load_state_dict(bad)
    with pytest.raises(sw.ShardwiseError, match=r"assign=True.*without assign"):
        model.load_state_dict(full, assign=True)
    model.load_state_dict(full)  # still usable
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _cnn_step(model, opt, _cnn_batch(rank, 1))


def test_load_state_dict_takes_a_full_plain_state_dict():
    run_ranks(_load_full, 2)  # before: "got mixed torch.Tensor and DTensor"


class Wrapped(nn.Module):
    """A wrapper owning no parameter whose forward calls its one child (PEFT's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = GPT(CFG)

    def forward(self, x, y):
        return self.net(x, y)


def _inner_model_called_directly(rank, world):
    # Note [forward entries]: the inner model, called outside the wrapper's forward, runs
    # as the root (PeftModel.generate calls it so). Before: "aten.embedding.default got
    # mixed torch.Tensor and DTensor" at its first op.
    ref = DDP(Wrapped())
    ours = sw.shard(Wrapped())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    for step in range(4):
        x, y = _batch(rank, step)
        # Ours alternates the inner model and the wrapper: the same training either way.
        for m, opt in zip((ref, ours.net if step % 2 else ours), opts):
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
    assert _max_diff(ours, ref.module.state_dict()) == 0.0  # bit-identical at 2 ranks
    with pytest.raises(IndexError):  # a forward that fails inside the inner model
        ours.net(torch.zeros(2, CFG.seq_len + 1, dtype=torch.long))
    with torch.no_grad():  # leaves nothing behind: the next call is a root forward again
        assert torch.equal(ours.net(*_batch(rank, 9)), ref.module.net(*_batch(rank, 9)))
    return True


def test_a_wrapped_models_inner_model_called_directly_trains_like_ddp():
    assert run_ranks(_inner_model_called_directly, 2) == [True, True]
