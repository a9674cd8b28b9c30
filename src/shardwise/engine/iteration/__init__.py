"""One iteration of a sharded model: units and their state machine (``unit``), the model's
phases (``state``: forward, backward, prefetch, the end of backward), the module and
autograd hooks that drive them (``hooks``, ``autograd``), what keeps units gathered
between their computations (``residency``), replicated buffers (``buffers``,
``running_stats``), and the checks riding on each forward (``model_check``, ``mixed``,
``lent``, ``exact_checks``).

Above ``engine.groups``; below ``engine.entry_points``.
"""
