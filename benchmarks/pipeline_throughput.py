"""Pipeline throughput and memory: the same as ``nobubble bench`` (see docs/benchmarks.md)."""

from nobubble.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
