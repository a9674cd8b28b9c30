"""PEFT/LoRA on a sharded model: adapters train as under DDP; only they are reduced and
get optimizer state; an adapter-only save loads in PEFT; merging works from a
consolidated state. Tiny Llama from a config, nothing downloaded."""

import copy
import os

import pytest
import torch
from harness import run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwise as sw

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}


def llama_config(tie: bool = True) -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       max_position_embeddings=32, tie_word_embeddings=tie)


def _lora_model(tie: bool = True):
    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(llama_config(tie)), LoraConfig(**LORA))
    with torch.no_grad():  # LoRA's B starts at zero; make the adapters matter at once
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _train_lora(rank, world, out):
    ref = DDP(_lora_model())
    ours = sw.shard(_lora_model())
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, ours)]
    before = sw.inspect(ours).comm
    for step in range(3):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank + step))
        for m, opt in zip((ref, ours), opts):
            m(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    # Only the adapters' groups are reduce-scattered, and only they have optimizer state.
    view = sw.inspect(ours)
    lora_bytes = sum(g.gathered_numel * g.dtype.itemsize
                     for u in view.units for g in u.groups if g.requires_grad)
    assert view.comm.since(before).bytes["reduce_scatter"] == 3 * lora_bytes
    assert len(opts[1].state) == len(trainable)
    sd = sw.full_state_dict(ours, rank0_only=False)
    for k, v in ref.module.state_dict().items():
        assert torch.equal(sd[k], v), k  # bit-identical to DDP at 2 ranks
    if rank == 0:
        ours.save_pretrained(out, state_dict=sd)  # PEFT keeps only the adapters
    torch.distributed.barrier()
    return sd if rank == 0 else None


@pytest.mark.slow
def test_lora_trains_like_ddp_and_saves_adapters_peft_loads(tmp_path):
    out = str(tmp_path / "adapter")
    sd = run_ranks(_train_lora, 2, out)[0]
    assert "adapter_model.safetensors" in os.listdir(out)
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config())  # the same frozen base weights as _lora_model's
    loaded = PeftModel.from_pretrained(base, out).eval()
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, sd[n]), n
    # Merging from the consolidated state gives the adapted model's outputs.
    adapted = _lora_model()
    adapted.load_state_dict(sd)
    adapted.eval()
    x = torch.arange(1, 9).view(1, 8)
    with torch.no_grad():
        expect = adapted(input_ids=x).logits
        merged = adapted.merge_and_unload()
        got = merged(input_ids=x).logits
    print("merge: max abs difference", (got - expect).abs().max().item())
    # W + s*B@A folded once against x@W + s*(x@A)@B: a few fp32 roundings of logits of
    # order 1 (measured 1.2e-7).
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def _generate_lora(rank, world):
    """Note [forward entries]: PeftModel.generate runs the inner model's forward, not the
    PeftModel's; it must gather the root unit (embedding, norm, head) all the same."""
    # Untied: this tiny tied model only ever repeats the prompt's last token.
    ref = _lora_model(tie=False).eval()
    ours = sw.shard(_lora_model(tie=False)).eval()
    # Each rank its own prompts and its own length: synced_gpus keeps the early rank
    # running forwards until the other is done (else it would hang in an all-gather).
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))
    opts = {"max_new_tokens": 3 + 4 * rank, "do_sample": False, "eos_token_id": None}
    with torch.no_grad():
        got = ours.generate(input_ids=prompt, **opts)
        expect = ref.generate(input_ids=prompt, **opts)
        with ref.disable_adapter():
            plain = ref.generate(input_ids=prompt, **opts)
        copied = copy.deepcopy(ours).generate(input_ids=prompt, **opts)  # its own hooks
    assert torch.equal(got, expect), (got, expect)
    assert torch.equal(copied, expect), (copied, expect)
    assert not torch.equal(plain, expect)  # the adapters decide some tokens
    # The inner model called directly, with gradients, is a whole training forward; the
    # same batch on every rank, so the averaged adapter gradients are the reference's.
    ours.train()
    ref.train()
    x = torch.arange(1, 9).view(1, 8)
    ours.get_base_model()(input_ids=x, labels=x).loss.backward()
    ref.get_base_model()(input_ids=x, labels=x).loss.backward()
    grads = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        if p.requires_grad:
            # g/2 + g/2 is g exactly: the reduction adds two equal halves.
            assert torch.equal(p.grad.full_tensor(), grads[n].grad), n
    return True


@pytest.mark.slow
def test_generate_on_a_sharded_peft_model_equals_unsharded():
    assert run_ranks(_generate_lora, 2, timeout=180) == [True, True]
