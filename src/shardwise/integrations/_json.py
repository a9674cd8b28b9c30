"""Python state (a scheduler's, Lightning's checkpoint dict) as JSON, never pickled.

``sw.save_checkpoint`` keeps ``extra`` as JSON and checks that it comes back exactly.
Beyond JSON, the states the integrations save hold tensors (ModelCheckpoint's scores, an
infinite ``kth_value`` among them), non-finite floats (ReduceLROnPlateau's ``best``),
tuples and the odd non-string key; each is stored as a tagged object and restored to its
type. Decoding builds only numbers, strings, lists, tuples, dicts and tensors of a torch
dtype: nothing read can name a function or a class (Note [what shardwise reads]
in checkpoint/sources.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ShardwiseError

TAG = "__shardwise__"  # marks an encoded value (a tensor, a tuple...)


def to_json(obj: Any, where: str, advice: str) -> Any:
    """``obj`` as JSON values; a value of another type raises, naming ``where`` it is and
    ending with ``advice``."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {TAG: "float", "value": repr(obj)}
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "data": to_json(t.flatten().tolist(), where, advice)}
    if isinstance(obj, tuple):
        return {TAG: "tuple", "items": [to_json(v, f"{where}[{i}]", advice)
                                        for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]", advice) for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and TAG not in obj:
            return {k: to_json(v, f"{where}[{k!r}]", advice) for k, v in obj.items()}
        return {TAG: "dict", "items": [[to_json(k, f"{where} key", advice),
                                        to_json(v, f"{where}[{k!r}]", advice)]
                                       for k, v in obj.items()]}
    raise ShardwiseError(f"{where} is a {type(obj).__name__}, which a shardwise checkpoint "
                         f"cannot hold {advice}")


def from_json(obj: Any, what: str) -> Any:
    """The value :func:`to_json` encoded; ``what`` names the file in an error."""
    if isinstance(obj, list):
        return [from_json(v, what) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get(TAG)
    if kind is None:
        return {k: from_json(v, what) for k, v in obj.items()}
    try:
        if kind == "float":
            return float(obj["value"])
        if kind == "tensor":
            dtype = getattr(torch, str(obj["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {obj['dtype']!r}")
            data = torch.tensor(from_json(obj["data"], what), dtype=dtype)
            return data.reshape(obj["shape"])
        if kind == "tuple":
            return tuple(from_json(v, what) for v in obj["items"])
        if kind == "dict":
            return {from_json(k, what): from_json(v, what) for k, v in obj["items"]}
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ShardwiseError(f"{what}: a malformed {kind!r} value ({e})") from None
    raise ShardwiseError(f"{what}: unknown value kind {kind!r}")
