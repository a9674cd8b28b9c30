"""Memory per rank, planned before anything is built: ``shardwise plan`` and :func:`plan`.

For a real model the plan uses the engine's own decisions (``planning/units.py``: units and
groups; ``engine/groups/layout.py``: padded shard sizes) on a copy built on the meta device, so its
parameter, gradient and optimizer figures are the bytes the engine allocates, not an
approximation. For a model given only as a parameter and layer count it assumes equal
blocks. Activations depend on batch, sequence and the model's code, so they are a term
the caller supplies (``activation_bytes``), never guessed.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from ..engine.groups.layout import ShardLayout
from ..engine.groups.offload import TIERS, Offload
from .units import (
    AUTO,
    UnitSpec,
    assign_units,
    auto_units,
    choose_units,
    discover_params,
    group_specs,
)

# Optimizer state bytes per parameter element, in the master dtype's element size units,
# plus per-parameter scalars (torch's AdamW keeps a float32 ``step`` per parameter).
_OPTIMIZERS = {"adamw": (2, 4), "adam": (2, 4), "sgd": (0, 0), "sgd-momentum": (1, 0)}


@dataclass
class MemoryPlan:
    """Bytes one rank holds (the rank with the most rows, rank 0)."""

    world_size: int
    parameters: int
    gradients: int
    optimizer: int
    largest_unit: int       # a gathered unit's full parameters, in compute dtype
    prefetched_unit: int    # the next unit, gathered while the largest computes
    activations: int
    units: int
    # With an Offload (engine/groups/offload): what the offloaded groups keep on each tier, as
    # sw.inspect(model).tier_bytes counts it after a step, and the bytes shardwise moves
    # to and from the offload tiers per step (Note [bytes moved]) against the minimum,
    # every state read and written once.
    offload: str = ""
    tiers: dict[str, int] = field(default_factory=dict)
    moved_per_step: int = 0
    moved_minimum: int = 0
    # Gradient accumulation under sw.no_sync, held until the synced backward on top of
    # ``total``: the full gradients it sums (every trainable group's, unsharded), and the
    # full parameters of the units it keeps gathered from one micro-batch to the next
    # (Note [gathered across micro-batches] in engine/iteration/state.py; 0 with
    # ``sw.no_sync(model, keep_gathered=False)`` or an Offload).
    accumulated_grads: int = 0
    held_params: int = 0
    # The dtypes planned: what the parameters are stored in (the master shards, the
    # gradients and the optimizer's state follow it) and what units are gathered in.
    dtype: str = ""
    compute_dtype: str = ""

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.largest_unit
                + self.prefetched_unit + self.activations)

    def table(self) -> str:
        """A readable table, in MiB."""
        rows = [("parameters (shard)", self.parameters), ("gradients (shard)", self.gradients),
                ("optimizer state (shard)", self.optimizer),
                ("largest gathered unit", self.largest_unit),
                ("prefetched unit", self.prefetched_unit), ("activations (given)",
                                                            self.activations),
                ("total without offload" if self.offload else "total", self.total)]
        if self.offload:
            rows += [(f"offloaded, on {tier}", n) for tier, n in self.tiers.items()]
            rows += [("moved to and from tiers per step", self.moved_per_step),
                     ("  the least possible", self.moved_minimum)]
        if self.accumulated_grads:
            rows += [("under sw.no_sync, also: full gradients", self.accumulated_grads),
                     ("  and units kept gathered", self.held_params)]
        width = max(len(r[0]) for r in rows)
        lines = [f"per rank, world size {self.world_size}, {self.units} units"
                 + (f", offload: {self.offload}" if self.offload else "")]
        if self.dtype:
            lines.append(f"  parameters stored in {self.dtype}, gathered in "
                         f"{self.compute_dtype or self.dtype}")
        lines += [f"  {name:<{width}}  {b / 2**20:12.1f} MiB" for name, b in rows]
        return "\n".join(lines)


def plan(model: nn.Module, world_size: int, optimizer: str = "adamw",
         param_dtype: torch.dtype | None = None, units: UnitSpec = None,
         activation_bytes: int = 0, memory_budget: int | None = None,
         offload: Offload | None = None) -> MemoryPlan:
    """Plan per-rank memory for ``model`` sharded over ``world_size`` ranks.

    ``model`` may live on the meta device (build it under ``torch.device("meta")``): only
    shapes and dtypes are read. Nothing communicates.

    Args:
        model: the unsharded model.
        world_size: ranks to shard over.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"`` or ``"sgd-momentum"``.
        param_dtype: compute dtype of gathered units (``MixedPrecision.param_dtype``).
        units: as ``sw.shard``'s ``units``; ``"auto"`` needs ``memory_budget`` (the
            planner cannot read the free memory of the machine that will train).
        activation_bytes: activations per rank, which only the caller can know.
        memory_budget: bytes of gathered parameters for ``units="auto"``.
        offload: an ``sw.Offload``: also the bytes per tier and the bytes moved per
            step (one forward, one backward and one step, ``reshard_after_forward=True``).

    Raises:
        ValueError: for an unknown optimizer or a world size below 1, or
            ``units="auto"`` without ``memory_budget``.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(n_layer=24, d_model=2048))
        >>> print(plan(model, world_size=8).table())
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: choose one of {sorted(_OPTIMIZERS)}")
    if units == AUTO:
        if memory_budget is None:
            raise ValueError("units='auto' needs memory_budget= (bytes) to plan with")
        chosen = auto_units(model, memory_budget, world_size, param_dtype).chosen
    else:
        chosen = choose_units(model, units)
    names = [n for n, _ in chosen]
    per_unit = assign_units(discover_params(model, names), names)
    per_elem, per_param = _OPTIMIZERS[optimizer]
    params = grads = opt = accumulated = held = 0
    unit_bytes = []
    stored: dict[torch.dtype, None] = {}    # in order of first appearance
    computed: dict[torch.dtype, None] = {}
    traffic = _Traffic(offload, per_elem)
    for i, recs in enumerate(per_unit):
        full = frozen = 0
        for spec in group_specs(recs, param_dtype, None, world_size):
            p = spec.records[0].param
            size = p.element_size()
            stored[p.dtype] = computed[spec.compute_dtype] = None
            layout = spec.layout
            params += layout.shard_numel * size
            group_full = layout.full_numel * _itemsize(spec.compute_dtype)
            full += group_full
            if not p.requires_grad:
                frozen += group_full
            if p.requires_grad:
                grads += layout.shard_numel * size
                accumulated += layout.gathered_numel * _itemsize(spec.reduce_dtype)
                rows = sum(s.local_rows(0) * s.row_numel for s in layout.slots)
                opt += per_elem * rows * size + per_param * len(layout.slots)
            # Gathered once a step: the root (for the whole step) and the unit running
            # last (kept for the backward that follows it: LAST, Note [residency] in
            # engine/iteration/residency.py),
            # assumed to be the last in module order; every other unit twice.
            traffic.add(layout, size, _itemsize(spec.compute_dtype), p.requires_grad,
                        gathers=1 if i in (0, len(per_unit) - 1) else 2)
        unit_bytes.append(full)
        # The engine's rule (residency.may_be_held): frozen no larger than trainable.
        if offload is None and full > frozen and frozen <= full - frozen:
            held += full
    ranked = sorted(unit_bytes, reverse=True) + [0, 0]
    return MemoryPlan(world_size, params, grads, opt, ranked[0], ranked[1], activation_bytes,
                      len(chosen), traffic.describe, traffic.tiers, traffic.moved,
                      traffic.minimum, accumulated, held, _names(stored), _names(computed))


class _Traffic:
    """What an ``Offload`` puts on each tier, and moves per step (Note [bytes moved] in
    engine/groups/offload/storage.py), group by group, as the engine does it on rank 0."""

    def __init__(self, offload: Offload | None, per_elem: int) -> None:
        self.offload = offload
        self.per_elem = per_elem
        self.tiers = dict.fromkeys(TIERS, 0) if offload is not None else {}
        self.moved = self.minimum = 0

    @property
    def describe(self) -> str:
        o = self.offload
        return "" if o is None else f"params {o.param_tier}, optimizer {o.optimizer_tier}"

    def add(self, layout: ShardLayout, size: int, compute: int, trainable: bool,
            gathers: int) -> None:
        o = self.offload
        if o is None or o.param_tier == o.optimizer_tier == "device":
            return
        ptier, otier = o.param_tier, o.optimizer_tier
        n = layout.shard_numel
        rows = sum(s.local_rows(0) * s.row_numel for s in layout.slots)
        self.tiers[otier] += n * size  # the master
        if ptier != otier:
            self.tiers[ptier] += n * compute  # the gathers' copy
        if ptier != "device":  # each gather stages its source from its tier
            self.moved += gathers * n * (size if ptier == otier else compute)
        if not trainable:
            return
        if ptier != otier:  # the copy refreshed after the step
            self.moved += n * size + (n * compute if ptier != "device" else 0)
        if otier == "disk":  # gradients, the optimizer's state
            self.tiers["disk"] += n * size + self.per_elem * n * size
        # Parked where they are published (n: Note [reduced rows written once]), stepped
        # (master, gradient and state read, master and state written).
        self.moved += n * size + (3 + 2 * self.per_elem) * rows * size
        self.minimum += 2 * (2 + self.per_elem) * rows * size


def uniform_plan(n_params: int, n_layers: int, world_size: int, dtype_bytes: int = 4,
                 optimizer: str = "adamw", compute_bytes: int | None = None,
                 activation_bytes: int = 0) -> MemoryPlan:
    """Plan for a model known only by its size: ``n_layers`` equal blocks hold it all.

    Padding is ignored (it is at most 64 elements per parameter and rank).
    """
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r}: choose one of {sorted(_OPTIMIZERS)}")
    per_elem, _ = _OPTIMIZERS[optimizer]
    shard = -(-n_params // world_size)
    unit = -(-n_params // max(n_layers, 1)) * (compute_bytes or dtype_bytes)
    return MemoryPlan(world_size, shard * dtype_bytes, shard * dtype_bytes,
                      per_elem * shard * dtype_bytes, unit, unit if n_layers > 1 else 0,
                      activation_bytes, n_layers)


def _names(dtypes: dict[torch.dtype, None]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def build_on_meta(spec: str, kwargs: dict | None = None,
                  dtype: torch.dtype | None = None) -> nn.Module:
    """Build ``package.module:callable`` (or a Hugging Face ``config.json`` folder) on the
    meta device, at no memory cost.

    A Hugging Face folder is built as ``LlamaForCausalLM(config)`` builds it (under
    ``sw.sharded_init()`` too): in torch's default dtype, float32, whatever the config's
    ``torch_dtype`` says (Note [the dtype planned]). ``dtype`` casts the floating-point
    parameters of either kind of model, as ``model.to(dtype)`` before ``sw.shard`` would.

    Raises:
        ShardwiseError: ``spec`` names a path that cannot be read as a config folder (a
            symbolic link loop, a file, a folder without ``config.json``, no permission).
    """
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        obj = getattr(importlib.import_module(module_name), attr)
        with torch.device("meta"):
            model = obj(**(kwargs or {}))
    else:
        model = _build_hf(spec)
    if dtype is not None and isinstance(model, nn.Module):
        model.to(dtype)  # on the meta device: no memory, floating-point tensors only
    return model


# Note [the dtype planned]
# A published config names the dtype its weights were saved in (``torch_dtype``: float16
# for Llama 2, bfloat16 for Llama 3), and ``AutoModelForCausalLM.from_config`` builds in
# it. The docs build ``LlamaForCausalLM(config)`` under ``sw.sharded_init()`` (and
# ``shardwise plan`` used to plan ``from_config``'s model): that is float32, torch's
# default, and the bytes a rank needs are twice the half-precision plan's. So a config
# folder is planned in float32, the dtype is printed, and ``--dtype`` plans another
# (a model cast with ``model.to(torch.bfloat16)`` before ``sw.shard``); ``--param-dtype``
# is the gathered units' dtype, ``MixedPrecision(param_dtype=...)``, as for any model.
def _build_hf(spec: str) -> nn.Module:
    _check_config_folder(spec)
    from .._log import quiet_imports

    # transformers imports torchao when it is installed, which logs every CUDA library it
    # cannot load: a command's output must begin with its own lines.
    with quiet_imports():
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(spec)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    return model.to(torch.get_default_dtype())


def _check_config_folder(spec: str) -> None:
    """Refuse, saying why, a local path that is no readable config folder (transformers
    would take it for a Hub repository id and say "Repo id must be in the form ...")."""
    from ..errors import ShardwiseError

    if not os.path.lexists(spec):
        if spec.startswith((os.sep, ".", "~")) or spec.count("/") > 1:
            raise ShardwiseError(f"{spec!r}: no such folder; give a folder holding a Hugging "
                                 f"Face config.json, or package.module:callable")
        return  # perhaps a Hub repository id: transformers says what it finds
    try:
        os.stat(spec)
    except OSError as e:
        if os.path.islink(spec):
            raise ShardwiseError(
                f"{spec!r} is a symbolic link that cannot be followed ({e.strerror}: a loop, "
                f"or a link to a missing target); give the config folder itself") from None
        raise ShardwiseError(f"{spec!r} cannot be read ({e.strerror})") from None
    if not os.path.isdir(spec):
        raise ShardwiseError(f"{spec!r} is a file; give the folder holding a Hugging Face "
                             f"config.json, or package.module:callable")
    config = os.path.join(spec, "config.json")
    if not os.path.isfile(config):
        raise ShardwiseError(f"{spec!r} holds no config.json: not a Hugging Face model "
                             f"folder (give the folder save_pretrained wrote)")
    if not os.access(config, os.R_OK) or not os.access(spec, os.R_OK | os.X_OK):
        raise ShardwiseError(f"{config!r} cannot be read (permission denied)")


def to_json(p: MemoryPlan) -> str:
    return json.dumps({**asdict(p), "total": p.total}, indent=2)


# -- bytes per step on a (replicate, shard) mesh -------------------------------------------

@dataclass
class CommPlan:
    """Bytes one rank feeds into the collectives of one training step (input bytes, as
    ``sw.inspect(model).comm`` counts them), on a mesh of ``replicas`` x ``shard_size``
    ranks (Note [hybrid sharding] in ``comm/mesh.py``; flat ZeRO-3 is ``replicas == 1``).

    ``all_gather`` and ``reduce_scatter`` run within a shard group (a node, when a row of
    the mesh is a node); ``all_reduce`` is the sum of each gradient shard across the
    replicas, the only traffic between shard groups. The ``*_wire`` properties are what a
    rank sends under ring algorithms: an all-gather sends its shard to the S-1 others,
    a reduce-scatter (S-1)/S of its input, an all-reduce 2(R-1)/R of its input.
    """

    replicas: int
    shard_size: int
    all_gather: int
    reduce_scatter: int
    all_reduce: int

    @property
    def world_size(self) -> int:
        return self.replicas * self.shard_size

    @property
    def within(self) -> int:
        """Input bytes per step of the shard group's collectives."""
        return self.all_gather + self.reduce_scatter

    @property
    def within_wire(self) -> int:
        s = self.shard_size
        return (s - 1) * self.all_gather + (s - 1) * self.reduce_scatter // s

    @property
    def across_wire(self) -> int:
        r = self.replicas
        return 2 * (r - 1) * self.all_reduce // r

    def as_dict(self) -> dict:
        return {**asdict(self), "within": self.within, "within_wire": self.within_wire,
                "across_wire": self.across_wire}


def comm_plan(model: nn.Module, replicas: int, shard_size: int,
              param_dtype: torch.dtype | None = None,
              reduce_dtype: torch.dtype | None = None, units: UnitSpec = None) -> CommPlan:
    """Input bytes one rank feeds into each collective per training step, sharded over
    ``shard_size`` ranks and replicated ``replicas`` times (``replicas=1``: flat ZeRO-3).

    Uses the engine's units, groups and padded layout, as :func:`plan` does. Per step
    every unit is all-gathered for its forward and again for its backward, except the
    root and the unit that runs last in forward, which stay gathered (taken here as the
    last unit in ``units`` order, the order of a model whose blocks run as they are
    registered); each trainable group's padded gradient buffer is reduce-scattered once,
    and, with ``replicas > 1``, its gradient shard all-reduced across the replicas once.
    Gradient accumulation under ``no_sync`` defers both reductions to the last
    micro-batch.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(n_layer=24, d_model=2048))
        >>> comm_plan(model, replicas=8, shard_size=8).all_reduce   # P/S in bytes
    """
    if replicas < 1 or shard_size < 1:
        raise ValueError(f"mesh ({replicas}, {shard_size}): both sizes must be at least 1")
    chosen = choose_units(model, units)
    names = [n for n, _ in chosen]
    per_unit = assign_units(discover_params(model, names), names)
    gather = scatter = reduce = 0
    for index, recs in enumerate(per_unit):
        gathers = 1 if index in (0, len(per_unit) - 1) else 2
        for spec in group_specs(recs, param_dtype, reduce_dtype, shard_size):
            layout = spec.layout
            gather += gathers * layout.shard_numel * _itemsize(spec.compute_dtype)
            if spec.records[0].param.requires_grad:
                size = _itemsize(spec.reduce_dtype)
                scatter += layout.gathered_numel * size
                reduce += layout.shard_numel * size
    if shard_size == 1:  # a shard group of one gathers and reduces without collectives
        gather = scatter = 0
    return CommPlan(replicas, shard_size, gather, scatter, reduce if replicas > 1 else 0)


def uniform_comm_plan(n_params: int, n_layers: int, replicas: int, shard_size: int,
                      dtype_bytes: int = 4, compute_bytes: int | None = None) -> CommPlan:
    """:func:`comm_plan` for a model known only by its size: ``n_layers`` equal blocks
    and an empty root, so the last block alone is gathered once; padding is ignored."""
    if replicas < 1 or shard_size < 1:
        raise ValueError(f"mesh ({replicas}, {shard_size}): both sizes must be at least 1")
    shard = -(-n_params // shard_size)
    block_shard = -(-n_params // max(n_layers, 1)) / shard_size
    gather = round((2 * shard - block_shard) * (compute_bytes or dtype_bytes))
    scatter = shard * shard_size * dtype_bytes
    if shard_size == 1:
        gather = scatter = 0
    return CommPlan(replicas, shard_size, gather, scatter,
                    shard * dtype_bytes if replicas > 1 else 0)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass
class MeshPlan:
    """Memory and bytes per step of one rank on a (replicas, shard_size) mesh, next to
    flat ZeRO-3 over the same R*S ranks; :func:`mesh_plan` makes one."""

    memory: MemoryPlan       # sharded over S: what each rank holds
    comm: CommPlan
    flat_memory: MemoryPlan  # sharded over R*S
    flat_comm: CommPlan

    def table(self) -> str:
        """A readable report, in MiB. "Spanning nodes": bytes in collectives whose group
        reaches beyond one shard group (node): for hybrid the all-reduce across
        replicas, for flat ZeRO-3 over several nodes every all-gather and reduce-scatter."""
        c, f = self.comm, self.flat_comm
        r, s = c.replicas, c.shard_size
        f_span = f.within if r > 1 else 0
        rows = [
            ("all-gather", c.all_gather, f.all_gather),
            ("reduce-scatter", c.reduce_scatter, f.reduce_scatter),
            ("all-reduce across replicas", c.all_reduce, 0),
            ("in collectives within a node", c.within, f.within - f_span),
            ("in collectives spanning nodes", c.all_reduce, f_span),
            ("ring, sent: within a node", c.within_wire, f.within_wire if r == 1 else 0),
            ("ring, sent: spanning nodes", c.across_wire, f.within_wire if r > 1 else 0),
        ]
        width = max(len(n) for n, _, _ in rows)
        head = f"mesh ({r}, {s}) = {c.world_size} ranks, sharded over {s}"
        lines = [self.memory.table().replace(f"world size {self.memory.world_size}", head),
                 "", f"bytes per rank per step, nodes of {s} ranks (input bytes unless "
                 f"'ring, sent')",
                 f"  {'':<{width}}  {f'hybrid ({r}, {s})':>14}  "
                 f"{f'flat over {c.world_size}':>14}"]
        lines += [f"  {n:<{width}}  {a / 2**20:10.1f} MiB  {b / 2**20:10.1f} MiB"
                  for n, a, b in rows]
        lines.append(f"  flat ZeRO-3 over {c.world_size} ranks: "
                     f"{self.flat_memory.total / 2**20:.1f} MiB per rank in total")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The memory plan's fields (as :func:`to_json`), plus ``mesh``, ``comm`` and
        ``flat`` (memory and comm of flat ZeRO-3 over R*S ranks)."""
        return json.dumps({**asdict(self.memory), "total": self.memory.total,
                           "mesh": [self.comm.replicas, self.comm.shard_size],
                           "comm": self.comm.as_dict(),
                           "flat": {**asdict(self.flat_memory), "total": self.flat_memory.total,
                                    "comm": self.flat_comm.as_dict()}}, indent=2)


def mesh_plan(model: nn.Module, replicas: int, shard_size: int, optimizer: str = "adamw",
              param_dtype: torch.dtype | None = None, units: UnitSpec = None,
              activation_bytes: int = 0) -> MeshPlan:
    """:func:`plan` and :func:`comm_plan` on a (replicas, shard_size) mesh, and both for
    flat ZeRO-3 over ``replicas * shard_size`` ranks.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig(n_layer=24, d_model=2048))
        >>> print(mesh_plan(model, replicas=64, shard_size=8).table())
    """
    world = replicas * shard_size
    return MeshPlan(plan(model, shard_size, optimizer, param_dtype, units, activation_bytes),
                    comm_plan(model, replicas, shard_size, param_dtype, units=units),
                    plan(model, world, optimizer, param_dtype, units, activation_bytes),
                    comm_plan(model, 1, world, param_dtype, units=units))
