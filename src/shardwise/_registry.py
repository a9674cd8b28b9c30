"""Everything shardwise attaches to modules and tensors.

No other module reads or writes ``__dict__``: the keys below are the whole list of what
shardwise leaves on user objects, so a reader can see at once what a sharded model carries.
This module is the bottom of the stack and knows none of shardwise's types: the typed
accessors of its own objects (``engine.iteration.state.model_state``,
``engine.iteration.unit.unit_of`` and ``sharded_param``, ``engine.sharded_init.init_piece``)
live with those types and go through :func:`attached` and :func:`attach_to`.

On modules:
- ``_shardwise``: the root's :class:`~shardwise.engine.iteration.state.ModelState`;
- ``_shardwise_unit``: the :class:`~shardwise.engine.iteration.unit.Unit` a module is the root of;
- ``save_pretrained`` and ``resize_token_embeddings``: the guards that replace a Hugging
  Face model's methods on the instance (``engine/entry_points/guards.py``);
- ``_ddp_params_and_buffers_to_ignore``: the guard DDP's constructor trips on;
- ``_is_fsdp_managed_module``: the marker by which Hugging Face transformers knows that
  every rank must run every forward (``generate`` turns on ``synced_gpus``, LayerDrop
  stops skipping layers), on every module of a sharded model, with
  ``_fsdp_use_orig_params``, by which dynamo compiles such modules with their parameters
  as inputs (Note [compile] in ``engine/iteration/hooks.py``);
- ``_apply``: on every module of a sharded model, the guard that makes moves and casts
  no-ops or refuses them (``engine/entry_points/casts.py``);
- ``__deepcopy__`` and ``__reduce_ex__``: on every module of a sharded model, the deep
  copy of the whole model and the refusal to pickle (``engine/clone.py``).

Read, never written: ``require_backward_grad_sync`` set on a sharded root by the user
(DDP's attribute for gradient accumulation; Note [DDP's sync attribute] in
``engine/iteration/state.py``).

Besides these keys, shardwise registers forward hooks on unit modules
(``engine/iteration/hooks.py``) and ``state_dict`` / ``load_state_dict`` hooks on the modules
holding shards (``engine/entry_points/state_dict.py``).

On tensors:
- ``_shardwise_param``: the :class:`~shardwise.engine.iteration.unit.ShardedParam` behind a
  shard or a full parameter, plain or a tensor subclass (Note [one group type]);
- ``_shardwise_init``: the :class:`~shardwise.engine.sharded_init.InitPiece` of a parameter
  partitioned by ``sharded_init``;
- ``_shardwise_partitioned_as``: the stand-in that replaced an original under
  ``sharded_init``;
- ``_shardwise_retired``: the name of an original parameter ``shard`` replaced;
- ``_shardwise_tensor_parallel``: the ``TpSpec`` of a tensor-parallel parameter's
  stand-in (Note [tensor-parallel parameters] in ``engine/groups/tensor_parallel.py``),
  and ``_shardwise_tp_original`` the DTensor parameter it stands in for, until ``shard``
  retires it;
- ``_shardwise_synchronised``: what keeps a plain parameter identical across ranks
  (``"DistributedDataParallel"``, ``"sw.per_rank"``: Note [parameters nothing
  synchronises] in ``engine/entry_points/guards.py``).

On optimizers:
- ``_shardwise_loose``: the plain trainable parameters beside shards that nothing
  synchronises, with the parameter count they were found for (the same Note), and the
  reproducible mode's groups among the shards;
- ``_shardwise_warned_clip``: set once the warning about gradients rescaled outside
  ``sw.clip_grad_norm_`` in the reproducible mode was given;
- ``_shardwise_set_aside_grads``: the gradients set aside between a step run unit by
  unit and the optimizer's own call, which then finds none (Note [stepping unit by unit]
  in engine/groups/offload/storage.py);
- ``_shardwise_plain_step``: the parameter groups swapped to local tensors for the step
  under way, and ``_shardwise_plain_step_hooked``, set once the optimizer's
  ``state_dict`` hooks that undo such a swap are registered (Note [plain step]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

# The keys whose values are shardwise's own objects. Their typed accessors live with the
# types (``engine.iteration.state.model_state``, ``engine.iteration.unit.unit_of`` and
# ``sharded_param``, ``engine.sharded_init.init_piece``), so that this module, at the bottom
# of the stack, knows none of them; they read and write through :func:`attached` and
# :func:`attach_to`.
STATE = "_shardwise"
UNIT = "_shardwise_unit"
PARAM = "_shardwise_param"
INIT = "_shardwise_init"
_TWIN = "_shardwise_partitioned_as"
_RETIRED = "_shardwise_retired"
_SYNCED = "_shardwise_synchronised"
TENSOR_PARALLEL = "_shardwise_tensor_parallel"
TP_ORIGINAL = "_shardwise_tp_original"
LOOSE_PARAMS = "_shardwise_loose"
WARNED_CLIP = "_shardwise_warned_clip"
SET_ASIDE_GRADS = "_shardwise_set_aside_grads"
PLAIN_STEP = "_shardwise_plain_step"
PLAIN_STEP_HOOKED = "_shardwise_plain_step_hooked"
OPTIMIZER_HOOKED = "_shardwise_state_dict_hooked"  # Note [optimizers meet shards]
_PREFIX = "_shardwise"


# -- generic access ----------------------------------------------------------------------
def attached(obj: Any, key: str) -> Any:
    """What shardwise attached to ``obj`` under ``key`` (one of the keys above), or None."""
    return obj.__dict__.get(key)


def attach_to(obj: Any, key: str, value: Any) -> None:
    obj.__dict__[key] = value


def detach_from(obj: Any, key: str) -> None:
    obj.__dict__.pop(key, None)


def is_sharded_root(module: nn.Module) -> bool:
    """Whether ``module`` is the root of a sharded model (without knowing its state)."""
    return STATE in module.__dict__


# -- modules -----------------------------------------------------------------------------
def set_instance_method(module: object, name: str, fn: Callable[..., Any]) -> None:
    """Shadow a method (or attribute) on one instance (a module, an optimizer); its class
    is left alone."""
    module.__dict__[name] = fn


def has_instance_attribute(module: nn.Module, name: str) -> bool:
    """Whether ``name`` is set on this instance itself (not inherited from its class)."""
    return name in module.__dict__


def instance_attribute(module: nn.Module, name: str, default: Any = None) -> Any:
    """``name`` as set on this instance itself, or ``default``."""
    return module.__dict__.get(name, default)


def remove_instance_method(module: nn.Module, name: str) -> None:
    """Undo :func:`set_instance_method` (nothing if unset): the class's method shows again."""
    module.__dict__.pop(name, None)


def mark_collective_forward(module: nn.Module) -> None:
    """Mark ``module`` as a module whose parameters a sharding engine manages, with the
    two attributes torch and transformers read for FSDP:

    - Hugging Face transformers then knows that its forward is collective: ``generate``
      defaults to ``synced_gpus=True``, so ranks that finish early keep stepping until
      every rank is done, instead of hanging the others;
    - dynamo (``torch.compile``) then treats it as FSDP with original parameters: its
      parameters are read when a compiled graph runs, not baked in or guarded on, since
      they are swapped between shards and full parameters (Note [compile] in
      engine/iteration/hooks.py)."""
    module.__dict__["_is_fsdp_managed_module"] = True
    module.__dict__["_fsdp_use_orig_params"] = True


# -- tensors -----------------------------------------------------------------------------
def partitioned_as(t: torch.Tensor) -> torch.Tensor | None:
    """The stand-in that replaced original ``t`` under ``sharded_init``, or ``None``."""
    return t.__dict__.get(_TWIN)


def set_partitioned_as(t: torch.Tensor, stand_in: torch.Tensor) -> None:
    t.__dict__[_TWIN] = stand_in


def retired_name(t: torch.Tensor) -> str | None:
    return t.__dict__.get(_RETIRED)


def set_retired_name(t: torch.Tensor, name: str) -> None:
    t.__dict__[_RETIRED] = name


def mark_synchronised(t: torch.Tensor, by: str) -> None:
    t.__dict__[_SYNCED] = by


def synchronised_by(t: torch.Tensor) -> str | None:
    """What keeps plain parameter ``t`` identical across ranks, if anything said so."""
    return t.__dict__.get(_SYNCED)


def copy_user_attributes(src: torch.Tensor, *dsts: torch.Tensor,
                         besides: torch.Tensor | None = None) -> None:
    """Copy attributes users set on a parameter (e.g. "no weight decay" flags), not ours;
    nor, for a tensor subclass, those a fresh instance ``besides`` has of its own (its
    inner tensors and settings)."""
    own = besides.__dict__ if besides is not None else {}
    user = {k: v for k, v in src.__dict__.items() if not k.startswith(_PREFIX) and k not in own}
    for dst in dsts:
        dst.__dict__.update(user)


def copy_all_attributes(src: Any, dst: Any) -> None:
    """Copy every instance attribute, shardwise's included, to a stand-in replacing
    ``src`` (a tensor, or a rebuilt container holding copies)."""
    dst.__dict__.update(src.__dict__)
