"""What a module's state is made of: its parameters (sharded or not) and persistent buffers.

A parameter's target is one kind of object whatever its gather strategy (Note [one group
type] in engine/groups/flat.py): a checkpoint asks it for its :class:`Part` s, the flat
tensors it holds of it (the parameter itself, or each of a tensor subclass's inner
tensors: Note [packed checkpoints] in engine/groups/subclass.py), and saves, reads and
writes each the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm.collectives import Comm
from ..engine.groups.alloc import freed
from ..engine.groups.tensor_parallel import tp_of
from ..engine.iteration.state import owning_state
from ..engine.iteration.unit import ShardedParam, sharded_param
from ..engine.sharded_init import init_piece
from ..errors import ShardwiseError
from ._messages import summary
from ._names import dtype_name, part_key
from ._tensor_parallel import Read, TpPlace, tp_places


@dataclass
class Part:
    """One flat tensor a checkpoint holds of a parameter: the parameter, or one of its
    inner tensors (``inner``), under ``key`` in the data files and ``piece`` in their
    pieces' records; flattened from ``shape`` and ``dtype``, of which this rank holds the
    ``local`` (offset, count) and saves ``saved`` (its local range, or none)."""

    key: str
    piece: str
    inner: str | None
    shape: tuple[int, ...]  # of the full tensor (the parameter, or its inner tensor)
    dtype: torch.dtype
    local: tuple[int, int]
    saved: tuple[int, int]
    values: torch.Tensor  # this rank's elements, flat: a view of where they live
    target: ParamTarget

    def key_for(self, main: str) -> str:
        """Its data-file key in a checkpoint that names the parameter ``main``."""
        return part_key(main, self.inner)

    def write_local(self, values: torch.Tensor) -> None:
        if self.inner is None:
            self.target.write_local(values)
            return
        with torch.no_grad():
            self.values.copy_(values.reshape(-1))

    def page_release(self) -> Callable[[], None] | None:
        return self.target.page_release()


@dataclass
class ParamTarget:
    """One parameter of the module, under every name it has in ``state_dict()``; its
    ``shape`` is the global one, and ``tp`` how a checkpoint cuts it in a
    tensor-parallel model (Note [tensor-parallel checkpoints] in
    checkpoint/_tensor_parallel.py)."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: ShardedParam | None
    plain: torch.Tensor | None
    tp: TpPlace | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def tensor(self) -> torch.Tensor:
        """What the module and an optimizer hold of it: its shard, or itself."""
        if self.sharded is not None:
            return self.sharded.shard
        assert self.plain is not None
        return self.plain

    @property
    def record(self) -> ShardedParam:
        """The record of its sharded parameter (of a target that has one)."""
        assert self.sharded is not None, "a sharded parameter's target"
        return self.sharded

    @property
    def kind(self) -> str | None:
        """The tensor subclass it is, gathered as bytes (Note [packed checkpoints]), or
        None for a parameter held by rows or whole."""
        if self.sharded is None or self.sharded.by_rows:
            return None
        t = self.sharded.gather.kind
        return f"{t.__module__}.{t.__qualname__}"

    @property
    def unsaveable(self) -> str | None:
        """Why a checkpoint cannot hold it (Note [packed checkpoints]), or None."""
        if self.sharded is None or self.sharded.by_rows:
            return None
        return self.sharded.gather.unsaveable

    def parts(self, rank: int) -> list[Part]:
        """What a checkpoint holds of it on ``rank``: the parameter's elements, or each
        of a tensor subclass's inner tensors, its part or the whole once (rank 0)."""
        main = self.names[0]
        if self.kind is None:
            lo, n = self.local_range()
            return [Part(part_key(main, None), main, None, self.shape, self.dtype, (lo, n),
                         self.saved_range(), self.local_values(), self)]
        sb = self.record.gather
        out = []
        for inner in sb.inner:
            lo, n = sb.inner_piece(inner)
            shape = tuple(sb.full_inner[inner])
            saved = (lo, n if self.writes and (n < math.prod(shape) or rank == 0) else 0)
            key = part_key(main, inner)
            out.append(Part(key, key, inner, shape, sb.pieces[inner].dtype, (lo, n), saved,
                            sb.pieces[inner].detach().reshape(-1), self))
        return out

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
        """The range of the flattened (global) parameter this rank saves: its
        :meth:`local_range`, or in a tensor-parallel model its part of it (Note
        [tensor-parallel checkpoints]); empty unless this rank :attr:`writes`."""
        lo, n = self.local_range()
        if self.tp is not None:
            lo, n = self.tp.saved_range(lo, n)
        return (lo, n) if self.writes else (lo, 0)

    def saved_values(self, rows: torch.Tensor) -> torch.Tensor:
        """What this rank saves of ``rows`` (its local range, flat: the parameter's or an
        optimizer state's), :meth:`saved_range`'s elements. In a tensor-parallel model,
        for a parameter tp splits on a dim other than 0, an exchange over tp (Note
        [tensor-parallel checkpoints]): every rank calls it in the same order."""
        if self.tp is None or not self.writes:
            return rows
        return self.tp.saved_values(rows, *self.local_range())

    @property
    def exchanges(self) -> bool:
        """Whether :meth:`saved_values` is a collective."""
        return self.tp is not None and self.writes and self.tp.dim not in (None, 0)

    def read_local(self, read: Read) -> torch.Tensor:
        """This rank's elements (its :meth:`local_range`, flat) from ``read``, which
        reads a range of the flattened (global) parameter."""
        lo, n = self.local_range()
        return read(lo, n) if self.tp is None else self.tp.read_local(read, lo, n)

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
    """The parameters (each once, with all its names: plain, sharded by rows, or tensor
    subclasses) and persistent buffers of ``module``. Changes nothing (call
    :func:`abandon_unfinished` first).

    Raises:
        ShardwiseError: a parameter is not materialised; the model is between a
            reproducible step's micro-batches, or inside its forward or backward or a
            ``gathered()`` block.
    """
    params, buffers = _targets(module)
    state = owning_state(module)
    if state is not None:
        if state.mid_step():
            raise ShardwiseError(
                "cannot save or load a reproducible model between the micro-batches of a "
                "step (what they summed so far is not in a checkpoint): save after the "
                "step's last (synced) backward")
    for t in params:
        unit = t.sharded.unit if t.sharded is not None else None
        if unit is not None and not unit.is_sharded():
            raise ShardwiseError("cannot load or save state while the model is inside its "
                                 "forward/backward or a gathered() block")
    return params, buffers


def _targets(module: nn.Module) -> tuple[list[ParamTarget], dict[str, torch.Tensor]]:
    """:func:`module_targets` without its checks of the model's phase."""
    params: dict[int, ParamTarget] = {}
    buffers: dict[str, torch.Tensor] = {}
    param_ids = {id(p) for p in module.parameters()}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            continue
        sp = sharded_param(value)
        if init_piece(value) is not None or (sp is None and value.is_meta):
            raise ShardwiseError(
                f"{name} is not materialised (built under sw.sharded_init or on the meta "
                f"device): call sw.shard(model) first, then load into the sharded model")
        if sp is not None:
            key = id(sp)
            if key not in params:
                spec = tp_of(sp)
                params[key] = ParamTarget([], tuple(sp.shape if spec is None else spec.shape),
                                          sp.dtype, sp, None)
        elif id(value) in param_ids:
            key = id(value)
            if key not in params:
                params[key] = ParamTarget([], tuple(value.shape), value.dtype, None, value)
        else:
            buffers[name] = value
            continue
        params[key].names.append(name)
    places = tp_places([t.sharded for t in params.values() if t.sharded is not None])
    for t in params.values():
        t.tp = places.get(id(t.sharded))
    return list(params.values()), buffers


def subclass_targets(module: nn.Module) -> list[ParamTarget]:
    """The tensor subclasses among ``module``'s parameters (quantized weights), without
    :func:`module_targets`' checks of the model's phase."""
    return [t for t in _targets(module)[0] if t.kind is not None]


def comm_of(module: nn.Module) -> Comm | None:
    state = owning_state(module)
    if state is not None:
        return state.comm
    return Comm(None) if dist.is_initialized() else None


# A value to write: the tensor, or what reads it (a disk tier's rows, read one at a time:
# Note [streamed load] in load.py).
Value = torch.Tensor | Callable[[], torch.Tensor]


def apply_values(values: list[tuple[ParamTarget | Part, Value]],
                 buffer_values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write planned parameter rows (or parts) and buffer values into the model."""
    for t, v in values:
        value = v() if callable(v) else v
        t.write_local(value)
        release = t.page_release()
        if release is not None:
            release()
        if callable(v):  # read one at a time: Note [freed memory]
            nbytes = value.numel() * value.element_size()
            del value
            freed(nbytes)
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
