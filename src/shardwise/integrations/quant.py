"""Quantized frozen bases for QLoRA, with torchao's ``NF4Tensor`` (``shardwise[quant]``).

``quantize_nf4(model)`` replaces the weights of a model's linear layers by frozen
``NF4Tensor`` s before ``sw.shard``; shardwise then shards, gathers and releases them as
packed bytes (Note [packed parameters] in engine/groups/subclass.py). torchao is imported quietly:
on a machine without CUDA its CUDA-only extension libraries are not loaded at all
(``TORCHAO_FORCE_SKIP_LOADING_SO_FILES``), so they print no "Failed to load" warnings,
and nothing NF4 needs lives in them.

To quantize while loading, with no rank ever holding the full-precision weights, build
under ``sw.sharded_init(quantize="nf4")`` (or ``quantize=NF4(...)``), shard, then
``sw.load_pretrained``: Note [quantize while loading] in engine/groups/quantize.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..engine.groups.quantize import NF4, default_choice, nf4_module
from ..engine.iteration.unit import sharded_param
from ..engine.sharded_init import init_piece
from ..errors import ShardwiseError


def quantize_nf4(module: nn.Module, *, block_size: int = 64, scaler_block_size: int = 256,
                 where: Callable[[str, nn.Linear], bool] | None = None) -> list[str]:
    """Replace the weight of every chosen ``nn.Linear`` by a frozen ``NF4Tensor``, in place.

    Call it on the unsharded model, before ``sw.shard`` (and before or after adding PEFT
    adapters: their own weights are never quantized). Each weight is quantized from its
    current values, one layer at a time.

    Args:
        module: the model.
        block_size: elements per NF4 block (one scale each).
        scaler_block_size: blocks per block of the double-quantized scales.
        where: ``(qualified_name, linear) -> bool`` choosing the layers; default: every
            ``nn.Linear`` except PEFT adapters and output heads named ``lm_head``.

    Returns:
        The qualified names of the quantized weights.

    Raises:
        ShardwiseError: torchao is missing, the model is already sharded (nothing is
            changed), a chosen weight was partitioned by ``sw.sharded_init``, or its size
            is not a multiple of ``block_size * scaler_block_size`` (the error names the
            weight).

    Example:
        >>> quantize_nf4(model)                      # every linear layer but lm_head
        >>> model = sw.shard(get_peft_model(model, LoraConfig(...)))
    """
    nf4 = nf4_module()
    chosen = where or _default_choice
    picked = [(name, mod) for name, mod in module.named_modules()
              if isinstance(mod, nn.Linear) and chosen(name, mod)]
    sharded = [f"{name}.weight" for name, mod in picked if sharded_param(mod.weight) is not None]
    if sharded:
        # Checked before any layer changes: torchao would fail part-way through, on the
        # first shard it met ("got mixed torch.Tensor and DTensor"), with the layers
        # before it already replaced.
        raise ShardwiseError(
            f"quantize_nf4 was called on a model already sharded by sw.shard "
            f"({', '.join(sharded[:3])}{', ...' if len(sharded) > 3 else ''} are shards: "
            f"each rank holds some rows, and the NF4 blocks and scales are computed over "
            f"whole weights). Nothing was changed. Quantize before sharding: "
            f"quantize_nf4(model), then sw.shard(model) (docs/qlora.md)")
    placed = [f"{name}.weight" for name, mod in picked
              if isinstance(mod.weight, DTensor) and sharded_param(mod.weight) is None]
    if placed:
        # Tensor parallelism (Note [tensor-parallel parameters] in
        # engine/groups/tensor_parallel.py): torchao fails on DTensors part-way through.
        raise ShardwiseError(
            f"quantize_nf4 does not take tensor-parallel weights ({', '.join(placed[:3])}"
            f"{', ...' if len(placed) > 3 else ''} are DTensors placed by "
            f"parallelize_module; docs/status.md). Nothing was changed")
    done = []
    for name, mod in picked:
        w = mod.weight
        if init_piece(w) is not None:
            raise ShardwiseError(
                f"{name}.weight was partitioned by sw.sharded_init: each rank holds some "
                f"of its rows, and quantizing would read a stand-in. Build the model "
                f"without sharded_init, quantize it, then sw.shard it")
        if w.numel() % (block_size * scaler_block_size):
            raise ShardwiseError(
                f"{name}.weight has {w.numel()} elements, not a multiple of block_size * "
                f"scaler_block_size = {block_size} * {scaler_block_size}; choose smaller "
                f"blocks, or leave the layer out with where=")
        with torch.no_grad():
            mod.weight = nn.Parameter(nf4.to_nf4(w.detach(), block_size, scaler_block_size),
                                      requires_grad=False)
        done.append(f"{name}.weight")
    return done


def _default_choice(name: str, mod: nn.Linear) -> bool:
    return default_choice(name, mod)


__all__ = ["NF4", "nf4_module", "quantize_nf4"]
