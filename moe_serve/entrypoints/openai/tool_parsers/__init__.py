"""Tool-call parsers: model text -> content and OpenAI tool calls, whole or streamed.

`base.py` holds the interface every parser implements; parsers register themselves by name in
`PARSERS` (the names `--tool-call-parser` accepts).
"""
from .base import PARSERS, ParsedOutput, StreamDelta, ToolParser, ToolStream, new_call_id  # noqa: F401
from . import deepseek_v3, deepseek_v31, deepseek_v32, hermes, mistral  # noqa: F401,E402  (register the format parsers)
