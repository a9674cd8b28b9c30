"""QLoRA's peak memory in every phase against one target (issue 54).

    OMP_NUM_THREADS=1 python benchmarks/qlora_phases.py FOLDER [--world 2 3] \
        [--layers 2 4] [--preset vocab] [--steps 2]

For each depth, writes a Llama of random bf16 weights as Hugging Face safetensors under
FOLDER (``qlora_load.py write``; the ``vocab`` preset: hidden 1024, vocabulary 128256,
untied head, so that the embeddings and the head, 501 MiB each in fp32, outweigh a decoder
layer ten times), then, at each world size (torchrun, gloo), every rank:

1. builds it in fp32 under ``sw.sharded_init(quantize="nf4")``;
2. adds PEFT LoRA (r 16 on q_proj and v_proj) and ``sw.shard`` s it;
3. ``sw.load_pretrained`` s the files (quantizing while loading);
4. trains ``--steps`` AdamW steps of the adapters on one sequence of 64 tokens.

Before each phase the peak RSS is restarted from the current RSS (``VmHWM``, reset
through ``/proc/self/clear_refs``); after it, the phase's peak is read. The target is the
issue's: the constant (RSS after the imports and ``init_distributed``) + the rank's NF4
share + its share of the full-precision parameters (embeddings, head, norms, adapters)
and of the adapters' AdamW state + the largest of a decoder layer, the embeddings and
the head in full precision (what one unit gathered whole holds), plus 10%. It does not
depend on the units chosen, so runs of two commits compare. One JSON line per rank and
depth, then a table of the ratio peak / target per phase (the worst rank).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from procstat import reset_peak, status_mib
from qlora_load import _config, _peft_names, write
from qlora_load import run as run_ranks_of

MIB = 2**20


def child(folder: str, steps: int, seq: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM

    import shardwise as sw

    sw.init_distributed()
    import shardwise.integrations.quant  # noqa: F401 - torchao, counted in the constant

    rank = torch.distributed.get_rank()
    config = AutoConfig.from_pretrained(folder)
    constant = status_mib("VmRSS")
    peaks: dict[str, float] = {}
    times: dict[str, float] = {}

    def phase(name: str, fn):
        torch.distributed.barrier()
        reset_peak()
        t = time.perf_counter()
        out = fn()
        torch.distributed.barrier()
        times[name] = round(time.perf_counter() - t, 1)
        peaks[name] = status_mib("VmHWM")
        return out

    def build():
        with sw.sharded_init(quantize="nf4"):
            return LlamaForCausalLM(config)

    base = phase("sharded_init", build)
    lora = LoraConfig(r=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = phase("shard", lambda: sw.shard(get_peft_model(base, lora)))
    phase("load", lambda: sw.load_pretrained(model, folder, rename=_peft_names, strict=False))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(rank)

    def train():
        for _ in range(steps):
            x = torch.randint(0, config.vocab_size, (1, seq), generator=g)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

    phase("train", train)
    view = sw.inspect(model)
    plain = sum(gv.shard_bytes for u in view.units for gv in u.groups)
    adam = 2 * sum(gv.shard_bytes for u in view.units for gv in u.groups if gv.requires_grad)
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = h * config.num_key_value_heads // config.num_attention_heads
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # attention, MLP, two norms
    biggest = 4 * max(layer, v * h)  # fp32: a decoder layer, or the embeddings (= head)
    target = 1.1 * (constant + (view.packed_bytes + plain + adam + biggest) / MIB)
    row = {
        "rank": rank, "world": view.world_size, "layers": config.num_hidden_layers,
        "units": [u.name for u in view.units], "constant_mib": round(constant),
        "nf4_share_mib": round(view.packed_bytes / MIB), "plain_share_mib": round(plain / MIB),
        "adam_mib": round(adam / MIB), "biggest_unit_mib": round(biggest / MIB),
        "target_mib": round(target), "peak_mib": {k: round(p) for k, p in peaks.items()},
        "seconds": times}
    rows: list = [None] * view.world_size
    torch.distributed.all_gather_object(rows, row)  # one writer: lines never interleave
    if rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)


def run(folder: str, world: int, steps: int, seq: int) -> list[dict]:
    return run_ranks_of(folder, world, steps, seq, script=__file__,
                        env={"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})


def table(rows: list[dict]) -> None:
    phases = ("sharded_init", "shard", "load", "train")
    print("| world | layers | target (MiB) | " + " | ".join(phases)
          + " |  (worst rank: peak MiB, peak / target)")
    keys = sorted({(r["world"], r["layers"]) for r in rows})
    for world, layers in keys:
        mine = [r for r in rows if (r["world"], r["layers"]) == (world, layers)]
        cells = []
        for ph in phases:
            worst = max(mine, key=lambda r: r["peak_mib"][ph] / r["target_mib"])
            peak = worst["peak_mib"][ph]
            cells.append(f"{peak} ({peak / worst['target_mib']:.2f}x)")
        target = "/".join(str(r["target_mib"]) for r in sorted(mine, key=lambda r: r["rank"]))
        print(f"| {world} | {layers} | {target} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["sweep", "child"])
    ap.add_argument("folder")
    ap.add_argument("--preset", default="vocab")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    if args.what == "child":
        child(args.folder, args.steps, args.seq)
        return
    rows = []
    for n in args.layers:
        sub = os.path.join(args.folder, f"{args.preset}-{n}")
        write(sub, args.preset, n)
        assert _config(args.preset, n).num_hidden_layers == n
        for world in args.world:
            rows += run(sub, world, args.steps, args.seq)
    table(rows)


if __name__ == "__main__":
    main()
