"""Quantized frozen weights under sharding (QLoRA): tensor subclasses that implement
FSDP2's all-gather extension protocol stay packed, gather through the protocol and
compute exactly as unsharded; everything shardwise cannot shard exactly is refused by
name; a tiny Llama with an NF4 base and PEFT LoRA adapters trains to the same bits at 1,
2 and 3 ranks in the reproducible mode.

Exactness is bit for bit wherever the arithmetic is the same: a gathered quantized weight
holds the same bytes as the unsharded one, so forwards match the unsharded model exactly
(and FSDP2's, which gathers the same bytes through the same protocol)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import weakref

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from packed_tensor import CALLS, CountedRows, OnlyPre, RowInt8, RowInt8Codes

import shardwise as sw

if importlib.util.find_spec("torchao") is None:  # not importorskip: torchao's import is noisy
    pytest.skip("torchao is not installed (shardwise[quant])", allow_module_level=True)
from shardwise.engine.groups.quantize import decode_by_pairs, dequantize_by_pairs  # noqa: E402
from shardwise.integrations.quant import nf4_module, quantize_nf4  # noqa: E402


# -- a model mixing packed frozen weights with trainable ones in each unit -------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)           # frozen, packed (RowInt8)
        self.adapter = nn.Linear(d, d, bias=False)
        self.norm = nn.LayerNorm(d)
        self.spare = nn.Linear(d, d, bias=False)  # packed, never called: bytes only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.proj(x) + self.adapter(x))


class Net(nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _nan_payloads(n: int) -> torch.Tensor:
    """float32 NaNs with distinct payloads (and signs): a float cast, a copy through
    another dtype or a reduction would canonicalise them."""
    bits = torch.arange(n, dtype=torch.int32) | 0x7F800001
    bits[::2] |= torch.tensor(-(2**31), dtype=torch.int32)
    return bits.view(torch.float32)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    for b in net.blocks:
        b.proj.weight = nn.Parameter(RowInt8.quantize(b.proj.weight.detach()),
                                     requires_grad=False)
        spare = RowInt8.quantize(b.spare.weight.detach())
        spare.scales.copy_(_nan_payloads(spare.scales.numel()))
        b.spare.weight = nn.Parameter(spare, requires_grad=False)
        b.proj.bias.requires_grad_(False)
    return net


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()


def _subclass_through_protocol(rank, world):
    ref, model = _net(), sw.shard(_net(), mixed_precision=None)
    local = model.blocks[0].proj.weight
    assert type(local.to_local()) is RowInt8 and local.shape == (12, 12)
    assert local.to_local().shape == (12 // world, 12)
    # The spare weights' bytes as gathered inside each forward: NaN payloads included.
    seen = []
    for b in model.blocks:  # the norm runs inside the unit's forward, while gathered
        b.norm.register_forward_hook(lambda m, i, o, b=b: seen.append(
            (_bytes(b.spare.weight.codes), _bytes(b.spare.weight.scales))))
    # The same bytes as the unsharded weights, so the same forward bit for bit: the
    # first gather builds the full tensors, the second refills them in place.
    for i in range(2):
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(10 * rank + i))
        with torch.no_grad():
            assert torch.equal(model(x), ref(x)), f"forward {i} differs from unsharded"
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x = torch.randn(5, 12, generator=torch.Generator().manual_seed(10 * rank + step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(seen) == 4 * 2  # each block in each of the 4 forwards
    for b_ref, (codes, scales) in zip(list(ref.blocks) * 4, seen):
        assert codes == _bytes(b_ref.spare.weight.codes)
        assert scales == _bytes(b_ref.spare.weight.scales)
    # 2 units of 2 packed weights, gathered for 2 forwards, then for 2 forwards and
    # backwards (the last unit stays gathered from its forward into its backward, which
    # comes next: 3 gathers a step). pre at every gather, post once per weight, then in
    # place (out=).
    gathers = 2 * 2 + 2 * 3
    assert CALLS["pre"] == 2 * gathers and CALLS["post"] == 4, CALLS
    assert CALLS["post_out"] == 2 * gathers - 4, CALLS
    # This rank keeps its rows' bytes only: int8 codes and float32 scales, each slot
    # aligned to 64 bytes (Note [alignment]).
    view = sw.inspect(model)
    rows = 12 // world
    per_weight = -(-rows * 12 // 64) * 64 + -(-rows * 4 // 64) * 64
    assert view.packed_bytes == 4 * per_weight, view.packed_bytes
    assert [p.types for p in view.unit("blocks.0").packed] == [("RowInt8", "RowInt8")]
    assert view.full_bytes == 0 and "(0.00 MiB quantized)" in str(view)
    assert not view.unmanaged
    # Frozen and packed: no gradient, no optimizer state, shards unchanged.
    for b_ref, b in zip(ref.blocks, model.blocks):
        w = b.proj.weight
        assert w.grad is None and w not in opt.state
        assert _bytes(w.to_local().codes) == _bytes(b_ref.proj.weight.codes.chunk(world)[rank])
    # A consolidated state dict holds each packed weight whole, still packed.
    sd = sw.full_state_dict(model, rank0_only=False)
    got = sd["blocks.1.spare.weight"]
    assert type(got) is RowInt8 and _bytes(got.scales) == _bytes(ref.blocks[1].spare.weight.scales)
    sw.check_consistency(model)
    return True


def _nf4_like_fsdp2(rank, world):
    """One subclass under both: NF4 weights give the unsharded forward, bit for bit,
    through shardwise and through FSDP2's fully_shard."""
    from torch.distributed.fsdp import fully_shard

    def build() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 96))
        quantize_nf4(m, block_size=32, scaler_block_size=8)
        return m
    ref, theirs, ours = build(), build(), build()
    fully_shard(theirs)
    sw.shard(ours)
    # The gathered weights dequantize by pairs (Note [NF4 dequantized by pairs]).
    decoders = []
    for linear in (ours[0], ours[2]):
        linear.register_forward_pre_hook(lambda m, a: decoders.append(
            type(m.weight).get_original_weight))
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        expect = ref(x)
        assert torch.equal(theirs(x), expect) and torch.equal(ours(x), expect)
    assert decoders == [dequantize_by_pairs] * 2, decoders
    return type(ours[0].weight.to_local()).__name__


def _hybrid(rank, world):
    """On a 2-D mesh the shard dim's mesh goes to fsdp_pre_all_gather, as under FSDP2;
    an unnamed 2-D mesh is refused, since that dim cannot be picked out by name."""
    from torch.distributed.device_mesh import init_device_mesh

    ref = _net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = sw.shard(_net(), mesh=mesh)
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    sw.check_consistency(model)  # replicas hold the same packed bytes
    # A weight divided by bytes over the shard dim (5 rows, 2 ranks): the replicas get
    # its shares too (Note [uneven packed parameters]).
    five = sw.shard(_five_rows(), mesh=mesh)
    assert type(five[1][0].weight).__name__ == "ByteShard"
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        assert torch.equal(five(x), _five_rows()(x))
    sw.check_consistency(five)
    refused = _net()
    with pytest.raises(sw.ShardwiseError, match="named mesh dims"):
        sw.shard(refused, mesh=init_device_mesh("cpu", (2, 2)))
    assert not sw.is_sharded(refused)  # refused before anything changed
    return True


def test_hybrid_mesh_gathers_within_the_shard_dim():
    assert run_ranks(_hybrid, 4) == [True] * 4


def test_subclass_gathers_through_the_protocol_and_stays_packed():
    assert run_ranks(_subclass_through_protocol, 3) == [True] * 3


def test_nf4_forward_matches_unsharded_and_fsdp2():
    assert run_ranks(_nf4_like_fsdp2, 2) == ["NF4Tensor"] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,block,scaler_block", [((96, 64), 64, 8), ((40, 96), 32, 4),
                                                      ((8, 2048), 64, 256),
                                                      ((576, 512), 64, 256)])  # 2.25 slices
def test_dequantizing_by_pairs_gives_torchaos_bits(dtype, shape, block, scaler_block):
    """Note [NF4 dequantized by pairs]: every bit of torchao's own dequantization, at
    several dtypes, block sizes and shapes; a layout it does not know keeps torchao's."""
    nf4 = nf4_module()
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.1
    t = nf4.to_nf4(w, block, scaler_block)
    theirs = nf4.NF4Tensor.get_original_weight(t)
    ours = dequantize_by_pairs(t)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # every bit
    decode_by_pairs(t)
    assert torch.equal(t.to(torch.float32), theirs.to(torch.float32))
    assert isinstance(t, nf4.NF4Tensor) and type(t).get_original_weight is dequantize_by_pairs
    assert "get_original_weight" not in t.__dict__  # no cycle, nothing copied along
    gone = weakref.ref(t)
    del t
    assert gone() is None  # freed with its last reference, not by the collector
    odd = nf4.to_nf4(torch.randn(4, 8).to(dtype), 2, 2)  # blocks of 2: not by pairs
    decode_by_pairs(odd)
    assert type(odd) is nf4.NF4Tensor


# -- what cannot be sharded exactly is refused, by name --------------------------------
class Params4bitLike(nn.Parameter):
    """Like bitsandbytes' Params4bit: packed uint8 bytes with their quantization state
    beside them, in an nn.Parameter subclass."""

    def __new__(cls, data: torch.Tensor, quant_state: dict) -> Params4bitLike:
        p = super().__new__(cls, data, requires_grad=False)
        p.quant_state = quant_state
        return p


def _with_weight(weight: torch.Tensor, requires_grad: bool = False) -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4))
    m[0].weight = nn.Parameter(weight, requires_grad=requires_grad) \
        if not isinstance(weight, nn.Parameter) else weight
    return m


def _refusals(rank, world, folder):
    w = torch.randn(4, 4)
    cases = {
        "Params4bitLike": _with_weight(Params4bitLike(torch.zeros(8, 1, dtype=torch.uint8),
                                                      {"blocksize": 64})),
        "nn.Parameter subclass": _with_weight(Params4bitLike(torch.zeros(8, 1,
                                                                         dtype=torch.uint8),
                                                             {})),
        "tensor subclass, packed_tensor.RowInt8Codes": _with_weight(RowInt8Codes(*_parts(w))),
        "fsdp_post_all_gather": _with_weight(OnlyPre(*_parts(w))),
        "requires grad": _with_weight(RowInt8(*_parts(w)), requires_grad=True),
    }
    for expected, model in cases.items():
        with pytest.raises(sw.ShardwiseError, match=expected) as err:
            sw.shard(model)
        assert "0.weight" in str(err.value), err.value
    # A weight that does not split evenly (5 rows over 2 ranks), in the second unit, is
    # divided by bytes (Note [uneven packed parameters]), which MixedPrecision's
    # param_dtype cannot reach: refused before the first unit is touched. Without it,
    # it gives the unsharded forward.
    uneven = _five_rows
    refused_mp = uneven()
    with pytest.raises(sw.ShardwiseError, match=r"1\.0\.weight .*does not split into 2 "
                                                r"equal shards.*param_dtype"):
        sw.shard(refused_mp, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    assert not sw.is_sharded(refused_mp) and type(refused_mp[0][0].weight) is RowInt8
    x = torch.randn(3, 4)
    sharded = sw.shard(uneven())
    assert type(sharded[1][0].weight).__name__ == "ByteShard"
    with torch.no_grad():
        assert torch.equal(sharded(x), uneven()(x))
    model = sw.shard(_net())
    # gathered, deepcopy and loading NF4 values work: tests/test_quantized_tools.py.
    refused = {
        "sw.load_pretrained": lambda: sw.load_pretrained(model, {}),
        "load_state_dict": lambda: model.load_state_dict(
            {"blocks.0.proj.weight": torch.zeros(12, 12)}, strict=False),
    }
    for what, call in refused.items():
        with pytest.raises(sw.ShardwiseError, match="quantized") as err:
            call()
        assert what in str(err.value), err.value
    # Chunks whose inner tensors are not parts of the full tensor's train, but a
    # checkpoint could not reshard them: the save says so and writes nothing.
    counted = sw.shard(_with_weight(CountedRows(*_parts(torch.randn(4, 4)))))
    counted(torch.randn(2, 4)).sum().backward()
    with pytest.raises(sw.ShardwiseError, match="contiguous parts"):
        sw.save_checkpoint(f"{folder}/counted", counted)
    assert not os.path.exists(f"{folder}/counted/checkpoint.json")
    with sw.sharded_init():
        partitioned = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(sw.ShardwiseError, match="sharded_init"):
        quantize_nf4(partitioned, block_size=32, scaler_block_size=2)
    # quantize_nf4 after sw.shard. Before: torchao's "got mixed torch.Tensor and DTensor".
    late = sw.shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    kept = [p for p in late.parameters()]
    with pytest.raises(sw.ShardwiseError, match=r"quantize_nf4 was called on a model "
                                                r"already sharded .*0\.weight, 1\.weight "
                                                r"are shards.*Nothing was changed. Quantize "
                                                r"before sharding"):
        quantize_nf4(late, block_size=32, scaler_block_size=2)
    assert all(a is b for a, b in zip(late.parameters(), kept, strict=True))
    late(torch.randn(2, 64)).sum().backward()
    # After every refusal the model still trains, the same on every rank.
    model(torch.randn(2, 12)).sum().backward()
    sw.check_consistency(model)
    return True


def _five_rows() -> nn.Module:
    """Two units of RowInt8 weights: 4 rows, then 5 (not even over 2 ranks)."""
    torch.manual_seed(0)
    second = nn.Sequential(nn.Linear(4, 5))
    second[0].weight = nn.Parameter(RowInt8(*_parts(torch.randn(5, 4))), requires_grad=False)
    return nn.Sequential(_with_weight(RowInt8(*_parts(torch.randn(4, 4)))), second)


def _parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = RowInt8.quantize(w)
    return q.codes, q.scales


def test_what_cannot_be_sharded_exactly_is_refused(tmp_path):
    assert run_ranks(_refusals, 2, str(tmp_path)) == [True, True]


def _uint8_bytes(rank, world):
    """A frozen uint8 table (every byte value, rows uneven over 3 ranks) under bf16
    mixed precision: gathered as bytes, never cast."""
    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.arange(256, dtype=torch.uint8).view(16, 16)
                                      .flip(0).contiguous(), requires_grad=False)
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self.table.detach().clone())
            return self.lin(x) + self.table[0].to(x.dtype)
    seen: list[torch.Tensor] = []
    model = sw.shard(nn.Sequential(Lookup()),
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    model(torch.randn(2, 16)).float().sum().backward()
    expect = torch.arange(256, dtype=torch.uint8).view(16, 16).flip(0)
    assert seen and all(t.dtype == torch.uint8 and torch.equal(t, expect) for t in seen)
    return True


def test_integer_weights_move_as_bytes_under_mixed_precision():
    assert run_ranks(_uint8_bytes, 3) == [True] * 3


# -- QLoRA: a tiny Llama with an NF4 base and PEFT LoRA adapters ------------------------
def _qlora(seed: int = 0, blocks: tuple[int, int] = (32, 8), quantize: bool = True):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # Shapes that split evenly over 1, 2 and 3 ranks into whole NF4 blocks (32 elements)
    # and whole blocks of scales (8 blocks): 96 and 192 rows.
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))
    if quantize:
        quantize_nf4(base, block_size=blocks[0], scaler_block_size=blocks[1])
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter at once
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _batches(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (6, 8), generator=g) for _ in range(steps)]


def _adapters(model, opt) -> dict[str, torch.Tensor]:
    """Every trainable parameter and its AdamW state, whole (a collective)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = p.full_tensor()
            for k, v in opt.state[p].items():
                out[f"{name}/{k}"] = v.full_tensor() if v.dim() else v
    return out


def _step(model, opt, batch) -> float:
    """One reproducible step over a global batch of 6 sequences; its mean loss."""
    mine = sw.micro_batches(batch, 6)
    per = []
    for i, x in enumerate(mine):
        with sw.no_sync(model) if i < len(mine) - 1 else contextlib.nullcontext():
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        per.append(loss.detach())
    opt.step()
    opt.zero_grad()
    return sw.global_mean(per)


def _qlora_reproducible(rank, world):
    model = sw.shard(_qlora(), reproducible=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [_step(model, opt, batch) for batch in _batches()]
    _check_memory(model, world)
    state = _adapters(model, opt)  # a collective: every rank
    return losses, state if rank == 0 else None


def _check_memory(model, world) -> None:
    """Each rank keeps 1/world of the NF4 bytes (its chunks' inner tensors, each slot
    rounded up to 64 bytes), not a full-precision shard: about 0.55 bytes an element."""
    nf4 = nf4_module()
    reference = _qlora()
    expected = numel = 0
    for p in reference.parameters():
        if isinstance(p, nf4.NF4Tensor):
            numel += p.numel()
            chunk = p.chunk(world)[0]
            names, _ = chunk.__tensor_flatten__()
            expected += sum(-(-getattr(chunk, n).nbytes // 64) * 64 for n in names)
    view = sw.inspect(model)
    assert view.packed_bytes == expected, (view.packed_bytes, expected)
    per_element = view.packed_bytes * world / numel
    assert per_element < 0.6, per_element  # 0.5 of codes, scales, the table, alignment
    frozen_fp32 = sum(g.shard_bytes for u in view.units for g in u.groups
                      if not g.requires_grad)
    assert frozen_fp32 < view.packed_bytes  # embeddings and norms only


def _train_default(model, opt, rank, world, batches):
    losses = []
    for batch in batches:
        x = batch.chunk(world)[rank]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _qlora_default(rank, world):
    """The default mode against the same quantized model trained in one process."""
    # SGD, not AdamW: AdamW divides by the root of the second moment, which turns the
    # rounding of a near-zero gradient into a whole step (a measured 3.3e-6 at 3 ranks
    # after 3 steps, a bound that would depend on the CPU), where SGD moves each weight
    # by lr times its gradient's error.
    model = sw.shard(_qlora())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5,
                          momentum=0.9)
    _train_default(model, opt, rank, world, _batches())
    ref = _qlora()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5,
                              momentum=0.9)
    _train_default(ref, ref_opt, 0, 1, _batches())
    got = _adapters(model, opt)
    worst = 0.0
    for name, p in ref.named_parameters():
        if p.requires_grad:
            # The bound of fp32 reductions in test_engine.py (rtol 1e-6, atol 1e-7): the
            # gradients differ by reduction order only (a mean of 2 or 3 ranks' means
            # against one mean over the batch). Measured: at most 4.8e-8 after 3 steps at
            # 2 and 3 ranks, a quarter of what the bound allows on adapters of about 0.1.
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7,
                                       msg=name)
            worst = max(worst, (got[name] - p.detach()).abs().max().item())
    return worst


@pytest.mark.parametrize("worlds", [(1, 2, 3)])
def test_qlora_reproducible_is_bit_identical_at_1_2_and_3_ranks(worlds):
    results = [run_ranks(_qlora_reproducible, w)[0] for w in worlds]
    (losses, state), others = results[0], results[1:]
    assert all(torch.isfinite(torch.tensor(losses))) and min(losses) > 0
    for (l2, s2), w in zip(others, worlds[1:]):
        assert l2 == losses, f"world {w}: losses {l2} != {losses}"
        assert s2.keys() == state.keys()
        for k in state:
            assert torch.equal(s2[k], state[k]), f"world {w}: {k} differs"


def test_qlora_default_mode_matches_one_process():
    worst = run_ranks(_qlora_default, 3)
    assert len(set(worst)) == 1, worst  # every rank holds the same adapters


def _qlora_trainer(rank, world, root):
    """ShardwiseTrainer against a DDP Trainer on the QLoRA model (DDP told to leave the
    NF4 weights alone), resumed from its checkpoint into a model quantized from other
    weights, then the adapters saved PEFT's way and loaded into a fresh sharded model."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from test_trainer import SAVE_AT, _args, _dataset, _env, _losses
    from transformers import Trainer

    from shardwise.integrations.transformers import ShardwiseTrainer

    _env(rank, world)
    ref = _qlora()
    nf4 = nf4_module().NF4Tensor
    ref._ddp_params_and_buffers_to_ignore = [n for n, p in ref.named_parameters()
                                             if isinstance(p, nf4)]
    ddp = Trainer(model=ref, args=_args(f"{root}/ddp", save_strategy="no"),
                  train_dataset=_dataset())
    ddp.train()
    # With the Trainer's checkpoints every 3 steps: sw.save_checkpoint holds the NF4 base.
    ours = ShardwiseTrainer(model=_qlora(), args=_args(f"{root}/sw"), train_dataset=_dataset())
    ours.train()
    resumed = ShardwiseTrainer(model=_qlora(seed=1), args=_args(f"{root}/resumed"),
                               train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=f"{root}/sw/checkpoint-{SAVE_AT}")
    assert _nf4_bytes(resumed.model) == _nf4_bytes(_qlora())  # the base came back
    late = [h["loss"] for h in ours.state.log_history if "loss" in h and h["step"] > SAVE_AT]
    assert _losses(resumed)[-len(late):] == late  # and training went on the same
    assert sw.inspect(ours.model).packed_bytes > 0
    ours.save_model(f"{root}/adapter")  # a PeftModel saves its adapters only
    trained = {k: v for k, v in sw.full_state_dict(ours.model, rank0_only=False).items()
               if "lora_" in k}
    torch.distributed.barrier()
    saved = load_file(f"{root}/adapter/adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    fresh = sw.shard(_qlora())
    set_peft_model_state_dict(fresh, saved)
    again = sw.full_state_dict(fresh, rank0_only=False)
    assert all(torch.equal(again[k], v) for k, v in trained.items())
    return _losses(ddp), _losses(ours)


def test_qlora_shardwise_trainer_matches_ddp_and_saves_adapters(tmp_path):
    ddp, ours = run_ranks(_qlora_trainer, 2, str(tmp_path), timeout=300)[0]
    assert len(ours) == len(ddp) > 0
    # As in test_trainer.py: the first loss is the same forward, bit for bit; later ones
    # may differ only through the clip factor's last bits (1e-5 of losses ~4).
    assert ours[0] == ddp[0]
    assert max(abs(a - b) for a, b in zip(ours, ddp)) < 1e-5, (ours, ddp)


def _trainer_at_lr_0(rank, world, root):
    """One ShardwiseTrainer step at learning rate 0 on a batch of identical rows: the
    NF4 bytes after it are the freshly quantized model's, and the first loss is what the
    unsharded quantized model gives for those rows in one process."""
    from test_trainer import _args, _dataset, _env, _losses

    from shardwise.integrations.transformers import ShardwiseTrainer

    _env(rank, world)
    row = _dataset(1)[0]
    ours = ShardwiseTrainer(model=_qlora(), train_dataset=[row] * 8, args=_args(
        f"{root}/sw", save_strategy="no", max_steps=1, learning_rate=0.0,
        gradient_accumulation_steps=1))
    ours.train()
    assert _nf4_bytes(ours.model) == _nf4_bytes(_qlora())
    x = row["input_ids"].expand(2, -1)   # this rank's batch: 2 of the identical rows
    with torch.no_grad():
        expect = _qlora()(input_ids=x, labels=x).loss.item()
    return _losses(ours)[0], expect


def test_qlora_trainer_step_at_lr_0_keeps_the_nf4_bytes(tmp_path):
    """Issue 43: a plain DDP Trainer re-quantizes the NF4 weights when it wraps the model
    (DDP's constructor broadcasts every parameter through torchao's cat and copy_, see
    docs/qlora.md), so its weights and first loss move at learning rate 0. ShardwiseTrainer
    never wraps the model in DDP: the bytes stay those quantize_nf4 wrote."""
    for first, expect in run_ranks(_trainer_at_lr_0, 2, str(tmp_path), timeout=300):
        # Bit for bit: the Trainer's loss is each rank's token sum over the global token
        # count times 2 ranks, averaged over ranks; with the same rows on both ranks that
        # is the rank's own mean exactly (multiplying and dividing by 2 is exact).
        assert first == expect, (first, expect)


def _nf4_bytes(model) -> dict[str, bytes]:
    """Every NF4 weight's inner tensors, whole, as bytes (a collective when sharded)."""
    nf4 = nf4_module().NF4Tensor
    sd = sw.full_state_dict(model, rank0_only=False) if sw.is_sharded(model) else \
        model.state_dict()
    out = {}
    for k, v in sd.items():
        if isinstance(v, nf4):
            names, _ = v.__tensor_flatten__()
            out.update({f"{k}/{n}": _bytes(getattr(v, n)) for n in names})
    return out


def _checkpoint_save(rank, world, folder):
    """Two reproducible steps, a checkpoint, a third step."""
    model = sw.shard(_qlora(), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen NF4 weights included
    batches = _batches()
    for batch in batches[:2]:
        _step(model, opt, batch)
    sw.save_checkpoint(folder, model, opt, extra={"step": 2})
    loss = _step(model, opt, batches[2])
    state = _adapters(model, opt)
    return loss, state if rank == 0 else None


def _checkpoint_load(rank, world, folder):
    """Into a model quantized from other weights, at another world size: the NF4 bytes
    come back byte for byte, and the third step gives the uninterrupted run's bits."""
    model = sw.shard(_qlora(seed=1), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert sw.load_checkpoint(folder, model, opt) == {"step": 2}
    assert _nf4_bytes(model) == _nf4_bytes(_qlora())
    loss = _step(model, opt, _batches()[2])
    state = _adapters(model, opt)
    if world == 1:  # what does not fit is refused by name, and nothing changes
        from shardwise.checkpoint.consolidation import consolidate

        for other, match in [(_qlora(blocks=(64, 4)), "quantized with other settings"),
                             (_qlora(quantize=False), "missing from the checkpoint")]:
            other = sw.shard(other)
            before = sw.full_state_dict(other)
            with pytest.raises(sw.ShardwiseError, match=match):
                sw.load_checkpoint(folder, other)
            after = sw.full_state_dict(other)
            assert all(_bytes(after[k]) == _bytes(v) for k, v in before.items()
                       if not isinstance(v, nf4_module().NF4Tensor))
        with pytest.raises(sw.ShardwiseError, match="holds tensor-subclass weights"):
            consolidate(folder, f"{folder}-full")
    return loss, state if rank == 0 else None


def test_qlora_checkpoint_round_trips_the_nf4_base_across_world_sizes(tmp_path):
    folder = str(tmp_path / "ck")
    loss, state = run_ranks(_checkpoint_save, 2, folder)[0]
    meta = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    assert len(meta["packed"]) == 2 * 7  # every linear weight of both decoder layers
    for world in (1, 3):
        got_loss, got = run_ranks(_checkpoint_load, world, folder)[0]
        assert got_loss == loss, (world, got_loss, loss)
        assert got.keys() == state.keys()
        for k in state:
            assert torch.equal(got[k], state[k]), (world, k)


def _qlora_generate(rank, world, quantize):
    """PeftModel.generate on a sharded (Q)LoRA model (Note [forward entries]): the inner
    model's forward gathers the root unit and the NF4 bytes, as a call of the root would;
    the tokens are the unsharded quantized model's."""
    ref = _qlora(quantize=quantize).eval()
    ours = sw.shard(_qlora(quantize=quantize)).eval()
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    opts = {"max_new_tokens": 3 + 4 * rank, "do_sample": False, "eos_token_id": None}
    with torch.no_grad():
        got = ours.generate(input_ids=prompt, **opts)
        expect = ref.generate(input_ids=prompt, **opts)
        # A deep copy (its own NF4 bytes and hooks) generates the same tokens.
        copied = copy.deepcopy(ours).generate(input_ids=prompt, **opts)
    assert torch.equal(got, expect), (got, expect)
    assert torch.equal(copied, expect), (copied, expect)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("quantize", [True, False], ids=["qlora", "lora"])
def test_generate_on_a_sharded_qlora_model_equals_unsharded(world, quantize):
    assert run_ranks(_qlora_generate, world, quantize, timeout=180) == [True] * world


def _moves_and_casts(rank, world):
    """``model.to("cpu")``, ``.float()`` and ``.eval()`` on a sharded QLoRA model leave its
    quantized shards in place; a cast that would dequantize them is refused, nothing
    changed."""
    model = sw.shard(_qlora())
    x = _batches(1)[0]
    with torch.no_grad():
        before = model(input_ids=x).logits
    model.to("cpu").float().eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, before)
    try:
        model.to(torch.float64)
    except sw.ShardwiseError as err:
        assert "quantized parameter" in str(err) and "Nothing was changed" in str(err)
    else:
        raise AssertionError("a cast of quantized parameters was not refused")
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    _train_default(model, opt, rank, world, _batches(2))
    return True


def test_moves_that_change_nothing_keep_quantized_shards_and_casts_are_refused():
    assert run_ranks(_moves_and_casts, 2) == [True, True]


def test_the_pairs_table_reads_no_value_on_the_host_off_the_cpu():
    """Note [NF4 dequantized by pairs]: off the CPU the 65536 x 4 table is made on the
    device, never keyed by its values read to the host (a stall at every dequantization
    on a GPU). The meta device stands for one here: a host read of a meta tensor raises."""
    from shardwise.engine.groups.quantize import _quads

    table = nf4_module().to_nf4(torch.randn(64, 64).to(torch.bfloat16), 64, 64).nf4
    quads = _quads(table.to("meta"))
    assert quads.device.type == "meta" and quads.shape == (65536, 4)
    assert quads.dtype == table.dtype
    on_cpu = _quads(table)
    assert torch.equal(on_cpu[0x21], table[[2, 1, 0, 0]])  # low byte first, high nibble first


def test_the_pairs_table_is_cached_by_bits():
    """A table holding -0.0 is not the one holding 0.0 (they compare equal), and one
    holding NaN is found again (NaN equals nothing): the cache keys on bits."""
    from shardwise.engine.groups.quantize import _TABLES, _quads

    plus = torch.linspace(-1, 1, 16).to(torch.bfloat16)
    plus[7] = 0.0
    minus = plus.clone()
    minus[7] = -0.0
    assert torch.equal(_quads(plus)[0x7777].view(torch.int16), plus[[7] * 4].view(torch.int16))
    assert torch.equal(_quads(minus)[0x7777].view(torch.int16), minus[[7] * 4].view(torch.int16))
    nan = plus.clone()
    nan[3] = float("nan")
    before = len(_TABLES)
    assert _quads(nan) is _quads(nan) and len(_TABLES) == before + 1
