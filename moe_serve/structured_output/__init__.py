"""Structured outputs: generation constrained by a JSON schema, a regex, a list of choices or an
EBNF grammar, with xgrammar.

- `params.py`   `StructuredOutputsParams`, the spec that travels inside `SamplingParams` (msgspec;
                no torch, no xgrammar).
- `grammar.py`  spec -> xgrammar Grammar (shared by the front end's check and the core's compile),
                the front end's cached check, and the core's `GrammarManager`: TokenizerInfo for the
                logits' width, a background thread that compiles, a cache per (kind, spec).
- `bitmask.py`  per step: fill the constrained rows' token bitmasks on the host, apply them to
                those rows of the logits on the device (-inf where the grammar forbids).

Life of a constrained request in the core: `EngineCore.add_request` asks the manager for the
compiled grammar (a future) and holds the request back from the scheduler until it is ready; then
it gets a matcher (`GrammarState`) and is queued. Every sampled token advances the matcher
(`Scheduler.update`); a matcher that terminates ends the request ("stop"). Preemption recomputes
the same tokens, so the matcher needs no rollback; each of n samples is its own request with its
own matcher.
"""
from .params import StructuredOutputsParams  # noqa: F401
