"""A group of parameters and how it moves: where each parameter's rows live (``layout``),
the copies between parameter-major and rank-major buffers (``copies``), the gradient
reduction (``reduce``, ``exact_reduction``), the storage of a group's shards and of its
offloaded state (``offload``), and the one group type (``interface``, ``parts``,
``flat``) with its tensor subclasses' gather strategy (``subclass``, and ``quantize`` for
quantized bases).

The bottom room of the engine: nothing here knows units, iterations or torch's entry
points.
"""
