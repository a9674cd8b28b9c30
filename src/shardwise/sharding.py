"""``shard()``: the public entry point, as a sequence of named steps: check, plan, agree, build.

1. ``_check_arguments``, ``_check_settings``: refuse what cannot be sharded, on each rank.
2. ``_budget``, ``_plan`` (``planning/``): the units, the parameters each owns and their
   flat groups, an engine :class:`~shardwise.engine.plan.Plan`; then the engine's checks
   of it. Agreed: a failure on one rank fails every rank, before anything changes (Note
   [agreed failure]).
3. ``_agree_structure``: every rank planned the same units with the same settings.
4. ``engine.build.build``: the engine's one entry point, which builds the groups, makes
   the buffers ``src_rank``'s, makes the units and the model state, and registers every
   hook and guard (engine/build.py, shared with deep copies).
"""

from __future__ import annotations

import functools
import hashlib
import socket
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ._args import require_group, require_module, require_rank
from ._log import logger
from ._registry import TENSOR_PARALLEL, attached
from .comm.agree import agreed
from .comm.collectives import Comm
from .comm.mesh import Topology, check_secondary, topology
from .comm.order_check import order_checks_enabled
from .consistency import maybe_check
from .engine.build import build
from .engine.groups.flat import gathers_bytes, refusal
from .engine.groups.offload import Offload
from .engine.groups.subclass import cut, shard_mesh
from .engine.groups.tensor_parallel import refusal as tp_refusal
from .engine.iteration.buffers import BufferPolicy, buffer_policy
from .engine.iteration.state import Settings, model_state
from .engine.iteration.unit import sharded_param, unit_of
from .engine.plan import Plan
from .engine.sharded_init import init_piece
from .errors import ShardwiseError
from .planning.memory import AUTO_BUDGET_FRACTION, free_memory
from .planning.units import (
    AUTO,
    AutoChoice,
    ParamRecord,
    UnitPlan,
    UnitSpec,
    assign_units,
    auto_units,
    choose_units,
    discover_params,
    plan_units,
    warn_if_one_unit_dominates,
)


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and gradient reduction; master weights keep their dtype.

    Floating-point inputs of every unit are cast to ``param_dtype`` (as FSDP2 does by
    default), so outputs come out in ``param_dtype``; buffers keep their dtype, and
    BatchNorm parameters stay in full precision (as FSDP1 does), since BatchNorm's kernel
    takes low-precision input only with full-precision weights and statistics.

    Args:
        param_dtype: dtype full parameters are gathered in and computed with
            (e.g. ``torch.bfloat16``); ``None`` keeps each parameter's dtype.
        reduce_dtype: dtype gradients are reduce-scattered in; ``None`` keeps the
            parameter's own (master) dtype, fp32 for an fp32 model: summing bf16
            gradients over ranks loses precision. Pass ``torch.bfloat16`` to halve the
            reduction traffic at that cost (FSDP2's ``MixedPrecisionPolicy`` reduces in
            ``param_dtype`` when its ``reduce_dtype`` is unset: docs/migration.md).

    Raises:
        ShardwiseError: a dtype that is not a floating-point ``torch.dtype`` (``"bf16"``).

    Example:
        >>> mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype)
                                          and value.is_floating_point):
                raise ShardwiseError(f"MixedPrecision: {name}={value!r}: expected a "
                                     f"floating-point torch.dtype (torch.bfloat16, "
                                     f"torch.float16, torch.float32), or None")


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` was sharded by :func:`shard` or holds parameters sharded by it.

    Args:
        module: any module.

    Raises:
        ShardwiseError: ``module`` is not a module.

    Example:
        >>> sw.is_sharded(model)      # False
        >>> sw.is_sharded(sw.shard(model))   # True
    """
    require_module(module, "sw.is_sharded")
    if model_state(module) is not None or unit_of(module) is not None:
        return True
    return any(sharded_param(p) is not None for p in module.parameters())


def _device_for(module: nn.Module, comm: Comm) -> torch.device:
    if comm.device.type == "cuda":
        return comm.device
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "meta":
            return t.device
        info = init_piece(t)
        if info is not None:
            return info.home
    return torch.device("cpu")


def shard(module: nn.Module, *, group: dist.ProcessGroup | None = None,
          mesh: DeviceMesh | None = None, units: UnitSpec = None,
          mixed_precision: MixedPrecision | None = None,
          buffers: str | BufferPolicy = "broadcast",
          src_rank: int = 0, reshard_after_forward: bool | int = True,
          prefetch: int = 1, reproducible: bool = False,
          memory_budget: int | None = None, offload: Offload | None = None) -> nn.Module:
    """Shard ``module`` in place (ZeRO-3) and return it.

    Every parameter is sharded on dim 0: rank r keeps its rows as ``torch.chunk`` splits
    them (possibly none), in one flat buffer per unit, dtype and ``requires_grad``. A
    frozen tensor subclass implementing FSDP2's all-gather extension protocol (torchao's
    ``NF4Tensor``) is sharded and gathered through that protocol, as packed bytes
    (docs/qlora.md). A unit's full parameters exist only while it computes. After the
    call every rank holds ``src_rank``'s parameters and buffers. The module keeps its
    class and methods; ``named_parameters()`` yields the original names, each an
    ``nn.Parameter`` holding a ``DTensor`` with the original shape (``p.to_local()`` is
    this rank's rows), so build the optimizer *after* sharding: one built before raises
    at its first step.

    Args:
        module: the model; its parameters must be real tensors on ``src_rank``.
        group: process group (default: the world).
        mesh: a ``DeviceMesh`` instead of ``group``: 1-D, the same as
            ``group=mesh.get_group()``; 2-D, dims (replicate, shard), hybrid sharding
            (Note [hybrid sharding] in comm/mesh.py): parameters sharded within each row of
            the mesh and replicated across rows, placed ``(Replicate(), Shard(0))``;
            gradients reduce-scattered within a row, then summed across rows.
            ``src_rank`` is then a rank of the whole mesh. Tensor parallelism: a model
            placed by torch's ``parallelize_module`` over ``mesh["tp"]`` is sharded
            over ``mesh=mesh["dp"]`` (or ``mesh["replicate", "shard"]``), each
            parameter's local tensor by rows (Note [tensor-parallel parameters] in
            engine/groups/tensor_parallel.py).
        units: submodules gathered together: a class, tuple of classes, or a callable
            ``(qualified_name, module) -> bool``; every match becomes a unit, nested
            matches too (each owns the parameters no inner unit owns). ``()`` makes the
            root the only unit. Default: each entry (holding parameters) of the outermost
            ``nn.ModuleList`` s, or, in a model without one, of the outermost
            ``nn.Sequential`` s; with a quantized base, also the declared input
            embeddings and untied output head (Note [the embeddings' own units] in
            planning/units.py). The root owns every other parameter. A warning says when
            one unit holds more than half of a model of a million parameters or more.
            ``"auto"``: the fewest units whose full parameters gathered at once fit
            ``memory_budget``: the root alone, else the default units, else each unit
            (and the root) also split into its children holding parameters, and so on
            down to modules without such children. Held at once: the root (gathered
            for the whole step), the computing unit, the units enclosing it and the
            ``prefetch`` units next to it. When no split fits, the one with the lowest
            peak (the fewest units among those) is used and a warning says by how much
            it exceeds the budget.
        mixed_precision: a :class:`MixedPrecision`, or ``None`` for full precision.
        buffers: a :class:`~shardwise.BufferPolicy` or its name, ``"broadcast"``,
            ``"average"`` or ``"local"``; see :mod:`shardwise.engine.iteration.buffers`.
        src_rank: rank (in ``group``) whose initial state everyone takes.
        reshard_after_forward: free non-root units after forward (``True``, ZeRO-3),
            keep them until their backward (``False``: less communication, more
            memory), or an int k dividing the shard group's size: keep them sharded over
            groups of k contiguous ranks, so that the backward's all-gather stays
            within them (Note [secondary shards] in comm/mesh.py; needs the model to span
            the world).
        prefetch: how many units ahead to gather while one computes, in forward and in
            backward (0: none). Each costs one more unit of full parameters in memory;
            more than 1 helps when all-gathers are slow next to compute. More than the
            number of units is refused.
        memory_budget: with ``units="auto"`` only: bytes of full parameters (in the
            compute dtype) that may be gathered at once. Default: a quarter
            (``memory.AUTO_BUDGET_FRACTION``) of the memory free on this rank's device
            (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` divided among the
            ranks on the host), minus the parameter, gradient and AdamW state shards the
            planner predicts, the minimum over all ranks. The rest of free memory is
            left for activations, the computing unit's gradients and communication.
        reproducible: results that do not depend on the world size (Note
            [reproducible reduction] in exact/reduce.py; docs/reproducible.md): each
            backward is one micro-batch, whose gradients are summed exactly; the
            gradient is their mean over all micro-batches of all ranks. Split batches
            with :func:`~shardwise.micro_batches`. Flat sharding only for now.
        offload: a :class:`~shardwise.Offload` placing the parameter shards and the
            optimizer state (with the gradients) on the device, in host memory or on
            disk (docs/offload.md); ``None`` keeps everything on the device. Training
            gives the same bits wherever the states live.

    Raises:
        ShardwiseError: when torch.distributed is not initialised, the module or one of
            its submodules is already sharded, both ``group`` and ``mesh`` are given or
            the mesh is not 1-D or 2-D, ``reshard_after_forward`` is an int that does
            not divide the shard group's size, ``src_rank`` is out of range, a policy or
            ``units`` is invalid, ``units`` matches no submodule, ``memory_budget`` is not
            a positive int or is given without ``units="auto"``, ``offload`` is not an
            ``Offload`` or its folder cannot be taken, a parameter is 0-dim, a parameter
            is a tensor subclass or an ``nn.Parameter`` subclass without FSDP2's
            extension protocol, or one with it requires grad, does not split into equal
            shards, or is given with ``offload``, a tensor-parallel DTensor parameter
            cannot be sharded over ``mesh`` or comes with ``offload`` or
            ``sharded_init`` (:func:`~shardwise.engine.groups.tensor_parallel.refusal`),
            or ``src_rank`` holds meta tensors; also when ranks disagree (one rank failed
            any of these, or ranks built different models or passed different
            ``units=``): then every rank raises the same error.

    Example:
        >>> sw.init_distributed()
        >>> model = sw.shard(GPT(cfg))
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        >>> big = sw.shard(GPT(cfg), units="auto", memory_budget=2 * 2**30)  # 2 GiB
        >>> # across 2 nodes of 8 GPUs: shard within a node, replicate across nodes
        >>> model = sw.shard(GPT(cfg), mesh=init_device_mesh("cuda", (2, 8)))
    """
    topo = _check_arguments(module, group, mesh, src_rank, mixed_precision)
    mp = mixed_precision or MixedPrecision()
    _check_settings(topo, reshard_after_forward, reproducible, mixed_precision, prefetch,
                    offload)
    device = _device_for(module, topo.world)
    budget = _budget(module, topo, device, units, memory_budget, mp)  # agreed by all ranks
    # Note [agreed failure]: a units callable raising on one rank, or src_rank holding
    # meta tensors, fails every rank here, before the first collective.
    plan = agreed(topo.world, f"sw.shard({type(module).__name__}) failed",
                  functools.partial(_plan, module, topo, device, units, budget,
                                    memory_budget is not None, prefetch,
                                    reshard_after_forward, mp, src_rank, offload, buffers,
                                    reproducible))
    settings = Settings(reshard_after_forward, prefetch, reproducible, mp.param_dtype,
                        src_rank)
    _agree_structure(topo.world, plan.units, _compared(settings, plan.buffers, topo.world, mp))
    build(module, plan, topo, device, settings)
    maybe_check(module)
    return module


def _check_settings(topo: Topology, reshard_after_forward: bool | int, reproducible: object,
                    mixed_precision: MixedPrecision | None, prefetch: object,
                    offload: object) -> None:
    """Refuse settings that are wrong whatever the model."""
    check_secondary(topo, reshard_after_forward)
    _check_reproducible(reproducible, topo, mixed_precision)
    if type(prefetch) is not int or prefetch < 0:
        raise ShardwiseError(f"prefetch={prefetch!r}: expected a non-negative integer")
    if offload is not None and not isinstance(offload, Offload):
        raise ShardwiseError(f"offload={offload!r}: expected sw.Offload(params=..., "
                             f"optimizer=..., folder=...) or None")


def _budget(module: nn.Module, topo: Topology, device: torch.device, units: UnitSpec,
            memory_budget: int | None, mp: MixedPrecision) -> int | None:
    """The memory budget ``units="auto"`` plans for (the given one, or the default the
    ranks agree on); ``None`` for any other ``units``."""
    _check_budget(units, memory_budget)
    if units != AUTO:
        return None
    # "auto" lays out groups to measure its choices, before the records' checks: a 0-dim
    # parameter would reach the layout as a bare ValueError.
    _refuse_scalars([n for n, p in module.named_parameters() if p.dim() == 0])
    if memory_budget is not None:
        return memory_budget
    return _default_budget(module, topo, device, mp)


def _plan(module: nn.Module, topo: Topology, device: torch.device, units: UnitSpec,
          budget: int | None, budget_given: bool, prefetch: int,
          reshard_after_forward: bool | int,
          mp: MixedPrecision, src_rank: int, offload: Offload | None,
          buffers: str | BufferPolicy, reproducible: bool = False) -> Plan:
    """Choose the units, the parameters each owns and their groups (``planning/``), say
    what was chosen, then check that the engine can take them (``engine/``); nothing
    changes yet."""
    shards = topo.shard.world_size
    auto = None
    if budget is not None:
        # Its choice comes with the plan it measured, groups laid out: that is built.
        auto = auto_units(module, budget, shards, mp.param_dtype, prefetch,
                          bool(reshard_after_forward), mp.reduce_dtype)
        chosen, records = auto.chosen, auto.records
        _check_prefetch(prefetch, len(chosen))
        per_unit = [u.records for u in auto.units]
        _report_auto(auto, given=budget_given)
    else:
        chosen = choose_units(module, units)
        _check_prefetch(prefetch, len(chosen))
        records = discover_params(module, [n for n, _ in chosen])
        per_unit = assign_units(records, [n for n, _ in chosen])
    warn_if_one_unit_dominates([sum(r.param.numel() for r in recs) for recs in per_unit],
                               [n for n, _ in chosen], shards, units)
    # Each group releases its originals as it is built (engine/build.py): only the plan
    # may hold the records.
    _check_params(records, topo.world.rank, src_rank, offload, shards, mp.param_dtype,
                  device, topo.given, reproducible, module)
    if any(gathers_bytes(r.param) for r in records):
        shard_mesh(topo)  # refuses a 2-D mesh without names, before anything changes
    # Laid out once the parameters passed their checks (a 0-dim one is refused by name).
    planned = auto.units if auto is not None else plan_units(
        chosen, per_unit, mp.param_dtype, mp.reduce_dtype, shards)
    placement = offload.resolve(device, topo.world.rank) if offload is not None else None
    return Plan(planned, placement, buffer_policy(buffers))


def _check_prefetch(prefetch: int, units: int) -> None:
    # prefetch=k gathers the k units that ran after (forward) or before (backward) the
    # one computing, so k >= units - 1 already keeps every unit gathered ahead (no
    # saving over DDP); a k above the number of units is a mistake (a byte count?
    # 10**9?), refused rather than clamped so that the user learns what the number
    # means. Up to the number of units is allowed, so that the default 1 holds for a
    # one-unit model; the message says so, and why more would gain nothing.
    if prefetch > units:
        raise ShardwiseError(
            f"prefetch={prefetch}: the model has {units} unit(s), so prefetch is "
            f"at most {units} (from {max(units - 1, 0)} on, every other "
            f"unit is already gathered ahead of the one computing); prefetch counts "
            f"units, each one more unit of full parameters in memory. Use 1 (the "
            f"default) or 2 when all-gathers are slow next to compute")


def _check_arguments(module: nn.Module, group: dist.ProcessGroup | None,
                     mesh: DeviceMesh | None, src_rank: int,
                     mixed_precision: object) -> Topology:
    """Refuse what cannot be sharded; the groups' :class:`Topology` otherwise."""
    require_module(module, "sw.shard")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ShardwiseError(f"sw.shard: mixed_precision={mixed_precision!r}: expected "
                             f"sw.MixedPrecision(param_dtype=..., reduce_dtype=...) or None")
    require_rank(src_rank, "sw.shard")
    require_group(group, "sw.shard")
    if not dist.is_initialized():
        raise ShardwiseError("torch.distributed is not initialised: call sw.init_distributed() "
                             "first (under torchrun, or as a world of one process)")
    for name, sub in module.named_modules():
        if is_sharded(sub):
            where = f"its submodule {name!r}" if name else "it"
            raise ShardwiseError(f"cannot shard {type(module).__name__}: {where} is already "
                                 f"sharded. Shard the outermost model once and pick units "
                                 f"with units=...")
    topo = topology(group, mesh)
    if not 0 <= src_rank < topo.world.world_size:
        raise ShardwiseError(f"src_rank={src_rank} is not a rank of a group of "
                             f"{topo.world.world_size}")
    return topo


def _check_reproducible(reproducible: object, topo: Topology,
                        mp: MixedPrecision | None) -> None:
    """Refuse what the reproducible mode cannot honour (Note [reproducible reduction])."""
    if not isinstance(reproducible, bool):
        raise ShardwiseError(f"reproducible={reproducible!r}: expected True or False")
    if not reproducible:
        return
    if topo.replicate is not None:
        raise ShardwiseError("reproducible=True with a 2-D mesh (hybrid sharding) is not "
                             "supported yet: shard flat (group= or a 1-D mesh)")
    if mp is not None and mp.reduce_dtype not in (None, torch.float32):
        raise ShardwiseError(f"reproducible=True sums gradients exactly and hands them out "
                             f"in fp32; reduce_dtype={mp.reduce_dtype} would round them per "
                             f"rank first. Leave reduce_dtype unset")
    if torch.cuda.is_available() and torch.cuda.is_initialized() and \
            not torch.are_deterministic_algorithms_enabled():
        raise ShardwiseError("reproducible=True on CUDA needs deterministic kernels: call "
                             "torch.use_deterministic_algorithms(True) first (and set "
                             "CUBLAS_WORKSPACE_CONFIG=:4096:8, as torch asks)")


def _check_budget(units: UnitSpec, memory_budget: object) -> None:
    if memory_budget is None:
        return
    if units != AUTO:
        raise ShardwiseError(f"memory_budget={memory_budget!r} applies to units='auto' only "
                             f"(units={units!r} was passed): pass units='auto' to let "
                             f"shardwise choose units within the budget, or drop "
                             f"memory_budget")
    if not isinstance(memory_budget, int) or isinstance(memory_budget, bool) \
            or memory_budget <= 0:
        raise ShardwiseError(f"memory_budget={memory_budget!r}: expected a positive int, "
                             f"in bytes of full parameters gathered at once (e.g. "
                             f"memory_budget=4 * 2**30 for 4 GiB), or None for the default")


def _default_budget(module: nn.Module, topo: Topology, device: torch.device,
                    mp: MixedPrecision) -> int:
    """``units="auto"``'s default budget (see :func:`shard`), the same on every rank.

    One exchange of every rank's free memory: ranks sharing a device (CPU ranks on one
    host) share its free memory, and the smallest share bounds every rank, since all
    ranks gather the same units.
    """
    comm = topo.world
    try:
        mine: tuple[str, str, int | str] = (socket.gethostname(), str(device),
                                            free_memory(device))
    except (OSError, ValueError, RuntimeError) as e:
        mine = (socket.gethostname(), str(device), f"{type(e).__name__}: {e}")
    everyone = comm.all_gather_object(mine, what="units='auto': the exchange of free memory")
    failed = [f"rank {r}: {free}" for r, (_, _, free) in enumerate(everyone)
              if not isinstance(free, int)]
    if failed:
        raise ShardwiseError("units='auto' could not read the free memory of every rank ("
                             + "; ".join(failed) + "): pass memory_budget=<bytes> to sw.shard")
    sharing = Counter((host, dev) for host, dev, _ in everyone)
    share = min(int(free) // sharing[(host, dev)] for host, dev, free in everyone)
    from .planning.planner import (
        plan,  # imported where it is used: the planner is above the units it plans
    )

    state = plan(module, topo.shard.world_size, "adamw", mp.param_dtype)
    sharded = state.parameters + state.gradients + state.optimizer
    budget = max(int(share * AUTO_BUDGET_FRACTION) - sharded, 0)
    logger.info("units='auto': default budget %.1f MiB = %.0f%% of %.1f MiB free per rank "
                "- %.1f MiB of sharded parameters, gradients and AdamW state", budget / 2**20,
                100 * AUTO_BUDGET_FRACTION, share / 2**20, sharded / 2**20)
    return budget


def _report_auto(auto: AutoChoice, given: bool) -> None:
    """Log what ``units="auto"`` chose; warn when even its finest choice is over budget."""
    names = [n or "<root>" for n, _ in auto.chosen]
    tried = ", ".join(f"{n} units: {peak / 2**20:.2f} MiB" for n, peak in auto.tried)
    logger.info("units='auto': %d units %s%s, %.2f MiB gathered at once, budget %.2f MiB "
                "(%s); tried %s", len(names), names[:6], " ..." if len(names) > 6 else "",
                auto.peak / 2**20, auto.budget / 2**20, "given" if given else "default",
                tried)
    if not auto.fits:
        over = auto.peak - auto.budget
        warnings.warn(
            f"shardwise: units='auto' found no units whose full parameters fit the memory "
            f"budget of {auto.budget} bytes ({auto.budget / 2**20:.2f} MiB"
            f"{'' if given else ', the default'}): the split with the lowest peak, "
            f"{len(names)} units, gathers {auto.peak} bytes at once, {over} bytes "
            f"({over / 2**20:.2f} MiB) over, and is used anyway. Finer splits gather no "
            f"less: the excess is in modules without parameter-holding submodules, or in "
            f"parameters the root owns (e.g. a tied embedding). Raise memory_budget, "
            f"gather in lower precision (mixed_precision=), or shard over more ranks",
            stacklevel=3)


def _compared(settings: Settings, buffers: BufferPolicy, comm: Comm, mp: MixedPrecision
              ) -> dict[str, object]:
    """Every setting that decides what ranks communicate, for :func:`_agree_structure`."""
    compared: dict[str, object] = dict(vars(settings))
    compared.pop("cast_inputs")  # mixed_precision says it
    compared.update(buffers=buffers.value,
                    mixed_precision=(str(mp.param_dtype), str(mp.reduce_dtype)),
                    SHARDWISE_CHECK=order_checks_enabled(comm))
    return compared


def _agree_structure(comm: Comm, units: list[UnitPlan], settings: dict[str, object]) -> None:
    """Raise on every rank unless all ranks chose the same units over the same parameters
    and were given the same ``settings`` (every argument that decides communication, and
    whether the order check is on).

    Ranks that built different models, or passed different ``units=``, ``prefetch=`` or
    ``reproducible=``, would otherwise issue mismatched collectives: a hang, or gloo
    aborting the process. One all-gather of a short fingerprint per rank, once per
    ``shard``.
    """
    desc = [(u.name, [(r.fqns[0], tuple(r.param.shape), str(r.param.dtype),
                       r.param.requires_grad) for r in u.records])
            for u in units]
    digest = hashlib.sha256(repr(desc).encode()).hexdigest()[:16]
    summary = f"{len(desc)} units, {sum(len(p) for _, p in desc)} parameters"
    everyone = comm.all_gather_object((digest, summary, [name for name, _ in desc],
                                       tuple(sorted((k, repr(v)) for k, v in settings.items()))),
                                      what="shard()'s structure check")
    if len({s for _, _, _, s in everyone}) > 1:
        theirs = [dict(s) for _, _, _, s in everyone]
        differ = [k for k in settings if len({t.get(k) for t in theirs}) > 1]
        lines = [f"  {k}: " + ", ".join(f"rank {r} {t.get(k)}" for r, t in enumerate(theirs))
                 for k in differ]
        raise ShardwiseError("ranks called sw.shard with different settings, which decide "
                             "what every rank communicates; pass the same arguments (and "
                             "the same SHARDWISE_CHECK) on every rank:\n" + "\n".join(lines))
    if len({d for d, _, _, _ in everyone}) > 1:
        lines = [f"  rank {r}: {s}, units {names[:6]}{' ...' if len(names) > 6 else ''}"
                 for r, (_, s, names, _) in enumerate(everyone)]
        raise ShardwiseError("ranks are sharding different models (or passed different "
                             "units=): every rank must build the same model and pass the "
                             "same arguments to sw.shard\n" + "\n".join(lines))


def _check_params(records: list[ParamRecord], rank: int, src_rank: int,
                  offload: Offload | None, shards: int,
                  compute_dtype: torch.dtype | None, device: torch.device,
                  given: DeviceMesh | None = None, reproducible: bool = False,
                  root: nn.Module | None = None) -> None:
    _check_tensor_parallel(records, given, offload, root)
    refused = [why for r in records if (why := refusal(r.fqns[0], r.param)) is not None]
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise ShardwiseError(refused[0] + more)
    subclasses = [r for r in records if gathers_bytes(r.param)]
    for r in subclasses:
        # Refuses what cannot be divided among the ranks, before any change (Note
        # [uneven packed parameters] in engine/groups/subclass.py).
        cut(r.fqns[0], r.param, shards, compute_dtype)
    if subclasses and offload is not None and offload.param_tier != "device" \
            and device.type != "cpu":
        # Note [packed bytes offloaded] in engine/groups/subclass.py: optimizer tiers take
        # only the trainable groups (adapters), which are flat; the subclasses' bytes are
        # frozen and have no optimizer state.
        raise ShardwiseError(f"Offload(params={offload.params!r}) does not take frozen "
                             f"tensor-subclass parameters (a QLoRA base's weights) on a "
                             f"{device.type} device yet ({subclasses[0].fqns[0]}, ...): "
                             f"their bytes would have to be staged on the device for "
                             f"every gather. Offload the adapters' master shards and "
                             f"optimizer state with Offload(optimizer="
                             f"{offload.optimizer!r}) (params on the device); a QLoRA "
                             f"base's 4-bit weights are already a quarter of their "
                             f"full-precision size or less")
    _refuse_scalars([r.fqns[0] for r in records if r.param.dim() == 0])
    if rank == src_rank:
        meta = [r.fqns[0] for r in records if r.param.is_meta and init_piece(r.param) is None]
        if meta:
            raise ShardwiseError(f"rank {src_rank} (src_rank) holds meta parameters "
                                 f"{meta[:5]}: materialise them first, or build the model "
                                 f"under sw.sharded_init()")


def _check_tensor_parallel(records: list[ParamRecord], given: DeviceMesh | None,
                           offload: Offload | None, root: nn.Module | None) -> None:
    """Refuse, by name, tensor-parallel parameters (DTensors placed by torch's
    ``parallelize_module``: Note [tensor-parallel parameters] in
    engine/groups/tensor_parallel.py) that ``given`` (the mesh ``shard`` was given) cannot
    shard, and the modes not built for them yet. An attention module's ``head_dim``
    (Hugging Face's) says how many heads its projections' rows hold."""
    specs = [(r, spec) for r in records if (spec := attached(r.param, TENSOR_PARALLEL)) is not None]
    if not specs:
        return
    for r, spec in specs:
        # The projection's parent, an attention module; never the root, whose own
        # head_dim (a model's attribute) says nothing of a vocab-parallel head's rows.
        owner = r.fqns[0].rpartition(".")[0].rpartition(".")[0]
        head_dim = getattr(root.get_submodule(owner), "head_dim", None) \
            if root is not None and owner else None
        why = tp_refusal(spec, given, r.param, head_dim if type(head_dim) is int else None)
        if why is not None:
            raise ShardwiseError(why)
    name = specs[0][1].name
    modes = [(offload is not None, "offload="),
             (any(init_piece(r.param) is not None for r in records), "sw.sharded_init")]
    for on, mode in modes:
        if on:
            raise ShardwiseError(f"{mode} does not take tensor-parallel parameters yet "
                                 f"({name}, ...; docs/status.md): shard the tensor-parallel "
                                 f"model without it")


def _refuse_scalars(names: list[str]) -> None:
    """Refuse 0-dim parameters, by name: rows are what shardwise divides."""
    if names:
        raise ShardwiseError(f"0-dim parameters cannot be sharded on dim 0: {names[:5]}. "
                             f"Make them 1-element parameters (shape (1,)) before sw.shard")
