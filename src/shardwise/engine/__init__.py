"""The engine: a parameter's life in a sharded model, from layout to gradient shard.

Layer 3, above ``comm`` and ``exact``, in three rooms, each importing only from the rooms
below it:

- ``groups``: a group of parameters and how it moves (layout, copies, storage, offload,
  reduction);
- ``iteration``: one iteration (units, phases, hooks, prefetch, buffers);
- ``entry_points``: what torch sees (the optimizer step, ``zero_grad``, casts, the state
  dict, refusals).

Above them, the engine's top: ``plan`` (what ``shard`` asks the engine to build),
``build``, the engine's one entry point (it builds the groups, the units and the model
state from a plan, or from a deep copy's groups, and registers every hook), ``clone``
(deep copies) and ``sharded_init`` (models built partitioned). Internal: the public names
(``sharded_init``, ``BufferPolicy``, ``sync_buffers``, ``per_rank``) are re-exported from
``shardwise``.
"""
