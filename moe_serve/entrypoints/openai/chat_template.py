"""A chat request's messages rendered to its prompt text through the model's chat template, in the
shape vLLM hands them over (shared by chat completions, /tokenize and the agents' endpoints)."""
from __future__ import annotations

import functools
import json
import re

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.request_limits import BadRequest


class ChatTemplate:
    def __init__(self, tok):
        self.tok = tok

    def chat_messages(self, messages: list[P.ChatMessage], field: str = "messages") -> list[dict]:
        """The request's messages as Hugging Face chat templates expect them, in the shape vLLM hands
        them over: content always a string (null, as agent frameworks send beside tool_calls, is "";
        a list of text parts is their texts joined by newlines), an assistant's tool_calls with their
        arguments as objects (templates write them with tojson), a tool message's tool_call_id.
        Templates written for plain chat concatenate content as a string and rely on this."""
        msgs = []
        for k, m in enumerate(messages):
            if m.role not in ("system", "user", "assistant", "tool", "developer"):
                raise BadRequest(f"unknown message role {m.role!r}", field)
            content = m.content
            if isinstance(content, list):  # content parts: keep the text ones
                texts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest(f"{field}[{k}].content[{j}]: only text content parts are supported, not "
                                         f"type {part.get('type')!r} (image inputs are not served)", field)
                    texts.append(part["text"])
                content = "\n".join(texts)
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls:
                if m.role != "assistant":
                    raise BadRequest(f"{field}[{k}]: only assistant messages have tool_calls", field)
                msg["tool_calls"] = [self._history_call(c, f"{field}[{k}].tool_calls[{j}]", field)
                                     for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                if m.role != "tool":
                    raise BadRequest(f"{field}[{k}]: only tool messages have a tool_call_id", field)
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            msgs.append(msg)
        return msgs

    def _history_call(self, call: dict, where: str, field: str) -> dict:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"arguments\": ...}}}", field)
        args = fn.get("arguments", "{}")
        if isinstance(args, str) and self._template_wants_objects:
            try:
                args = json.loads(args)
            except ValueError:
                raise BadRequest(f"{where}.function.arguments is not JSON: {args[:80]!r}", field) from None
        out = {"type": call.get("type", "function"), "function": {"name": fn["name"], "arguments": args}}
        if "id" in call:
            out["id"] = call["id"]
        return out

    @functools.cached_property
    def _template_wants_objects(self) -> bool:
        """Whether the chat template writes tool-call arguments with tojson (Qwen, Hermes, Mistral):
        then they are handed over as objects, as vLLM does; templates that paste them as text
        (DeepSeek-V3's) get the JSON text."""
        return bool(re.search(r"arguments\s*\|\s*tojson", self.tok.chat_template or ""))

    def render_chat(self, msgs: list[dict], add_generation_prompt: bool, template_kwargs: dict | None,
                    tools: list[dict] | None, field: str = "messages") -> str:
        kwargs = dict(template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        try:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # template errors (e.g. raise_exception on a role order) are the client's
            raise BadRequest(f"the chat template rejected the messages: {e}", field) from None
        if not isinstance(text, str):
            raise BadRequest("the chat template did not produce text", field)
        return text
