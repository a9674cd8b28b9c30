"""Quantize while loading (issue 43): a QLoRA base built under
``sw.sharded_init(quantize=...)``, sharded, then filled by ``sw.load_pretrained`` from
safetensors, weight by weight, never whole in full precision on any rank.

The reference is the path that holds the whole model in full precision: build it, quantize
it with ``quantize_nf4``, shard it. Both must give the same NF4 bytes on every rank and the
same training bits in the reproducible mode, at 2 ranks (a Hugging Face folder of
several safetensors files with an index) and 3 (one safetensors file)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from test_quantized import _step

import shardwise as sw

if importlib.util.find_spec("torchao") is None:  # not importorskip: torchao's import is noisy
    pytest.skip("torchao is not installed (shardwise[quant])", allow_module_level=True)
from shardwise.integrations.quant import NF4, nf4_module, quantize_nf4  # noqa: E402

BLOCKS = NF4(block_size=32, scaler_block_size=8)  # whole blocks at 1, 2 and 3 ranks


def _config():
    from transformers import LlamaConfig

    # 96 and 192 rows: whole NF4 blocks (32) and scale blocks (8) at 2 and 3 ranks.
    return LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=192,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=32)


def _weights():
    """The pretrained weights: a Llama with seed 0's random weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_config())


def _with_adapters(base):
    """PEFT LoRA on q_proj and v_proj, from seed 1 (each path spends the RNG differently
    while building), with B drawn so the adapters matter at once."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _peft_names(key: str) -> str:
    """A Hugging Face key as the PeftModel names it: LoRA wraps q_proj and v_proj, whose
    own weights become ``base_layer``'s."""
    for m in ("q_proj", "v_proj"):
        key = key.replace(f".{m}.", f".{m}.base_layer.")
    return "base_model.model." + key


def _reference():
    """Quantize the whole model, then shard (the path that holds every weight whole)."""
    base = _weights()
    quantize_nf4(base, block_size=BLOCKS.block_size,
                 scaler_block_size=BLOCKS.scaler_block_size)
    return sw.shard(_with_adapters(base), reproducible=True)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()


def _nf4_bytes(model) -> dict[str, bytes]:
    """Every weight whole, NF4 ones as their inner tensors' bytes (a collective)."""
    nf4 = nf4_module().NF4Tensor
    out = {}
    for k, v in sw.full_state_dict(model, rank0_only=False).items():
        if isinstance(v, nf4):
            names, _ = v.__tensor_flatten__()
            out.update({f"{k}/{n}": _bytes(getattr(v, n)) for n in names})
        else:
            out[k] = _bytes(v)
    return out


def _local_nf4(model) -> dict[str, bytes]:
    """This rank's share of every NF4 weight, as bytes."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, nf4_module().NF4Tensor):
            names, _ = local.__tensor_flatten__()
            out[name] = b"".join(_bytes(getattr(local, n)) for n in names)
    return out


def _batches(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 64, (6, 8), generator=g) for _ in range(steps)]


def _train(model) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Three reproducible AdamW steps; the losses, adapters and their state, whole."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for batch in _batches():
        losses.append(_step(model, opt, batch))  # test_quantized's reproducible step
    state = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            state[name] = p.full_tensor()
            for k, v in opt.state[p].items():
                state[f"{name}/{k}"] = v.full_tensor() if v.dim() else v
    return losses, state


def _load_quantized(rank, world, source, held_bytes=None):
    from transformers import LlamaForCausalLM

    if held_bytes is not None:  # every full-precision row read again when written
        from shardwise.checkpoint import pretrained
        pretrained._HELD_BYTES = held_bytes
    with sw.sharded_init(quantize=BLOCKS):
        base = LlamaForCausalLM(_config())
    # No full-precision values exist for the quantized weights before the load.
    q = base.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q, nf4_module().NF4Tensor)
    assert q.quantized_data.stride() == (0,)  # a placeholder in no memory
    model = sw.shard(_with_adapters(base), reproducible=True)
    x = torch.randint(0, 64, (1, 4))
    with pytest.raises(sw.ShardwiseError,
                       match=r"q_proj\.base_layer\.weight.*have not been loaded"):
        model(input_ids=x)
    # strict=False: the source has no adapters; a base parameter it leaves out is refused
    # (test_strict_false_refuses_base_weights_the_source_does_not_fill).
    sw.load_pretrained(model, source, rename=_peft_names, strict=False)

    reference = _reference()
    assert _local_nf4(model) == _local_nf4(reference)  # this rank's share, byte for byte
    assert _nf4_bytes(model) == _nf4_bytes(reference)  # every weight, whole
    got, want = _train(model), _train(reference)
    assert got[0] == want[0], (got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for k in want[1]:
        assert torch.equal(got[1][k], want[1][k]), k
    return True


def _save_folder(path: str) -> None:
    # Several files and an index, as Hugging Face writes a large model.
    _weights().save_pretrained(path, max_shard_size="100KB", safe_serialization=True)


def test_quantize_while_loading_equals_quantizing_the_whole_model(tmp_path):
    from safetensors.torch import save_file

    folder = str(tmp_path / "hf")
    _save_folder(folder)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert run_ranks(_load_quantized, 2, folder) == [True] * 2
    single = str(tmp_path / "one.safetensors")
    save_file({k: v.contiguous() for k, v in _weights().state_dict().items()}, single)
    assert run_ranks(_load_quantized, 3, single) == [True] * 3
    # Rows read once to be checked and again to be written (large ones, at their default
    # threshold of 16 MiB) load the same bits.
    assert run_ranks(_load_quantized, 2, folder, 0) == [True] * 2


def _refusals(rank, world, folder):
    from transformers import LlamaForCausalLM

    for bad, match in [("int4", "unknown quantization.*'nf4'"),
                       (3, "takes 'nf4', a callable"),
                       (NF4(block_size=0), "block_size=0")]:
        with pytest.raises(sw.ShardwiseError, match=match):
            with sw.sharded_init(quantize=bad):
                pass
    rules = [
        (lambda n, m: n.endswith("input_layernorm"),
         r"model\.layers\.0\.input_layernorm \(LlamaRMSNorm, weight \[96\]\): only nn.Linear"),
        (lambda n, m: True, r"model\.embed_tokens \(Embedding.*only nn.Linear"),
        ("nf4", r"model\.layers\.0\.self_attn\.q_proj\.weight \(\[96, 96\], 9216 elements\) "
                r"cannot be quantized to NF4 with block_size=64"),
    ]
    for rule, match in rules:
        with pytest.raises(sw.ShardwiseError, match=match):
            with sw.sharded_init(quantize=rule):
                LlamaForCausalLM(_config())
    with pytest.raises(sw.ShardwiseError, match=r"chose q\.lora_A, a PEFT adapter"):
        with sw.sharded_init(quantize=NF4(where=lambda n, m: isinstance(m, nn.Linear),
                                          block_size=32, scaler_block_size=2)):
            nn.ModuleDict({"q": nn.ModuleDict({"lora_A": nn.Linear(64, 64)})})
    # Loading into the stand-ins of a model not sharded yet.
    with sw.sharded_init(quantize=BLOCKS):
        base = LlamaForCausalLM(_config())
    with pytest.raises(sw.ShardwiseError, match=r"not sharded yet.*sw\.shard\(model\) first"):
        sw.load_pretrained(base, folder)
    # A source whose weights are integers: refused before anything changes.
    model = sw.shard(base)
    ints = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in
            _weights().state_dict().items()}
    with pytest.raises(sw.ShardwiseError, match="int32"):
        sw.load_pretrained(model, ints)
    # A rule leaving a linear layer out: it is loaded in full precision, as is the head.
    with sw.sharded_init(quantize=NF4(where=lambda n, m: n.endswith("q_proj"),
                                      block_size=32, scaler_block_size=8)):
        base = LlamaForCausalLM(_config())
    assert isinstance(base.model.layers[0].self_attn.q_proj.weight, nf4_module().NF4Tensor)
    assert not isinstance(base.model.layers[0].self_attn.k_proj.weight,
                          nf4_module().NF4Tensor)
    model = sw.shard(base)
    sw.load_pretrained(model, folder)
    want = _weights().state_dict()
    got = sw.full_state_dict(model, rank0_only=False)
    for k in ("model.layers.0.self_attn.k_proj.weight", "lm_head.weight",
              "model.norm.weight"):
        assert torch.equal(got[k], want[k]), k
    model(input_ids=torch.randint(0, 64, (1, 4)))  # loaded: runs
    # strict=False and a quantized weight missing from the source: refused by name before
    # anything changes (Note [the base awaits loading]), so the forward still refuses.
    with sw.sharded_init(quantize=BLOCKS):
        base = LlamaForCausalLM(_config())
    model = sw.shard(base)
    partial = {k: v for k, v in want.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(sw.ShardwiseError, match=r"(?s)nothing was changed.*1 parameters of a "
                                                r"base.*\['model\.layers\.1\.mlp\.up_proj"
                                                r"\.weight'\]"):
        sw.load_pretrained(model, partial, strict=False)
    with pytest.raises(sw.ShardwiseError, match=r"^model\.embed_tokens\.weight, .* \(21 "
                                                r"parameters\).*have not been loaded"):
        model(input_ids=torch.randint(0, 64, (1, 4)))
    return True


def test_bad_quantize_input_is_refused_by_name(tmp_path):
    folder = str(tmp_path / "hf")
    _save_folder(folder)
    assert run_ranks(_refusals, 2, folder) == [True] * 2


def test_a_linear_deferred_then_replaced_in_the_block_is_refused():
    def replaced(rank, world):
        with pytest.raises(sw.ShardwiseError, match=r"0\.weight was deferred.*replaced"):
            with sw.sharded_init(quantize=NF4(block_size=32, scaler_block_size=2)):
                model = nn.Sequential(nn.Linear(64, 64))
                model[0].weight = nn.Parameter(torch.zeros(64, 64))
        return True

    assert run_ranks(replaced, 2) == [True] * 2


def _misses_under_strict_false(rank, world, folder):
    """strict=False forgives the adapters, not a base parameter the source does not
    fill: a rename= that misses the embeddings, the final norm and the head, and a
    forgotten rename=, are refused at load time on every rank, nothing changed."""
    from transformers import LlamaForCausalLM

    with sw.sharded_init(quantize=BLOCKS):
        base = LlamaForCausalLM(_config())
    model = sw.shard(_with_adapters(base))
    x = torch.randint(0, 64, (1, 4))

    def layers_only(key: str) -> str:  # misses model.embed_tokens, model.norm, lm_head
        return _peft_names(key) if ".layers." in key else key

    with pytest.raises(sw.ShardwiseError) as err:
        sw.load_pretrained(model, folder, rename=layers_only, strict=False)
    said = str(err.value)
    assert "nothing was changed" in said, said
    for name in ("base_model.model.model.embed_tokens.weight",
                 "base_model.model.model.norm.weight", "base_model.model.lm_head.weight",
                 "'model.embed_tokens.weight'", "rename="):  # what is missing, what is left
        assert name in said, (name, said)
    assert "lora_" not in said, said  # the adapters are what strict=False is for
    # A forgotten rename=: no name in the source matched, said with an example of each
    # side, under strict=False and strict=True alike.
    for strict in (False, True):
        with pytest.raises(sw.ShardwiseError, match=(
                r"no name in the source matched.*'model\.embed_tokens\.weight'.*"
                r"'base_model\.model\.model\.embed_tokens\.weight'.*"
                r"rename=\{'': 'base_model\.model\.'\}")):
            sw.load_pretrained(model, folder, strict=strict)
    # Nothing was loaded: the forward still refuses, naming the embeddings too.
    with pytest.raises(sw.ShardwiseError,
                       match=r"^base_model\.model\.model\.embed_tokens\.weight, "
                             r".*q_proj\.base_layer\.weight.*sw\.load_pretrained"):
        model(input_ids=x)
    # The right rename= loads everything and the adapters are left to train.
    sw.load_pretrained(model, folder, rename=_peft_names, strict=False)
    want = _weights().state_dict()
    got = sw.full_state_dict(model, rank0_only=False)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(got[_peft_names(k)], want[k]), k
    model(input_ids=x)
    return True


def test_strict_false_refuses_base_weights_the_source_does_not_fill(tmp_path):
    folder = str(tmp_path / "hf")
    _save_folder(folder)
    assert run_ranks(_misses_under_strict_false, 2, folder) == [True] * 2
