"""QLoRA memory: what a rank holds for a frozen base in NF4, bf16 and fp32.

    OMP_NUM_THREADS=1 python benchmarks/qlora_memory.py [--world 2] [--layers 8]

For each base, ``--world`` ranks (torchrun, gloo) build the same Llama (hidden 1024,
intermediate 2816, vocabulary 8000 so that the decoder holds most of the weights, as in
a 7B model, untied head), make its decoder's linear weights
the frozen base (``quantize_nf4`` for NF4; for bf16 the whole model cast, as QLoRA's
bf16 baseline does; as built for fp32), add PEFT
LoRA adapters (r 16 on q_proj and v_proj), shard it, and run 3 AdamW steps on 2
sequences of 128 tokens. Each rank reports, from ``sw.inspect``, its bytes of the frozen
base's shards (packed bytes for NF4), its bytes of all parameter shards, the largest
decoder layer while gathered, and its peak RSS during steps 2-3 above its RSS before
them (``VmHWM``, reset through ``/proc/self/clear_refs``). The table shows rank 0.

Every rank builds the full-precision model before quantizing or sharding it: the
construction peak is the unsharded model's and is not what this measures (docs/qlora.md:
limits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from procstat import reset_peak, status_mib

BASES = ("nf4", "bf16", "fp32")


def _model(base: str, layers: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.integrations.quant import quantize_nf4

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
        tie_word_embeddings=False))
    if base == "nf4":
        quantize_nf4(model.model.layers)
    elif base == "bf16":  # the whole base; PEFT keeps its adapters in fp32
        model.to(torch.bfloat16)
    return get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))


def child(base: str, layers: int) -> None:
    import torch

    import shardwise as sw

    sw.init_distributed()
    rank = torch.distributed.get_rank()
    model = sw.shard(_model(base, layers))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    before = 0.0
    for step in range(3):
        if step == 1:
            before = status_mib("VmRSS")
            reset_peak()
        x = torch.randint(0, 8000, (2, 128), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    peak = status_mib("VmHWM") - before
    view = sw.inspect(model)
    frozen = view.packed_bytes + sum(
        gv.shard_bytes for u in view.units for gv in u.groups
        if not gv.requires_grad and any("layers" in p.name and "proj" in p.name
                                        for p in gv.params))
    base_numel = sum(p.numel for u in view.units for gv in u.groups for p in gv.params
                     if not gv.requires_grad and "layers" in p.name and "proj" in p.name)
    base_numel += sum(pv.numel for u in view.units for pv in u.packed)
    if rank == 0:
        print(json.dumps({"base": base, "world": view.world_size, "frozen_base": frozen,
                          "base_numel": base_numel, "params": view.param_bytes,
                          "largest_unit": max(u.gathered_bytes for u in view.units
                                              if "layers" in u.name),
                          "peak_mib": peak}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--child", choices=BASES)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.layers)
        return
    rows = []
    for base in BASES:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={args.world}", __file__, "--child", base,
             "--layers", str(args.layers)],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
            check=False)
        if out.returncode:
            sys.exit(f"{base} failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"world {args.world}, {args.layers} layers; per rank (rank 0):")
    print(f"{'base':6s} {'base shard MiB':>15s} {'bytes/element':>14s} {'all params MiB':>15s} "
          f"{'one layer MiB':>17s} {'peak RSS in steps MiB':>22s}")
    mib = 2**20
    for r in rows:
        per = r["frozen_base"] * r["world"] / r["base_numel"]
        print(f"{r['base']:6s} {r['frozen_base'] / mib:15.1f} {per:14.3f} "
              f"{r['params'] / mib:15.1f} {r['largest_unit'] / mib:17.1f} "
              f"{r['peak_mib']:22.1f}")


if __name__ == "__main__":
    main()
