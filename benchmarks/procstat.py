"""This process's memory as the kernel counts it, for the benchmarks that report peaks."""

from __future__ import annotations


def status_mib(key: str) -> float:
    """A field of ``/proc/self/status`` in MiB (``VmRSS``, ``VmHWM``, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak() -> None:
    """Start ``VmHWM`` (the peak RSS) again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
