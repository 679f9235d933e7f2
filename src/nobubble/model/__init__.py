"""The model: its shapes (presets), layers, mixture of experts and partition into stages."""
