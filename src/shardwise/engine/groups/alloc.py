"""Freed host memory handed back to the operating system while a model is built.

Note [freed memory]
Building a model that does not fit on one rank frees, one submodule at a time, as much
memory as the model holds: under ``sharded_init`` each whole parameter after it is
partitioned, in ``shard`` each group's full values after the scatter. glibc keeps what
is freed: blocks of 128 KiB or more are mmapped at first, but the threshold rises with
the first large free, and blocks freed by gloo's worker threads go back to those threads'
arenas, which the main thread does not allocate from. Resident memory then grows with
the model though live memory does not.

So the build paths report what they free, and every 64 MiB of it ``malloc_trim(0)``
returns the free memory of every arena to the OS: often enough to keep the peak near the
model's share, rarely enough that the walks of the heap cost nothing that shows.
BENCHMARKS.md ("Resident memory while building a model bigger than one rank",
``benchmarks/build_memory.py``) has the peaks with and without it, and the other
intervals tried. Elsewhere than glibc (musl, macOS) this does nothing.

Note [a fixed mmap threshold]
Training keeps the same growth going: glibc raises its mmap threshold to the size of the
largest block freed (up to 32 MiB), after which a unit's gathered buffers, staged shards
and reduction buffers come from the heap, and what they free stays resident: the peak
grows with the model's depth though nothing live grows. A model whose state is on disk
promises a peak that does not grow with depth, so :func:`bound_heap` fixes the threshold
at 1 MiB (``mallopt(M_MMAP_THRESHOLD)``, which also stops the adjustment): blocks that
large are mapped and unmapped, and the peak no longer depends on depth (BENCHMARKS.md,
"Offload", has the peaks before and after). It is process-wide, set once, and left alone
when ``MALLOC_MMAP_THRESHOLD_`` is in the environment (the user chose). The threshold only
decides how new memory is obtained: free chunks already in the heap (a model built under
``sharded_init`` leaves them on ``src_rank``) are still handed out and kept, so such a
model's full parameters report what they free (:func:`freed`), and the step trims.
"""

from __future__ import annotations

import ctypes
import os

_EVERY = 64 * 2**20  # bytes freed between two trims (BENCHMARKS.md, resident memory)


def _find_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _find_trim()
_freed = 0
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_THRESHOLD = 2**20
_bounded = False


def freed(nbytes: int) -> None:
    """``nbytes`` of host memory were just released; trim once enough has been."""
    global _freed
    if _trim is None:
        return
    _freed += nbytes
    if _freed >= _EVERY:
        _freed = 0
        _trim(0)


def trim() -> None:
    """Return free memory now (the end of a build)."""
    global _freed
    _freed = 0
    if _trim is not None:
        _trim(0)


def bound_heap() -> bool:
    """Note [a fixed mmap threshold]: whether the threshold is now fixed (``False``
    where glibc is absent or the user set ``MALLOC_MMAP_THRESHOLD_``)."""
    global _bounded
    if _bounded:
        return True
    if _trim is None or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        ok = ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    _bounded = ok
    return ok
