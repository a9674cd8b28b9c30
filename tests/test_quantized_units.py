"""A quantized base's default units (Note [the embeddings' own units] in
planning/units.py): the input embeddings and an untied head are units of their own, each
gathered alone and resharded after its forward, and training still matches the same
quantized model trained in one process. A tied head, a model without a quantized base and
an explicit ``units=`` keep the units they had."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from harness import run_ranks
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.planning.units import choose_units

if importlib.util.find_spec("torchao") is None:  # not importorskip: torchao's import is noisy
    pytest.skip("torchao is not installed (shardwise[quant])", allow_module_level=True)
from test_quantized import _qlora, _qlora_default  # noqa: E402

EMBED, HEAD = "base_model.model.model.embed_tokens", "base_model.model.lm_head"


def _own_units(rank, world):
    model = sw.shard(_qlora())
    view = sw.inspect(model)
    names = [u.name for u in view.units]
    assert names == ["<root>", EMBED, "base_model.model.model.layers.0",
                     "base_model.model.model.layers.1", HEAD], names
    # Each owns its weight, and the root keeps the final norm only.
    assert [p.name for g in view.unit(EMBED).groups for p in g.params] == \
        [f"{EMBED}.weight"]
    assert [p.name for g in view.unit(HEAD).groups for p in g.params] == [f"{HEAD}.weight"]
    assert [p.name for g in view.unit("<root>").groups for p in g.params] == \
        ["base_model.model.model.norm.weight"]
    # While the head computes, the embeddings are resharded: never both gathered.
    inner = model.base_model.model
    seen = []
    inner.lm_head.register_forward_pre_hook(lambda m, a: seen.append(
        (isinstance(inner.model.embed_tokens.weight, DTensor),
         isinstance(inner.lm_head.weight, DTensor))))
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=x, labels=x).loss.backward()
    assert seen == [(True, False)], seen
    # An explicit units= is taken as given.
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    given = sw.shard(_qlora(), units=LlamaDecoderLayer)
    assert [u.name for u in sw.inspect(given).units] == [
        "<root>", "base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    # Training with the new units matches one process (test_quantized.py's bound).
    return _qlora_default(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_a_quantized_base_gives_the_embeddings_and_the_head_units_of_their_own(world):
    worst = run_ranks(_own_units, world)
    assert len(set(worst)) == 1, worst  # every rank holds the same adapters


def test_tied_or_full_precision_models_keep_the_default_units():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.integrations.quant import quantize_nf4

    def names(tie: bool, quantize: bool) -> list[str]:
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=tie))
        if quantize:
            quantize_nf4(base, block_size=32, scaler_block_size=8)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        return [n for n, _ in choose_units(model, None)]

    blocks = ["", "base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    assert names(tie=False, quantize=False) == blocks  # no quantized base: as before
    # Tied: the head's weight is the embeddings', owned by the root, so neither module
    # owns anything of its own and neither becomes a unit.
    assert names(tie=True, quantize=True) == blocks
    assert names(tie=False, quantize=True) == ["", EMBED, *blocks[1:], HEAD]
