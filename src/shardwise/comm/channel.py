"""Check messages: ranks learn that they do the same thing without waiting for each other.

Note [checks ride the exchanges]
Under gloo, the collective-order check (Note [collective order] in engine/iteration/state.py) is a
stream of small fixed-size messages, *headers*, each rank sending one to every peer of the
model's group at each point it checks. Every exchange of the forward (Note [gloo
exchanges] in comm/collectives.py) sends a header just before its data, saying what it is (its
collective, unit and message size) and what the rank is doing ("unit blocks.3"); the
points that exchange nothing send a header of their own: the end of a forward, the start
of a backward, a public operation (an optimizer step driven by an integration is only
noted, for the next forward's first header to carry). A rank compares its peers' headers
with its own, in order, before it relies on them: the headers up to an exchange's own
before waiting for its data, all of them before any other wait, before any collective,
before a backward's first gradients are taken for reduction (so a backward the ranks did
not run together adds nothing to what ``no_sync`` accumulated), at the end of each
forward (so that a forward's divergence raises in that forward) and at each public
operation. A
peer's header leaves with the data of the same exchange, so it is there when the data
is. The exchanges of a backward carry no header: autograd runs the same graph on every
rank once the forward and the backward's own header agreed (the old check, too, had one
check per backward). Per training step of a model with U units: about U + 2 headers, one
message to each peer each, and one wait for the peers, at the end of the forward, instead
of U + 2 synchronous all-reduces, each holding every rank until the slowest arrived
(BENCHMARKS.md, "The collective-order check without a round trip", has the cost of both).

Why this is safe:
- Headers have one size, under a tag made of the epoch and a generation counted per
  channel: one rank's g-th header pairs with every other rank's g-th, whatever they say,
  so ranks that diverged still compare, and every rank finds the same first difference
  (each sees every rank's g-th header).
- Data travels under tags that carry its message size (``data_tag``): exchanges that
  ranks which diverged issued before comparing headers never pair messages of different
  sizes (gloo aborts the process on those), and their data is never used, for each
  exchange's data is waited for only once its header matched.
- On a difference every rank raises the same error and moves the channel to the next
  epoch, which is part of every tag: what the old epoch left unpaired can never pair with
  new messages, so training goes on after the error with no collective to resynchronise.
  Works of the old epoch are kept alive (gloo still owns their buffers) and never waited
  for. Epochs would repeat after 64 such errors on one group: after 63, shardwise refuses
  to use the group (``Channel.broken``).

A header that has not arrived when needed is waited for on a helper thread (a gloo
point-to-point wait that times out breaks the whole group, so it cannot be sliced), while
this thread watches the peers (Note [peer watch] in comm/peers.py): a rank left alone ends in
an error saying what every rank is doing, a peer that died in an error at once, and a
peer that never comes at the group's timeout. Under other backends (NCCL, or a group
mixing gloo and NCCL) the check, when ``SHARDWISE_CHECK=1`` turns it on, stays one
synchronous all-reduce (``comm/order_check.py``).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
import zlib
from collections import deque
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._env import check_setting
from ..errors import ShardwiseError
from .peers import wait_watched

# Tags: bit 30 marks every shardwise message (far above the small tags user code passes
# to send/recv), bit 29 a header. Headers: epoch, then generation. Data: its collective,
# epoch, a counter per group (keeps a few exchanges of one size in flight apart) and a
# fingerprint of its byte size.
_MARK, _HEADER, _REDUCE = 1 << 30, 1 << 29, 1 << 28
_EPOCH_SHIFT, _EPOCHS = 22, 64
_GENERATIONS = 1 << 22
_COUNTER_SHIFT, _COUNTERS = 20, 4
_SIZE_PRINTS = 1 << 20

# A header: the fields compared, the description's length and bytes, a sentinel.
_FIELDS, _KEY = 64, 4
_TEXT_BYTES = (_FIELDS - _KEY - 2) * 8

_NAP = 5e-5     # seconds between looks at a header not yet arrived
_NAPS = 40      # looks before the wait moves to a helper thread (about 5 ms)

EXCHANGE, END_FORWARD, BACKWARD, OPERATION, OPTIMIZER_STEP = 1, 2, 3, 4, 5


def order_checks_enabled(comm: Any) -> bool:
    """Whether ranks check the order of what they do (read at each use): as
    ``SHARDWISE_CHECK`` says, and by default under gloo."""
    if comm.world_size == 1:
        return False
    setting = check_setting()
    return "gloo" in comm.backend if setting is None else setting


class _Posted:
    """One header sent to every peer, and theirs being received."""

    __slots__ = ("gen", "mine", "text", "label", "inbox", "recvs", "sends", "waiter",
                 "_sentinels")

    def __init__(self, gen: int, mine: np.ndarray, text: str, label: str,
                 inbox: torch.Tensor, recvs: list, sends: list) -> None:
        self.gen, self.mine, self.text, self.label = gen, mine, text, label
        self.inbox, self.recvs, self.sends = inbox, recvs, sends
        self.waiter: tuple[threading.Event, list[BaseException]] | None = None
        # A view of the inbox's memory, made once: ``arrived`` is asked up to _NAPS
        # times a wait.
        self._sentinels = inbox.numpy()[:, -1]

    def arrived(self) -> bool:
        # gloo writes a message into the tensor as it arrives, before any wait: a nonzero
        # sentinel (the last field) says the wait will return at once. (A list of one
        # value per peer: a tenth of numpy's reduction on an array this small.)
        return all(self._sentinels.tolist())


class Channel:
    """The check messages of one process group, shared by every model on it."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.messages = comm.backend == "gloo"  # else checks are collectives
        self.epoch = 0
        self.broken = False  # after _EPOCHS - 1 divergences (``new_epoch``)
        self.models = 0   # models attached so far: each model's number in headers
        # What this rank does (a key compared, a text reported): the first thing noted
        # since the last header, which is where a rank that diverged first went.
        self._first: tuple[int, str] | None = None
        self._first_between = False
        self._latest: tuple[int, str] = (0, "nothing yet")
        # Everything noted since the last header, the first one's text first: a header
        # carries them all, for a divergence is often noticed one step after it happened
        # (Note [what diverged]).
        self._noted: list[str] = []
        # In a backward, exchanges carry no header (``set_doing``).
        self.exchange_headers = True
        self._gen = 0
        self.headers = 0  # headers posted, ever (each one message to every peer)
        self._pending: deque[_Posted] = deque()
        # Per group object, weakly: a channel must not keep a group (and gloo's threads)
        # alive past destroy_process_group (Note [teardown] in comm/process_group.py).
        self._counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.abandoned: list[Any] = []  # works of past epochs (gloo owns their buffers)
        self._peers = [r for r in range(comm.world_size) if r != comm.rank]  # group ranks

    def checking(self) -> bool:
        """Whether headers are posted now (order checks on, under gloo)."""
        return self.messages and order_checks_enabled(self.comm)

    def set_doing(self, key: int, text: str, exchange_headers: bool = True,
                  between_steps: bool = False) -> None:
        """Note what this rank does now; the next header carries the first thing noted
        since the last one. ``exchange_headers=False`` from the start of a backward:
        its exchanges follow from the forward (autograd runs the same graph on every
        rank), so they carry no header of their own; the backward's header is compared
        before its first wait (as the old check, one check per backward).
        ``between_steps``: a note made outside any forward (an optimizer step), which the
        next forward's first header carries; other notes are forgotten when a forward
        starts (``new_forward``), for a forward an exception ended noted them on one rank
        only."""
        if self._first is None:
            self._first = (key, text)
            self._first_between = between_steps
            self._noted = [text]
        else:
            self._noted.append(text)
        self._latest = (key, text)
        self.exchange_headers = exchange_headers

    def new_forward(self) -> None:
        """A root forward starts: forget what an unfinished one noted."""
        if self._first is not None and not self._first_between:
            self._first = None
            self._noted = []

    # -- tags ------------------------------------------------------------------------
    def data_tag(self, group: Any, kind: str, nbytes: int) -> int:
        """The tag of an exchange over ``group`` (this channel's group or one of its
        subgroups) sending messages of ``nbytes`` (Note [checks ride the exchanges])."""
        count = self._counters.get(group, 0)
        self._counters[group] = count + 1
        size = _size_print(nbytes)
        return (_MARK | (_REDUCE if kind == "reduce_scatter" else 0)
                | (self.epoch % _EPOCHS) << _EPOCH_SHIFT
                | (count % _COUNTERS) << _COUNTER_SHIFT | size)

    # -- headers ---------------------------------------------------------------------
    def post(self, kind: int, ident: int, extra: int, label: str,
             text: str | None = None) -> int:
        """Send this rank's header to every peer and start receiving theirs; returns its
        generation. What a divergence error says this rank was doing: the first thing
        noted since the last header (``set_doing``), else ``text``, else the last thing
        noted. ``label`` names the wait in a timeout."""
        if self.broken:
            raise ShardwiseError(
                f"ranks diverged {_EPOCHS - 1} times on this process group; messages "
                f"left behind by those errors could now pair with new ones, so shardwise "
                f"stops using it. Restart the run (or create a new process group)")
        gen = self._gen
        self._gen += 1
        self.headers += 1
        if self._first is not None:
            doing, self._first = self._first[0], None
            text, self._noted = _joined(self._noted), []
        else:
            doing = self._latest[0]
            text = self._latest[1] if text is None else text
        mine = np.zeros(_FIELDS, dtype=np.int64)
        mine[:_KEY] = (kind, ident, extra, doing)
        raw = text.encode()[:_TEXT_BYTES]
        mine[_KEY] = len(raw)
        mine.view(np.uint8)[(_KEY + 1) * 8:(_KEY + 1) * 8 + len(raw)] = np.frombuffer(raw, np.uint8)
        mine[-1] = gen + 1
        tag = (_MARK | _HEADER | (self.epoch % _EPOCHS) << _EPOCH_SHIFT
               | gen % _GENERATIONS)
        inbox = torch.zeros((len(self._peers), _FIELDS), dtype=torch.int64)
        # Note [header cost]
        # A header is a fixed cost per checked point (about U + 2 per forward and
        # backward of U units, each micro-batch), so on a small model it is a visible
        # share of the step (docs/performance.md, "The order check's cost"). Its
        # messages go to the process group's own send and receive, with ranks of the
        # group: dist.isend/irecv only resolve the group and the rank and check the
        # tensor, which the channel knows already, and that Python cost 10-20% of a
        # header's round trip (benchmarks/check_cost.py --headers).
        group = self.comm.group if self.comm.group is not None else dist.group.WORLD
        assert group is not None, "the default process group exists while a channel is used"
        try:
            # Receives first: a peer's header arriving then means its receive for ours
            # is posted, so waiting for our send never waits for the peer.
            recvs = [group.recv([inbox[i]], p, tag) for i, p in enumerate(self._peers)]
            out = torch.from_numpy(mine)
            sends = [group.send([out], p, tag) for p in self._peers]
        except RuntimeError as err:
            raise self.comm.stuck(f"the order check before {label}", err) from err
        self._pending.append(_Posted(gen, mine, text, label, inbox, recvs, sends))
        return gen

    def settle(self, upto: int | None = None) -> None:
        """Compare every header posted so far (with ``upto``: up to that generation)
        with the peers'; raise ``ShardwiseError`` on every rank if they differ."""
        while self._pending and (upto is None or self._pending[0].gen <= upto):
            posted = self._pending[0]
            self._arrive(posted)
            self._pending.popleft()
            self._compare(posted)

    def pending(self) -> bool:
        return bool(self._pending)

    def _arrive(self, posted: _Posted) -> None:
        if posted.waiter is None:
            for _ in range(_NAPS):
                if posted.arrived():
                    break
                time.sleep(_NAP)
            else:
                posted.waiter = _helper_wait(posted.recvs)
        if posted.waiter is not None:
            # Watched; an interrupted wait (Ctrl-C, the peer watch's error) leaves the
            # helper in charge of the receives, and a retry waits for it again.
            done, failed = posted.waiter
            what = f"the order check before {posted.label}"
            warned = wait_watched(lambda seconds: done.wait(seconds), self.comm, what)
            if failed:
                raise self.comm.stuck(what, failed[0], warned) from failed[0]
            posted.recvs = []
        try:
            for works in (posted.recvs, posted.sends):
                while works:
                    works[0].wait()  # a done point-to-point work is never waited twice
                    works.pop(0)
        except RuntimeError as err:
            raise self.comm.stuck(f"the order check before {posted.label}", err) from err

    def _compare(self, posted: _Posted) -> None:
        inbox = posted.inbox.numpy()
        mine = posted.mine[:_KEY].tolist()
        if all(row == mine for row in inbox[:, :_KEY].tolist()):
            return
        texts = {self.comm.rank: posted.text}
        others = [r for r in range(self.comm.world_size) if r != self.comm.rank]
        for row, r in zip(inbox, others):
            length = int(row[_KEY])
            texts[r] = row.view(np.uint8)[(_KEY + 1) * 8:(_KEY + 1) * 8 + length].tobytes() \
                .decode(errors="replace")
        self.new_epoch()
        raise diverged([texts[r] for r in range(self.comm.world_size)])

    def new_epoch(self) -> None:
        """Leave what is in flight behind: every rank does this at the same header."""
        if self.epoch + 1 >= _EPOCHS:
            self.broken = True  # tags would repeat: messages left behind could pair
        self.epoch += 1
        self._gen = 0
        self._counters.clear()
        self._first = None  # noted before the error, where ranks were not alike
        self._noted = []
        for posted in self._pending:
            self.abandoned.extend(posted.recvs + posted.sends + [posted.inbox])
        self._pending.clear()


@functools.lru_cache(maxsize=4096)
def _size_print(nbytes: int) -> int:
    """The fingerprint of a message size in a data tag: a model's exchanges have a few
    sizes, each fingerprinted once (Note [layouts are read per call] in
    engine/groups/layout.py says why per-call work counts)."""
    return zlib.crc32(nbytes.to_bytes(8, "little")) % _SIZE_PRINTS


def _helper_wait(works: list) -> tuple[threading.Event, list[BaseException]]:
    """Wait for ``works`` on a helper thread; the event is set when it is over (the list
    then holds its error, if any)."""
    done = threading.Event()
    failed: list[BaseException] = []

    def wait_all() -> None:
        try:
            for w in works:
                w.wait()
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            failed.append(err)
        done.set()

    threading.Thread(target=wait_all, name="shardwise-check", daemon=True).start()
    return done, failed


# Note [what diverged]
# A header says what its rank did since the previous header: usually one thing (a unit
# about to run), but a unit that exchanges nothing (a root without parameters of its
# own) only notes itself, and the next unit's exchange carries both. Ranks that ran
# `linears[rank % 2]` after such a root post "unit <root>; then unit linears.0" and
# "unit <root>; then unit linears.1": their headers differ in the exchange, and the
# error once named only the first note, "unit <root>" on both ranks. So a header
# carries every note since the last one (the first and last, when they do not fit), and
# the error names the first note in which ranks differ, after the notes they share (or,
# when one rank's notes end first, everything after those). The comparison itself is
# unchanged: the first note's key and the exchange's own fields.
_THEN = "; then "


def _joined(noted: list[str]) -> str:
    """The notes a header carries, within its text's bytes (Note [what diverged])."""
    text = _THEN.join(noted)
    if len(text.encode()) > _TEXT_BYTES and len(noted) > 2:
        text = _THEN.join([noted[0], "...", noted[-1]])
    return text


def diverged(names: list[str]) -> ShardwiseError:
    """The error every rank raises when ranks did different things (``names[r]``: what
    rank r was doing, its notes joined by ``_THEN``; Note [what diverged])."""
    steps = [n.split(_THEN) for n in names]
    shared = 0
    while (all(len(s) > shared + 1 for s in steps)
           and len({s[shared] for s in steps}) == 1):
        shared += 1
    after = f" after {steps[0][shared - 1]}" if shared else ""
    heads = [s[shared] for s in steps]
    if len(set(heads)) == 1:  # alike up to where a rank's notes end: show all that follow
        heads = [_THEN.join(s[shared:]) for s in steps]
    which = ", ".join(f"rank {r}: {h}" for r, h in enumerate(heads))
    advice = ("Every rank must call shardwise's collective operations (full_state_dict, "
              "gathered, save_checkpoint, ...) in the same order")
    if any("(gathered again: " in h for h in heads):
        # Note [held units on one rank] in engine/iteration/state.py
        advice = ("A unit kept gathered across sw.no_sync micro-batches was gathered again "
                  "on some ranks only, because its shard changed there (an edit of the "
                  "shards, or an optimizer step, on one rank inside sw.no_sync): make the "
                  "change on every rank, or after the synced backward's step. " + advice)
    elif any(h.startswith("unit ") for h in heads):
        advice = ("Each forward must run the same units (the sharded modules) in the same "
                  "order on every rank: a branch that chooses modules by rank or by data "
                  "(`layers[rank % 2]`) must choose alike everywhere (decide it from a "
                  "value all ranks share, all_reduce'd or broadcast), or the modules it "
                  "chooses among must be in the root unit, which every forward gathers "
                  "whole (sw.shard(model, units=...) naming only the other units). "
                  + advice + ", and a rank that caught an exception in a forward must "
                  "not go on alone")
    return ShardwiseError(f"ranks diverged{after} ({which}). {advice}")


_channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def channel_of(comm: Any) -> Channel:
    """The channel of ``comm``'s group (one per group object, dropped with it)."""
    group = comm.group if comm.group is not None else dist.group.WORLD
    channel = _channels.get(group)
    if channel is None:
        channel = _channels[group] = Channel(comm)
    return channel
