"""Memory per rank, planned before anything is built: ``shardwise plan`` and :func:`plan`.

For a real model the plan uses the engine's own decisions (``_plan.py``: units and
groups; ``_layout.py``: padded shard sizes) on a copy built on the meta device, so its
parameter, gradient and optimizer figures are the bytes the engine allocates, not an
approximation. For a model given only as a parameter and layer count it assumes equal
blocks. Activations depend on batch, sequence and the model's code, so they are a term
the caller supplies (``activation_bytes``), never guessed.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from ._layout import build_layout
from ._plan import (
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
                ("total", self.total)]
        width = max(len(r[0]) for r in rows)
        lines = [f"per rank, world size {self.world_size}, {self.units} units"]
        lines += [f"  {name:<{width}}  {b / 2**20:12.1f} MiB" for name, b in rows]
        return "\n".join(lines)


def plan(model: nn.Module, world_size: int, optimizer: str = "adamw",
         param_dtype: torch.dtype | None = None, units: UnitSpec = None,
         activation_bytes: int = 0, memory_budget: int | None = None) -> MemoryPlan:
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
    params = grads = opt = 0
    unit_bytes = []
    for recs in per_unit:
        full = 0
        for spec in group_specs(recs, param_dtype, None):
            p = spec.records[0].param
            size = p.element_size()
            layout = build_layout([tuple(r.param.shape) for r in spec.records], world_size)
            params += layout.shard_numel * size
            full += layout.full_numel * torch.empty(0, dtype=spec.compute_dtype).element_size()
            if p.requires_grad:
                grads += layout.shard_numel * size
                rows = sum(s.local_rows(0) * s.row_numel for s in layout.slots)
                opt += per_elem * rows * size + per_param * len(layout.slots)
        unit_bytes.append(full)
    ranked = sorted(unit_bytes, reverse=True) + [0, 0]
    return MemoryPlan(world_size, params, grads, opt, ranked[0], ranked[1], activation_bytes,
                      len(chosen))


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


def build_on_meta(spec: str, kwargs: dict | None = None) -> nn.Module:
    """Build ``package.module:callable`` (or a Hugging Face ``config.json`` folder) on the
    meta device, at no memory cost."""
    with torch.device("meta"):
        if ":" in spec:
            module_name, _, attr = spec.partition(":")
            obj = getattr(importlib.import_module(module_name), attr)
            return obj(**(kwargs or {}))
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec))


def to_json(p: MemoryPlan) -> str:
    return json.dumps({**asdict(p), "total": p.total}, indent=2)
