"""POST /v1/chat/completions: messages and tools checked, rendered through the chat template and
run; the output split into reasoning, content and tool calls (whole, or streamed as chunks). The
Responses and Messages endpoints translate onto this one (`create(..., items=True)`)."""
from __future__ import annotations

import time
from typing import AsyncIterator

import msgspec

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai import request_limits as L
from moe_serve.entrypoints.openai.chat_template import ChatTemplate
from moe_serve.entrypoints.openai.outputs import (StreamFailure, _continuous, _error_of, _sse, _sse_error, _usage,
                                                  prompt_logprobs_field, routed_experts_field)
from moe_serve.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningParser
from moe_serve.entrypoints.openai.request_limits import BadRequest, sampling_params
from moe_serve.entrypoints.openai.runner import RequestRunner
from moe_serve.entrypoints.openai.structured import check_tool_choice, constrains_output, with_structured_outputs
from moe_serve.entrypoints.openai.tool_parsers import PARSERS, ParsedOutput, StreamDelta, ToolParser
from moe_serve.entrypoints.openai.tool_parsers.constrained import ConstrainedToolParser


class ChatServing:
    def __init__(self, runner: RequestRunner, template: ChatTemplate, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None):
        self.runner, self.template, self.tok = runner, template, runner.tok
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser

    def check_chat(self, req: P.ChatCompletionRequest, max_tokens: int | None) -> None:
        """Cheap checks of the messages and tools, before any template is rendered."""
        if not req.messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        L.check_count("messages", len(req.messages), L.MAX_MESSAGES, "messages")
        chars = 0
        for m in req.messages:
            if isinstance(m.content, str):
                chars += len(m.content)
            elif isinstance(m.content, list):
                chars += sum(len(p["text"]) for p in m.content if isinstance(p, dict) and isinstance(p.get("text"), str))
        self.runner.limits.check_chars(chars, max_tokens, "messages", L.CHAT_CHARS_SLACK)
        if req.tools is not None:
            L.check_count("tools", len(req.tools), L.MAX_TOOLS, "tools")
            for i, tool in enumerate(req.tools):
                size = len(msgspec.json.encode(tool))
                if size > L.MAX_TOOL_SCHEMA_BYTES:
                    raise BadRequest(f"tools[{i}] is {size} bytes as JSON; at most {L.MAX_TOOL_SCHEMA_BYTES} are "
                                     "allowed per tool", "tools", code="tool_too_large")
        check_tool_choice(req)  # "required" and named functions are enforced by structured outputs
        if req.tools and req.tool_choice in (None, "auto") and not self.enable_auto_tool_choice:
            # Without a parser a call the model writes would come back as plain text (vLLM refuses too).
            raise BadRequest("tool_choice='auto' (the default when tools are given) needs the server started with "
                             "--enable-auto-tool-choice --tool-call-parser NAME; send tool_choice='none' to show "
                             "the tools to the model and get a text answer", "tool_choice")

    def tool_parser_for(self, req: P.ChatCompletionRequest) -> ToolParser | None:
        """The parser that turns this request's output into tool calls, or None (plain text)."""
        if not req.tools or req.tool_choice == "none":
            return None
        if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
            return ConstrainedToolParser(self.tok, req.tools, req.tool_choice)
        if req.tool_choice in (None, "auto") and self.enable_auto_tool_choice:
            return PARSERS[self.tool_call_parser](self.tok, req.tools)
        return None

    def reasoning_parser_for(self, req: P.ChatCompletionRequest) -> ReasoningParser | None:
        if self.reasoning_parser is None:
            return None
        if constrains_output(req):  # the grammar holds from the first token: the output has no reasoning
            return None
        return REASONING_PARSERS[self.reasoning_parser](self.tok, req.chat_template_kwargs)

    def chat_prompt(self, req: P.ChatCompletionRequest, max_tokens: int | None) -> list[int]:
        t = self.template
        text = t.render_chat(t.chat_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs,
                             req.tools)
        self.runner.limits.check_chars(len(text), max_tokens, "messages")  # the rendered prompt, exactly bounded
        return self.tok.encode(text, add_special_tokens=False)

    def chat_params(self, req: P.ChatCompletionRequest):
        """The request's sampling parameters (checked) and its max_tokens (None: up to max_model_len)."""
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequest("top_logprobs requires logprobs=true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise BadRequest(f"top_logprobs must be in [0, 20], got {req.top_logprobs}", "top_logprobs")
        if req.echo:
            raise BadRequest("echo is not supported on chat completions", "echo")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                 "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        return params, max_tokens

    async def create(self, req: P.ChatCompletionRequest, rid: str, deadline: float | None = None,
                     items: bool = False):
        """A ChatCompletionResponse, or when streaming the SSE lines (with items: the chunk objects
        of `chat_items`, for the endpoints that translate them)."""
        run = self.runner
        run.check_model(req.model)
        params, max_tokens = self.chat_params(req)
        self.check_chat(req, max_tokens)
        params = await with_structured_outputs(run, req, params, deadline)
        ids = await run._until(deadline, run.off_loop(self.chat_prompt, req, max_tokens))
        if getattr(self.tool_parser_for(req), "needs_special_tokens", False):
            params = params.replace(skip_special_tokens=False)  # the call markers are special tokens
        stream = run.submit(rid, [ids], params, req.kv_transfer_params)
        if req.stream:
            if items:
                return self.chat_items(req, rid, params, stream, deadline)
            return self._stream_chat(req, rid, params, stream, deadline)
        n = params.n
        texts, lps, fins = await run._collect(stream, n, deadline)
        run._check_ended(fins)
        tools, reasoner = self.tool_parser_for(req), self.reasoning_parser_for(req)
        choices = []
        for i in range(n):
            message, finish = chat_message(texts[i], fins[i][0], tools, reasoner, req.parallel_tool_calls)
            choices.append(P.ChatChoice(i, message, self._chat_logprobs(lps[i]) if req.logprobs else None, finish,
                                        fins[i][1], routed_experts_field(req, stream, i)))
        return P.ChatCompletionResponse(rid, int(time.time()), run.model_name, choices, _usage(stream),
                                        prompt_logprobs=prompt_logprobs_field(self.tok, ids, stream.prompt_logprobs[0],
                                                                              params.prompt_logprobs),
                                        weight_version=stream.weight_version)

    async def count_chat_tokens(self, req: P.ChatCompletionRequest, deadline: float | None = None) -> int:
        """The prompt tokens the chat request's conversation (and tools) render to."""
        self.runner.check_model(req.model)
        self.check_chat(req, None)
        ids = await self.runner._until(deadline, self.runner.off_loop(self.chat_prompt, req, None))
        return len(ids)

    def _chat_logprobs(self, lps) -> P.ChatLogprobs:
        def entry(tid: int, v: float) -> P.TopLogprob:
            t = self.tok.decode([tid], False)
            return P.TopLogprob(t, v, list(t.encode("utf-8")))

        content = []
        for lp in lps:
            e = entry(lp.token_id, lp.logprob)
            content.append(P.ChatTokenLogprob(e.token, e.logprob, e.bytes, [entry(i, v) for i, v in lp.top]))
        return P.ChatLogprobs(content)

    async def _stream_chat(self, req, rid, params, stream, deadline) -> AsyncIterator[bytes]:
        async for item in self.chat_items(req, rid, params, stream, deadline):
            yield _sse(item) if isinstance(item, P.ChatCompletionChunk) else _sse_error(*item)
        yield b"data: [DONE]\n\n"

    async def chat_items(self, req, rid, params, stream, deadline) -> AsyncIterator:
        """A streamed chat's chunks (P.ChatCompletionChunk), ending, for a stream cut short, with a
        StreamFailure: what the chat stream sends, before it is written as SSE (the Responses and
        Messages endpoints translate the same items into their own events)."""
        run, created, ended = self.runner, int(time.time()), None
        tools, reasoner = self.tool_parser_for(req), self.reasoning_parser_for(req)
        # One parser state per choice: text that may start a call marker or `</think>` waits in it.
        tool_streams = [tools.stream() if tools is not None else None for _ in range(params.n)]
        think_streams = [reasoner.stream() if reasoner is not None else None for _ in range(params.n)]
        called = [False] * params.n
        # A choice's role goes out with its first output, never before: clients (benchmarks
        # included) time the first chunk as the first token, so it must carry one (as vLLM's).
        # When the parsers hold that token's text back, the chunk has the role and empty content.
        greeted = [False] * params.n
        try:
            async for i, out in run._timed(stream, deadline):
                ended = ended or _error_of(out)
                first = not greeted[i]
                greeted[i] = True
                if not (first or out.new_text or out.finished or out.logprobs):
                    continue
                delta = _stream_delta(out.new_text, out.finished, think_streams[i], tool_streams[i])
                if delta.tool_calls and req.parallel_tool_calls is False:
                    delta.tool_calls = [c for c in delta.tool_calls if c.index == 0] or None
                called[i] = called[i] or bool(delta.tool_calls)
                if first:
                    delta.role = "assistant"
                    if delta.content is None and not delta.tool_calls:
                        delta.content = ""
                elif not (delta.content or delta.reasoning_content or delta.tool_calls or out.finished
                          or out.logprobs):
                    continue
                lp = self._chat_logprobs(out.logprobs or []) if req.logprobs else None
                finish = _calls_finish(tools, out.finish_reason) if out.finished and called[i] else out.finish_reason
                routed = routed_experts_field(req, stream, i) if out.finished else msgspec.UNSET
                yield P.ChatCompletionChunk(rid, created, run.model_name, [P.ChatStreamChoice(
                    i, delta, lp, finish, out.stop_reason if out.finished else None, routed)],
                    _usage(stream) if _continuous(req) else None, weight_version=stream.weight_version)
            if run.engine.dead or ended:
                yield run._ended_failure(ended)
            elif req.stream_options and req.stream_options.include_usage:
                yield P.ChatCompletionChunk(rid, created, run.model_name, [], _usage(stream),
                                            weight_version=stream.weight_version)
        except BadRequest as e:  # the request timed out
            yield StreamFailure(str(e), e.status, e.type, e.code)
        finally:
            await stream.aclose()


def chat_message(text: str, finish: str | None, tools: ToolParser | None, reasoner: ReasoningParser | None,
                 parallel: bool | None = None) -> tuple[P.ChatMessageOut, str | None]:
    """The assistant message of one whole output: reasoning split off first, then tool calls
    parsed from the rest; finish_reason becomes "tool_calls" when there are any."""
    reasoning = None
    if reasoner is not None:
        reasoning, text = reasoner.split(text)
    parsed = tools.parse(text) if tools is not None else ParsedOutput(text if text or not reasoning else None)
    if parallel is False:
        parsed.tool_calls = parsed.tool_calls[:1]
    if parsed.tool_calls:
        finish = _calls_finish(tools, finish)
    return P.ChatMessageOut("assistant", parsed.content, reasoning or None, parsed.tool_calls), finish


def _calls_finish(tools: ToolParser, finish: str | None) -> str | None:
    """finish_reason of an output with tool calls: "tool_calls"; a constrained tool_choice decides
    its own (vLLM's: "stop" for a named function; an output cut short stays "length")."""
    if isinstance(tools, ConstrainedToolParser):
        return tools.calls_finish_reason(finish)
    return "tool_calls"


def _stream_delta(text: str, final: bool, think, tools) -> P.Delta:
    """One engine output of a streamed choice as a chat delta: reasoning split off first, then
    tool calls parsed out of the content."""
    reasoning = ""
    if think is not None:
        reasoning, text = think.feed(text, final)
    if tools is None:
        return P.Delta(content=text or None, reasoning_content=reasoning or None)
    d: StreamDelta = tools.feed(text, final)
    return P.Delta(content=d.content or None, reasoning_content=reasoning or None, tool_calls=d.tool_calls or None)
