"""The reproducible mode's checks of a forward: dropout that trains, and a loss divided
by the micro-batches per rank. Both make results depend on the world size, which the
mode promises they do not.

Dropout draws its masks from each rank's generator, whose stream depends on how many
micro-batches the rank ran before (docs/reproducible.md): :class:`DropoutWarning`
warns once per model.

Note [a divided loss]
In the reproducible mode the gradient is the mean over all M micro-batches of a step, and
the engine takes it (Note [reproducible reduction] in exact/reduce.py): each micro-batch's
loss must be backpropagated undivided. Gradient accumulation under DDP teaches the
opposite: divide each micro-batch's loss by the number of micro-batches the rank runs,
``(loss / len(mine)).backward()`` with ``mine = sw.micro_batches(batch, M)``, or by a
``grad_accum_steps`` that is the same number K = M/N (accelerate's ``Accelerator.backward``
and Lightning's ``accumulate_grad_batches`` divide by it too). The gradient is then the
mean divided by K, a factor that depends on the world size, and so does every step after
(issue 50: weights 5.6e-4 off at N=2, 1.1e-3 at N=3), with nothing said.

What the engine sees of that, when the model returns its loss, is the gradient that
reaches the loss: its *seed*, exactly the factor the loss was multiplied by after the
model returned it (1 for ``loss.backward()``, 1/K for ``(loss / K).backward()``). So in
the reproducible mode a hook on the root's loss output records each backward's seed. The
loss output is the output itself when it is a 0-dim floating tensor (GPT's with targets),
a mapping's ``"loss"`` (a Hugging Face ``ModelOutput``), or the first 0-dim floating tensor
of a tuple or list (``(loss, logits)``, nanoGPT's ``(logits, loss)``). At the synced
backward, once K, the micro-batches this rank summed in the step, is known, the check
asks: K > 1, and every seed of the step 1/K (to the seed dtype's epsilon)? Each rank's
answer rides the all-reduce of used-parameter flags that ends every synced backward
(``ModelState._publish_gradients``), so every rank raises, or none does, before any
gradient is handed out: the optimizer step that follows finds no gradient and changes
nothing. It costs a 0-dim copy per micro-batch and one element more in that all-reduce.

Why this test rather than another:

- "Every seed must be 1" would refuse what does not depend on the world size and is
  legitimate: a constant loss weight (``0.5 * loss``), a loss scaler's factor, weights per
  micro-batch fixed by the global batch (its token counts), and any scalar output that is
  not itself the loss but enters one outside (``(model(x) - target) ** 2``), whose seed is
  anything. 1/K is one value, reached only by a scaling by exactly that.
- "Every seed of a step the same, and the same on every rank": 1/K on every micro-batch
  of every rank passes it.
- Making ``len(mine)`` something other than the number of micro-batches in ``mine``: the
  documented loop needs that count, and the same mistake is as often spelled
  ``/ grad_accum_steps``.

What it does not catch (docs/reproducible.md lists it): a loss computed outside the model
from its outputs (logits): what reaches them is the loss function's own gradient times
the factor, and autograd keeps no link from the model's output to the tensor
``backward()`` was called on, so the factor cannot be told apart; a factor that is not
1/K (a loss scaler's scale times 1/K, a division by N); a per-rank normalization that
varies over the micro-batches. A constant weight of exactly 1/K (0.5 at two micro-batches
per rank) is refused at the world sizes where it equals 1/K: put it inside the model's
loss, or into the learning rate.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ...errors import ShardwiseError


def loss_output(output: Any) -> torch.Tensor | None:
    """The loss among a root's forward outputs (Note [a divided loss]), or ``None``."""
    if isinstance(output, Mapping):
        candidates = [output.get("loss")]
    elif isinstance(output, (tuple, list)):
        candidates = list(output)
    else:
        candidates = [output]
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point():
            return t
    return None


class LossSeeds:
    """The seeds of a reproducible model's loss output in the current step, and the check
    of the synced backward (Note [a divided loss])."""

    def __init__(self, units: list[Any]) -> None:
        self.units = units
        self.seeds: list[torch.Tensor] = []
        self._mine: tuple[float, int] | None = None  # (seed, K) when this rank found it

    def watch(self, output: Any) -> None:
        """A root forward returned ``output``: record its loss's seed in the backward."""
        loss = loss_output(output)
        if loss is not None and torch.is_grad_enabled() and loss.grad_fn is not None:
            loss.register_hook(self._seen)

    def _seen(self, grad: torch.Tensor) -> None:
        # The step's first backward (no reduction holds a micro-batch yet): what a step
        # that never reached its synced backward left here goes.
        if not any(g.reduction.has_accumulated() for u in self.units
                   for g in u.trainable_groups):
            self.seeds.clear()
        self.seeds.append(grad.detach().clone())

    def answer(self, groups: list[Any]) -> int:
        """This rank's answer at a synced backward, to be all-reduced by MAX: K when K > 1
        (the micro-batches this rank summed in the step) and every seed of the step was
        1/K, else 0. Forgets the step's seeds."""
        seeds, self.seeds = self.seeds, []
        self._mine = None
        k = max((getattr(g.reduction, "summed", 0) for g in groups), default=0)
        if k < 2 or not seeds:
            return 0
        values = torch.stack([s.reshape(()).to(torch.float64) for s in seeds]).tolist()
        if all(abs(v * k - 1.0) <= torch.finfo(s.dtype).eps for v, s in zip(values, seeds)):
            self._mine = (values[0], k)
            return k
        return 0

    def settle(self, answer: int, groups: list[Any]) -> None:
        """Raise on every rank when some rank's answer (the all-reduced ``answer``) found a
        divided loss; its reductions are dropped first, so nothing stays in flight and no
        gradient of the step is handed out (the next forward starts clean)."""
        if not answer:
            return
        for g in groups:
            g.reduction.drop()
        if self._mine is not None:
            seed, k = self._mine
            found = (f"every micro-batch's loss in this step reached backward scaled by "
                     f"{seed:.6g} = 1/{k}, and this rank ran {k} micro-batches in the step: "
                     f"the loss was divided by len(sw.micro_batches(...))")
        else:
            k = answer
            found = (f"on another rank every micro-batch's loss in this step was divided "
                     f"by the {k} micro-batches that rank ran (len(sw.micro_batches(...)))")
        raise ShardwiseError(
            f"reproducible mode: {found}, or by a gradient-accumulation count that is the "
            f"same number, M/N (accelerate's Accelerator.backward and Lightning's "
            f"accumulate_grad_batches divide so). The engine already takes the mean over "
            f"all M micro-batches; divided again, the gradient would be 1/{k} of it, a "
            f"factor that depends on the world size, and so would the results. Call "
            f"backward() on each micro-batch's own loss, undivided: loss.backward(), not "
            f"(loss / len(mine)).backward(). No gradient of this step was handed out "
            f"(docs/reproducible.md, Note [a divided loss])")


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
