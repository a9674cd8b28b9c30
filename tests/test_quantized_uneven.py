"""Quantized weights at any world size (issue 43, part 4): an NF4 weight whose rows and
blocks do not split into N equal shards is divided by bytes of its full inner tensors
(Note [uneven packed parameters] in engine/groups/subclass.py), and gives the bits it gives at 1
and 2 ranks.

The model: a tiny Llama whose 64-row projections (q, k, v, o, down) split evenly at 2
ranks but not at 3, and whose 96-row ones (gate, up) split evenly at both, so at 3 ranks
each decoder layer's unit gathers both kinds in one all-gather."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from harness import run_ranks
from test_quantize_load import _peft_names, _with_adapters
from test_quantized import _adapters, _batches, _step
from test_quantized import _nf4_bytes as _all_nf4_bytes

import shardwise as sw

if importlib.util.find_spec("torchao") is None:  # not importorskip: torchao's import is noisy
    pytest.skip("torchao is not installed (shardwise[quant])", allow_module_level=True)
from shardwise.engine.groups.subclass import ByteShard  # noqa: E402
from shardwise.integrations.quant import NF4, nf4_module, quantize_nf4  # noqa: E402

BLOCKS = NF4(block_size=32, scaler_block_size=8)  # 256 elements: whole in every weight
UNEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")  # 64 rows: not by 3


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=32)


def _weights(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_config())


def _qlora(seed: int = 0):
    """The base quantized whole (the reference every sharded model must equal), with
    PEFT LoRA on q_proj and v_proj."""
    base = _weights(seed)
    quantize_nf4(base, block_size=BLOCKS.block_size,
                 scaler_block_size=BLOCKS.scaler_block_size)
    return _with_adapters(base)


def _nf4_bytes(model) -> dict[str, bytes]:
    """test_quantized's, which must find NF4 weights here."""
    out = _all_nf4_bytes(model)
    assert out
    return out


def _divided_by_bytes(model) -> set[str]:
    return {n for n, p in model.named_parameters() if type(p) is ByteShard}


def _expected_packed_bytes(world: int) -> int:
    """This rank's NF4 bytes: per inner tensor, a chunk's (even) or ceil(numel / world)
    elements (by bytes), each slot rounded up to 64 bytes (Note [alignment])."""
    total = 0
    for name, p in _qlora().named_parameters():
        if not isinstance(p, nf4_module().NF4Tensor):
            continue
        names, _ = p.__tensor_flatten__()
        if any(f".{m}." in name for m in UNEVEN) and world == 3:
            sizes = [-(-getattr(p, n).numel() // world) * getattr(p, n).element_size()
                     for n in names]
        else:
            chunk = p.chunk(world)[0]
            sizes = [getattr(chunk, n).nbytes for n in names]
        total += sum(-(-s // 64) * 64 for s in sizes)
    return total


def _train(rank, world):
    """Three reproducible AdamW steps; at 3 ranks, also what the sharded model holds."""
    model = sw.shard(_qlora(), reproducible=True)
    uneven = _divided_by_bytes(model)
    nf4 = {n for n, p in _qlora().named_parameters() if isinstance(p, nf4_module().NF4Tensor)}
    expect = {n for n in nf4 if any(f".{m}." in n for m in UNEVEN)} if world == 3 else set()
    assert uneven == expect, sorted(uneven ^ expect)
    assert sw.inspect(model).packed_bytes == _expected_packed_bytes(world)
    if world == 3:
        # The full NF4 bytes, gathered, are the original's; and a forward gives the
        # unsharded quantized model's logits bit for bit.
        ref = _qlora()
        assert _nf4_bytes(model) == _nf4_bytes(ref)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
        # What the module holds while sharded has no values of its own: reading it
        # fails, naming the weight.
        w = model.base_model.model.model.layers[1].mlp.down_proj.weight
        y = torch.ones(3, w.shape[0])  # where the weight is not the first argument too
        for read in (lambda: w + 1, w.to_local, w.full_tensor, lambda: w.sum().item(),
                     lambda: y @ w, lambda: torch.cat([w, w]), lambda: torch.mul(y.t(), w)):
            with pytest.raises(sw.ShardwiseError, match=r"layers\.1\.mlp\.down_proj\.weight "
                                                        r"is a quantized weight .* by bytes"):
                read()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [_step(model, opt, batch) for batch in _batches()]
    # Released after each step, refilled in place at the next gather (the weights
    # LinearNF4 saved in forward saw their values in backward: the bits above).
    assert sw.inspect(model).full_bytes == 0
    sw.check_consistency(model)
    state = _adapters(model, opt)
    return losses, state if rank == 0 else None


def test_qlora_at_3_ranks_with_uneven_weights_gives_the_bits_of_1_and_2():
    (losses, state), *others = [run_ranks(_train, w)[0] for w in (1, 2, 3)]
    assert all(torch.isfinite(torch.tensor(losses))) and min(losses) > 0
    for w, (l2, s2) in zip((2, 3), others):
        assert l2 == losses, f"world {w}: losses {l2} != {losses}"
        assert s2.keys() == state.keys()
        for k in state:
            assert torch.equal(s2[k], state[k]), f"world {w}: {k} differs"


# -- checkpoints: uneven <-> even, byte for byte ----------------------------------------
def _checkpoint(rank, world, load, save):
    """Load ``load`` (if any) into a model quantized from other weights, else train two
    steps; save ``save`` (if any); then the third step."""
    model = sw.shard(_qlora(seed=0 if load is None else 1), reproducible=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen NF4 weights included
    if load is None:
        for batch in _batches()[:2]:
            _step(model, opt, batch)
    else:
        sw.load_checkpoint(load, model, opt)
        assert _nf4_bytes(model) == _nf4_bytes(_qlora())
    if save is not None:
        sw.save_checkpoint(save, model, opt)
    loss = _step(model, opt, _batches()[2])
    state = _adapters(model, opt)
    return loss, state if rank == 0 else None


def test_checkpoints_of_uneven_weights_reload_at_even_world_sizes_and_back(tmp_path):
    at3, at2 = str(tmp_path / "at3"), str(tmp_path / "at2")
    loss, state = run_ranks(_checkpoint, 3, None, at3)[0]
    meta = json.loads((tmp_path / "at3" / "checkpoint.json").read_text())
    q = meta["packed"]["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    # Each rank's element range of the 2048 code bytes (ceil(2048 / 3) = 683 a rank).
    assert q["inner"]["quantized_data"]["pieces"] == [[0, 683], [683, 683], [1366, 682]]
    for world, load, save in ((2, at3, at2), (3, at2, None)):
        got_loss, got = run_ranks(_checkpoint, world, load, save)[0]
        assert got_loss == loss, (world, got_loss, loss)
        assert got.keys() == state.keys()
        for k in state:
            assert torch.equal(got[k], state[k]), (world, k)


# -- quantize while loading, uneven ----------------------------------------------------
def _load_quantized(rank, world, source):
    from transformers import LlamaForCausalLM

    with sw.sharded_init(quantize=BLOCKS):
        base = LlamaForCausalLM(_config())
    model = sw.shard(_with_adapters(base), reproducible=True)
    assert _divided_by_bytes(model)
    sw.load_pretrained(model, source, rename=_peft_names, strict=False)
    reference = sw.shard(_qlora(), reproducible=True)
    # This rank's bytes (padding included), then every weight whole.
    for unit, ref_unit in zip(sw.inspect(model).units, sw.inspect(reference).units):
        assert unit.name == ref_unit.name
    from shardwise.engine.iteration.state import model_state

    mine, theirs = model_state(model), model_state(reference)
    for u, r in zip(mine.units, theirs.units):
        for g, h in zip([g for g in u.groups if not g.by_rows],
                        [h for h in r.groups if not h.by_rows]):
            assert torch.equal(g.local, h.local), u.name
    assert _nf4_bytes(model) == _nf4_bytes(reference)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad],
                                lr=1e-2)
    batch = _batches()[0]
    assert _step(model, opt, batch) == _step(reference, ref_opt, batch)
    return True


def test_quantize_while_loading_at_3_uneven_ranks_equals_quantizing_the_whole(tmp_path):
    from safetensors.torch import save_file

    single = str(tmp_path / "one.safetensors")
    save_file({k: v.contiguous() for k, v in _weights().state_dict().items()}, single)
    assert run_ranks(_load_quantized, 3, single) == [True] * 3


# -- what is still refused ---------------------------------------------------------------
def _refusals(rank, world):
    nf4 = nf4_module().NF4Tensor
    # MixedPrecision's param_dtype reaches a subclass through fsdp_post_all_gather only,
    # which a weight divided by bytes does not call: another dtype is refused, by name,
    # before anything changes.
    model = _qlora()
    with pytest.raises(sw.ShardwiseError, match=r"layers\.0\.self_attn\.q_proj\.base_layer"
                                                r"\.weight .*divided by bytes.*"
                                                r"MixedPrecision\(param_dtype=torch\.bfloat16\)"):
        sw.shard(model, mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    assert not sw.is_sharded(model)
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.weight, nf4)
    # Its own dtype is no change: a model built in bf16 trains under param_dtype=bf16.
    base = _weights().to(torch.bfloat16)
    quantize_nf4(base, block_size=32, scaler_block_size=8)
    model = sw.shard(_with_adapters(base),
                     mixed_precision=sw.MixedPrecision(param_dtype=torch.bfloat16))
    assert _divided_by_bytes(model)
    x = torch.randint(0, 64, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    return True


def test_what_an_uneven_split_still_refuses():
    assert run_ranks(_refusals, 3) == [True] * 3
