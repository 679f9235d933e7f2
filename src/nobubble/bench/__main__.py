"""``python -m nobubble.bench``: the same as ``nobubble bench``."""

from nobubble.bench.cli import main

raise SystemExit(main())
