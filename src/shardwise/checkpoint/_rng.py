"""RNG states in a checkpoint: each rank's taken at a save, checked and restored at a load,
and rank 0's carried to another world size by ``Resumable``.

A rank's torch (and, once initialised, CUDA) generator states are tensors of its data
file (``rng/torch``, ``rng/cuda``: _names.py); Python's ``random`` state is JSON, in the
metadata's ``python_rng``. They are restored at the world size that saved them only
(docs/checkpoints.md); ``Resumable`` carries rank 0's to another size when every rank's
were equal (Note [resumable runs] in resumable.py).
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ShardwiseError
from ._names import RNG_CUDA, RNG_TORCH

if TYPE_CHECKING:
    from ._format import Reader


def python_rng_state() -> list:
    """Python's ``random`` state as JSON values."""
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def set_python_rng_state(saved: list) -> None:
    """Restore a state from :func:`python_rng_state`."""
    random.setstate((saved[0], tuple(saved[1]), saved[2]))


def rank_rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's generator states, as tensors for its data file."""
    tensors = {RNG_TORCH: torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors[RNG_CUDA] = torch.cuda.get_rng_state()
    return tensors


@dataclass
class RankRng:
    """One rank's saved RNG states, read and checked (:func:`read_rank_rng`)."""

    torch_state: torch.Tensor
    cuda_state: torch.Tensor | None
    python_state: list

    def restore(self) -> None:
        torch.set_rng_state(self.torch_state)
        if self.cuda_state is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda_state)
        set_python_rng_state(self.python_state)


def read_rank_rng(file: Reader, python_state: list, where: str) -> RankRng:
    """A rank's RNG states from its data file ``file`` and its Python state from the
    metadata, the torch state tried on a scratch generator first, so that a bad one fails
    before anything changes.

    Raises:
        ShardwiseError: ``rng/torch`` is not a torch RNG state (naming ``where``).
    """
    rng = RankRng(file.read(RNG_TORCH),
                  file.read(RNG_CUDA) if RNG_CUDA in file.keys() else None, python_state)
    try:
        torch.Generator().set_state(rng.torch_state)
    except (RuntimeError, TypeError) as e:
        raise ShardwiseError(f"{where}: {RNG_TORCH} is not a torch RNG state ({e})") from e
    return rng


def portable_rng() -> tuple[dict[str, Any], str]:
    """This rank's torch and Python states as JSON values (``Resumable``'s record, to
    carry to another world size), and their digest, which ranks compare."""
    torch_state = torch.get_rng_state()
    python_state = python_rng_state()
    digest = hashlib.sha256(torch_state.numpy().tobytes()
                            + json.dumps(python_state).encode()).hexdigest()
    return {"torch": base64.b64encode(torch_state.numpy().tobytes()).decode(),
            "python": python_state}, digest


def restore_portable_rng(record: dict[str, Any]) -> None:
    """Restore the states of a :func:`portable_rng` record."""
    raw = base64.b64decode(record["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    set_python_rng_state(record["python"])
