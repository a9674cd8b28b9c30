"""Refusals that make misuse of a sharded model loud instead of silently wrong.

- an optimizer built before ``shard`` holds the replaced originals: they are *retired*,
  and reading their ``.grad`` (every optimizer step and ``zero_grad`` does) raises;
- Hugging Face ``save_pretrained`` without the consolidated weights (or with this
  rank's rows) raises, and so does ``resize_token_embeddings``;
- wrapping a sharded model in ``DistributedDataParallel`` raises in DDP's constructor;
- before every optimizer step (:func:`check_step`, which the step pre-hook calls: Note
  [the optimizer step] in engine/entry_points/step.py): Adafactor over shards, full
  parameters taken while their units were gathered (:func:`_refuse_full`), trainable
  plain parameters beside shards that nothing synchronises (Note [parameters nothing
  synchronises]; ``sw.per_rank`` in engine/entry_points/step.py declares the exceptions),
  and, in the reproducible mode, gradients rescaled by anything but
  ``sw.clip_grad_norm_`` (a warning).

Elsewhere, beside the entry point each serves: moves and casts (engine/entry_points/
casts.py, Note [casting after shard]); what each root forward checks of the model
(engine/iteration/model_check.py).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NoReturn

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..._args import some_names
from ..._registry import (
    LOOSE_PARAMS,
    WARNED_CLIP,
    attach_to,
    attached,
    instance_attribute,
    is_sharded_root,
    mark_synchronised,
    retired_name,
    set_instance_method,
    set_retired_name,
    synchronised_by,
)
from ...errors import ShardwiseError
from ..iteration.unit import sharded_param

_RETIRED: dict[type, type] = {}


def _retired_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``.grad`` raises (made once per class)."""
    if cls not in _RETIRED:
        def grad(self: torch.Tensor, value: object = None) -> None:
            name = retired_name(self) or "a parameter"
            raise ShardwiseError(
                f"{name} was replaced by its sharded version in sw.shard, but something "
                f"(usually an optimizer built before sw.shard) still holds the original, "
                f"which never gets a gradient: training would silently do nothing. Build "
                f"the optimizer after sw.shard(model), from model.parameters()")
        _RETIRED[cls] = type(f"Retired{cls.__name__}", (cls,),
                             {"grad": property(grad, grad), "__module__": __name__})
    return _RETIRED[cls]


def retire(original: nn.Parameter, name: str) -> None:
    """Make a replaced original parameter fail loudly when an optimizer reaches it.

    Optimizers read ``p.grad`` of every parameter they hold (in ``step`` and
    ``zero_grad``); an optimizer built before ``shard`` holds the originals, which no
    longer take part in training. A parameter class whose layout forbids the swap is
    left alone.
    """
    set_retired_name(original, name)
    try:
        original.__class__ = _retired_class(type(original))
    except TypeError:
        pass


def guard_save_pretrained(module: nn.Module) -> None:
    """Make Hugging Face ``save_pretrained`` on a sharded model loud unless given a state.

    Its default ``self.state_dict()`` holds DTensors, and transformers would write each
    rank's rows (or gather on rank 0 only, which hangs the others); so does a
    ``state_dict=`` holding them. Passing the consolidated ``state_dict=`` works and is
    forwarded unchanged.
    """
    original = getattr(module, "save_pretrained", None)
    if not callable(original):
        return

    @functools.wraps(original)
    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is None:
            raise ShardwiseError(
                f"save_pretrained on a sharded {type(module).__name__} needs the full "
                f"weights: on every rank, sd = sw.full_state_dict(model); then on rank 0, "
                f"model.save_pretrained(path, state_dict=sd). Or save a checkpoint and "
                f"export it: shardwise consolidate CHECKPOINT path/")
        pieces = ([k for k, v in state_dict.items() if isinstance(v, DTensor)]
                  if isinstance(state_dict, dict) else [])
        if pieces:
            raise ShardwiseError(
                f"save_pretrained was given a state dict holding this rank's rows of "
                f"{len(pieces)} parameter(s) ({some_names(pieces)}): DTensors, as "
                f"model.state_dict() holds on a sharded model. transformers would gather "
                f"them inside, on this rank alone (a hang), or write a partial folder. "
                f"Nothing was written. Pass the full weights: on every rank, "
                f"sd = sw.full_state_dict(model); then on rank 0, "
                f"model.save_pretrained(path, state_dict=sd)")
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    set_instance_method(module, "save_pretrained", save_pretrained)


def guard_resize(module: nn.Module) -> None:
    """Make Hugging Face ``resize_token_embeddings`` on a sharded model refuse, before it
    changes anything: it would replace sharded parameters by ones of another shape
    (DTensor's ``NotImplementedError ... _is_all_true`` or "mixed torch.Tensor and
    DTensor" half-way through, before)."""
    if callable(getattr(module, "resize_token_embeddings", None)):
        set_instance_method(module, "resize_token_embeddings",
                            functools.partial(_refuse_resize, type(module).__name__))


def _refuse_resize(name: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise ShardwiseError(
        f"resize_token_embeddings on a sharded {name}: it would change the shapes of the "
        f"embedding and output head, which shardwise laid out in shards when it sharded "
        f"them; nothing was changed. Resize before sharding: "
        f"model.resize_token_embeddings(n); model = sw.shard(model)")


class _NoDDP:
    """Stands in DDP's ``_ddp_params_and_buffers_to_ignore``: DDP's constructor reads it
    with ``set(...)``, and iterating raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __iter__(self) -> NoReturn:
        raise ShardwiseError(
            f"DistributedDataParallel cannot wrap {self.name}, which sw.shard already "
            f"shards: shardwise averages gradients across ranks itself, as DDP would. Train "
            f"the sharded model directly; with accelerate, use shardwise.integrations."
            f"accelerate.ShardwiseAccelerator, whose prepare() does not wrap it in DDP, and "
            f"with the Hugging Face Trainer, shardwise.integrations.transformers."
            f"ShardwiseTrainer")


def guard_ddp(module: nn.Module) -> None:
    """Make ``DistributedDataParallel(module)`` raise a clear error in its constructor."""
    set_instance_method(module, "_ddp_params_and_buffers_to_ignore",
                        _NoDDP(type(module).__name__))  # type: ignore[arg-type]
    _guard_torch_classes()


# Note [torch classes that meet shards]
# Two pieces of torch fail deep inside DTensor when they meet shardwise's parameters,
# where no attribute of the sharded model can step in first:
# - DistributedDataParallel around a module that *holds* a sharded model: DDP reads its
#   ignore list from the wrapper only (the sharded root's guard above is never seen), then
#   broadcasts every parameter ("aten.cat.default got mixed torch.Tensor and DTensor");
# - Adafactor (torch's and transformers'): its factored second moment keeps statistics
#   over whole rows and whole columns of each matrix, and a rank holds only some rows;
#   its first step fails mid-way ("in-place operations that require placement changes
#   are not supported") after some parameters were already updated.
# So the first sw.shard of a process adds a check to DDP's constructor, and the optimizer
# step pre-hook (Note [the optimizer step] in engine/entry_points/step.py) calls check_step; each
# only looks for shardwise's parameters and otherwise does nothing. Everything shardwise
# patches in torch is listed in Note [what shardwise patches in torch] in
# engine/entry_points/step.py.
_torch_guarded = False


def _guard_torch_classes() -> None:
    global _torch_guarded
    if _torch_guarded:
        return
    _torch_guarded = True
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def init(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        _refuse_sharded_parts(module)
        original(self, module, *args, **kwargs)
        for p in module.parameters():  # Note [parameters nothing synchronises]
            mark_synchronised(p, "DistributedDataParallel")

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign]


def check_step(optimizer: torch.optim.Optimizer) -> None:
    """The misuse checks before an optimizer step (Note [the optimizer step] in
    engine/entry_points/step.py): raise, before anything changes, for an Adafactor over shards, full
    parameters taken while gathered, and plain parameters nothing synchronises; warn in
    the reproducible mode for gradients rescaled other than by ``sw.clip_grad_norm_``.

    Raises:
        ShardwiseError: naming the parameters, the rule and the fix.
    """
    _refuse_factored(optimizer)
    _refuse_full(optimizer)
    _refuse_unsynchronised(optimizer)
    _warn_inexact_clip(optimizer)


def _warn_inexact_clip(optimizer: torch.optim.Optimizer) -> None:
    """Reproducible mode: warn once per optimizer when the gradients it is about to step
    were changed in place after the reduction handed them out, other than by
    ``sw.clip_grad_norm_``: ``torch.nn.utils.clip_grad_norm_`` sums each rank's rows in
    fp32, so its norm, and the clipped gradients, depend on the world size."""
    facts = attached(optimizer, LOOSE_PARAMS)
    if facts is None or len(facts) < 5 or not facts[4] or attached(optimizer, WARNED_CLIP):
        return
    if any(r.rescaled_elsewhere() for r in facts[4]):
        attach_to(optimizer, WARNED_CLIP, True)
        warnings.warn(
            "shardwise: the gradients of a reproducible model (sw.shard(reproducible=True)) "
            "were changed in place between the backward and optimizer.step(), not by "
            "sw.clip_grad_norm_. If that was torch.nn.utils.clip_grad_norm_, its norm is "
            "summed in fp32 over each rank's rows and differs in the last bits from one "
            "world size to another: use sw.clip_grad_norm_(model, max_norm), which sums "
            "exactly (docs/reproducible.md)", stacklevel=4)  # the user's step: past check_step


def _refuse_sharded_parts(module: Any) -> None:
    """Raise if ``module`` holds a sharded model whose parameters DDP would take."""
    if not isinstance(module, nn.Module) or is_sharded_root(module):
        return  # a sharded root itself: guard_ddp's error comes from DDP's own read
    ignored = set(instance_attribute(module, "_ddp_params_and_buffers_to_ignore", ()))
    for name, sub in module.named_modules():
        if not is_sharded_root(sub):
            continue
        taken = [f"{name}.{n}" for n, _ in sub.named_parameters()
                 if f"{name}.{n}" not in ignored]
        if taken:
            raise ShardwiseError(
                f"DistributedDataParallel cannot wrap {type(module).__name__}: its "
                f"submodule {name!r} is sharded by sw.shard, and DDP would broadcast and "
                f"all-reduce its sharded parameters ({taken[0]}, ...) as if they were "
                f"whole. shardwise averages their gradients itself. Shard the whole "
                f"model instead, with the blocks as units: sw.shard({type(module).__name__}"
                f"(...), units=...), and train it without DDP")


def _refuse_factored(optimizer: torch.optim.Optimizer) -> None:
    """Before any step of an Adafactor over sharded matrices: refuse, saying why."""
    if type(optimizer).__name__ != "Adafactor":
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if (sp := sharded_param(p)) is not None and sp.by_rows and p.dim() >= 2:
                raise ShardwiseError(
                    f"{type(optimizer).__module__}.Adafactor cannot step sharded matrices: "
                    f"its factored second moment keeps statistics over whole rows and "
                    f"whole columns of each matrix ({tuple(p.shape)} here), and each rank "
                    f"holds only some rows. Nothing was updated. Use an optimizer whose "
                    f"state is per element (AdamW, Adam, SGD, ...), or Adafactor "
                    f"on an unsharded model")


# Note [parameters nothing synchronises]
# sw.shard(model.encoder) beside a plain trainable model.head shards the encoder only:
# the head's gradients are each rank's own, nothing averages them, and the ranks' heads
# drift apart step by step, silently (FSDP2 too: docs/parameters.md's habits table). DDP
# would have averaged them. So before an optimizer steps shards of a sharded model of
# several ranks, its other trainable parameters must be synchronised by something: DDP
# (its constructor marks them), FSDP2 or another DTensor placement, or the user, who
# says so with sw.per_rank(...). Otherwise the step raises, before anything changes,
# naming them. The verdict is kept on the optimizer until its number of parameters
# changes, so a step pays a walk of its parameter list, not a check of each parameter.

def _refuse_full(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer holding full parameters instead of shards: one built while
    units were gathered (between a forward and its backward, or inside ``gathered``)
    took what the modules held then. Their gradients go to the shards, so the step would
    leave those parameters untrained, silently."""
    full = [sp.fqns[0] for g in optimizer.param_groups for p in g["params"]
            if (sp := sharded_param(p)) is not None and p is not sp.shard]
    if full:
        raise ShardwiseError(
            f"{type(optimizer).__name__} holds the full (gathered) form of {len(full)} "
            f"sharded parameter(s) ({', '.join(full[:3])}{', ...' if len(full) > 3 else ''}"
            f"), not their shards: it was built while their units were gathered (between "
            f"a forward and its backward, or inside sw.gathered), and would never train "
            f"them. Nothing was updated. Build the optimizer before the forward or after "
            f"the backward (model.parameters() then yields the DTensor shards)")


def _refuse_unsynchronised(optimizer: torch.optim.Optimizer) -> None:
    """Note [parameters nothing synchronises]."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    known = attached(optimizer, LOOSE_PARAMS)
    if known is None or known[0] != len(params):
        known = (len(params), *_loose_params(params))
        attach_to(optimizer, LOOSE_PARAMS, known)
    loose = [p for p in known[1] if p.grad is not None]
    if loose:  # DDP built before the first sw.shard marked nothing: look for it once
        _mark_ddp_parameters()
        known = (known[0], [p for p in known[1] if synchronised_by(p) is None], *known[2:])
        attach_to(optimizer, LOOSE_PARAMS, known)
        loose = [p for p in known[1] if p.grad is not None]
    if not loose:
        return
    names = _names(optimizer, loose, known[2])
    raise ShardwiseError(
        f"{type(optimizer).__name__}.step() would update {len(loose)} trainable "
        f"parameter(s) outside the sharded model that nothing synchronises across its "
        f"{known[3]} ranks ({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}): "
        f"each rank's own gradients would train them apart. Nothing was updated. Shard "
        f"the whole model (sw.shard(model), whose root owns every parameter outside the "
        f"units), or put these parameters in a sharded unit; wrap them in "
        f"DistributedDataParallel if they must stay plain; sw.per_rank(...) declares "
        f"parameters trained per rank on purpose")


def _mark_ddp_parameters() -> None:
    """Mark the parameters of every DistributedDataParallel of this process as
    synchronised (those built before the first ``sw.shard`` could not be marked by its
    constructor). Walks the garbage collector's objects: only where a step would
    otherwise raise, once per optimizer."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance asks a weakref proxy for its referent's
        # class, and a dead proxy (torch.compile leaves some) raises ReferenceError.
        if issubclass(type(obj), DistributedDataParallel):
            for p in obj.module.parameters():
                mark_synchronised(p, "DistributedDataParallel")


def _loose_params(params: list[torch.Tensor]) -> Any:
    """The trainable plain parameters nothing synchronises, when ``params`` also holds
    shards of a sharded model of several ranks; the model's root and world size; its
    trainable groups of the reproducible mode."""
    model = next((sp.unit.model for p in params
                  if (sp := sharded_param(p)) is not None and sp.unit is not None), None)
    if model is None:
        return [], None, 1, []
    exact = [g.reduction for u in model.units for g in u.trainable_groups
             if g.reduction.exact]  # others never rescale: the step's check stays free
    if model.comm.world_size == 1:
        return [], None, 1, exact
    loose = [p for p in params if p.requires_grad and sharded_param(p) is None
             and not isinstance(p, DTensor) and synchronised_by(p) is None]
    return loose, model.units[0].module, model.comm.world_size, exact


def _names(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
           root: nn.Module) -> list[str]:
    """Names of ``params``: the optimizer's own (built from ``named_parameters()``), else
    found through the modules that hold the sharded ``root`` (only on this error path),
    else their shapes."""
    ids = {id(p) for p in params}
    named: dict[int, str] = {}
    for g in optimizer.param_groups:
        for n, p in zip(g.get("param_names", ()), g["params"]):
            named[id(p)] = n
    if len(ids - named.keys()):
        import gc

        holders = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)
                   and any(m is root for m in o.modules()) and o is not root]
        for top in holders:
            for n, p in top.named_parameters():
                named.setdefault(id(p), n)
    return [named.get(id(p), f"a {tuple(p.shape)} parameter") for p in params]
