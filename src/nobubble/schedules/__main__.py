"""``python -m nobubble.schedules``: the same as ``nobubble schedule``."""

from nobubble.config import ConfigError
from nobubble.config.flags import OneLineParser
from nobubble.schedules.cli import add_arguments, run
from nobubble.schedules.ir import ScheduleError

parser = OneLineParser(prog="python -m nobubble.schedules", description=__doc__)
add_arguments(parser)
try:
    raise SystemExit(run(parser.parse_args()))
except (ScheduleError, ConfigError) as exc:
    parser.exit(2, f"{parser.prog}: error: {exc}\n")
