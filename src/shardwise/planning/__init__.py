"""Planning: what ``shard`` will build, and what it will cost, decided before building.

Layer 4, above the engine: the choice of units (``units``), byte accounting of what each
rank stores (``memory``) and the planner behind ``shardwise plan`` (``planner``).
``shardwise.planning.planner.plan`` and ``shardwise.planning.memory`` are public.
"""
