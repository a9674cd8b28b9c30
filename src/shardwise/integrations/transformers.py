"""``ShardwiseTrainer``: Hugging Face ``Trainer`` training a model sharded by shardwise.

The Trainer's own accelerator becomes a :class:`~shardwise.integrations.accelerate.
ShardwiseAccelerator` (no DDP wrapper, global-norm clipping, ``sw.no_sync`` for gradient
accumulation), and the Trainer's saving and loading go through shardwise:

- the model is sharded when the Trainer is built, before the optimizer exists, with
  units from the model's ``_no_split_modules`` (its decoder layers); a model built under
  ``sw.sharded_init()`` works the same;
- ``save_model`` writes a normal Hugging Face folder (``from_pretrained`` loads it);
- a Trainer checkpoint (``checkpoint-N/``) holds that folder plus a shardwise checkpoint
  of the parameters and optimizer state, so ``train(resume_from_checkpoint=...)`` works
  at any world size;
- evaluation works, and ``generate`` turns on ``synced_gpus`` by itself;
- TRL's trainers take it as a mixin listed after them, ``class X(DPOTrainer,
  ShardwiseTrainer)`` (integrations/trl.py; the other order raises);
- with ``shard_kwargs={"reproducible": True}`` (docs/reproducible.md) each
  per-device batch is one micro-batch whose own mean loss is backpropagated, undivided by
  the accumulation steps or rescaled by token counts across ranks: the engine takes the
  mean over all micro-batches. Keep ``gradient_accumulation_steps * world_size`` fixed
  (the number of micro-batches per step); accelerate's sampler then hands each step the
  same set of batches at every world size.

Only the Trainer methods that read or write weights are overridden; each falls back to
the Trainer's own when the folder holds no shardwise checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
from transformers import Trainer

from ..checkpoint import load_checkpoint, load_pretrained, save_checkpoint
from ..checkpoint.sources import load_weights_only
from ..checkpoint.state_dict import full_state_dict, share_tied
from ..comm.process_group import init_distributed
from ..engine.iteration.state import model_state
from ..engine.sharded_init import sharded_init
from ..errors import ShardwiseError
from ..sharding import is_sharded, shard
from ._units import no_split_units
from .accelerate import ShardwiseAccelerator, plain_optimizer
from .trl import adapt as adapt_trl
from .trl import trl_classes

CHECKPOINT = "shardwise"       # the shardwise checkpoint inside a Trainer checkpoint folder
_SCHEDULER = "scheduler.pt"    # the Trainer's own name for it


class ShardwiseTrainer(Trainer):
    """A ``transformers.Trainer`` whose model is sharded by shardwise (ZeRO-3).

    Args:
        model: a ``PreTrainedModel`` (or PEFT model), sharded or not; an unsharded one is
            sharded here.
        *args, **kwargs: as for ``Trainer``.
        shard_kwargs: keyword arguments for :func:`shardwise.shard`; ``units`` defaults
            to the model's ``_no_split_modules``.

    Raises:
        ShardwiseError: as :func:`shardwise.shard` does.

    Example:
        >>> trainer = ShardwiseTrainer(model=model, args=TrainingArguments("out"),
        ...                            train_dataset=ds)
        >>> trainer.train()
        >>> trainer.save_model("final")     # a Hugging Face folder
    """

    def __init__(self, model: nn.Module | None = None, *args: Any,
                 shard_kwargs: dict | None = None, **kwargs: Any) -> None:
        if model is None:
            raise TypeError("ShardwiseTrainer needs a model (model_init is not supported)")
        mro = type(self).__mro__
        misplaced = trl_classes(mro[mro.index(ShardwiseTrainer) + 1:])
        if misplaced:
            # TRL's trainers load a model given by its id, wrap it with PEFT and patch its
            # forward before calling Trainer.__init__: all that must come before shard.
            name, trl = type(self).__name__, misplaced[0].__name__
            raise TypeError(
                f"{name} lists ShardwiseTrainer before {trl} among its bases; list it "
                f"after: `class {name}({trl}, ShardwiseTrainer)`, so that TRL builds the "
                f"model before it is sharded (docs/integrations.md, TRL)")
        if isinstance(model, str):
            raise TypeError(f"ShardwiseTrainer needs a model, not the model id {model!r}")
        if not is_sharded(model):
            training_args = kwargs.get("args") or (args[0] if args else None)
            init_distributed()
            options = dict(shard_kwargs or {})
            options.setdefault("units", no_split_units(model))
            device = getattr(training_args, "device", None)
            if device is not None and device.type != "cpu":
                model.to(device)  # before shard: the structure is fixed there
            shard(model, **options)
        if trl_classes(mro):
            adapt_trl()  # before TRL's __init__ goes on with the sharded model
        super().__init__(model, *args, **kwargs)
        self._reproducible = _is_reproducible(model)
        if self._reproducible:
            optim = str(getattr(self.args.optim, "value", self.args.optim))
            if "fused" in optim:
                raise ShardwiseError(
                    f"reproducible mode: optim={optim!r} (the Trainer's default) "
                    f"steps a whole tensor and its shards to different bits; pass "
                    f"TrainingArguments(optim='adamw_torch')")
            # Note [reproducible reduction]: the mean over micro-batches is the engine's;
            # dividing by the accumulation steps (which depend on the world size) here
            # would change the gradient's bits from one world size to another.
            self.loss_is_scaled_for_ga = True
            # accelerate's sampler deals per-device batches round robin: micro-batch
            # i*N + r is rank r's i-th (Note [reproducible running statistics]).
            state = model_state(model)
            if state is not None and state.running_stats is not None:
                state.running_stats.order = "round robin"

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch: Any = None
                      ) -> torch.Tensor:
        """The Trainer's step; in the reproducible mode the loss it returns for logging
        is divided by the accumulation steps, as the Trainer's own is (only the loss that
        is backpropagated must stay undivided)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self._reproducible:
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The Trainer's loss; in the reproducible mode each micro-batch's own mean (the
        token count across ranks and accumulation steps is dropped: it rescales the loss
        by the number of processes)."""
        if self._reproducible:
            num_items_in_batch = None
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # The Trainer builds its Accelerator itself, with arguments that change between
        # transformers releases; ShardwiseAccelerator only overrides methods and adds a few
        # attributes, so the instance is switched to it instead of being rebuilt.
        self.accelerator.__class__ = ShardwiseAccelerator
        self.accelerator.init_shardwise()

    @property
    def _sharded(self) -> nn.Module:
        assert self.model is not None  # set in __init__
        return self.model

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        if is_sharded(model):
            # The shards were placed at shard(). A move, even a no-op in intent such as
            # "cpu" to "cpu:0" (the Trainer's CPU device), copies them out of
            # shardwise's storage, which the next forward refuses.
            return
        super()._move_model_to_device(model, device)

    # -- weights out -------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a Hugging Face folder of the full model (every rank must call it): the
        files the plain Trainer writes, a tied head once."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state = full_state_dict(self._sharded)  # collective; the full tensors on rank 0
        state = share_tied(self._sharded, state)  # save_pretrained finds ties by storage
        self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(os.path.join(output_dir, CHECKPOINT), self._sharded,
                        plain_optimizer(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    # -- weights in --------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: nn.Module | None = None) -> None:
        path = os.path.join(resume_from_checkpoint, CHECKPOINT)
        if not os.path.isdir(path):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_checkpoint(path, self._sharded)  # the parameters; the optimizer comes later

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, CHECKPOINT)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(os.path.join(checkpoint, CHECKPOINT), self._sharded,
                        plain_optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, _SCHEDULER)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            # The Trainer's own format (a torch pickle), read as transformers reads it:
            # weights_only=True, torch's allow-list of tensors and plain containers,
            # which never runs code.
            state = load_weights_only(scheduler, "The Trainer writes it with its "
                                                 "scheduler's state only")
            self.lr_scheduler.load_state_dict(state)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not os.path.isdir(os.path.join(best, CHECKPOINT)):
            return super()._load_best_model()
        load_checkpoint(os.path.join(best, CHECKPOINT), self._sharded)


def _is_reproducible(model: nn.Module) -> bool:
    state = model_state(model)
    return state is not None and state.settings.reproducible


def from_pretrained(model_class: Any, folder: str, *, config: Any = None,
                    dtype: torch.dtype | str = torch.float32, allow_nonfinite: bool = False,
                    **shard_kwargs: Any) -> nn.Module:
    """Build a Hugging Face model partitioned from the start and load its weights.

    The model is built from its config under :func:`shardwise.sharded_init` (no rank
    ever holds it whole), sharded with units from its ``_no_split_modules``, and loaded
    with :func:`shardwise.load_pretrained`, each rank reading only its rows of the
    folder's safetensors files. Every rank must call it.

    Args:
        model_class: an ``AutoModel*`` class or a concrete model class
            (``LlamaForCausalLM``).
        folder: a local folder written by ``save_pretrained`` (config and safetensors).
        config: a config to use instead of the folder's ``config.json``.
        dtype: the dtype of the parameters the model trains (its master weights):
            float32 by default, whatever the config says, since a folder saved in
            float16 or bfloat16 would otherwise train in it (Hugging Face's
            ``from_config`` builds in the config's dtype); ``"auto"`` for the config's.
            Compute in low precision with ``mixed_precision=sw.MixedPrecision(...)``.
        allow_nonfinite: load weights holding NaN or inf as they are (refused by
            default, as by ``load_pretrained``).
        **shard_kwargs: passed to :func:`shardwise.shard` (``mixed_precision``, ...).

    Raises:
        ShardwiseError: when the folder's weights do not match the model (missing,
            unexpected or mis-shaped keys, listed) or hold NaN or inf, as
            ``load_pretrained`` does.

    Example:
        >>> model = sw.from_pretrained(AutoModelForCausalLM, "/models/llama-1b")
    """
    from transformers import AutoConfig

    if not (dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point)):
        raise ShardwiseError(f"sw.from_pretrained: dtype={dtype!r}: expected a floating "
                             f"torch.dtype (torch.float32, torch.bfloat16) or 'auto' (the "
                             f"config's)")
    init_distributed()
    config = config if config is not None else AutoConfig.from_pretrained(folder)
    wanted = (getattr(config, "dtype", None) or torch.float32) if dtype == "auto" else dtype
    if isinstance(wanted, str):  # a config read from JSON may hold the dtype's name
        wanted = getattr(torch, wanted)
    default = torch.get_default_dtype()
    torch.set_default_dtype(wanted)  # built in it: a cast of sharded_init's pieces would copy
    try:
        with sharded_init():
            if hasattr(model_class, "from_config"):   # the Auto* classes
                model = model_class.from_config(config, dtype=wanted)
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(default)
    shard_kwargs.setdefault("units", no_split_units(model))
    shard(model, **shard_kwargs)
    load_pretrained(model, folder, allow_nonfinite=allow_nonfinite)
    return model
