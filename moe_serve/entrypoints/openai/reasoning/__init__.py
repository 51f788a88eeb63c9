"""Reasoning parsers: the model's `<think>...</think>` text -> `reasoning_content`, the rest -> content.

`--reasoning-parser NAME` picks one of REASONING_PARSERS for every chat request.
"""
from .base import REASONING_PARSERS, ReasoningParser, ReasoningStream  # noqa: F401
from . import think  # noqa: F401  (registers deepseek_r1 and qwen3)
