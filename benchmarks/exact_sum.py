"""Accuracy and cost of the exact, order-independent sums of issue 24 (``shardwise.exact.sums``).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/exact_sum.py

Accuracy on real gradients: the reference workload's GPT (6 layers, d_model 512, 8 heads,
vocab 8192, sequence 256; ``shardwise.models``), initial weights of ``torch.manual_seed(0)``,
one global batch of M=8 sequences split into M micro-batches of one sequence each (the
reference's 2 ranks x batch 4). Each micro-batch's gradient is computed on its own; their
sum is formed by:

* fp32 sequential: ``((g0 + g1) + g2) + ...``, today's reduction in rank order;
* fp32 in other groupings: each of N ranks sums its M/N micro-batches, then the N partial
  sums are added in rank order (N=2, 4), and a pairwise tree;
* exact: ``_exact_sum`` at N=1 (sequential ``add_``), N=2 and N=8 (MAX of indices, align,
  integer sum), which must give identical bits; and with a block of 64 elements sharing
  one index.

Each is compared with the fp64 sum of the same fp32 terms (exact for 8 terms unless they span
more than 29 binades; the table gives how many elements differ from the fp64 sum rounded to
fp32). Cost: encode/align/add/decode time per element on this CPU (one thread), with the eager
ops and with the fused kernels (``--timings-only`` prints just that table), including the
gradient path's float64 partials (Note [float64 partials]: a micro-batch added, one
micro-batch per rank summed at the receiver) against the binned encode + add_, and bytes
per element on the wire. The accuracy table has the float64 partials' rows too, at N=1, 2
and 8 (which must give identical bits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from shardwise.exact import partial as ep
from shardwise.exact import sums as es
from shardwise.models import GPT, GPTConfig


def micro_batch_grads(cfg: GPTConfig, micro: int, seed: int) -> torch.Tensor:
    """[micro, P] fp32: the flat gradient of each micro-batch of one sequence."""
    torch.manual_seed(0)
    model = GPT(cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    rows = []
    for m in range(micro):
        model.zero_grad(set_to_none=True)
        model(x[m : m + 1], y[m : m + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in params]))
    return torch.stack(rows)


def fp32_grouped(terms: torch.Tensor, world: int) -> torch.Tensor:
    per = terms.shape[0] // world
    partial = []
    for r in range(world):
        acc = terms[r * per].clone()
        for m in range(r * per + 1, (r + 1) * per):
            acc += terms[m]
        partial.append(acc)
    out = partial[0]
    for p in partial[1:]:
        out += p
    return out


def fp32_tree(terms: torch.Tensor) -> torch.Tensor:
    level = list(terms)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def exact_grouped(encoded: list[es.Binned], world: int, block: int | None = None) -> torch.Tensor:
    per = len(encoded) // world
    parts = []
    for r in range(world):
        acc = es.zeros(encoded[0].numel)
        for m in range(r * per, (r + 1) * per):
            es.add_(acc, encoded[m])
        parts.append(acc)
    index = torch.stack([p.index for p in parts]).amax(dim=0)  # the all-reduce MAX
    if block is not None:
        index = es.expand_index(es.block_index(index, block), block, index.shape[0])
    bins = torch.zeros_like(parts[0].bins)
    for p in parts:  # the integer reduce-scatter (here unsplit)
        bins += es.align(p, index).bins
    return es.decode(es.Binned(index, bins, terms=len(encoded)))


def partials_grouped(terms: torch.Tensor, world: int) -> torch.Tensor:
    """What the reproducible mode's gradient path gives (Note [float64 partials]): each of
    ``world`` ranks accumulates its share, the rows are summed from every rank's partial
    (here unsplit)."""
    per = terms.shape[0] // world
    parts, errors = [], []
    for r in range(world):
        acc = None
        for m in range(r * per, (r + 1) * per):
            acc = ep.accumulate(acc, terms[m].clone())
        assert acc is not None
        parts.append(acc.value)
        errors += acc.errors
    return ep.total(parts, errors)


def accuracy(grads: torch.Tensor, chunk: int, block: int) -> dict[str, torch.Tensor]:
    """Every method's sum, chunk by chunk of elements (bounded memory)."""
    n = grads.shape[1]
    out: dict[str, list[torch.Tensor]] = {}

    def put(name: str, value: torch.Tensor) -> None:
        out.setdefault(name, []).append(value)

    for lo in range(0, n, chunk):
        terms = grads[:, lo : lo + chunk]
        put("fp64", terms.double().sum(0))
        put("fp32 sequential (N=1)", fp32_grouped(terms, 1))
        put("fp32, N=2 (4+4)", fp32_grouped(terms, 2))
        put("fp32, N=4 (2+2+2+2)", fp32_grouped(terms, 4))
        put("fp32, pairwise tree", fp32_tree(terms))
        encoded = [es.encode(t) for t in terms]
        same = [exact_grouped(encoded, w) for w in (1, 2, 8)]
        if not all(torch.equal(s.view(torch.int32), same[0].view(torch.int32)) for s in same):
            raise AssertionError("exact sums differ across groupings")
        put("exact, N=1, 2, 8 (identical bits)", same[0])
        put(f"exact, index shared by {block} elements", exact_grouped(encoded, 2, block))
        same = [partials_grouped(terms, w) for w in (1, 2, 8)]
        if not all(torch.equal(s.view(torch.int32), same[0].view(torch.int32)) for s in same):
            raise AssertionError("float64 partials differ across groupings")
        put("float64 partials (the gradient path), N=1, 2, 8 (identical bits)", same[0])
    return {k: torch.cat(v) for k, v in out.items()}


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timings(n: int, repeat: int) -> dict[str, float]:
    """Milliseconds per million elements of each operation on realistic operands."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, generator=g)
    y = torch.randn(n, generator=g) * 4.0  # different magnitudes: indices differ
    a, b = es.encode(x), es.encode(y)
    index = torch.maximum(a.index, b.index)
    s = es.add(a, b)
    p0 = ep.accumulate(ep.accumulate(None, x.clone()), y)
    per_m = 1e3 / (n / 1e6)
    return {
        "fp32 add (the default mode)": median_time(lambda: x + y, repeat) * per_m,
        "encode": median_time(lambda: es.encode(x), repeat) * per_m,
        "align (to the MAX of two)": median_time(lambda: es.align(a, index), repeat) * per_m,
        "add (indices differ)": median_time(lambda: es.add(a, b), repeat) * per_m,
        "add_ (same index, integer add)": median_time(
            lambda: es.add_(es.Binned(s.index, s.bins.clone(), 2), s), repeat
        )
        * per_m,
        "decode": median_time(lambda: es.decode(s), repeat) * per_m,
        # A micro-batch under no_sync: the binned form encodes and adds; the gradient
        # path adds into a float64 partial (Note [float64 partials]).
        "binned: encode + add_ (a micro-batch)": median_time(
            lambda: es.add_(es.Binned(s.index, s.bins.clone(), 2), es.encode(y)), repeat)
        * per_m,
        "partial: second micro-batch (fp32 + fp32 into float64)": median_time(
            lambda: ep.accumulate(ep.Partial(x), y), repeat) * per_m,
        "partial: a later micro-batch (float64 += fp32, in place)": median_time(
            lambda: ep.accumulate(p0, y), repeat) * per_m,
        "partial: one micro-batch per rank, 2 ranks' fp32 rows summed (per row)": median_time(
            lambda: ep.total([x, y], []), repeat) * per_m,
        "partial: 2 ranks' float64 rows summed (per row)": median_time(
            lambda: ep.total([p0.value, p0.value], []), repeat) * per_m,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="M micro-batches of one sequence")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=1 << 22)
    ap.add_argument("--time-elems", type=int, default=1 << 22)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timings-only", action="store_true",
                    help="skip the accuracy table (it computes M gradients of the GPT)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.timings_only:
        print_timings(args)
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, seq_len=args.seq)
    t0 = time.perf_counter()
    grads = micro_batch_grads(cfg, args.micro, seed=100)
    t_grad = time.perf_counter() - t0
    t0 = time.perf_counter()
    sums = accuracy(grads, args.chunk, args.block)
    t_acc = time.perf_counter() - t0
    ref = sums.pop("fp64")
    ref32 = ref.float()
    n = ref.numel()
    print(
        f"commit {commit}; GPT {cfg.n_layer} layers, d_model {cfg.d_model}, seq {cfg.seq_len}; "
        f"M={args.micro} micro-batches of 1 sequence; {n:,} gradient elements "
        f"(gradients {t_grad:.0f} s, sums {t_acc:.0f} s)\n"
    )
    print("| sum | max abs error | norm-wise rel. error | elements != fp64 rounded to fp32 |")
    print("|---|---|---|---|")
    for name, s in sums.items():
        err = s.double() - ref
        rel = float(err.norm() / ref.norm())
        differ = int((s.view(torch.int32) != ref32.view(torch.int32)).sum())
        print(
            f"| {name} | {float(err.abs().max()):.3e} | {rel:.3e} | "
            f"{differ:,} ({100 * differ / n:.2f}%) |"
        )
    del grads, sums
    spec = es.DEFAULT
    print(
        f"\nBins: K={spec.K} of W={spec.W} bits; up to {es.max_terms(spec):,} terms between "
        f"decodes. Bytes per element on the wire: fp32 4; exact {spec.wire_bytes} "
        f"({8 * spec.K} of int64 bins + 1 of int8 index), {8 * spec.K + 1 / args.block:.3f} "
        f"with an index per {args.block} elements.\n"
    )
    print_timings(args)


def print_timings(args: argparse.Namespace) -> None:
    """ns per element of each operation, with the eager ops (``SHARDWISE_FUSED=0``) and
    with the fused kernels (Note [fused kernels]); both give the same bits."""
    columns = {}
    for fused in ("0", "1"):
        os.environ["SHARDWISE_FUSED"] = fused
        timings(args.time_elems, 1)  # the fused kernels compile at first use
        columns[fused] = timings(args.time_elems, args.repeat)
    print(f"| operation ({args.time_elems:,} elements, median of {args.repeat}) | "
          f"eager ops, ns per element | fused kernels, ns per element |")
    print("|---|---|---|")
    for name, eager in columns["0"].items():
        print(f"| {name} | {eager:.1f} | {columns['1'][name]:.1f} |")


if __name__ == "__main__":
    main()
