"""What a checkpoint calls what it holds: the keys of the tensors in its data files, and the
names of dtypes in its metadata.

Each rank's data file holds, under these keys (docs/checkpoints.md):

- ``param/<name>``: its piece of a parameter, flat (``<name>`` is the parameter's first
  name; the metadata lists its others, tied ones);
- ``optim/<name>/<state>``: its piece of an optimizer-state tensor shaped like the
  parameter, flat; or, in rank 0's file, a state tensor of another shape, whole;
- ``packed/<name>/<inner>``: its piece of an inner tensor of a parameter gathered as its
  inner tensors' bytes, a tensor subclass (a quantized weight: Note [packed checkpoints]
  in engine/groups/subclass.py);
- ``rng/torch`` and ``rng/cuda``: its RNG states (checkpoint/_rng.py).

The metadata lists parameters held as inner tensors in their own section,
:data:`SUBCLASSES`, beside ``params``.

These names are independent of how the files encode tensors (checkpoint/_format.py): a
new format keeps them. They are fixed: checkpoints written by earlier versions use them,
so the rest of the checkpoint code asks this module for them rather than spelling them.
"""

from __future__ import annotations

import torch

RNG_PREFIX = "rng/"
RNG_TORCH = "rng/torch"
RNG_CUDA = "rng/cuda"
# The metadata's section of the parameters held as a tensor subclass's inner tensors
# (``checkpoint.json``'s ``"packed"``), beside ``"params"``.
SUBCLASSES = "packed"


def param_key(main: str) -> str:
    """The data-file key of a parameter's piece."""
    return f"param/{main}"


def optim_key(main: str, state: str) -> str:
    """The data-file key of the optimizer state ``state`` of the parameter ``main``."""
    return f"optim/{main}/{state}"


def inner_key(main: str, inner: str) -> str:
    """The data-file key of the inner tensor ``inner`` of a parameter held as a tensor
    subclass's inner tensors (Note [packed checkpoints] in engine/groups/subclass.py)."""
    return f"{SUBCLASSES}/{main}/{inner}"


def part_key(main: str, inner: str | None) -> str:
    """The data-file key of a part of the parameter ``main``: the parameter's piece
    (``inner`` None), or its inner tensor ``inner``'s."""
    return param_key(main) if inner is None else inner_key(main, inner)


def parameter_of(key: str) -> str | None:
    """The parameter a ``param/`` or ``optim/`` key belongs to, or None for another key."""
    kind, _, rest = key.partition("/")
    return rest.split("/")[0] if kind in ("param", "optim") else None


def dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` as the metadata names it: ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype the metadata names ``name``.

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
