"""shardwise: ZeRO-3 fully sharded data parallelism for plain PyTorch modules.

Public API (every function that communicates is called by every rank, in the same order):

Process group
    init_distributed(backend=None, timeout=None)
Sharding
    shard(module, *, group, mesh, units, mixed_precision, buffers, src_rank,
          reshard_after_forward, prefetch, reproducible, memory_budget, offload)
        -> the same module; every parameter becomes a DTensor with its original shape,
        sharded on dim 0 (``p.to_local()`` is this rank's rows)
    Offload(params=None, optimizer=None, folder=None)
                                               states on the device, "cpu" or "disk"
    sharded_init(group=None, src_rank=0)       context manager: partition while building
    MixedPrecision(param_dtype, reduce_dtype)
    BufferPolicy                               "broadcast", "average" or "local"
    is_sharded(module)
    inspect(module) -> ModelView               this rank's engine state: units, bytes,
                                               phase, counters; read-only, no collective
    clip_grad_norm_(module, max_norm, norm_type=2.0)
    no_sync(module)
Reproducible mode (shard(..., reproducible=True): the same bits at any world size)
    micro_batches(batch, count, group=None)    this rank's share of a global batch
    global_mean(values, group=None)            a mean over every rank's micro-batches
Consistency
    gathered(module_or_params, modifier_rank=None)
    sync_buffers(module, src_rank=0, group=None)
    check_consistency(module, group=None, optimizer=None)
    per_rank(module_or_params)                 plain parameters trained per rank on purpose
                                               (others beside shards make a step raise)
State and checkpoints
    full_state_dict(module, rank0_only=True)
    full_parameters(module, *, rank0_only=False, dequantize=True, remove_duplicate=True)
                                               -> iterator of (name, full tensor), one
                                               unit gathered at a time, in
                                               named_parameters order (weights to an
                                               inference engine or a generation copy)
    full_optimizer_state_dict(module, optimizer, rank0_only=True)
                                               the optimizer's state as over the unsharded
                                               model: one file, loaded on every rank
    load_pretrained(module, source, strict=True, rename=None, *, allow_nonfinite=False)
    save_checkpoint(path, module, optimizer=None, extra=None, *, keep_previous=True,
                    background=False) -> None, or with background a SaveHandle
    SaveHandle                                 a background save: returned once the state
                                               is staged in host memory; .wait() returns
                                               when it is committed (raises what the
                                               write raised, on every rank), .done()
                                               asks without waiting
    load_checkpoint(path, module, optimizer=None) -> extra
                                               (a save or load first waits for the
                                               background save in flight)
    Resumable(folder, model, optimizer=None, *, every, keep=2, scheduler=None,
              micro_batches=None, steps_per_epoch=None, background=True)
                                               a loop that resumes from its newest
                                               checkpoint at any world size (torchrun
                                               restarts, elastic jobs); saves in the
                                               background, one in flight
    command line: shardwise consolidate CHECKPOINT OUTPUT; shardwise inspect CHECKPOINT;
    shardwise sign CHECKPOINT
Hugging Face (optional: transformers, accelerate)
    from_pretrained(model_class, folder, **shard_kwargs) -> a sharded, loaded model
    shardwise.integrations.transformers.ShardwiseTrainer
    shardwise.integrations.accelerate.ShardwiseAccelerator
Lightning (optional)
    shardwise.integrations.lightning.ShardwiseStrategy   Trainer(strategy="shardwise")
Environment
    SHARDWISE_CHECK (order and consistency checks), SHARDWISE_PEER_TIMEOUT (seconds a
    rank waits for peers that are elsewhere, default 30), SHARDWISE_LOG,
    SHARDWISE_FUSED (0: the reproducible mode's sums without compiled kernels)
Errors
    ShardwiseError, DivergenceError, ReadOnlyGatherError, CollectiveError
Reference models
    shardwise.models: GPT, GPTConfig, SmallCNN

Example::

    import torch, shardwise as sw
    sw.init_distributed()                       # torchrun --nproc_per_node N train.py
    model = sw.shard(GPT(cfg))                  # each rank keeps 1/N of every parameter
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss = model(x, y); loss.backward(); opt.step()
"""

from typing import Any

from .checkpoint import Resumable, SaveHandle, load_checkpoint, load_pretrained, save_checkpoint
from .checkpoint.state_dict import full_optimizer_state_dict, full_state_dict
from .comm.process_group import init_distributed
from .consistency import check_consistency
from .engine.entry_points.step import per_rank
from .engine.groups.offload import Offload
from .engine.iteration.buffers import BufferPolicy, sync_buffers
from .engine.sharded_init import sharded_init
from .errors import CollectiveError, DivergenceError, ReadOnlyGatherError, ShardwiseError
from .exact.micro_batches import global_mean, micro_batches
from .gather import gathered
from .grads import clip_grad_norm_, no_sync
from .inspection import ModelView, inspect
from .sharding import MixedPrecision, is_sharded, shard
from .streaming import full_parameters

__version__ = "0.1.0"


def from_pretrained(model_class: Any, folder: str, **kwargs: Any) -> Any:
    """Build a Hugging Face model partitioned from the start, shard it and load its
    weights from ``folder``; see :func:`shardwise.integrations.transformers.from_pretrained`
    (imported here lazily: transformers is an optional extra).

    Example:
        >>> model = sw.from_pretrained(AutoModelForCausalLM, "/models/llama-1b")
    """
    from .integrations.transformers import from_pretrained as load

    return load(model_class, folder, **kwargs)


__all__ = [
    "BufferPolicy",
    "CollectiveError",
    "DivergenceError",
    "MixedPrecision",
    "ModelView",
    "Offload",
    "ReadOnlyGatherError",
    "Resumable",
    "SaveHandle",
    "ShardwiseError",
    "check_consistency",
    "clip_grad_norm_",
    "from_pretrained",
    "full_optimizer_state_dict",
    "full_parameters",
    "full_state_dict",
    "gathered",
    "global_mean",
    "init_distributed",
    "inspect",
    "is_sharded",
    "load_checkpoint",
    "load_pretrained",
    "micro_batches",
    "no_sync",
    "per_rank",
    "save_checkpoint",
    "shard",
    "sharded_init",
    "sync_buffers",
]
