"""Frozen tensor subclasses gathered through FSDP2's extension protocol (QLoRA bases):
their gather strategy, ``SubclassBytes`` (Note [one group type] in engine/groups/flat.py).

Note [packed parameters]
A quantized weight such as torchao's ``NF4Tensor`` is a tensor subclass: it reports the
shape and dtype of the weight it stands for, and stores packed 4-bit codes and scales in
inner tensors. Sharded like a plain parameter it would be dequantized (``.to(dtype)``) into
a full-precision shard: 7x the bytes QLoRA exists to save, and nothing said. A subclass
that implements FSDP2's extension protocol says instead how it is gathered:

- sharding: ``torch.chunk(t, N, dim=0)[r]`` is rank r's shard, itself an instance of the
  subclass (FSDP2 shards it the same way); a weight that does not split so into N equal
  shards is divided by bytes instead (Note [uneven packed parameters]);
- ``shard.fsdp_pre_all_gather(mesh)`` (or the five-argument form ``(mesh, outer_size,
  outer_stride, module, mp_policy)``) returns the tensors to all-gather and metadata;
- ``shard.fsdp_post_all_gather(outputs, metadata, param_dtype, out=None)``, given each
  input all-gathered across the shard group (rank after rank, viewed ``(-1, *size[1:])``),
  returns the full tensor and the inner tensors it allocated; called again with
  ``out=`` the full tensor after a release, it refills that tensor in place.

shardwise calls these exactly as FSDP2 does (``torch/distributed/fsdp/_fully_shard/
_fsdp_param.py``), so one subclass works under both. What it adds:

- Bytes move as bytes. Every all-gather input is viewed as ``uint8`` and packed into one
  byte buffer per group, so packed codes never pass through a floating-point cast, a NaN
  canonicalisation or a reduction; one all-gather per group and gather.
- Each rank's shard lives in the group's own byte buffer: the chunk's inner tensors
  (``__tensor_flatten__``) are copied there and the chunk rebuilt around views of it
  (``__tensor_unflatten__``), so no rank keeps the full original alive, and initial values
  come from ``src_rank`` as for every parameter (a scatter of bytes).
- Release frees the full buffer's storage and the inner tensors ``fsdp_post_all_gather``
  allocated; the next gather refills them in place, so tensors autograd saved in forward
  (``LinearNF4`` saves its weight) see the values again in backward, as with
  Note [freeing full parameters] in engine/iteration/unit.py.

Limits, each refused by name at ``shard``: the parameter must be frozen (a trainable
subclass, float8 training, would need its gradients reduced as rows: Note [one group
type] in engine/groups/flat.py says what that would take), its
inner tensors must be plain, and ``sharded_init`` and, on a GPU, ``Offload(params=...)``
do not take it (Note [packed bytes offloaded]). Any other tensor subclass, and any
``nn.Parameter`` subclass (bitsandbytes' ``Params4bit`` keeps its quantization state
beside packed bytes that a row split would tear apart), is refused: shardwise never
shards a tensor whose bytes it cannot move exactly.
"""

from __future__ import annotations

import inspect as pyinspect
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..._args import some_names
from ..._registry import copy_user_attributes
from ...comm.mesh import Topology
from ...errors import ShardwiseError
from .layout import ShardLayout, build_layout, contiguous_stride
from .parts import DeviceStorage
from .quantize import as_torchaos, decode_by_pairs


def uses_protocol(t: torch.Tensor) -> bool:
    """Whether ``t`` implements FSDP2's all-gather extension protocol."""
    return hasattr(t, "fsdp_pre_all_gather") and hasattr(t, "fsdp_post_all_gather")


def subclass_refusal(name: str, p: torch.Tensor) -> str | None:
    """Why parameter ``name`` cannot be sharded, or ``None`` when it can (plain, or a
    frozen subclass with the protocol: Note [packed parameters])."""
    kind = f"{type(p).__module__}.{type(p).__qualname__}"
    if type(p) is nn.Parameter and type(p.data) is torch.Tensor:
        return None
    has_pre, has_post = hasattr(p, "fsdp_pre_all_gather"), hasattr(p, "fsdp_post_all_gather")
    if has_pre != has_post:
        return (f"{name} ({kind}) defines only one of fsdp_pre_all_gather and "
                f"fsdp_post_all_gather; the extension protocol needs both")
    if not has_pre:
        # nn.Parameter(subclass_tensor) keeps the subclass as its type; an nn.Parameter
        # subclass (bitsandbytes' Params4bit) holds plain data.
        plain_data = type(p.data) is torch.Tensor
        what = f"an nn.Parameter subclass, {kind}" if plain_data else f"a tensor subclass, {kind}"
        return (f"{name} is {what}, which shardwise cannot shard exactly: its bytes may "
                f"carry meaning (packed 4-bit codes, a quantization state) that splitting "
                f"its rows would lose, and it does not implement FSDP2's extension "
                f"protocol (fsdp_pre_all_gather / fsdp_post_all_gather) that says how to "
                f"gather it. Use a subclass that does (torchao's NF4Tensor: "
                f"docs/qlora.md), or a plain nn.Parameter")
    if p.requires_grad:
        return (f"{name} ({kind}) requires grad: shardwise gathers tensor subclasses "
                f"through the extension protocol for frozen weights only (QLoRA bases); "
                f"freeze it with requires_grad_(False), or train it as a plain parameter")
    if not hasattr(p, "__tensor_flatten__") or not hasattr(type(p), "__tensor_unflatten__"):
        return (f"{name} ({kind}) implements the extension protocol but not "
                f"__tensor_flatten__ / __tensor_unflatten__, by which shardwise moves its "
                f"shard's inner tensors between ranks")
    return None


# Note [uneven packed parameters]
# A subclass's own split (``torch.chunk`` on dim 0) gives N equal shards only when its
# rows and blocks divide by N: NF4 needs each shard to hold whole blocks of scales, so a
# 64-row projection has no 3-rank split, nor has a 4096-wide Llama's at 3 or 6 ranks. Such
# a weight is divided instead by elements of its *full* inner tensors
# (``__tensor_flatten__``): each inner tensor, viewed flat, is cut as a parameter's rows
# are (Note [row sharding] in engine/groups/layout.py: ``ceil(numel / N)`` elements a rank, the
# last ranks' slots padded with zeros), tiny ones (NF4's scalar mean, its table of 16
# values) alike, one slot each in the group's byte buffer. A gather all-gathers those
# slots with the group's other bytes (one all-gather) and rebuilds the full tensor with
# ``__tensor_unflatten__(full inner tensors, the original's context, size, stride)``: the
# original's bytes exactly, so the forward gives the bits of one rank and of an even split.
#
# Chosen over cutting rows at whole blocks and padding because it needs nothing of the
# subclass beyond flattening: no padded instance (an NF4Tensor cannot hold padding rows),
# no knowledge of which inner tensor holds which blocks; it costs at most one element per
# inner tensor and rank, and the slot alignment. An even split keeps the subclass's own
# chunks: it is what FSDP2 does, and the chunk is what the protocol's
# ``fsdp_pre_all_gather`` runs on. What follows from there being no chunk of the subclass:
#
# - While sharded the module holds a :class:`ByteShard`: the weight's shape and dtype, no
#   values. Any operation on it raises, naming the weight (``to_local`` and
#   ``full_tensor`` too): there is no local tensor to give. Its values exist while its
#   unit is gathered (forward, backward), and whole from ``sw.full_state_dict``.
# - ``fsdp_post_all_gather`` is not called, and it alone takes MixedPrecision's
#   ``param_dtype``: a ``param_dtype`` other than the weight's own dtype is refused for such
#   a weight, by name (NF4 ignores it anyway: its gathered weight keeps the dtype it was
#   quantized from, and dequantizes to its input's).
# - A checkpoint records each rank's element range as its piece (Note [packed
#   checkpoints]), so it reloads at any world size, split either way.
# - Release frees the full byte buffer, whose views the rebuilt tensor holds; the next
#   gather refills it in place, so the weight ``LinearNF4`` saved in forward sees values
#   again in backward.
@dataclass(frozen=True)
class Cut:
    """How one quantized parameter is divided among ``world`` ranks: into the subclass's
    own equal chunks, or by elements of its full inner tensors (``by_bytes``: Note [uneven
    packed parameters]). ``shapes`` are the stored inner tensors' shapes: a chunk's, or the
    full tensor's."""

    world: int
    by_bytes: bool
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    def per_rank(self, i: int) -> int:
        """Elements of inner tensor ``i`` in each rank's slot (padding included)."""
        n = math.prod(self.shapes[i])
        return -(-n // self.world) if self.by_bytes else n

    def held(self, i: int, rank: int) -> int:
        """Elements of inner tensor ``i`` that ``rank`` holds (``torch.chunk``'s rule)."""
        if not self.by_bytes:
            return self.per_rank(i)
        c = self.per_rank(i)
        return max(0, min(c, math.prod(self.shapes[i]) - rank * c))

    def slot_bytes(self) -> list[int]:
        """Bytes of each inner tensor's slot, the same on every rank."""
        return [self.per_rank(i) * d.itemsize for i, d in enumerate(self.dtypes)]

    def shares(self, name: str, full: torch.Tensor) -> list[list[torch.Tensor]]:
        """What each rank stores of ``full`` (a tensor of the same structure): per rank,
        each inner tensor's bytes (a padded slot's valid part).

        Raises:
            ShardwiseError: ``full`` is not divided into inner tensors of this shape.
        """
        if self.by_bytes:
            _plain_inner(full, name)
            inner = [getattr(full, n).detach() for n in self.names]
            if [(tuple(t.shape), t.dtype) for t in inner] != list(zip(self.shapes,
                                                                       self.dtypes)):
                raise ShardwiseError(f"{name}: its inner tensors are not shaped as the "
                                     f"model's")
            flat = [t.reshape(-1) for t in inner]
            return [[_as_bytes(f[min(r * self.per_rank(i), f.numel()):][:self.held(i, r)])
                     for i, f in enumerate(flat)] for r in range(self.world)]
        chunks = list(torch.chunk(full.detach(), self.world, dim=0))
        out = []
        for c in chunks:
            parts = [getattr(c, n) for n in self.names]
            if [(tuple(t.shape), t.dtype) for t in parts] != list(zip(self.shapes,
                                                                       self.dtypes)):
                raise ShardwiseError(f"{name}: its shards have inner tensors of other "
                                     f"shapes than the model's")
            out.append([_as_bytes(t) for t in parts])
        if len(out) != self.world:
            raise ShardwiseError(f"{name}: it splits into {len(out)} shards, not "
                                 f"{self.world}")
        return out


def cut(name: str, p: torch.Tensor, n: int, compute_dtype: torch.dtype | None = None) -> Cut:
    """How ``p`` is divided among ``n`` ranks (Note [uneven packed parameters]): into the
    subclass's own chunks (``torch.chunk`` on dim 0, as FSDP2) when they are ``n`` of one
    shape, else by elements of its full inner tensors. ``sw.shard`` calls it before
    changing anything.

    Raises:
        ShardwiseError: an inner tensor is not a plain tensor; or, for a weight divided by
            bytes, ``__tensor_unflatten__`` does not rebuild it from its inner tensors, or
            ``compute_dtype`` (MixedPrecision's ``param_dtype``) is not its dtype.
    """
    try:
        chunks = list(torch.chunk(p.detach(), n, dim=0))
    except Exception:  # noqa: BLE001 - the subclass's split refused (NF4 asserts): by bytes
        chunks = []
    if len(chunks) == n and len({tuple(c.shape) for c in chunks}) == 1:
        names, _ = _plain_inner(chunks[0], name)
        layouts = {tuple((tuple(getattr(c, k).shape), getattr(c, k).dtype) for k in names)
                   for c in chunks}
        if len(layouts) == 1:
            (layout,) = layouts
            return Cut(n, False, tuple(names), tuple(s for s, _ in layout),
                       tuple(d for _, d in layout))
    names, ctx = _plain_inner(p, name)
    kind = f"{type(p).__qualname__}, shape {tuple(p.shape)}"
    try:
        rebuilt = type(p).__tensor_unflatten__(  # type: ignore[attr-defined]
            {k: getattr(p, k) for k in names}, ctx, p.size(), p.stride())
    except Exception as err:
        raise ShardwiseError(f"{name} ({kind}) does not split into {n} equal shards on "
                             f"dim 0, and {type(p).__qualname__}.__tensor_unflatten__ "
                             f"failed to rebuild it from its own inner tensors ({err}), "
                             f"so it cannot be divided by bytes either "
                             f"(Note [uneven packed parameters] in engine/groups/subclass.py)"
                             ) from err
    if type(rebuilt) is not type(p) or (rebuilt.shape, rebuilt.dtype) != (p.shape, p.dtype):
        raise ShardwiseError(f"{name} ({kind}): __tensor_unflatten__ rebuilt a "
                             f"{type(rebuilt).__qualname__} {tuple(rebuilt.shape)} "
                             f"{rebuilt.dtype} from its inner tensors, not the weight")
    if compute_dtype is not None and compute_dtype != p.dtype:
        raise ShardwiseError(
            f"{name} ({kind}, {p.dtype}) does not split into {n} equal shards, so it is "
            f"divided by bytes and rebuilt whole, as it was quantized "
            f"(Note [uneven packed parameters] in engine/groups/subclass.py); "
            f"MixedPrecision(param_dtype={compute_dtype}) cannot apply to it. Build the "
            f"model in {compute_dtype} before quantizing, or shard without param_dtype, or "
            f"choose a world size over which its rows and blocks divide")
    inner = [getattr(p, k) for k in names]
    return Cut(n, True, tuple(names), tuple(tuple(t.shape) for t in inner),
               tuple(t.dtype for t in inner))


def _plain_inner(t: torch.Tensor, name: str = "") -> tuple[list[str], Any]:
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    for n in names:
        inner = getattr(t, n)
        if type(inner) is not torch.Tensor:
            raise ShardwiseError(f"{name + ': ' if name else ''}{type(t).__qualname__}.{n} "
                                 f"is a {type(inner).__qualname__}: shardwise moves the "
                                 f"inner tensors of a quantized weight as bytes, so they "
                                 f"must be plain tensors")
    return list(names), ctx


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat (a view when it can be one).

    ``contiguous()`` is not enough: a tensor of at most one element counts as contiguous
    whatever its stride, and keeps it, and ``view(torch.uint8)`` wants the last stride to
    be 1 as written. NF4 makes such a tensor: with one block of scales (a weight of
    ``block_size * scaler_block_size`` elements, 16384 with the default blocks) its
    ``quantization_factor`` is the one-element view ``factors[:, 0]`` of stride
    ``scaler_block_size``, and a piece of an inner tensor divided by bytes may hold one
    element or none (Note [uneven packed parameters]). Those are copied, at most one
    element."""
    flat = t.detach().contiguous().view(-1)
    if flat.stride(0) != 1:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


# Note [packed checkpoints]
# A checkpoint must reload at any world size, and the subclass's own metadata (block
# sizes, shapes, what its __tensor_flatten__ context holds) is not JSON. So a checkpoint
# holds the *values* of the full tensor's inner tensors, in pieces, and a load writes them
# into the pieces the model already holds, whose structure comes from quantizing the same
# architecture with the same settings (checked: the type, every inner tensor's full
# shape and dtype). Each rank's piece of an inner tensor is a contiguous element range:
# for a weight divided by bytes (Note [uneven packed parameters]) its slot's valid part;
# for an even split, the chunk's inner tensor when it is either the whole of the full
# tensor's (NF4's scaler mean and lookup table: saved once, by rank 0) or its r-th of N
# contiguous parts (NF4's codes and scales), which ``shard`` checks on the bytes
# (``_inner_split``). A load at N' ranks reads its own range, whichever way either side
# was split. A subclass whose even chunks are made otherwise trains, and its checkpoints
# are refused, with the reason.
def _inner_split(name: str, full: torch.Tensor, chunk: torch.Tensor, rank: int,
                 world: int) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """Each inner tensor's full shape, and why a checkpoint could not hold the parameter
    (Note [packed checkpoints]), or None."""
    full_names, _ = full.__tensor_flatten__()  # type: ignore[attr-defined]
    names, _ = chunk.__tensor_flatten__()  # type: ignore[attr-defined]
    shapes = {n: tuple(getattr(full, n).shape) for n in full_names}
    if list(full_names) != list(names):
        return shapes, f"{name}: its shards have other inner tensors than the full tensor"
    for n in names:
        whole, part = _as_bytes(getattr(full, n)), _as_bytes(getattr(chunk, n))
        k = part.numel()
        if whole.numel() == k and torch.equal(whole, part):
            continue
        if whole.numel() == world * k and torch.equal(whole[rank * k:(rank + 1) * k], part):
            continue
        return shapes, (f"{name}: its shard's inner tensor {n} is neither the full "
                        f"tensor's {n} nor one of its {world} contiguous parts, so a "
                        f"checkpoint could not reload it at another world size")
    return shapes, None


aten = torch.ops.aten


class ByteShard(torch.Tensor):
    """What the module holds, while sharded, for a quantized weight divided by bytes
    (Note [uneven packed parameters]): its shape and dtype, no values. Every operation
    but ``detach`` (which ``nn.Parameter`` needs) and a copy into itself (what
    ``load_state_dict`` does once the values are loaded) raises, naming the weight."""

    _shardwise_about: str

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                about: str) -> ByteShard:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                requires_grad=False)
        t._shardwise_about = about
        return t

    # Everything reaches __torch_dispatch__, which refuses it.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ByteShard(shape={tuple(self.shape)}, dtype={self.dtype})"

    def refusal(self, what: str) -> ShardwiseError:
        return ShardwiseError(
            f"{self._shardwise_about}; this rank holds part of its packed bytes, not a "
            f"tensor, so {what} cannot run on it. Its values exist while its unit is "
            f"gathered (in forward and backward), and whole from sw.full_state_dict(model)")

    def to_local(self) -> torch.Tensor:
        raise self.refusal("to_local()")

    def full_tensor(self) -> torch.Tensor:
        raise self.refusal("full_tensor()")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self.refusal("pickling")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        # The weight may be any argument (``x @ w``, ``torch.cat([w])``): name the first.
        t = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, ByteShard))
        if func is aten.detach.default:
            return cls(t.shape, t.dtype, t.device, t._shardwise_about)
        if func is aten.copy_.default and args[0] is t and args[1] is t:
            # load_state_dict copies what the module holds into itself once its values
            # are loaded (_load_packed in engine/entry_points/state_dict.py): nothing to do.
            return t
        raise t.refusal(str(func))


@dataclass
class SubclassBytes:
    """How a frozen tensor-subclass parameter is gathered: its bytes, through FSDP2's
    extension protocol (Note [packed parameters]); one of the two gather strategies of
    Note [one group type] in engine/groups/flat.py. The parameter's record is the one every
    parameter has (``ShardedParam``); this is what only such a parameter has."""

    kind: type                     # the subclass
    cut: Cut                       # how it is divided among the ranks
    # This rank's chunk, the subclass over the group's bytes; None when divided by bytes
    # (Note [uneven packed parameters]): there is no chunk of the subclass then.
    chunk: torch.Tensor | None
    inner: list[str]               # names of the inner tensors
    # This rank's piece of each inner tensor, a view of the group's bytes: the chunk's
    # inner tensor, or the valid part of the slot (flat) when divided by bytes.
    pieces: dict[str, torch.Tensor]
    # Each inner tensor's slot in the group's bytes, padding included: what a load writes.
    stored: list[torch.Tensor]
    offsets: list[int]             # where each slot starts in the group's bytes
    rank: int                      # this rank, in the shard group
    mesh: Any                      # the shard group's 1-D mesh, which the protocol is given
    param_dtype: torch.dtype | None  # MixedPrecision's, for the protocol; None: its own
    # Each inner tensor's shape in the full tensor: a checkpoint records the full inner
    # tensors in pieces (Note [packed checkpoints]).
    full_inner: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Why a checkpoint cannot hold this parameter, or None (Note [packed checkpoints]).
    unsaveable: str | None = None
    # Divided by bytes: the original's __tensor_flatten__ context, size and stride, which
    # rebuild the full tensor (Note [uneven packed parameters]).
    ctx: Any = None
    stride: tuple[int, ...] = ()
    # Storage fsdp_post_all_gather allocated itself, with its size: freed and refilled
    # with the full buffer.
    allocated: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    metadata: Any = None           # fsdp_pre_all_gather's, until fsdp_post_all_gather

    # -- gather: what it sends, what it builds (Note [one group type]) -----------------
    def inputs(self, sp: Any) -> list[torch.Tensor]:
        """What parameter ``sp`` sends to the all-gather: its slots when divided by bytes
        (Note [uneven packed parameters]), else what ``fsdp_pre_all_gather`` says, called
        as FSDP2 calls it."""
        if self.chunk is None:
            return self.stored
        fn = self.chunk.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if len(pyinspect.signature(fn).parameters) == 1:
            inputs, self.metadata = fn(self.mesh)
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            inputs, self.metadata = fn(self.mesh, sp.shape, contiguous_stride(sp.shape),
                                       sp.slots[0][0],
                                       MixedPrecisionPolicy(param_dtype=self.param_dtype))
        return list(inputs)

    def outputs(self, gathered: list[torch.Tensor],
                sizes: list[tuple[torch.Size, torch.dtype]]) -> tuple[torch.Tensor, ...]:
        """Its all-gather outputs from ``gathered``, each input's bytes from every rank
        one after another: viewed ``(-1, *size[1:])`` for the protocol, or, divided by
        bytes, the full inner tensors (the slots, less the padding at the end)."""
        views = []
        for i, (t, (size, dtype)) in enumerate(zip(gathered, sizes)):
            if self.chunk is None:
                c = self.cut
                n = math.prod(c.shapes[i]) * c.dtypes[i].itemsize
                views.append(t[:n].view(c.dtypes[i]).view(c.shapes[i]))
            else:
                views.append(t.view(dtype).view(-1, *size[1:]))
        return tuple(views)

    def value(self, sp: Any, outputs: tuple[torch.Tensor, ...]
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A full tensor built from ``outputs``, and the storage the protocol allocated
        for it: ``fsdp_post_all_gather``'s, or, divided by bytes, the original rebuilt
        around the full inner tensors (Note [uneven packed parameters])."""
        if self.chunk is None:
            return self.kind.__tensor_unflatten__(  # type: ignore[attr-defined]
                dict(zip(self.inner, outputs)), self.ctx, sp.shape, self.stride), []
        fn = self.chunk.fsdp_post_all_gather  # type: ignore[attr-defined]
        full, allocated = fn(outputs, self.metadata, self.param_dtype or sp.dtype)
        self.metadata = None
        return full, list(allocated)

    def after_gather(self, sp: Any, outputs: tuple[torch.Tensor, ...],
                     gathered: torch.Tensor) -> nn.Parameter | None:
        """Its full parameter at its first gather (``sp.full`` still on the meta device:
        :func:`not_gathered`), built from ``outputs``, which view the group's byte buffer
        ``gathered``; at a later gather it is refilled in place and None is returned (a
        weight divided by bytes needs nothing: its inner tensors view that buffer)."""
        if not sp.full.is_meta:
            if self.chunk is not None:
                self.chunk.fsdp_post_all_gather(  # type: ignore[attr-defined]
                    outputs, self.metadata, self.param_dtype or sp.dtype, out=sp.full)
                self.metadata = None
            return None
        full, allocated = self.value(sp, outputs)
        if self.chunk is not None and tuple(full.shape) != tuple(sp.shape):
            raise ShardwiseError(
                f"{sp.fqns[0]}: fsdp_post_all_gather built a tensor of shape "
                f"{tuple(full.shape)}, not the parameter's {tuple(sp.shape)}")
        param = nn.Parameter(full, requires_grad=False)
        copy_user_attributes(sp.shard, param,
                             besides=self.chunk if self.chunk is not None else param)
        decode_by_pairs(param)
        self.allocated = [(t, t.untyped_storage().nbytes()) for t in allocated
                          if not _shares(t, gathered)]
        return param

    @staticmethod
    def users_type(full: torch.Tensor) -> None:
        """Give the gathered ``full`` the subclass's own type while users hold it (a
        ``gathered()`` block shows what FSDP2 would: Note [NF4 dequantized by pairs])."""
        as_torchaos(full)

    @staticmethod
    def engines_type(full: torch.Tensor) -> None:
        """Give the gathered ``full`` back the type the engine computes with (Note [NF4
        dequantized by pairs]; :meth:`after_gather` gives it at the first gather)."""
        decode_by_pairs(full)

    @staticmethod
    def edits_refusal(src: int, detail: str) -> str:
        """Why ``gathered(modifier_rank=src)`` cannot keep rank ``src``'s edits of
        these parameters (Note [tensor-subclass parameters in gathered()] in gather.py)."""
        return (f"gathered(modifier_rank={src}) cannot keep the edits of quantized "
                f"parameters: {detail}")

    def views(self) -> list[torch.Tensor]:
        """Every tensor of it viewing the group's bytes: the chunk's inner tensors, the
        pieces, the slots."""
        inner = [getattr(self.chunk, n) for n in self.inner] if self.chunk is not None else []
        return [*inner, *self.pieces.values(), *self.stored]

    def write_shares(self, buf: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Write each rank's share of ``value`` (its full tensor) into that rank's row of
        ``buf``, a ``(ranks, bytes)`` buffer of zeros, at its slots."""
        for r, parts in enumerate(self.cut.shares(name, value)):
            for at, b in zip(self.offsets, parts):
                buf[r, at:at + b.numel()].copy_(b)

    def inner_piece(self, inner: str) -> tuple[int, int]:
        """(offset, count) of this rank's ``inner`` in the full inner tensor's flattened
        elements (Note [packed checkpoints]): its part, or all of it."""
        full = math.prod(self.full_inner[inner])
        if self.cut.by_bytes:
            i = self.inner.index(inner)
            return min(self.rank * self.cut.per_rank(i), full), self.cut.held(i, self.rank)
        k = self.pieces[inner].numel()
        return (0, k) if k == full else (self.rank * k, k)

    @staticmethod
    def gradient_refusal(names: list[str]) -> str:
        """The refusal of parameters ``names``, gathered as bytes, set to require
        gradients after ``shard``: their group reduces nothing (Note [one group type] in
        engine/groups/flat.py), so they would train silently not at all."""
        return (f"{len(names)} quantized (tensor subclass) parameter(s) ({some_names(names)}) "
                f"were set to require gradients after sw.shard: shardwise shards them frozen, "
                f"so they would get no gradient and never train. Freeze them again "
                f"(requires_grad_(False)); train adapters beside them (LoRA), or a "
                f"full-precision copy of the weight")

    @staticmethod
    def cast_refusal(names: list[str]) -> str:
        """The refusal of a cast (``model.half()``, ``model.to(dtype)``) reaching
        parameters ``names``, gathered as bytes (Note [casting after shard] in
        engine/entry_points/casts.py)."""
        return (f"{len(names)} quantized parameter(s) ({some_names(names)}) cannot be cast "
                f"after sw.shard: a cast would dequantize them into full precision. Nothing "
                f"was changed. Cast the model before quantizing it, or compute in another "
                f"dtype with MixedPrecision(param_dtype=...)")

    def inner_mismatch(self, name: str, inner: str, saved: str, here: str) -> str:
        """Parameter ``name``'s inner tensor ``inner`` is ``saved`` (dtype and shape) in
        a checkpoint and ``here`` in the model: the load's refusal, with its likely cause."""
        return (f"{name}: its {inner} is {saved} in the checkpoint, {here} in the model "
                f"(quantized with other settings?)")

    # -- whole values in, this rank's share kept (Note [packed checkpoints]) ------------
    def full_problem(self, name: str, shape: torch.Size, value: object) -> str | None:
        """Why ``value`` cannot be the full value of parameter ``name`` (of ``shape``), or
        None: it must be the same subclass, of the same shape, with inner tensors of the
        full tensor's shapes and dtypes (quantized with the same settings)."""
        if self.unsaveable:
            return self.unsaveable
        kind = self.kind
        if isinstance(value, ByteShard):
            return (f"{name}: the value is this rank's share of a weight divided by bytes "
                    f"(what model.state_dict() holds for it), which has no values; load "
                    f"its full value (sw.full_state_dict)")
        if type(value) is not kind or not isinstance(value, torch.Tensor):
            what = (f"a {value.dtype} {type(value).__qualname__}"
                    if isinstance(value, torch.Tensor) else type(value).__qualname__)
            return (f"{name} is a quantized {kind.__qualname__} and the value is {what}: "
                    f"shardwise writes quantized values only (a {kind.__qualname__} "
                    f"quantized with the model's settings); to quantize full-precision "
                    f"weights as they load, use sw.load_pretrained (docs/qlora.md)")
        if tuple(value.shape) != tuple(shape):
            return (f"{name}: the value has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(shape)}")
        names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
        if sorted(names) != sorted(self.inner):
            return f"{name}: the value has inner tensors {sorted(names)}, not {sorted(self.inner)}"
        for n in self.inner:
            t, mine = getattr(value, n), self.pieces[n]
            if (tuple(t.shape), t.dtype) != (self.full_inner[n], mine.dtype):
                return (f"{name}: the value's {n} is {t.dtype} {list(t.shape)}, the model's "
                        f"{mine.dtype} {list(self.full_inner[n])} (quantized with other "
                        f"settings?)")
        return None

    def take_full(self, value: torch.Tensor) -> None:
        """Write this rank's share of the full value ``value`` (checked by
        :meth:`full_problem`) into its shard: each inner tensor's part, or the whole, as
        :meth:`inner_piece` says; for a weight divided by bytes, its slot's valid part
        (Note [uneven packed parameters])."""
        with torch.no_grad():
            for n in self.inner:
                off, k = self.inner_piece(n)
                piece = getattr(value, n).detach().reshape(-1)[off:off + k]
                mine = self.pieces[n]  # the group's bytes, which the chunk's inner views
                if mine.data_ptr() != piece.data_ptr():
                    mine.view(-1).copy_(piece)


    # -- a state dict's values: whole, or this rank's chunk ------------------------------
    def value_problem(self, name: str, shape: torch.Size, value: object) -> str | None:
        """Why ``value``, from a state dict, cannot be loaded into parameter ``name`` (of
        ``shape``), or None: a full value (:meth:`full_problem`), or a DTensor holding
        this rank's chunk (what ``model.state_dict()`` gives at the same world size)."""
        if not isinstance(value, DTensor):
            return self.full_problem(name, shape, value)
        local, mine = value.to_local(), self.chunk
        if mine is None:
            return (f"{name} is a DTensor holding a {type(local).__qualname__} chunk, but at "
                    f"this world size the weight is divided by bytes, not into chunks (Note "
                    f"[uneven packed parameters] in engine/groups/subclass.py): load its full "
                    f"value (sw.full_state_dict)")
        same = (type(local) is type(mine) and tuple(value.shape) == tuple(shape)
                and tuple(local.shape) == tuple(mine.shape)
                and all((tuple(getattr(local, n).shape), getattr(local, n).dtype)
                        == (tuple(getattr(mine, n).shape), getattr(mine, n).dtype)
                        for n in self.inner))
        if same:
            return None
        return (f"{name} is a DTensor holding a {type(local).__qualname__} of shape "
                f"{tuple(local.shape)}, not this rank's {type(mine).__qualname__} chunk of "
                f"shape {tuple(mine.shape)}: load the full value (sw.full_state_dict), or a "
                f"state_dict() saved at the same world size with the same settings")

    def take_value(self, value: torch.Tensor) -> None:
        """Write ``value`` (checked by :meth:`value_problem`) into this rank's shard."""
        if not isinstance(value, DTensor):
            self.take_full(value)
            return
        assert self.chunk is not None  # else refused (value_problem)
        theirs = value.to_local()
        with torch.no_grad():
            for n in self.inner:
                mine = getattr(self.chunk, n)
                if mine.data_ptr() != getattr(theirs, n).data_ptr():
                    mine.copy_(getattr(theirs, n))


def not_gathered(dtype: torch.dtype) -> nn.Parameter:
    """A subclass parameter's full form before its first gather: an empty parameter on
    the meta device, without gradient (``SubclassBytes.after_gather`` builds the real one
    then)."""
    return nn.Parameter(torch.empty(0, dtype=dtype, device="meta"), requires_grad=False)


# -- a group of subclass parameters ----------------------------------------------------
def cuts_agreed(names: list[str], originals: list[torch.Tensor], topology: Topology,
                compute_dtype: torch.dtype | None) -> list[Cut]:
    """How each of ``originals`` is divided among the shard group's ranks, compared across
    them: every rank must hold the same kinds of pieces, or the byte scatter would
    misplace them (one comparison, failing on every rank alike)."""
    comm = topology.shard
    cuts = [cut(n, p, comm.world_size, compute_dtype) for n, p in zip(names, originals)]
    sig = [(n, type(p).__qualname__, "bytes" if c.by_bytes else "chunks",
            [(s, str(d)) for s, d in zip(c.shapes, c.dtypes)])
           for n, p, c in zip(names, originals, cuts)]
    everyone = comm.all_gather_object(sig, what="the quantized parameters' layout")
    for r, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            bad = next((a, b) for a, b in zip(everyone[0], theirs) if a != b)
            raise ShardwiseError(f"ranks hold different quantized parameters: rank 0 "
                                 f"has {bad[0]}, rank {r} has {bad[1]}; quantize the "
                                 f"same weights with the same settings on every rank")
    return cuts


def group_view(params: list[Any], shard_bytes: int, full_bytes: int,
               full_allocated: bool) -> dict[str, Any]:
    """Plain values for ``sw.inspect`` of a group of subclass parameters, each gathered
    by its ``SubclassBytes``: a ``PackedView``, of the kind that ``UnitView.packed`` (the
    API's name) lists apart from flat groups."""
    return {"kind": "packed", "names": tuple(p.fqns[0] for p in params),
            "types": tuple(p.gather.kind.__name__ for p in params),
            "numel": sum(p.numel for p in params),
            "shard_bytes": shard_bytes, "full_bytes": full_bytes,
            "full_allocated": full_allocated}


def store_layout(cuts: list[Cut]) -> ShardLayout:
    """Where each inner tensor's slot lies in every rank's bytes (the same on each)."""
    return build_layout([(b,) for c in cuts for b in c.slot_bytes()], 1)


def subclass_shard(fqns: list[str], orig: torch.Tensor, c: Cut, local: torch.Tensor,
                   slots: list[Any], topology: Topology, device: torch.device,
                   param_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, nn.Parameter, SubclassBytes]:
    """This rank's share of ``orig`` over its ``slots`` of the group's bytes ``local``: its
    bytes (the slots, one after another), the shard the module holds (a DTensor of the
    chunk, or a :class:`ByteShard`) and its gather strategy."""
    rank, world = topology.shard.rank, topology.shard.world_size
    store, pieces = [], {}
    for i, (n, nbytes, dtype, s) in enumerate(zip(c.names, c.slot_bytes(), c.dtypes, slots)):
        store.append(local[s.offset:s.offset + nbytes])
        piece = store[-1][:c.held(i, rank) * dtype.itemsize].view(dtype)
        pieces[n] = piece if c.by_bytes else piece.view(c.shapes[i])
    span = local[slots[0].offset:slots[-1].offset + c.slot_bytes()[-1]]
    offsets = [s.offset for s in slots]
    mesh = shard_mesh(topology)
    names, ctx = orig.__tensor_flatten__()  # type: ignore[attr-defined]
    if c.by_bytes:
        # A fresh instance, whose own attributes (inner tensors, settings) are not the
        # user's: the original's would keep the full weight alive.
        fresh = type(orig).__tensor_unflatten__(  # type: ignore[attr-defined]
            {n: getattr(orig, n) for n in names}, ctx, orig.size(), orig.stride())
        about = (f"{fqns[0]} is a quantized weight ({type(orig).__qualname__} "
                 f"{tuple(orig.shape)}) divided among {world} ranks by bytes, its rows "
                 f"and blocks not splitting into {world} equal shards "
                 f"(Note [uneven packed parameters] in engine/groups/subclass.py)")
        shard = nn.Parameter(ByteShard(orig.shape, orig.dtype, device, about),
                             requires_grad=False)
        copy_user_attributes(orig, shard, besides=fresh)
        del fresh
        gather = SubclassBytes(type(orig), c, None, list(c.names), pieces, store, offsets,
                               rank, mesh, param_dtype, dict(zip(c.names, c.shapes)), None,
                               ctx, tuple(orig.stride()))
        return span, shard, gather
    mine = torch.chunk(orig.detach(), world, dim=0)[rank]
    _, chunk_ctx = mine.__tensor_flatten__()  # type: ignore[attr-defined]
    chunk = type(mine).__tensor_unflatten__(  # type: ignore[attr-defined]
        pieces, chunk_ctx, mine.size(), mine.stride())
    with torch.no_grad():
        dt = DTensor.from_local(chunk, topology.mesh, topology.placements,
                                run_check=False, shape=orig.shape, stride=orig.stride())
    shard = nn.Parameter(dt, requires_grad=False)
    # Not the original's inner tensors: they would keep the full weight alive.
    copy_user_attributes(orig, shard, besides=mine)
    full_inner, unsaveable = _inner_split(fqns[0], orig, mine, rank, world)
    gather = SubclassBytes(type(orig), c, chunk, list(c.names), pieces, store, offsets, rank,
                           mesh, param_dtype, full_inner, unsaveable)
    return span, shard, gather


def twin_shard(span: torch.Tensor, shard: nn.Parameter, sb: SubclassBytes,
               old: torch.Tensor, new: torch.Tensor, topology: Topology
               ) -> tuple[torch.Tensor, nn.Parameter, SubclassBytes]:
    """What :func:`subclass_shard` made, for a copy of the group whose bytes ``new`` are
    a copy of ``old`` (Note [deep copy] in engine/clone.py): the same views at the same
    offsets of ``new``, a new shard around them, nothing gathered."""
    def same_place(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(*_moved(t, old, new))

    pieces = {n: same_place(t) for n, t in sb.pieces.items()}
    chunk = None
    if sb.chunk is None:  # divided by bytes: a ByteShard, no values
        twin = nn.Parameter(shard.detach(), requires_grad=False)
        copy_user_attributes(shard, twin)
    else:
        ctx = sb.chunk.__tensor_flatten__()[1]  # type: ignore[attr-defined]
        chunk = sb.kind.__tensor_unflatten__(  # type: ignore[attr-defined]
            pieces, ctx, sb.chunk.size(), sb.chunk.stride())
        with torch.no_grad():
            dt = DTensor.from_local(chunk, topology.mesh, topology.placements,
                                    run_check=False, shape=shard.shape, stride=shard.stride())
        twin = nn.Parameter(dt, requires_grad=False)
        copy_user_attributes(shard, twin, besides=sb.chunk)
    return same_place(span), twin, replace(
        sb, chunk=chunk, pieces=pieces, stored=[same_place(t) for t in sb.stored],
        allocated=[], metadata=None)


def send_bytes(params: list[Any], world: int, device: torch.device,
               layout: ShardLayout | None, sizes: list[list[tuple[torch.Size, torch.dtype]]]
               ) -> tuple[torch.Tensor, ShardLayout, list[list[tuple[torch.Size, torch.dtype]]]]:
    """What this rank's all-gather sends for subclass parameters ``params``: every input
    each one's strategy gives, as bytes, in slots of a layout made at the first gather
    (``layout`` None) and the same afterwards; with that layout and the inputs' sizes.

    Raises:
        ShardwiseError: a parameter's inputs changed sizes or dtypes since the first.
    """
    per_param = [p.gather.inputs(p) for p in params]
    now = [[(t.size(), t.dtype) for t in ts] for ts in per_param]
    if layout is None:
        sizes = now
        layout = build_layout([(world * _as_bytes(t).numel(),) for ts in per_param
                               for t in ts], world)
    elif now != sizes:
        changed = next(p.fqns[0] for p, a, b in zip(params, now, sizes) if a != b)
        raise ShardwiseError(f"{changed}: fsdp_pre_all_gather returned tensors of other "
                             f"sizes or dtypes than at its first gather")
    # Only the alignment gaps are zeroed (the bytes sent stay the same on every run): a
    # zeroed buffer would write a decoder layer's bytes twice at every gather.
    send = torch.empty(layout.shard_numel, dtype=torch.uint8, device=device)
    cursor = 0
    for s, t in zip(layout.slots, (t for ts in per_param for t in ts)):
        send[cursor:s.offset].zero_()
        send[s.offset:s.offset + s.chunk_rows].copy_(_as_bytes(t))
        cursor = s.offset + s.chunk_rows
    send[cursor:].zero_()
    return send, layout, sizes


def received(params: list[Any], layout: ShardLayout,
             sizes: list[list[tuple[torch.Size, torch.dtype]]], full: torch.Tensor
             ) -> list[tuple[torch.Tensor, ...]]:
    """Each parameter's all-gather outputs, as views of the byte buffer ``full`` (the
    gathered bytes copied out in ``layout``)."""
    slots = iter(layout.slots)
    out = []
    for p, mine in zip(params, sizes):
        views = []
        for _ in mine:
            s = next(slots)
            views.append(full[s.full_offset:s.full_offset + s.numel])
        out.append(p.gather.outputs(views, mine))
    return out


# Note [packed bytes offloaded]
# Offload(params="disk") keeps this rank's packed bytes in a file of the rank's folder
# (engine/groups/offload/disk.py), mapped: every tensor viewing the bytes (a chunk's inner
# tensors; the pieces a load writes; a byte-divided weight's slots, Note [uneven
# packed parameters]) is re-pointed at the mapping with ``set_``, so the chunks and
# the shards the modules hold stay the same objects. A gather reads them (through
# ``fsdp_pre_all_gather``, or the slots) as before, then drops
# their pages, so memory holds the bytes of the units being gathered only (the page
# cache keeps them; a later read maps them back). Frozen, they are written only by a
# checkpoint load or ``gathered(modifier_rank=)``, through the mapping. With
# ``params="cpu"`` on a CPU device they stay where they are, host memory. On a GPU the
# protocol's inputs and metadata (NF4's scaler mean, lookup table) would be host
# tensors: refused at ``sw.shard`` until they are staged on the device.
class ByteStorage(DeviceStorage):
    """Where a group of subclass parameters keeps this rank's bytes: on the device, or
    on an offload tier (Note [packed bytes offloaded]). Frozen: nothing steps, reduces
    or casts them."""

    def __init__(self, numel: int, device: torch.device) -> None:
        super().__init__(numel, torch.uint8, torch.uint8, device)
        self.tier = "device"
        self._disk: Any = None  # the DiskBuffer holding ``master``, on the disk tier

    @property
    def steps_in_place(self) -> bool:
        return False  # frozen: nothing for an optimizer to step (Note [plain step])

    def place(self, placement: Any, views: list[torch.Tensor]) -> None:
        """Move the bytes to ``placement``'s parameter tier (a ``Placement``,
        engine/groups/parts.py, such as offload's ``Tiers``), re-pointing ``views`` (every
        tensor viewing them, once each) at their new home."""
        tier = placement.params
        if tier == "device" or self.device.type != "cpu":
            return
        self.tier = tier
        if tier != "disk":
            return
        self._disk = placement.folder.buffer(self.master.numel(), torch.uint8, "quantized")
        self.on_disk = True
        mapped = self._disk.tensor
        mapped.copy_(self.master)
        # The same tensor objects, re-pointed (set_) at the mapping: the shards the
        # modules hold, the pieces a load writes, the slots a byte-divided weight sends.
        with torch.no_grad():
            for t in views:
                t.set_(*_moved(t, self.master, mapped))
        self.master = mapped
        self.release()

    def release(self) -> None:
        if self._disk is not None:
            self._disk.release()

    def prefetch(self, gather: bool = False) -> None:
        if self._disk is not None:
            self._disk.prefetch()

    def bytes_by_tier(self) -> dict[str, int]:
        return {} if self.tier == "device" else {self.tier: self.master.numel()}

    def describe(self) -> str | None:
        return None if self.tier == "device" else f"quantized bytes on {self.tier}"

    def cast_refusal(self, unit_name: str) -> str | None:
        return f"unit {unit_name} holds quantized parameters"

    def like(self) -> ByteStorage:
        """Storage for a copy of the group, in memory (``copy.deepcopy``)."""
        return ByteStorage(self.numel, self.device)


def _moved(t: torch.Tensor, old: torch.Tensor, new: torch.Tensor
           ) -> tuple[torch.UntypedStorage, int, torch.Size, tuple[int, ...]]:
    """``set_``'s arguments that make ``t``, a view of the byte buffer ``old``, view the
    same bytes of ``new`` (a byte buffer of the same size)."""
    assert _shares(t, old), "a quantized parameter's tensor outside the group's bytes"
    at = t.storage_offset() * t.element_size() - old.storage_offset() + new.storage_offset()
    assert at % t.element_size() == 0, \
        "slots are aligned (Note [alignment] in engine/groups/layout.py)"
    return new.untyped_storage(), at // t.element_size(), t.size(), t.stride()


def _shares(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def shard_mesh(topology: Topology) -> DeviceMesh:
    """The 1-D mesh of the shard group, which ``fsdp_pre_all_gather`` is given (FSDP2
    passes its shard mesh)."""
    mesh = topology.mesh
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if not names:
        raise ShardwiseError("quantized parameters on a 2-D mesh need named mesh dims "
                             "(init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))): "
                             "fsdp_pre_all_gather is given the shard dim's mesh")
    return mesh[names[-1]]
