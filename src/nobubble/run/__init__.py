"""The run: one setup for both launchers, the training loop, checkpoints, step logging and the
summary (docs/architecture.md)."""
