"""Activation checkpointing under shardwise: the recipes of docs/performance.md
("Activation checkpointing") train to DDP's bits at 2 ranks.

Checkpointing changes what is kept for the backward, not the arithmetic: a block's
forward is recomputed with the same kernels on the same values. So every variant is
compared, losses and consolidated state bit for bit, with DDP training the model without
checkpointing; the selective recipe (torch's ``create_selective_checkpoint_contexts``
with a policy that saves the matmuls' and attention's outputs) is also run under DDP,
which gives the same bits. Variants: each block wrapped by torch's
``apply_activation_checkpointing`` (non-reentrant, full or selective; reentrant), a
forward that runs its blocks through ``checkpoint_sequential`` (reentrant or not), and a
Hugging Face Llama whose own ``activation_checkpointing_enable`` is given the selective
policy's ``context_fn``.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn as nn
from harness import run_ranks
from parity import GPT_CFG, cpu_state, gpt_batches, gpt_loss, train
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

import shardwise as sw
from shardwise.models import GPT, Block

STEPS = 4

# The recipe's policy (docs/performance.md): keep what the matmuls and attention compute,
# recompute the cheap rest (norms, activations, additions).
SAVED = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default}


DECIDED = [0]  # ops the policy was asked about


def policy(ctx, op, *args, **kwargs):
    DECIDED[0] += 1
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class SequentialGPT(GPT):
    """The reference GPT whose forward runs its blocks through ``checkpoint_sequential``."""

    reentrant = False

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        x = checkpoint_sequential(list(self.blocks), 2, x, use_reentrant=self.reentrant)
        logits = self.lm_head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def checkpointed(model: nn.Module, variant: str) -> nn.Module:
    """``model`` with its blocks checkpointed as ``variant`` says (before sw.shard)."""
    if variant == "selective":
        wrap = functools.partial(
            checkpoint_wrapper,
            context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    elif variant == "full":
        wrap = checkpoint_wrapper
    elif variant == "reentrant":
        wrap = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    else:
        return model
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap,
                                   check_fn=lambda m: isinstance(m, Block))
    return model


def _build(rank: int, variant: str) -> nn.Module:
    torch.manual_seed(rank)  # src_rank's values must win, as in tests/parity.py
    if variant.startswith("sequential"):
        model = SequentialGPT(GPT_CFG)
        model.reentrant = variant == "sequential_reentrant"
        return model
    return checkpointed(GPT(GPT_CFG), variant)


def _parity(rank, world, variants):
    # DDP without checkpointing, and DDP with the selective recipe: the same bits.
    ddp = DDP(_build(rank, "none"))  # DDP takes rank 0's values, as sw.shard does
    ref_losses = train(ddp, gpt_batches(rank, STEPS), gpt_loss)
    ref = cpu_state(ddp.module)
    selective = DDP(_build(rank, "selective"))
    assert torch.equal(train(selective, gpt_batches(rank, STEPS), gpt_loss), ref_losses)
    assert all(torch.equal(v, ref[k]) for k, v in cpu_state(selective.module).items())
    for variant in variants:
        model = sw.shard(_build(rank, variant))
        calls = [0]
        for m in model.modules():
            if isinstance(m, Block):
                m.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        DECIDED[0] = 0
        losses = train(model, gpt_batches(rank, STEPS), gpt_loss)
        # Each checkpointed block ran twice a step: its forward, and again in the
        # backward. checkpoint_sequential leaves its last segment alone: of 3 blocks in 2
        # segments, the first block is checkpointed.
        again = 1 if variant.startswith("sequential") else GPT_CFG.n_layer
        assert calls[0] == (GPT_CFG.n_layer + again) * STEPS, (variant, calls)
        assert (DECIDED[0] > 0) == (variant == "selective"), variant
        assert torch.equal(losses, ref_losses), (variant, losses, ref_losses)
        state = sw.full_state_dict(model, rank0_only=False)
        assert list(state) == list(ref), variant  # the wrapper's prefix is not in the keys
        for k, v in ref.items():
            assert torch.equal(state[k], v), (variant, k)
    return True


@pytest.mark.parametrize("variants", [("selective", "full"),
                                      ("reentrant", "sequential", "sequential_reentrant")],
                         ids=["selective-full", "reentrant-sequential"])
def test_checkpointed_blocks_train_to_ddps_bits(variants):
    assert run_ranks(_parity, 2, variants) == [True, True]


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)).train()


def _llama_loss(model, x, y):
    return model(input_ids=x % 64, labels=x % 64).loss


def _hugging_face(rank, world):
    ddp = DDP(_llama())
    ref_losses = train(ddp, gpt_batches(rank, STEPS), _llama_loss)
    ref = cpu_state(ddp.module)
    model = _llama()
    enable = getattr(model, "activation_checkpointing_enable", None) or \
        model.gradient_checkpointing_enable  # transformers before 5.24
    enable({"use_reentrant": False,
            "context_fn": functools.partial(create_selective_checkpoint_contexts, policy)})
    model = sw.shard(model)
    DECIDED[0] = 0
    losses = train(model, gpt_batches(rank, STEPS), _llama_loss)
    assert DECIDED[0] > 0
    assert torch.equal(losses, ref_losses), (losses, ref_losses)
    state = sw.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(state[k], v) for k, v in ref.items())
    return True


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers")
def test_hugging_face_checkpointing_with_a_selective_policy_trains_to_ddps_bits():
    assert run_ranks(_hugging_face, 2) == [True, True]
