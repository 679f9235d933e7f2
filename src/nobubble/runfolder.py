"""The run folder: config.json, metrics.jsonl, summary.json, tokenizer and checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from nobubble.config import ConfigError, TrainConfig


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to ``path`` so that readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def default_run_dir(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{cfg.run_name()}-{time.strftime('%Y%m%d-%H%M%S')}"


class RunFolder:
    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @classmethod
    def create(cls, cfg: TrainConfig, overwrite: bool = False) -> RunFolder:
        """Make a fresh run folder; refuse to touch one that already holds something."""
        path = Path(cfg.out) if cfg.out else default_run_dir(cfg)
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"run folder {path} exists and is not a directory; choose another --out"
            )
        if path.exists() and any(path.iterdir()):
            if not overwrite:
                raise ConfigError(
                    f"run folder {path} already holds files; choose another --out, continue it "
                    f"with --resume {path}, or pass --overwrite to replace it"
                )
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        write_json_atomic(run.config_path, cfg.to_dict())
        return run

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary_path, summary)
