"""How much CPU other processes took while a benchmark run ran: a shared machine's noise.

Linux only (``/proc/stat``): the CPU time every process used, minus the CPU time of this
process's finished children (the run), over the run's wall time, in cores.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (jiffies)


def _machine_busy_s() -> float:
    fields = _STAT.read_text().split("\n", 1)[0].split()[1:]
    return sum(int(fields[i]) for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class ForeignLoad:
    """Context manager around a child run; ``cores`` is the others' average CPU use."""

    def __init__(self) -> None:
        self.cores: float | None = None

    def __enter__(self) -> ForeignLoad:
        if _STAT.exists():
            self._start = (time.monotonic(), _machine_busy_s(), _children_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        if not _STAT.exists():
            return
        wall0, busy0, own0 = self._start
        wall = time.monotonic() - wall0
        foreign = (_machine_busy_s() - busy0) - (_children_cpu_s() - own0)
        self.cores = max(foreign, 0.0) / wall if wall > 0 else 0.0
