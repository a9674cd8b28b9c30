"""Collectives over one process group, with byte counters.

torch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single``, which older releases lack: the newer name
is used where it exists, so no deprecation warning is raised on any release.

Collectives write only into buffers of their own (the all-gather output is a temporary
that is copied out, Note [freeing full parameters] in engine/iteration/unit.py), never into tensors
autograd has saved: gloo bumps an output's version counter on its worker thread, at a
moment nobody can wait for.

Note [gloo exchanges]: under gloo, the all-gathers and reduce-scatters of units travel as
point-to-point messages (each rank sends every peer its part and receives theirs), not as
gloo's own collectives. gloo's all-gather is slow, and it has no reduce-scatter: torch
all-reduces a clone of the input (twice the traffic) and copies a chunk out. The
exchange is faster for both, alone (``benchmarks/collectives.py``) and on the reference
workload's step (BENCHMARKS.md, "Unit collectives under gloo").
The result is the same: an all-gather is a copy; a reduce-scatter's sum is taken in rank
order, and at N=2 it is one addition, which is commutative, so every bit equals gloo's
all-reduce (and DDP's). At N>2 the order may differ from gloo's ring in the last bits.
Each exchange carries a tag (``Channel.data_tag`` in comm/channel.py) made of its kind, the
epoch of the order checks, a counter per process group and a fingerprint of its message
size, so two models' (or one model's two) exchanges in flight at once never take each
other's messages, and exchanges that diverged ranks issued never pair messages of
different sizes (gloo aborts the process on those); with the order check on, a header
goes before each exchange's data (Note [checks ride the exchanges]). Ranks issue
exchanges in the same order, which is what a collective requires anyway. In a world of
one, under any backend, the same code only copies. CUDA tensors keep the backend's
collectives (gloo cannot send them point to point).

Note [two transports] (below ``Comm``) says how the two ways a unit's collectives travel
share one interface.

Note [stuck collectives]: every collective carries a description of what it is for
("the all-gather of unit 'blocks.3'"). When it fails, because a peer died or because no
peer joined it before the process group's timeout (ranks that diverged), the error names
that collective and this rank, so that a hang ends in a message saying where each rank
was waiting, not in an anonymous gloo timeout.
"""

from __future__ import annotations

import functools
import pickle
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ShardwiseError
from .channel import EXCHANGE, Channel, channel_of
from .peers import LEFT_EARLY, departed, enable_publishing, sliced, wait_watched
from .scalars import mark

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# gloo cannot send bool; these travel as the same-size integer.
_WIRE_DTYPE = {torch.bool: torch.uint8}


@dataclass
class CommStats:
    """Per kind of collective: this rank's input bytes (``bytes``), call counts, and the
    bytes this rank put on the wire itself (``sent``: gloo's exchanges, Note [gloo
    exchanges]; a backend's own collectives do not say what they send). A world of one
    gathers and reduces units without any collective, so they are not counted there."""

    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)

    def clear(self) -> None:
        """Start counting from zero."""
        for counter in (self.bytes, self.calls, self.sent):
            counter.clear()

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1


class Comm:
    """One process group, this rank's place in it, and what was sent over it."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.stats = CommStats()
        self.backend = str(dist.get_backend(group))
        self._mesh = None
        # The group whose channel carries this group's order checks (Note [checks ride
        # the exchanges]): the model's whole group, for its shard and replica subgroups.
        self.checks_over: Comm = self
        self._channel: Channel | None = None
        # Wire buffers of the reproducible mode's exchanges over this group, kept between
        # steps for reuse (exact/partial.py's ``buffer``): they live as long as the
        # model that holds this communicator, not the process.
        self.spare_buffers: list[torch.Tensor] = []
        if self.world_size > 1 and "gloo" in self.backend:
            enable_publishing()  # Note [peer watch]

    @property
    def channel(self) -> Channel:
        """The order checks' channel (Note [checks ride the exchanges])."""
        if self._channel is None:
            self._channel = channel_of(self.checks_over)
        return self._channel

    @property
    def device(self) -> torch.device:
        """Where this group's collectives take their tensors (NCCL: the current GPU)."""
        if "nccl" in self.backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def mesh(self):
        """A 1-D ``DeviceMesh`` over this group, for DTensor parameters (made once)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            group = self.group if self.group is not None else dist.group.WORLD
            mesh = DeviceMesh.from_group(group, self.device.type)
            # Note [teardown] in comm/process_group.py: a mesh keeps its group in _pg_registry,
            # which would keep gloo's threads alive past destroy_process_group for as long
            # as the model lives (to interpreter exit, for a model in a global). Eager
            # DTensor ops find the group by name; only torch.compile tracing reads the
            # registry.
            mesh._pg_registry.clear()
            mark(mesh)  # Note [rank-local scalars] in comm/scalars.py
            self._mesh = mesh
        return self._mesh

    def global_rank(self, group_rank: int) -> int:
        """The default group's rank of ``group_rank`` in this group."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                   what: str = "an all-gather", skip_own: bool = False):
        """Concatenate every rank's ``inp`` into ``out``.

        With ``async_op``, ``inp`` must stay unchanged and ``out`` unread until the
        returned work is waited for (gloo sends and receives them in the background).
        ``skip_own`` (with ``async_op``): this rank's part of ``out`` may be left
        unwritten, for a caller that reads ``inp`` instead; the returned work's
        ``own_skipped`` says whether it was (Note [own rows from the shard] in
        engine/groups/copies.py).
        """
        self.stats.add("all_gather", inp)
        transport = self.transport(inp)
        if skip_own and transport is EXCHANGES and self.world_size > 1:
            work = _exchange_all_gather(self, out, inp, what, own=False)
            work.own_skipped = True
        else:
            work = transport.all_gather(self, out, inp, what)
        return self._finish(work, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False,
                       what: str = "a reduce-scatter"):
        """Sum ``inp`` over ranks and keep this rank's chunk in ``out``.

        With ``async_op``, ``inp`` must stay unchanged and ``out`` unread until the
        returned work is waited for (under gloo ``inp``'s chunks are sent from where they
        are and ``out`` is received into, Note [gloo exchanges]).
        """
        self.stats.add("reduce_scatter", inp)
        work = self.transport(inp).reduce_scatter(self, out, inp, what)
        return self._finish(work, async_op)

    def all_to_all(self, outs: list[torch.Tensor], inps: list[torch.Tensor],
                   async_op: bool = False, what: str = "an all-to-all"):
        """Send ``inps[r]`` to rank r and receive rank r's into ``outs[r]``, for every
        other rank r (this rank's own entries are neither sent nor written). Every rank
        passes chunks of the same sizes and dtype.

        With ``async_op``, ``inps`` must stay unchanged and ``outs`` unread until the
        returned work is waited for.
        """
        for r, t in enumerate(inps):
            if r != self.rank:
                self.stats.add("all_to_all", t)
        work = self.transport(inps[0]).all_to_all(self, outs, inps, what)
        return self._finish(work, async_op)

    def transport(self, t: torch.Tensor) -> Transport:
        """How a unit's collective on ``t`` travels (Note [two transports]): by exchange
        for CPU tensors under gloo (a mixed "cpu:gloo,cuda:nccl" group included) and for
        anything in a world of one, whose "collectives" are local copies; by the
        backend's own collectives otherwise (gloo cannot send CUDA tensors point to
        point, and NCCL's collectives beat separate sends)."""
        if self.world_size == 1 or (t.is_cpu and "gloo" in self.backend):
            return EXCHANGES
        return COLLECTIVES

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   what: str = "an all-reduce", watch: bool = False):
        """Sum (or ``op``) ``tensor`` over ranks, in place. ``watch``: a synchronous call
        waits watching its peers (Note [peer watch])."""
        self.stats.add("all_reduce", tensor)
        return self._run(what, async_op, dist.all_reduce, tensor, op=op, watch=watch)

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int,
                what: str = "a scatter") -> None:
        """Rank ``src`` sends ``chunks[r]`` to rank r (``chunks`` is ignored elsewhere)."""
        self.stats.add("scatter", out)
        self._run(what, False, dist.scatter, out, chunks if self.rank == src else None,
                  src=self.global_rank(src))

    def broadcast(self, tensor: torch.Tensor, src: int, what: str = "a broadcast") -> None:
        self.stats.add("broadcast", tensor)
        self._run(what, False, dist.broadcast, tensor, src=self.global_rank(src))

    def _finish(self, work: _Pending, async_op: bool) -> _Pending | None:
        if async_op:
            return work
        work.wait()
        return None

    def _run(self, what: str, async_op: bool, collective, *args, watch: bool = False,
             **kwargs):
        """Issue ``collective``; Note [stuck collectives] for the errors. With ``watch``, a
        synchronous one is issued asynchronously and waited for in slices that watch the
        peers (Note [peer watch] in comm/peers.py): a sliced wait costs more than a plain
        one (BENCHMARKS.md, "Peer watch"), so only the waits where a rank alone shows
        first are watched. A collective first settles the order checks (Note
        [checks ride the exchanges]): ranks that diverged raise there instead of pairing
        collectives of different sizes (or issuing one a peer never joins)."""
        if self.channel.pending():
            self.channel.settle()
        try:
            work = collective(*args, group=self.group, async_op=async_op or watch, **kwargs)
        except RuntimeError as err:
            raise self.stuck(what, err) from err
        if not (async_op or watch):
            return None
        pending = _Pending([work], self, what, watched=watch)
        if async_op:
            return pending
        pending.wait()
        return None

    def stuck(self, what: str, err: BaseException, warned: str | None = None
              ) -> CollectiveError:
        """The error for ``what``, which failed on this rank with ``err``; ``warned``: the
        peer watch's last warning during the wait, which says more."""
        if warned is not None:
            return CollectiveError(f"{warned}. The wait then ended: {err}")
        # A peer that exited closes its connections, and the wait fails at once: name it
        # when its note says so (Note [peer watch]).
        timed_out = "timed out" in str(err).lower()
        left, notes = departed(self, patience=0.0 if timed_out else 1.0)
        if left:
            return CollectiveError(
                f"rank {self.rank}: {what} did not complete: rank(s) {left} exited (their "
                f"processes are gone; {notes}). {LEFT_EARLY}. (The error was: {err})")
        return CollectiveError(
            f"rank {self.rank}: {what} did not complete ({err}). Another rank failed, "
            f"exited or never joined it within the process group's timeout: look for "
            f"another rank's error first. If none raised, the ranks diverged (ran "
            f"different code, or one stopped early: a rank whose data ran out first needs "
            f"the same number of batches as the others: sw.micro_batches(batch, M), "
            f"drop_last=True in the DataLoader, or DistributedSampler); rerun with "
            f"SHARDWISE_CHECK=1 to see where. The timeout is "
            f"sw.init_distributed(timeout=...)")

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int,
                          what: str = "a broadcast") -> None:
        """Make every rank's ``tensors`` equal to rank ``src``'s, one message per dtype.

        Tensors are updated in place, and only on ranks other than ``src``.
        """
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.broadcast(flat, src, what)
            if self.rank != src:
                unflatten_into(flat, same_dtype)

    def average_tensors(self, tensors: list[torch.Tensor],
                        what: str = "an all-reduce") -> None:
        """Replace floating ``tensors`` in place by their mean over ranks."""
        for same_dtype in _by_dtype(tensors).values():
            flat = _flatten(same_dtype)
            self.all_reduce(flat, what=what)
            flat.div_(self.world_size)
            unflatten_into(flat, same_dtype)

    def all_gather_object(self, obj: Any, what: str = "an exchange of metadata") -> list[Any]:
        """Every rank's ``obj``, in rank order (small metadata only)."""
        if "gloo" not in self.backend:
            out: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(out, obj, group=self.group)
            except RuntimeError as err:
                raise self.stuck(what, err) from err
            return out
        # Under gloo, as two watched collectives (Note [peer watch]): the sizes, then
        # the pickled objects padded to the largest. Objects are shardwise's own
        # metadata (names, messages, fingerprints), never a peer's arbitrary data.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        self._run(what, False, _all_gather_flat, sizes,
                  torch.tensor([data.numel()], dtype=torch.int64), watch=True)
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        everyone = torch.empty(longest * self.world_size, dtype=torch.uint8)
        self._run(what, False, _all_gather_flat, everyone, padded, watch=True)
        rows = everyone.view(self.world_size, longest)
        return [pickle.loads(rows[r, :int(sizes[r])].numpy().tobytes())
                for r in range(self.world_size)]


# Note [two transports]
# A unit's all-gather and reduce-scatter travel one of two ways, chosen per tensor by
# ``Comm.transport``: the backend's own collectives, or point-to-point exchanges (Note
# [gloo exchanges]). Both implement :class:`Transport`, issue their work without waiting
# and return a ``_Pending`` (whose ``then`` finishes what the messages leave to do, a
# reduce-scatter's sum); ``Comm`` counts bytes and waits or not, the same way for both.
# A third way (a CUDA stream path) plugs in as a third implementation.
class Transport:
    """How a unit's all-gather and reduce-scatter travel."""

    def all_gather(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                   what: str) -> _Pending:
        raise NotImplementedError

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                       what: str) -> _Pending:
        raise NotImplementedError

    def all_to_all(self, comm: Comm, outs: list[torch.Tensor], inps: list[torch.Tensor],
                   what: str) -> _Pending:
        raise NotImplementedError


class _Collectives(Transport):
    """The backend's collectives (NCCL; gloo's for CUDA tensors)."""

    def all_gather(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                   what: str) -> _Pending:
        return comm._run(what, True, _all_gather_flat, out, inp)

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                       what: str) -> _Pending:
        return comm._run(what, True, _reduce_scatter_flat, out, inp)

    def all_to_all(self, comm: Comm, outs: list[torch.Tensor], inps: list[torch.Tensor],
                   what: str) -> _Pending:
        received = list(outs)
        received[comm.rank] = torch.empty_like(inps[comm.rank])  # the backend writes it
        return comm._run(what, True, dist.all_to_all, received, list(inps))


class _Exchanges(Transport):
    """Point-to-point messages to each peer (Note [gloo exchanges]); in a world of one,
    copies."""

    def all_gather(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                   what: str) -> _Pending:
        return _exchange_all_gather(comm, out, inp, what, own=True)

    def reduce_scatter(self, comm: Comm, out: torch.Tensor, inp: torch.Tensor,
                       what: str) -> _Pending:
        if comm.world_size == 1:
            out.copy_(inp)
            return _Pending([], comm, what)
        chunks = inp.chunk(comm.world_size)
        peers = _peers(comm)
        parts: dict[int, torch.Tensor] | None
        if comm.world_size == 2:
            # One addition, received straight into ``out``: a + b equals b + a bit for bit.
            recvs = [(p, out) for _, p in peers]
            parts = None
        else:
            inbox = torch.empty((comm.world_size - 1) * out.numel(), dtype=out.dtype,
                                device=out.device).chunk(comm.world_size - 1)
            recvs = [(p, inbox[i]) for i, (_, p) in enumerate(peers)]
            parts = {p: t for p, t in recvs}
            parts[comm.rank] = chunks[comm.rank]
        work = _exchange(comm, [(p, chunks[p]) for p, _ in peers], recvs, what,
                         "reduce_scatter")

        def add_up() -> None:
            if parts is None:
                out.add_(chunks[comm.rank])
                return
            out.copy_(parts[0])
            for r in range(1, comm.world_size):  # rank order: the same sum on every run
                out.add_(parts[r])

        work.then = add_up
        return work

    def all_to_all(self, comm: Comm, outs: list[torch.Tensor], inps: list[torch.Tensor],
                   what: str) -> _Pending:
        peers = _peers(comm)
        return _exchange(comm, [(p, inps[p]) for p, _ in peers],
                         [(p, outs[p]) for _, p in peers], what, "reduce_scatter")


COLLECTIVES: Transport = _Collectives()
EXCHANGES: Transport = _Exchanges()


def _exchange_all_gather(comm: Comm, out: torch.Tensor, inp: torch.Tensor, what: str,
                         own: bool) -> _Pending:
    """An all-gather by exchange; ``own``: this rank's part of ``out`` is ``inp``'s copy,
    else left as it is (``Comm.all_gather``'s ``skip_own``)."""
    parts = out.chunk(comm.world_size)
    peers = _peers(comm)
    work = _exchange(comm, [(p, inp) for p, _ in peers],
                     [(p, parts[p]) for _, p in peers], what, "all_gather")
    if own:
        parts[comm.rank].copy_(inp)
    return work


def _peers(comm: Comm) -> list[tuple[int, int]]:
    """(rank to send to, rank to receive from) for each of the N-1 other ranks: every
    rank sends to and receives from every other directly, k places away."""
    n = comm.world_size
    return [((comm.rank + k) % n, (comm.rank - k) % n) for k in range(1, n)]


def _exchange(comm: Comm, sends: list[tuple[int, torch.Tensor]],
              recvs: list[tuple[int, torch.Tensor]], what: str, kind: str) -> _Pending:
    """Issue point-to-point sends and receives under one tag (Note [gloo exchanges]),
    after this exchange's header when order checks are on (Note [checks ride the
    exchanges])."""
    if not recvs:  # a world of one
        return _Pending([], comm, what)
    group = comm.group if comm.group is not None else dist.group.WORLD
    assert group is not None, "the default process group exists while a model is used"
    channel = comm.channel
    nbytes = recvs[0][1].numel() * recvs[0][1].element_size()
    gen = None
    if channel.exchange_headers and channel.checking():
        gen = channel.post(EXCHANGE, _ident(what), nbytes, what)
    tag = channel.data_tag(group, kind, nbytes)
    works = []
    sent = 0
    # As a header's messages (Note [header cost] in comm/channel.py): the group's own
    # send and receive with ranks of the group, which is what dist.isend/irecv end in
    # after resolving the group and the rank again, twice per exchange and peer (a fixed
    # cost per exchange, issue 54). Complex tensors travel as their real view, as
    # there; everything else dist.isend checks holds for a flat buffer's chunks.
    try:
        for peer, tensor in sends:
            sent += tensor.numel() * tensor.element_size()
            works.append(group.send([_real(tensor)], peer, tag))
        for peer, tensor in recvs:
            works.append(group.recv([_real(tensor)], peer, tag))
    except RuntimeError as err:
        comm.stats.sent[kind] += sent
        raise comm.stuck(what, err) from err
    comm.stats.sent[kind] += sent
    return _Pending(works, comm, what, point_to_point=True, channel=channel, gen=gen)


@functools.lru_cache(maxsize=4096)
def _ident(what: str) -> int:
    """An exchange's description as its header's compared field: a unit's exchanges say
    the same few things every step (Note [layouts are read per call] in
    engine/groups/layout.py)."""
    return zlib.crc32(what.encode()) & 0x7FFFFFFF


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class _Pending:
    """Issued communication, whose ``wait`` names it when it fails and then runs
    ``then`` (the sum of a reduce-scatter's exchange). An exchange's ``wait`` first
    settles the order checks up to its header (Note [checks ride the exchanges])."""

    def __init__(self, works: list[Any], comm: Comm, what: str,
                 point_to_point: bool = False, watched: bool = False,
                 channel: Channel | None = None, gen: int | None = None) -> None:
        self._works = works
        self._p2p = point_to_point
        self._watched = watched
        self._comm = comm
        self._what = what
        self._error: RuntimeError | None = None
        self._channel = channel
        self._epoch = channel.epoch if channel is not None else 0
        self._gen = gen
        self.then: Callable[[], None] | None = None
        self.own_skipped = False  # an all-gather's own part left unwritten (skip_own)

    def _abandoned(self) -> bool:
        """Whether ranks diverged since this was issued: its messages may never come."""
        if self._channel is None or self._channel.epoch == self._epoch:
            return False
        self._channel.abandoned.extend(self._works)
        self._works = []
        return True

    def discard(self) -> bool:
        """Wait without using the result (buffers must outlive the communication); an
        exchange left behind by a divergence is left to gloo instead, and False returned:
        gloo may still write into its buffers, which the caller must not free."""
        self.then = None
        if self._abandoned():
            return False
        self.wait()
        return True

    def settle(self, use: bool) -> bool:
        """:meth:`wait` when the result is used, else :meth:`discard`; whether it ended
        (False: left to gloo, as :meth:`discard` says)."""
        if use:
            self.wait()
            return True
        return self.discard()

    def wait(self) -> None:
        if self._error is not None:  # a failed exchange stays failed
            raise self._comm.stuck(self._what, self._error)
        if self._abandoned():
            raise ShardwiseError(
                f"{self._what} was left behind when ranks diverged (the error raised then "
                f"says how); start the next step from its forward")
        if self._channel is not None and self._channel.pending():
            # Up to its own header, or every header before an exchange without one.
            self._channel.settle(upto=self._gen)
        try:
            while self._works:
                # A finished point-to-point work must not be waited for again (gloo would
                # wait for a second message): a wait interrupted half-way (Ctrl-C) resumes
                # with the works not yet done. A collective's wait does more than wait
                # (NCCL orders the current stream after it), so it always runs.
                if self._p2p:
                    if not self._works[0].is_completed():
                        self._works[0].wait()
                elif self._watched:
                    wait_watched(sliced(self._works[0]), self._comm, self._what)
                else:
                    self._works[0].wait()
                self._works.pop(0)
        except CollectiveError:
            raise  # the peer watch's own, complete error
        except RuntimeError as err:
            self._error = err
            raise self._comm.stuck(self._what, err) from err
        if self.then is not None:
            then, self.then = self.then, None
            then()


def _by_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    wire = _WIRE_DTYPE.get(tensors[0].dtype, tensors[0].dtype)
    return torch.cat([t.detach().reshape(-1).view(wire) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], *,
                   same_bits: bool = True) -> None:
    """Copy ``flat``'s consecutive pieces into ``tensors`` in place: the inverse of
    concatenating them flat.

    Args:
        flat: as many elements as ``tensors`` hold together.
        tensors: written in order, each from the next ``numel()`` elements.
        same_bits: each piece holds its tensor's bits, in a dtype of the same width (the
            wire dtype of a broadcast), and is viewed as the tensor's dtype; with False
            its values are converted (rounded) to it instead.
    """
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            piece = flat[offset:offset + n]
            piece = piece.view(t.dtype) if same_bits else piece.to(t.dtype)
            t.copy_(piece.view(t.shape))
            offset += n
