"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) as a translation onto
chat completions: `system` and the messages' text, tool_use and tool_result blocks become chat
messages, `tools` (input_schema) chat tools, tool_choice auto / any / tool / none the chat's auto /
required / a named function / none, stop_sequences `stop`, `thinking` the template's
enable_thinking; the chat path renders, constrains and parses the output as it does its own, and
its message, or stream of chunks, becomes Anthropic's content blocks and events. Errors are in
Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.
"""
from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Union

import msgspec

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.outputs import sse_json
from moe_serve.entrypoints.openai.serving import BadRequest, OpenAIServing, StreamFailure

# Chat request fields as this API names them, for errors raised on the translated request.
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "chat_template_kwargs": "thinking",
           "response_format": "output_config"}
# HTTP status -> Anthropic's error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               499: "invalid_request_error", 503: "overloaded_error", 529: "overloaded_error"}


class MessagesRequest(msgspec.Struct, omit_defaults=True):
    messages: list[dict]
    max_tokens: int | None = None  # required by create, not by count_tokens
    model: str | None = None
    system: Union[str, list[dict], None] = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # {"type": "enabled", "budget_tokens": N} | {"type": "adaptive"} | {"type": "disabled"}: the template's
    # enable_thinking (budget_tokens is not enforced apart from max_tokens)
    thinking: dict | None = None
    # {"format": {"type": "json_schema", "schema": ...}}: constrained output; {"effort": ...}: the
    # template's reasoning_effort, where it has one
    output_config: dict | None = None
    metadata: dict | None = None  # {"user_id": ...}: accepted, no effect on the output
    cache_control: dict | None = None  # accepted: prompt prefixes are cached automatically
    service_tier: str | None = None  # "auto" / "standard_only"
    kv_transfer_params: dict | None = None  # disaggregated serving (as on chat completions)
    # Sampling, as older clients send it (the current API has none of them).


def error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                           "message": message}})


class MessagesServing:
    def __init__(self, chat: OpenAIServing):
        self.chat = chat

    # --- request -> chat request --------------------------------------------------------------------
    def _messages(self, req: MessagesRequest) -> list[P.ChatMessage]:
        msgs = []
        if req.system is not None:
            msgs.append(P.ChatMessage("system", _text(req.system, "system", "system")))
        if not req.messages:
            raise BadRequest("messages: at least one message is required", "messages")
        for i, m in enumerate(req.messages):
            where = f"messages[{i}]"
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("user", "assistant"):
                raise BadRequest(f"{where}.role must be 'user' or 'assistant', got {role!r}", "messages")
            content = m.get("content")
            if isinstance(content, str):
                msgs.append(P.ChatMessage(role, content))
                continue
            if not isinstance(content, list):
                raise BadRequest(f"{where}.content must be a string or a list of content blocks", "messages")
            texts, calls, thinking = [], [], None
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                at = f"{where}.content[{j}]"
                if kind == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif kind == "tool_use" and role == "assistant":
                    if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                        raise BadRequest(f"{at}: a tool_use block needs an id and a name", "messages")
                    calls.append({"id": block["id"], "type": "function", "function": {
                        "name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
                elif kind == "tool_result" and role == "user":
                    if texts:  # text before a result: its own user turn
                        msgs.append(P.ChatMessage("user", "\n".join(texts)))
                        texts = []
                    result = block.get("content", "")
                    # A list of blocks (as coding agents send results) is one string, its texts on lines.
                    text = result if isinstance(result, str) else _text(result, f"{at}.content", "messages", "\n")
                    if block.get("is_error"):
                        text = f"Error: {text}"
                    if not isinstance(block.get("tool_use_id"), str):
                        raise BadRequest(f"{at}: a tool_result block needs a tool_use_id", "messages")
                    msgs.append(P.ChatMessage("tool", text, tool_call_id=block["tool_use_id"]))
                elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                    thinking = block.get("thinking") or None
                else:
                    raise BadRequest(f"{at}: content block type {kind!r} is not supported in a {role} message (text, "
                                     "tool_use and thinking from the assistant, text and tool_result from the user; "
                                     "image and document inputs are not served)", "messages")
            if texts or calls or thinking or role == "assistant":
                msgs.append(P.ChatMessage(role, "\n".join(texts) if texts or not calls else None,
                                          tool_calls=calls or None, reasoning_content=thinking))
        return msgs

    def _tools(self, req: MessagesRequest) -> list[dict] | None:
        if req.tools is None:
            return None
        out = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or "input_schema" not in t:
                raise BadRequest(f"tools[{i}]: only custom tools with a name and an input_schema are served "
                                 f"(type {t.get('type') if isinstance(t, dict) else t!r})", "tools")
            if t.get("type") not in (None, "custom"):
                raise BadRequest(f"tools[{i}].type {t['type']!r} is not supported: only custom tools are served",
                                 "tools")
            # OpenAI's key order (templates write the tool with tojson, keys in order)
            fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") is not None else {}),
                  "parameters": t["input_schema"]}
            out.append({"type": "function", "function": fn})
        return out

    @staticmethod
    def _tool_choice(req: MessagesRequest):
        tc = req.tool_choice
        if tc is None:
            return None if req.tools is None else "auto"
        kind = tc.get("type")
        if kind == "tool" and isinstance(tc.get("name"), str):
            choice = {"type": "function", "function": {"name": tc["name"]}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise BadRequest(f"tool_choice.type {kind!r} is not one of auto, any, tool, none", "tool_choice")
        return choice

    def _template_kwargs(self, req: MessagesRequest) -> dict | None:
        kwargs, template = {}, self.chat.tok.chat_template or ""
        t = req.thinking
        if t is not None:
            kind = t.get("type")
            if kind not in ("enabled", "adaptive", "disabled"):
                raise BadRequest(f"thinking.type {kind!r} is not 'enabled', 'adaptive' or 'disabled'", "thinking")
            if "enable_thinking" not in template:
                raise BadRequest("thinking: this model's chat template has no enable_thinking switch", "thinking")
            if kind != "disabled" and self.chat.reasoning_parser is None:
                raise BadRequest("thinking needs the server started with --reasoning-parser NAME (the thinking "
                                 "blocks are the reasoning it parses)", "thinking")
            kwargs["enable_thinking"] = kind != "disabled"
        effort = (req.output_config or {}).get("effort")
        if effort is not None:
            if "reasoning_effort" not in template:
                raise BadRequest(f"output_config.effort={effort!r}: this model's chat template has no "
                                 "reasoning_effort to set", "output_config")
            kwargs["reasoning_effort"] = effort
        return kwargs or None

    @staticmethod
    def _response_format(req: MessagesRequest) -> P.ResponseFormat | None:
        oc = req.output_config or {}
        unknown = set(oc) - {"effort", "format"}
        if unknown:
            raise BadRequest(f"output_config.{sorted(unknown)[0]} is not supported", "output_config")
        fmt = oc.get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise BadRequest("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                             "output_config")
        return P.ResponseFormat("json_schema", P.JsonSchemaFormat("output", None, fmt["schema"], True))

    def chat_request(self, req: MessagesRequest, stream: bool) -> P.ChatCompletionRequest:
        if req.service_tier not in (None, "auto", "standard_only"):
            raise BadRequest(f"service_tier {req.service_tier!r} is not supported", "service_tier")
        return P.ChatCompletionRequest(
            model=req.model, messages=self._messages(req), max_completion_tokens=req.max_tokens,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=stream,
            stream_options=P.StreamOptions(include_usage=True, continuous_usage_stats=True) if stream else None,
            tools=self._tools(req),
            tool_choice=self._tool_choice(req) if req.tools is not None or req.tool_choice else None,
            parallel_tool_calls=False if (req.tool_choice or {}).get("disable_parallel_tool_use") else None,
            chat_template_kwargs=self._template_kwargs(req), response_format=self._response_format(req),
            kv_transfer_params=req.kv_transfer_params)

    # --- the endpoints ------------------------------------------------------------------------------
    async def create(self, req: MessagesRequest, rid: str, deadline: float | None = None):
        if req.max_tokens is None:
            raise BadRequest("max_tokens: field required", "max_tokens")
        creq = self.chat_request(req, req.stream)
        msg_id = f"msg_{uuid.uuid4().hex}"
        try:
            result = await self.chat.chat(creq, rid, deadline, items=True)
        except BadRequest as e:
            raise BadRequest(str(e), _PARAMS.get(e.param, e.param), e.status, e.code, e.type) from None
        if req.stream:
            return self._events(msg_id, result)
        choice = result.choices[0]
        m = choice.message
        blocks = []
        if m.reasoning_content:
            blocks.append({"type": "thinking", "thinking": m.reasoning_content, "signature": ""})
        if m.content:
            blocks.append({"type": "text", "text": m.content})
        for c in m.tool_calls:
            blocks.append({"type": "tool_use", "id": c.id, "name": c.function.name,
                           "input": _arguments(c.function.arguments)})
        stop, seq = _stop_reason(choice.finish_reason, choice.stop_reason)
        return self._message(msg_id, blocks, stop, seq, result.usage.prompt_tokens, result.usage.completion_tokens)

    async def count_tokens(self, req: MessagesRequest, rid: str, deadline: float | None = None) -> dict:
        creq = self.chat_request(req, False)
        if creq.tools:  # rendered the same whatever the choice; counting needs no tool parser
            creq.tool_choice = "none"
        tok = await self.chat.count_chat_tokens(creq, deadline)
        return {"input_tokens": tok}

    def _message(self, msg_id: str, blocks: list, stop: str | None, seq: str | None, inp: int, out: int) -> dict:
        return {"id": msg_id, "type": "message", "role": "assistant", "model": self.chat.model_name,
                "content": blocks, "stop_reason": stop, "stop_sequence": seq,
                "usage": {"input_tokens": inp, "output_tokens": out}}

    async def _events(self, msg_id: str, items) -> AsyncIterator[bytes]:
        def event(kind: str, **data) -> bytes:
            return f"event: {kind}\n".encode() + b"data: " + sse_json({"type": kind, **data}) + b"\n\n"

        started, index, open_kind, calls = False, -1, None, {}
        finish = stop_str = None
        usage = (0, 0)

        def close():
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", index=index)]

        def start(kind: str, block: dict):
            """Close the open block, open the next one of this kind."""
            nonlocal index, open_kind
            evs = close()
            index += 1
            open_kind = kind
            return evs + [event("content_block_start", index=index, content_block=block)]

        # The chat items come from the first token on; message_start goes out with the first one's
        # events (one write per item), so a client timing the first event times a computed token.
        async for item in items:
            evs = []
            if isinstance(item, StreamFailure):
                evs += close()
                evs.append(event("error", error={"type": ERROR_TYPES.get(item.status, "api_error"),
                                                 "message": item.message}))
                yield b"".join(evs)
                return
            if item.usage is not None:  # every chunk carries the usage so far
                usage = (item.usage.prompt_tokens, item.usage.completion_tokens)
            if not started:
                started = True
                evs.append(event("message_start", message=self._message(msg_id, [], None, None, usage[0], 0)))
            for c in item.choices:
                d = c.delta
                if d.reasoning_content:
                    if open_kind != "thinking":
                        evs += start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    evs.append(event("content_block_delta", index=index,
                                     delta={"type": "thinking_delta", "thinking": d.reasoning_content}))
                if d.content:
                    if open_kind != "text":
                        evs += start("text", {"type": "text", "text": ""})
                    evs.append(event("content_block_delta", index=index,
                                     delta={"type": "text_delta", "text": d.content}))
                for tc in d.tool_calls or []:
                    if tc.index not in calls:
                        evs += start("tool_use", {"type": "tool_use", "id": tc.id or f"toolu_{uuid.uuid4().hex}",
                                                  "name": (tc.function.name if tc.function else None) or "",
                                                  "input": {}})
                        calls[tc.index] = index
                    frag = tc.function.arguments if tc.function else None
                    if frag:
                        evs.append(event("content_block_delta", index=calls[tc.index],
                                         delta={"type": "input_json_delta", "partial_json": frag}))
                if c.finish_reason:
                    finish, stop_str = c.finish_reason, c.stop_reason
            if evs:
                yield b"".join(evs)
        stop, seq = _stop_reason(finish, stop_str)
        evs = [] if started else [event("message_start", message=self._message(msg_id, [], None, None, *usage))]
        evs += close()
        evs.append(event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                         usage={"input_tokens": usage[0], "output_tokens": usage[1]}))
        evs.append(event("message_stop"))
        yield b"".join(evs)


def _stop_reason(finish: str | None, stop) -> tuple[str | None, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _arguments(text: str):
    try:
        v = json.loads(text)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _text(content, where: str, param: str, sep: str = "") -> str:
    """A string, or a list of text blocks' texts joined by sep (vLLM: "" for the system prompt's
    blocks, newlines for a message's and a tool result's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text blocks", param)
    texts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise BadRequest(f"{where}[{j}]: only text blocks are supported here, not type {kind!r}", param)
        texts.append(b["text"])
    return sep.join(texts)
