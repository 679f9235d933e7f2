"""``python -m nobubble.schedules``: the same as ``nobubble schedule``."""

import argparse

from nobubble.schedules.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m nobubble.schedules", description=__doc__)
add_arguments(parser)
raise SystemExit(run(parser.parse_args()))
