"""``units="auto"``: the fewest units whose gathered parameters fit a memory budget."""

import logging
import warnings

import pytest
import torch
from harness import LogCollector, run_ranks
from loops import train_steps

import shardwise as sw
from shardwise.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=8, n_layer=4, n_head=2, d_model=32)


def _names(model):
    return [u.name for u in sw.inspect(model).units]


def _bytes(model):
    """Each unit's gathered bytes, root first, as the engine allocated them."""
    return [u.gathered_bytes for u in sw.inspect(model).units]


def _choices(rank, world):
    # What the engine allocates under the three granularities, to set budgets by.
    whole = sum(_bytes(sw.shard(GPT(CFG), units=())))
    blocks = sw.shard(GPT(CFG))
    root, *block = _bytes(blocks)
    two_blocks = root + 2 * max(block)  # the root stays gathered; one block prefetched
    assert two_blocks < whole

    huge = sw.shard(GPT(CFG), units="auto", memory_budget=2**40)
    assert _names(huge) == ["<root>"]
    assert _names(sw.shard(GPT(CFG), units="auto", memory_budget=whole)) == ["<root>"]
    assert _names(sw.shard(GPT(CFG), units="auto", memory_budget=whole - 1)) == _names(blocks)
    assert _names(sw.shard(GPT(CFG), units="auto", memory_budget=two_blocks)) == \
        _names(blocks)

    # Tighter than two blocks: each block splits into its layers (the blocks then own
    # nothing and are dropped), and the root's own modules become units too; the tied
    # embedding and head stay with the root, which holds every use of them.
    fine = sw.shard(GPT(CFG), units="auto", memory_budget=two_blocks - 1)
    names = _names(fine)
    assert "blocks.0" not in names and "lm_head" not in names, names
    assert names[:4] == ["<root>", "pos_emb", "blocks.0.ln1", "blocks.0.qkv"], names
    assert names[-1] == "ln_f" and len(names) == 3 + 6 * CFG.n_layer, names
    sizes = _bytes(fine)
    peak = sizes[0] + max(a + b for a, b in zip(sizes[1:], sizes[2:]))
    assert peak < two_blocks

    # prefetch=2 holds three blocks at once: two blocks' budget no longer fits them.
    assert _names(sw.shard(GPT(CFG), units="auto", memory_budget=two_blocks,
                           prefetch=2)) == names
    # Gathered in bf16, half the bytes hold two blocks (in fp32 they hold layers only).
    mp = sw.MixedPrecision(param_dtype=torch.bfloat16)
    assert _names(sw.shard(GPT(CFG), units="auto", memory_budget=two_blocks // 2,
                           mixed_precision=mp)) == _names(blocks)

    # Below the finest split: that split, and a warning saying by how much it is over.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tight = sw.shard(GPT(CFG), units="auto", memory_budget=1000)
    assert _names(tight) == names
    said = [str(w.message) for w in caught if "units='auto'" in str(w.message)]
    assert len(said) == 1 and f"{peak - 1000} bytes" in said[0] and "over" in said[0], said

    # The default budget (free memory) holds this small model whole; rank 0 logs it.
    log = logging.getLogger("shardwise")
    collect, level = LogCollector(), log.level
    log.addHandler(collect)
    log.setLevel(logging.INFO)
    try:
        default = sw.shard(GPT(CFG), units="auto")
    finally:
        log.setLevel(level)
        log.removeHandler(collect)
    assert _names(default) == ["<root>"]
    picked = [m for m in collect.messages if m.startswith("units='auto': 1 units")]
    budget = [m for m in collect.messages if "default budget" in m]
    assert (len(picked), len(budget)) == ((1, 1) if rank == 0 else (0, 0)), collect.messages

    # Bad budgets fail before anything changes, saying what to pass instead.
    for bad in (0, -5, 1.5, True, "1G"):
        with pytest.raises(sw.ShardwiseError, match="expected a positive int"):
            sw.shard(GPT(CFG), units="auto", memory_budget=bad)
    with pytest.raises(sw.ShardwiseError, match="applies to units='auto' only"):
        sw.shard(GPT(CFG), memory_budget=2**30)
    with pytest.raises(sw.ShardwiseError, match="or 'auto'"):
        sw.shard(GPT(CFG), units="automatic")
    # A 0-dim parameter is refused by name under "auto" as with units given (it reached
    # the layout first, as a bare ValueError).
    scaled = GPT(CFG)
    scaled.scale = torch.nn.Parameter(torch.tensor(2.0))
    for units in ("auto", None):
        with pytest.raises(sw.ShardwiseError, match=r"0-dim parameters .*'scale'"):
            sw.shard(scaled, units=units)


def test_auto_picks_the_fewest_units_that_fit():
    run_ranks(_choices, 2)


def _trains_as_explicit(rank, world):
    g = torch.Generator().manual_seed(rank)
    batches = [(x[:, :-1], x[:, 1:]) for x in
               torch.randint(0, CFG.vocab_size, (3, 2, CFG.seq_len + 1), generator=g)]

    def losses(units, **kw):
        torch.manual_seed(0)
        model = sw.shard(GPT(CFG), units=units, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return _names(model), train_steps(model, opt, batches)

    out = {}
    for budget in (2**40, 60_000):  # the root alone; layers (the budget is below 2 blocks)
        names, auto = losses("auto", memory_budget=budget)
        picked = set(names[1:])
        same_names, explicit = losses((lambda name, module: name in picked) if picked else ())
        assert same_names == names and auto == explicit, (names, auto, explicit)
        out[budget] = names
    assert out[2**40] == ["<root>"] and "blocks.1.fc" in out[60_000], out


def test_training_with_auto_units_equals_the_same_units_given():
    run_ranks(_trains_as_explicit, 2)


def _default_budget_is_agreed(rank, world):
    import shardwise.sharding as shard_module  # the module, not the function shard
    from shardwise.planning.planner import plan

    root, *block = _bytes(sw.shard(GPT(CFG)))
    two_blocks = root + 2 * max(block)
    state = plan(GPT(CFG), world)
    sharded = state.parameters + state.gradients + state.optimizer
    # Rank 0 sees little free memory; the three ranks share one host, so each gets a
    # third of it, a quarter of which goes to gathered parameters: two blocks' worth.
    # The other ranks see plenty, but every rank must choose what rank 0 can afford.
    free = 4 * world * (sharded + two_blocks) if rank == 0 else 2**40
    shard_module.free_memory = lambda device: free
    return _names(sw.shard(GPT(CFG), units="auto")), _names(sw.shard(GPT(CFG)))


def test_default_budget_is_the_smallest_share_on_every_rank():
    results = run_ranks(_default_budget_is_agreed, 3)
    assert all(auto == default for auto, default in results), results


def test_the_planner_plans_auto_units_on_the_meta_device():
    from shardwise.planning.planner import plan
    from shardwise.planning.units import gathered_peak

    with torch.device("meta"):
        model = GPT(CFG)
    assert plan(model, 2, units="auto", memory_budget=2**40).units == 1
    assert plan(model, 2, units="auto", memory_budget=1).units == 3 + 6 * CFG.n_layer
    with pytest.raises(ValueError, match="memory_budget"):
        plan(model, 2, units="auto")
    # The root, then the worst window: two neighbours, or a unit inside the one enclosing it.
    assert gathered_peak(["", "a", "b", "c"], [10, 100, 100, 100], prefetch=1) == 210
    assert gathered_peak(["", "a", "a.x", "b"], [10, 5, 100, 100], prefetch=1) == 215
    assert gathered_peak(["", "a", "b"], [10, 1, 2], prefetch=0,
                         reshard_after_forward=False) == 13
