"""The reproducible mode (``sw.shard(model, reproducible=True)``, Note [reproducible
reduction] in exact/reduce.py): the same global batch, split into M=12 micro-batches,
gives bit-identical losses, parameters, buffers and optimizer state at N = 1, 2, 3, 4 and
6 ranks, and after a resume at another N. The GPT clips its gradients by their global
norm (``sw.clip_grad_norm_``) every step; the CNN averages its BatchNorm buffers across
ranks (``buffers="average"``); odd N use AdamW's per-tensor step, even N its foreach step.
The same runs in the default mode differ across N (by about 1e-7): the test shows that
there was something to fix.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
import torch.nn as nn
from elastic_script import digest as _digest  # parameters, buffers, optimizer state
from harness import run_ranks
from parity import GPT_CFG

import shardwise as sw
from shardwise.models import GPT, SmallCNN

M = 12        # micro-batches per global batch: divisible by 1, 2, 3, 4 and 6
STEPS = 10


def _global_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 7)
    if name == "gpt":
        x = torch.randint(0, GPT_CFG.vocab_size, (2 * M, GPT_CFG.seq_len + 1), generator=g)
        return x[:, :-1], x[:, 1:]
    return torch.randn(4 * M, 3, 16, 16, generator=g), torch.randint(0, 10, (4 * M,),
                                                                       generator=g)


def _loss(name: str, model, x, y):
    if name == "gpt":
        return model(x, y)
    return torch.nn.functional.cross_entropy(model(x), y)


def _build(name: str, reproducible: bool):
    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG) if name == "gpt" else SmallCNN(),
                     reproducible=reproducible,
                     buffers="broadcast" if name == "gpt" else "average")
    foreach = torch.distributed.get_world_size() % 2 == 0
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                     foreach=foreach)


def _train(name: str, model, opt, steps: range, reproducible: bool) -> list[float]:
    losses = []
    for step in steps:
        mine = sw.micro_batches(_global_batch(name, step), M)
        per_micro_batch = []
        for i, (x, y) in enumerate(mine):
            last = i == len(mine) - 1
            with contextlib.nullcontext() if last else sw.no_sync(model):
                loss = _loss(name, model, x, y)
                # The default mode averages over ranks, so each rank scales its share;
                # the reproducible mode averages over all micro-batches itself.
                (loss if reproducible else loss / len(mine)).backward()
            per_micro_batch.append(loss)
        if name == "gpt":
            sw.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(sw.global_mean(per_micro_batch))
    return losses


def _run(rank, world, name, reproducible, root):
    model, opt = _build(name, reproducible)
    if root is None:
        losses = _train(name, model, opt, range(STEPS), reproducible)
        return losses, _digest(model, opt)
    # Saved at this N after 5 steps; resumed at N=4 by the caller.
    path = os.path.join(root, name)
    if world == 2:
        losses = _train(name, model, opt, range(5), reproducible)
        sw.save_checkpoint(path, model, opt)
        return losses, None
    sw.load_checkpoint(path, model, opt)
    losses = _train(name, model, opt, range(5, STEPS), reproducible)
    return losses, _digest(model, opt)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_bit_identical_at_any_world_size_and_after_a_resume(name, tmp_path):
    runs = {n: run_ranks(_run, n, name, True, None, timeout=300)[0] for n in (1, 2, 3, 4, 6)}
    saved = run_ranks(_run, 2, name, True, str(tmp_path), timeout=300)[0]
    resumed = run_ranks(_run, 4, name, True, str(tmp_path), timeout=300)[0]
    default = {n: run_ranks(_run, n, name, False, None, timeout=300)[0] for n in (1, 2, 3)}

    losses, digest = runs[1]
    for n, (other_losses, other_digest) in runs.items():
        assert other_losses == losses, f"N={n}: losses differ from N=1"
        assert other_digest == digest, f"N={n}: final state differs from N=1"
    assert saved[0] + resumed[0] == losses and resumed[1] == digest, \
        "saved at N=2 after 5 steps, resumed at N=4: differs from the N=1 run"
    # What the mode fixes: DDP-style averaging in fp32 lands elsewhere at each N.
    spread = max(abs(a - b) / abs(b) for n in (2, 3)
                 for a, b in zip(default[n][0], default[1][0]))
    differs = [n for n in (2, 3) if default[n][1] != default[1][1]]
    print(f"{name}: reproducible mode bit-identical at N=1,2,3,4,6 and after a resume "
          f"2 -> 4; default mode: final state differs from N=1 at N={differs}, losses by "
          f"up to {spread:.1e} (relative)")
    assert differs, "the default mode happened to match: the test would show nothing"


def _errors(rank, world):
    model, _ = _build("gpt", True)
    with pytest.raises(sw.ShardwiseError, match=r"do not split over 4 ranks.*\[1, 2, 3, 6\]"):
        sw.micro_batches(torch.zeros(12, 2), 6)
    with pytest.raises(sw.ShardwiseError, match=r"batch\[1\] has 10 rows"):
        sw.micro_batches((torch.zeros(8, 2), torch.zeros(10)), 4)
    with pytest.raises(sw.ShardwiseError, match="expected True or False"):
        sw.shard(GPT(GPT_CFG), reproducible="yes")
    with pytest.raises(sw.ShardwiseError, match="reduce_dtype"):
        sw.shard(GPT(GPT_CFG), reproducible=True,
                 mixed_precision=sw.MixedPrecision(reduce_dtype=torch.bfloat16))
    parts = sw.micro_batches({"x": torch.arange(8), "y": [torch.arange(8)]}, 4)
    assert [p["x"].tolist() for p in parts] == [[2 * rank, 2 * rank + 1]]
    # A rank that summed one micro-batch more than the others is named at the reduction
    # (in a training loop the order check sees its extra forward first).
    from shardwise.comm.collectives import Comm
    from shardwise.exact.partial import accumulate, exchange

    acc = accumulate(None, torch.ones(8))
    if rank == 0:
        acc = accumulate(acc, torch.ones(8))
    with pytest.raises(sw.ShardwiseError, match="different numbers of micro-batches"):
        exchange(Comm(None), acc, "a test buffer").result()
    # The reduction itself: every rank's rows of the mean, exactly.
    total = exchange(Comm(None), accumulate(None, torch.arange(8.0) * (rank + 1)), "x").result()
    assert torch.equal(total, torch.arange(2.0 * rank, 2.0 * rank + 2) * 2.5)


def test_errors_of_the_reproducible_mode():
    run_ranks(_errors, 4, timeout=120)


class _Skipping(torch.nn.Module):
    """Three linear blocks; ``skip`` leaves one out (a data-dependent path)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, skip=None):
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x.pow(2).mean()


def _misuse(rank, world, root):
    import copy

    model, opt = _build("gpt", True)
    x = torch.randint(0, GPT_CFG.vocab_size, (2, GPT_CFG.seq_len))
    # A synced backward per micro-batch (no_sync forgotten) would add partial means.
    model(x, x).backward()
    with pytest.raises(sw.ShardwiseError, match="second synced backward"):
        model(x, x).backward()
    opt.zero_grad()
    # Copies and checkpoints between the micro-batches of a step are refused.
    with sw.no_sync(model):
        model(x, x).backward()
    with pytest.raises(sw.ShardwiseError, match="between the micro-batches"):
        copy.deepcopy(model)
    with pytest.raises(sw.ShardwiseError, match="between the micro-batches"):
        sw.save_checkpoint(os.path.join(root, "mid"), model, opt)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    copy.deepcopy(model)
    sw.save_checkpoint(os.path.join(root, "after"), model, opt)
    if world != 1:
        return
    # The gradient is the mean over every micro-batch, also for a unit that one of them
    # skipped (it counts as a zero term), as for the plain model.
    torch.manual_seed(0)
    plain = _Skipping()
    skipping = sw.shard(copy.deepcopy(plain), reproducible=True)
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for i, xb in enumerate(inputs):
        (plain(xb, skip=1 if i == 1 else None) / 4).backward()
        with contextlib.nullcontext() if i == 3 else sw.no_sync(skipping):
            skipping(xb, skip=1 if i == 1 else None).backward()
    # The exact sum and the plain model's fp32 sum of four terms differ by a rounding or
    # two (about 1e-7 relative, on any x86 CPU); a wrong count (sum/3) is off by a third.
    for (name, p), q in zip(plain.named_parameters(), skipping.parameters()):
        assert torch.allclose(q.grad.full_tensor(), p.grad, rtol=1e-5, atol=1e-8), name


def test_misuse_of_the_reproducible_mode_is_refused(tmp_path):
    run_ranks(_misuse, 1, str(tmp_path), timeout=120)
    run_ranks(_misuse, 2, str(tmp_path), timeout=120)


class _Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        for b in self.blocks:
            x = self.drop(b(x))
        return x.sum()


def _traps(rank, world):
    """Issue 30 item 8: the documented traps of the reproducible mode, said at run time."""
    torch.manual_seed(0)
    model = sw.shard(_Dropped(), reproducible=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(2, 4)
    with pytest.warns(UserWarning, match=r"dropout in training mode \(drop\)"):
        model(x).backward()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model: no second warning
        model(x).backward()
    opt.zero_grad()
    model.drop.p = 0.0
    model(x).backward()
    sw.clip_grad_norm_(model, 1.0)  # exact: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    opt.zero_grad()
    model(x).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # depends on the world size
    with pytest.warns(UserWarning, match=r"not by sw.clip_grad_norm_"):
        opt.step()


def test_the_reproducible_modes_traps_are_said_at_run_time():
    run_ranks(_traps, 2)


def _run_micro(rank, world, m):
    """Four steps of the GPT with ``m`` micro-batches a step (the reproducible mode)."""
    global M
    M = m  # _train splits each global batch into M micro-batches
    model, opt = _build("gpt", True)
    losses = _train("gpt", model, opt, range(4), True)
    return losses, _digest(model, opt)


def test_one_micro_batch_per_rank_gives_the_one_rank_bits():
    # Note [float64 partials]: with one micro-batch per rank the fp32 gradient itself goes
    # on the wire and the receiver sums the ranks' terms; one rank holding all three sums
    # them into a float64 partial first. Same bits.
    one = run_ranks(_run_micro, 1, 3, timeout=300)[0]
    three = run_ranks(_run_micro, 3, 3, timeout=300)[0]
    assert three[0] == one[0], "losses differ from one rank's"
    assert three[1] == one[1], "final state differs from one rank's"


class _Branches(nn.Module):
    """A linear layer and a scale ``b``; ``use_b`` leaves ``b`` out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Parameter(torch.ones(4))

    def forward(self, x, use_b):
        y = self.a(x).sum()
        return y + (self.b * x[0]).sum() if use_b else y


def _signed_zero(rank, world, order):
    torch.manual_seed(0)
    model = sw.shard(_Branches(), reproducible=True)
    # Micro-batch "zero": the input is -0.0, so b's gradient is -0.0 everywhere;
    # micro-batch "skip": b is not used (an absent gradient, a zero term).
    steps = {"zero": (torch.full((2, 4), -0.0), True), "skip": (torch.ones(2, 4), False)}
    mine = [steps[name] for name in order][rank::world]
    for i, (x, use_b) in enumerate(mine):
        with contextlib.nullcontext() if i == len(mine) - 1 else sw.no_sync(model):
            model(x, use_b).backward()
    grad = model.b.grad.full_tensor()
    return torch.signbit(grad).tolist()


def test_an_absent_gradient_is_the_same_zero_in_any_order():
    # Note [float64 partials]: before, a first micro-batch without a gradient wrote +0.0
    # and a later one added nothing, so -0.0 and "absent" summed to -0.0 in one order and
    # +0.0 in the other (and at two ranks). An absent gradient now is -0.0 throughout.
    one = run_ranks(_signed_zero, 1, ("zero", "skip"))[0]
    other = run_ranks(_signed_zero, 1, ("skip", "zero"))[0]
    two = run_ranks(_signed_zero, 2, ("zero", "skip"))[0]
    assert one == other == two
    assert all(one), "b's gradient: a sum of -0.0 terms is -0.0"


class _Returns(nn.Module):
    """Two tanh blocks and a mean-squared loss, returned as ``kind`` says: the loss alone
    (as GPT does), a dict with ``"loss"`` (a Hugging Face ``ModelOutput`` is an
    ``OrderedDict``), or ``(outputs, loss)`` (nanoGPT's order)."""

    def __init__(self, kind: str, checkpointed: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x, y):
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = (checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)).tanh()
        loss = torch.nn.functional.mse_loss(x, y)
        if self.kind == "dict":
            return {"logits": x, "loss": loss}
        return (x, loss) if self.kind == "tuple" else loss


def _steps(model, opt, m: int, steps: int, weight) -> list[float]:
    """``steps`` steps of ``m`` micro-batches, each loss backpropagated as
    ``weight(loss, mine)``; returns the final parameters' bits (as lists)."""
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        mine = sw.micro_batches((torch.randn(2 * m, 4, generator=g),
                                 torch.randn(2 * m, 4, generator=g)), m)
        for i, (x, y) in enumerate(mine):
            with contextlib.nullcontext() if i == len(mine) - 1 else sw.no_sync(model):
                out = model(x, y)
                loss = out["loss"] if isinstance(out, dict) else (
                    out[1] if isinstance(out, tuple) else out)
                weight(loss, mine).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().tolist() for p in model.parameters()]


def _divided(rank, world):
    """Issue 50 item 8: a loss divided by the rank's micro-batch count (``len(mine)``, M/N)
    is refused on every rank before anything changes, for every way a model returns its
    loss and under mixed precision; the model trains on afterwards."""
    for kind, mp in [("loss", None), ("dict", None), ("tuple", None),
                     ("loss", sw.MixedPrecision(param_dtype=torch.bfloat16))]:
        torch.manual_seed(0)
        model = sw.shard(_Returns(kind), reproducible=True, mixed_precision=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = [p.full_tensor().clone() for p in model.parameters()]
        with pytest.raises(sw.ShardwiseError,
                           match=r"scaled by 0\.5 = 1/2.*2 micro-batches.*undivided"):
            _steps(model, opt, 4, 1, lambda loss, mine: loss / len(mine))
        assert all(p.grad is None for p in model.parameters()), kind
        opt.step()  # no gradient was handed out: nothing changes
        after = [p.full_tensor() for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), kind
        _steps(model, opt, 4, 1, lambda loss, mine: loss)  # the documented loop goes on
    # One rank alone dividing: every rank raises, the other naming it.
    torch.manual_seed(0)
    model = sw.shard(_Returns("loss"), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(sw.ShardwiseError, match="on another rank" if rank else "1/2"):
        _steps(model, opt, 4, 1, lambda loss, mine: loss / len(mine) if rank == 0 else loss)
    # The GPT (its loss returned alone), as the issue wrote it.
    model, opt = _build("gpt", True)
    mine = sw.micro_batches(_global_batch("gpt", 0), 4)
    with pytest.raises(sw.ShardwiseError, match=r"1/2"):
        for i, (x, y) in enumerate(mine):
            with contextlib.nullcontext() if i == len(mine) - 1 else sw.no_sync(model):
                (model(x, y) / len(mine)).backward()


def test_a_loss_divided_by_the_micro_batches_per_rank_is_refused():
    run_ranks(_divided, 2, timeout=180)


def _weighted(rank, world, kind):
    """A constant loss weight that does not depend on the world size is legitimate: 0.3
    (never 1/K) gives the same bits at every N, under activation checkpointing too."""
    torch.manual_seed(0)
    model = sw.shard(_Returns(kind, checkpointed=kind == "tuple"), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bits = _steps(model, opt, 6, 2, lambda loss, mine: 0.3 * loss)
    if world == 3:
        # Note [a divided loss]: a weight of exactly 1/K (here 2 micro-batches per rank)
        # cannot be told from a division by len(mine); refused at such world sizes.
        with pytest.raises(sw.ShardwiseError, match=r"0\.5 = 1/2"):
            _steps(model, opt, 6, 1, lambda loss, mine: 0.5 * loss)
    return bits


@pytest.mark.parametrize("kind", ["loss", "tuple"])
def test_a_constant_loss_weight_gives_the_same_bits_at_any_world_size(kind):
    one = run_ranks(_weighted, 1, kind, timeout=180)[0]
    for n in (2, 3):
        assert run_ranks(_weighted, n, kind, timeout=180)[0] == one, f"N={n} differs from N=1"


def _kernel_records(rank, world):
    from shardwise.comm.collectives import Comm
    from shardwise.engine.iteration.running_stats import RunningStats

    g = torch.Generator().manual_seed(3)
    bn = nn.BatchNorm2d(4, momentum=0.3)
    bn.running_mean.uniform_(-1, 1, generator=g)  # a start other than 0 and 1
    bn.running_var.uniform_(0.5, 2, generator=g)
    plain = copy.deepcopy(bn)
    stats = RunningStats(bn, Comm(None))
    xs = [torch.randn(8, 4, 5, 5, generator=g) * 3 + 1 for _ in range(2)]
    dims = [0, 2, 3]
    # Float32 rounding: the restore and the replay compute BatchNorm's update in another
    # order than the kernel (which accumulates in float64). Measured over 200 seeds of
    # this setup: at most 9.5e-7 (2 ulp of a variance near 4), within 1e-6 + 1e-6 * |v|.
    close = {"rtol": 1e-6, "atol": 1e-6}

    bn(xs[0])
    plain(xs[0])
    torch.testing.assert_close(bn.running_mean, plain.running_mean, **close)
    torch.testing.assert_close(bn.running_var, plain.running_var, **close)
    record = stats._seen[bn][0]
    torch.testing.assert_close(record[0], 0.3 * xs[0].mean(dim=dims), **close)
    torch.testing.assert_close(record[1], 0.3 * xs[0].var(dim=dims, unbiased=True), **close)

    before = (bn.running_mean.clone(), bn.running_var.clone())
    with pytest.raises(RuntimeError):
        bn(torch.randn(8, 5, 5, 5))  # five channels for four: the kernel refuses
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    assert len(stats._seen[bn]) == 1, "a forward that raised is not a micro-batch"

    bn(xs[1])
    plain(xs[1])
    stats.replay()
    torch.testing.assert_close(bn.running_mean, plain.running_mean, **close)
    torch.testing.assert_close(bn.running_var, plain.running_var, **close)
    assert int(bn.num_batches_tracked) == int(plain.num_batches_tracked) == 2


def test_batchnorm_statistics_are_read_from_the_kernel():
    """Note [reproducible running statistics]: the records are the kernel's own
    ``momentum * mean`` and ``momentum * variance`` of each micro-batch; between
    micro-batches the module shows the kernel's update, a forward that raises gives its
    statistics back, and the replay of two micro-batches is BatchNorm's two updates."""
    run_ranks(_kernel_records, 1)
