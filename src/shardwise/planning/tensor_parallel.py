"""Tensor parallelism in a plan: a model built on the meta device, its tp-split modules'
parameters made the local tensors one tp rank holds (Note [planning tensor parallelism]).

Note [planning tensor parallelism]
shardwise shards each tensor-parallel parameter's *local* tensor over dp as it shards a
plain parameter of that shape (Note [tensor-parallel parameters] in
engine/groups/tensor_parallel.py). So a plan with tp is the plan of the same model whose
tp-split parameters have their local shapes: :func:`split_for_tp` gives them those shapes
(on the meta device, at no cost), and the planner's units, groups and padded layout then
give the bytes a rank holds and feeds into the dp collectives, as without tp. Which
modules tp splits is what a ``parallelize_module`` plan says, and the planner cannot read
the training script: it takes a rule, ``{pattern: "colwise" | "rowwise"}``, the patterns
matched (``fnmatch``) against module names as the plan's keys are, by default
:data:`LLAMA_RULES` (the Hugging Face Llama, Mistral and Qwen names). ``colwise`` splits a
``Linear``'s weight and bias on dim 0 and an ``Embedding``'s weight on dim 1;
``rowwise`` a ``Linear``'s weight on dim 1 (its bias stays whole, replicated) and an
``Embedding``'s on dim 0, as torch's ``ColwiseParallel`` and ``RowwiseParallel`` do.
Everything else, sequence-parallel norms included, is replicated over tp: each rank holds
it whole, sharded over dp. The activations' collectives over tp (per layer, and their
size set by batch and sequence) are not planned, as activations are not.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch.nn as nn

LLAMA_RULES = {
    "*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise",
    "*.o_proj": "rowwise",
    "*.gate_proj": "colwise", "*.up_proj": "colwise", "*.down_proj": "rowwise",
}
STYLES = ("colwise", "rowwise")


@dataclass
class TpSplit:
    """What :func:`split_for_tp` split: tp ``size``, the ``modules`` by style, and the
    elements of the parameters it split (``split``, before the split) of ``total``."""

    size: int
    modules: dict[str, list[str]] = field(default_factory=dict)
    split: int = 0
    total: int = 0

    def describe(self, dp: int) -> str:
        """Lines for the plan's table, ``dp`` being the ranks sharded over (all replicas)."""
        counts = " and ".join(f"{len(v)} {k}" for k, v in self.modules.items() if v)
        share = self.split / self.total if self.total else 0.0
        return (f"  tensor parallel: {dp} dp x {self.size} tp = {dp * self.size} ranks; "
                f"{counts} modules split, {share:.0%} of the parameters (the figures "
                f"above are one tp rank's; the tp collectives of activations are not "
                f"planned)")

    def as_dict(self) -> dict:
        return {"size": self.size, "modules": self.modules, "split_elements": self.split,
                "elements": self.total}


def _dims(module: nn.Module, style: str) -> dict[str, int]:
    """The dim each parameter of ``module`` is split on under ``style`` (none: kept)."""
    if isinstance(module, nn.Linear):
        return {"weight": 0, "bias": 0} if style == "colwise" else {"weight": 1}
    if isinstance(module, nn.Embedding):
        return {"weight": 1 if style == "colwise" else 0}
    raise ValueError(f"{style} applies to Linear and Embedding modules (as torch's "
                     f"{style.capitalize()}Parallel), not {type(module).__name__}")


def split_for_tp(model: nn.Module, size: int,
                 rules: dict[str, str] | None = None) -> TpSplit:
    """Give the parameters of ``model``'s tp-split modules the local shapes of one tp
    rank, in place (Note [planning tensor parallelism]); ``model`` is on the meta device.

    Args:
        model: the unsharded model, built on the meta device.
        size: the tp size.
        rules: ``{fnmatch pattern over module names: "colwise" | "rowwise"}``; default
            :data:`LLAMA_RULES`. A module takes the first pattern that matches it.

    Returns:
        A :class:`TpSplit` saying what was split.

    Raises:
        ValueError: a style other than colwise or rowwise; a rule matching a module that
            is not a Linear or an Embedding; a tp size that does not divide a split dim
            (``sw.shard`` refuses it too); with ``size > 1``, no module matched (the
            rule does not name this model's modules).

    Example:
        >>> with torch.device("meta"):
        ...     model = LlamaForCausalLM(config)
        >>> split_for_tp(model, 8)       # then plan(model, dp)
    """
    rules = LLAMA_RULES if rules is None else rules
    bad = {k: v for k, v in rules.items() if v not in STYLES}
    if bad:
        raise ValueError(f"tp rule {bad}: each pattern's style is one of {STYLES}")
    out = TpSplit(size, {s: [] for s in STYLES},
                  total=sum(p.numel() for p in model.parameters()))
    if size == 1:
        return out
    done: dict[int, nn.Parameter] = {}  # a tied weight is split once
    for name, module in model.named_modules():
        style = next((s for pattern, s in rules.items() if fnmatch.fnmatchcase(name, pattern)),
                     None)
        if style is None:
            continue
        for pname, dim in _dims(module, style).items():
            p = getattr(module, pname, None)
            if p is None:
                continue
            if id(p) in done:
                setattr(module, pname, done[id(p)])
                continue
            if p.shape[dim] % size:
                raise ValueError(f"{name}.{pname}: tp={size} does not divide its dim {dim} "
                                 f"(size {p.shape[dim]}); sw.shard refuses that too")
            shape = list(p.shape)
            shape[dim] //= size
            out.split += p.numel()
            done[id(p)] = nn.Parameter(p.new_empty(shape), requires_grad=p.requires_grad)
            setattr(module, pname, done[id(p)])
        out.modules[style].append(name)
    if not any(out.modules.values()):
        raise ValueError(f"no module of the model matches the tp rule {rules}: give "
                         f"--tp-plan with patterns over its module names (the keys of its "
                         f"parallelize_module plan)")
    return out
