"""The one exception type of the data package."""

from nobubble.config import ConfigError


class DataError(ConfigError):
    """A data or tokenizer problem a user can fix; the message names the problem and the fix.

    It subclasses :class:`~nobubble.config.ConfigError` (itself a ``ValueError``) so that every
    place that reports configuration problems without a traceback reports these too.
    """
