"""Integrations with the tools people train with; each imports its library lazily.

- :mod:`shardwise.integrations.accelerate`: ``ShardwiseAccelerator``, an ``accelerate``
  ``Accelerator`` that shards models instead of wrapping them in DDP.
- :mod:`shardwise.integrations.transformers`: ``ShardwiseTrainer``, a Hugging Face
  ``Trainer`` built on it.
"""
