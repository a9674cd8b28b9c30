"""The frozen-tokenizer case that motivated shardwise, and the two right ways to do it.

    torchrun --standalone --nproc_per_node 2 examples/frozen_tokenizer.py

A frozen video tokenizer (Conv3d + BatchNorm3d layers + a codebook,
``shardwise.demo.video_tokenizer``, which ``shardwise demo`` shows too) turns clips into tokens
that a sharded transformer learns to model. Its pretrained weights, with trained
BatchNorm running statistics, come from a safetensors file.

0. The incumbents' failure, re-enacted: the weights are loaded on rank 0 only, then the
   parameters (not the buffers) are broadcast, as DeepSpeed ZeRO-3's gather does on exit.
   Other ranks keep the default statistics (mean 0, var 1) and the same clip becomes
   different tokens on each rank. shardwise does not partition this model behind your
   back, and ``sw.check_consistency`` says loudly what differs.
1. Keep the tokenizer whole on every rank, load it on every rank, beside a trainable
   sharded transformer. ``sw.shard`` touches only the transformer.
2. Shard the tokenizer on its own for inference: ``sw.shard`` gives every rank
   ``src_rank``'s parameters *and* buffers.

Either way the tokens are identical on every rank and equal to an unsharded reference.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import shardwise as sw
from shardwise.demo.video_tokenizer import (
    CLIP,
    VideoTokenizer,
    clips,
    load_on_rank0_only,
    write_pretrained,
)
from shardwise.models import GPT, GPTConfig


def gather_all(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    sw.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    workdir = [tempfile.mkdtemp(prefix="shardwise-tokenizer-") if rank == 0 else None]
    dist.broadcast_object_list(workdir)
    path = os.path.join(workdir[0], "tokenizer.safetensors")
    if rank == 0:
        write_pretrained(path)
    dist.barrier()

    probe = clips(2, seed=7)
    reference = VideoTokenizer().eval()  # unsharded, loaded from the file on this rank
    reference.load_state_dict(load_file(path))
    expected = reference(probe)
    result: dict[str, object] = {}

    # 0. The failure, re-enacted: weights loaded on rank 0 only.
    naive = VideoTokenizer().eval()
    load_on_rank0_only(naive, load_file(path))
    naive_tokens = gather_all(naive(probe))
    result["naive_tokens_agree"] = all(torch.equal(t, naive_tokens[0]) for t in naive_tokens)
    try:
        sw.check_consistency(naive)
        result["naive_error"] = None
    except sw.DivergenceError as e:
        result["naive_error"] = str(e)
        say(f"0. loaded on rank 0 only -> tokens agree across ranks: "
            f"{result['naive_tokens_agree']}; check_consistency says:\n{e}\n")

    # 1. Whole frozen tokenizer on every rank, beside a sharded trainable transformer.
    tokenizer = VideoTokenizer()
    tokenizer.load_state_dict(load_file(path))  # every rank loads
    tokenizer.requires_grad_(False).eval()
    torch.manual_seed(0)
    lm = sw.shard(GPT(GPTConfig(vocab_size=64, seq_len=31, n_layer=2, n_head=2, d_model=32)))
    assert not sw.is_sharded(tokenizer), "shard(lm) must not touch the tokenizer"
    sw.check_consistency(tokenizer)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own clips
    for step in range(args.steps):
        tokens = tokenizer(torch.rand(4, *CLIP, generator=g))  # (4, 32)
        loss = lm(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        say(f"1. step {step}: language-model loss {loss.item():.3f}")
    tokens1 = gather_all(tokenizer(probe))
    result["way1_ok"] = all(torch.equal(t, expected) for t in tokens1)
    sw.check_consistency(tokenizer)

    # 2. The tokenizer sharded on its own, for inference. Loading on src_rank suffices:
    #    shard() hands every rank src_rank's parameters and buffers.
    sharded = VideoTokenizer()
    if rank == 0:
        sharded.load_state_dict(load_file(path))
    sharded = sw.shard(sharded).eval()
    sw.check_consistency(sharded)
    tokens2 = gather_all(sharded(probe))
    result["way2_ok"] = all(torch.equal(t, expected) for t in tokens2)
    say(f"1. whole tokenizer: tokens equal the reference on all {world} ranks: "
        f"{result['way1_ok']}")
    say(f"2. sharded tokenizer: tokens equal the reference on all {world} ranks: "
        f"{result['way2_ok']}")
    dist.barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(workdir[0])
    return result


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
