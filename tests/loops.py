"""The training loop the tests share, and what a sharded model looks like between steps.

``train_steps`` is the plain loop (forward, backward, step, zero_grad) that several test
files each defined with another optimizer or loss; the loops of the integrations
(accelerate, Lightning, the transformers Trainer) and their resumes differ in substance
and stay in their files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw


def call_loss(model: nn.Module, *batch: Any) -> torch.Tensor:
    """A model that returns its own loss: ``model(*batch)`` (the reference GPT)."""
    return model(*batch)


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[tuple],
                loss_fn: Callable[..., torch.Tensor] = call_loss) -> list[float]:
    """One optimizer step per batch: ``loss_fn(model, *batch)``, backward, step, and
    gradients set to None. Returns each step's loss."""
    losses = []
    for batch in batches:
        loss = loss_fn(model, *batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_at_rest(model: nn.Module) -> None:
    """Every unit sharded with no full parameter allocated, and the model holding exactly
    its shards (no full parameter left in place, none added or replaced)."""
    view = sw.inspect(model)
    for u in view.units:
        assert u.state == "sharded" and not any(g.full_allocated for g in u.groups), u
    assert all(p.held == "shard" for u in view.units for p in u.params), view
    assert not view.unmanaged, view.unmanaged
