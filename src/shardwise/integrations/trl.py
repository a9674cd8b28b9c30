"""TRL's trainers on a sharded model: what ``class X(DPOTrainer, ShardwiseTrainer)`` needs
beyond the ``Trainer`` glue of ``ShardwiseTrainer``.

``ShardwiseTrainer`` calls :func:`adapt` when it is built as a base of one of TRL's
trainers; nothing here is used otherwise. The reference, reward and teacher models TRL
prepares with ``accelerator.prepare_model(m, evaluation_mode=True)`` are sharded by
``ShardwiseAccelerator.prepare_model`` (Note [models prepared for evaluation] in
integrations/accelerate.py).

Note [TRL's model hash]
With ``precompute_ref_log_probs=True``, TRL's ``DPOTrainer`` and ``KTOTrainer`` name the
cache file of the reference log-probabilities after a hash of the model's weights:
``hash_module(model)`` (trl/trainer/utils.py) walks ``model.state_dict()`` and hashes
each tensor's ``.numpy()`` bytes, right after ``Trainer.__init__`` returned. Under
``ShardwiseTrainer`` the model is sharded by then, its state dict holds DTensors, and
``.numpy()`` refuses them ("not supported for tensor subclasses"): the trainer could not
be built. TRL hashes before sharding under FSDP for this reason, but here the model is
sharded inside ``Trainer.__init__``, before the hash, and a model built under
``sw.sharded_init()`` was never whole. A DTensor's ``.numpy()`` cannot be given the
whole tensor's bytes (an all-gather inside ``.numpy()`` would hang the common
``if rank == 0:`` call, Note [rank-local scalars] in comm/scalars.py), and TRL offers no
hook between ``Trainer.__init__`` and the hash. So the name ``hash_module`` in those
trainers' modules is wrapped, once per process, by :func:`_hash_module`: for a module
holding shards it gathers the full state dict on rank 0 (``sw.full_state_dict``, one
unit at a time), hashes it with TRL's own function and gives every rank rank 0's digest
(TRL broadcasts rank 0's fingerprint anyway); every other module goes to TRL's function
as before. The digest is the one TRL computes for the unsharded model (tested), so a
cache written by a DDP run is found by a sharded run and the other way round. Every rank
calls it, as TRL does (the hash is in ``__init__``, on every rank).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ..checkpoint.state_dict import full_state_dict
from ..engine.iteration.state import owning_state

# TRL's modules whose trainers hash their model (Note [TRL's model hash]).
_HASHING = ("trl.trainer.dpo_trainer", "trl.trainer.kto_trainer")
_MARK = "_shardwise_wrapped"


def trl_classes(classes: tuple[type, ...]) -> list[type]:
    """TRL's classes among ``classes`` (a slice of a method resolution order)."""
    return [c for c in classes if c.__module__.split(".")[0] == "trl"]


def adapt() -> None:
    """Make TRL's trainers work on a sharded model (Note [TRL's model hash]). Called by
    ``ShardwiseTrainer.__init__`` for a TRL trainer; idempotent."""
    for name in _HASHING:
        try:
            module = importlib.import_module(name)
        except ImportError:  # another TRL release: nothing of it to adapt
            continue
        original = getattr(module, "hash_module", None)
        if original is None or getattr(original, _MARK, False):
            continue
        module.hash_module = _wrapped(original)  # type: ignore[attr-defined]


def _wrapped(original: Callable[[nn.Module], str]) -> Callable[[nn.Module], str]:
    def hash_module(module: nn.Module) -> str:
        return _hash_module(module, original)

    setattr(hash_module, _MARK, True)
    hash_module.__doc__ = original.__doc__
    return hash_module


class _StateOnly:
    """Stands for a module whose ``state_dict()`` is ``state`` (TRL's hash reads only
    that)."""

    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state_dict(self) -> dict[str, Any]:
        return self._state


def _hash_module(module: nn.Module, original: Callable[[Any], str]) -> str:
    """TRL's ``hash_module`` digest of ``module``, sharded or not (Note [TRL's model
    hash]). Every rank must call it for a sharded module."""
    state = owning_state(module)
    if state is None:
        return original(module)
    full = full_state_dict(module)  # rank 0 holds it; the others get {}
    digest = original(_StateOnly(full)) if state.comm.rank == 0 else None
    return str(state.comm.all_gather_object(digest, what="TRL's model hash")[0])
