"""Reproducible mode's warning about dropout in training mode, once per model.

Dropout draws its masks from each rank's generator, whose stream depends on how many
micro-batches the rank ran before; results then depend on the world size
(docs/reproducible.md), which reproducible mode promises they do not.
"""

from __future__ import annotations

import warnings

import torch.nn as nn


class DropoutWarning:
    """Warns, at the first training forward with active dropout, that results will
    depend on the world size."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.said = False

    def forward_started(self) -> None:
        """A forward of the model starts: warn if it trains through active dropout."""
        if self.said or not self.root.training:
            return
        active = [n for n, m in self.root.named_modules()
                  if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training]
        if active:
            self.said = True
            names = ", ".join(active[:3]) + (", ..." if len(active) > 3 else "")
            warnings.warn(
                f"shardwise: reproducible mode with dropout in training mode ({names}): "
                f"its masks come from each rank's "
                f"random stream, which depends on the world size, so results will too. "
                f"Set their p to 0, or seed the generator per micro-batch "
                f"(docs/reproducible.md)", stacklevel=4)
