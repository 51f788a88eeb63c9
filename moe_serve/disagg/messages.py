"""The HTTP bodies between a decode instance's front end and a prefill instance's (`POST
/v1/disagg/prefill`): the prompt's tokens (the decode side tokenized it: both sides compute the same
ids) and the blocks to fill. The bulk KV goes through the transfer engine, not through these.

Router replay (`return_routed_experts`) rides on these bodies: the decode side asks for the prompt's
routing with the KV, and the answer carries the rows of positions 0 .. target.end - 1 (the ones the
decode side does not compute) as a `RoutedExpertRows`, whose int16 bytes msgspec's JSON writes as
base64 (the compact form clients get). They go in the answer rather than through the transfer
engine because the answer is already the one message that says "written"; a few KB per prompt
(positions x MoE layers x k x 2 bytes) are nothing next to its KV."""
from __future__ import annotations

import msgspec

from moe_serve.protocol import KVTarget, RoutedExpertRows


class PrefillRequest(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]  # the whole prompt (the decode side computes its last token again)
    target: KVTarget
    timeout_s: float = 30.0  # the prefill side gives up (and writes nothing) after this
    return_routed_experts: bool = False  # answer with the routing of positions 0 .. target.end - 1


class PrefillResponse(msgspec.Struct):
    request_id: str
    prompt_tokens: int
    cached_tokens: int  # of them, found in the prefill instance's own prefix cache
    transferred_tokens: int
    # With PrefillRequest.return_routed_experts: positions 0 .. target.end - 1, start 0 (JSON:
    # [start, num_layers, top_k, base64 of the little-endian int16 rows]).
    routed_experts: RoutedExpertRows | None = None
