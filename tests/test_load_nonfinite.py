"""NaN and inf refused by ``sw.load_pretrained`` (issue 51, item 3; Note [non-finite
values refused] in checkpoint/pretrained.py).

They used to load without a word, quantized or not, and the first loss was NaN. Now a
parameter holding NaN or inf, or a buffer holding NaN, is refused on every rank, naming
the tensors and counting their values, before anything changes; a quantized weight is
refused at its round of quantizing, and the model then refuses to run until a load
completes. ``allow_nonfinite=True`` loads them as they are. An inf in a buffer (an
attention mask) is no error."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn as nn
from harness import run_ranks

import shardwise as sw


class Net(nn.Module):
    """Two units of 8-row weights (3, 3 and 2 rows a rank at 3 ranks), a norm with
    running statistics, and a mask buffer of -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.norm(x) + self.mask.softmax(-1).sum()


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _bytes(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """Bitwise: a NaN equals itself."""
    return {k: v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for k, v in state.items()}


def _plain(rank, world):
    model = sw.shard(_net(0))
    before = _bytes(sw.full_state_dict(model, rank0_only=False))
    bad = _net(1).state_dict()
    bad["blocks.0.weight"][6:] = float("nan")            # rank 2's rows only
    bad["blocks.0.weight"][7, 0] = float("-inf")
    bad["blocks.1.weight"][0, 0] = float("inf")          # rank 0's rows
    bad["blocks.1.weight"][4, 1] = float("nan")          # rank 1's rows
    # Each rank read only its own rows; the refusal is the same on every rank, with the
    # counts of all of them, and nothing changed.
    with pytest.raises(sw.ShardwiseError, match=(
            r"refused the given state dict: 2 tensors hold values that are NaN or inf \(in the "
            r"model's dtype, after any cast\): 'blocks\.0\.weight' \(16 of its 64 "
            r"values\), 'blocks\.1\.weight' \(2 of its 64 values\); nothing was changed\. "
            r".*allow_nonfinite=True")):
        sw.load_pretrained(model, bad)
    assert _bytes(sw.full_state_dict(model, rank0_only=False)) == before
    # A NaN in a buffer too; an inf in one (the mask) is no error.
    nan_stat = _net(1).state_dict()
    nan_stat["norm.running_var"][3] = float("nan")
    with pytest.raises(sw.ShardwiseError, match=r"1 tensor holds .*'norm\.running_var' "
                                                r"\(1 of its 8 values\); nothing was"):
        sw.load_pretrained(model, nan_stat)
    assert _bytes(sw.full_state_dict(model, rank0_only=False)) == before
    good = _net(1).state_dict()
    sw.load_pretrained(model, good)  # -inf in the mask
    assert _bytes(sw.full_state_dict(model, rank0_only=False)) == _bytes(good)
    # Opted in: loaded as they are, bit for bit.
    sw.load_pretrained(model, bad, allow_nonfinite=True)
    assert _bytes(sw.full_state_dict(model, rank0_only=False)) == _bytes(bad)
    with pytest.raises(sw.ShardwiseError, match="allow_nonfinite must be True or False"):
        sw.load_pretrained(model, good, allow_nonfinite="yes")

    # Unsharded, and an overflow made by the cast to the model's float16.
    half = nn.Linear(4, 2).half()
    kept = copy.deepcopy(half.state_dict())
    src = {"weight": torch.ones(2, 4), "bias": torch.tensor([1.0, 1e6])}
    with pytest.raises(sw.ShardwiseError, match=r"'bias' \(1 of its 2 values\); nothing"):
        sw.load_pretrained(half, src)
    assert _bytes(half.state_dict()) == _bytes(kept)
    return True


def test_nan_and_inf_are_refused_by_name_before_anything_changes():
    assert run_ranks(_plain, 3) == [True] * 3


# -- quantized while loading -------------------------------------------------------------
def _quantized(rank, world):
    from test_quantize_load import BLOCKS, _config, _peft_names, _weights, _with_adapters
    from transformers import LlamaForCausalLM

    from shardwise.integrations.quant import quantize_nf4

    good = _weights().state_dict()
    bad = {k: v.clone() for k, v in good.items()}
    bad["model.layers.1.mlp.up_proj.weight"][0, :5] = float("nan")
    x = torch.randint(0, 64, (2, 8))
    ref = _weights()
    quantize_nf4(ref, block_size=BLOCKS.block_size,
                 scaler_block_size=BLOCKS.scaler_block_size)
    ref = _with_adapters(ref)
    with torch.no_grad():
        expect = ref(input_ids=x).logits
    refused = (r"refused the given state dict: 1 tensor holds values that are NaN or inf .*"
               r"'model\.layers\.1\.mlp\.up_proj\.weight' \(5 of its 18432 values\); the "
               r"full-precision weights and buffers and the quantized weights before these "
               r"are loaded, the rest are not, and the model refuses to run")

    # Built under sharded_init(quantize=), and quantized with quantize_nf4 then sharded:
    # each refused, and refusing to run until a load completes.
    with sw.sharded_init(quantize=BLOCKS):
        built = LlamaForCausalLM(_config())
    made = _weights()
    quantize_nf4(made, block_size=BLOCKS.block_size,
                 scaler_block_size=BLOCKS.scaler_block_size)
    for base in (built, made):
        model = sw.shard(_with_adapters(base))
        with pytest.raises(sw.ShardwiseError, match=refused):
            sw.load_pretrained(model, bad, rename=_peft_names, strict=False)
        # Loaded in rounds of 2 weights; up_proj's round is the last.
        with pytest.raises(sw.ShardwiseError, match=(
                r"^base_model\.model\.model\.layers\.1\.mlp\.up_proj\.weight, base_model"
                r"\.model\.model\.layers\.1\.mlp\.down_proj\.weight \(2 parameters\) .* "
                r"have not been loaded")):
            model(input_ids=x)
        sw.load_pretrained(model, good, rename=_peft_names, strict=False)
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, expect)

    # A full-precision weight of the base: refused before anything changed.
    plain = dict(good, **{"model.norm.weight": torch.full((96,), float("inf"))})
    with pytest.raises(sw.ShardwiseError, match=r"'model\.norm\.weight' \(96 of its 96 "
                                                r"values\); nothing was changed"):
        sw.load_pretrained(model, plain, rename=_peft_names, strict=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, expect)

    # Opted in: the load completes, and the loss is what the check exists to prevent.
    sw.load_pretrained(model, bad, rename=_peft_names, strict=False, allow_nonfinite=True)
    assert torch.isnan(model(input_ids=x, labels=x).loss)
    return True


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                    reason="torchao is not installed (shardwise[quant])")
def test_a_quantized_weight_holding_nan_stops_the_load_and_the_model():
    assert run_ranks(_quantized, 2) == [True] * 2


def _changed_between_reads(rank, world):
    from shardwise.checkpoint import pretrained

    pretrained._HELD_BYTES = 0  # every row read to be checked, then again to be written
    real, reads = pretrained._flat_range, []

    def changing(src, key, lo, n):
        value = real(src, key, lo, n)
        reads.append(key)
        if key == "blocks.1.weight" and reads.count(key) == 2 and rank == 0:  # changed
            value = value.clone()
            value.view(-1)[0] = float("nan")
        return value

    pretrained._flat_range = changing
    model = sw.shard(_net(0))
    # Rank 0's read only: every rank raises, saying the model is partly changed.
    with pytest.raises(sw.ShardwiseError, match=r"(?s)while writing the checked values; "
                                                r"state may be partly changed.*rank\(s\) "
                                                r"\[0\]: .*blocks\.1\.weight changed while "
                                                r"it was loaded: its second read holds NaN"):
        sw.load_pretrained(model, _net(1).state_dict())
    return True


def test_a_source_changed_between_the_check_and_the_write_is_refused():
    """Rows too large to hold are read to be checked, then again to be written (the
    embeddings and head of a quantized model: docs/qlora.md); a NaN that only the second
    read sees is refused, not loaded."""
    assert run_ranks(_changed_between_reads, 2) == [True] * 2
