"""The engine: a parameter's life in a sharded model, from layout to gradient shard.

Layer 3, above ``comm`` and ``exact``. In dependency order: ``layout`` (where rows live),
``copies`` (rank-major and parameter-major buffers), ``reduce`` (a group's gradient
reduction), ``unit`` (storage, gathers and the unit's state machine), ``autograd`` and
``hooks`` (what torch calls), ``running_stats`` and ``buffers`` (replicated state),
``guards`` (misuse made loud), ``step`` (what ``optimizer.step()`` runs: Note [the
optimizer step]), ``state`` (the model's iteration), ``state_dict_hooks`` and ``clone``
(what a sharded model carries, and its copies), ``sharded_init`` and ``alloc`` (building
models too big for one rank), ``plan`` (what ``shard`` asks the engine to build) and
``build``, the engine's one entry point: it builds the groups, the units and the model
state from a plan (or from a deep copy's groups) and registers every hook. Internal: the
public names (``sharded_init``, ``BufferPolicy``, ``sync_buffers``) are re-exported from
``shardwise``.
"""
