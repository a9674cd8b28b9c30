"""``model.state_dict()`` and ``model.load_state_dict()`` on a sharded model.

``state_dict()`` holds, for each sharded parameter, a DTensor of this rank's rows, as under
FSDP2: ``torch.save`` writes them per rank, ``copy.deepcopy`` copies them, and they stay
views of the shards (``dcp.load(model.state_dict(), ...)`` loads in place).
``load_state_dict()`` takes such a sharded state dict saved at the same world size, or a
full one of plain tensors, from which each rank takes its rows; afterwards every rank holds
``src_rank``'s buffers, as after ``shard``. Hooks on the modules holding shards do it;
module copies inherit them (they take the module they run on as an argument).

Note [DTensor storage offset]
Since torch 2.10 (pytorch#167597) a DTensor takes its local tensor's storage offset, and a
shard's local tensor views its unit's flat buffer at an offset. ``torch.save`` and
``copy.deepcopy`` treat a wrapper tensor with a non-zero data pointer as an ordinary
tensor and read the wrapper's storage, which it does not have ("invalid python storage").
So each value is wrapped again at offset 0 around the same local tensor (the way DTensor
wrapped before 2.10): still a view of the shard, and saved with its flat buffer.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..comm.order_check import announce
from ..errors import ShardwiseError
from .buffers import BufferPolicy
from .packed import packed_param
from .state import model_state
from .unit import ShardedParam, sharded_param


def install_state_dict_hooks(root: nn.Module) -> None:
    """Hook ``state_dict`` and ``load_state_dict`` of every module holding a shard, and
    the end of ``load_state_dict`` of the sharded root."""
    for m in root.modules():
        if any(sharded_param(t) is not None for t in m._parameters.values()
               if t is not None):
            m.register_state_dict_post_hook(_saveable_values)
            m.register_load_state_dict_pre_hook(_take_rows)
        if any(packed_param(t) is not None for t in m._parameters.values()
               if t is not None):
            m.register_load_state_dict_pre_hook(_refuse_packed)
    root.register_load_state_dict_post_hook(_sync_buffers)


def _sharded(module: nn.Module) -> list[tuple[str, torch.Tensor, ShardedParam]]:
    out: list[tuple[str, torch.Tensor, ShardedParam]] = []
    for name, t in module._parameters.items():
        sp = sharded_param(t) if t is not None else None
        if t is not None and sp is not None:
            out.append((name, t, sp))
    return out


def _saveable_values(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     local_metadata: dict) -> None:
    """Note [DTensor storage offset]."""
    for name, t, _ in _sharded(module):
        value = state_dict.get(prefix + name)
        if isinstance(value, DTensor) and value is not t and value.storage_offset() != 0:
            state_dict[prefix + name] = _at_offset_zero(value)


def _at_offset_zero(t: DTensor) -> DTensor:
    out = cast(Any, torch.Tensor._make_wrapper_subclass(
        DTensor, t.shape, strides=t.stride(), storage_offset=0, dtype=t.dtype,
        device=t.device, layout=t.layout, requires_grad=t.requires_grad))
    out._spec = t._spec
    out._local_tensor = t._local_tensor
    return cast(DTensor, out)


def _take_rows(module: nn.Module, state_dict: dict[str, Any], prefix: str,
               local_metadata: dict, strict: bool, missing_keys: list[str],
               unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Turn each value for a shard into a DTensor of this rank's rows on the model's mesh
    (``load_state_dict`` copies a copy of the caller's dict: the caller's is untouched).
    A value of the wrong full shape is left for torch to report."""
    sharded = _sharded(module)
    if sharded and (local_metadata.get("assign_to_params_buffers", False)
                    or torch.__future__.get_swap_module_params_on_conversion()):
        raise ShardwiseError(
            f"load_state_dict(assign=True) (or with torch.__future__'s "
            f"swap_module_params_on_conversion) would replace the shards of "
            f"{type(module).__name__} with the given tensors, outside shardwise's storage: "
            f"call model.load_state_dict(sd) without assign, which copies into the shards")
    for name, t, sp in sharded:
        key = prefix + name
        value = state_dict.get(key)
        if t is not sp.shard or not isinstance(value, torch.Tensor):
            continue  # gathered (the full parameter takes a full value), or torch reports
        state_dict[key] = _rows(sp, value, key)


def _refuse_packed(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   *args: Any) -> None:
    """Loading into a quantized shard is not supported yet: refuse the keys that would
    (PEFT's adapter loads never name them)."""
    keys = [prefix + name for name, t in module._parameters.items()
            if t is not None and packed_param(t) is not None and prefix + name in state_dict]
    if keys:
        raise ShardwiseError(f"load_state_dict cannot load quantized (tensor subclass) "
                             f"parameters of a sharded model yet ({', '.join(keys)}); "
                             f"nothing was loaded. Quantize the loaded weights before "
                             f"sw.shard instead (docs/qlora.md)")


def _rows(sp: ShardedParam, value: torch.Tensor, key: str) -> torch.Tensor:
    assert sp.unit is not None
    comm = sp.unit.model.topology.shard  # the rows follow the shard group's ranks
    mine = cast(DTensor, sp.shard)
    if isinstance(value, DTensor):
        if (tuple(value.placements) == tuple(mine.placements)
                and value.device_mesh.shape == mine.device_mesh.shape
                and tuple(value.shape) == tuple(sp.shape)
                and tuple(value.to_local().shape) == tuple(sp.local.shape)):
            return sp.as_dtensor(value.to_local().to(sp.local.device))
        raise ShardwiseError(
            f"load_state_dict: {key} is a DTensor of shape {tuple(value.shape)} placed "
            f"{tuple(value.placements)} over {value.device_mesh.size()} rank(s), but this "
            f"model places it {tuple(mine.placements)} over "
            f"{tuple(mine.device_mesh.shape)}: a sharded state dict (as "
            f"torch.save(model.state_dict()) writes per rank) loads only at the world size "
            f"it was saved at. To change world size, save with sw.save_checkpoint and load "
            f"with sw.load_checkpoint, or use torch.distributed.checkpoint (dcp.save / "
            f"dcp.load), or load a full state dict (sw.full_state_dict(model, "
            f"rank0_only=False)) with model.load_state_dict on every rank")
    if tuple(value.shape) != tuple(sp.shape):
        return value
    rows = sp.slot.local_rows(comm.rank)
    start = min(comm.rank * sp.slot.chunk_rows, sp.slot.rows)
    return sp.as_dtensor(value.detach().narrow(0, start, rows).to(sp.local.device))


def _sync_buffers(module: nn.Module, incompatible_keys: Any) -> None:
    """After a load, every rank takes ``src_rank``'s buffers (unless ``buffers="local"``):
    ranks that loaded different values would otherwise train on different statistics."""
    state = model_state(module)
    if state is None or state.buffers.policy is BufferPolicy.LOCAL:
        return
    announce(state.comm, "load_state_dict", state.number)
    state.buffers.broadcast_all()
