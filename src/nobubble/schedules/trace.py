"""Chrome / Perfetto trace (the JSON "Trace Event Format"): open it in ui.perfetto.dev.

One process per schedule, one thread per stage; every F and B is a complete ("X") event, every
STEP an instant ("i") event. One simulated time unit is shown as one millisecond.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from nobubble.schedules.ir import ActionKind
from nobubble.schedules.timing import SimResult

MICROSECONDS_PER_UNIT = 1000.0


def chrome_trace(panels: Sequence[tuple[str, SimResult]]) -> dict[str, object]:
    """The trace of one or more (name, result) pairs, as a JSON-ready dict."""
    events: list[dict[str, object]] = []
    for pid, (name, result) in enumerate(panels):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        for s, stage in enumerate(result.timeline):
            events.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": pid,
                    "tid": s,
                    "args": {"name": result.row_label(s)},
                }
            )
            for t in stage:
                a = t.action
                base = {
                    "pid": pid,
                    "tid": s,
                    "ts": t.start * MICROSECONDS_PER_UNIT,
                    "cat": str(a.kind),
                }
                if a.kind.is_compute:
                    events.append(
                        base
                        | {
                            "name": "&".join(f"{p.kind}{p.microbatch}" for p in a.parts),
                            "ph": "X",
                            "dur": (t.end - t.start) * MICROSECONDS_PER_UNIT,
                            "args": {
                                "stage": a.stage,
                                **({"paired": str(a.paired)} if a.paired else {}),
                                "microbatch": a.microbatch,
                                "version": a.version,
                                "step": a.step,
                            },
                        }
                    )
                elif a.kind is ActionKind.STEP:
                    events.append(
                        base
                        | {
                            "name": f"STEP -> v{a.version}",
                            "ph": "i",
                            "s": "t",
                            "args": {"step": a.step, "version": a.version},
                        }
                    )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(panels: Sequence[tuple[str, SimResult]], path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(panels)))
