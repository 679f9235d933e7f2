"""Checkpoints: atomic, checksummed shards (files) and optimizer state keyed by parameter name."""
