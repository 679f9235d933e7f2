"""The multi-process pipeline runtime (one stage per torchrun process)."""
