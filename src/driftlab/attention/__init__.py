"""The single attention function every local model runs through (see engine.py)."""

from driftlab.attention.engine import ATTENTION_NAME, register

__all__ = ["ATTENTION_NAME", "register"]
