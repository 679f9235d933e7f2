"""Hugging Face Llama checkpoints in and out: ``nobubble export --format hf`` and ``init_from``.

Both sides read and write safetensors and JSON themselves; ``transformers`` is needed only to load
an export (or to make a checkpoint to start from), never by nobubble. See docs/export.md.

- :mod:`nobubble.hf.convert`: parameter names, shapes and the ``config.json`` of the mapping;
- :mod:`nobubble.hf.export`: a run's checkpoint to a ``LlamaForCausalLM`` folder;
- :mod:`nobubble.hf.init`: a new run's first weights from such a folder (``init_from=PATH``);
- :mod:`nobubble.hf.cli`: ``nobubble export``.
"""
