"""The optimizer step over plain local tensors (Note [plain step] in
engine/entry_points/plain_step.py): no DTensor dispatch in the step of an elementwise torch
optimizer, the same bits as the DTensor path, and everything that reads the optimizer sees what it
saw before."""

from __future__ import annotations

import torch
from harness import run_ranks
from parity import GPT_CFG, gpt_batches
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import shardwise as sw
from shardwise.models import GPT


class DTensorOps(TorchDispatchMode):
    """Counts the ops that reach dispatch with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs or {}))):
            self.count += 1
        return func(*args, **(kwargs or {}))


class RowNormalized(torch.optim.Optimizer):
    """Not elementwise: scales each gradient by its whole tensor's norm (the kind of
    step, like Muon's or Adafactor's, that must see whole matrices)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-6), alpha=-group["lr"])


OPTIMIZERS = {
    "AdamW amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "SGD nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "Adam fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "not elementwise": lambda ps: RowNormalized(ps),
}


def _model():
    torch.manual_seed(0)
    return sw.shard(GPT(GPT_CFG))


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local().clone()
        for k, v in opt.state[p].items():
            out[f"{name}/{k}"] = (v.to_local() if isinstance(v, DTensor) else v).clone()
    return out


def _train(make, rank, plain: bool, steps: int = 3):
    """``steps`` steps; ``plain=False`` passes a closure, which keeps the DTensor path.
    Returns the state and how many DTensor ops the steps ran."""
    model = _model()
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ops = DTensorOps()
    for step, (x, y) in enumerate(gpt_batches(rank, steps)):
        model(x, y).backward()
        if step == 1:
            opt.param_groups[0]["lr"] *= 3  # an edit between steps is taken up
        with ops:
            opt.step() if plain else opt.step(lambda: None)
        opt.zero_grad()
        sched.step()
    return _snapshot(model, opt), ops.count, model, opt


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k}"


def _checks(rank, world):
    for name, make in OPTIMIZERS.items():
        plain, plain_ops, model, opt = _train(make, rank, plain=True)
        ref, ref_ops, _, _ = _train(make, rank, plain=False)
        _same(plain, ref, name)  # the same kernels on the same local tensors
        assert ref_ops > 0, name
        if name == "not elementwise":
            assert plain_ops > 0  # left on the DTensor path, which sees whole matrices
            continue
        assert plain_ops == 0, (name, plain_ops)
        # What the optimizer shows outside the step is as before: the parameters in
        # its groups, DTensor state under them.
        held = [p for g in opt.param_groups for p in g["params"]]
        assert held == list(model.parameters())
        assert all(isinstance(v, DTensor) for p in held for v in opt.state[p].values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    # A state dict round trip, then more steps: the same as going on unbroken.
    make = OPTIMIZERS["AdamW amsgrad"]
    _, _, model, opt = _train(make, rank, plain=True)
    copy = make(model.parameters())
    copy.load_state_dict(opt.state_dict())
    _same(_snapshot(model, copy), _snapshot(model, opt), "state dict round trip")
    # A step that raises leaves its swap behind; the next reader undoes it.
    model(*next(gpt_batches(rank, 1))).backward()
    opt.param_groups[0]["betas"] = None
    try:
        opt.step()
    except TypeError:
        pass
    else:
        raise AssertionError("a step with betas=None should raise")
    opt.state_dict()
    assert opt.param_groups[0]["params"][0] is next(model.parameters())
    return True


def test_plain_step_is_exact_and_invisible():
    assert run_ranks(_checks, 2) == [True, True]
