"""The structured-output spec of a request (vLLM's `StructuredOutputsParams` fields). Exactly one
of json / regex / choice / grammar / json_object is set. Importing this module imports neither
torch nor xgrammar."""
from __future__ import annotations

import json as _json

import msgspec

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    json: str | dict | None = None  # a JSON schema (as a dict or as JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's / GBNF dialect)
    json_object: bool | None = None  # any JSON object

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # As JSON text (key order kept: properties are generated in the schema's order).
            self.json = _json.dumps(self.json, ensure_ascii=False, separators=(",", ":"))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_) if set_ else 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        for name in ("regex", "grammar", "json"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what the compiled grammar depends on, the cache key."""
        k = self.kind
        if k == "choice":
            return k, _json.dumps(self.choice, ensure_ascii=False)
        if k == "json_object":
            return k, ""
        return k, getattr(self, k)
