"""Data for nobubble: the built-in corpus, tokenizers, sources, the split and batching.

``build_data(cfg, run_dir)`` is the entry point of the training loop; see ``docs/data.md``.
"""

from nobubble.data.batching import TrainBatches
from nobubble.data.build import DataBundle, build_data
from nobubble.data.errors import DataError
from nobubble.data.shards import write_bin_shards
from nobubble.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataBundle",
    "DataError",
    "HFTokenizer",
    "Tokenizer",
    "TrainBatches",
    "build_data",
    "load_tokenizer",
    "write_bin_shards",
]
