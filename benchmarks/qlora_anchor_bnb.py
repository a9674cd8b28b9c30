"""The PEFT + bitsandbytes anchor for benchmarks/qlora_load.py: the same files, one process.

Loads a folder written by ``benchmarks/qlora_load.py write`` with Hugging Face
``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4"))`` on the CPU, adds the same LoRA adapters (r 16 on q_proj
and v_proj, no dropout), trains a few steps as ``qlora_load.py child`` does (one
sequence of random tokens, AdamW over the adapters) and prints one JSON line: the peak
RSS (``VmHWM``) after loading and after the steps, the RSS after the imports (the
constant), and the bytes bitsandbytes keeps per quantized weight. ``from_pretrained``
reads the safetensors files through a memory map, which the model keeps (its bf16
weights are views of it): the pages read count in ``VmHWM`` although the kernel may drop
them. So a sampler thread (every 50 ms) also reports the largest RSS of the
``*.safetensors`` mappings and the largest RSS less those pages (comparable with
``qlora_load.py``, which reads the files with plain reads).

It needs bitsandbytes, which shardwise does not depend on: run it from a separate
environment with the same torch, transformers, PEFT and accelerate (bitsandbytes 0.50.2
quantizes NF4 on the CPU with torch 2.13):

    python3.11 -m venv bnbvenv && bnbvenv/bin/pip install torch==2.13.0
    bnbvenv/bin/pip install transformers==5.24.0 peft==0.21.2 accelerate==1.16.0 \\
        safetensors==0.8.0 bitsandbytes==0.50.2
    OMP_NUM_THREADS=1 python benchmarks/qlora_load.py write FOLDER --preset small --layers 4
    OMP_NUM_THREADS=1 bnbvenv/bin/python benchmarks/qlora_anchor_bnb.py FOLDER --steps 2

The base is kept as written (bf16; the head and norms too), without PEFT's
``prepare_model_for_kbit_training``, which would upcast the head, the embeddings and the
norms to fp32: the same model as shardwise's run. PEFT + bitsandbytes is one device's
model; under DDP each rank holds all of it, so N ranks on one host take N times this.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from procstat import status_mib
from qlora_load import train


def _mapped_weights_mib() -> float:
    """The RSS of this process's mappings of ``*.safetensors`` files, in MiB."""
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if not head.endswith(":"):  # a mapping's first line: range, perms, ..., path
                counting = line.rstrip().endswith(".safetensors")
            elif counting and head == "Rss:":
                total += int(line.split()[1])
    return total / 1024


class _FilePeak:
    """The largest RSS of mapped safetensors files, and of the rest, seen (every 50 ms)."""

    def __init__(self) -> None:
        self.peak = self.rest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            mapped = _mapped_weights_mib()
            self.peak = max(self.peak, mapped)
            self.rest = max(self.rest, status_mib("VmRSS") - mapped)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--double-quant", type=int, default=1,
                    help="bnb_4bit_use_double_quant (1, as QLoRA; torchao's NF4 also "
                         "quantizes its scales)")
    args = ap.parse_args()

    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, BitsAndBytesConfig, LlamaForCausalLM

    constant = status_mib("VmRSS")
    files = _FilePeak()
    config = AutoConfig.from_pretrained(args.folder)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_use_double_quant=bool(args.double_quant))
    t = time.perf_counter()
    base = LlamaForCausalLM.from_pretrained(args.folder, quantization_config=quant,
                                            dtype=torch.bfloat16, device_map="cpu")
    load_s = time.perf_counter() - t
    load_peak, load_file_peak, load_rest = status_mib("VmHWM"), files.peak, files.rest
    quantized = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not quantized:
        raise SystemExit("from_pretrained quantized nothing: is bitsandbytes' CPU backend there?")
    # What one quantized weight costs: the packed codes and its quantization state.
    nf4_bytes = 0
    for m in quantized:
        w = m.weight
        nf4_bytes += w.numel() * w.element_size()
        qs = w.quant_state
        nf4_bytes += qs.absmax.numel() * qs.absmax.element_size()
        if qs.state2 is not None:
            nf4_bytes += qs.state2.absmax.numel() * qs.state2.absmax.element_size()
    quantized_numel = sum(m.in_features * m.out_features for m in quantized)
    plain = sum(p.numel() * p.element_size() for n, p in base.named_parameters()
                if not isinstance(p, bnb.nn.Params4bit))
    params = quantized_numel + sum(p.numel() for p in base.parameters()
                                   if not isinstance(p, bnb.nn.Params4bit))

    model = get_peft_model(base, LoraConfig(r=16, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    step_s, losses = train(model, config.vocab_size, args.steps, args.seq, 0)
    mib = 2**20
    print(json.dumps({
        "system": "peft+bitsandbytes", "bitsandbytes": bnb.__version__,
        "torch": torch.__version__, "layers": config.num_hidden_layers,
        "params_b": round(params / 1e9, 3),
        "peak_mib": round(status_mib("VmHWM")), "load_peak_mib": round(load_peak),
        "mapped_peak_mib": round(files.stop()), "load_mapped_peak_mib": round(load_file_peak),
        "mapped_end_mib": round(_mapped_weights_mib()),
        "unmapped_peak_mib": round(files.rest), "load_unmapped_peak_mib": round(load_rest),
        "constant_mib": round(constant), "nf4_mib": round(nf4_bytes / mib),
        "nf4_bytes_per_element": round(nf4_bytes / quantized_numel, 4),
        "plain_mib": round(plain / mib), "load_s": round(load_s, 1),
        "step_s": [round(s, 3) for s in step_s], "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
