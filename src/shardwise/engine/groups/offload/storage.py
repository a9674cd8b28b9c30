"""The host and disk tiers: one rank's ``Tiers`` (what ``Offload`` resolves to), a flat
group's storage there (its master shard, its parameter copy, its gradients and its
optimizer state, each on the tier Note [two states, three tiers] puts it on), and the
optimizer step over disk-offloaded state, one unit at a time.

Note [bytes moved]
``moved`` counts the bytes shardwise's own copies read from and write to the offload
tiers (host memory, disk): staging a shard for a gather, refreshing the parameters tier's
copy, parking reduced rows, publishing gradients, and (counted from the tensors it
stepped) the optimizer step's reads and writes of master shards, gradients and state.
``planning/planner.py`` predicts the same quantity per step from the layout, and a test
holds the two equal.

Note [reduced rows written once]
A unit's reduced rows leave the device (and, for the disk tier, memory) as soon as its
reduction is done, so that a backward's worth never piles up before the backward ends
and they are published as ``.grad``. On disk they used to wait in a file of their own
and were copied into the gradients' file when published: each gradient byte written
twice and read once more, and a file the size of the shard more per group. When no
parameter of the group holds a gradient (the step after ``zero_grad()``, the usual
case), nothing the rows could overwrite is anyone's gradient: they are written straight
to their slots in the gradients' file, in the master's dtype (the cast ``finish`` would
make), and publishing only hands each parameter the view of its slot, so the gradient
is written once per step and read once, by the optimizer. A parameter already holding a
gradient (backward passes summed without ``no_sync``, ``zero_grad(set_to_none=False)``)
is summed into it as before, at the end of the backward, so an aborted backward leaves
it untouched: its group parks the rows in a file of their own, made then. What was in
the gradients' file before is overwritten at the reduction instead of at the end of the
backward; only a tensor kept from a gradient ``zero_grad`` dropped still views it, and it
was overwritten at the end of the backward before. The CPU tier parks the rows in a host
tensor made for them (a copy even where host and device are one), in the master's
dtype, and publishes views of it as they are, where it copied each parameter's rows
once more before.

Note [stepping unit by unit]
Memory stays bounded only if one unit's master shards, gradients and optimizer state are
resident at a time (Note [the disk tier]). ``torch.optim`` optimizers step every
parameter in one call, so before the step runs (a global step pre-hook) the step is run
here once per unit, with each parameter group narrowed to that unit's parameters, while
the next unit's pages are read ahead. After each call the state the optimizer created is
moved into the unit's files and the unit's pages are dropped. The optimizer's own call
then finds no gradients (they are set aside until its post-hook puts them back), so it
changes nothing, and its hooks, LR-scheduler counters and return value behave as usual
(a closure is evaluated once, before the units step, and its loss returned).

Narrowing is exact only for optimizers that update each parameter from its own gradient
and state: the ``torch.optim`` classes in ``PER_PARAMETER`` (engine/groups/parts.py). Any
other is refused at its first step by name (``optimizer="cpu"`` steps any optimizer in
one call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from ...._registry import PARAM, SET_ASIDE_GRADS, attach_to, attached, detach_from
from ....errors import ShardwiseError
from ..alloc import freed, trim
from ..parts import PER_PARAMETER, OptimizerStep
from .disk import DiskBuffer, DiskFolder

TIERS = ("device", "cpu", "disk")  # nearest first

# The optimizer tiers any group of this process was ever given: until "cpu" or "disk" is
# here, an optimizer step has nothing of offload's to do, and skips the walk of its
# parameters (step_by_unit, after_step) that every step of every optimizer would pay.
OPTIMIZER_TIERS_USED: set[str] = set()


@dataclass(frozen=True)
class Tiers:
    """One rank's tiers: the compute device, and the disk folder when one is used. The
    ``Placement`` (engine/groups/parts.py) the engine is given for an ``Offload``."""

    params: str
    optimizer: str
    device: torch.device
    folder: DiskFolder | None

    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor; pinned when the device is a GPU, so that copies to it
        and from it can run asynchronously."""
        pin = self.device.type == "cuda"
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def describe(self) -> str:
        where = f" in {self.folder.path}" if self.folder is not None else ""
        return f"params on {self.params}, optimizer state on {self.optimizer}{where}"

    def storage(self, numel: int, dtype: torch.dtype, compute_dtype: torch.dtype
                ) -> GroupStorage:
        return GroupStorage(self, numel, dtype, compute_dtype)

    def optimizer_step(self) -> OptimizerStep:
        return TIER_STEP


class GroupStorage:
    """Where a group's states live when any is offloaded.

    ``master`` is the shard buffer (``FlatGroup.local``: the DTensor parameters view it);
    ``copy`` the parameters tier's copy in the compute dtype, or ``None`` when gathers
    read the master itself. It answers what a flat group asks of its storage
    (``ShardStorage`` in engine/groups/parts.py), as the device's storage does.
    """

    def __init__(self, placement: Tiers, numel: int, dtype: torch.dtype,
                 compute_dtype: torch.dtype) -> None:
        self.placement = placement
        self.device = placement.device  # where gathers and reductions run
        OPTIMIZER_TIERS_USED.add(placement.optimizer)
        self.numel = numel
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        self._disk: list[DiskBuffer] = []  # every disk buffer, released together
        self.master = self._make(placement.optimizer, dtype, "master")
        self._master_file = self._disk[0] if self._disk else None
        self.copy = (None if placement.params == placement.optimizer else
                     self._make(placement.params, compute_dtype, "params"))
        self.copy_version = -1  # the master's version the copy was taken at
        # Disk tier only, made at first use (a frozen group never has them):
        self._grads: torch.Tensor | None = None  # the gradients' home
        self._grads_buffer: DiskBuffer | None = None  # the file _grads views
        self._parked: torch.Tensor | None = None  # reduced rows until published (park)
        self._parked_file: DiskBuffer | None = None  # the file _parked views
        self._state: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self.moved = 0  # Note [bytes moved]

    def _disk_buffer(self, dtype: torch.dtype, what: str, writes: bool = False
                     ) -> DiskBuffer:
        assert self.placement.folder is not None, "Offload checked folder="
        buf = self.placement.folder.buffer(self.numel, dtype, what, writes)
        self._disk.append(buf)
        return buf

    def _make(self, tier: str, dtype: torch.dtype, what: str) -> torch.Tensor:
        if tier == "disk":
            return self._disk_buffer(dtype, what).tensor
        if tier == "cpu":
            return self.placement.host_tensor(self.numel, dtype)
        return torch.zeros(self.numel, dtype=dtype, device=self.placement.device)

    @property
    def on_disk(self) -> bool:
        return bool(self._disk)

    @property
    def streams_state(self) -> bool:
        """Whether the optimizer's state of the group's parameters lives in its files."""
        return self.placement.optimizer == "disk"

    def like(self) -> GroupStorage:
        """A storage of its own for a copy of the group (``copy.deepcopy``)."""
        return GroupStorage(self.placement, self.numel, self.dtype, self.compute_dtype)

    def recast(self, dtype: torch.dtype, compute: torch.dtype) -> None:
        raise AssertionError("an offloaded group is never cast: guards refuse it")

    def tiers(self) -> tuple[str, str]:
        """(the parameters tier, the optimizer tier)."""
        return self.placement.params, self.placement.optimizer

    def describe(self) -> str | None:
        return self.placement.describe()

    def freezing_refusal(self, changed: int, total: int, trainable_at_build: bool) -> str:
        """Note [freezing after shard]: its tiers were planned for a group trainable
        at ``shard``; only freezing or unfreezing all of such a group is followed."""
        if changed == total and trainable_at_build:
            return ""
        return ("in an offloaded unit: its tiers were laid out for the frozen and trainable "
                "parameters at sw.shard, so only freezing or unfreezing all of a unit's "
                "parameters that were trainable then is followed. Set requires_grad before "
                "sw.shard(model, offload=...) (Note [freezing after shard])")

    def cast_refusal(self, unit_name: str) -> str | None:
        return f"unit {unit_name} is offloaded (sw.Offload)"

    @property
    def steps_in_place(self) -> bool:
        """No: its step is the tiers' own (Note [stepping unit by unit])."""
        return False

    def full_freed(self, nbytes: int) -> None:
        """The group's full parameters' ``nbytes`` were freed."""
        if self.on_disk:
            # Note [a fixed mmap threshold]: free chunks left in the heap from before the
            # threshold was fixed would keep what each unit frees.
            freed(nbytes)

    # -- initial values, whole reads -------------------------------------------------
    def receiving(self) -> torch.Tensor:
        """Where initial shards are received: a device buffer (:meth:`received`)."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def check_files(self) -> None:
        """Raise if a disk tier file was truncated from outside (Note [tier files changed
        from outside] in engine/groups/offload/disk.py)."""
        for b in self._disk:
            b.check()

    def received(self, into: torch.Tensor) -> None:
        self.check_files()
        with torch.no_grad():
            self.master.copy_(into)
        self.release()

    def readable(self) -> torch.Tensor:
        """The master shard, copied to the device for a collective."""
        self.check_files()
        out = self.master.to(self.device, copy=True)
        self.release()
        return out

    # -- gathers ---------------------------------------------------------------------
    def gather_source(self, version: int) -> torch.Tensor:
        """The shard in the compute dtype on the device, for an all-gather: the
        parameters tier's copy when it is on the device, else a fresh staged copy."""
        self.check_files()
        if self.copy is not None and self.copy_version != version:
            self.refresh(version)
        src = self.master if self.copy is None else self.copy
        if src is self.copy and self.placement.params == "device":
            return src
        staged = torch.empty(self.numel, dtype=self.compute_dtype, device=self.placement.device)
        with torch.no_grad():
            staged.copy_(src)
        self.moved += _nbytes(src)
        self.release()
        return staged

    def refresh(self, version: int) -> None:
        """Take the parameters tier's copy from the master (which is at ``version``)."""
        assert self.copy is not None
        with torch.no_grad():
            self.copy.copy_(self.master)
        self.copy_version = version
        self.moved += _nbytes(self.master)
        if self.placement.params != "device":
            self.moved += _nbytes(self.copy)
        self.release()

    # -- gradients -------------------------------------------------------------------
    def park(self, out: torch.Tensor, params: list[Any]) -> torch.Tensor:
        """Reduced rows (``out``, on the device, the group's ``params``' rows at their
        slots) moved to the optimizer's tier until the backward ends and they are
        published, in the master's dtype (the cast ``finish`` would make) where they can
        be published as they are (Note [reduced rows written once]). For the disk tier:
        straight into the gradients' file when no parameter of the group holds a
        gradient, else into a file of their own (kept for the next backward); for the
        CPU tier, into a host tensor of their own (even where host and device are one)."""
        self.check_files()
        assert out.numel() <= self.numel
        if self.placement.optimizer != "disk":
            parked = out.detach().to("cpu", dtype=self.dtype, copy=True)
            self.moved += _nbytes(parked)
            return parked
        if all(p.shard.grad is None for p in params):
            self._grads_file()
            assert self._grads_buffer is not None
            # In the master's dtype (publish casts no more), written without reading the
            # old gradients (Note [writes that read nothing] in disk.py).
            rows = out.detach().reshape(-1).to(device="cpu", dtype=self.dtype)
            self._grads_buffer.write(rows)
            home = self._grads_buffer.tensor[:out.numel()]
            self.moved += _nbytes(home)
            self.release()
            return home
        self.moved += _nbytes(out)
        if self._parked is None or self._parked.dtype != out.dtype:
            self._parked_file = self._disk_buffer(out.dtype, "reduced")
            self._parked = self._parked_file.tensor
        home = self._parked[:out.numel()]
        with torch.no_grad():
            home.copy_(out.reshape(-1))
        self.release()
        return home

    def _grads_file(self) -> torch.Tensor:
        """The gradients' home on disk, the group's layout, made at first use."""
        if self._grads is None:
            self._grads_buffer = self._disk_buffer(self.dtype, "grads", writes=True)
            self._grads = self._grads_buffer.tensor
        return self._grads

    def publish(self, p: Any, rows: torch.Tensor) -> None:
        """Hand parameter ``p`` its reduced rows (parked, in its dtype) as a gradient on
        the optimizer's tier, or add them to the one it has."""
        existing = cast(DTensor | None, p.shard.grad)
        home = None
        if self.placement.optimizer == "disk":
            home = self._grads_file()[p.slot.offset:p.slot.offset + rows.numel()].view(
                rows.shape)
        if existing is None and (home is None or rows.data_ptr() == home.data_ptr()):
            # Note [reduced rows written once]: already where the gradient lives (on
            # disk), or in a host tensor park made for them alone (the CPU tier).
            p.shard.grad = p.as_dtensor(rows)
            return
        # Read from where they were parked, written to the gradient's home.
        self.moved += 2 * _nbytes(rows)
        if existing is not None:
            local = existing.to_local()
            with torch.no_grad():
                local.add_(rows.to(local.device))
            return
        assert home is not None
        with torch.no_grad():
            home.copy_(rows)
        p.shard.grad = p.as_dtensor(home)

    # -- optimizer state -------------------------------------------------------------
    def adopt_state(self, p: Any, key: str, value: DTensor) -> DTensor:
        """Parameter ``p``'s state ``key`` moved into this group's file for it (the
        value itself if it is there already)."""
        local = value.to_local()
        where = (key, local.dtype)
        if where not in self._state:
            self._state[where] = self._disk_buffer(local.dtype, f"state-{key}").tensor
        home = self._state[where][p.slot.offset:p.slot.offset + local.numel()].view(
            local.shape)
        if home.data_ptr() == local.data_ptr():
            return value
        with torch.no_grad():
            home.copy_(local)
        return cast(DTensor, p.as_dtensor(home))

    def count_step(self, p: Any, state: dict) -> None:
        """Note [bytes moved]: one step of ``p`` read its master rows, gradient and
        state, and wrote its master rows and state."""
        n = _nbytes(p.local)
        shaped = sum(_nbytes(v.to_local()) for v in state.values()
                     if isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape))
        self.moved += 3 * n + 2 * shaped

    # -- pages -----------------------------------------------------------------------
    def release(self) -> None:
        """Drop this group's disk pages from the process (Note [the disk tier])."""
        for b in self._disk:
            b.release()

    def prefetch(self, gather: bool = False) -> None:
        """Start reading this group's disk pages ahead of use: for a gather, the master
        shard's; for an optimizer step, every file but parked rows' (read by then)."""
        if gather:
            if self._master_file is not None and self.placement.params == "disk":
                self._master_file.prefetch()
            return
        for b in self._disk:
            if b is not self._parked_file:
                b.prefetch()

    def bytes_by_tier(self) -> dict[str, int]:
        """Bytes this group's storage holds on each tier: the master, the parameters
        copy, and on disk the gradients, any parked rows (Note [reduced rows written
        once]) and optimizer state (state the optimizer keeps in host memory is its
        own)."""
        out = dict.fromkeys(TIERS, 0)
        out[self.placement.optimizer] += _nbytes(self.master)
        if self.copy is not None:
            out[self.placement.params] += _nbytes(self.copy)
        for t in (self._grads, self._parked, *self._state.values()):
            if t is not None:
                out["disk"] += _nbytes(t)
        return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage(p: torch.Tensor) -> tuple[Any, GroupStorage | None]:
    """The sharded parameter behind ``p`` (engine/groups/flat.py's ShardedParam, found through
    the registry: this package sits below the groups that use it) and its group's
    offloaded storage, or ``None``."""
    sp = attached(p, PARAM)
    storage = getattr(sp.group, "storage", None) if sp is not None else None
    return sp, storage if isinstance(storage, GroupStorage) else None


def _buckets(optimizer: torch.optim.Optimizer
             ) -> tuple[list[tuple[list[GroupStorage], set[int]]], set[int]]:
    """The optimizer's parameters by disk-offloaded unit, in unit order, and the rest."""
    by_unit: dict[tuple[int, int], tuple[list[GroupStorage], set[int]]] = {}
    rest: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            sp, store = _storage(p)
            unit = sp.unit if sp is not None else None
            if store is None or store.placement.optimizer != "disk" or unit is None:
                rest.add(id(p))
                continue
            key = (unit.model.number, unit.index)
            if key not in by_unit:
                stores = [s for g in unit.groups
                          if isinstance(s := getattr(g, "storage", None), GroupStorage)]
                by_unit[key] = (stores, set())
            by_unit[key][1].add(id(p))
    return [by_unit[k] for k in sorted(by_unit)], rest


def _inner_step(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The class's step without torch's hook wrapper (which would call this module
    again, and the user's hooks once per unit)."""
    outer = type(optimizer).step
    inner = getattr(outer, "__wrapped__", None)
    if not getattr(outer, "hooked", False) or inner is None:
        raise ShardwiseError(f"{type(optimizer).__name__}.step is not torch's hooked step, "
                             f"so shardwise cannot step its disk-offloaded state unit by "
                             f"unit; use Offload(optimizer='cpu')")
    return inner


def _refuse(optimizer: torch.optim.Optimizer) -> None:
    cls = type(optimizer)
    if cls.__name__ not in PER_PARAMETER or not cls.__module__.startswith("torch.optim"):
        raise ShardwiseError(
            f"{cls.__module__}.{cls.__name__} cannot step disk-offloaded state: shardwise "
            f"steps it one unit at a time to keep memory bounded, which gives the same "
            f"result only for optimizers that update each parameter from its own gradient "
            f"and state (torch.optim's {', '.join(sorted(PER_PARAMETER))}). Nothing was "
            f"updated. Use Offload(optimizer='cpu'), which steps any optimizer")
    if optimizer._optimizer_step_pre_hooks:
        raise ShardwiseError(
            f"{cls.__name__} has step pre-hooks (register_step_pre_hook), which would run "
            f"after shardwise stepped its disk-offloaded state unit by unit. Nothing was "
            f"updated. Do their work before optimizer.step(), or use "
            f"Offload(optimizer='cpu')")


def step_by_unit(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
                 ) -> tuple[tuple, dict] | None:
    """Note [stepping unit by unit]: run the step, and return the arguments that make
    the optimizer's own call change nothing (``None``: no disk-offloaded state here)."""
    if "disk" not in OPTIMIZER_TIERS_USED:
        return None
    buckets, rest = _buckets(optimizer)
    if not buckets:
        return None
    _refuse(optimizer)
    inner = _inner_step(optimizer)
    # ``args`` are the step's own: the optimizer, then the closure if passed by position.
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    saved = [g["params"] for g in optimizer.param_groups]
    plan: list[tuple[list[GroupStorage], set[int]]] = ([([], rest)] if rest else []) + buckets
    try:
        for i, (stores, members) in enumerate(plan):
            if i + 1 < len(plan):
                for s in plan[i + 1][0]:
                    s.prefetch()
            for s in stores:  # Note [tier files changed from outside] in disk.py
                s.check_files()
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = [p for p in params if id(p) in members]
            inner(optimizer)
            stepped = [p for ps in saved for p in ps if id(p) in members]
            moved = _adopt(optimizer, stepped)
            _count(optimizer, stepped)
            for s in stores:
                s.release()
            if moved:
                # The state just made in memory, freed, would otherwise stay in glibc's
                # heap until the end of the step (Note [a fixed mmap threshold]).
                trim()
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        # The step's temporaries, freed, stay in glibc's heap otherwise (Note [a fixed
        # mmap threshold]; what they came to: BENCHMARKS.md, "Offload").
        trim()
    stash = {}
    for params in saved:
        for p in params:
            if p.grad is not None:
                stash[p] = p.grad
                p.grad = None
    attach_to(optimizer, SET_ASIDE_GRADS, stash)
    return (optimizer,), {"closure": (lambda: loss)} if closure is not None else {}


def after_step(optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """After the optimizer's own call: give the parameters their gradients back (after a
    unit-by-unit step, whose traffic was counted then), or count what the step of state
    in host memory read and wrote (Note [bytes moved])."""
    stash = attached(optimizer, SET_ASIDE_GRADS)
    if stash is None:
        if "cpu" not in OPTIMIZER_TIERS_USED:
            return
        _count(optimizer, [p for g in optimizer.param_groups for p in g["params"]],
               tier="cpu")
        return
    detach_from(optimizer, SET_ASIDE_GRADS)
    for p, grad in stash.items():
        p.grad = grad


def _count(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
           tier: str | None = None) -> None:
    for p in params:
        sp, store = _storage(p)
        if p.grad is None or store is None:
            continue
        if tier is None or store.placement.optimizer == tier:
            store.count_step(sp, optimizer.state.get(p, {}))


def _adopt(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> int:
    """Move the state the step made for ``params`` into their units' files; how many
    tensors moved."""
    moved = 0
    for p in params:
        sp, store = _storage(p)
        st = optimizer.state.get(p)
        if store is None or not st:
            continue
        for k, v in list(st.items()):
            if isinstance(v, DTensor) and tuple(v.shape) == tuple(p.shape):
                st[k] = store.adopt_state(sp, k, v)
                moved += st[k] is not v
    return moved


class _TierStep:
    """The tiers' part of every optimizer step (``Placement.optimizer_step``): Note
    [stepping unit by unit] before it, and after it the gradients given back or the host
    tier's traffic counted (Note [bytes moved])."""

    def before(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict
               ) -> tuple[tuple, dict] | None:
        return step_by_unit(optimizer, args, kwargs)

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        after_step(optimizer, args, kwargs)


TIER_STEP = _TierStep()
