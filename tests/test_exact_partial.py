"""The reproducible mode's gradient sums (Note [float64 partials] in exact/partial.py).

Single process: a "world" of N ranks over M=12 micro-batches is simulated as the engine runs
it. Each rank accumulates its micro-batches (``accumulate``) in a random order, and each
rank's rows are summed from every rank's partial and kept errors (``total``, what
``Exchange.result`` does with what it received). Every world size and grouping must give
``fp32(round64(S))`` per element, S the exact sum of its terms, computed here independently
with Python's ``math.fsum``. Then the real exchange between spawned ranks, and the compiled
passes against the eager ones.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from harness import run_fresh, run_ranks
from test_exact_sum import KINDS, N_ELEM, WORLDS, M, _assignments, _terms

from shardwise.errors import ShardwiseError
from shardwise.exact import partial as ep

NAN_BITS = torch.tensor(math.nan, dtype=torch.float32).view(torch.int32).item()


def _spread(kind: str, seed: int = 0) -> list[torch.Tensor]:
    """Terms aimed at the float64 sums' exactness checks."""
    g = torch.Generator().manual_seed(seed)
    n = N_ELEM
    if kind == "spread":  # elements' terms 2**35, 2**70 and 2**100 apart: inexact adds
        big = torch.randn(n, generator=g) * 1e10
        return [big * 2.0 ** -(0, 35, 70, 100)[m % 4] * (1 if m % 3 else -1) for m in range(M)]
    if kind == "one_outlier":  # smooth terms and, for a few elements, one far below
        out = [torch.randn(n, generator=g) for _ in range(M)]
        for m in (2, 7, 11):
            out[m] = out[m].clone()
            out[m][m::37] *= 2.0**-60
        return out
    if kind == "double_rounding":  # 1 + 2**-24 (an fp32 tie) + 2**-80: round64 first
        one = torch.ones(n)
        return [one, one * 2.0**-24, one * 2.0**-80] + [torch.zeros(n)] * (M - 3)
    if kind == "nonfinite":  # inf, -inf and NaN arriving after finite terms
        out = [torch.randn(n, generator=g) for _ in range(M)]
        for m, v in ((3, math.inf), (4, -math.inf), (6, math.nan), (9, math.inf)):
            out[m] = out[m].clone()
            out[m][m::50] = v
        return out
    if kind == "signed_zeros":  # every term -0.0 for some elements, mixed for others
        out = [torch.full((n,), -0.0) for _ in range(M)]
        out[5] = out[5].clone()
        out[5][::2] = 0.0
        return out
    raise ValueError(kind)


SPREAD = ("spread", "one_outlier", "double_rounding", "nonfinite", "signed_zeros")


def _any_terms(kind: str) -> list[torch.Tensor]:
    return _terms(kind) if kind in KINDS else _spread(kind)


def _reference(terms: list[torch.Tensor]) -> torch.Tensor:
    """fp32(round64(S)) per element, by Python's exact ``math.fsum``; IEEE's class for a
    non-finite term (canonical NaN); -0.0 only where every term is -0.0."""
    columns = torch.stack(terms, dim=1).double().tolist()
    out = []
    for values in columns:
        if any(math.isnan(v) for v in values) or (math.inf in values and -math.inf in values):
            out.append(math.nan)
        elif math.inf in values or -math.inf in values:
            out.append(math.inf if math.inf in values else -math.inf)
        elif all(v == 0 and math.copysign(1, v) < 0 for v in values):
            out.append(-0.0)
        else:
            out.append(math.fsum(values))
    return torch.tensor(out, dtype=torch.float64).float()


def _bits(x: torch.Tensor) -> list[int]:
    """Bits, every NaN as the canonical one (the reference's NaN is Python's)."""
    b = x.view(torch.int32)
    return torch.where(torch.isnan(x), NAN_BITS, b).tolist()


def _world(terms: list[torch.Tensor], groups: list[list[int]], rng: random.Random
           ) -> tuple[torch.Tensor, int]:
    """The sums as ``world = len(groups)`` ranks give them (rows gathered back), and how
    many errors the ranks kept."""
    world = len(groups)
    parts = []
    for g in groups:
        acc = None
        for m in rng.sample(g, len(g)):
            acc = ep.accumulate(acc, terms[m].clone())
        parts.append(acc)
    rows = N_ELEM // world
    out = []
    for s in range(world):
        lo = s * rows
        mine = [p.value[lo:lo + rows] for p in parts]
        errors = []
        for p in parts:
            for idx, val in p.errors:
                here = (idx >= lo) & (idx < lo + rows)
                errors.append((idx[here] - lo, val[here]))
        out.append(ep.total(mine, errors))
    return torch.cat(out), sum(p.error_count() for p in parts)


@pytest.mark.parametrize("kind", KINDS + SPREAD)
def test_every_world_size_and_grouping_gives_fp32_of_round64_of_the_exact_sum(kind):
    terms = _any_terms(kind)
    want = _bits(_reference(terms))
    rng = random.Random(kind)
    kept = 0
    for world in WORLDS:
        for groups in _assignments(world, rng):
            got, errors = _world(terms, groups, rng)
            kept += errors
            assert _bits(got) == want, (world, groups)
    if kind in ("spread", "one_outlier"):
        assert kept > 0, "no rank kept an error: the exact path was not exercised"


def test_the_double_rounding_is_the_documented_one():
    # 1 + 2**-24 + 2**-80: round64 gives 1 + 2**-24, an fp32 tie, which goes to even (1.0);
    # the correctly rounded fp32 of S would be 1 + 2**-23. Note [float64 partials] says
    # fp32(round64(S)), at every grouping.
    terms = _spread("double_rounding")
    got, _ = _world(terms, [list(range(M))], random.Random(0))
    assert got[0].item() == 1.0
    got, _ = _world(terms, [[0, 3, 4, 5], [1, 6, 7, 8], [2, 9, 10, 11]], random.Random(1))
    assert got[0].item() == 1.0


def test_terms_added_piece_by_piece_keep_their_errors_where_they_are():
    # The engine adds each parameter's gradient into its rows of the rank-major partial
    # (2-D strided views, Note [float64 partials]); a kept error must name the element
    # of the flat partial, as when the term is added whole.
    terms = _spread("spread")
    grid = (3, N_ELEM // 3)
    cuts = ((0, 5), (5, 250), (250, grid[1]))

    def pieces_of(x):
        return lambda t: [(t.view(grid)[:, a:b], x.view(grid)[:, a:b]) for a, b in cuts]

    whole = piecewise = None
    for t in terms[:6]:
        whole = ep.accumulate(whole, t.clone())
        piecewise = (ep.accumulate(None, t.clone()) if piecewise is None
                     else ep.add_pieces(piecewise, pieces_of(t)))
    assert whole is not None and piecewise is not None and whole.error_count() > 0
    assert torch.equal(whole.value.view(torch.int64), piecewise.value.view(torch.int64))
    assert _bits(ep.total([piecewise.value], piecewise.errors)) == _bits(
        _reference(terms[:6]))
    kept = sorted(zip(torch.cat([i for i, _ in piecewise.errors]).tolist(),
                      torch.cat([e for _, e in piecewise.errors]).tolist()))
    assert kept == sorted(zip(torch.cat([i for i, _ in whole.errors]).tolist(),
                              torch.cat([e for _, e in whole.errors]).tolist()))


def test_a_stale_scratch_is_a_false_alarm_only():
    # add_pieces reads its whole scratch once; a reused one is stale outside the pieces.
    # The pieces are then looked at one by one: no error is made up, and the scratch is
    # left clean.
    x = torch.randn(N_ELEM)
    y = torch.randn(N_ELEM)
    stale = torch.full((N_ELEM,), math.nan, dtype=torch.float64)
    spare = [stale]
    acc = ep.add_pieces(ep.accumulate(None, x.clone()),
                        lambda t: [(t[: N_ELEM // 2], y[: N_ELEM // 2])], spare)
    assert acc.errors == [] and spare == [stale] and not bool(stale.any())
    want = torch.cat([x[: N_ELEM // 2].double() + y[: N_ELEM // 2].double(),
                      x[N_ELEM // 2:].double()])
    assert torch.equal(acc.value, want)


def test_accumulate_refuses_what_it_cannot_add():
    with pytest.raises(ShardwiseError, match="fp32"):
        ep.accumulate(None, torch.zeros(4, dtype=torch.float64))
    acc = ep.accumulate(None, torch.zeros(4))
    with pytest.raises(ShardwiseError, match="4"):
        ep.accumulate(acc, torch.zeros(5))


# ---------------------------------------------------------------------------------------
# The exchange between ranks.


def _exchange(rank: int, world: int) -> None:
    from shardwise.comm.collectives import Comm

    comm = Comm(None)
    terms = _spread("spread")  # kept errors on every rank, inexact sums across ranks
    mine = [terms[m] for m in range(rank, M, world)]
    acc = None
    for t in mine:
        acc = ep.accumulate(acc, t.clone())
    assert acc is not None and acc.error_count() > 0
    got = ep.exchange(comm, acc, "a test buffer").result()
    rows = N_ELEM // world
    want = _reference(terms)[rank * rows:(rank + 1) * rows] / M
    assert _bits(got) == _bits(want)
    # One term per rank: the fp32 wire.
    got = ep.exchange(comm, ep.accumulate(None, terms[rank].clone()), "one term").result()
    want = _reference(terms[:world])[rank * rows:(rank + 1) * rows] / world
    assert _bits(got) == _bits(want)
    if world == 1:
        return
    # A rank that summed one micro-batch more than the others is named, on every rank,
    # and the next exchange works.
    acc = ep.accumulate(None, torch.ones(N_ELEM))
    if rank == 0:
        acc = ep.accumulate(acc, torch.ones(N_ELEM))
    with pytest.raises(ShardwiseError, match=r"different numbers of micro-batches \(rank 0: 2"):
        ep.exchange(comm, acc, "a test buffer").result()
    got = ep.exchange(comm, ep.accumulate(None, torch.full((N_ELEM,), float(rank))),
                      "after").result()
    assert torch.equal(got, torch.full((rows,), sum(range(world)) / world))


@pytest.mark.parametrize("world", [1, 3])
def test_the_exchange_gives_every_rank_its_rows_of_the_exact_mean(world):
    run_ranks(_exchange, world, timeout=120)


# ---------------------------------------------------------------------------------------
# Compiled passes (Note [fused kernels]).


def test_the_compiled_passes_give_the_eager_bits():
    # Above FUSE_MIN elements the passes run compiled, checked on the probe first; here on
    # other data, uneven lengths (vectorized loops' tails) and kept errors, the results
    # must equal the eager passes' bit for bit. In a fresh interpreter: inductor's compile
    # workers do not survive a fork (conftest.py turns the kernels off in tests).
    run_fresh("test_exact_partial", "_compiled", {"SHARDWISE_FUSED": "1"})


def _compiled() -> None:
    import warnings

    from shardwise.exact import fused

    n = 3 * fused.FUSE_MIN + 11
    probe = fused.probe(n_random=n)[:n]
    g = torch.Generator().manual_seed(3)
    terms = [probe, probe.roll(5) * 2.0**-35, torch.randn(n, generator=g) * 1e-3,
             probe.flip(0) * 2.0**-70]
    runs = {}
    for mode in ("1", "0"):
        os.environ["SHARDWISE_FUSED"] = mode
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a failed compile or mismatch warns
            acc = None
            for t in terms:
                acc = ep.accumulate(acc, t.clone())
            assert acc is not None
            one = ep.total([terms[0], terms[1]], [])
            three = ep.total([terms[0], terms[1], terms[2]], [])
            wide = ep.total([acc.value, terms[2].double()], acc.errors)
        runs[mode] = (acc.value.view(torch.int64), acc.error_count(), one, three, wide)
    for name in ("add", "total of float32, float32", "total of float32, float32, float32",
                 "total of float64, float64"):
        assert fused._kernels.get(f"partial {name} on cpu") is not None, name
    (v1, e1, *r1), (v0, e0, *r0) = runs["1"], runs["0"]
    assert e1 == e0 > 0
    nan = torch.isnan(v1.view(torch.float64))
    assert torch.equal(nan, torch.isnan(v0.view(torch.float64)))
    assert torch.equal(v1[~nan], v0[~nan])
    for a, b in zip(r1, r0):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _as_dtensor(rank: int, world: int) -> None:
    import shardwise as sw
    from shardwise.engine.iteration.state import model_state

    torch.manual_seed(0)
    model = sw.shard(torch.nn.Linear(4, 6))
    state = model_state(model)
    assert state is not None
    p = state.units[0].params[0]
    local = p.local.detach().clone().requires_grad_(True)
    with torch.no_grad():
        got = p.as_dtensor(local)
        want = torch.distributed.tensor.DTensor.from_local(
            local, got.device_mesh, got.placements, run_check=False, shape=p.shape,
            stride=p.shard.stride())
    # Note [a gradient's DTensor]: the shortcut gives what from_local gives.
    assert got.requires_grad == want.requires_grad is False
    assert got.placements == want.placements and got.shape == want.shape


def test_a_gradients_dtensor_is_what_from_local_gives():
    run_ranks(_as_dtensor, 2)
