"""What a module's state is made of: its parameters (sharded or not) and persistent buffers."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.collectives import Comm
from ..engine.groups.alloc import freed
from ..engine.iteration.state import owning_state
from ..engine.iteration.unit import ShardedParam, sharded_param
from ..engine.sharded_init import init_piece
from ..errors import ShardwiseError
from ._messages import summary
from ._names import dtype_name


@dataclass
class ParamTarget:
    """One parameter of the module, under every name it has in ``state_dict()``."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: ShardedParam | None
    plain: torch.Tensor | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_range(self) -> tuple[int, int]:
        """(offset into the flattened parameter, element count) this rank stores."""
        if self.sharded is not None:
            return self.sharded.piece.param_offset, self.sharded.piece.numel
        return 0, self.numel

    @property
    def writes(self) -> bool:
        """Whether this rank saves its rows: under hybrid sharding only replica 0 does, so
        a checkpoint holds each shard once (Note [hybrid sharding] in comm/mesh.py)."""
        sp = self.sharded
        return sp is None or sp.unit is None or sp.unit.model.topology.replica_index == 0

    def saved_range(self) -> tuple[int, int]:
        """:meth:`local_range` if this rank :attr:`writes`, else an empty piece."""
        lo, n = self.local_range()
        return (lo, n) if self.writes else (lo, 0)

    def local_values(self) -> torch.Tensor:
        """This rank's elements, flattened."""
        if self.sharded is not None:
            return self.sharded.local.detach().reshape(-1)
        assert self.plain is not None
        return self.plain.detach().reshape(-1)

    def write_local(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            if self.sharded is not None:
                self.sharded.local.view(-1).copy_(values.reshape(-1))
            else:
                assert self.plain is not None
                self.plain.copy_(values.reshape(self.shape))

    # What a checkpoint asks of the parameter's group (Note [one interface for a group]
    # in engine/groups/interface.py): never which tier it is on.
    def page_release(self) -> Callable[[], None] | None:
        """What drops the pages of this parameter's group once a checkpoint has read or
        written its rows (Note [the disk tier]); ``None`` when there are none."""
        group = self.sharded.group if self.sharded is not None else None
        return group.page_release() if group is not None else None

    @property
    def streams_state(self) -> bool:
        """Whether its optimizer state lives in its group's files: a load reads it one
        tensor at a time (Note [streamed load] in load.py)."""
        group = self.sharded.group if self.sharded is not None else None
        return group is not None and group.streams_state

    def adopt_state(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """Optimizer state ``key`` of this parameter, ``values`` being this rank's rows,
        as a DTensor where its group keeps such state; the group's pages are then
        dropped."""
        sp = self.sharded
        assert sp is not None and sp.group is not None
        out = sp.group.adopt_state(sp, key, sp.as_dtensor(values.view(sp.local.shape)))
        sp.group.release_pages()
        return out


@dataclass
class PackedTarget:
    """One quantized (tensor subclass) parameter, under every name it has; a checkpoint
    holds its inner tensors' values (Note [packed checkpoints] in engine/groups/packed.py)."""

    names: list[str]
    packed: ShardedParam

    @property
    def kind(self) -> str:
        t = self.packed.gather.kind
        return f"{t.__module__}.{t.__qualname__}"

    @property
    def writes(self) -> bool:
        """As :attr:`ParamTarget.writes`: replica 0 saves under hybrid sharding."""
        group = self.packed.group
        return group is None or group.topology.replica_index == 0

    def saved_piece(self, inner: str, rank: int) -> tuple[int, int]:
        """What this rank saves of ``inner``: its part, or the whole once (rank 0)."""
        off, cnt = self.packed.gather.inner_piece(inner)
        whole = cnt == math.prod(self.packed.gather.full_inner[inner])
        if not self.writes or (whole and rank != 0):
            return off, 0
        return off, cnt

    def inner(self, name: str) -> InnerTarget:
        return InnerTarget(self.packed.gather.pieces[name])


@dataclass
class InnerTarget:
    """An inner tensor of a quantized parameter's shard, which a load writes into."""

    local: torch.Tensor

    def write_local(self, values: torch.Tensor) -> None:
        with torch.no_grad():
            self.local.view(-1).copy_(values.reshape(-1))


def packed_targets(module: nn.Module) -> list[PackedTarget]:
    """The quantized parameters of ``module``, each once with all its names."""
    out: dict[int, PackedTarget] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        pp = sharded_param(value) if isinstance(value, torch.Tensor) else None
        if pp is not None and not pp.by_rows:
            out.setdefault(id(pp), PackedTarget([], pp)).names.append(name)
    return list(out.values())


def abandon_unfinished(module: nn.Module) -> None:
    """Before a checkpoint reads or writes a sharded model: abandon an iteration that
    cannot complete (an aborted backward, a forward whose backward never came), as the
    next forward would (``ModelState.recover``); nothing for other modules. The one
    change of state on a checkpoint's way in: :func:`module_targets` only reads."""
    state = owning_state(module)
    if state is not None:
        state.recover()
        state.release_held()  # Note [gathered across micro-batches] in engine/iteration/state.py


def module_targets(module: nn.Module) -> tuple[list[ParamTarget], dict[str, torch.Tensor]]:
    """The parameters (each once, with all its names) and persistent buffers of ``module``;
    quantized ones are :func:`packed_targets`'. Changes nothing (call
    :func:`abandon_unfinished` first).

    Raises:
        ShardwiseError: a parameter is not materialised; the model is between a
            reproducible step's micro-batches, or inside its forward or backward or a
            ``gathered()`` block.
    """
    params: dict[int, ParamTarget] = {}
    buffers: dict[str, torch.Tensor] = {}
    param_ids = {id(p) for p in module.parameters()}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        sp = sharded_param(value)
        if sp is not None and not sp.by_rows:
            continue  # a tensor subclass: packed_targets'

        if init_piece(value) is not None or (sp is None and value.is_meta):
            raise ShardwiseError(
                f"{name} is not materialised (built under sw.sharded_init or on the meta "
                f"device): call sw.shard(model) first, then load into the sharded model")
        if sp is not None:
            key = id(sp)
            if key not in params:
                params[key] = ParamTarget([], tuple(sp.shape), sp.dtype, sp, None)
        elif id(value) in param_ids:
            key = id(value)
            if key not in params:
                params[key] = ParamTarget([], tuple(value.shape), value.dtype, None, value)
        else:
            buffers[name] = value
            continue
        params[key].names.append(name)
    state = owning_state(module)
    if state is not None:
        if state.mid_step():
            raise ShardwiseError(
                "cannot save or load a reproducible model between the micro-batches of a "
                "step (what they summed so far is not in a checkpoint): save after the "
                "step's last (synced) backward")
    for t in params.values():
        unit = t.sharded.unit if t.sharded is not None else None
        if unit is not None and not unit.is_sharded():
            raise ShardwiseError("cannot load or save state while the model is inside its "
                                 "forward/backward or a gathered() block")
    return list(params.values()), buffers


def comm_of(module: nn.Module) -> Comm | None:
    state = owning_state(module)
    if state is not None:
        return state.comm
    return Comm(None) if dist.is_initialized() else None


# A value to write: the tensor, or what reads it (a disk tier's rows, read one at a time:
# Note [streamed load] in load.py).
Value = torch.Tensor | Callable[[], torch.Tensor]


def apply_values(values: list[tuple[ParamTarget | InnerTarget, Value]],
                 buffer_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write planned parameter rows and buffer values into the model."""
    for t, v in values:
        value = v() if callable(v) else v
        t.write_local(value)
        release = t.page_release() if isinstance(t, ParamTarget) else None
        if release is not None:
            release()
            if callable(v):  # read one at a time: Note [freed memory]
                freed(value.numel() * value.element_size())
    with torch.no_grad():
        for b, v in buffer_values:
            b.copy_(v)


@dataclass
class Matched:
    """The module's tensors paired with saved ones, and what did not pair."""

    params: list[tuple[ParamTarget, str]] = field(default_factory=list)  # (target, key)
    buffers: list[tuple[torch.Tensor, str]] = field(default_factory=list)  # (buffer, key)
    missing: list[str] = field(default_factory=list)      # the module's names
    unexpected: list[str] = field(default_factory=list)   # saved keys nothing took
    mismatched: list[str] = field(default_factory=list)   # one line each

    def problems(self, where: str, strict: bool = True) -> list[str]:
        """Message parts (lists summarised); ``strict=False`` forgives missing and
        unexpected names, never a mismatch."""
        out = []
        if self.mismatched:
            out.append("mismatched: " + summary(self.mismatched, join="; "))
        if strict and self.missing:
            out.append(f"missing from the {where}: {summary(self.missing)}")
        if strict and self.unexpected:
            out.append(f"not in the model: {summary(self.unexpected)}")
        return out

    def advice(self, strict: bool = True) -> str:
        """What fits :meth:`problems` of a source of pretrained weights, in parentheses:
        names that differ can be renamed or forgiven, a shape that differs cannot."""
        parts = []
        if strict and (self.missing or self.unexpected):
            parts.append("pass rename={'old.prefix.': 'new.prefix.'} if the names differ "
                         "only by a prefix, or strict=False to ignore missing and "
                         "unexpected keys")
        if self.mismatched:
            parts.append("a shape that differs is not a naming problem: rename= and "
                         "strict=False do not apply. Build the model from the config saved "
                         "with these weights (AutoConfig.from_pretrained(folder): hidden "
                         "size, vocabulary, heads), resize it as the weights were "
                         "(resize_token_embeddings) before loading, or load the weights of "
                         "the model you built: this source may be another model's")
        return f" ({'; '.join(parts)})" if parts else ""


def match_targets(params: list[ParamTarget], buffers: Mapping[str, torch.Tensor],
                  saved: Mapping[str, tuple[tuple[int, ...], str | None]],
                  key_of: Mapping[str, str], where: str) -> Matched:
    """Pair the module's parameters and buffers with saved tensors: the one matcher of
    ``load_checkpoint`` and ``load_pretrained``.

    Args:
        params, buffers: from :func:`module_targets`.
        saved: each saved key's shape and dtype name (None: any dtype, cast on load).
        key_of: every name the saved side answers to (a tied weight's each name, a renamed
            key) mapped to its saved key.
        where: how messages name the saved side ("checkpoint", "source").
    """
    out = Matched()
    used: set[str] = set()

    def fits(name: str, shape: tuple[int, ...], dtype: torch.dtype, key: str) -> bool:
        want_shape, want_dtype = saved[key]
        if tuple(want_shape) == tuple(shape) and want_dtype in (None, dtype_name(dtype)):
            return True
        kind = "" if want_dtype is None else f"{want_dtype} "
        mine = "" if want_dtype is None else f"{dtype_name(dtype)} "
        out.mismatched.append(f"{name}: {where} {kind}{list(want_shape)}, model "
                              f"{mine}{list(shape)}")
        return False

    for t in params:
        present = [n for n in t.names if n in key_of]
        if not present:
            out.missing.append(t.names[0])
            continue
        key = key_of[present[0]]  # a tied weight needs only one of its names
        used.update(key_of[n] for n in present)  # and may come under several
        if fits(present[0], t.shape, t.dtype, key):
            out.params.append((t, key))
    for name, b in buffers.items():
        if name not in key_of:
            out.missing.append(name)
            continue
        used.add(key_of[name])
        if fits(name, tuple(b.shape), b.dtype, key_of[name]):
            out.buffers.append((b, key_of[name]))
    out.unexpected = [k for k in saved if k not in used]
    return out
