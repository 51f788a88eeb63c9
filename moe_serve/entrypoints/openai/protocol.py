"""OpenAI request bodies as msgspec Structs (decoded with msgspec, not pydantic).

Unknown fields are ignored, as vLLM does, and named in one warning line of the server's log with the
request id (top-level fields; see api_server.unknown_fields). Every field declared here is honoured
or refused with a 400 naming it. Wrong types are rejected by msgspec with the path of the offending
field, which becomes the error's `param`.
"""
from __future__ import annotations

from typing import Union

import msgspec


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extra: usage so far in every chunk


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None  # the output always conforms (xgrammar's strict mode) either way


class ResponseFormat(msgspec.Struct, omit_defaults=True):
    type: str  # "text" | "json_object" | "json_schema"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(msgspec.Struct, omit_defaults=True):
    """vLLM's `structured_outputs` extra field: exactly one of these."""
    json: Union[str, dict, None] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF
    json_object: bool | None = None


class _Common(msgspec.Struct, omit_defaults=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    # vLLM's extra: per prompt token its logprob, rank and this many top logprobs ([0, 20]; not with
    # stream). On completions echo with logprobs computes them too (OpenAI's legacy scoring).
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained output (entrypoints/openai/structured.py): OpenAI's response_format, vLLM's extra.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's extra for disaggregated serving: {"prefill_url": URL} on a --disaggregation-mode decode
    # instance (set by `moe-serve router --prefill ... --decode ...`).
    kv_transfer_params: dict | None = None
    # Router replay (RL rollouts): per choice, the logical top-k experts of every MoE layer at every
    # prompt and output position but the last (`choices[i].routed_experts`; docs/rl_rollouts.md), as
    # nested lists or, with routed_experts_format "base64", little-endian int16 [positions, layers, k].
    return_routed_experts: bool = False
    routed_experts_format: str = "list"


class CompletionRequest(_Common):
    # One array-like per union is all msgspec allows; shapes are checked when the prompt is parsed.
    prompt: Union[str, list[Union[str, int, list[int]]], None] = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls, OpenAI's shape
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (templates may show it)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    echo: bool = False  # vLLM's extra: refused (400) on chat
    chat_template_kwargs: dict | None = None  # extra variables for the chat template (e.g. enable_thinking)
    # Tools are handed to the chat template (as `tools`); with --enable-auto-tool-choice and
    # tool_choice "auto" the output is parsed into tool calls.
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None  # false: at most the first parsed call is returned


class TokenizeRequest(msgspec.Struct, omit_defaults=True):
    """POST /tokenize (vLLM's shape): a `prompt`, or chat `messages` rendered by the template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


# --- responses --------------------------------------------------------------------------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """One entry of vLLM's `prompt_logprobs`: per prompt token {token id: this}."""
    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: None for the first prompt token, then {token id: PromptLogprob} (the token and the top ones).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    # With return_routed_experts (absent otherwise): moe_serve/routed_experts.py's "list" or "base64" form.
    routed_experts: Union[list[list[list[int]]], str, msgspec.UnsetType] = msgspec.UNSET


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"
    # The weights that generated it (set by weight updates): of the last token; in a stream, of the
    # chunk's tokens (a chunk with none: of the latest before it).
    weight_version: str | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob] | None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # always sent (null beside tool calls, as OpenAI does)
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With return_routed_experts (absent otherwise): moe_serve/routed_experts.py's "list" or "base64" form.
    routed_experts: Union[list[list[list[int]]], str, msgspec.UnsetType] = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None  # vLLM's, as on completions
    weight_version: str | None = None  # the weights that generated it (set by weight updates)


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None  # a fragment; the fragments of one call concatenate to its arguments


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int  # which call of this choice the fragment belongs to
    id: str | None = None  # sent with the call's first fragment
    type: str | None = None  # "function", with the first fragment
    function: DeltaFunctionCall | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # with finish_reason "stop": the stop string or token id (vLLM's)
    # With return_routed_experts, in the choice's last chunk: all its positions (as ChatChoice's).
    routed_experts: Union[list[list[list[int]]], str, msgspec.UnsetType] = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    weight_version: str | None = None  # the weights that made this chunk's tokens (set by weight updates)


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "moe-serve"
    root: str | None = None
    max_model_len: int | None = None
    object: str = "model"
    weight_version: str | None = None  # the weights served (set by weight updates)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
