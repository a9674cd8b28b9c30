"""A progress bar for long checkpoint work (consolidation), on stderr."""

from __future__ import annotations

import sys


class Progress:
    """A byte-counting tqdm progress bar on stderr, shown only for long work on a terminal
    or when forced."""

    def __init__(self, total: int, label: str, enabled: bool | None = None) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=max(total, 1), desc=label, unit="B", unit_scale=True,
                         unit_divisor=1024, file=sys.stderr,
                         disable=not (sys.stderr.isatty() if enabled is None else enabled))

    def advance(self, amount: int) -> None:
        self._bar.update(amount)

    def finish(self) -> None:
        self._bar.close()
