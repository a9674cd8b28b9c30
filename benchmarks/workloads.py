"""Step time of shardwise against DDP and FSDP2 on several workloads, interleaved rounds.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/workloads.py \\
        [--workloads llama,bert,cnn,gpt] [--rounds 3 --steps 8]

Workloads, fp32, AdamW, 2 ranks (batch sizes per rank):

- ``llama``: Hugging Face ``LlamaForCausalLM``, 4 layers, hidden 256, intermediate 688,
  4 heads, vocab 8192, sequence 64, batch 4; units: its ``_no_split_modules``
  (``no_split_units``), FSDP2 on the same decoder layers.
- ``bert``: Hugging Face ``BertForMaskedLM``, 4 layers, hidden 256, intermediate 1024,
  4 heads, vocab 8192, sequence 128, batch 8, 15% of tokens masked, dropout off (so
  losses compare); it names no ``_no_split_modules``: shardwise's default units (each
  ``BertLayer``), FSDP2 on the same layers.
- ``cnn``: ``shardwise.models.SmallCNN`` with channels 3-32-64-128-128 (conv, BatchNorm,
  ReLU per block), 32x32 images, batch 32, cross-entropy; shardwise's default units (the
  blocks, BatchNorm buffers broadcast from rank 0, as DDP does).
- ``gpt``: step_time.py's reference GPT (6 layers, d_model 512, sequence 256, batch 4).
- ``accum``: gradient accumulation (issue 44's probe): Hugging Face ``LlamaForCausalLM``,
  4 layers, hidden 512, intermediate 1376, 8 heads, vocab 8192, sequence 128; per rank and
  step ``--micro`` (4) micro-batches of one sequence under no_sync (``sw.no_sync``, DDP's
  ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``), then one more micro-batch
  whose backward reduces; each micro-batch's loss divided by their number (undivided
  under ``shardwise_reproducible``, which takes the mean itself). Units as
  ``llama``'s. Not in the default list: ``--workloads accum``.

Each workload builds every system from the same initial weights and gives it the same data,
then runs step_time.py's interleaved rounds (``run_rounds``: every system in turn, the order
rotating). Systems: ``ddp``, ``fsdp2`` (``fully_shard`` on each block, then the root),
``shardwise`` and ``shardwise_unchecked`` (shardwise with ``SHARDWISE_CHECK=0`` around its
steps: the cost of the collective-order check), and, when asked for with ``--systems``,
``shardwise_auto`` (``units="auto"``, with ``--budget BYTES`` as its ``memory_budget``, else
the default budget) and ``shardwise_reproducible`` (``reproducible=True``: one micro-batch
per rank, the mean over ranks as DDP's) and ``shardwise_kept`` (``reshard_after_forward=False``: no
gather in the backward, what re-gathering costs); rank 0 prints the units each shardwise system
chose.

Compiled systems, also on request: ``ddp_compiled``, ``fsdp2_compiled`` and
``shardwise_compiled``, each its eager system's model compiled whole with
``torch.compile`` (inductor) after wrapping or sharding, as ``compiled.py`` does (Note
[compile] in engine/iteration/hooks.py). Their ratios are to ``ddp_compiled`` (compiled
against compiled), the eager systems' to ``ddp``; ``ddp_compiled``'s own is to ``ddp``
(what compiling buys DDP). The compile happens in the first steps, which ``--warmup``
leaves out of the timings (first round only, as for every system). Several models of
the same classes compiled in one process would run into dynamo's recompile limit (8 per
code object), which then falls back to eager silently: the limit is raised here, for the
benchmark only.

A system that cannot be built (an option the measured shardwise lacks: ``table.py
--before``) or whose step raises (e.g. a compile error) is left out of the later rounds
and shown as ``n/a`` with the exception's type in the table; the ranks agree on that
(an all-reduce after each build and each system's turn), so the others go on. A failure
that leaves one rank inside a collective the other never enters still hangs the run.

Printed per workload: each round's medians, then a Markdown table of each system's
baseline, the median step time over all timed steps, the ratio to the baseline per
round and the median of those ratios, and the largest loss difference from the
baseline.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from step_time import GPTConfig, System, build, call_model, compare, report, wrap_fsdp2
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw

# Where the model state lives moved over time; table.py --before measures older trees
# (before the reproducible mode, which alone needs it here: none, then).
try:
    from shardwise.engine.iteration.state import model_state
except ImportError:
    try:  # before the engine's rooms
        from shardwise.engine.state import model_state  # type: ignore[no-redef]
    except ImportError:
        try:  # before the engine
            from shardwise._state import model_state  # type: ignore[no-redef]
        except ImportError:
            model_state = None  # type: ignore[assignment]
from shardwise.integrations._units import no_split_units
from shardwise.models import SmallCNN

EAGER = ("ddp", "fsdp2", "shardwise", "shardwise_unchecked", "shardwise_auto",
         "shardwise_reproducible", "shardwise_kept")
COMPILED = ("ddp_compiled", "fsdp2_compiled", "shardwise_compiled")
SYSTEMS = EAGER + COMPILED
DEFAULT_SYSTEMS = EAGER[:4]
VOCAB = 8192


class Workload:
    """How to build one workload's model (same weights at every call), its batches and its
    loss; ``units(model)`` is shardwise's ``units=`` (None: the default)."""

    def __init__(self, build, batch, loss_fn, units=lambda model: None) -> None:
        self.build, self.batch, self.loss_fn, self.units = build, batch, loss_fn, units


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(channels=(3, 32, 64, 128, 128))


def llama_wide() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128))


MICRO = 4  # micro-batches under no_sync per step of ``accum`` (--micro)


def unwrap(model: nn.Module) -> nn.Module:
    """The model ``torch.compile`` wrapped (the model itself when not compiled)."""
    return getattr(model, "_orig_mod", model)


def baseline(system: str) -> str:
    """The system ``system``'s ratios are taken against."""
    return "ddp_compiled" if system.endswith("_compiled") and system != "ddp_compiled" else "ddp"


@contextlib.contextmanager
def no_sync(model: nn.Module):
    """Each system's way of accumulating gradients without reducing them."""
    model = unwrap(model)
    if isinstance(model, DDP):
        with model.no_sync():
            yield
    elif sw.is_sharded(model):
        with sw.no_sync(model):
            yield
    else:  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)


def accumulating(batch: tuple[torch.Tensor, ...], model: nn.Module) -> torch.Tensor:
    """``MICRO`` micro-batches of one sequence under no_sync, their backward run here;
    returns the last micro-batch's loss, whose backward (run by ``System.run``) reduces."""
    parts = list(zip(*(t.split(1) for t in batch)))
    n = len(parts)
    # The reproducible mode takes the mean over the micro-batches itself and refuses a
    # loss divided by their number (Note [a divided loss]): it backpropagates each loss
    # undivided. What it returns still reads as loss / n, as the others' does, for the
    # table's loss column.
    state = model_state(unwrap(model)) if model_state is not None else None
    exact = bool(getattr(getattr(state, "settings", None), "reproducible", False))
    with no_sync(model):
        for part in parts[:-1]:
            loss = model(input_ids=part[0], labels=part[0]).loss
            (loss if exact else loss / n).backward()
    loss = model(input_ids=parts[-1][0], labels=parts[-1][0]).loss
    return (loss / n).detach() + (loss - loss.detach()) if exact else loss / n


def tokens(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(5, VOCAB, (batch, seq), generator=g)


def masked(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masked-LM batch: 15% of the tokens replaced by id 4, labels only there."""
    x = tokens(g, 8, 128)
    mask = torch.rand(x.shape, generator=g) < 0.15
    return x.masked_fill(mask, 4), x.masked_fill(~mask, -100)


def gpt_batch(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = tokens(g, 4, GPTConfig.seq_len)
    return x, torch.roll(x, -1, dims=1)


WORKLOADS = {
    "llama": Workload(llama, lambda g: (tokens(g, 4, 64),),
                      lambda m, b: m(input_ids=b[0], labels=b[0]).loss, no_split_units),
    "bert": Workload(bert, masked, lambda m, b: m(input_ids=b[0], labels=b[1]).loss),
    "cnn": Workload(cnn, lambda g: (torch.randn(32, 3, 32, 32, generator=g),
                                    torch.randint(0, 10, (32,), generator=g)),
                    lambda m, b: F.cross_entropy(m(b[0]), b[1])),
    "gpt": Workload(lambda: build(GPTConfig()), gpt_batch, call_model),
    "accum": Workload(llama_wide, lambda g: (tokens(g, MICRO + 1, 128),),
                      lambda m, b: accumulating(b, m), no_split_units),
}


def blocks(model: nn.Module, units) -> list[nn.Module]:
    """The modules shardwise makes units of, for FSDP2: those ``units`` selects, else (its
    default) the entries holding parameters of the outermost ``nn.ModuleList`` s."""
    if units is not None:
        return [m for n, m in model.named_modules() if n and units(n, m)]
    lists: list[str] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(o + ".") for o in lists):
            lists.append(name)
    return [b for n in lists for b in model.get_submodule(n)
            if any(True for _ in b.parameters())]


def wrap(name: str, w: Workload, device: torch.device, budget: int | None) -> nn.Module:
    """System ``name``'s model: built, wrapped or sharded, then compiled for a ``_compiled``
    system."""
    if name.endswith("_compiled"):
        return torch.compile(wrap(name.removesuffix("_compiled"), w, device, budget))
    model = w.build()
    units = w.units(model)
    if name == "ddp":
        return DDP(model.to(device))
    if name == "fsdp2":
        return wrap_fsdp2(model.to(device), blocks(model, units))
    if name == "shardwise_auto":
        return sw.shard(model, units="auto", memory_budget=budget)
    if name == "shardwise_reproducible":
        return sw.shard(model, units=units, reproducible=True)
    if name == "shardwise_kept":
        return sw.shard(model, units=units, reshard_after_forward=False)
    return sw.shard(model, units=units)


def make(name: str, w: Workload, device: torch.device, budget: int | None = None) -> System:
    return System(name, wrap(name, w, device, budget), device, w.loss_fn,
                  unchecked=name == "shardwise_unchecked")


def reason(e: BaseException) -> str:
    """A short cell for the table: the exception's type and the start of its message."""
    first = (str(e).strip().splitlines() or [""])[0].replace("|", "/")
    return f"{type(e).__name__}: {first[:60]}" if first else type(e).__name__


def agree(error: str | None) -> str | None:
    """This rank's error, or a note that another rank failed, or None if none did (a
    collective: every rank calls it at the same point)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    if flag.item() == 0:
        return None
    return error or "failed on another rank"


def attempt(what: str, fn, failed: dict[str, str], name: str):
    """``fn()``, or None with ``failed[name]`` set when it raised on any rank."""
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported in the table, not fatal
        error = reason(e)
        if dist.get_rank() == 0:
            print(f"{name}: {what} failed, left out:", flush=True)
            traceback.print_exc()
    error = agree(error)
    if error is not None:
        failed[name] = error
        return None
    return result


def run_all(systems: list[System], data, rounds: int, steps: int,
            failed: dict[str, str]) -> None:
    """step_time.py's ``run_rounds`` (every system in turn, the order rotating), a system
    that raises left out of the rounds after it."""
    rank = dist.get_rank()
    for r in range(rounds):
        for s in systems[r % len(systems):] + systems[:r % len(systems)]:
            if s.name in failed:
                continue
            if attempt(f"round {r + 1}", lambda s=s: s.run(data, steps) or True, failed,
                       s.name) and rank == 0:
                first = f", first step {s.times[0][0]:.1f} s" if r == 0 else ""
                print(f"  round {r + 1} {s.name:10s} median "
                      f"{statistics.median(s.times[-1]):.3f} s/step{first}", flush=True)


def table(names: list[str], systems: list[System], failed: dict[str, str],
          warmup: int) -> None:
    """One row per system, in ``names``' order: its baseline, median step time, ratios
    to the baseline per round and their median, largest loss difference from it."""
    by_name = {s.name: s for s in systems}
    print("\n| system | baseline | median s/step | ratio to baseline per round; median | "
          "max abs loss diff from baseline |\n|---|---|---|---|---|")
    for name in names:
        ref_name = baseline(name)
        if name in failed:
            print(f"| {name} | {ref_name} | n/a | n/a ({failed[name]}) | n/a |")
            continue
        s = by_name[name]
        timed = [t for r, ts in enumerate(s.times) for t in (ts[warmup:] if r == 0 else ts)]
        ref = by_name.get(ref_name)
        if ref is None or ref_name in failed:
            print(f"| {name} | {ref_name} | {statistics.median(timed):.4f} | n/a (no "
                  f"{ref_name} in this run) | n/a |")
            continue
        ratios, dl = compare(s, ref, warmup)
        print(f"| {name} | {ref_name} | {statistics.median(timed):.4f} | "
              f"{' '.join(f'{x:.3f}' for x in ratios)}; **{statistics.median(ratios):.3f}** "
              f"| {dl:.2e} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="llama,bert,cnn,gpt",
                        help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per system and round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="first-round steps not timed (the compiled systems' compile)")
    parser.add_argument("--budget", type=int, default=None,
                        help="shardwise_auto's memory_budget in bytes (default: its default)")
    parser.add_argument("--micro", type=int, default=4,
                        help="accum: micro-batches under no_sync before the synced one")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                        help=f"of {', '.join(SYSTEMS)}; ratios are to ddp (the compiled "
                             "systems': to ddp_compiled)")
    args = parser.parse_args()
    global MICRO
    MICRO = args.micro
    args.reference = "ddp"
    names = args.workloads.split(",")
    chosen = args.systems.split(",")
    if set(names) - set(WORKLOADS) or set(chosen) - set(SYSTEMS):
        parser.error("unknown workload or system")
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup (the first round's untimed steps)")
    # Every compiled model of a workload shares its classes' code objects with the others
    # (and with the previous workloads'): raise dynamo's limit of compiled variants per
    # code object, which one model alone would not reach.
    torch._dynamo.config.recompile_limit = 64
    sw.init_distributed(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    for name in names:
        w = WORKLOADS[name]
        g = torch.Generator().manual_seed(100 + rank)
        data = [w.batch(g) for _ in range(args.rounds * args.steps)]
        failed: dict[str, str] = {}
        systems = [s for s in (attempt("build", lambda n=n: make(n, w, device, args.budget),
                                       failed, n) for n in chosen) if s is not None]
        if rank == 0:
            n = sum(p.numel() for p in w.build().parameters())
            print(f"\n## {name}: {n / 1e6:.2f}M parameters", flush=True)
            for s in systems:
                model = unwrap(s.model)
                if sw.is_sharded(model):
                    view = sw.inspect(model)
                    units = [u.name for u in view.units]
                    print(f"{s.name}: {len(units)} units {units[:4]}"
                          f"{' ...' if len(units) > 4 else ''}, largest gathered "
                          f"{view.largest_gathered_bytes / 2**20:.2f} MiB", flush=True)
        run_all(systems, data, args.rounds, args.steps, failed)
        if rank == 0:
            ran = [s for s in systems if s.name not in failed]
            if ran and ran[0].name == "ddp":
                report(ran, args, world)
            table(chosen, systems, failed, args.warmup)
        del systems
        gc.collect()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
