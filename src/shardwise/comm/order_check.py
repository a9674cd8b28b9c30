"""The collective-order check: ranks agree on what they are about to do, or all raise.

Note [collective order] in engine/iteration/state.py says why every rank must issue the same
collectives in the same order. When ranks diverge anyway (a rank that caught an exception and went
on, skipped a unit, or alone called ``full_state_dict``), their next collectives pair up
wrongly; under gloo, two messages of different sizes abort the process (SIGABRT inside
gloo) instead of raising. So ranks say what they do at each unit's forward, at the end of
the root's forward, at the start of a backward, after an optimizer step driven by an
integration, and before each public operation that communicates, and every rank raises
one error naming what each rank was doing when they differ.

Under gloo (on by default) what ranks say travels in small messages that ride the units'
exchanges and are compared when their data is waited for, without a round trip of their
own: Note [checks ride the exchanges] in comm/channel.py. Under other backends
(``SHARDWISE_CHECK=1``; off by default, where reading a result would stall the host on
every unit) each check is one synchronous all-reduce of a fixed size, so that even
mismatched checks pair up, and any difference shows in the maximum.
``SHARDWISE_CHECK=0`` turns checks off everywhere, ``SHARDWISE_CHECK=1`` on everywhere
(with the consistency checks of ``consistency.maybe_check``).
"""

from __future__ import annotations

import functools
import inspect
import zlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from .._args import require_group, require_module, require_optimizer
from .agree import same_everywhere
from .channel import BACKWARD, END_FORWARD, OPERATION, OPTIMIZER_STEP, diverged
from .channel import order_checks_enabled as order_checks_enabled
from .collectives import Comm
from .peers import ACTIVITY

F = TypeVar("F", bound=Callable[..., Any])

_UNIT = 6  # the collective check's kind for a unit (the others are the channel's)


class OrderCheck:
    """One root forward's checks: one per unit that communicates, one at its end.

    ``model`` numbers the sharded model among those on its group, so that two models of
    the same structure (a model and its EMA copy) are told apart."""

    def __init__(self, comm: Comm, model: int) -> None:
        self.comm = comm
        self.model = model
        channel = comm.channel
        self.channel = channel if channel.messages else None
        if self.channel is not None:
            self.channel.new_forward()
        self._checked = 0  # unit checks in the current root forward

    def unit(self, index: int, name: str) -> None:
        """Raise on every rank unless all ranks are about to run unit ``index`` (under
        gloo: note it, for the next header to carry; the next unit's exchange or the end
        of the forward compares it). The engine decides which unit calls are checked
        (``ModelState._order_checked``)."""
        position = self._checked
        self._checked += 1
        if self.channel is not None:
            self.channel.set_doing((self.model << 40) | (position << 20) | index,
                                   f"unit {name}")
            return
        # The first check of a forward is where a rank running the model alone waits
        # first: only that wait watches the peers (Note [peer watch]).
        _agree(self.comm, _UNIT, index, f"unit {name}", position == 0)

    def end_forward(self, calls: int) -> None:
        """Raise on every rank unless all ranks end the forward here. Catches a rank that
        skips the *last* unit, whose peers would otherwise wait in that unit's check."""
        if self._checked:
            self._checked = 0
            self._check(END_FORWARD, calls,
                        f"the end of the forward after {calls} unit calls")
            if self.channel is not None:
                # The forward's divergences surface in the forward (its caller may not
                # run a backward); one wait per forward, not one per unit.
                self.channel.settle()

    def backward(self, synced: bool = True) -> None:
        """Raise on every rank unless all ranks start a backward here, all of them synced
        or all under ``no_sync``: a rank that runs one micro-batch more than its peers
        meets their synced backward with one of its ``no_sync`` ones, whose reduction it
        would never join (a hang until the timeout before)."""
        what = "the backward" if synced else "a backward under sw.no_sync"
        if self.channel is not None:
            self.channel.set_doing((self.model << 40) | (1 << 39) | int(synced), what,
                                   exchange_headers=False)
        self._check(BACKWARD, int(synced), what)

    def _check(self, kind: int, index: int, what: str) -> None:
        if self.channel is not None:
            self.channel.post(kind, index, self.model, what, what)
        else:
            _agree(self.comm, kind, index, what)


class ModelChecks:
    """One sharded model's order checks, forward after forward (Note [collective order]
    in engine/iteration/state.py): an :class:`OrderCheck` for each forward that communicates, none
    for one inside ``gathered()`` (Note [a forward inside gathered]), which keeps the
    check of an awaited backward's forward when it joins one.

    ``model`` numbers the model among those on its group (``ModelState.number``)."""

    def __init__(self, comm: Comm, model: int) -> None:
        self.comm = comm
        self.model = model
        self.current: OrderCheck | None = None  # the running (or awaited) forward's
        self._epoch = comm.channel.epoch  # Note [checks ride the exchanges]

    def diverging(self) -> bool:
        """Whether ranks diverged since the last :meth:`diverged`, which says it once."""
        return self.comm.channel.epoch != self._epoch

    def diverged(self) -> bool:
        """Whether ranks diverged (an order check raised) since the last call: the
        orders they recorded may differ then, and the engine forgets its own."""
        epoch = self.comm.channel.epoch
        if epoch == self._epoch:
            return False
        self._epoch = epoch
        return True

    def start_forward(self, communicates: bool, joins: bool) -> None:
        """A forward starts; ``joins``: it joins one whose backward is awaited."""
        if communicates:
            self.current = (OrderCheck(self.comm, self.model)
                            if order_checks_enabled(self.comm) else None)
        elif not joins:
            self.current = None

    def unit(self, index: int, name: str) -> None:
        """A unit that communicates is called (see :meth:`OrderCheck.unit`)."""
        if self.current is not None:
            self.current.unit(index, name)

    def end_forward(self, calls: int) -> None:
        """The forward ends after ``calls`` recorded unit calls."""
        if self.current is not None:
            self.current.end_forward(calls)

    def backward(self, synced: bool) -> None:
        """A backward starts (see :meth:`OrderCheck.backward`)."""
        if self.current is not None:
            self.current.backward(synced)

    def abandon(self) -> None:
        """The forward raised and nothing awaits a backward: no check runs on."""
        self.current = None


Announcement = tuple[Comm | None, str, int | None]


def operation(name: str, announced: Callable[..., Announcement | None] | None = None
              ) -> Callable[[F], F]:
    """Declare the public function ``name``: the decorator notes it for the peer watch
    while it runs (Note [peer watch]), refuses a ``module``, ``optimizer`` or ``group``
    argument of the wrong kind, and, given ``announced``, checks before its body
    that every rank is starting the same call (:func:`announce`). ``announced`` takes the
    call's arguments by name and returns ``(group, text, model number)`` for
    :func:`announce`, or ``None`` when nothing is to be checked (an unsharded module
    where the function falls back to torch's)."""
    def wrap(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with ACTIVITY.operation(name):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                arguments = bound.arguments
                if "module" in arguments:
                    require_module(arguments["module"], name)
                if "optimizer" in arguments:
                    require_optimizer(arguments["optimizer"], name)
                if "group" in arguments:
                    require_group(arguments["group"], name)
                if announced is not None:
                    what = announced(**bound.arguments)
                    if what is not None:
                        announce(*what)
                return fn(*args, **kwargs)
        return cast(F, run)
    return wrap


def announce(comm: Comm | None, operation: str, model: int | None = None) -> None:
    """Raise on every rank unless all ranks are about to start ``operation`` (a public
    function that communicates), when order checks are on. ``model``: the number of the
    sharded model it works on (``ModelState.number``), so that two models of the same
    structure (a model and its EMA copy) are told apart."""
    if comm is None or not order_checks_enabled(comm):
        return
    code = zlib.crc32(operation.encode()) & 0x3FFFFFFF
    text = operation if not model else f"{operation} (sharded model {model})"
    channel = comm.channel
    if channel.messages:
        channel.set_doing(code, text)
        channel.post(OPERATION, code, 0 if model is None else model + 1, text, text)
        channel.settle()  # the operation's collectives follow: every rank must be here
        return
    _agree(comm, OPERATION, zlib.crc32(f"{operation}#{model}".encode()) & 0x3FFFFFFF, text,
           watch=True)


def watch_steps(comm: Comm, optimizer: torch.optim.Optimizer):
    """After each ``optimizer.step()``, raise on every rank unless all ranks have taken
    as many steps, when order checks are on. For the integrations, which drive the
    optimizer: a rank that skipped a step (a caught exception, a data loader that ran
    out early) would otherwise train on silently, diverged. Under gloo the step is noted
    for the next forward's first header (Note [checks ride the exchanges]); elsewhere one
    check as small as a unit's. Either way a rank that skipped the step meets it at its
    next forward's check, which names both.

    Returns:
        The hook's handle (``.remove()`` stops the checks).
    """
    taken = [0]

    def after_step(*_: object) -> None:
        taken[0] += 1
        if not order_checks_enabled(comm):
            return
        what = f"optimizer step {taken[0]}"
        channel = comm.channel
        if channel.messages:
            # Noted, not sent: the next forward's first header carries it, so no header
            # is left pending after the last step (Note [teardown] in comm/process_group.py).
            channel.set_doing((OPTIMIZER_STEP << 56) | taken[0], what, between_steps=True)
        else:
            _agree(comm, OPTIMIZER_STEP, taken[0], what)

    return optimizer.register_step_post_hook(after_step)


def _agree(comm: Comm, kind: int, index: int, what: str, watch: bool = False) -> None:
    """The check as one synchronous all-reduce (backends other than gloo)."""
    if same_everywhere(comm, [kind, index], f"the order check before {what}", watch):
        return
    raise diverged(comm.all_gather_object(what, what="the order check's error report"))
