"""The speed and memory benchmark (``nobubble bench``): gpipe, 1f1b, 2bw (with and without error
feedback) and pipedream on our runtime, and torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B on the same stage modules, run back to back under torchrun. See docs/benchmarks.md.
"""

from nobubble.bench.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
