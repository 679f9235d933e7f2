import dataclasses

import pytest

from nobubble.model.presets import PRESETS, ModelConfig


@pytest.fixture
def tiny_mc() -> ModelConfig:
    """A very small model config with a resolved vocabulary (fast on CPU)."""
    return dataclasses.replace(
        PRESETS["tiny"],
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
        vocab_size=64,
    )
