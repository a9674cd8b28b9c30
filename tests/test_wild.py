"""Programs from the wild: nanoGPT's training loop, as its users run it under DDP.

nanoGPT (``train.py``) evaluates on the master process at iteration 0, accumulates gradients
with ``model.require_backward_grad_sync``, and checkpoints by ``torch.save`` of
``model.state_dict()`` and ``optimizer.state_dict()`` on rank 0 alone; a resume loads that
file on every rank. The loop below is that program's skeleton on the reference GPT, run
three ways on the same data at 2 ranks:

- under DDP (the reference);
- under shardwise with the habit unchanged: the resume must be refused on every rank at the
  load, naming the fix, with nothing changed (a rank-0 file holds only rank 0's rows);
- under shardwise changed as docs/migration.md's DDP section says (full state dicts, the
  gathered evaluation): every loss and the final state equal DDP's bit for bit. At two ranks
  shardwise's reduce-scatter and DDP's all-reduce add the same two numbers, so equality is
  exact (tests/test_parity.py).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
ACCUMULATE = 2      # nanoGPT's gradient_accumulation_steps per rank
ITERS = 3           # iterations before the checkpoint, and again after the resume


def _batch(rank: int, it: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + 10 * micro + rank)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # nanoGPT's configure_optimizers: weight decay on 2-D and larger tensors only
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)


def _evaluate(model: torch.nn.Module, rank: int, sharded: bool) -> float | None:
    """nanoGPT's estimate_loss on the master process; under shardwise the documented
    pattern (docs/troubleshooting.md, "Evaluating on one rank")."""
    x, y = _batch(99, 0, 0)
    model.eval()
    loss = None
    with sw.gathered(model) if sharded else contextlib.nullcontext(), torch.no_grad():
        if rank == 0:
            loss = model(x, y).item()
    dist.barrier()
    model.train()
    return loss


def _iterations(model, ddp_or_model, opt, rank: int, start: int, sharded: bool) -> list:
    losses = []
    for it in range(start, start + ITERS):
        if it == 0:
            losses.append(("eval", _evaluate(model, rank, sharded)))
        for micro in range(ACCUMULATE):
            ddp_or_model.require_backward_grad_sync = micro == ACCUMULATE - 1
            loss = ddp_or_model(*_batch(rank, it, micro)) / ACCUMULATE
            loss.backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(ddp_or_model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _state(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    if sharded:
        return sw.full_state_dict(model, rank0_only=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ddp(rank: int, path: str) -> tuple[list, dict]:
    torch.manual_seed(0)
    raw = GPT(CFG)
    model = DDP(raw)
    opt = _optimizer(model)
    losses = _iterations(raw, model, opt, rank, 0, sharded=False)
    if rank == 0:
        torch.save({"model": raw.state_dict(), "optimizer": opt.state_dict(),
                    "iter_num": ITERS}, path)
    dist.barrier()
    ckpt = torch.load(path)
    raw = GPT(CFG)
    raw.load_state_dict(ckpt["model"])
    model = DDP(raw)
    opt = _optimizer(model)
    opt.load_state_dict(ckpt["optimizer"])
    losses += _iterations(raw, model, opt, rank, ckpt["iter_num"], sharded=False)
    return losses, _state(raw, sharded=False)


def _shardwise_as_documented(rank: int, path: str) -> tuple[list, dict]:
    """docs/migration.md, "From DDP": the consolidated state dicts, built on every rank
    and written by rank 0; every rank loads the one file."""
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    opt = _optimizer(model)
    losses = _iterations(model, model, opt, rank, 0, sharded=True)
    checkpoint = {"model": sw.full_state_dict(model),
                  "optimizer": sw.full_optimizer_state_dict(model, opt),
                  "iter_num": ITERS}
    if rank == 0:
        torch.save(checkpoint, path)
    dist.barrier()
    ckpt = torch.load(path)
    raw = GPT(CFG)
    raw.load_state_dict(ckpt["model"])   # nanoGPT loads before wrapping, as under DDP
    model = sw.shard(raw)
    opt = _optimizer(model)
    opt.load_state_dict(ckpt["optimizer"])
    losses += _iterations(model, model, opt, rank, ckpt["iter_num"], sharded=True)
    return losses, _state(model, sharded=True)


def _shardwise_habit_unchanged(rank: int, path: str) -> str:
    """The rank-0 file of sharded state dicts, loaded on every rank after sharding: refused
    on every rank, naming the fix, with the model and the optimizer unchanged."""
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG))
    opt = _optimizer(model)
    _iterations(model, model, opt, rank, 0, sharded=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    dist.barrier()
    before = sw.full_state_dict(model, rank0_only=False)
    opt_before = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
    ckpt = torch.load(path, weights_only=False)
    messages = []
    for what, load in (("model", lambda: model.load_state_dict(ckpt["model"])),
                       ("optimizer", lambda: opt.load_state_dict(ckpt["optimizer"]))):
        with pytest.raises(sw.ShardwiseError) as e:
            load()
        message = str(e.value)
        assert what in message and "full_state_dict" in message, message
        messages.append(message)
    after = sw.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(before[k], after[k]) for k in before)
    opt_after = sw.full_optimizer_state_dict(model, opt, rank0_only=False)
    for i, state in opt_before["state"].items():
        for k, v in state.items():
            assert torch.equal(v, opt_after["state"][i][k]), (i, k)
    return "\n".join(messages)


def _nanogpt(rank: int, world: int, folder: str) -> tuple:
    ddp = _ddp(rank, os.path.join(folder, "ddp.pt"))
    documented = _shardwise_as_documented(rank, os.path.join(folder, "shardwise.pt"))
    refused = _shardwise_habit_unchanged(rank, os.path.join(folder, "habit.pt"))
    return ddp, documented, refused


@pytest.mark.slow
def test_nanogpt_checkpoint_resume_and_step_zero_evaluation(tmp_path):
    results = run_ranks(_nanogpt, 2, str(tmp_path))
    for rank, ((ddp_losses, ddp_state), (losses, state), refused) in enumerate(results):
        assert len(losses) == len(ddp_losses) == 2 * ITERS * ACCUMULATE + 1
        assert losses == ddp_losses, (rank, losses, ddp_losses)
        assert list(state) == list(ddp_state)
        for k, v in ddp_state.items():
            assert torch.equal(state[k], v), f"rank {rank}: {k} differs from DDP's resumed run"
        assert "optimizer" in refused and "model" in refused
    assert results[0][1][0][0][1] is not None  # rank 0 evaluated at iteration 0
