"""Units of a Hugging Face model: the classes its authors say must not be split."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn


def no_split_units(model: nn.Module) -> Callable[[str, nn.Module], bool] | None:
    """A ``units=`` callable selecting modules whose class is in the model's
    ``_no_split_modules`` (a Hugging Face convention: the decoder layers), or ``None``
    (shardwise's default) when the model names none.

    Example:
        >>> sw.shard(llama, units=no_split_units(llama))   # each LlamaDecoderLayer
    """
    names: set[str] = set()
    for m in model.modules():  # a PEFT wrapper or a composite model: the inner models'
        names |= set(getattr(m, "_no_split_modules", None) or ())
    if not names:
        return None
    return lambda _qualified, module: type(module).__name__ in names
