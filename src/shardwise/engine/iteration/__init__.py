"""One iteration of a sharded model: units and their state machine (``unit``), the model's
phases and its communication (``state``: forward, backward, the end of backward; the
order units ran in, prefetches, the gathers and reductions in flight), the module and
autograd hooks that drive them (``hooks``, ``autograd``), what keeps units gathered
between their computations, full parameters a forward lends included (``residency``),
replicated buffers (``buffers``, ``running_stats``), and the checks riding on each
forward (``model_check``, ``mixed``, ``exact_checks``).

Above ``engine.groups``; below ``engine.entry_points``.
"""
