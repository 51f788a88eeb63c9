"""Structured outputs on the OpenAI endpoints: a request's `response_format`, vLLM's
`structured_outputs` extra field, or a chat's tool_choice "required" / a named function, turned
into the engine's `StructuredOutputsParams`, checked with xgrammar before the request is accepted.

- response_format {"type": "text"}: unconstrained; {"type": "json_object"}: any JSON object;
  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}: that schema (xgrammar's
  strict mode always: the output conforms to the schema whatever `strict` says).
- structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object"}: exactly one.
- tool_choice {"type": "function", "function": {"name": N}}: the output is N's arguments, a JSON
  value of its `parameters` schema. tool_choice "required": a JSON array of one or more
  {"name": <a tool's name>, "parameters": <that tool's arguments>} (anyOf over the tools; one item
  at most with parallel_tool_calls=false). `tool_parsers/constrained.py` reads them back.

A reasoning parser is not applied to a constrained output: the grammar holds from its first token,
so it has no reasoning section (vLLM instead starts the grammar after the reasoning ends).

The check builds the grammar (`structured_output.grammar.check_spec`, remembered per spec) in the
tokenization pool, never on the event loop; a spec xgrammar refuses is a 400 naming the field it
came from. The core compiles the same spec against the tokenizer.
"""
from __future__ import annotations

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai.request_limits import BadRequest
from moe_serve.sampling_params import SamplingParams
from moe_serve.structured_output.params import KINDS, StructuredOutputsParams


def _tool_function(tool, i: int) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise BadRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                         "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return fn


def _parameters_schema(fn: dict) -> dict:
    # No parameters: the function takes none, so its arguments are the empty object.
    return fn.get("parameters") or {"type": "object", "properties": {}}


def named_tool(req: P.ChatCompletionRequest) -> str | None:
    """The function tool_choice names, or None for a string tool_choice."""
    tc = req.tool_choice
    if not isinstance(tc, dict):
        return None
    fn = tc.get("function")
    if tc.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}', "tool_choice")
    return fn["name"]


def check_tool_choice(req: P.ChatCompletionRequest) -> None:
    """tool_choice "required" / a named function: tools must be given and hold the named one."""
    tc = req.tool_choice
    if tc in (None, "none", "auto"):
        return
    if isinstance(tc, str) and tc != "required":
        raise BadRequest(f'tool_choice must be "none", "auto", "required" or a named function, got {tc!r}',
                         "tool_choice")
    name = named_tool(req)
    if not req.tools:
        raise BadRequest(f"tool_choice={'required' if name is None else 'a named function'} needs tools",
                         "tool_choice")
    names = [_tool_function(t, i)["name"] for i, t in enumerate(req.tools)]
    if name is not None and name not in names:
        raise BadRequest(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"({', '.join(names)})", "tool_choice")


def tool_choice_schema(req: P.ChatCompletionRequest) -> dict | None:
    """The JSON schema tool_choice forces on the output, or None (tool_choice none/auto)."""
    if req.tool_choice in (None, "none", "auto"):
        return None
    fns = [_tool_function(t, i) for i, t in enumerate(req.tools or [])]
    name = named_tool(req)
    if name is not None:
        return _parameters_schema(next(f for f in fns if f["name"] == name))
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]}, "parameters": _parameters_schema(f)},
              "required": ["name", "parameters"], "additionalProperties": False} for f in fns]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _response_format_spec(rf: P.ResponseFormat) -> StructuredOutputsParams | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise BadRequest('response_format of type "json_schema" needs json_schema.schema', "response_format")
        return StructuredOutputsParams(json=js.schema_)
    raise BadRequest(f'response_format.type must be "text", "json_object" or "json_schema", got {rf.type!r}',
                     "response_format")


def _extra_spec(so: P.StructuredOutputsRequest) -> StructuredOutputsParams:
    given = {k: getattr(so, k) for k in KINDS if getattr(so, k) not in (None, False)}
    if len(given) != 1:
        raise BadRequest(f"structured_outputs must set exactly one of {', '.join(KINDS)}; got "
                         f"{', '.join(given) if given else 'none'}", "structured_outputs")
    try:
        return StructuredOutputsParams(**given)
    except ValueError as e:
        raise BadRequest(str(e), "structured_outputs") from None


def structured_spec(req: P._Common) -> tuple[StructuredOutputsParams | None, str | None]:
    """(spec, the request field it came from) or (None, None) when the output is unconstrained."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if isinstance(req, P.ChatCompletionRequest):
        schema = tool_choice_schema(req)
        if schema is not None:
            found.append((StructuredOutputsParams(json=schema), "tools"))
    if req.response_format is not None:
        spec = _response_format_spec(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.structured_outputs is not None:
        found.append((_extra_spec(req.structured_outputs), "structured_outputs"))
    if len(found) > 1:
        names = ["tool_choice" if f == "tools" else f for _, f in found]
        raise BadRequest(f"only one of {' / '.join(names)} may constrain the output", names[-1])
    return found[0] if found else (None, None)


def constrains_output(req: P._Common) -> bool:
    """Whether the request's output is grammar-constrained (cheap; the spec is checked later)."""
    rf = req.response_format
    forced_tools = isinstance(req, P.ChatCompletionRequest) and (req.tool_choice == "required"
                                                                 or isinstance(req.tool_choice, dict))
    return (rf is not None and rf.type != "text") or req.structured_outputs is not None or forced_tools


def _check(spec: StructuredOutputsParams, field: str) -> None:
    from moe_serve.structured_output.grammar import check_spec

    try:
        check_spec(spec)
    except ValueError as e:
        what = {"tools": "a tool's parameters schema", "response_format": "response_format's schema",
                "structured_outputs": f"structured_outputs.{spec.kind}"}[field]
        raise BadRequest(f"{what} cannot be compiled: {e}", field) from None


async def with_structured_outputs(serving, req: P._Common, params: SamplingParams,
                                  deadline: float | None) -> SamplingParams:
    """params constrained as the request asks (checked off the event loop), or params as they are."""
    spec, field = structured_spec(req)
    if spec is None:
        return params
    await serving._until(deadline, serving.off_loop(_check, spec, field))
    try:
        return params.replace(structured_outputs=spec)
    except ValueError as e:
        msg = str(e)
        raise BadRequest(msg, "min_tokens" if "min_tokens" in msg else field) from None
