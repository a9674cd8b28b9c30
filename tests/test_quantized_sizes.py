"""NF4 weights of every size shard with the default blocks (issue 51, item 5).

With the default blocks (64 elements, 256 blocks of scales) a weight of 16384 elements
has one block of scales, and torchao stores its ``quantization_factor`` as a one-element
view of stride 256; a weight divided by bytes may give a rank a piece of one element or
none. ``sw.shard`` used to raise torch's "self.stride(-1) must be 1 to view Float as Byte"
on them (a Llama 128 wide at 2 and 3 ranks), both after ``quantize_nf4`` and when
quantizing while loading (``_as_bytes`` in engine/groups/subclass.py).

The sweep: Llamas of one decoder layer, hidden sizes 64 to 512, at 1 to 4 ranks (one
group per world size, every size in it). Their linear weights hold 1 to 16 blocks of
scales, split evenly or divided by bytes. Each model is quantized both ways, sharded, and
must give the unsharded quantized model's logits bit for bit, and its NF4 bytes."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

import shardwise as sw

if importlib.util.find_spec("torchao") is None:  # not importorskip: torchao's import is noisy
    pytest.skip("torchao is not installed (shardwise[quant])", allow_module_level=True)
from shardwise.integrations.quant import NF4, nf4_module, quantize_nf4  # noqa: E402

HIDDEN = (64, 128, 192, 256, 320, 512)
PER_SCALER_BLOCK = 64 * 256  # the default blocks: elements under one block of scales


def _config(hidden: int):
    from transformers import LlamaConfig

    # One key-value head of two: k and v have hidden / 2 rows. With intermediate 256 the
    # weights hold 1 (64, 128: the failing size), 2, 3, 4, 5, 8 and 16 blocks of scales.
    return LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=256,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=32)


def _whole_blocks(name: str, mod: nn.Module) -> bool:
    """Every linear the default blocks can hold, but the head (hidden 64's q_proj, of
    4096 elements, cannot)."""
    return (isinstance(mod, nn.Linear) and not name.endswith("lm_head")
            and (mod.in_features * mod.out_features) % PER_SCALER_BLOCK == 0)


def _weights(hidden: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(hidden)
    return LlamaForCausalLM(_config(hidden))


def _bytes(t: torch.Tensor) -> bytes:
    # contiguous_format: clone() keeps the stride of a one-element view (NF4's
    # quantization_factor with one block of scales), which view(uint8) refuses.
    return (t.detach().reshape(-1).clone(memory_format=torch.contiguous_format)
            .view(torch.uint8).numpy().tobytes())


def _nf4_bytes(model: nn.Module) -> dict[str, bytes]:
    """Every NF4 weight's inner tensors, whole (a collective on a sharded model)."""
    nf4 = nf4_module().NF4Tensor
    out = {}
    state = (sw.full_state_dict(model, rank0_only=False) if sw.is_sharded(model)
             else model.state_dict())
    for k, v in state.items():
        if isinstance(v, nf4):
            names, _ = v.__tensor_flatten__()
            out.update({f"{k}/{n}": _bytes(getattr(v, n)) for n in names})
    return out


def _sweep(rank, world):
    from transformers import LlamaForCausalLM

    nf4 = nf4_module().NF4Tensor
    blocks = set()
    for hidden in HIDDEN:
        weights = _weights(hidden)
        ref = copy.deepcopy(weights)
        quantized = quantize_nf4(ref, where=_whole_blocks)
        assert quantized, hidden
        blocks |= {ref.get_parameter(n).quantization_factor.numel() for n in quantized}
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            expect = ref(input_ids=x).logits
        want = _nf4_bytes(ref)

        # quantize_nf4, then shard.
        model = copy.deepcopy(weights)
        quantize_nf4(model, where=_whole_blocks)
        sw.shard(model)
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, expect), (hidden, "quantize_nf4")
        assert _nf4_bytes(model) == want, (hidden, "quantize_nf4")

        # Quantized while loading.
        with sw.sharded_init(quantize=NF4(where=_whole_blocks)):
            loaded = LlamaForCausalLM(_config(hidden))
        assert isinstance(loaded.model.layers[0].mlp.down_proj.weight, nf4)
        sw.shard(loaded)
        sw.load_pretrained(loaded, weights.state_dict())
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=x).logits, expect), (hidden, "loaded")
        assert _nf4_bytes(loaded) == want, (hidden, "loaded")
    assert blocks >= {1, 2, 3, 4, 5, 8, 16}, sorted(blocks)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_nf4_of_every_size_shards_with_default_blocks(world):
    assert run_ranks(_sweep, world) == [True] * world
