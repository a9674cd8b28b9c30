"""``shard()``: choose units, split parameters, sync initial state, install hooks."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import _hooks
from ._comm import Comm
from ._state import ModelState
from ._unit import FlatGroup, Unit
from .buffers import BufferPolicy, BufferSync
from .consistency import maybe_check
from .errors import ShardwiseError
from ._registry import (clear_init_piece, init_piece, model_state, partitioned_as,
                        retired_name, set_instance_method, set_model_state,
                        set_retired_name, set_sharded_param, set_unit, sharded_param,
                        unit_of)
from ._sharded_init import full_value

UnitSpec = type | tuple | Callable[[str, nn.Module], bool] | None


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and gradient reduction; master weights keep their dtype.

    Floating-point inputs of every unit are cast to ``param_dtype`` (as FSDP2 does by
    default), so outputs come out in ``param_dtype``; buffers keep their dtype, and
    BatchNorm parameters stay in full precision (as FSDP1 does), since BatchNorm's kernel
    takes low-precision input only with full-precision weights and statistics.

    Args:
        param_dtype: dtype full parameters are gathered in and computed with
            (e.g. ``torch.bfloat16``); ``None`` keeps each parameter's dtype.
        reduce_dtype: dtype gradients are reduce-scattered in; ``None`` uses
            ``param_dtype``.

    Example:
        >>> mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by :func:`shard` or holds parameters sharded by it.

    Args:
        module: any module. Raises nothing.

    Example:
        >>> sw.is_sharded(model)      # False
        >>> sw.is_sharded(sw.shard(model))   # True
    """
    if model_state(module) is not None or unit_of(module) is not None:
        return True
    return any(sharded_param(p) is not None for p in module.parameters())


def _unit_predicate(units: UnitSpec) -> Callable[[str, nn.Module], bool]:
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)):
        return lambda name, mod: isinstance(mod, units)
    if isinstance(units, tuple) and not units:
        return lambda name, mod: False  # units=(): the root alone, on purpose
    if callable(units):
        return lambda name, mod: bool(units(name, mod))
    raise ShardwiseError(f"units={units!r} is not understood: pass a module class, a tuple of "
                         f"classes, or a callable (qualified_name, module) -> bool")


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _default_units(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost entries of ``nn.ModuleList`` s; without any, of ``nn.Sequential`` s.

    Transformer stacks keep their blocks in a ModuleList; convolutional nets (torchvision's
    ResNets: ``layer1`` ... ``layer4``) and plain ``nn.Sequential`` stacks keep theirs in
    Sequentials. Entries without parameters (activations, pooling) are not units.
    """
    by_name = dict(root.named_modules())
    for container in (nn.ModuleList, nn.Sequential):
        chosen: list[tuple[str, nn.Module]] = []
        for name, mod in by_name.items():
            if mod is root or any(name.startswith(n + ".") for n, _ in chosen):
                continue
            parent = by_name.get(name.rpartition(".")[0])
            if isinstance(parent, container) and _has_params(mod):
                chosen.append((name, mod))
        if chosen:
            return chosen
    return []


def _choose_units(root: nn.Module, units: UnitSpec) -> list[tuple[str, nn.Module]]:
    """``("", root)`` followed by every unit ``units`` selects (see :func:`shard`)."""
    if units is None:
        return [("", root), *_default_units(root)]
    pred = _unit_predicate(units)
    chosen = [(n, m) for n, m in root.named_modules() if m is not root and pred(n, m)]
    if not chosen and units != ():
        raise ShardwiseError(
            f"units={units!r} matched no submodule of {type(root).__name__}, so the whole "
            f"model would be gathered at once. Pass the class of its blocks (e.g. "
            f"units=MyBlock), units=None for the default, or units=() if one unit is "
            f"really what you want")
    return [("", root), *chosen]


# Below this many elements (4 MiB in fp32) gathering a whole model at once is harmless.
_WARN_MIN_NUMEL = 1 << 20


def _warn_if_one_unit_dominates(sizes: list[int], names: list[str], world_size: int,
                                units: UnitSpec) -> None:
    total = sum(sizes)
    if world_size == 1 or total < _WARN_MIN_NUMEL or units == ():
        return
    biggest = max(range(len(sizes)), key=lambda i: sizes[i])
    if sizes[biggest] * 2 > total:
        name = names[biggest] or "<root>"
        warnings.warn(
            f"shardwise: unit {name!r} holds {sizes[biggest] / total:.0%} of the model's "
            f"parameters, so its full parameters are gathered at once and the memory saving "
            f"of sharding is mostly lost. Pass units=<block class> (or a callable) to "
            f"sw.shard to split it; units=() silences this warning", stacklevel=3)


def _owner(path: str, unit_names: list[str]) -> int:
    """Index of the innermost unit whose module contains ``path``."""
    best, best_len = 0, -1
    for i, n in enumerate(unit_names):
        if (n == "" or path == n or path.startswith(n + ".")) and len(n) > best_len:
            best, best_len = i, len(n)
    return best


def _common_unit(indices: set[int], unit_names: list[str]) -> int:
    """The innermost unit containing all ``indices`` (for shared parameters)."""
    if len(indices) == 1:
        return next(iter(indices))
    paths = [unit_names[i] for i in indices]
    candidates = [i for i, n in enumerate(unit_names)
                  if all(n == "" or p == n or p.startswith(n + ".") for p in paths)]
    return max(candidates, key=lambda i: len(unit_names[i]))


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


def _retire(original: nn.Parameter, name: str) -> None:
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


def _device_for(module: nn.Module, comm: Comm) -> torch.device:
    if comm.device.type == "cuda":
        return comm.device
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "meta":
            return t.device
        if init_piece(t) is not None:
            return init_piece(t).home
    return torch.device("cpu")


def shard(module: nn.Module, *, group: dist.ProcessGroup | None = None, units: UnitSpec = None,
          mixed_precision: MixedPrecision | None = None,
          buffers: str | BufferPolicy = "broadcast",
          src_rank: int = 0, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``module`` in place (ZeRO-3) and return it.

    Each unit's parameters (one flat buffer per dtype and ``requires_grad``) are split
    into ``world_size`` equal, padded slices; each rank keeps one, so a given parameter's
    piece may differ in size across ranks, or be empty. A unit's full parameters exist
    only while it computes. After the call every rank
    holds ``src_rank``'s parameters and buffers. The module keeps its class and methods;
    ``named_parameters()`` yields the original names, each a 1-D ``nn.Parameter`` holding
    this rank's piece, so build the optimizer *after* sharding.

    Args:
        module: the model; its parameters must be real tensors on ``src_rank``.
        group: process group (default: the world).
        units: submodules gathered together: a class, tuple of classes, or a callable
            ``(qualified_name, module) -> bool``; every match becomes a unit, nested
            matches too (each owns the parameters no inner unit owns). ``()`` makes the
            root the only unit. Default: each entry (holding parameters) of the outermost
            ``nn.ModuleList`` s, or, in a model without one, of the outermost
            ``nn.Sequential`` s. The root owns every other parameter. A warning says when
            one unit holds more than half of a model of a million parameters or more.
        mixed_precision: a :class:`MixedPrecision`, or ``None`` for full precision.
        buffers: ``"broadcast"``, ``"average"`` or ``"local"``, see :mod:`shardwise.buffers`.
        src_rank: rank (in ``group``) whose initial state everyone takes.
        reshard_after_forward: free non-root units after forward (ZeRO-3) or keep them
            until their backward (less communication, more memory).

    Raises:
        ShardwiseError: when torch.distributed is not initialised, the module or one of
            its submodules is already sharded, ``src_rank`` is out of range, a policy or
            ``units`` is invalid, ``units`` matches no submodule, or ``src_rank`` holds
            meta tensors.

    Example:
        >>> sw.init_distributed()
        >>> model = sw.shard(GPT(cfg))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    """
    if not isinstance(module, nn.Module):
        raise ShardwiseError(f"shard() takes an nn.Module, got {type(module).__name__}")
    if not dist.is_initialized():
        raise ShardwiseError("torch.distributed is not initialised: call sw.init_distributed() "
                             "first (under torchrun, or as a world of one process)")
    for name, sub in module.named_modules():
        if is_sharded(sub):
            where = f"its submodule {name!r}" if name else "it"
            raise ShardwiseError(f"cannot shard {type(module).__name__}: {where} is already "
                                 f"sharded. Shard the outermost model once and pick units "
                                 f"with units=...")
    comm = Comm(group)
    if not 0 <= src_rank < comm.world_size:
        raise ShardwiseError(f"src_rank={src_rank} is not a rank of a group of "
                             f"{comm.world_size}")
    mp = mixed_precision or MixedPrecision()
    mesh = comm.mesh()
    buffer_sync = BufferSync(module, comm, buffers, src_rank)
    device = _device_for(module, comm)
    chosen = _choose_units(module, units)
    unit_names = [n for n, _ in chosen]

    # Every place each parameter is registered, and the units that use it.
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    fqns: dict[int, list[str]] = {}
    owners: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_path, mod in module.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            twin = partitioned_as(p)
            if twin is not None:  # a weight shared into a module sharded_init partitioned
                mod._parameters[pname] = p = twin
            key = id(p)
            params.setdefault(key, p)
            if (mod, pname) not in slots.setdefault(key, []):
                slots[key].append((mod, pname))
            fqn = f"{mod_path}.{pname}" if mod_path else pname
            if fqn not in fqns.setdefault(key, []):
                fqns[key].append(fqn)
            owners.setdefault(key, set()).add(_owner(mod_path, unit_names))
    scalars = [fqns[k][0] for k, p in params.items() if p.dim() == 0]
    if scalars:
        raise ShardwiseError(f"0-dim parameters cannot be sharded on dim 0: {scalars[:5]}. "
                             f"Make them 1-element parameters (shape (1,)) before sw.shard")
    if comm.rank == src_rank:
        meta = [fqns[k][0] for k, p in params.items() if p.is_meta and init_piece(p) is None]
        if meta:
            raise ShardwiseError(f"rank {src_rank} (src_rank) holds meta parameters "
                                 f"{meta[:5]}: materialise them first, or build the model "
                                 f"under sw.sharded_init()")

    per_unit: list[list[int]] = [[] for _ in chosen]
    for key in params:
        per_unit[_common_unit(owners[key], unit_names)].append(key)
    _warn_if_one_unit_dominates([sum(params[k].numel() for k in keys) for keys in per_unit],
                                unit_names, comm.world_size, units)

    built: list[Unit] = []
    for i, (name, mod) in enumerate(chosen):
        groups = []
        by_kind: dict[tuple, list[int]] = {}
        for key in per_unit[i]:
            p = params[key]
            # BatchNorm keeps full-precision parameters under mixed precision: its running
            # statistics (buffers) keep their dtype, and its kernel takes low-precision
            # input only with full-precision weights.
            full_precision = any(isinstance(m, _BatchNorm) for m, _ in slots[key])
            by_kind.setdefault((p.dtype, p.requires_grad, full_precision), []).append(key)
        for (dtype, _, full_precision), keys in by_kind.items():
            floating = dtype.is_floating_point and not full_precision
            compute = (mp.param_dtype or dtype) if floating else dtype
            reduce = (mp.reduce_dtype or compute) if floating else dtype
            originals = [params[k] for k in keys]
            g = FlatGroup([fqns[k] for k in keys], [slots[k] for k in keys], originals, comm,
                          mesh, device, compute, reduce)
            # Parameters partitioned by sharded_init are gathered one group at a time,
            # so no full-model copy exists at any point.
            values = [full_value(p) for p in originals]
            g.fill_local(values if comm.rank == src_rank else None, src_rank)
            del values
            for sp in g.params:
                set_sharded_param(sp.shard, sp)
                set_sharded_param(sp.full, sp)
                for m, attr in sp.slots:
                    m._parameters[attr] = sp.shard
            # Release the originals now, not after the last unit: the old and the new
            # storage of the whole model must never coexist.
            for p in originals:
                clear_init_piece(p)
            for k in keys:
                _retire(params[k], fqns[k][0])
                del params[k]
            del originals
            groups.append(g)
        built.append(Unit(mod, name, groups, reshard_after_forward, is_root=(i == 0)))
        built[-1].cast_inputs = mp.param_dtype

    for mod in module.modules():
        for bname, b in mod._buffers.items():
            if b is None:
                continue
            if b.is_meta:
                if comm.rank == src_rank:
                    raise ShardwiseError(f"rank {src_rank} (src_rank) holds a meta buffer "
                                         f"{bname!r} of {type(mod).__name__}")
                # Filled by the broadcast from src_rank just below.
                mod._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
            elif b.device != device:
                mod._buffers[bname] = b.to(device)
    buffer_sync.broadcast_all()

    state = ModelState(module, comm, built, buffer_sync, src_rank)
    for unit in built:
        set_unit(unit.module, unit)
        state.handles.append(unit.module.register_forward_pre_hook(
            functools.partial(_hooks.pre_forward, unit), prepend=True, with_kwargs=True))
        state.handles.append(unit.module.register_forward_hook(
            functools.partial(_hooks.post_forward, unit), with_kwargs=True))
        for sp in unit.params:
            if sp.requires_grad:
                state.handles.append(sp.full.register_post_accumulate_grad_hook(
                    lambda _p, s=state: s.ensure_backward_callback()))
    set_model_state(module, state)
    _guard_save_pretrained(module)
    maybe_check(module)
    return module


def _guard_save_pretrained(module: nn.Module) -> None:
    """Make Hugging Face ``save_pretrained`` on a sharded model loud unless given a state.

    Its default ``self.state_dict()`` holds DTensors, and transformers would write each
    rank's rows (or gather on rank 0 only, which hangs the others). Passing the
    consolidated ``state_dict=`` works and is forwarded unchanged.
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
        return original(save_directory, *args, state_dict=state_dict, **kwargs)

    set_instance_method(module, "save_pretrained", save_pretrained)
