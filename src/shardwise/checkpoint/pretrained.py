"""``load_pretrained``: full weights into a sharded or unsharded module, every rank right."""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn as nn

from .._args import require_bool
from ..comm.agree import agreed
from ..comm.order_check import operation
from ..consistency import maybe_check
from ..engine.state import owning_state, refuse_packed
from ..errors import ShardwiseError
from ._targets import (
    abandon_unfinished,
    apply_values,
    comm_of,
    match_targets,
    module_targets,
)
from .sources import Rename, open_source, renamer


def _read_source(module: nn.Module, source: object, strict: bool, rename: Rename):
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
    saved = {k: (src.shape(k), None) for k in key_of.values()}  # any dtype: cast on load
    match = match_targets(params, buffers, saved, key_of, "source")
    problems = match.problems("source", strict)
    if problems:
        hint = (" (pass rename={'old.prefix.': 'new.prefix.'} if the names differ only by a "
                "prefix, or strict=False to ignore missing and unexpected keys)")
        raise ShardwiseError(f"{src.description}: " + "; ".join(problems) + hint)
    # Read everything this rank needs before changing anything.
    casts: Counter[tuple[torch.dtype, torch.dtype]] = Counter()
    values = []
    for t, key in match.params:
        lo, n = t.local_range()
        values.append((t, _cast(src.read_flat(key, lo, lo + n), t.dtype, key, casts)))
    buffer_values = [(b, _cast(src.read(key), b.dtype, key, casts))
                     for b, key in match.buffers]
    return (src.description, src.fingerprint()), values, buffer_values, casts


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
                    rename: Rename = None) -> None:
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
        rename: how source keys map to module keys, never guessed: a prefix mapping such
            as ``{"model.": ""}`` (strip) or ``{"": "model."}`` (add), or a callable.

    Raises:
        ShardwiseError: on every rank, before anything is modified, listing missing,
            unexpected and wrongly shaped keys, naming an unreadable file, a tensor whose
            kind (integer or floating point) is not the model's, or when ranks were given
            different weights (Note [one source] in sources.py).

    Example:
        >>> model = sw.shard(LlamaForCausalLM(config))
        >>> sw.load_pretrained(model, "/models/llama-1b")   # folder from save_pretrained
    """
    require_bool(strict, "load_pretrained", "strict")
    refuse_packed(module, "sw.load_pretrained")
    comm = comm_of(module)
    what = "load_pretrained failed"
    source_id, values, buffer_values, casts = agreed(
        comm, what, lambda: _read_source(module, source, strict, rename))
    if comm is not None and comm.world_size > 1:  # Note [one source] in sources.py
        ids = comm.all_gather_object(source_id)
        if len({fingerprint for _, fingerprint in ids}) > 1:
            listed = "\n".join(f"  rank {r}: {d} (fingerprint {f})" for r, (d, f) in
                                enumerate(ids))
            raise ShardwiseError(f"{what}; nothing was changed: the ranks were given "
                                 f"different weights (names, shapes, sizes or data "
                                 f"differ):\n{listed}")
    apply_values(values, buffer_values)
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
