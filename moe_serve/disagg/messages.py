"""The HTTP bodies between a decode instance's front end and a prefill instance's (`POST
/v1/disagg/prefill`): the prompt's tokens (the decode side tokenized it: both sides compute the same
ids) and the blocks to fill. The bulk KV goes through the transfer engine, not through these."""
from __future__ import annotations

import msgspec

from moe_serve.protocol import KVTarget


class PrefillRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]  # the whole prompt (the decode side computes its last token again)
    target: KVTarget
    timeout_s: float = 30.0  # the prefill side gives up (and writes nothing) after this


class PrefillResponse(msgspec.Struct):
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # of them, found in the prefill instance's own prefix cache
    transferred_tokens: int
