"""Failures agreed across ranks: one rank's error becomes every rank's, before the next
collective, so no rank is left waiting in a collective the others never reach.

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

from ._comm import Comm
from .errors import ShardwiseError

T = TypeVar("T")


def agreed(comm: Comm | None, what: str, make_plan: Callable[[], T],
           changed: bool = False) -> T:
    """Run ``make_plan`` here and raise on every rank if it failed on any (Note
    [agreed failure]); its result otherwise. ``changed``: ``make_plan`` changes state,
    so the error must not claim that nothing was changed."""
    error, plan = None, None
    try:
        plan = make_plan()
    except ShardwiseError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - a bad input must fail on every rank, cleanly
        error = f"{type(e).__name__}: {e}"
    agree(comm, error, what, changed)
    return plan  # type: ignore[return-value]


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
