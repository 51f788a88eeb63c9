"""vLLM's tokenizer endpoints, POST /tokenize and /detokenize (outside /v1, as in vLLM): a prompt or
a chat conversation to token ids through the same template as chat completions, and back."""
from __future__ import annotations

from moe_serve.entrypoints.openai import protocol as P
from moe_serve.entrypoints.openai import request_limits as L
from moe_serve.entrypoints.openai.chat_template import ChatTemplate
from moe_serve.entrypoints.openai.request_limits import BadRequest
from moe_serve.entrypoints.openai.runner import RequestRunner


class TokenizeServing:
    def __init__(self, runner: RequestRunner, template: ChatTemplate):
        self.runner, self.template, self.tok = runner, template, runner.tok

    async def tokenize(self, req: P.TokenizeRequest, rid: str, deadline: float | None = None) -> P.TokenizeResponse:
        self.runner.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give either prompt (a string) or messages", "prompt" if req.messages is None
                             else "messages")
        if req.messages is not None:
            if not req.messages:
                raise BadRequest("messages must be a non-empty list", "messages")
            L.check_count("messages", len(req.messages), L.MAX_MESSAGES, "messages")
            L.check_count("tools", len(req.tools or ()), L.MAX_TOOLS, "tools")
        ids, strs = await self.runner._until(deadline, self.runner.off_loop(self._tokenize, req))
        return P.TokenizeResponse(len(ids), self.runner.max_model_len, ids, strs)

    def _tokenize(self, req: P.TokenizeRequest) -> tuple[list[int], list[str] | None]:
        if req.prompt is not None:
            ids = self.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        else:
            t = self.template
            text = t.render_chat(t.chat_messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs,
                                 req.tools)
            ids = self.tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        return ids, [self.tok.id_to_token(i) or "" for i in ids] if req.return_token_strs else None

    async def detokenize(self, req: P.DetokenizeRequest, rid: str,
                         deadline: float | None = None) -> P.DetokenizeResponse:
        self.runner.check_model(req.model)
        vocab = self.tok.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"tokens {bad[:8]}{' ...' if len(bad) > 8 else ''} are outside the vocabulary "
                             f"[0, {vocab})", "tokens")
        text = await self.runner._until(deadline, self.runner.off_loop(self.tok.decode, req.tokens, False))
        return P.DetokenizeResponse(text)
