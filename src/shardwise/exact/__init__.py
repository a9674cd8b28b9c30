"""The reproducible mode's arithmetic: sums that do not depend on the world size.

Layer 2, above ``comm``: exact sums of fp32 tensors, their reduction across ranks, and the
micro-batch helpers (``sw.micro_batches``, ``sw.global_mean``) re-exported from
``shardwise``. The engine asks it for reductions; nothing here knows about modules.
"""
