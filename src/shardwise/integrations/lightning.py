"""``ShardwiseStrategy``: a Lightning strategy that shards the ``LightningModule`` (ZeRO-3).

Lightning's DDP strategy fails on a sharded model (it broadcasts the parameters, which
are DTensors, and wraps the model in ``DistributedDataParallel``). This strategy keeps
DDP's process handling and collectives (launch, ``barrier``, ``broadcast``, ``reduce``
for ``self.log(..., sync_dist=True)``, ``all_gather``) and changes what touches the
model:

- ``setup`` moves the model to its device, converts it for the precision, then shards
  it with :func:`shardwise.shard` (units: the model's ``_no_split_modules`` when a
  Hugging Face model is inside, else shardwise's default), and only then calls
  ``configure_optimizers``, so the optimizer holds the sharded parameters. No
  ``configure_model`` is needed. The model is never moved again (teardown included).
- every ``*_step`` runs inside the sharded root's forward, as DDP runs it inside its
  wrapper's, so ``training_step`` may call ``self(x)`` or any submodule;
- ``precision="bf16-mixed"`` (or ``"16-mixed"``) becomes
  ``sw.MixedPrecision(param_dtype=...)``: fp32 master weights and optimizer state,
  parameters gathered and computed in the low dtype, gradients reduced in fp32;
  Lightning's autocast (and its gradient scaler for ``"16-mixed"``) stays on;
- gradient accumulation (``accumulate_grad_batches``) uses :func:`shardwise.no_sync`;
- a checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) is a folder written by
  :func:`shardwise.save_checkpoint`, holding every rank's shards and the optimizer's,
  with the rest of Lightning's checkpoint (loops, epoch, step, callbacks, schedulers,
  hyperparameters) as JSON in its ``extra``; nothing is pickled. ``fit(ckpt_path=...)``
  resumes from it at any world size.

Importing this module registers the strategy as ``"shardwise"`` in Lightning's
``StrategyRegistry`` (Lightning has no entry point for strategies), so
``Trainer(strategy="shardwise")`` works once ``shardwise.integrations.lightning`` (or
``ShardwiseStrategy`` from ``shardwise.integrations``) has been imported.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from .._registry import has_instance_attribute, remove_instance_method
from ..checkpoint import load_checkpoint, save_checkpoint
from ..checkpoint._format import remove_checkpoint
from ..comm.order_check import watch_steps
from ..engine.iteration import hooks as engine_hooks
from ..engine.iteration.state import model_state
from ..errors import ShardwiseError
from ..grads import no_sync
from ..sharding import MixedPrecision, is_sharded, shard
from ._json import from_json, to_json
from ._units import no_split_units

_FORMAT = "shardwise-lightning/1"   # marks the extra of a checkpoint this strategy wrote


class ShardwiseStrategy(DDPStrategy):
    """Lightning strategy training the ``LightningModule`` sharded by shardwise (ZeRO-3).

    Args:
        shard_kwargs: keyword arguments for :func:`shardwise.shard` (``units``,
            ``buffers``, ``prefetch``, ``reshard_after_forward``, ``mixed_precision``);
            ``units`` defaults to the model's ``_no_split_modules``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io,
        precision_plugin, process_group_backend, timeout, start_method: as for
            Lightning's ``DDPStrategy``.

    Raises:
        TypeError: for an argument neither ``DDPStrategy`` nor this class takes.
        ShardwiseError: from ``setup``, when a submodule was already sharded by hand, or
            ``shard_kwargs["mixed_precision"]`` contradicts ``precision``; from
            checkpointing, with more than one optimizer, a checkpoint value JSON cannot
            hold (the message names it), or a path that is not a checkpoint folder
            written by this strategy.

    Example:
        >>> import lightning as L
        >>> from shardwise.integrations.lightning import ShardwiseStrategy
        >>> trainer = L.Trainer(strategy="shardwise", precision="bf16-mixed")
        >>> trainer.fit(lit_module, loader)        # sharded; checkpoints are folders
        >>> trainer.fit(lit_module, loader, ckpt_path="ckpts/last.ckpt")  # any world size
    """

    strategy_name = "shardwise"

    def __init__(self, shard_kwargs: dict[str, Any] | None = None, *,
                 start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
                 **ddp_kwargs: Any) -> None:
        # ddp_kwargs are DDPStrategy's own arguments (accelerator, timeout, ...); the
        # others it takes would go to DistributedDataParallel, which is never built here.
        allowed = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                   "precision_plugin", "process_group_backend", "timeout"}
        unknown = sorted(set(ddp_kwargs) - allowed)
        if unknown:
            raise TypeError(f"ShardwiseStrategy got unexpected arguments {unknown}; pass "
                            f"sw.shard options as shard_kwargs={{...}}")
        super().__init__(start_method=start_method, **ddp_kwargs)
        self.shard_kwargs = dict(shard_kwargs or {})

    # -- setup -------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        model: nn.Module | None = self.lightning_module  # what self.model is until setup
        assert model is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if not is_sharded(model):
            if fitting and self._layer_sync:  # SyncBatchNorm: a new module, so before shard
                model = self._layer_sync.apply(model)
            # Casts and moves fix the structure shard() records, so both come first.
            model = self.precision_plugin.convert_module(model)
            model.to(self.root_device)
            shard(model, **self._shard_options(model))
            self.model = model
        elif model_state(model) is None:
            raise ShardwiseError(
                "ShardwiseStrategy shards the LightningModule itself, but parts of it were "
                "already sharded (sw.shard on a submodule). Leave sharding to the strategy "
                "and pass options as ShardwiseStrategy(shard_kwargs={...})")
        if fitting:
            self.setup_optimizers(trainer)  # configure_optimizers sees the sharded params
            state = model_state(model)
            assert state is not None
            for optimizer in self.optimizers:  # every rank stepped, checked at each step
                watch_steps(state.comm, optimizer)
        self.setup_precision_plugin()
        # DDP's _optimizers_to_device and _sync_module_states are left out: shard() placed
        # the shards (the optimizer's state follows them) and gave every rank src_rank's
        # values.

    def _shard_options(self, model: nn.Module) -> dict[str, Any]:
        options = dict(self.shard_kwargs)
        options.setdefault("units", no_split_units(model))
        plugin = self.precision_plugin
        if isinstance(plugin, LightningMixedPrecision):
            dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
            given = options.get("mixed_precision")
            if given is not None and given.param_dtype != dtype:
                raise ShardwiseError(
                    f"precision={plugin.precision!r} computes in {dtype}, but shard_kwargs "
                    f"has mixed_precision={given}; pass one of the two")
            options.setdefault("mixed_precision", MixedPrecision(param_dtype=dtype))
        return options

    def model_to_device(self) -> None:
        assert self.model is not None
        # A sharded model's shards were placed by shard(); moving it, even to the device
        # it is on, could detach them from shardwise's storage.
        if not is_sharded(self.model):
            self.model.to(self.root_device)

    # -- steps -------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_root("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_root("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_root("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_root("predict_step", args, kwargs)

    def _through_root(self, method: str, args: tuple, kwargs: dict) -> Any:
        """Run ``module.<method>`` as the sharded root's forward.

        shardwise gathers the root's own parameters (those outside any unit) in the
        root's forward only; a step calls submodules directly (``self.model(x)``), so
        the whole step must be that forward. The
        arguments go through the root's forward hook, which casts floating tensors for
        mixed precision (as Lightning's FSDP strategy casts the batch).
        """
        module: nn.Module | None = self.lightning_module
        assert module is not None
        step = getattr(module, method)
        if model_state(module) is None:  # not sharded (yet): nothing to gather
            return step(*args, **kwargs)
        original = module.forward
        # A step calling self(x) would start a second root forward inside this one, which
        # shardwise takes as a new iteration: the root gathered again and the recorded
        # unit order (used to prefetch) cut short. So the root's own hooks are hidden
        # while the step runs; the units' hooks stay. Not under manual optimization: a
        # backward inside the step ends the iteration and reshards the root, and only a
        # root forward (self(x)) gathers it again for the next forward.
        hide = method != "training_step" or getattr(module, "automatic_optimization", True)
        patched = has_instance_attribute(module, "forward")  # normally not: the class's

        def restore() -> None:  # the step's own self(x) must reach the real forward
            if patched:
                module.forward = original
            else:
                remove_instance_method(module, "forward")

        def forward(*a: Any, **k: Any) -> Any:
            restore()
            with _without_root_hooks(module) if hide else contextlib.nullcontext():
                return step(*a, **k)

        module.forward = forward
        try:
            return module(*args, **kwargs)
        finally:
            restore()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last micro-batch)."""
        if self.model is not None and model_state(self.model) is not None:
            with no_sync(self.model):
                yield
        else:
            yield

    # -- checkpoints -------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the checkpoint loads into the sharded model and its optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restored it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go into the shardwise checkpoint, never gathered

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # likewise the optimizer state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Write a shardwise checkpoint folder at ``filepath`` (every rank calls this)."""
        if storage_options is not None:
            raise TypeError("ShardwiseStrategy.save_checkpoint takes no storage_options: "
                            "the checkpoint is written by sw.save_checkpoint")
        path = self.broadcast(os.fspath(filepath))  # one folder, as rank 0 names it
        optimizer = self._optimizer() if "optimizer_states" in checkpoint else None
        rest = {k: v for k, v in checkpoint.items()
                if k not in ("state_dict", "optimizer_states")}
        extra = {"format": _FORMAT, "checkpoint": _to_json(rest, "checkpoint")}
        assert self.model is not None
        save_checkpoint(path, self.model, optimizer, extra=extra)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint folder this strategy wrote (``ModelCheckpoint`` dropping
        one beyond ``save_top_k``): on the main process, only what ``sw.save_checkpoint``
        wrote there, never through a link (Note [what shardwise deletes] in _fs.py).
        Lightning's own removal deletes the whole tree at that path."""
        if self.is_global_zero:
            remove_checkpoint(os.fspath(filepath))

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model (and, when fitting, the optimizer) from a shardwise checkpoint
        folder, at any world size; return the rest of Lightning's checkpoint."""
        path = self.broadcast(os.fspath(checkpoint_path))
        module = self.lightning_module
        assert module is not None and module._trainer is not None
        if not os.path.isdir(path):
            raise ShardwiseError(
                f"{path} is not a folder: ShardwiseStrategy resumes from the checkpoint "
                f"folders it writes (a Lightning .ckpt file holds full, unsharded state)")
        fitting = module._trainer.state.fn == TrainerFn.FITTING
        extra = load_checkpoint(path, module, self._optimizer() if fitting else None)
        if not (isinstance(extra, dict) and extra.get("format") == _FORMAT):
            raise ShardwiseError(f"{path}: a shardwise checkpoint not written by "
                                 f"ShardwiseStrategy (no Lightning state in its extra)")
        checkpoint: dict[str, Any] = _from_json(extra["checkpoint"])
        checkpoint["state_dict"] = {}
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the weights

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # likewise

    def _optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ShardwiseError(
                f"ShardwiseStrategy checkpoints hold one optimizer; configure_optimizers "
                f"returned {len(self.optimizers)}")
        return self.optimizers[0] if self.optimizers else None

    # -- teardown ----------------------------------------------------------------------
    def teardown(self) -> None:
        if self.model is None or not is_sharded(self.model):
            return super().teardown()
        # DDP's teardown would move the model and the optimizer state to the CPU and undo
        # SyncBatchNorm, each of which breaks a sharded model; the rest is kept.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("shardwise", cls, override=True,
                                   description="ZeRO-3 sharding by shardwise")


@contextlib.contextmanager
def _without_root_hooks(module: nn.Module) -> Iterator[None]:
    """Hide shardwise's forward hooks on ``module`` (and only those) inside the block."""
    ours: tuple[Callable, ...] = (engine_hooks.pre_forward, engine_hooks.post_forward,
                                  engine_hooks.forward_raised)
    pre, post = module._forward_pre_hooks, module._forward_hooks
    def theirs(h: Callable) -> bool:
        return h not in ours and getattr(h, "func", None) not in ours

    module._forward_pre_hooks = OrderedDict((k, h) for k, h in pre.items() if theirs(h))
    module._forward_hooks = OrderedDict((k, h) for k, h in post.items() if theirs(h))
    try:
        yield
    finally:
        module._forward_pre_hooks, module._forward_hooks = pre, post


# -- Lightning's checkpoint dict as JSON -------------------------------------------------
# Beyond JSON, Lightning's checkpoint holds tensors (ModelCheckpoint's scores, an infinite
# ``kth_value`` among them), tuples and the odd non-string key: integrations/_json.py.

_ADVICE = ("(its Lightning state is JSON, never pickled). Keep such objects out of "
           "the checkpoint (e.g. save_hyperparameters(ignore=[...])) or store them as "
           "numbers, strings, lists, dicts or tensors")


def _to_json(obj: Any, where: str) -> Any:
    return to_json(obj, where, _ADVICE)


def _from_json(obj: Any) -> Any:
    return from_json(obj, "a ShardwiseStrategy checkpoint")


# Lightning builds its registry from its own strategy classes when it is imported and
# has no entry point for others: the name is registered when this module is imported.
ShardwiseStrategy.register_strategies(StrategyRegistry)
