"""The speed and memory benchmark (``nobubble bench``): every pipeline schedule on our runtime
(with or without a delay correction, compile or activation checkpointing), and
torch.distributed.pipelining's schedules on the same stage modules, run back to back under
torchrun, with data parallelism if asked. See docs/benchmarks.md.
"""

from nobubble.bench.cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
