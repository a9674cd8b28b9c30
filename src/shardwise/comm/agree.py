"""Agreement across ranks, the one way.

One rank's error becomes every rank's (:func:`agreed`, :func:`agree`), a flag raised on
any rank is seen by all (:func:`any_rank`), and ranks learn whether they hold the same
integers (:func:`same_everywhere`, the collective-order check's primitive).

Note [agreed failure]
Work that can fail on some ranks only (reading a file, checking a user's argument,
writing to a full disk) runs inside :func:`agreed`; one small all-gather of the error
messages follows, and if any rank failed every rank raises the same error, listing each
rank's message. Loads and ``shard`` change nothing before that point, so "nothing was
changed" holds on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from ..errors import ShardwiseError
from .collectives import Comm

T = TypeVar("T")


def agreed(comm: Comm | None, what: str, prepare: Callable[[], T],
           changed: bool = False) -> T:
    """Run ``prepare`` here and raise on every rank if it failed on any (Note
    [agreed failure]); its result otherwise. ``changed``: ``prepare`` changes state,
    so the error must not claim that nothing was changed."""
    error, result = None, None
    try:
        result = prepare()
    except ShardwiseError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a bad input must fail on every rank, cleanly
        error = f"{type(e).__name__}: {e}"
    agree(comm, error, what, changed)
    return result  # type: ignore[return-value]


def agree(comm: Comm | None, error: str | None, what: str, changed: bool = False) -> None:
    """Raise on every rank if any rank hit an error (each rank's message is included)."""
    if comm is None or comm.world_size == 1:
        if error:
            raise ShardwiseError(f"{what}: {error}")
        return
    errors = comm.all_gather_object(error, what=f"the agreement on errors ({what})")
    if any(errors):
        distinct: dict[str, list[int]] = {}
        for r, e in enumerate(errors):
            if e:
                distinct.setdefault(e, []).append(r)
        lines = [f"  rank(s) {ranks}: {e}" for e, ranks in distinct.items()]
        outcome = ("state may be partly changed on some ranks" if changed
                   else "nothing was changed")
        raise ShardwiseError(f"{what}; {outcome}:\n" + "\n".join(lines))


def any_rank(comm: Comm, flag: bool, what: str = "an agreement") -> bool:
    """Whether ``flag`` is set on any rank (one small all-reduce)."""
    t = torch.tensor([int(flag)], dtype=torch.int32, device=comm.device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX, what=what)
    return bool(t.item())


def same_everywhere(comm: Comm, values: list[int], what: str, watch: bool = False) -> bool:
    """Whether every rank passed the same ``values``. One all-reduce of the maximum over
    the values and their negations: equal everywhere exactly when the maximum of v and
    of -v give back v. Every call has the same size whatever the values, so calls of
    ranks that diverged still pair up (and then disagree) instead of mismatching sizes."""
    mine = [*values, *(-v for v in values)]
    seen = torch.tensor(mine, dtype=torch.int64, device=comm.device)
    comm.all_reduce(seen, op=dist.ReduceOp.MAX, what=what, watch=watch)
    return seen.tolist() == mine
