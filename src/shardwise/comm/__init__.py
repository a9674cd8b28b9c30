"""Communication: collectives over process groups, and the checks that ride on them.

Layer 1, above the base modules (``errors``, ``_env``, ``_log``, ``_registry``) and below
everything else: nothing here knows what a unit or a model is. Internal; the public
``init_distributed`` is re-exported from ``shardwise``.
"""
