"""Helpers for tests and demos: tiny random checkpoints of every supported family."""

from hetserve.testing.tiny import demo_model_dir, make_tiny_checkpoint
from hetserve.testing.tiny_families import FAMILIES, tiny_config

__all__ = ["FAMILIES", "demo_model_dir", "make_tiny_checkpoint", "tiny_config"]
