"""`moe-serve router`: one OpenAI-compatible entry point in front of several moe-serve instances.

Each request (completions, chat completions, Responses, Anthropic Messages) goes whole to one
worker instance, chosen by `--policy`:

- `cache_aware` (default): the worker that already served the longest prefix of this request, so a
  conversation's turns land where its KV blocks are cached, when that prefix is at least
  `--cache-threshold` of the request and the worker has at most `--load-margin` requests in flight
  beyond the least busy one; otherwise the least busy (among equals, the one sent the least). The
  router sees JSON, not tokens: a request's key is its
  prompt-shaping fields (tools, system, then each message) serialized one after another, hashed
  in chained chunks of `CHUNK` characters as the engine hashes token blocks; each worker keeps the
  hashes of what it was sent, least recently used dropped beyond `--cache-entries` (the workers'
  own eviction is not visible here, so this is SGLang's approximate-tree idea, not an exact view);
- `least_load`: the worker with the fewest requests in flight;
- `round_robin`: each worker in turn.

Disaggregated (`--prefill URL... --decode URL...`): the decode instances are the workers above
(a request goes whole to one of them, chosen by the policy: its prefix cache saves KV moves); each
request also gets a prefill instance, chosen by the same policy among the prefill instances, named
in the body as `kv_transfer_params.prefill_url`. The decode instance reserves the prompt's blocks,
has that prefill instance compute the prompt and write its KV there (moe_serve/disagg), computes
the last prompt token itself and streams the output back through here. With no prefill instance
up, the decode instance computes the prompt itself.

Workers are health-checked every `--health-check-interval` seconds and skipped while down; a
request whose worker refuses the connection is sent to another, and the client only sees an error
(503, naming the workers tried) when none takes it. A worker that fails mid-stream ends the
client's stream with an error event naming it. A client that goes away closes the upstream
connection, and the worker aborts the request and frees its blocks. The server's hardening applies
here too: `--api-key`, body size and time limits, the header deadline and the connection cap.

In three parts: `policy.py` (which instance: the workers' state and the policies), `proxy.py`
(forwarding, streaming, the prefill/decode handoff) and `app.py` (the routes, and the command).
"""
from moe_serve.entrypoints.router.app import ROUTES, add_router_parser, build_router_app, run_router
from moe_serve.entrypoints.router.policy import CHUNK, POLICIES, Worker, WorkerPool, chunk_hashes, request_key

__all__ = ["CHUNK", "POLICIES", "ROUTES", "Worker", "WorkerPool", "add_router_parser", "build_router_app",
           "chunk_hashes", "request_key", "run_router"]
