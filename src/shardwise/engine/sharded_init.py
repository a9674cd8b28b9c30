"""``sharded_init()``: build a model too big for one rank, partitioned as it is built.

Note [partition at registration]
A module is complete when it is registered on its parent (``self.block = Block()``, or an
entry added to an ``nn.ModuleList``): its ``__init__`` has returned. At that moment a
registration hook (torch's, removable) replaces each of its parameters by a *partitioned
parameter*: an ``nn.Parameter`` on the meta device with the full shape and dtype (so shape
arithmetic in later init code works, at no memory cost), whose values live as this rank's
padded piece, kept in the registry (``_registry.init_piece``). The pieces are scattered from
``src_rank``'s freshly constructed tensor, so values never depend on other ranks' RNG.

Note [init after registration]
Init code often touches parameters after their module was registered (``self.apply(
init_weights)``, ``nn.init.zeros_(self.proj.bias)``, ``w.data.normal_()``). While the block
is open, a torch function mode (thread-local) sees every torch call: a call involving a
partitioned parameter runs on the real full tensor, all-gathered from the pieces, and if
the call wrote to it, ``src_rank``'s result is scattered back into the pieces. ``.data``
hands out such a full tensor and the write-back happens at the next event (another
partitioned parameter touched, a module registered, the block left), so at most one full
parameter exists at a time. Shape, dtype and device queries are answered without any
communication. Every rank runs the same init code (SPMD), so every rank issues the same
collectives; only ``src_rank``'s random numbers end up in the model.

Note [scope]
The registration hooks are process-wide in torch, so each hook acts only when its block
is the innermost ``sharded_init`` on the *calling thread*, which it learns from torch's
thread-local function-mode stack: a model built in another thread, or after the block,
is never touched. Nested blocks: the innermost block wins (its group and ``src_rank``).
Leaving the block, normally or by an exception, removes the hooks and the mode.

With ``quantize=``, linear weights are deferred rather than partitioned: Note [quantize
while loading] in engine/groups/quantize.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.modules.module as torch_module
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._args import require_group, require_rank
from .._registry import (
    INIT,
    attach_to,
    attached,
    copy_all_attributes,
    detach_from,
    partitioned_as,
    set_partitioned_as,
)
from ..comm.collectives import Comm
from ..errors import ShardwiseError
from .groups.alloc import bound_heap, freed
from .groups.layout import ShardLayout, build_layout
from .groups.quantize import NF4, guard_forward, mark_awaiting, resolve
from .groups.quantize import is_adapter as is_adapter_path
from .iteration.unit import sharded_param

_METADATA = {"shape", "dtype", "ndim", "requires_grad", "is_leaf", "grad_fn",
             "size", "dim", "numel", "is_floating_point", "is_complex", "element_size",
             "nelement", "__len__", "__hash__", "__eq__", "__repr__", "__format__",
             "requires_grad_"}


@dataclass
class InitPiece:
    """This rank's piece of a parameter partitioned by :func:`sharded_init`."""

    piece: torch.Tensor  # padded, this rank's chunk of the flattened parameter
    layout: ShardLayout
    comm: Comm
    src_rank: int
    home: torch.device  # where the parameter was built; full values are materialised there

    def gather_full(self, shape: torch.Size) -> torch.Tensor:
        """The full parameter on every rank, on its home device (a collective).

        Init code then runs where it would have run unpartitioned: on the CPU it draws from
        the CPU generator, as the unpartitioned build does, even when NCCL moves the pieces.
        """
        flat = torch.empty(self.layout.gathered_numel, dtype=self.piece.dtype,
                           device=self.piece.device)
        self.comm.all_gather(flat, self.piece)
        return flat[:self.layout.slots[0].numel].view(shape).to(self.home)

    def store(self, full: torch.Tensor) -> None:
        """Take ``src_rank``'s ``full`` as the parameter's new value (a scatter)."""
        chunks = None
        if self.comm.rank == self.src_rank:
            flat = full.detach().reshape(-1).to(self.piece.device, self.piece.dtype)
            chunks = _padded_chunks(flat, self.layout.shard_numel, self.comm.world_size)
        with torch.no_grad():
            self.comm.scatter(self.piece, chunks, self.src_rank)

    @classmethod
    def zeros(cls, numel: int, dtype: torch.dtype, comm: Comm, src_rank: int,
              home: torch.device) -> InitPiece:
        """A parameter of ``numel`` zeros, partitioned without ever being whole."""
        layout = build_layout([(numel,)], comm.world_size, align=1)
        device = comm.device if comm.device.type == "cuda" else home
        return cls(torch.zeros(layout.shard_numel, dtype=dtype, device=device), layout,
                   comm, src_rank, home)


def _padded_chunks(flat: torch.Tensor, size: int, n: int) -> list[torch.Tensor]:
    """``flat`` cut into ``n`` chunks of ``size`` elements: views of it, but for the
    chunks that run past its end, padded with zeros (a copy of at most one chunk each).
    The full value on ``src_rank`` is never copied whole: Note [partition at
    registration] promises one full parameter at a time."""
    out = []
    for i in range(n):
        lo, hi = min(i * size, flat.numel()), min((i + 1) * size, flat.numel())
        if hi - lo == size:
            out.append(flat[lo:hi])
        else:
            padded = torch.zeros(size, dtype=flat.dtype, device=flat.device)
            padded[:hi - lo].copy_(flat[lo:hi])
            out.append(padded)
    return out


def _func_name(func) -> str:
    """``shape`` for ``Tensor.shape.__get__``, else the function's own name."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__") and owner is not None:
        return getattr(owner, "__name__", name)
    return name


def full_value(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value on every rank: gathered if partitioned, else itself."""
    info = init_piece(p)
    return info.gather_full(p.shape) if info is not None else p.detach()


class _InitMode(TorchFunctionMode):
    def __init__(self, ctx: _ShardedInit) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.ctx.call(func, args, kwargs or {})


class _ShardedInit:
    """One open ``sharded_init`` block: its hooks, its mode and its pending write-back."""

    def __init__(self, comm: Comm, src_rank: int, quantize: NF4 | None = None) -> None:
        self.comm = comm
        self.src_rank = src_rank
        self.quantize = quantize
        self.mode = _InitMode(self)
        self._pending: tuple[nn.Parameter, torch.Tensor] | None = None
        self.partitioned: list[tuple[nn.Module, str]] = []  # every slot given a stand-in
        # quantize=: where each module was registered (its path while building), and the
        # weights left without values (Note [quantize while loading] in quantize.py).
        self.registered: dict[int, tuple[nn.Module, str]] = {}
        self.deferred: list[tuple[nn.Module, str, nn.Parameter, torch.device]] = []

    # -- scope -----------------------------------------------------------------------
    def innermost_here(self) -> bool:
        modes = [m for m in _get_current_function_mode_stack() if isinstance(m, _InitMode)]
        return bool(modes) and modes[-1] is self.mode

    # -- partitioning ----------------------------------------------------------------
    def partition(self, p: nn.Parameter) -> torch.Tensor:
        """A partitioned stand-in for ``p``, holding ``src_rank``'s values."""
        if init_piece(p) is not None or sharded_param(p) is not None:
            return p
        twin = partitioned_as(p)
        if twin is not None:
            return twin
        layout = build_layout([(p.numel(),)], self.comm.world_size, align=1)
        device = self.comm.device if self.comm.device.type == "cuda" else p.device
        piece = torch.empty(layout.shard_numel, dtype=p.dtype, device=device)
        info = InitPiece(piece, layout, self.comm, self.src_rank, p.device)
        info.store(p.detach())
        meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                            requires_grad=p.requires_grad)
        copy_all_attributes(p, meta)
        set_init_piece(meta, info)
        # A parent that still holds the original (a weight shared into a submodule) is
        # pointed at the stand-in by shard(). The original's values are released now,
        # not whenever the garbage collector gets to it: the whole model must never sit
        # in memory, and measuring showed a third more peak memory without this.
        set_partitioned_as(p, meta)
        released = p.numel() * p.element_size() if p.device.type == "cpu" else 0
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        freed(released)  # Note [freed memory] in engine/groups/alloc.py
        return meta

    def on_module_registered(self, parent: nn.Module, name: str, child: nn.Module):
        if child is None or not self.innermost_here():
            return None
        self.flush()
        base = ""
        if self.quantize is not None:
            self.registered[id(child)] = (parent, name)
            base = self.path_of(child)
        for sub, mod in child.named_modules():
            for pname, p in list(mod._parameters.items()):
                if p is None or _is_deferred(p):
                    continue
                if self.quantize is not None and pname == "weight" and \
                        self.quantize.defers(f"{base}.{sub}" if sub else base, mod):
                    mod._parameters[pname] = self.defer(mod, pname, p)
                    continue
                mod._parameters[pname] = self.partition(p)
                self.partitioned.append((mod, pname))
        return None

    # -- quantize= (Note [quantize while loading] in engine/groups/quantize.py) -----------------
    def path_of(self, mod: nn.Module) -> str:
        """``mod``'s path from the outermost module it is registered under so far."""
        parts = []
        while id(mod) in self.registered:
            mod, name = self.registered[id(mod)]
            parts.append(name)
        return ".".join(reversed(parts))

    def defer(self, mod: nn.Module, pname: str, p: nn.Parameter) -> nn.Parameter:
        """A meta stand-in for ``p``, without values: they come from the source."""
        meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                            requires_grad=p.requires_grad)
        attach_to(meta, _DEFERRED, True)
        self.deferred.append((mod, pname, meta, p.device))
        released = p.numel() * p.element_size() if p.device.type == "cpu" else 0
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        freed(released)  # Note [freed memory] in engine/groups/alloc.py
        return meta

    def finish_quantize(self) -> None:
        """Apply the rule, by qualified name, to the deferred weights: NF4 placeholders
        for those it picks, zeros partitioned as usual for the others. Every parameter
        of the model but adapters then awaits ``load_pretrained``, and the model refuses
        to run forward until then."""
        rule = self.quantize
        if rule is None:
            return
        children = set(self.registered)
        roots = {id(p): p for p, _ in self.registered.values() if id(p) not in children}
        names: dict[int, str] = {}
        deferred = {id(mod) for mod, _, _, _ in self.deferred}
        for root in roots.values():
            for name, mod in root.named_modules():
                names.setdefault(id(mod), name)
                w = mod._parameters.get("weight")
                if w is None or id(mod) in deferred or not rule.chooses(name, mod):
                    continue
                if isinstance(mod, nn.Linear):  # not deferred: an adapter, or lm_head
                    why = ("a PEFT adapter: adapters are trained, not quantized"
                           if is_adapter_path(name) else
                           "whose weight was kept when it was registered (lm_head under "
                           "the default rule)")
                    raise ShardwiseError(f"the quantize rule chose {name}, {why}; make "
                                         f"the rule return False for it")
                raise ShardwiseError(
                    f"the quantize rule chose {name} ({type(mod).__name__}, weight "
                    f"{list(w.shape)}): only nn.Linear weights (2-D) are quantized to NF4; "
                    f"make the rule return False for it")
        for mod, pname, meta, home in self.deferred:
            name = names.get(id(mod), type(mod).__name__)
            if mod._parameters.get(pname) is not meta:
                raise ShardwiseError(
                    f"{name}.{pname} was deferred by sw.sharded_init(quantize=...) and then "
                    f"replaced inside the block; Hugging Face from_pretrained loads this way. "
                    f"Build the model from its config inside the block, then sw.shard it "
                    f"and sw.load_pretrained(model, folder)")
            if rule.chooses(name, mod):
                rule.check(f"{name}.{pname}", meta.shape)
                mod._parameters[pname] = nn.Parameter(
                    rule.placeholder(meta.shape, meta.dtype, home), requires_grad=False)
            else:
                # Zeros awaiting the source, partitioned without a whole tensor: the
                # head this is under the default rule is as large as the embeddings.
                stand_in = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype,
                                                    device="meta"),
                                        requires_grad=meta.requires_grad)
                set_init_piece(stand_in, InitPiece.zeros(meta.numel(), meta.dtype,
                                                         self.comm, self.src_rank, home))
                mod._parameters[pname] = stand_in
                self.partitioned.append((mod, pname))
        # Every parameter of the base awaits loading, not only the deferred ones: the
        # embeddings, norms and head hold src_rank's random init, which would train
        # silently (Note [the base awaits loading] in engine/groups/quantize.py).
        for root in roots.values():
            for name, mod in root.named_modules():
                if is_adapter_path(name):
                    continue
                for pname, p in mod._parameters.items():
                    if p is not None:
                        mark_awaiting(mod, pname)
            guard_forward(root)

    def check_not_replaced(self) -> None:
        """Raise if partitioned parameters were later replaced by whole tensors.

        Hugging Face ``from_pretrained`` builds the model and then assigns the loaded
        tensors, so under ``sharded_init`` it would leave the whole model on every rank.
        """
        replaced = sorted({f"{type(m).__name__}.{n}" for m, n in self.partitioned
                           if (p := m._parameters.get(n)) is not None
                           and init_piece(p) is None and sharded_param(p) is None})
        if replaced:
            raise ShardwiseError(
                f"parameters partitioned by sw.sharded_init were replaced by whole tensors "
                f"inside the block ({', '.join(replaced[:3])}"
                f"{', ...' if len(replaced) > 3 else ''}), so every rank now holds them "
                f"whole. Hugging Face from_pretrained loads this way. To load a model "
                f"bigger than one rank, build it from its config and load into the shards: "
                f"with sw.sharded_init(): model = AutoModelForCausalLM.from_config(config); "
                f"then model = sw.shard(model); sw.load_pretrained(model, folder)")

    # -- init code touching partitioned parameters -------------------------------------
    def flush(self) -> None:
        if self._pending is not None:
            param, full = self._pending
            self._pending = None
            info = init_piece(param)
            assert info is not None, "only partitioned parameters are pending"
            info.store(full)

    def call(self, func, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        hits = [i for i, a in enumerate(flat)
                if isinstance(a, torch.Tensor) and init_piece(a) is not None]
        if not hits:
            return func(*args, **kwargs)
        name = _func_name(func)
        if name in _METADATA:
            return func(*args, **kwargs)  # the meta stand-in has the full metadata
        home = init_piece(flat[hits[0]]).home
        if name == "device":
            return home
        if name in ("is_meta", "is_cpu", "is_cuda"):
            # As the unpartitioned tensor would answer: nn.init.trunc_normal_ and others
            # return early on meta tensors, which would silently skip the init.
            return home.type == name[3:]
        self.flush()
        if name == "data" and getattr(func, "__name__", "") == "__set__":
            self.repartition(flat[0], flat[1])  # param.data = value (Module.to(dtype), ...)
            return None
        fulls: dict[int, tuple[nn.Parameter, torch.Tensor, int]] = {}
        for i in hits:
            p = flat[i]
            if id(p) not in fulls:
                full = init_piece(p).gather_full(p.shape)
                fulls[id(p)] = (p, full, full._version)
            flat[i] = fulls[id(p)][1]
        if name == "data":
            p, full, _ = next(iter(fulls.values()))
            self._pending = (p, full)  # written back at the next event
            return full
        a, k = tree_unflatten(flat, spec)
        out = func(*a, **k)
        for p, full, version in fulls.values():
            if full._version != version:
                init_piece(p).store(full)
        back = {id(full): p for p, full, _ in fulls.values()}
        if isinstance(out, torch.Tensor) and id(out) in back:
            return back[id(out)]
        # A view of a full value (``w[:, 0]``, ``w.t()``) may be written to later: keep
        # that parameter pending, written back at the next event like ``.data``.
        storages = {full.untyped_storage().data_ptr(): p for p, full, _ in fulls.values()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in storages:
                param = storages[t.untyped_storage().data_ptr()]
                self._pending = (param, fulls[id(param)][1])
                break
        return out

    def repartition(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """``p.data = value`` for a partitioned ``p``: partition ``value`` (src_rank's)."""
        old = init_piece(p)
        assert old is not None, "only partitioned parameters are repartitioned"
        if value is p or init_piece(value) is old:
            # A cast that changes nothing (``.to(torch.float32)`` of a float32 module)
            # gives the parameter itself back: there is nothing to repartition.
            return
        value = value.detach()
        layout = build_layout([(value.numel(),)], self.comm.world_size, align=1)
        piece = torch.empty(layout.shard_numel, dtype=value.dtype, device=old.piece.device)
        info = InitPiece(piece, layout, self.comm, self.src_rank, value.device)
        info.store(value)
        p.data = torch.empty(value.shape, dtype=value.dtype, device="meta")
        set_init_piece(p, info)


@contextlib.contextmanager
def sharded_init(group: dist.ProcessGroup | None = None, src_rank: int = 0,
                 quantize: str | Callable[[str, nn.Module], bool] | NF4 | None = None,
                 ) -> Iterator[None]:
    """Partition modules as they are built, so no rank ever holds the whole model.

    Inside the block, each submodule is partitioned when it is registered on its parent
    (its ``__init__`` is done): every rank keeps 1/N of each parameter, with
    ``src_rank``'s values. Parameters of the outermost module itself stay whole until
    :func:`shardwise.shard`, which then chooses the units without a full-model copy.
    Buffers stay whole and are made ``src_rank``'s by ``shard``. Init code may keep
    touching parameters after registration (``apply(init_weights)``, ``.data.normal_()``);
    see Note [init after registration]. The result equals building on ``src_rank`` and
    calling ``sw.shard``.

    With ``quantize``, the linear layers it picks get a 4-bit NF4 base with no rank ever
    holding their full-precision weights: they hold no values until
    ``sw.load_pretrained(model, source)`` (after ``sw.shard``) reads, quantizes and
    shares them out weight by weight. Linear weights the rule leaves out (the head) are
    loaded the same way; other parameters (norms, embeddings) are partitioned as usual.
    Every parameter built in the block but LoRA adapters must then come from the
    source, even under ``strict=False``, and the model refuses to run forward until
    loaded (Note [quantize while loading] and Note [the base awaits loading] in
    engine/groups/quantize.py).

    Scope: only modules built by this thread inside the block are affected; nested blocks
    use the innermost block's group and ``src_rank``; torch's hook registries are left as
    they were on exit, exception or not (Note [scope]).

    Args:
        group: process group to partition over (default: the world).
        src_rank: rank (in ``group``) whose construction is kept.
        quantize: ``"nf4"`` (every ``nn.Linear`` but adapters and ``lm_head``), a callable
            ``(qualified_name, module) -> bool`` choosing the layers, or
            ``shardwise.integrations.quant.NF4(where=..., block_size=...,
            scaler_block_size=...)``; ``None``: no quantization.

    Raises:
        ShardwiseError: when torch.distributed is not initialised, ``src_rank`` is out
            of range, ``quantize`` is not one of the above (or torchao is missing), or, at
            the end of the block, the rule picks a weight NF4 cannot hold (not an
            ``nn.Linear``, an adapter, a size not in whole blocks), naming it.

    Example:
        >>> with sw.sharded_init():
        ...     model = GPT(big_config)        # each block is partitioned as it is built
        >>> model = sw.shard(model)
    """
    if not dist.is_initialized():
        raise ShardwiseError("sharded_init needs torch.distributed: call sw.init_distributed()")
    require_rank(src_rank, "sw.sharded_init")
    require_group(group, "sw.sharded_init")
    comm = Comm(group)
    if not 0 <= src_rank < comm.world_size:
        raise ShardwiseError(f"src_rank={src_rank} is not a rank of a group of "
                             f"{comm.world_size}")
    rule = resolve(quantize)
    if rule is not None:
        # A model loaded quantized promises a peak that does not grow with its depth, as
        # an offloaded one does: Note [a fixed mmap threshold] in engine/groups/alloc.py.
        bound_heap()
    ctx = _ShardedInit(comm, src_rank, rule)
    handle = torch_module.register_module_module_registration_hook(ctx.on_module_registered)
    ok = False
    try:
        with ctx.mode:
            yield
            ok = True
    finally:
        handle.remove()
        if ok:
            ctx.flush()
    ctx.finish_quantize()
    ctx.check_not_replaced()


# Deferred stand-ins (quantize=) are never partitioned, whatever registers them again.
_DEFERRED = "_shardwise_deferred"


def _is_deferred(p: torch.Tensor) -> bool:
    return bool(attached(p, _DEFERRED))


def init_piece(t: torch.Tensor) -> InitPiece | None:
    """This rank's piece of a parameter partitioned by ``sharded_init``, or ``None``."""
    return attached(t, INIT)


def set_init_piece(t: torch.Tensor, info: InitPiece) -> None:
    attach_to(t, INIT, info)


def clear_init_piece(t: torch.Tensor) -> None:
    detach_from(t, INIT)
