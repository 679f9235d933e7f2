"""How much CPU others took while a benchmark run ran: a shared machine's noise.

Linux only (``/proc/stat``), over the run's wall time, in cores:

- ``cores``: other processes on this machine, the CPU time every process used (user, nice,
  system, irq, softirq) minus that of this process's finished children (the run). A benchmark
  can wait for them to finish and run again.
- ``steal_cores``: time the hypervisor gave this virtual machine's CPUs to other machines
  (``steal``). Nothing on this machine can make it go away, so it is reported apart and never
  makes a run count as disturbed; a high figure says the machine's cores are slower than they
  look.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user nice system irq softirq (jiffies)
_STEAL_FIELD = 7


def _machine_s() -> tuple[float, float]:
    """(CPU time of every process, time stolen by the hypervisor), in seconds."""
    fields = [int(f) for f in _STAT.read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    steal = fields[_STEAL_FIELD] if len(fields) > _STEAL_FIELD else 0
    return sum(fields[i] for i in _BUSY_FIELDS) / tick, steal / tick


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class ForeignLoad:
    """Context manager around a child run; ``cores``: the other processes' average CPU use;
    ``steal_cores``: the hypervisor's steal (module docstring)."""

    def __init__(self) -> None:
        self.cores: float | None = None
        self.steal_cores: float | None = None

    def __enter__(self) -> ForeignLoad:
        if _STAT.exists():
            self._start = (time.monotonic(), *_machine_s(), _children_cpu_s())
        return self

    def __exit__(self, *exc: object) -> None:
        if not _STAT.exists():
            return
        wall0, busy0, steal0, own0 = self._start
        wall = time.monotonic() - wall0
        busy, steal = _machine_s()
        foreign = (busy - busy0) - (_children_cpu_s() - own0)
        self.cores = max(foreign, 0.0) / wall if wall > 0 else 0.0
        self.steal_cores = (steal - steal0) / wall if wall > 0 else 0.0
