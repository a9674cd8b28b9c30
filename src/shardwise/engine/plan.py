"""What ``shard`` asks the engine to build: the units, their groups and their parameters.

``planning/units.py`` fills these records and ``shard`` has every rank agree on them;
:func:`shardwise.engine.build.build` builds the model from them. They are plain records:
making one changes nothing in the model. They live in the engine, below ``planning/``, so
that the builder can take a plan without importing the layer that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .groups.layout import ShardLayout
from .groups.parts import Placement
from .iteration.buffers import BufferPolicy


@dataclass
class ParamRecord:
    """One parameter of the model: every name and every place it is registered."""

    param: nn.Parameter
    fqns: list[str] = field(default_factory=list)
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    users: set[int] = field(default_factory=set)  # indices of the units whose modules use it


@dataclass
class GroupSpec:
    """The parameters of one flat group, the dtypes it computes and reduces in, and their
    layout over the shard group's ranks: laid out once, when planned, and built as
    planned (``units="auto"`` measured its choice on this layout)."""

    records: list[ParamRecord]
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    layout: ShardLayout


@dataclass
class UnitPlan:
    """One unit as planned: its flat groups, and the parameters gathered through FSDP2's
    extension protocol instead (Note [packed parameters] in engine/groups/subclass.py)."""

    name: str
    module: nn.Module
    records: list[ParamRecord]  # every parameter the unit owns, in order of discovery
    groups: list[GroupSpec]
    subclasses: list[ParamRecord]  # gathered as bytes (Note [one group type])


@dataclass(frozen=True)
class Plan:
    """What ``shard`` decided before changing anything, the same on every rank: what
    :func:`~shardwise.engine.build.build` builds."""

    units: list[UnitPlan]  # the root's first, then in module order
    placement: Placement | None  # where the states live; None: all on the device
    buffers: BufferPolicy  # how buffers are kept equal
