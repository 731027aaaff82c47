"""Helpers for tests and demos: tiny random checkpoints of every supported family."""

from hetserve.testing.tiny import FAMILIES, demo_model_dir, make_tiny_checkpoint, tiny_config

__all__ = ["FAMILIES", "demo_model_dir", "make_tiny_checkpoint", "tiny_config"]
