"""QLoRA from a base bigger than memory: quantize while loading, then train (issue 43).

    # write a Llama of random bf16 weights as Hugging Face sharded safetensors
    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py write FOLDER --preset 13b [--layers 40]
    # 2 ranks (torchrun, gloo): build under sw.sharded_init(quantize="nf4"), add LoRA,
    # shard, sw.load_pretrained, train; one JSON line per rank
    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py run FOLDER [--world 2] [--steps 3]
    # both, at two depths, with a table (the small scale used while developing)
    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py sweep FOLDER --preset small --layers 4 8

``write`` never holds the model: it computes every tensor's shape from the config (a
model on the meta device), writes each safetensors file's header first and then each
tensor as it is drawn (normal, std 0.02, one generator per tensor so the weights do not
depend on the file split), into ``*.partial`` files renamed once complete, with the index
written last: an interrupted write leaves no folder that looks loadable. It refuses to
start without the room it needs (plus 2 GiB), and prints its progress.

``run`` reports per rank: the peak RSS (``VmHWM``, the whole run; the files are read with
plain reads, so no mapped file pages count), the RSS after ``init_distributed`` and the
imports (the constant), the NF4 share (``sw.inspect``'s packed bytes), the largest
decoder layer in full precision (bf16), and the target: NF4 share + that layer + the
constant + this rank's share of the full-precision parameters (embeddings, head, norms)
and of the adapters' training state. Times: build (sharded_init), shard, load, each step.

The run of issue 43, on a quiet machine (bf16 weights larger than its memory at 40
layers; 12.4 + 24.2 GiB of files, about an hour or more in all, most of it loading and
the steps):

    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py sweep /work/qlora-13b \
        --preset 13b --layers 20 40 --steps 2

Presets (Llama shapes, untied head, vocabulary 32000 unless said):
  small: hidden 2048, intermediate 5632, 16 heads      (0.34B at 4 layers, 0.54B at 8)
  13b:   hidden 5120, intermediate 13824, 40 heads     (13.0B at 40 layers: 26.0 GB bf16)
  vocab: hidden 1024, intermediate 2816, 8 heads, vocabulary 128256 (0.29B at 2 layers,
         0.26B of it the embeddings and the head)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib

from procstat import status_mib

PRESETS = {
    "small": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16,
              "num_key_value_heads": 16, "layers": 8},
    "13b": {"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
            "num_key_value_heads": 40, "layers": 40},
    # Llama 3's vocabulary on a narrow model: the embeddings and the head dominate
    # (benchmarks/qlora_phases.py).
    "vocab": {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8,
              "num_key_value_heads": 8, "layers": 2, "vocab_size": 128256},
}
SHARD_BYTES = 2 * 2**30  # per safetensors file, as Hugging Face's default 2 GB shards


def _config(preset: str, layers: int):
    from transformers import LlamaConfig

    p = dict(PRESETS[preset])
    p.pop("layers")
    p.setdefault("vocab_size", 32000)
    return LlamaConfig(num_hidden_layers=layers, max_position_embeddings=512,
                       tie_word_embeddings=False, **p)


def _shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def write(folder: str, preset: str, layers: int) -> None:
    import torch

    config = _config(preset, layers)
    shapes = _shapes(config)
    total = sum(math.prod(s) * 2 for _, s in shapes)
    if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        print(f"{folder}: already written ({total / 1e9:.1f} GB)", flush=True)
        return
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < total + 2 * 2**30:
        sys.exit(f"{folder}: {total / 2**30:.1f} GiB to write, {free / 2**30:.1f} GiB free")
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = math.prod(shape) * 2
        if files[-1] and size + n > SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += n
    print(f"writing {len(shapes)} tensors, {sum(math.prod(s) for _, s in shapes) / 1e9:.2f}B "
          f"parameters, {total / 2**30:.1f} GiB in {len(files)} files to {folder}", flush=True)
    weight_map = {}
    start, done = time.perf_counter(), 0
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key, shape in tensors:
            n = math.prod(shape) * 2
            header[key] = {"dtype": "BF16", "shape": list(shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        partial = os.path.join(folder, name + ".partial")
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for key, shape in tensors:
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                rows = max(1, 2**24 // max(1, math.prod(shape[1:])))  # 64 MiB of fp32
                for r in range(0, shape[0], rows):
                    part = torch.randn((min(rows, shape[0] - r), *shape[1:]), generator=g)
                    if key.endswith("norm.weight"):
                        part = part * 0.02 + 1.0
                    else:
                        part *= 0.02
                    f.write(part.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
                done += math.prod(shape) * 2
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, os.path.join(folder, name))
        el = time.perf_counter() - start
        print(f"  {name}: {done / 2**30:.1f}/{total / 2**30:.1f} GiB, {el:.0f} s, "
              f"{done / 2**20 / el:.0f} MiB/s", flush=True)
    config.save_pretrained(folder)
    with open(os.path.join(folder, "model.safetensors.index.json.partial"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    os.replace(os.path.join(folder, "model.safetensors.index.json.partial"),
               os.path.join(folder, "model.safetensors.index.json"))
    print(f"written in {time.perf_counter() - start:.0f} s", flush=True)


def _peft_names(key: str) -> str:
    """A Hugging Face key as the PeftModel names it (LoRA wraps q_proj and v_proj)."""
    for m in ("q_proj", "v_proj"):
        key = key.replace(f".{m}.", f".{m}.base_layer.")
    return "base_model.model." + key


def child(folder: str, steps: int, seq: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, LlamaForCausalLM

    import shardwise as sw

    sw.init_distributed()
    import shardwise.integrations.quant  # noqa: F401 - torchao, counted in the constant

    rank = torch.distributed.get_rank()
    constant = status_mib("VmRSS")
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else \
        (lambda *a: None)
    config = AutoConfig.from_pretrained(folder)
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)  # the base in bf16, as the source
    with sw.sharded_init(quantize="nf4"):
        base = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)  # the adapters in fp32, as PEFT keeps them
    build_s = time.perf_counter() - t
    say(f"built under sharded_init in {build_s:.0f} s, RSS {status_mib('VmRSS'):.0f} MiB")
    t = time.perf_counter()
    model = sw.shard(get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0)))
    shard_s = time.perf_counter() - t
    say(f"sharded in {shard_s:.0f} s, RSS {status_mib('VmRSS'):.0f} MiB; loading")
    t = time.perf_counter()
    sw.load_pretrained(model, folder, rename=_peft_names, strict=False)
    load_s = time.perf_counter() - t
    load_peak = status_mib("VmHWM")
    after_load = status_mib("VmRSS")
    say(f"loaded in {load_s:.0f} s, peak RSS so far {load_peak:.0f} MiB; training")
    step_s, losses = train(model, config.vocab_size, steps, seq, rank, say)
    view = sw.inspect(model)
    # The largest unit in full precision (bf16): a decoder layer, or the root's
    # embeddings and head, whichever is larger.
    layer_numel = max(sum(p.numel for gv in u.groups for p in gv.params)
                      + sum(pv.numel for pv in u.packed) for u in view.units)
    plain = sum(gv.shard_bytes for u in view.units for gv in u.groups)
    adam = 2 * sum(gv.shard_bytes for u in view.units for gv in u.groups if gv.requires_grad)
    mib = 2**20
    target = constant + (view.packed_bytes + 2 * layer_numel + plain + adam) / mib
    # One write of the whole line: ranks share the pipe, and print's two writes (the text,
    # then the newline) of two ranks can interleave into one unparsable line.
    sys.stdout.write(json.dumps({
        "rank": rank, "world": view.world_size, "layers": config.num_hidden_layers,
        "params_b": round(sum(math.prod(s) for _, s in _shapes(config)) / 1e9, 3),
        "peak_mib": round(status_mib("VmHWM")), "load_peak_mib": round(load_peak),
        "constant_mib": round(constant), "nf4_share_mib": round(view.packed_bytes / mib),
        "unit_bf16_mib": round(2 * layer_numel / mib), "after_load_mib": round(after_load),
        "file_mib": round(status_mib("RssFile")),
        "plain_share_mib": round(plain / mib), "adam_mib": round(adam / mib),
        "target_mib": round(target), "build_s": round(build_s, 1),
        "shard_s": round(shard_s, 1), "load_s": round(load_s, 1),
        "step_s": [round(s, 3) for s in step_s], "losses": losses}) + "\n")
    sys.stdout.flush()


def train(model, vocab: int, steps: int, seq: int, seed: int,
          say=lambda line: None) -> tuple[list[float], list[float]]:
    """``steps`` AdamW steps of the adapters on one random sequence of ``seq`` tokens each
    (this benchmark's and qlora_anchor_bnb.py's); each step's seconds and loss."""
    import torch

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    step_s, losses = [], []
    for step in range(steps):
        t = time.perf_counter()
        x = torch.randint(0, vocab, (1, seq), generator=g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t)
        losses.append(loss.item())
        say(f"step {step}: {step_s[-1]:.1f} s, loss {losses[-1]:.3f}, "
            f"peak RSS {status_mib('VmHWM'):.0f} MiB")
    return step_s, losses


def run(folder: str, world: int, steps: int, seq: int, script: str = __file__,
        env: dict[str, str] | None = None) -> list[dict]:
    """``script``'s ``child`` at ``world`` ranks under torchrun (this file's by default),
    its JSON lines collected and echoed by rank; ``env`` adds to the environment."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={world}", script, "child", folder, "--steps", str(steps),
         "--seq", str(seq)],
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
             "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                            os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode:
        sys.exit(f"run failed (exit {out.returncode}); its stderr is above")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for r in sorted(rows, key=lambda r: r["rank"]):
        print(json.dumps(r), flush=True)
    return rows


def table(rows: list[dict]) -> None:
    print(f"{'layers':>6s} {'params':>7s} {'rank':>4s} {'peak RSS':>9s} {'target':>7s} "
          f"{'NF4 share':>9s} {'1 unit bf16':>12s} {'constant':>8s} {'load s':>7s} "
          f"{'step s':>7s}  (MiB)")
    for r in sorted(rows, key=lambda r: (r["layers"], r["rank"])):
        print(f"{r['layers']:6d} {r['params_b']:6.2f}B {r['rank']:4d} {r['peak_mib']:9d} "
              f"{r['target_mib']:7d} {r['nf4_share_mib']:9d} {r['unit_bf16_mib']:12d} "
              f"{r['constant_mib']:8d} {r['load_s']:7.1f} {r['step_s'][-1]:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["write", "run", "sweep", "child"])
    ap.add_argument("folder")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--layers", type=int, nargs="+")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    layers = args.layers or [PRESETS[args.preset]["layers"]]
    if args.what == "child":
        child(args.folder, args.steps, args.seq)
    elif args.what == "write":
        write(args.folder, args.preset, layers[0])
    elif args.what == "run":
        table(run(args.folder, args.world, args.steps, args.seq))
    else:
        rows = []
        for n in layers:
            sub = os.path.join(args.folder, f"{args.preset}-{n}")
            write(sub, args.preset, n)
            rows += run(sub, args.world, args.steps, args.seq)
        table(rows)


if __name__ == "__main__":
    main()
