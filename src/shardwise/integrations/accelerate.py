"""``ShardwiseAccelerator``: accelerate's ``Accelerator``, sharding models with shardwise.

accelerate wraps every model it prepares in ``DistributedDataParallel``; a sharded model
must not be (shardwise already averages gradients), and its gradient clipping,
accumulation and state saving must go through shardwise. This subclass changes exactly
those points and nothing else:

- ``prepare`` shards each model it is given (units from the model's
  ``_no_split_modules`` when it has them), never wraps one in DDP, and points optimizers
  built on the unsharded model at the sharded parameters;
- ``prepare_model(model, evaluation_mode=True)`` freezes and shards a model that is not
  sharded yet (Note [models prepared for evaluation]);
- ``clip_grad_norm_`` returns the global norm over every rank's shards, identical on
  every rank;
- ``no_sync`` (used by ``accumulate``) is ``sw.no_sync``;
- ``save_state``/``load_state`` write and read a shardwise checkpoint (loadable at any
  world size) holding the schedulers' and the step's state in its JSON (nothing
  pickled);
- ``get_state_dict`` returns the full state dict on the main process and an empty one
  elsewhere, as accelerate's does for FSDP and DeepSpeed ZeRO-3 (so
  ``save_pretrained(..., state_dict=accelerator.get_state_dict(model))`` works).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..checkpoint import load_checkpoint, save_checkpoint
from ..checkpoint.sources import load_weights_only
from ..checkpoint.state_dict import full_state_dict, share_tied
from ..comm.order_check import watch_steps
from ..engine.entry_points.state_dict import install_optimizer_hooks
from ..engine.iteration.state import model_state, owning_state
from ..errors import ShardwiseError
from ..grads import clip_grad_norm_, no_sync
from ..sharding import is_sharded, shard
from ._json import from_json, to_json
from ._units import no_split_units

_CHECKPOINT = "shardwise"            # the shardwise checkpoint inside a state folder
_SCHEDULERS = "schedulers.pt"  # where a shardwise before issue 51 kept them (a pickle)
_ADVICE = ("(ShardwiseAccelerator keeps the schedulers' states as JSON, never pickled): "
           "a scheduler whose state_dict() holds other objects must be saved by you")

# Note [models prepared for evaluation]
# accelerate's ``prepare_model(model, evaluation_mode=True)`` places a model and applies
# autocast without wrapping it for training: it is how TRL's trainers prepare the models
# they only run forward under ``no_grad`` (DPO's and KTO's reference model in full
# fine-tuning, GRPO's and RLOO's reference and reward models, the distillation trainers'
# teachers). Left whole, such a model is replicated on every rank, and a DPO run keeps
# half of its weights outside ZeRO-3's saving. TRL shards it under DeepSpeed ZeRO-3 and
# FSDP with its own code (``prepare_deepspeed``, ``prepare_fsdp``), a path a shardwise
# run does not take. So here such a model is sharded, as ``prepare`` shards any model,
# after ``requires_grad_(False)``: every group is frozen, gathered and never reduced, and
# holds no gradient. A model already sharded, or part of a sharded model, is left as it
# is (the Trainer prepares its own, sharded, model this way to evaluate without
# training), and so is one without parameters.


class ShardwiseAccelerator(Accelerator):
    """An ``Accelerator`` whose models are sharded by shardwise (ZeRO-3), not DDP-wrapped.

    Takes the same arguments as ``accelerate.Accelerator``, plus ``shard_kwargs``:
    keyword arguments for :func:`shardwise.shard` (``units``, ``mixed_precision``,
    ``buffers``, ...) used for models ``prepare`` shards.

    Raises:
        ShardwiseError: from ``prepare``, for an optimizer that already has state for the
            unsharded parameters; from ``save_state``/``load_state``, with more than one
            sharded model or optimizer.

    Example:
        >>> accelerator = ShardwiseAccelerator()
        >>> model, opt, loader = accelerator.prepare(model, opt, loader)
        >>> for x, y in loader:
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(model(x, y))
        ...         accelerator.clip_grad_norm_(model.parameters(), 1.0)
        ...         opt.step(); opt.zero_grad()
    """

    def __init__(self, *args: Any, shard_kwargs: dict | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_shardwise(shard_kwargs)

    def init_shardwise(self, shard_kwargs: dict | None = None) -> None:
        """Set this class's own attributes. ``ShardwiseTrainer`` calls it after switching
        the Trainer's ``Accelerator`` to this class, which runs no ``__init__``."""
        self.shard_kwargs = dict(shard_kwargs or {})
        # Kept across calls of prepare(): an optimizer may be prepared after its model.
        self._shardwise_remap: dict[int, nn.Parameter] = {}
        self._shardwise_watched: set[int] = set()  # ids of the optimizers watch_steps has

    # -- prepare -----------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        remap = self._shardwise_remap
        for obj in args:
            if isinstance(obj, nn.Module) and not is_sharded(obj):
                remap.update(self._shard(obj))
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer) and remap:
                _repoint(obj, remap)
        for obj in args:
            if isinstance(obj, torch.optim.Optimizer):
                self._watch(obj, [o for o in args if isinstance(o, nn.Module)])
        return super().prepare(*args, device_placement=device_placement)

    def _watch(self, optimizer: torch.optim.Optimizer, models: list[nn.Module]) -> None:
        """Check every step that all ranks stepped (``watch_steps``), once per optimizer
        of a sharded model."""
        watched = self._shardwise_watched
        inner = plain_optimizer(optimizer)
        if id(inner) in watched:
            return
        ids = {id(p) for g in inner.param_groups for p in g["params"]}
        for model in [*models, *self._models]:
            state = model_state(self.unwrap_model(model))
            if state is not None and ids & {id(p) for p in model.parameters()}:
                watch_steps(state.comm, inner)
                watched.add(id(inner))
                return

    def _shard(self, model: nn.Module) -> dict[int, nn.Parameter]:
        """Shard ``model``; map each original parameter's id to its sharded parameter."""
        before = dict(model.named_parameters(remove_duplicate=False))
        kwargs = dict(self.shard_kwargs)
        kwargs.setdefault("units", no_split_units(model))
        if self.device.type != "cpu":
            model.to(self.device)
        shard(model, **kwargs)
        after = dict(model.named_parameters(remove_duplicate=False))
        return {id(p): after[name] for name, p in before.items()}

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """accelerate's ``prepare_model``, never wrapping in DDP. A model prepared for
        evaluation only that is not sharded yet (TRL's reference, reward and teacher
        models) is frozen and sharded: Note [models prepared for evaluation]."""
        if (evaluation_mode and not is_sharded(model) and owning_state(model) is None
                and any(True for _ in model.parameters())):
            model.requires_grad_(False)
            self._shard(model)
        if is_sharded(model):
            # evaluation_mode skips the DDP wrapper and nothing else (autocast, compile):
            # shardwise reduces gradients itself, and placed the shards at shard().
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement, evaluation_mode)

    # -- training ----------------------------------------------------------------------
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        params = list(parameters)
        model = self._sharded_model_of(params)
        if model is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        self.unscale_gradients()
        return clip_grad_norm_(model, max_norm, norm_type)

    def no_sync(self, model: nn.Module) -> Any:
        if is_sharded(self.unwrap_model(model)):
            return no_sync(self.unwrap_model(model))
        return super().no_sync(model)

    def _sharded_model_of(self, params: list) -> nn.Module | None:
        ids = {id(p) for p in params}
        for model in self._models:
            model = self.unwrap_model(model)
            if is_sharded(model) and ids == {id(p) for p in model.parameters()}:
                return model
        return None

    # -- state -------------------------------------------------------------------------
    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """The full state dict of a sharded model on the main process, ``{}`` on the
        others (every rank calls it), as accelerate returns under FSDP and DeepSpeed
        ZeRO-3: plain CPU tensors with the unsharded model's names, a tied weight's
        names sharing one tensor as in ``model.state_dict()``, ready for
        ``save_pretrained(path, state_dict=...)`` (which writes a tied weight once) or
        ``torch.save`` on the main process. An unsharded model's is accelerate's own.

        Example:
            >>> sd = accelerator.get_state_dict(model)
            >>> if accelerator.is_main_process:
            ...     model.save_pretrained(path, state_dict=sd)
        """
        target = self.unwrap_model(model) if unwrap else model
        if owning_state(target) is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return share_tied(target, full_state_dict(target, rank0_only=True))

    def save_state(self, output_dir: str | None = None, **kwargs: Any) -> str:
        """Save the sharded model, its optimizer, the schedulers and the step.

        Returns the folder; ``load_state`` reads it back at any world size.
        """
        if output_dir is None:
            return super().save_state(output_dir, **kwargs)  # accelerate's automatic naming
        model, optimizer = self._sharded_state()
        # The schedulers' states go into the checkpoint's JSON, committed with it; nothing
        # is pickled (Note [what shardwise reads] in checkpoint/sources.py).
        schedulers = to_json([s.state_dict() for s in self._schedulers], "schedulers",
                             _ADVICE)
        save_checkpoint(os.path.join(output_dir, _CHECKPOINT), model, optimizer,
                        extra={"step": self.step, "schedulers": schedulers})
        self.wait_for_everyone()
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Load what :meth:`save_state` wrote (at this or another world size)."""
        if input_dir is None or not os.path.isdir(os.path.join(input_dir, _CHECKPOINT)):
            return super().load_state(input_dir, **kwargs)
        model, optimizer = self._sharded_state()
        extra = load_checkpoint(os.path.join(input_dir, _CHECKPOINT), model, optimizer)
        self.step = int(extra["step"])
        if "schedulers" in extra:
            states = from_json(extra["schedulers"], f"{input_dir}/{_CHECKPOINT}")
        else:
            states = _old_schedulers(os.path.join(input_dir, _SCHEDULERS))
        for scheduler, state in zip(self._schedulers, states):
            scheduler.load_state_dict(state)

    def _sharded_state(self) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        models = [self.unwrap_model(m) for m in self._models]
        if len(models) != 1 or not is_sharded(models[0]):
            raise ShardwiseError(
                f"ShardwiseAccelerator.save_state/load_state handle one sharded model; "
                f"{len(models)} model(s) were prepared. Save each with sw.save_checkpoint")
        if len(self._optimizers) > 1:
            raise ShardwiseError("ShardwiseAccelerator.save_state/load_state handle one "
                                 "optimizer; save each with sw.save_checkpoint")
        optimizer = plain_optimizer(self._optimizers[0]) if self._optimizers else None
        return models[0], optimizer


def _old_schedulers(path: str) -> list:
    """The schedulers' states a shardwise before issue 51 wrote beside the checkpoint
    (``schedulers.pt``, a torch pickle): loaded with ``weights_only=True``, torch's
    allow-list of tensors and plain containers, so that it can never run code."""
    if not os.path.isfile(path):
        return []
    states = load_weights_only(path, "Save the state again with this shardwise (it now "
                                     "keeps the schedulers in the checkpoint's JSON)")
    if not isinstance(states, list):
        raise ShardwiseError(f"{path}: expected a list of scheduler states, found a "
                             f"{type(states).__name__}")
    return states


def plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's wrapper (itself an Optimizer subclass)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _repoint(optimizer: torch.optim.Optimizer, remap: dict[int, nn.Parameter]) -> None:
    """Make an optimizer built on an unsharded model use the sharded parameters."""
    if not any(id(p) in remap for g in optimizer.param_groups for p in g["params"]):
        return  # built on the sharded model already, or on another model
    if optimizer.state:
        raise ShardwiseError(
            "an optimizer that has already stepped was passed to prepare() with an unsharded "
            "model: its state belongs to the full parameters. Build the optimizer after "
            "sharding (or before any step)")
    for group in optimizer.param_groups:
        group["params"] = [remap.get(id(p), p) for p in group["params"]]
    install_optimizer_hooks(optimizer)  # its groups changed without add_param_group
