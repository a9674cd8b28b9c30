"""What torch sees of a sharded model, one module per torch entry point: the optimizer step
(``step``, ``plain_step``), ``zero_grad``, ``state_dict`` and ``load_state_dict``
(``state_dict``), casts and moves (``casts``), and the refusals of misuse (``guards``).
The decisions for each entry point are in docs/parameters.md ("Torch's entry points").

Above ``engine.iteration``; within the engine only its top, ``build``, imports it.
"""
