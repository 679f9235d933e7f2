"""Optional packages: imported where the feature that needs them starts, through :func:`require`.

nobubble imports at the top of its modules, with this exception: a package of an optional extra
(pyproject.toml's ``[project.optional-dependencies]``) is imported where its feature is entered
(``data=hf:...``, a ``.parquet`` file, a PNG, ``optim=lion``, ``logger=wandb``, ``nobubble
eval``...), so that nobubble and its default path run without it, and a missing one is an error
that names the extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from nobubble.config.fields import ConfigError

# top-level module -> (the distribution pip installs, the extra of nobubble that brings it)
EXTRAS: dict[str, tuple[str, str]] = {
    "datasets": ("datasets", "datasets"),
    "pyarrow": ("pyarrow", "parquet"),
    "matplotlib": ("matplotlib", "plots"),
    "pytorch_optimizer": ("pytorch-optimizer", "optimizers"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "lm_eval": ("lm-eval", "eval"),
    "transformers": ("transformers", "eval"),  # nobubble eval's; loading an export needs only hf
}


class MissingExtra(ConfigError):
    """A feature was asked for whose optional package is not installed (or does not import)."""


def require(module: str, feature: str) -> ModuleType:
    """``import module`` (e.g. ``"pyarrow.parquet"``) for ``feature`` (what the user asked for,
    e.g. ``"optim=lion"``); a :class:`MissingExtra` naming the install command if it fails."""
    distribution, extra = EXTRAS[module.partition(".")[0]]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(
            f"{feature} needs the optional package {distribution} ({exc}); install it with: "
            f"pip install 'nobubble[{extra}]'"
        ) from None
