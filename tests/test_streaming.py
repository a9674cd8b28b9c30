"""``sw.full_parameters``: a sharded model's full weights streamed unit by unit.

Against ``sw.full_state_dict`` bit for bit (the reference GPT with its tied head, a tiny
Hugging Face Llama with tied embeddings, a QLoRA model with an NF4 base, a GPT offloaded
to disk), at 2 and 3 ranks, with the model at rest (every unit sharded) at each item; a
rank's live heap within one unit's full bytes at each item; a plain copy loaded from the
stream computing the sharded model's outputs and generating its tokens; ``rank0_only``;
closing early on every rank; and the misuses refused: not a sharded model, inside a
forward or before its backward, ranks that stop at different points, start on different
submodules, or do not start together.
"""

from __future__ import annotations

import ctypes
import importlib.util

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from loops import assert_at_rest
from parity import GPT_CFG, gpt_batches

import shardwise as sw
from shardwise.models import GPT, GPTConfig

HAVE_HF = importlib.util.find_spec("transformers") is not None
HAVE_QUANT = HAVE_HF and all(importlib.util.find_spec(m) is not None
                             for m in ("torchao", "peft"))


# -- the models --------------------------------------------------------------------------
def _llama(tie: bool = True) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie))


def _qlora(quantize: bool = True) -> nn.Module:
    """A tiny Llama whose linears are NF4 (blocks that divide at 2 and 3 ranks), with
    PEFT LoRA adapters (tests/test_quantized.py's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.integrations.quant import quantize_nf4

    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    if quantize:
        quantize_nf4(base, block_size=32, scaler_block_size=8)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _build(kind: str, folder: str) -> tuple[nn.Module, nn.Module]:
    """The sharded model, after two AdamW steps, and a plain copy of its architecture
    with other weights."""
    torch.manual_seed(0)
    if kind in ("gpt", "offload"):
        base, plain = GPT(GPT_CFG), GPT(GPT_CFG)
    elif kind == "llama":
        base, plain = _llama(), _llama()
    else:
        base, plain = _qlora(), _qlora(quantize=False)
    offload = sw.Offload(params="disk", optimizer="disk", folder=folder) \
        if kind == "offload" else None
    model = sw.shard(base, offload=offload)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    rank = torch.distributed.get_rank()
    for x, y in gpt_batches(rank, 2):
        x, y = x % 64, y % 64  # within every vocabulary here
        loss = model(x, y) if kind in ("gpt", "offload") else \
            model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model, plain


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if type(a) is not type(b) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if hasattr(a, "__tensor_flatten__") and type(a) is not torch.Tensor:
        names, _ = a.__tensor_flatten__()
        return all(_same_bits(getattr(a, n), getattr(b, n)) for n in names)
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _is_quantized(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def _check_stream(model: nn.Module, module: nn.Module, expect: dict[str, torch.Tensor],
                  **kw) -> list[str]:
    """Stream ``module`` (part of ``model``) and compare each item with ``expect``
    (``full_state_dict`` of ``module``) bit for bit, the model at rest at each item."""
    names = []
    for name, t in sw.full_parameters(module, **kw):
        assert_at_rest(model)
        ref = expect[name]
        if _is_quantized(ref) and kw.get("dequantize", True):
            ref = ref.get_original_weight()
        assert not isinstance(t, torch.distributed.tensor.DTensor), name
        assert _same_bits(t, ref), name
        names.append(name)
    return names


def _equals_full_state_dict(rank, world, kind, folder):
    model, plain = _build(kind, folder)
    sd = sw.full_state_dict(model, rank0_only=False)
    order = [n for n, _ in model.named_parameters()]
    assert _check_stream(model, model, sd) == order
    if kind == "quantized":
        assert any(_is_quantized(v) for v in sd.values())
        assert _check_stream(model, model, sd, dequantize=False) == order
    every = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert _check_stream(model, model, sd, remove_duplicate=False) == every
    if kind in ("gpt", "llama"):  # a tied head: under each name with False only
        assert len(every) == len(order) + 1
    # A submodule: names relative to it, as full_state_dict's.
    layers = model.blocks if kind in ("gpt", "offload") else \
        model.model.layers if kind == "llama" else model.base_model.model.model.layers
    part = sw.full_state_dict(layers[1], rank0_only=False)
    assert _check_stream(model, layers[1], part) == [n for n, _ in layers[1].named_parameters()]
    # A plain copy loaded from the stream computes what the sharded model computes.
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, t in sw.full_parameters(model):
            params.pop(name).copy_(t)
    assert not params, list(params)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    model.eval()
    plain.eval()
    with torch.no_grad():
        if kind in ("gpt", "offload"):
            assert torch.equal(model(x), plain(x))
        else:
            assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
            opts = {"max_new_tokens": 4, "do_sample": False, "eos_token_id": None}
            assert torch.equal(model.generate(input_ids=x, **opts),
                               plain.generate(input_ids=x, **opts))
    assert_at_rest(model)
    return True


KINDS = ["gpt", "offload",
         pytest.param("llama", marks=pytest.mark.skipif(not HAVE_HF, reason="transformers")),
         pytest.param("quantized", marks=pytest.mark.skipif(not HAVE_QUANT,
                                                            reason="torchao, peft"))]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_full_parameters_equal_full_state_dict(kind, world, tmp_path):
    assert run_ranks(_equals_full_state_dict, world, kind, str(tmp_path),
                     timeout=240) == [True] * world


# -- memory: one unit at a time ----------------------------------------------------------
class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _heap_in_use() -> int:
    """Bytes malloc has handed out and not had back, every thread's (glibc)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


MEMORY_CFG = GPTConfig(vocab_size=512, seq_len=32, n_layer=6, n_head=4, d_model=256)


def _memory(rank, world):
    torch.manual_seed(0)
    model = sw.shard(GPT(MEMORY_CFG))
    view = sw.inspect(model)
    unit = max(g.full_bytes for u in view.units for g in u.groups)  # one block, fp32
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert whole > 5 * unit
    slack = 256 * 1024
    for _ in sw.full_parameters(model):  # first use: whatever gloo allocates once
        pass
    # The caller drops each tensor: one run's buffer is all that is held.
    base = _heap_in_use()
    worst = 0
    for _, t in sw.full_parameters(model):
        worst = max(worst, _heap_in_use() - base)
        del t
    assert worst <= unit + slack, (worst, unit)
    # A plain loop keeps the previous item until the next: at most two runs' buffers.
    base = _heap_in_use()
    worst = 0
    for _, t in sw.full_parameters(model):  # noqa: B007 - t held as a for loop holds it
        worst = max(worst, _heap_in_use() - base)
    del t
    assert worst <= 2 * unit + slack, (worst, unit)
    # rank0_only: the other ranks hold nothing between gathers.
    base = _heap_in_use()
    got = list(sw.full_parameters(model, rank0_only=True))
    assert (len(got) > 0) == (rank == 0)
    if rank:
        assert _heap_in_use() - base <= slack
    return worst, unit


@pytest.mark.parametrize("world", [2, 3])
def test_at_most_one_unit_is_held_at_a_time(world):
    run_ranks(_memory, world)


# -- rank0_only, closing early -----------------------------------------------------------
def _gpt(rank):
    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, rank):
    for x, y in gpt_batches(rank, 1):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()


def _rank0_only_and_closing(rank, world):
    model, opt = _gpt(rank)
    sd = sw.full_state_dict(model, rank0_only=False)
    got = list(sw.full_parameters(model, rank0_only=True))
    if rank == 0:
        assert [n for n, _ in got] == [n for n, _ in model.named_parameters()]
        assert all(torch.equal(t, sd[n]) for n, t in got)
    else:
        assert got == []
    # Rank 0 stops early (mid-unit, then at a unit's end): the others stop with it.
    for stop in (2, 3):
        it = sw.full_parameters(model, rank0_only=True)
        if rank == 0:
            for i, _ in enumerate(it):
                if i == stop:
                    break
            it.close()
        else:
            assert list(it) == []
        assert_at_rest(model)
    # Every rank closes early, at the same item: at rest, and training goes on in step.
    for stop in (0, 1, 5, 36):
        it = sw.full_parameters(model)
        for i, _ in enumerate(it):
            if i == stop:
                break
        it.close()
        assert_at_rest(model)
    sw.full_parameters(model).close()  # never started: nothing to do
    _step(model, opt, rank)
    sd = sw.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(t, sd[n]) for n, t in sw.full_parameters(model))
    with sw.no_sync(model):  # units held gathered across micro-batches: untouched
        x, y = next(gpt_batches(rank, 1))
        model(x, y).backward()
    assert all(torch.equal(t, sd[n]) for n, t in sw.full_parameters(model))
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    assert_at_rest(model)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_rank0_only_and_closing_early_leave_the_model_at_rest(world):
    assert run_ranks(_rank0_only_and_closing, world) == [True] * world


# -- misuse ------------------------------------------------------------------------------
def _refusals(rank, world):
    model, opt = _gpt(rank)
    with pytest.raises(sw.ShardwiseError, match="not a sharded model"):
        sw.full_parameters(GPT(GPT_CFG))
    with pytest.raises(sw.ShardwiseError, match="must be a module"):
        sw.full_parameters(model.state_dict())  # type: ignore[arg-type]
    with pytest.raises(sw.ShardwiseError, match="rank0_only must be True or False"):
        sw.full_parameters(model, rank0_only="yes")  # type: ignore[arg-type]
    other = sw.shard(GPT(GPT_CFG))
    both = nn.ModuleDict({"a": model, "b": other})
    with pytest.raises(sw.ShardwiseError, match="another sharded model"):
        sw.full_parameters(both)
    x, y = next(gpt_batches(rank, 1))
    loss = model(x, y)
    with pytest.raises(sw.ShardwiseError, match="between a forward and its backward"):
        sw.full_parameters(model)
    loss.backward()
    opt.step()
    opt.zero_grad()
    seen = []

    def inside(module, args):
        try:
            sw.full_parameters(model)
        except sw.ShardwiseError as e:
            seen.append(str(e))

    handle = model.blocks[1].register_forward_pre_hook(inside)
    with torch.no_grad():
        model(x)
    handle.remove()
    assert len(seen) == 1 and "inside a forward" in seen[0], seen
    assert_at_rest(model)
    # Ranks part ways: rank 0 closes after two items, the others go on.
    it = sw.full_parameters(model)
    with pytest.raises(sw.ShardwiseError, match=r"rank\(s\) \[0\] closed the iterator"):
        if rank == 0:
            next(it), next(it)
            it.close()
        else:
            list(it)
    return True


def test_misuse_is_refused():
    assert run_ranks(_refusals, 2) == [True, True]


def _apart(rank, world, case):
    model, _ = _gpt(rank)
    x, y = next(gpt_batches(rank, 1))
    with pytest.raises(sw.ShardwiseError):
        if case == "submodules":
            list(sw.full_parameters(model.blocks[rank]))
        elif rank == 0:
            list(sw.full_parameters(model))
        else:  # a forward while rank 0 streams
            model(x, y).backward()
    return True


@pytest.mark.parametrize("case", ["submodules", "not_joined"])
def test_ranks_that_do_not_start_together_raise(case):
    assert run_ranks(_apart, 2, case, timeout=120) == [True, True]


def _hybrid(rank, world):
    """A (2, 2) mesh with bf16 compute: each shard group gathers its own rows; the values
    are the fp32 masters, full_state_dict's."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = sw.shard(GPT(GPT_CFG), mesh=init_device_mesh("cpu", (2, 2)),
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank)
    sd = sw.full_state_dict(model, rank0_only=False)
    assert _check_stream(model, model, sd) == [n for n, _ in model.named_parameters()]
    assert all(t.dtype == torch.float32 for _, t in sw.full_parameters(model))
    part = sw.full_state_dict(model.blocks[2], rank0_only=False)
    assert _check_stream(model, model.blocks[2], part, rank0_only=True) == \
        ([n for n, _ in model.blocks[2].named_parameters()] if rank == 0 else [])
    return True


def test_hybrid_sharding_and_mixed_precision():
    assert run_ranks(_hybrid, 4) == [True] * 4
