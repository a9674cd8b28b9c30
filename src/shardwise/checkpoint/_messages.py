"""Lists and per-rank values, shortened for the checkpoint code's error messages."""

from __future__ import annotations


def summary(items: list, limit: int = 10, join: str | None = None) -> str:
    """``items`` for a message: all of them when few, else the first ``limit`` and a
    count (a message must not list 200,000 invented names)."""
    shown = items[:limit]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    if join is not None:
        return join.join(str(i) for i in shown) + (f"{join}...{more}" if more else "")
    return f"{shown!r}"[:-1] + (f", ...{more}]" if more else "]")


def by_rank(values: list) -> str:
    """Per-rank values for a message: ``rank 0: 'a', rank 1: 'b'``."""
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
