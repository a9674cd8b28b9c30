"""Gradient accumulation under ``sw.no_sync`` with units kept gathered between micro-batches
(Note [gathered across micro-batches] in engine/iteration/state.py), against DistributedDataParallel
and against the same loop with ``keep_gathered=False`` (which reshards as any step does, so
its arithmetic is the same: the two must agree bit for bit at any world size)."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from test_engine import Edge, _assert_close
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.planning.planner import plan


def _states(model) -> list[str]:
    return [u.state for u in sw.inspect(model).units if u.groups]


def _gathers(model, before) -> int:
    return sw.inspect(model).comm.since(before).calls.get("all_gather", 0)


def _held_against_ddp(rank, world):
    torch.manual_seed(0)
    base = Edge()  # frozen and trainable groups in one unit, a unit called twice, ...
    ddp = DDP(copy.deepcopy(base), find_unused_parameters=True)
    held = sw.shard(copy.deepcopy(base))
    resharding = sw.shard(copy.deepcopy(base))
    models = (ddp, held, resharding)
    quiet = (ddp.no_sync, lambda: sw.no_sync(held),
             lambda: sw.no_sync(resharding, keep_gathered=False))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    exact = world == 2
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(3):
        micro = [(torch.randn(6, 5, generator=g), torch.randint(0, 3, (6,), generator=g))
                 for _ in range(4)]
        for model, ctx in zip(models, quiet):
            if model is not ddp:
                before = sw.inspect(model).comm
            for i, (x, y) in enumerate(micro):
                last = i == len(micro) - 1
                # ``sometimes`` is used on rank 0 only in one micro-batch
                with contextlib.nullcontext() if last else ctx():
                    out = model(x, use_sometimes=i != 1 or rank == 0)
                    if model is held and i == 0:
                        first = sw.inspect(held).comm  # after the only gathers
                    F.cross_entropy(out, y).backward()
                if model is held and not last:
                    assert _states(held) == ["gathered"] * 4, (step, i, _states(held))
                if model is resharding and not last:
                    assert _states(resharding) == ["sharded"] * 4, (step, i)
            if model is held:  # gathered once, in the first micro-batch's forward
                assert _gathers(held, first) == 0
                assert _gathers(held, before) == sum(len(u.groups)
                                                     for u in sw.inspect(held).units)
            if model is not ddp:
                # The synced backward reshards and frees everything, as a step does.
                view = sw.inspect(model)
                assert view.phase == "idle" and _states(model) == ["sharded"] * 4
                assert view.full_bytes == 0
                assert not any(g.full_allocated for u in view.units for g in u.groups)
                assert not any(p.has_full_grad for u in view.units for p in u.params)
        ref = dict(ddp.module.named_parameters())
        other = dict(resharding.named_parameters())
        for name, p in held.named_parameters():
            if ref[name].grad is None:
                assert p.grad is None and other[name].grad is None, name
                continue
            _assert_close(p.grad.full_tensor(), ref[name].grad, exact, f"{step} {name}")
            assert torch.equal(p.grad.to_local(), other[name].grad.to_local()), name
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    sd = sw.full_state_dict(held, rank0_only=False)
    sd2 = sw.full_state_dict(resharding, rank0_only=False)
    for k, v in ddp.module.state_dict().items():
        _assert_close(sd[k], v, exact, k)
        assert torch.equal(sd[k], sd2[k]), k


@pytest.mark.parametrize("world", [2, 3])
def test_units_stay_gathered_between_micro_batches_and_match_ddp(world):
    run_ranks(_held_against_ddp, world)


class Boom(Exception):
    pass


def _interruptions(rank, world, path):
    """Each way of leaving a micro-batch abnormally, in a held model and in one that
    reshards (``keep_gathered=False``), which must stay identical."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=16)
    base = GPT(cfg)
    held = sw.shard(copy.deepcopy(base))
    resharding = sw.shard(copy.deepcopy(base))
    opts = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (held, resharding)}
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(6)]
    saved = [sw.full_state_dict(m, rank0_only=False) for m in (held, resharding)]

    def quiet(model):
        return sw.no_sync(model, keep_gathered=model is held)

    def micro(model, x):
        with quiet(model):
            model(x, x).backward()

    def boom(*_):
        raise Boom

    def interrupt(model, how, x):
        opt = opts[id(model)]
        if how == "optimizer step":  # a shard changes under the held full parameters
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.full_like(p, 0.5)
            opt.step()
            opt.zero_grad()
        elif how == "exception":
            handle = model.blocks[1].register_forward_hook(boom)
            with pytest.raises(Boom), quiet(model):
                model(x, x)
            handle.remove()
        elif how == "no_grad forward":
            with quiet(model), torch.no_grad():
                model(x, x)
        elif how == "forward without backward":
            with quiet(model):
                model(x, x)
        elif how == "gathered":
            with quiet(model), sw.gathered(model):
                pass
        elif how == "gathered, modified":
            with quiet(model), sw.gathered(model, modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        model.blocks[0].fc.weight.mul_(0.5)
        elif how == "checkpoint":
            folder = f"{path}/{'held' if model is held else 'resharding'}"
            with quiet(model):
                sw.save_checkpoint(folder, model, opt)
                with torch.no_grad():
                    model.blocks[2].fc.weight.zero_()
                sw.load_checkpoint(folder, model, opt)
        elif how == "load_state_dict":
            with quiet(model):
                model.load_state_dict(saved[model is not held])
        elif how == "state_dict on one rank":
            with quiet(model):
                if rank == 0:
                    sd = model.state_dict()
                    assert all(isinstance(v, DTensor) for k, v in sd.items()
                               if k.endswith("weight")), [type(v) for v in sd.values()]
                    kept = model.state_dict(keep_vars=True)
                    assert all(isinstance(v, DTensor) for k, v in kept.items()
                               if k.endswith("weight"))

    cases = ["optimizer step", "exception", "no_grad forward", "forward without backward",
             "gathered", "gathered, modified", "checkpoint", "load_state_dict",
             "state_dict on one rank"]
    for how in cases:
        for model in (held, resharding):
            opt = opts[id(model)]
            micro(model, batches[0])
            interrupt(model, how, batches[1])
            micro(model, batches[2])
            model(batches[3], batches[3]).backward()  # synced
            assert _states(model) == ["sharded"] * len(_states(model)), (how, _states(model))
            assert sw.inspect(model).full_bytes == 0, how
            opt.step()
            opt.zero_grad()
        a = sw.full_state_dict(held, rank0_only=False)
        b = sw.full_state_dict(resharding, rank0_only=False)
        for k in a:
            assert torch.equal(a[k], b[k]), (how, k)


def test_leaving_a_micro_batch_abnormally_leaves_consistent_state(tmp_path):
    run_ranks(_interruptions, 2, str(tmp_path), timeout=240)


def _memory(rank, world):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=8, n_layer=2, n_head=2, d_model=16)
    x = torch.randint(0, 64, (2, 8))
    expected = plan(GPT(cfg), world_size=world)
    assert expected.accumulated_grads > 0 and expected.held_params > 0
    assert "under sw.no_sync" in expected.table()
    model = sw.shard(GPT(cfg))
    with sw.no_sync(model):
        model(x, x).backward()
    # The plan's held parameters are what the engine keeps gathered.
    assert sw.inspect(model).full_bytes == expected.held_params
    # Gradients waiting in a held unit's .grad are waiting gradients: a cast, or a
    # requires_grad change, is refused as when they wait in the accumulator.
    with pytest.raises(sw.ShardwiseError, match="accumulated under sw.no_sync"):
        model.double()
    weight = model.blocks[0].fc.weight  # the full parameter while held
    weight.requires_grad_(False)
    with pytest.raises(sw.ShardwiseError, match="changed while gradients accumulated"):
        model(x, x)
    weight.requires_grad_(True)
    model(x, x).backward()
    assert sw.inspect(model).full_bytes == 0
    with sw.no_sync(model, keep_gathered=False):
        model(x, x).backward()
    assert sw.inspect(model).full_bytes == 0
    model(x, x).backward()

    # A mostly frozen model (a base with a small trainable part) is not held.
    frozen = GPT(cfg)
    for name, p in frozen.named_parameters():
        p.requires_grad_("ln" in name)
    assert plan(frozen, world_size=world).held_params == 0
    model = sw.shard(frozen)
    with sw.no_sync(model):
        model(x, x).backward()
    assert sw.inspect(model).full_bytes == 0
    model(x, x).backward()


def test_the_plan_states_what_accumulation_holds():
    run_ranks(_memory, 2)


class _WithAside(torch.nn.Module):
    """Two units on the main path and one (``aside``) that only the first micro-batch calls."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aside = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, aside: bool = False):
        if aside:
            self.aside(x)  # its output unused: no gradient reaches it
        return self.b(self.a(x)).square().mean()


def _aside_and_stale(rank, world):
    """A held unit no micro-batch gave a gradient to is sharded after the synced step; a
    sw.gathered block after an optimizer step inside no_sync sees the new shards."""
    torch.manual_seed(0)
    base = _WithAside()
    units = lambda name, m: name in ("a", "b", "aside")  # noqa: E731
    for keep in (True, False):
        model = sw.shard(copy.deepcopy(base), units=units)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        with sw.no_sync(model, keep_gathered=keep):
            model(x, aside=True).backward()
        model(x).backward()
        assert _states(model) == ["sharded"] * 3, (keep, _states(model))
        assert sw.inspect(model).full_bytes == 0
        assert isinstance(model.aside.weight, DTensor)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with sw.no_sync(model, keep_gathered=keep):
            model(x).backward()
        opt.step()  # inside the accumulation: the held units' shards change
        want = sw.full_state_dict(model, rank0_only=False)
        with sw.gathered(model, modifier_rank=0):
            assert torch.equal(model.a.weight, want["a.weight"]), keep
            if rank == 0:
                with torch.no_grad():
                    model.a.weight.mul_(2)
        got = sw.full_state_dict(model, rank0_only=False)
        assert torch.equal(got["a.weight"], want["a.weight"] * 2), keep
        assert torch.equal(got["b.weight"], want["b.weight"]), keep


def test_an_unused_held_unit_is_released_and_gathered_sees_a_step_inside_no_sync():
    run_ranks(_aside_and_stale, 2)
