"""The OpenAI endpoints over one AsyncEngine, put together: one RequestRunner (runner.py: the path
every request takes into the engine and back, where its prompts are validated once) and the
endpoints built on it, each in its own module:

    completions.py   POST /v1/completions
    chat.py          POST /v1/chat/completions (Responses and Messages translate onto it)
    tokenize.py      POST /tokenize, /detokenize
    prefill.py       POST /v1/disagg/prefill (a prefill instance)

api_server.py routes HTTP to the handlers of `OpenAIServing`."""
from __future__ import annotations

from moe_serve.engine.async_engine import AsyncEngine
from moe_serve.entrypoints.openai.chat import ChatServing, chat_message
from moe_serve.entrypoints.openai.chat_template import ChatTemplate
from moe_serve.entrypoints.openai.completions import CompletionServing
from moe_serve.entrypoints.openai.outputs import StreamFailure
from moe_serve.entrypoints.openai.prefill import PrefillServing
from moe_serve.entrypoints.openai.reasoning import REASONING_PARSERS
from moe_serve.entrypoints.openai.request_limits import BadRequest, PromptLimits, sampling_params
from moe_serve.entrypoints.openai.runner import RequestRunner
from moe_serve.entrypoints.openai.tokenize import TokenizeServing
from moe_serve.entrypoints.openai.tool_parsers import PARSERS

__all__ = ["BadRequest", "OpenAIServing", "StreamFailure", "sampling_params"]


class OpenAIServing:
    """The handlers: `completions`, `chat` (and `count_chat_tokens`), `tokenize`, `detokenize` and
    `prefill`, each `(request, request id, deadline)`; `runner` for what they share."""

    def __init__(self, engine: AsyncEngine, served_model_name: str, max_model_len: int,
                 limits: PromptLimits | None = None, request_timeout_s: float | None = None,
                 tokenizer_threads: int = 2, max_pending_tokenizations: int = 256,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, api_key: str | None = None):
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                             f"(one of {', '.join(sorted(PARSERS))})")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser={tool_call_parser!r} is not one of {', '.join(sorted(PARSERS))}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser={reasoning_parser!r} is not one of "
                             f"{', '.join(sorted(REASONING_PARSERS))}")
        # Tokenization and chat templating run in the runner's pool, never on the event loop.
        self.runner = RequestRunner(engine, served_model_name, max_model_len, limits, request_timeout_s,
                                    tokenizer_threads, max_pending_tokenizations, api_key)
        template = ChatTemplate(self.runner.tok)
        self.chat_serving = ChatServing(self.runner, template, enable_auto_tool_choice, tool_call_parser,
                                        reasoning_parser)
        tokenizer = TokenizeServing(self.runner, template)
        self.completions = CompletionServing(self.runner).create
        self.chat = self.chat_serving.create
        self.count_chat_tokens = self.chat_serving.count_chat_tokens
        self.tokenize, self.detokenize = tokenizer.tokenize, tokenizer.detokenize
        self.prefill = PrefillServing(self.runner).prefill

    # What the translating endpoints (responses.py, anthropic.py) and api_server read.
    @property
    def engine(self) -> AsyncEngine:
        return self.runner.engine

    @property
    def tok(self):
        return self.runner.tok

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def reasoning_parser(self) -> str | None:
        return self.chat_serving.reasoning_parser

    def deadline(self) -> float | None:
        return self.runner.deadline()

    _chat_message = staticmethod(chat_message)
