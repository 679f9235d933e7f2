"""Delay corrections: one module each (facts, state, rule); the registry collects them."""
