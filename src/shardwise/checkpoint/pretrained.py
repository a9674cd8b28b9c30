"""``load_pretrained``: full weights into a sharded or unsharded module, every rank right."""

from __future__ import annotations

import functools
import math
import warnings
from collections import Counter

import torch
import torch.nn as nn

from .._args import require_bool
from ..comm.agree import agree, agreed
from ..comm.order_check import operation
from ..consistency import maybe_check
from ..engine.groups.alloc import freed
from ..engine.groups.flat import gathers_bytes
from ..engine.groups.quantize import (
    NF4,
    awaiting,
    guard_forward,
    mark_awaiting,
    mark_loaded,
    nf4_module,
)
from ..engine.iteration.state import owning_state
from ..engine.iteration.unit import sharded_param
from ..errors import ShardwiseError
from ._messages import summary
from ._targets import (
    ParamTarget,
    Value,
    abandon_unfinished,
    apply_values,
    comm_of,
    match_targets,
    module_targets,
    subclass_targets,
)
from ._tensor_parallel import checkpoint_comm
from .sources import Rename, Source, open_source, renamer

# Note [non-finite values refused]
# A NaN or an inf in a weight (a damaged or diverged source; a float32 value beyond
# float16's range, cast) trains quietly into a NaN loss. So ``load_pretrained`` counts
# the values that are NaN or inf in every parameter as it reads it, and the NaNs in
# buffers (an inf in a buffer is a common attention mask value): one sum over a tensor
# read anyway, and a count only when the sum is not finite (``_not_finite``). The values
# checked are the model's, after any cast. Each rank checks what it reads, its rows of a
# sharded parameter, so the findings are combined across ranks in the comparison of
# sources that precedes every load (a range that several ranks read whole counted
# once): the refusal is the same on every rank, names the first tensors and counts
# their values, and comes before anything changes. Quantized weights
# are read whole, one a rank, in rounds after the full-precision ones are written (Note
# [quantize while loading] in engine/groups/quantize.py): one holding NaN or inf stops the load
# at its round, on every rank, and the quantized weights of that round and later ones,
# awaiting load (Note [the base awaits loading] in engine/groups/quantize.py), keep the model
# from running until a load gives them values. ``allow_nonfinite=True`` skips the checks.
#: (place in the load's order, source key, first element read, elements read, how many
#: are NaN or inf, elements in all)
Found = tuple[int, str, int, int, int, int]


def _not_finite(t: torch.Tensor, nan_only: bool = False) -> int:
    """How many values of ``t`` are NaN or inf (NaN only, with ``nan_only``).

    When there are none, as there should be, that takes one pass over ``t`` and no
    copy: its sum. NaN and inf propagate through a sum (inf + -inf is NaN), so a sum
    that is finite (not NaN) proves that every value is; one that is not, also the
    overflow of a sum of large finite values, is followed by the exact count (several
    times slower than the sum: ``isfinite`` makes a boolean tensor)."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    wide = t.dtype if t.dtype in (torch.float64, torch.complex64, torch.complex128) \
        else torch.float32
    try:
        total = t.sum(dtype=wide)
        if bool(~torch.isnan(total) if nan_only else torch.isfinite(total)):
            return 0
    except (RuntimeError, TypeError):  # a dtype sum does not take: the count decides
        pass
    if nan_only:
        return int(torch.isnan(t).sum())
    return t.numel() - int(torch.isfinite(t).sum())


def _nonfinite_message(description: str, found: list[Found], quantized: bool) -> str:
    """The refusal of NaN and inf (Note [non-finite values refused]), from ``found`` on
    every rank."""
    ranges: dict[str, dict[tuple[int, int], int]] = {}
    total: dict[str, int] = {}
    for _, key, lo, n, count, numel in sorted(found):
        ranges.setdefault(key, {})[(lo, n)] = count  # a range read by several: once
        total[key] = numel
    counts = [(key, sum(r.values())) for key, r in ranges.items()]
    shown = ", ".join(f"{key!r} ({c} of its {total[key]} values)" for key, c in counts[:5])
    more = f" and {len(counts) - 5} more" if len(counts) > 5 else ""
    state = ("the full-precision weights and buffers and the quantized weights before "
             "these are loaded, the rest are not, and the model refuses to run until a "
             "load completes" if quantized else "nothing was changed")
    return (f"sw.load_pretrained refused {description}: {len(counts)} tensor"
            f"{'s hold' if len(counts) > 1 else ' holds'} values that are NaN or inf "
            f"(in the model's dtype, after any cast): {shown}{more}; {state}. A weight "
            f"holding them makes the first loss NaN. The usual causes are a damaged or "
            f"diverged checkpoint, or values beyond the range of a lower precision they "
            f"were cast to. Fix the source, or pass allow_nonfinite=True to load them as "
            f"they are")


def _read_source(module: nn.Module, source: object, strict: bool, rename: Rename,
                 allow_nonfinite: bool):
    _check_quantized(module)
    src = open_source(source)
    to_module = renamer(rename)
    key_of: dict[str, str] = {}
    for k in src.keys():
        name = to_module(k)
        if name in key_of:
            raise ShardwiseError(f"{src.description}: keys {key_of[name]!r} and {k!r} both "
                                 f"become {name!r} after renaming")
        key_of[name] = k
    abandon_unfinished(module)
    params, buffers = module_targets(module)
    # Quantized weights match as the full weights they stand for, after the others, and
    # are loaded last, one at a time (Note [quantize while loading] in
    # engine/groups/quantize.py).
    params = [t for t in params if t.kind is None] + [t for t in params if t.kind is not None]
    saved = {k: (src.shape(k), None) for k in key_of.values()}  # any dtype: cast on load
    match = match_targets(params, buffers, saved, key_of, "source")
    names = [n for t in params for n in t.names] + list(buffers)
    if saved and names and len(match.unexpected) == len(saved):
        raise ShardwiseError(_nothing_matched(src.description, key_of, names,
                                              rename is not None))
    problems = match.problems("source", strict)
    quantized = [(t, key) for t, key in match.params if t.kind is not None]
    match.params = [(t, key) for t, key in match.params if t.kind is None]
    for _, key in quantized:
        if not src.dtype(key).is_floating_point:
            problems.append(f"{key}: the source holds {src.dtype(key)}, not "
                            f"floating-point weights to quantize")
    if problems:
        raise ShardwiseError(f"{src.description}: " + "; ".join(problems)
                             + match.advice(strict))
    loaded = {n for t, _ in match.params for n in t.names}
    loaded |= {n for t, _ in quantized for n in t.names}
    _check_base_filled(module, loaded, match.unexpected, src.description)
    # Read everything this rank needs before changing anything.
    casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
    values: list[tuple[ParamTarget, Value]] = []
    found: list[Found] = []  # Note [non-finite values refused]
    for i, (t, key) in enumerate(match.params):
        lo, n = t.local_range()
        # A tensor-parallel parameter's local rows are read from the global tensor's
        # ranges (Note [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
        read = _cast(t.read_local(functools.partial(_flat_range, src, key)), t.dtype, key,
                     casts)
        bad = 0 if allow_nonfinite else _not_finite(read)
        if bad:
            if t.tp is not None and t.tp.dim is not None:  # tp ranks' elements differ
                lo += t.tp.rank * math.prod(t.tp.local_shape)
            found.append((i, key, lo, n, bad, t.numel))
        value: Value = read
        if read.numel() * read.element_size() > _HELD_BYTES:
            # Read again when written, not held: holding every row read until all are
            # checked is a second copy of this rank's share (the embeddings and the
            # head, under a quantized base: docs/qlora.md, "Memory by phase").
            value = functools.partial(_read_rows, src, key, t, allow_nonfinite)
        del read
        values.append((t, value))
    buffer_values = []
    for i, (b, key) in enumerate(match.buffers, len(match.params)):
        value = _cast(src.read(key), b.dtype, key, casts)
        buffer_values.append((b, value))
        bad = 0 if allow_nonfinite else _not_finite(value, nan_only=True)
        if bad:
            found.append((i, key, 0, value.numel(), bad, value.numel()))
    return ((src.description, src.fingerprint()), values, buffer_values, casts, src,
            quantized, loaded, found)


def _flat_range(src: Source, key: str, lo: int, n: int) -> torch.Tensor:
    """Elements ``[lo, lo + n)`` of the flattened source tensor ``key``."""
    return src.read_flat(key, lo, lo + n)


# Rows larger than this are read once to be checked and again to be written.
_HELD_BYTES = 16 << 20


def _read_rows(src: Source, key: str, t: ParamTarget, allow_nonfinite: bool) -> torch.Tensor:
    """This rank's rows of ``key`` in ``t``'s dtype, read again to be written (the cast
    was counted at the first read), and checked again: a source changed in between must
    not bring in what the first read refused (Note [non-finite values refused])."""
    value = _cast(t.read_local(functools.partial(_flat_range, src, key)), t.dtype, key,
                  Counter())
    if not allow_nonfinite and _not_finite(value):
        raise ShardwiseError(f"{src.description}: {key} changed while it was loaded: its "
                             f"second read holds NaN or infinite values that the first "
                             f"did not")
    return value


class _NotFinite(Exception):
    def __init__(self, found: Found) -> None:
        super().__init__(found)
        self.found = found


def _nf4_shares(t: ParamTarget, src: Source, key: str,
                casts: Counter[tuple[torch.dtype, torch.dtype]],
                allow_nonfinite: bool) -> list[torch.Tensor]:
    """Source weight ``key`` quantized as ``t`` was (its block sizes), then divided as
    ``sw.shard`` divides it (Note [uneven packed parameters] in engine/groups/subclass.py): what
    each rank stores, as one byte row each, its slots one after another.

    Raises:
        _NotFinite: the weight holds NaN or inf, unless ``allow_nonfinite``.
    """
    pp = t.record
    # NF4's block sizes, from its full inner tensors: a scale per block, a scale of
    # scales per block of blocks.
    n_blocks = math.prod(pp.gather.full_inner["quantized_scalers"])
    rule = NF4(block_size=pp.numel // n_blocks,
               scaler_block_size=n_blocks // math.prod(pp.gather.full_inner["quantization_factor"]))
    device = pp.gather.stored[0].device
    full = _cast(src.read(key), pp.dtype, key, casts).reshape(pp.shape).to(device)
    bad = 0 if allow_nonfinite else _not_finite(full)
    if bad:  # Note [non-finite values refused]
        raise _NotFinite((0, key, 0, full.numel(), bad, full.numel()))
    q = rule.quantize(full)
    released = full.numel() * full.element_size() if full.device.type == "cpu" else 0
    del full
    freed(released)  # Note [freed memory] in engine/groups/alloc.py
    sizes = pp.gather.cut.slot_bytes()
    out = []
    for parts in pp.gather.cut.shares(t.names[0], q):
        row = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        offset = 0
        for part, size in zip(parts, sizes):
            row[offset:offset + part.numel()].copy_(part)
            offset += size
        out.append(row)
    return out


def _load_quantized(module: nn.Module, items: list[tuple[ParamTarget, str]],
                    src: Source, casts: Counter[tuple[torch.dtype, torch.dtype]],
                    allow_nonfinite: bool) -> None:
    """Each quantized weight read, quantized and shared out, in rounds of N weights: in
    a round rank r quantizes the r-th and scatters each rank its share (Note [quantize
    while loading] in engine/groups/quantize.py). A rank holds one weight in full precision at
    a time. Each weight awaits loading until its round is written, so a load that stops
    part-way leaves a model that refuses to run, naming the weights it did not load
    (Note [the base awaits loading] in engine/groups/quantize.py)."""
    if not items:
        return
    group = items[0][0].record.group
    assert group is not None
    comm = group.comm
    n, rank = comm.world_size, comm.rank
    for t, _ in items:
        for mod, attr in t.record.slots:
            mark_awaiting(mod, attr)
    guard_forward(module)
    for start in range(0, len(items), n):
        batch = items[start:start + n]
        send, error, found = None, None, None
        if rank < len(batch):
            try:
                send = _nf4_shares(batch[rank][0], src, batch[rank][1], casts,
                                   allow_nonfinite)
            except _NotFinite as e:
                _, key, lo, k, bad, numel = e.found
                found = (start + rank, key, lo, k, bad, numel)  # its place in the load
            except Exception as e:  # noqa: BLE001 - fail on every rank, not in the scatter
                error = f"{batch[rank][0].names[0]}: {type(e).__name__}: {e}"
        outcome = [(error, found)] if n == 1 else comm.all_gather_object(
            (error, found), what="the agreement on errors (load_pretrained, quantizing)")
        if any(e for e, _ in outcome):  # each rank's message, on every rank
            agree(comm, error, "load_pretrained failed while quantizing", changed=True)
        if any(f for _, f in outcome):
            raise ShardwiseError(_nonfinite_message(
                src.description, [f for _, f in outcome if f is not None], True))
        for j, (t, _) in enumerate(batch):
            pp = t.record
            if n == 1:
                assert send is not None
                got = send[0]
            else:
                got = torch.empty(sum(x.numel() for x in pp.gather.stored), dtype=torch.uint8,
                                  device=pp.gather.stored[0].device)
                comm.scatter(got, send if j == rank else None, j,
                             what=f"the scatter of {t.names[0]}'s quantized shards")
            offset = 0
            with torch.no_grad():
                for x in pp.gather.stored:  # each slot, its padding (zeros) included
                    x.copy_(got[offset:offset + x.numel()])
                    offset += x.numel()
        del send
        mark_loaded(module, {name for t, _ in batch for name in t.names})


def _nothing_matched(description: str, key_of: dict[str, str], names: list[str],
                     renamed: bool) -> str:
    """The message for a source none of whose names is the model's (a forgotten or wrong
    ``rename=``): one source key and one model name, a pair differing by a prefix when
    there is one, and then the prefix mapping that joins them."""
    pair, fix = None, None
    for name in names:  # the model's names longer: it adds a prefix
        parts = name.split(".")
        tails = ((".".join(parts[:i]) + ".", ".".join(parts[i:]))
                 for i in range(1, len(parts)))
        found = next(((prefix, tail) for prefix, tail in tails if tail in key_of), None)
        if found is not None:
            pair, fix = (found[1], name), {"": found[0]}
            break
    if pair is None:
        model = set(names)
        for name in key_of:  # the source's names longer: the model drops a prefix
            parts = name.split(".")
            tails = ((".".join(parts[:i]) + ".", ".".join(parts[i:]))
                     for i in range(1, len(parts)))
            found = next(((prefix, tail) for prefix, tail in tails if tail in model), None)
            if found is not None:
                pair, fix = (name, found[1]), {found[0]: ""}
                break
    source_name, model_name = pair if pair is not None else (next(iter(key_of)), names[0])
    key = key_of[source_name]
    shown = f"{key!r}" + (f" (renamed to {source_name!r})" if source_name != key else "")
    suggestion = (f"; here rename={fix!r} joins the two"
                  if fix is not None and not renamed else "")
    peft = (" A PeftModel also names an adapted layer's weight '...base_layer.weight': a "
            "callable rename handles both (docs/qlora.md)."
            if any(".base_layer." in n for n in names) else "")
    return (f"{description}: no name in the source matched one in the model, so nothing "
            f"would be loaded. The source has keys such as {shown} ({len(key_of)} keys), "
            f"the model names such as {model_name!r} ({len(names)} names). Pass rename= "
            f"mapping the source's names to the model's (a dict of prefixes or a "
            f"callable){suggestion}.{peft}")


def _check_base_filled(module: nn.Module, loaded: set[str], unexpected: list[str],
                       description: str) -> None:
    """Refuse a load that would leave a parameter of a quantized base unloaded, even under
    ``strict=False`` (Note [the base awaits loading] in engine/groups/quantize.py): it would
    keep its random init (or zeros) and train silently."""
    left = [n for n in awaiting(module) if n not in loaded]
    if not left:
        return
    untaken = (f"; the source keys nothing took: {summary(unexpected, limit=5)}"
               if unexpected else "")
    raise ShardwiseError(
        f"{description}: {len(left)} parameters of a base built under "
        f"sw.sharded_init(quantize=...), or quantized weights a failed load left "
        f"unloaded, are not in the source and would keep no loaded "
        f"values: {summary(left, limit=5)}{untaken}. strict=False forgives only what the "
        f"source cannot hold (adapters, added after the block); every base parameter must "
        f"come from this one source. Fix rename= so that these names are reached, or "
        f"load a source that has them (docs/qlora.md)")


def _check_quantized(module: nn.Module) -> None:
    """Refuse quantized weights of a model not sharded yet: their stand-ins (built under
    ``sharded_init(quantize=)``) or whole ``NF4Tensor`` s, which would be rewritten as if
    they were plain tensors."""
    state = owning_state(module)
    pending = awaiting(module) if state is None else []
    whole = [n for n, p in module.named_parameters()
             if gathers_bytes(p) and sharded_param(p) is None]
    if pending:
        raise ShardwiseError(
            f"{', '.join(pending[:3])}{', ...' if len(pending) > 3 else ''} belong to a "
            f"model built under sw.sharded_init(quantize=...) and not sharded yet; "
            f"load_pretrained loads (and quantizes) into each rank's share of them: call "
            f"model = sw.shard(model) first")
    if whole:
        raise ShardwiseError(
            f"{', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''} are quantized "
            f"weights of a model not sharded yet; load_pretrained quantizes into each "
            f"rank's share of them: call model = sw.shard(model) first (or load, then "
            f"quantize_nf4, then shard)")
    packed = subclass_targets(module) if state is not None else []
    other = [t for t in packed if not issubclass(t.record.gather.kind, nf4_module().NF4Tensor)]
    if other:
        raise ShardwiseError(
            f"sw.load_pretrained quantizes into NF4 weights only, and this model's "
            f"quantized {other[0].names[0]} is a "
            f"{other[0].record.gather.kind.__qualname__}"
            f"{f' ({len(other) - 1} more)' if len(other) > 1 else ''}; nothing was done. "
            f"Load the full-precision model, quantize it, then shard it")


def _cast(value: torch.Tensor, dtype: torch.dtype, key: str,
          casts: Counter[tuple[torch.dtype, torch.dtype]]) -> torch.Tensor:
    """``value`` in the model's ``dtype``: a float of another precision is cast (and
    counted, for the warning), an integer where the model holds a float, or the reverse,
    is refused: such a source is not weights for this model."""
    if value.dtype == dtype:
        return value
    kind = {value.dtype.is_floating_point, dtype.is_floating_point}
    if len(kind) > 1 or value.dtype.is_complex != dtype.is_complex or torch.bool in (
            value.dtype, dtype):
        raise ShardwiseError(f"{key}: the source holds {value.dtype}, the model "
                             f"{dtype}; load_pretrained casts between floating-point "
                             f"precisions only. Convert the source, or the model, first")
    casts[(value.dtype, dtype)] += 1
    return value.to(dtype)


@operation("load_pretrained", lambda module, **_: (comm_of(module), "load_pretrained", None))
def load_pretrained(module: nn.Module, source: object, strict: bool = True,
                    rename: Rename = None, *, allow_nonfinite: bool = False) -> None:
    """Load full (unsharded) weights into ``module``, sharded or not, on every rank.

    From safetensors sources each rank reads only the slices of each parameter it stores
    (safetensors' slice API), so no rank holds the whole model; a dict or a weights-only
    pickle is whole on every rank by nature. Every rank loads every persistent buffer found
    in the source; then every buffer is made ``src_rank``'s, so ranks end identical
    (non-persistent buffers keep ``src_rank``'s constructed values). A tied weight needs to
    appear under one of its names only. Floating-point values are cast to each
    parameter's dtype, with a warning saying how many (rank 0); an integer where the model
    holds a floating-point tensor, or the reverse, is refused.

    Args:
        module: the model (call on every rank of its group).
        source: a state dict, a ``.safetensors`` file, or a folder with ``model.safetensors``
            or ``model.safetensors.index.json`` and its shards (Hugging Face layout). A
            ``.bin``/``.pt`` file is accepted only if ``torch.load(weights_only=True)``
            loads it: nothing is ever unpickled.
        strict: raise on keys missing from the source or unknown to the model.
            ``strict=False`` ignores them, except for a model built under
            ``sw.sharded_init(quantize=...)``: every parameter built in that block (all
            but LoRA adapters) must come from the source, since it would otherwise keep
            a random init or zeros; what was added after the block (the adapters of
            ``get_peft_model``) may be missing (Note [the base awaits loading] in
            engine/groups/quantize.py).
        rename: how source keys map to module keys, never guessed: a prefix mapping such
            as ``{"model.": ""}`` (strip) or ``{"": "model."}`` (add), or a callable.
        allow_nonfinite: load parameters holding NaN or inf, and buffers holding NaN,
            as they are; by default they are refused (Note [non-finite values refused]).

    Raises:
        ShardwiseError: on every rank, before anything is modified, listing missing,
            unexpected and wrongly shaped keys, naming an unreadable file, a tensor
            whose kind (integer or floating point) is not the model's, when no name in
            the source is the model's (whatever ``strict``; with a key of each, for
            ``rename=``), when a quantized base's parameter is not in the source
            (whatever ``strict``), when ranks were given different weights (Note
            [one source] in sources.py), or when a parameter holds NaN or inf or a
            buffer NaN (the first ones named, with their counts; unless
            ``allow_nonfinite``). Quantized weights
            (Note [quantize while loading] in engine/groups/quantize.py) are read and
            quantized after the plain ones are written: a file that fails to read
            then, on some rank, raises on every rank with the plain weights loaded and
            the quantized ones partly, as does a quantized weight holding NaN or inf;
            the model refuses to run until they are all loaded (call again).

    Example:
        >>> model = sw.shard(LlamaForCausalLM(config))
        >>> sw.load_pretrained(model, "/models/llama-1b")   # folder from save_pretrained
    """
    require_bool(strict, "load_pretrained", "strict")
    require_bool(allow_nonfinite, "load_pretrained", "allow_nonfinite")
    comm = comm_of(module)
    # Every rank of a tensor-parallel model agrees, not each dp group apart (Note
    # [tensor-parallel checkpoints] in checkpoint/_tensor_parallel.py).
    ranks = checkpoint_comm(module, comm)
    what = "load_pretrained failed"
    source_id, values, buffer_values, casts, src, quantized, loaded, found = agreed(
        ranks, what, lambda: _read_source(module, source, strict, rename, allow_nonfinite))
    if ranks is not None and ranks.world_size > 1:  # Note [one source] in sources.py
        ids = ranks.all_gather_object((source_id, found))
        if len({fingerprint for (_, fingerprint), _ in ids}) > 1:
            listed = "\n".join(f"  rank {r}: {d} (fingerprint {f})" for r, ((d, f), _) in
                                enumerate(ids))
            raise ShardwiseError(f"{what}; nothing was changed: the ranks were given "
                                 f"different weights (names, shapes, sizes or data "
                                 f"differ):\n{listed}")
        found = [f for _, theirs in ids for f in theirs]
    if found:  # Note [non-finite values refused]
        raise ShardwiseError(_nonfinite_message(source_id[0], found, False))
    # Rows too large to hold are read again here, which may fail on some ranks only (a
    # source changed since): every rank then says so, and that the model is partly loaded.
    agreed(ranks, f"{what} while writing the checked values",
           functools.partial(apply_values, values, buffer_values), changed=True)
    del values
    mark_loaded(module, loaded - {n for t, _ in quantized for n in t.names})
    _load_quantized(module, quantized, src, casts, allow_nonfinite)
    mark_loaded(module, loaded)
    if casts and (comm is None or comm.rank == 0):
        said = ", ".join(f"{n} from {a} to {b}".replace("torch.", "")
                         for (a, b), n in sorted(casts.items(), key=str))
        warnings.warn(f"shardwise: load_pretrained cast tensors of another precision to the "
                      f"model's dtypes ({said}); load a source of the model's dtypes, or "
                      f"build the model in the source's, to keep every bit", stacklevel=3)
    if comm is not None and comm.world_size > 1:
        # Buffers not in the source (non-persistent ones, or missing under strict=False)
        # may differ per rank; every rank takes src_rank's.
        state = owning_state(module)
        comm.broadcast_tensors([b for _, b in module.named_buffers() if b is not None],
                               state.src_rank if state is not None else 0)
    maybe_check(module)
