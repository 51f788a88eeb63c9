"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) as a translation onto chat
completions: the request becomes a ChatCompletionRequest (instructions and input items as messages,
function tools as chat tools, text.format as response_format, reasoning.effort as the template's
reasoning_effort), which the chat path renders, constrains and parses exactly as it does its own
requests; its message, or its stream of chunks, becomes Responses output items and events.

Responses are kept (store, the default) in a bounded in-memory store, least recently stored evicted
past STORE_MAX_ENTRIES or after STORE_MAX_AGE_S: `previous_response_id` continues one (its messages
and output become the conversation before this input; its instructions do not carry over, as in
OpenAI's API), and GET returns it; an unknown or evicted id is a 404.
"""
from __future__ import annotations

import collections
import time
import uuid
from typing import AsyncIterator, Union

import msgspec

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.outputs import sse_json
from moe_serve.entrypoints.openai.serving import BadRequest, OpenAIServing, StreamFailure

STORE_MAX_ENTRIES = 1024
STORE_MAX_AGE_S = 3600.0

# Chat request fields as this API names them, for errors raised on the translated request.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "chat_template_kwargs": "reasoning"}


class ResponsesRequest(msgspec.Struct, omit_defaults=True):
    model: str | None = None
    input: Union[str, list[dict], None] = None
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    reasoning: dict | None = None  # {"effort": ...}: the chat template's reasoning_effort, where it has one
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict | None = None  # echoed
    user: str | None = None  # echoed
    truncation: str | None = None  # "disabled" only
    include: list[str] | None = None  # refused when not empty
    background: bool | None = None  # refused when true
    max_tool_calls: int | None = None  # refused
    top_logprobs: int | None = None  # refused when not 0
    service_tier: str | None = None  # "auto" / "default" only
    kv_transfer_params: dict | None = None  # disaggregated serving (as on chat completions)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseStore:
    """Response id -> (the conversation as chat messages, the Response object); bounded by count and age."""

    def __init__(self, max_entries: int = STORE_MAX_ENTRIES, max_age_s: float = STORE_MAX_AGE_S):
        self.max_entries, self.max_age_s = max_entries, max_age_s
        self._items: collections.OrderedDict[str, tuple[float, list, dict]] = collections.OrderedDict()

    def put(self, rid: str, messages: list, response: dict) -> None:
        self._items[rid] = (time.monotonic(), messages, response)
        self._items.move_to_end(rid)
        self._evict()

    def get(self, rid: str) -> tuple[list, dict] | None:
        self._evict()
        item = self._items.get(rid)
        return None if item is None else (item[1], item[2])

    def _evict(self) -> None:
        now = time.monotonic()
        while self._items and (len(self._items) > self.max_entries
                               or now - next(iter(self._items.values()))[0] > self.max_age_s):
            self._items.popitem(last=False)


def not_found(rid: str, param: str = "previous_response_id") -> BadRequest:
    return BadRequest(f"Response with id '{rid}' not found (never stored, or evicted from the server's store of "
                      f"{STORE_MAX_ENTRIES} responses kept up to {STORE_MAX_AGE_S:.0f} s).", param, 404, "not_found",
                      "invalid_request_error")


class ResponsesServing:
    def __init__(self, chat: OpenAIServing):
        self.chat = chat
        self.store = ResponseStore()

    # --- request -> chat request ------------------------------------------------------------------
    def _check(self, req: ResponsesRequest) -> None:
        if req.input is None or req.input == "" or req.input == []:
            raise BadRequest("input must be a non-empty string or list of items", "input")
        if req.truncation not in (None, "disabled"):
            raise BadRequest(f"truncation={req.truncation!r} is not supported (only 'disabled': a conversation too "
                             "long for the context is refused)", "truncation")
        if req.include:
            raise BadRequest(f"include={req.include!r} is not supported", "include")
        if req.background:
            raise BadRequest("background responses are not supported", "background")
        if req.max_tool_calls is not None:
            raise BadRequest("max_tool_calls is not supported", "max_tool_calls")
        if req.top_logprobs:
            raise BadRequest("top_logprobs is not supported on responses", "top_logprobs")
        if req.service_tier not in (None, "auto", "default"):
            raise BadRequest(f"service_tier={req.service_tier!r} is not supported", "service_tier")

    def _messages(self, req: ResponsesRequest, history: list) -> list[P.ChatMessage]:
        msgs = [P.ChatMessage("system", req.instructions)] if req.instructions else []
        msgs += history
        items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
        reasoning = None
        for i, item in enumerate(items):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise BadRequest(f"{where} must be an object", "input")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise BadRequest(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                     "input")
                msgs.append(P.ChatMessage(role, _text_of(item.get("content"), f"{where}.content"),
                                          reasoning_content=reasoning if role == "assistant" else None))
                reasoning = None if role == "assistant" else reasoning
            elif kind == "function_call":
                call = {"id": _str(item, "call_id", where), "type": "function",
                        "function": {"name": _str(item, "name", where), "arguments": _str(item, "arguments", where)}}
                last = msgs[-1] if msgs else None
                if last is not None and last.role == "assistant" and last.tool_calls and not last.content:
                    last.tool_calls.append(call)  # consecutive calls: one assistant turn
                else:
                    msgs.append(P.ChatMessage("assistant", None, tool_calls=[call], reasoning_content=reasoning))
                    reasoning = None
            elif kind == "function_call_output":
                output = item.get("output")
                msgs.append(P.ChatMessage("tool", output if isinstance(output, str) else
                                          _text_of(output, f"{where}.output"), tool_call_id=_str(item, "call_id", where)))
            elif kind == "reasoning":  # an earlier turn's reasoning: the next assistant turn's reasoning_content
                reasoning = "".join(c.get("text", "") for c in item.get("content") or [] if isinstance(c, dict)) or None
            else:
                raise BadRequest(f"{where}.type {kind!r} is not supported (message, function_call, "
                                 "function_call_output and reasoning items are)", "input")
        return msgs

    def _tools(self, req: ResponsesRequest) -> list[dict] | None:
        if req.tools is None:
            return None
        out = []
        for i, t in enumerate(req.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise BadRequest(f"tools[{i}].type {kind!r} is not supported: only function tools are served",
                                 "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
            if not isinstance(fn.get("name"), str):
                raise BadRequest(f"tools[{i}].name must be a string", "tools")
            out.append({"type": "function", "function": fn})
        return out

    @staticmethod
    def _tool_choice(tc):
        if tc is None or isinstance(tc, str):
            return tc
        if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
            return {"type": "function", "function": {"name": tc["name"]}}
        raise BadRequest(f"tool_choice {tc!r} is not supported: 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"name\": ...}", "tool_choice")

    @staticmethod
    def _response_format(text: dict | None) -> P.ResponseFormat | None:
        fmt = (text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return P.ResponseFormat("json_object")
        if fmt.get("type") == "json_schema":
            return P.ResponseFormat("json_schema", P.JsonSchemaFormat(fmt.get("name"), fmt.get("description"),
                                                                      fmt.get("schema"), fmt.get("strict")))
        raise BadRequest(f"text.format.type {fmt.get('type')!r} is not one of text, json_object, json_schema", "text")

    def _template_kwargs(self, req: ResponsesRequest) -> dict | None:
        r = req.reasoning or {}
        unknown = set(r) - {"effort", "summary", "generate_summary"}
        if unknown:
            raise BadRequest(f"reasoning.{sorted(unknown)[0]} is not supported", "reasoning")
        if r.get("summary") or r.get("generate_summary"):
            raise BadRequest("reasoning summaries are not produced (the reasoning parser returns the reasoning "
                             "itself as reasoning items)", "reasoning")
        if r.get("effort") is None:
            return None
        if "reasoning_effort" not in (self.chat.tok.chat_template or ""):
            raise BadRequest(f"reasoning.effort={r['effort']!r}: this model's chat template has no reasoning_effort "
                             "to set", "reasoning")
        return {"reasoning_effort": r["effort"]}

    def chat_request(self, req: ResponsesRequest, history: list) -> P.ChatCompletionRequest:
        return P.ChatCompletionRequest(
            model=req.model, messages=self._messages(req, history), max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature, top_p=req.top_p, stream=req.stream,
            stream_options=P.StreamOptions(include_usage=True) if req.stream else None,
            tools=self._tools(req), tool_choice=self._tool_choice(req.tool_choice),
            parallel_tool_calls=req.parallel_tool_calls, response_format=self._response_format(req.text),
            chat_template_kwargs=self._template_kwargs(req), kv_transfer_params=req.kv_transfer_params)

    # --- the endpoint -------------------------------------------------------------------------------
    async def create(self, req: ResponsesRequest, rid: str, deadline: float | None = None):
        self._check(req)
        history = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise not_found(req.previous_response_id)
            history = list(prev[0])
        creq = self.chat_request(req, history)
        resp_id = _new_id("resp")
        try:
            result = await self.chat.chat(creq, rid, deadline, items=True)
        except BadRequest as e:
            raise BadRequest(str(e), _PARAMS.get(e.param, e.param), e.status, e.code, e.type) from None
        if req.stream:
            return self._events(req, resp_id, creq.messages, result)
        choice = result.choices[0]
        output = _output_items(choice.message)
        response = self._response(req, resp_id, output, choice.finish_reason, _usage(result.usage))
        self._keep(req, resp_id, creq.messages, choice.message, response)
        return response

    def get(self, response_id: str) -> dict:
        item = self.store.get(response_id)
        if item is None:
            raise not_found(response_id, "response_id")
        return item[1]

    def _keep(self, req, resp_id: str, messages: list, message: P.ChatMessageOut, response: dict) -> None:
        if not req.store:
            return
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in message.tool_calls]
        said = P.ChatMessage("assistant", message.content, tool_calls=calls or None,
                             reasoning_content=message.reasoning_content)
        # The instructions are this request's own: a continuation does not carry them over.
        kept = messages[1:] if req.instructions else messages
        self.store.put(resp_id, [*kept, said], response)

    def _response(self, req: ResponsesRequest, resp_id: str, output: list, finish: str | None,
                  usage: dict | None, status: str | None = None) -> dict:
        incomplete = finish == "length"
        return {
            "id": resp_id, "object": "response", "created_at": int(time.time()),
            "status": status or ("incomplete" if incomplete else "completed"), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.chat.model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    async def _events(self, req, resp_id: str, messages: list, items) -> AsyncIterator[bytes]:
        seq = [0]

        def event(kind: str, **data) -> bytes:
            data = {"type": kind, "sequence_number": seq[0], **data}
            seq[0] += 1
            return f"event: {kind}\n".encode() + b"data: " + sse_json(data) + b"\n\n"

        def opening() -> list[bytes]:
            start = self._response(req, resp_id, [], None, None, "in_progress")
            return [event("response.created", response=start), event("response.in_progress", response=start)]

        # The stream's first bytes go out with the first chat item, which comes with the first token:
        # response.created and in_progress are written together with the first output's events (one
        # write per chat item), so a client timing the first event times a computed token.
        out = _StreamedOutput(event)
        finish, usage, started = None, None, False
        async for item in items:
            evs = [] if started else opening()
            started = True
            if isinstance(item, StreamFailure):
                failed = self._response(req, resp_id, out.items, None, usage, "failed")
                failed["error"] = {"code": str(item.code or item.type), "message": item.message}
                yield b"".join([*evs, *out.close(), event("response.failed", response=failed)])
                return
            if item.usage is not None and not item.choices:
                usage = _usage(item.usage)
            for c in item.choices:
                evs += out.feed(c.delta)
                finish = c.finish_reason or finish
            if evs:
                yield b"".join(evs)
        evs = ([] if started else opening()) + out.close()
        response = self._response(req, resp_id, out.items, finish, usage)
        self._keep(req, resp_id, messages, out.message(), response)
        evs.append(event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
                         response=response))
        yield b"".join(evs)


class _StreamedOutput:
    """Output items built from chat deltas, with the events that open, grow and close them."""

    def __init__(self, event):
        self.event, self.items = event, []
        self.open = None  # ("reasoning" | "message", item) or ("calls", {chat index: item})
        self.reasoning, self.text, self.calls = "", "", []

    def _open(self, kind: str, item: dict, part: dict | None) -> list[bytes]:
        self.items.append(item)
        evs = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]
        if part is not None:
            evs.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0, part=part))
        return evs

    def feed(self, delta: P.Delta) -> list[bytes]:
        evs = []
        if delta.reasoning_content:
            if self.open is None or self.open[0] != "reasoning":
                evs += self.close()
                item = {"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": [],
                        "status": "in_progress"}
                evs += self._open("reasoning", item, {"type": "reasoning_text", "text": ""})
                self.open = ("reasoning", item)
            item = self.open[1]
            item.setdefault("_text", [])
            item["_text"].append(delta.reasoning_content)
            self.reasoning += delta.reasoning_content
            evs.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=len(self.items) - 1, content_index=0, delta=delta.reasoning_content))
        if delta.content:
            if self.open is None or self.open[0] != "message":
                evs += self.close()
                item = {"type": "message", "id": _new_id("msg"), "status": "in_progress", "role": "assistant",
                        "content": []}
                evs += self._open("message", item, {"type": "output_text", "text": "", "annotations": []})
                self.open = ("message", item)
            item = self.open[1]
            item.setdefault("_text", [])
            item["_text"].append(delta.content)
            self.text += delta.content
            evs.append(self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, delta=delta.content, logprobs=[]))
        for tc in delta.tool_calls or []:
            if self.open is None or self.open[0] != "calls":
                evs += self.close()
                self.open = ("calls", {})
            calls = self.open[1]
            if tc.index not in calls:
                item = {"type": "function_call", "id": _new_id("fc"), "call_id": tc.id or _new_id("call"),
                        "name": (tc.function.name if tc.function else None) or "", "arguments": "",
                        "status": "in_progress"}
                calls[tc.index] = item
                self.calls.append(item)
                evs += self._open("calls", item, None)
            item = calls[tc.index]
            frag = tc.function.arguments if tc.function else None
            if frag:
                item["arguments"] += frag
                evs.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=frag))
        return evs

    def close(self) -> list[bytes]:
        """Close the open item(s): their done events, their final form in `items`."""
        if self.open is None:
            return []
        kind, item = self.open
        self.open = None
        if kind == "calls":
            evs = []
            for call in item.values():
                idx = self.items.index(call)
                call["status"] = "completed"
                evs.append(self.event("response.function_call_arguments.done", item_id=call["id"],
                                      output_index=idx, arguments=call["arguments"]))
                evs.append(self.event("response.output_item.done", output_index=idx, item=call))
            return evs
        idx = self.items.index(item)
        text = "".join(item.pop("_text", []))
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            evs = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                              text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            evs = [self.event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                              text=text, logprobs=[])]
        item["content"] = [part]
        item["status"] = "completed"
        evs.append(self.event("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                              part=part))
        evs.append(self.event("response.output_item.done", output_index=idx, item=item))
        return evs

    def message(self) -> P.ChatMessageOut:
        """The streamed output as the chat message it was (for the store)."""
        calls = [P.ToolCall(c["call_id"], P.FunctionCall(c["name"], c["arguments"])) for c in self.calls]
        return P.ChatMessageOut("assistant", self.text or None, self.reasoning or None, calls)


def _output_items(message: P.ChatMessageOut) -> list[dict]:
    items = []
    if message.reasoning_content:
        items.append({"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": message.reasoning_content}]})
    if message.content:
        items.append({"type": "message", "id": _new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.content, "annotations": []}]})
    for c in message.tool_calls:
        items.append({"type": "function_call", "id": _new_id("fc"), "call_id": c.id, "name": c.function.name,
                      "arguments": c.function.arguments, "status": "completed"})
    return items


def _usage(u: P.UsageInfo) -> dict:
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details is not None else 0
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def _str(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise BadRequest(f"{where}.{key} must be a string", "input")
    return v


def _text_of(content, where: str) -> str:
    """A message's content: a string, or its text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{j}]: only text content parts are supported, not type {kind!r} (image and "
                             "file inputs are not served)", "input")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins a message's text parts

