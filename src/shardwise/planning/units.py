"""The plan of a ``shard()`` call, decided before anything is changed.

Which submodules are units (:func:`choose_units`), every parameter with all its names and
registrations (:func:`discover_params`), which unit owns each (:func:`assign_units`), how
each unit's parameters split into flat groups and how each group is laid out
(:func:`group_specs`, :func:`plan_units`: the layout is computed here, once, and built as
it is), and the ``units="auto"`` choice under a memory budget (:func:`auto_units`, which
hands back the plan it measured). The records a plan is made of are the engine's
(engine/plan.py), which ``engine.build`` builds. Nothing here communicates or modifies the
model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from .._registry import partitioned_as
from ..engine.groups.flat import gathers_bytes
from ..engine.groups.layout import build_layout
from ..engine.groups.tensor_parallel import stand_in
from ..engine.plan import (  # the records a plan is made of: the engine builds from them
    GroupSpec,
    ParamRecord,
    UnitPlan,
)
from ..errors import ShardwiseError

UnitSpec = type | tuple | Callable[[str, nn.Module], bool] | str | None
AUTO = "auto"


def _unit_predicate(units: UnitSpec) -> Callable[[str, nn.Module], bool]:
    if isinstance(units, type) or (isinstance(units, tuple) and units
                                   and all(isinstance(u, type) for u in units)):
        return lambda name, mod: isinstance(mod, units)
    if isinstance(units, tuple) and not units:
        return lambda name, mod: False  # units=(): the root alone, on purpose
    if callable(units):
        return lambda name, mod: bool(units(name, mod))
    raise ShardwiseError(f"units={units!r} is not understood: pass a module class, a tuple of "
                         f"classes, a callable (qualified_name, module) -> bool, or 'auto'")


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


# Note [the embeddings' own units]
# By default the root owns every parameter outside the blocks: in a language model, the
# input embeddings and the output head, gathered whole from the root's forward to the
# end of its backward. Beside full-precision blocks that is in proportion, but with a
# quantized base (NF4: a block gathers 0.5 bytes an element) the embeddings and the head
# are most of what a rank gathers: a 70B Llama 3's are 4.2 GB each in fp32, more than a
# decoder layer in full precision. So when the model holds a frozen tensor subclass
# gathered as bytes, the default units also take the modules the model declares as its
# input embeddings and output head (Hugging Face's ``get_input_embeddings()`` and
# ``get_output_embeddings()``, found through wrappers such as PEFT's that forward
# attributes): each is gathered for its own forward (and the head again for its
# backward) and resharded after it, so no rank holds both, nor either beside the root's
# other parameters. A declared module is left to the root when it is, or holds, a block,
# and when it owns nothing of its own: a tied head's weight is also the embeddings', and
# a shared weight stays in the innermost unit holding every use (the root). Only
# declared modules: a model that reads a unit's weight outside that module's forward
# (``F.linear(x, self.wte.weight)``) is refused at that read, naming the weight, and
# Hugging Face's models call both through their forward. Models without a quantized
# base keep the default above: there the root is no larger than a block or two, and more
# units mean more collectives per step. ``sw.shard`` gathers one group at a time, so these
# units also keep it from holding the embeddings and the head at once.


def _declared_embeddings(root: nn.Module) -> list[nn.Module]:
    """The modules ``root`` declares as its input embeddings and output head (Hugging
    Face's accessors; a base model's head is ``None``)."""
    found: list[nn.Module] = []
    for accessor in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(root, accessor, None)
        if not callable(get):
            continue
        try:
            mod = get()
        except (NotImplementedError, AttributeError):  # declared by no such model
            continue
        if isinstance(mod, nn.Module) and mod is not root and _has_params(mod) \
                and all(mod is not m for m in found):
            found.append(mod)
    return found


def _with_embeddings(root: nn.Module, blocks: list[tuple[str, nn.Module]]
                     ) -> list[tuple[str, nn.Module]]:
    """``blocks`` and, with a quantized base, the declared embeddings and head as units
    of their own, in module order (Note [the embeddings' own units])."""
    if not any(gathers_bytes(p) for p in root.parameters()):
        return blocks
    declared = {id(m) for m in _declared_embeddings(root)}
    taken = [n for n, _ in blocks]
    extra = [(n, m) for n, m in root.named_modules() if id(m) in declared
             and not any(n == t or n.startswith(t + ".") or t.startswith(n + ".")
                         for t in taken)]
    if not extra:
        return blocks
    order = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    merged = sorted([*blocks, *extra], key=lambda nm: order[id(nm[1])])
    owning = {id(m) for _, m in _owning(root, merged)[0]}  # a tied head owns nothing
    return [(n, m) for n, m in merged if id(m) in owning or id(m) not in declared]


def choose_units(root: nn.Module, units: UnitSpec) -> list[tuple[str, nn.Module]]:
    """``("", root)`` followed by every unit ``units`` selects (see :func:`shard`); by
    default the blocks, and with a quantized base also the embeddings and the head (Note
    [the embeddings' own units])."""
    if units is None:
        return [("", root), *_with_embeddings(root, _default_units(root))]
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


def warn_if_one_unit_dominates(sizes: list[int], names: list[str], world_size: int,
                                units: UnitSpec) -> None:
    total = sum(sizes)
    # units=() and units="auto" (which chose within a memory budget) are deliberate.
    if world_size == 1 or total < _WARN_MIN_NUMEL or units == () or units == AUTO:
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


def discover_params(root: nn.Module, unit_names: list[str]) -> list[ParamRecord]:
    """Every parameter of ``root`` once, in order of first appearance, with all its names.

    A weight shared into a module that ``sharded_init`` partitioned counts as its
    partitioned stand-in, so both registrations are one parameter again; the module is
    not touched (``shard`` registers the shard in every slot once the plan is agreed).
    """
    records: dict[int, ParamRecord] = {}
    for mod_path, mod in root.named_modules(remove_duplicate=False):
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            twin = partitioned_as(p)
            if twin is not None:
                p = twin
            if id(p) not in records:
                # Note [tensor-parallel parameters] in engine/groups/tensor_parallel.py:
                # a DTensor is planned as its local tensor.
                fqn0 = f"{mod_path}.{pname}" if mod_path else pname
                placed = isinstance(p, DTensor)  # skips the tp module for the others
                records[id(p)] = ParamRecord(stand_in(fqn0, p) if placed else p)
            rec = records[id(p)]
            if (mod, pname) not in rec.slots:
                rec.slots.append((mod, pname))
            fqn = f"{mod_path}.{pname}" if mod_path else pname
            if fqn not in rec.fqns:
                rec.fqns.append(fqn)
            rec.users.add(_owner(mod_path, unit_names))
    return list(records.values())


def assign_units(records: list[ParamRecord], unit_names: list[str]) -> list[list[ParamRecord]]:
    """The parameters each unit owns: a shared one goes to the innermost unit holding
    every use of it (a tied embedding and head: the root)."""
    per_unit: list[list[ParamRecord]] = [[] for _ in unit_names]
    for rec in records:
        per_unit[_common_unit(rec.users, unit_names)].append(rec)
    return per_unit


def group_specs(records: list[ParamRecord], param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, world_size: int) -> list[GroupSpec]:
    """Split one unit's parameters into flat groups by (dtype, requires_grad, the dtypes
    it computes and reduces in; Note [one group per dtypes]), each laid out over
    ``world_size`` ranks (the layout the engine builds).

    A frozen weight never shares a buffer with a trainable one (it is never reduced), and
    BatchNorm keeps full-precision parameters under mixed precision: its running
    statistics keep their dtype, and its kernel takes low-precision input only with
    full-precision weights.
    """
    by_kind: dict[tuple[torch.dtype, bool, torch.dtype, torch.dtype], list[ParamRecord]] = {}
    for rec in records:
        dtype = rec.param.dtype
        full_precision = any(isinstance(m, _BatchNorm) for m, _ in rec.slots)
        floating = dtype.is_floating_point and not full_precision
        compute = (param_dtype or dtype) if floating else dtype
        # Gradients are summed across ranks in the master dtype unless asked otherwise:
        # a bf16 sum over many ranks loses the low bits that fp32 master weights keep.
        reduce = (reduce_dtype or dtype) if floating else dtype
        # Note [one group per dtypes]
        # Groups split by what their buffers hold and how they move (dtype, trainable,
        # the compute and reduce dtypes), not by module kind: BatchNorm's parameters
        # share their block's group unless mixed precision gives the two different
        # dtypes. Each group is an all-gather in the forward, another in the backward
        # and a reduce-scatter, a fixed cost per exchange (issue 54): a BatchNorm group
        # of its own doubled the exchanges of a conv-BatchNorm block for nothing.
        kind = (dtype, rec.param.requires_grad, compute, reduce)
        by_kind.setdefault(kind, []).append(rec)
    specs = []
    for (_, _, compute, reduce), recs in by_kind.items():
        layout = build_layout([tuple(r.param.shape) for r in recs], world_size)
        specs.append(GroupSpec(recs, compute, reduce, layout))
    return specs


def plan_units(chosen: list[tuple[str, nn.Module]], per_unit: list[list[ParamRecord]],
               param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
               world_size: int) -> list[UnitPlan]:
    """Each chosen unit's groups (:func:`group_specs`, laid out over ``world_size``
    ranks) and tensor subclasses (gathered as bytes)."""
    out = []
    for (name, module), records in zip(chosen, per_unit):
        plain = [r for r in records if not gathers_bytes(r.param)]
        subclasses = [r for r in records if gathers_bytes(r.param)]
        out.append(UnitPlan(name, module, records,
                            group_specs(plain, param_dtype, reduce_dtype, world_size),
                            subclasses))
    return out


# -- units="auto" ---------------------------------------------------------------------
#
# Note [auto units]
# A unit is one module with forward hooks, so the engine cannot merge consecutive blocks
# into one unit: the choices are sets of modules. ``auto_units`` walks a ladder of unit
# sets from coarse to fine and takes the first whose gathered peak fits the budget:
#
#   rung 0: the root alone (one all-gather and one reduce-scatter per step);
#   rung 1: the default units (the blocks, ``_default_units``);
#   rung k+1: every unit of rung k, the root included, also splits into its children
#     that hold parameters (``_refine``); a unit left owning nothing is dropped.
#
# Each rung has more units than the one before, so the first that fits is the one with
# the fewest units on the ladder. Splitting stops at modules without parameter-holding
# children (a Linear, a LayerNorm): those are indivisible. Only modules the model calls
# through their forward can be units, so containers (ModuleList, ModuleDict,
# Sequential, which may be iterated rather than called) are looked into, never chosen.

# Modules that hold others but may not be called themselves: looked into, never units.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList,
               nn.ParameterDict)
_MAX_RUNGS = 64  # deeper than any real model; a guard, not a limit anyone meets


@dataclass
class AutoChoice:
    """What ``units="auto"`` chose: the units (root first), their gathered peak in
    bytes, the budget, and ``(units, peak)`` of every rung tried, coarse to fine; and
    the plan it measured: every parameter (in order of discovery) and each unit's
    groups, laid out as the engine builds them, so that ``shard`` builds that plan
    rather than lay the groups out again."""

    chosen: list[tuple[str, nn.Module]]
    peak: int
    budget: int
    tried: list[tuple[int, int]]
    records: list[ParamRecord]
    units: list[UnitPlan]

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget


def gathered_bytes(units: list[UnitPlan], world_size: int,
                   param_dtype: torch.dtype | None) -> list[int]:
    """Bytes of each unit's full parameters while gathered, in compute dtype, padded as
    the engine lays them out (``FlatGroup.full``): its groups' planned layouts, and its
    packed parameters counted as plain ones."""
    out = []
    for unit in units:
        specs = [*unit.groups, *group_specs(unit.subclasses, param_dtype, None, world_size)]
        out.append(sum(s.layout.full_numel * s.compute_dtype.itemsize for s in specs))
    return out


def gathered_peak(names: list[str], sizes: list[int], prefetch: int,
                  reshard_after_forward: bool = True) -> int:
    """Bytes of full parameters held at the worst moment of a step, units in module order.

    The root (``names[0]``) stays gathered from its forward to the end of its backward.
    While unit i computes, the units enclosing it are gathered too, and so are the
    ``prefetch`` units after it (forward) or before it (backward). Without resharding
    after forward every unit is held until its backward: the whole model.

    Example:
        >>> gathered_peak(["", "a", "b", "c"], [10, 100, 100, 100], prefetch=1)
        210
    """
    if not reshard_after_forward:
        return sum(sizes)
    rest, own = names[1:], sizes[1:]
    worst = 0
    for i, name in enumerate(rest):
        around = {j for j in range(i) if name.startswith(rest[j] + ".")}
        ahead = range(i, min(i + prefetch + 1, len(rest)))
        behind = range(max(0, i - prefetch), i + 1)
        for window in (ahead, behind):
            worst = max(worst, sum(own[j] for j in around.union(window)))
    return sizes[0] + worst


def _refine(root: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``units`` plus, under every unit and the root, the parameter-holding children not
    already in a unit (containers looked into), in module order."""
    order = {id(m): (i, n) for i, (n, m) in enumerate(root.named_modules())}
    taken = {id(m) for _, m in units}
    found: dict[int, nn.Module] = {}

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            if id(child) in taken or id(child) in found or not _has_params(child):
                continue
            if isinstance(child, _CONTAINERS) or any(id(m) in taken for m in child.modules()):
                visit(child)  # a unit inside: split around it, never enclose it
            else:
                found[id(child)] = child

    for mod in [root, *(m for _, m in units)]:
        visit(mod)
    merged = {id(m): m for _, m in units} | found
    return [(order[k][1], m) for k, m in sorted(merged.items(), key=lambda kv: order[kv[0]][0])]


def _owning(root: nn.Module, units: list[tuple[str, nn.Module]]
            ) -> tuple[list[tuple[str, nn.Module]], list[ParamRecord], list[list[ParamRecord]]]:
    """The units that own a parameter, every parameter, and what each unit (root first)
    owns. Dropping a unit that owns nothing changes no other unit's share."""
    names = ["", *(n for n, _ in units)]
    records = discover_params(root, names)
    per_unit = assign_units(records, names)
    kept = [i for i, recs in enumerate(per_unit[1:], 1) if recs]
    return ([units[i - 1] for i in kept], records,
            [per_unit[0], *(per_unit[i] for i in kept)])


def auto_units(root: nn.Module, budget: int, world_size: int,
               param_dtype: torch.dtype | None = None, prefetch: int = 1,
               reshard_after_forward: bool = True,
               reduce_dtype: torch.dtype | None = None) -> AutoChoice:
    """The fewest units, on the ladder of Note [auto units], whose gathered peak
    (:func:`gathered_peak`) is at most ``budget`` bytes; when none fits, the first rung
    with the lowest peak (finer rungs that gather no less are not worth their units),
    and ``fits`` is False. Derived from the module
    structure and parameter shapes only, so every rank that built the same model and
    got the same budget chooses the same units. The choice carries its plan
    (:func:`plan_units`, ``reduce_dtype`` for its groups' reduction), which ``shard``
    builds.

    Example:
        >>> auto_units(GPT(cfg), budget=2**40, world_size=2).chosen   # the root alone
        [('', GPT(...))]
    """
    tried: list[tuple[int, int]] = []
    best: AutoChoice | None = None
    rung: list[tuple[str, nn.Module]] = []
    previous: list[str] | None = None
    for _ in range(_MAX_RUNGS):
        rung, records, per_unit = _owning(root, rung)
        names = ["", *(n for n, _ in rung)]
        if names == previous:
            break  # nothing left to split
        previous = names
        chosen = [("", root), *rung]
        planned = plan_units(chosen, per_unit, param_dtype, reduce_dtype, world_size)
        peak = gathered_peak(names, gathered_bytes(planned, world_size, param_dtype),
                             prefetch, reshard_after_forward)
        tried.append((len(names), peak))
        choice = AutoChoice(chosen, peak, budget, tried, records, planned)
        if choice.fits:
            return choice
        if best is None or peak < best.peak:
            best = choice
        rung = ((_with_embeddings(root, _default_units(root)) if len(names) == 1 else [])
                or _refine(root, rung))
    assert best is not None
    return best
