"""The configuration schema: every setting, its help and its range, in sections; parsing and the
checks the schema alone can make. It imports nothing else of nobubble (docs/architecture.md)."""

from nobubble.config.checks import check_schema, profile_range, zero_problem
from nobubble.config.correction import (
    OLD_EF,
    OldSpellingWarning,
    correction_names,
    fold_ef,
    names_in,
)
from nobubble.config.fields import (
    ConfigError,
    NobubbleWarning,
    Range,
    as_bool,
    check_choice,
    setting,
    suggest,
)
from nobubble.config.logging import chosen_loggers
from nobubble.config.parse import (
    base_type,
    coerce,
    from_saved,
    load_toml,
    merge_layers,
    parse_overrides,
    unknown_key_error,
)
from nobubble.config.schema import FIELDS, HINTS, SECTION_OF, SECTIONS, TrainConfig

__all__ = [
    "FIELDS",
    "HINTS",
    "OLD_EF",
    "SECTIONS",
    "SECTION_OF",
    "ConfigError",
    "NobubbleWarning",
    "OldSpellingWarning",
    "Range",
    "TrainConfig",
    "as_bool",
    "base_type",
    "check_choice",
    "check_schema",
    "chosen_loggers",
    "coerce",
    "correction_names",
    "fold_ef",
    "from_saved",
    "load_toml",
    "merge_layers",
    "names_in",
    "parse_overrides",
    "profile_range",
    "setting",
    "suggest",
    "unknown_key_error",
    "zero_problem",
]
