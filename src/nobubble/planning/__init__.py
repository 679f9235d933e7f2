"""``nobubble plan``: a cost model for clusters. Per-action times from a model's FLOPs at a
stated MFU, messages from bandwidth and latency, memory from bytes per parameter and per
activation; the schedule simulator turns them into step time, bubble and memory per rank for
every schedule (docs/schedules.md, "Planning a cluster"); with ``--optim``, each schedule's time
to the synchronous final loss from the fitted law of the delay's extra steps (``target``)."""
