"""Quantizing while building and loading: the ``quantize=`` rule, NF4 stand-ins, shares;
and gathered NF4 weights dequantized by pairs of codes.

Note [quantize while loading]
QLoRA exists for bases whose full-precision weights do not fit, so under
``sw.sharded_init(quantize=RULE)`` no rank ever holds them, whole or partitioned:

- Building: when an ``nn.Linear`` is registered on its parent, its weight is *deferred*: a
  meta stand-in with the full shape and dtype and no values (init code writing to it runs
  on meta, for nothing: its values come from the source). Adapters (a module path with a
  ``lora_`` part) are never deferred, nor, under the default rule, a head named
  ``lm_head``. The rule itself needs qualified names, known only once the model is
  complete: at the end of the block each deferred weight the rule picks becomes an NF4
  *placeholder*, an ``NF4Tensor`` of the full shape whose inner tensors are zero-stride
  views of one zero (no memory); one the rule leaves out becomes an ordinary partitioned
  parameter holding zeros. Both are marked *awaiting load*.
- ``sw.shard`` shards a placeholder like any NF4 weight (torch.chunk on dim 0, or by bytes
  when that is uneven: Note [uneven packed parameters] in engine/groups/subclass.py; one byte
  buffer per unit), so each rank's NF4 share is allocated once, at its final size.
- ``sw.load_pretrained`` fills the shares weight by weight, in rounds of N: in a round,
  rank r reads the r-th weight whole, quantizes it as ``quantize_nf4`` would and scatters
  each rank its share's bytes. So a rank holds one weight in full precision at a time, the
  quantization work is split N ways, and each byte equals what quantizing the whole model
  then sharding gives (the same ``to_nf4`` on the same values, then the same share).

Note [the base awaits loading]
A model built under ``sharded_init(quantize=)`` is a pretrained base whose values come
from ``load_pretrained``: at the end of the block *every* parameter it has is marked
awaiting load, not only the deferred linear weights. The others (embeddings, norms, a
head the rule keeps) hold ``src_rank``'s random init, which would train as silently as
zeros. PEFT adapters (a module path with a ``lora_`` part) are not marked, nor is
anything added after the block (adapters from ``get_peft_model``): those are what the
source does not hold. So:

- ``load_pretrained`` refuses, before changing anything, a load that leaves a base
  parameter unloaded, even under ``strict=False`` (which forgives only the rest): the
  usual cause is a ``rename=`` that misses some names, and the error names them and the
  source keys nothing took. One source must hold the whole base.
- A model with parameters awaiting load refuses to run forward, naming them (it was
  never loaded, or a load failed part-way).
- ``load_pretrained`` marks the quantized weights it loads awaiting load from its first
  round of quantizing, each until its round is written, in any sharded model (one made
  with ``quantize_nf4`` too), and what it wrote before as loaded: a load that stops
  part-way, on a file that fails to read or a weight holding NaN or inf (Note
  [non-finite values refused] in checkpoint/pretrained.py), leaves a model that
  refuses to run naming the weights not loaded, not one mixing old and new weights.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, SupportsIndex

import torch
import torch.nn as nn
import torch.nn.modules.module as torch_module

from ..._log import quiet_imports
from ..._registry import is_sharded_root
from ...errors import ShardwiseError

Rule = Callable[[str, nn.Module], bool]


def nf4_module() -> Any:
    """torchao's NF4 module (``to_nf4``, ``NF4Tensor``), imported without its CUDA noise.

    Raises:
        ShardwiseError: torchao is not installed.

    Example:
        >>> to_nf4 = nf4_module().to_nf4
    """
    try:
        with quiet_imports():
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ShardwiseError("quantized bases need torchao: pip install 'shardwise[quant]' "
                             "(after torch, as the README says)") from err
    return nf4_tensor


# Note [NF4 dequantized by pairs]
# A QLoRA step spends most of its time turning NF4 codes back into numbers, not in its
# matmuls: torchao's NF4Tensor dequantizes each weight for every linear's forward and
# again for its backward (as bitsandbytes does), splitting each byte into two nibbles,
# indexing its 16-entry table once per nibble and interleaving the halves with a stack;
# on one core, 200-280 ms for a 5632 x 2048 weight, against 3-9 ms for the matmul of 64
# tokens with it (the profile: BENCHMARKS.md, "QLoRA's step against bitsandbytes").
# Two bytes hold four consecutive elements, so a table of 65536 rows of four values
# (row c: the values of the nibbles of c's low byte, then of its high byte, as the codes
# are stored little-endian) decodes them in one embedding lookup that writes the values
# already interleaved; each block is then scaled by its dequantized scaler, the same
# product of the same two numbers torchao takes, so every bit is torchao's
# (tests/test_quantized.py compares them): 18-25 ms for that weight. In bf16 or fp16 a
# row of four values is one 8-byte word, and the table is read as 65536 words: torch's
# index_select of words is 3-5x faster on CPU than the embedding's copy of 4-value rows
# (for the codes of that weight on one core, 3.3 against 15.6 ms with nothing else
# running, 2.3 against 7.3 under load), the same bits; about 7 ms for the weight in all,
# its scales included.
#
# The full weight a unit's gather builds (``SubclassBytes.after_gather`` in
# engine/groups/subclass.py, once per group, refilled in place after) becomes an instance
# of ``NF4ByPairs``, a subclass of torchao's ``NF4Tensor`` whose ``get_original_weight``
# (which torchao's linear and its ``to(dtype)`` call) is this: only weights shardwise
# gathers, nothing global; ``isinstance(w, NF4Tensor)`` holds, whatever torchao's ops
# make from it is torchao's own type, and it pickles as one. Inside ``sw.gathered()``,
# and kept past its end, the weight is torchao's type itself, as FSDP2 gives it: the
# block's code sees nothing of this (its forward dequantizes as torchao does). Not a
# method set on the instance: that would hold the tensor in a cycle with itself (freed
# only by Python's collector, so a ``gathered()`` block's bytes would outlive it) and
# follow it into copies. A weight whose layout is not the one this knows (an odd block,
# codes not one byte per pair, a table of another dtype than the weight's, a big-endian
# machine) keeps torchao's own.
_TABLES: dict[tuple, torch.Tensor] = {}


def _quads(table: torch.Tensor) -> torch.Tensor:
    """The 65536 x 4 table of the values of every two bytes of codes. Cached by the 16
    values' bits on the host (NF4's are the same for every weight; by bits, for -0.0 is
    not 0.0 and a NaN equals nothing); on an accelerator made anew at each call, for
    reading the values there would stall the host until the device caught up, at every
    dequantization, and making it is a few small kernels."""
    if table.device.type != "cpu":
        return _make_quads(table)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[table.element_size()]
    key = (table.dtype, tuple(table.contiguous().view(bits).tolist()))
    if key not in _TABLES:
        _TABLES[key] = _make_quads(table)
    return _TABLES[key]


def _make_quads(table: torch.Tensor) -> torch.Tensor:
    byte = torch.arange(256, device=table.device)
    pairs = torch.stack([table[byte >> 4], table[byte & 0b1111]], dim=-1)
    two = torch.arange(65536, device=table.device)
    return torch.cat([pairs[two & 0xFF], pairs[two >> 8]], dim=-1).contiguous()


def dequantize_by_pairs(t: Any) -> torch.Tensor:
    """The values of NF4 weight ``t`` (torchao's ``NF4Tensor``), as
    ``t.get_original_weight()`` gives them, bit for bit (Note [NF4 dequantized by
    pairs]).

    Example:
        >>> torch.equal(dequantize_by_pairs(w), type(w).get_original_weight(w))
        True
    """
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor,
                                   t.scaler_block_size)
    pairs = t.quantized_data.view(-1).view(torch.uint16)
    quads = _quads(t.nf4)
    if quads.element_size() != 2:
        values = torch.nn.functional.embedding(pairs.to(torch.int32), quads)
    elif pairs.device.type != "cpu":  # a row is one 8-byte word: gathered as words
        values = quads.view(torch.int64).view(-1).index_select(0, pairs.to(torch.int32))
    else:
        # The codes widened to int32 (index_select's index type) a slice at a time: the
        # allocator reuses a slice's memory, where one int32 copy of them all would be
        # mapped fresh and faulted in at each call under a bounded heap (Note [a fixed
        # mmap threshold] in engine/groups/alloc.py): a quarter of the lookup's time.
        words = quads.view(torch.int64).view(-1)
        values = torch.empty(pairs.numel(), dtype=torch.int64, device=pairs.device)
        for i in range(0, pairs.numel(), _PAIRS_PER_SLICE):
            torch.index_select(words, 0, pairs[i:i + _PAIRS_PER_SLICE].to(torch.int32),
                               out=values[i:i + _PAIRS_PER_SLICE])
    return values.view(quads.dtype).view(-1, t.block_size).mul_(
        scalers.unsqueeze(-1)).view(t.shape)


# 128 KiB of int32 codes a slice, below the bounded heap's 1 MiB mapping threshold; a
# 5632 x 2048 weight's lookup took 15.1 ms by slices of 32768 pairs against 19.7 ms at
# once, under that threshold, one core (16.5 ms by slices of 131072).
_PAIRS_PER_SLICE = 1 << 15


_BY_PAIRS: dict[type, type] = {}


def _by_pairs(base: type) -> type:
    """``base`` (torchao's ``NF4Tensor``) with :func:`dequantize_by_pairs` as its
    ``get_original_weight``; pickled as ``base`` itself."""
    cls = _BY_PAIRS.get(base)
    if cls is None:
        def reduce_ex(self: Any, protocol: SupportsIndex) -> Any:
            self.__class__ = base
            try:
                return torch.Tensor.__reduce_ex__(self, protocol)  # as ``base``
            finally:
                self.__class__ = cls

        def unflatten(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
            # torch.compile rebuilds subclasses through this and checks their type
            t = base.__tensor_unflatten__(inner, meta, size, stride)  # type: ignore[attr-defined]
            t.__class__ = cls
            return t

        cls = type("NF4ByPairs", (base,), {
            "__module__": __name__, "__reduce_ex__": reduce_ex,
            "__doc__": "A gathered NF4 weight (Note [NF4 dequantized by pairs]).",
            "__tensor_unflatten__": staticmethod(unflatten),
            "get_original_weight": dequantize_by_pairs})
        _BY_PAIRS[base] = cls
    return cls


def decode_by_pairs(t: torch.Tensor) -> None:
    """Make gathered weight ``t`` dequantize by pairs (Note [NF4 dequantized by pairs])
    when it is an ``NF4Tensor`` of the layout that knows; anything else is left as is."""
    if type(t).__name__ != "NF4Tensor" or sys.byteorder != "little" or not all(
            hasattr(t, a) for a in ("nf4", "quantized_data", "quantized_scalers",
                                    "quantization_factor", "scaler_block_size", "block_size")):
        return
    data = t.quantized_data  # type: ignore[attr-defined]
    block = t.block_size  # type: ignore[attr-defined]
    table = t.nf4  # type: ignore[attr-defined]
    # The table in the weight's dtype: the product is then taken in it, as torchao's is.
    if (data.dtype != torch.uint8 or data.numel() * 2 != t.numel() or block % 4
            or t.numel() % block or table.numel() != 16 or table.dtype != t.dtype):
        return
    t.__class__ = _by_pairs(type(t))


def as_torchaos(t: torch.Tensor) -> None:
    """Give gathered weight ``t`` torchao's own type back (a ``gathered()`` block shows
    users what FSDP2 would: Note [NF4 dequantized by pairs])."""
    if type(t) in _BY_PAIRS.values():
        t.__class__ = type(t).__bases__[0]


def is_adapter(path: str) -> bool:
    """Whether a module path names a PEFT adapter (``...q_proj.lora_A.default``)."""
    return any(part.startswith("lora_") for part in path.split("."))


def default_choice(name: str, mod: nn.Module) -> bool:
    """``quantize="nf4"``: every ``nn.Linear`` but adapters and heads named ``lm_head``."""
    return (isinstance(mod, nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"
            and not is_adapter(name))


@dataclass(frozen=True)
class NF4:
    """Which linear layers to quantize to NF4, and how (``sw.sharded_init(quantize=)``).

    Args:
        where: ``(qualified_name, module) -> bool``; default: every ``nn.Linear`` except
            PEFT adapters and heads named ``lm_head``. Names are relative to the outermost
            module built in the block (``model.layers.0.self_attn.q_proj``).
        block_size: elements per NF4 block (one scale each).
        scaler_block_size: blocks per block of the double-quantized scales.

    Example:
        >>> with sw.sharded_init(quantize=NF4(block_size=32, scaler_block_size=8)):
        ...     model = LlamaForCausalLM(config)
    """

    where: Rule | None = None
    block_size: int = 64
    scaler_block_size: int = 256

    def chooses(self, name: str, mod: nn.Module) -> bool:
        """Whether the weight of ``mod`` (qualified ``name`` in the block's module) is
        quantized: the user's ``where`` rule, else :func:`default_choice`."""
        return bool(self.where(name, mod)) if self.where is not None \
            else default_choice(name, mod)

    def defers(self, path: str, mod: nn.Module) -> bool:
        """Whether a weight is left without values when its module is registered (the
        rule is applied at the end of the block, with qualified names)."""
        if not isinstance(mod, nn.Linear) or is_adapter(path):
            return False
        return self.where is not None or path.rsplit(".", 1)[-1] != "lm_head"

    def check(self, name: str, shape: torch.Size) -> None:
        """Refuse, naming the weight, a shape NF4 cannot hold in whole blocks."""
        per = self.block_size * self.scaler_block_size
        if len(shape) != 2 or shape.numel() % per:
            raise ShardwiseError(
                f"{name} ({list(shape)}, {shape.numel()} elements) cannot be quantized to "
                f"NF4 with block_size={self.block_size} and scaler_block_size="
                f"{self.scaler_block_size}: NF4 takes 2-D weights whose size is a multiple "
                f"of block_size * scaler_block_size = {per}. Pass quantize=NF4(...) with "
                f"smaller blocks, or a where= rule that leaves it out")

    def placeholder(self, shape: torch.Size, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
        """An ``NF4Tensor`` of ``shape`` holding zeros, in no memory (zero-stride inner
        tensors); ``sw.shard`` allocates each rank's share, ``load_pretrained`` fills it."""
        mod = nf4_module()
        n = shape.numel()
        blocks = n // self.block_size

        def zeros(count: int, dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(1, dtype=dt, device=device).expand(count)

        lut = mod.to_nf4(torch.zeros(self.block_size * self.scaler_block_size, dtype=dtype,
                                     device=device),
                         self.block_size, self.scaler_block_size).nf4
        meta = mod.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, dtype, device,
                                      False)
        return mod.NF4Tensor(meta, self.block_size, blocks, self.scaler_block_size,
                             zeros(blocks, torch.int8),
                             zeros(blocks // self.scaler_block_size, dtype),
                             torch.zeros((), dtype=dtype, device=device),
                             zeros(n // 2, torch.uint8), lut)

    def quantize(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` as an ``NF4Tensor``, exactly as ``quantize_nf4`` makes it."""
        return nf4_module().to_nf4(full, self.block_size, self.scaler_block_size)


def resolve(quantize: object) -> NF4 | None:
    """The rule ``sw.sharded_init(quantize=)`` was given, checked.

    Raises:
        ShardwiseError: anything but ``None``, ``"nf4"``, a callable or an :class:`NF4`.
    """
    if quantize is None:
        return None
    if isinstance(quantize, NF4):
        rule = quantize
    elif isinstance(quantize, str):
        if quantize.lower() != "nf4":
            raise ShardwiseError(f"sw.sharded_init(quantize={quantize!r}): unknown "
                                 f"quantization; the one supported is 'nf4' (or a callable "
                                 f"(name, module) -> bool choosing the layers, or NF4(...))")
        rule = NF4()
    elif callable(quantize):
        rule = NF4(where=quantize)
    else:
        raise ShardwiseError(f"sw.sharded_init(quantize=...) takes 'nf4', a callable "
                             f"(name, module) -> bool or NF4(...), not a "
                             f"{type(quantize).__name__}")
    for what, v in (("block_size", rule.block_size),
                    ("scaler_block_size", rule.scaler_block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ShardwiseError(f"NF4({what}={v!r}): must be a positive int")
    nf4_module()  # fail now, not at the end of the block, when torchao is missing
    return rule


# -- weights awaiting load (Note [quantize while loading]) ------------------------------
_AWAITING: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def mark_awaiting(mod: nn.Module, attr: str) -> None:
    """Record that ``mod.<attr>`` is a parameter of a quantized base still to be loaded
    (a forward is refused, naming it, until :func:`mark_loaded`: Note [the base awaits
    loading])."""
    _AWAITING.setdefault(mod, set()).add(attr)


def awaiting(root: nn.Module) -> list[str]:
    """Qualified names of the parameters under ``root`` still awaiting
    ``load_pretrained``."""
    return [f"{name}.{attr}" if name else attr for name, mod in root.named_modules()
            for attr in sorted(_AWAITING.get(mod, ()))]


def mark_loaded(root: nn.Module, names: set[str]) -> None:
    """The weights of ``root`` named ``names`` now hold loaded values."""
    for name, mod in root.named_modules():
        attrs = _AWAITING.get(mod)
        if attrs:
            attrs -= {a for a in attrs if (f"{name}.{a}" if name else a) in names}
            if not attrs:
                del _AWAITING[mod]


_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_guard_handle: Any = None


def guard_forward(root: nn.Module) -> None:
    """Make ``root``, and any sharded model holding it, refuse to run forward while any
    of its weights awaits loading.

    A global forward pre-hook: those run before a module's own hooks, so the refusal
    comes before shardwise's root hook starts gathering (an error inside a forward
    would leave the units gathered). It removes itself once nothing awaits loading.
    """
    global _guard_handle
    _GUARDED.add(root)
    if _guard_handle is None:
        _guard_handle = torch_module.register_module_forward_pre_hook(_refuse_unloaded)


def _refuse_unloaded(module: nn.Module, args: Any) -> None:
    global _guard_handle
    if not _AWAITING:
        if _guard_handle is not None:
            _guard_handle.remove()
            _guard_handle = None
        return
    if module not in _GUARDED and not is_sharded_root(module):
        return
    names = awaiting(module)
    if names:
        raise ShardwiseError(
            f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''} ({len(names)} "
            f"parameters) were built under sw.sharded_init(quantize=...), or are "
            f"quantized weights an sw.load_pretrained that failed left part-loaded, and "
            f"have not been loaded: sw.load_pretrained(model, source), after sw.shard, "
            f"gives them their values, and the model does not run until such a load has "
            f"completed (docs/qlora.md)")
