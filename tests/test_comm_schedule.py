"""The model's communication schedule (Note [communication owner] in
engine/iteration/state.py): which gathers are in flight while each unit computes, in
forward and in backward, how many reductions are, and that none is left for the
optimizer step.

Observed from hooks registered after ``shard``, which run after the engine's: a forward
pre-hook on each block (the block is gathered, its prefetches issued), and a hook on each
block's output tensor (its backward starts: the engine's hook on the same tensor has
gathered it and issued the backward prefetches). Losses are the same at every depth
(test_comm_volume.py); this is about when.
"""

import pytest
import torch
from harness import run_ranks

import shardwise as sw
from shardwise.engine.iteration.state import model_state
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=96, seq_len=16, n_layer=4, n_head=2, d_model=32)


def _schedule(rank, world, depth):
    torch.manual_seed(0)
    model = sw.shard(GPT(CFG), units=type(GPT(CFG).blocks[0]), prefetch=depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = model_state(model).schedule
    seen: dict[str, list] = {}

    def names(units):
        return [u.name for u in units]

    def on_forward(i):
        def hook(module, args):
            seen[f"forward {i}"] = names(schedule.in_flight())
        return hook

    def on_output(i):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                output.register_hook(lambda g: seen.__setitem__(
                    f"backward {i}", (names(schedule.in_flight()),
                                      names(schedule.reductions_in_flight()))))
        return hook

    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(on_forward(i))
        block.register_forward_hook(on_output(i))
    after = []
    for step in range(3):
        x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len),
                          generator=torch.Generator().manual_seed(rank + step))
        model(x, x).backward()
        # Every reduction was waited for at the end of backward, none is left to the step.
        after.append((names(schedule.in_flight()), names(schedule.reductions_in_flight()),
                      [g.reduction.state.value for u in schedule.units
                       for g in u.trainable_groups]))
        opt.step()
        opt.zero_grad()
    return seen, after


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_gathers_follow_the_order_and_every_reduction_is_waited_before_the_step(depth):
    seen, after = run_ranks(_schedule, 2, depth)[0]
    n = CFG.n_layer
    for i in range(n):
        # Forward (the previous iteration's order): the next `depth` blocks, in order.
        ahead = [f"blocks.{j}" for j in range(i + 1, min(i + 1 + depth, n))]
        assert seen[f"forward {i}"] == ahead, (i, seen)
        # Backward (this forward's order, backwards): the `depth` blocks before it,
        # nearest first; the root stays gathered and is never prefetched.
        gathering, reducing = seen[f"backward {i}"]
        behind = [f"blocks.{j}" for j in range(i - 1, max(-1, i - 1 - depth), -1)]
        assert gathering == behind, (i, seen)
        # At most two reductions in flight: starting one waits for the one before, so
        # while a block computes only the block after it (whose backward just ended)
        # is still reducing.
        assert reducing == ([f"blocks.{i + 1}"] if i + 1 < n else []), (i, seen)
    for gathering, reducing, states in after:
        assert gathering == [] and reducing == [], after
        assert set(states) == {"idle"}, after
