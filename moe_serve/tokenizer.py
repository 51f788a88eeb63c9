"""Tokenizer (the checkpoint's tokenizer.json via `tokenizers`), chat template, and incremental
detokenization that never emits half of a multi-byte character."""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime

_REPLACEMENT = "\ufffd"


class Tokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        from moe_serve.quantization import gguf_file

        tj = os.path.join(path, "tokenizer.json")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        self.config: dict = {}
        if (gguf := gguf_file.gguf_path(path)) is not None:  # the tokenizer from a GGUF file's metadata
            self._tok, self.config = gguf_file.tokenizer_parts(gguf)
        elif not os.path.isfile(tj):
            raise ValueError(f"model={path!r}: no tokenizer.json (a fast tokenizer file is required)")
        else:
            self._tok = HFTokenizer.from_file(tj)
        if gguf is None and os.path.isfile(cfg_path):
            with open(cfg_path) as f:
                self.config = json.load(f)
        self.chat_template: str | None = self.config.get("chat_template")
        tmpl_file = os.path.join(path, "chat_template.jinja")
        if self.chat_template is None and os.path.isfile(tmpl_file):
            with open(tmpl_file) as f:
                self.chat_template = f.read()
        if isinstance(self.chat_template, list):  # named templates: take "default"
            self.chat_template = next((t["template"] for t in self.chat_template if t.get("name") == "default"),
                                      self.chat_template[0]["template"])
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token = self._token_str(self.config.get("bos_token"))
        self.eos_token = self._token_str(self.config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._compiled = None

    @functools.cached_property
    def token_extent(self) -> tuple[int, int]:
        """(characters, UTF-8 bytes): the most that any one token stands for, over the whole
        vocabulary, decoded alone or in its raw vocabulary form (measured once, ~0.1 s per 100k ids)."""
        n = self.vocab_size
        texts = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        raw = [self._tok.id_to_token(i) or "" for i in range(n)]
        chars = max(max(map(len, texts), default=1), max(map(len, raw), default=1), 1)
        nbytes = max(max((len(t.encode("utf-8", "replace")) for t in texts), default=1),
                     max((len(t.encode("utf-8", "replace")) for t in raw), default=1), 1)
        return chars, nbytes

    @functools.cached_property
    def chars_per_token(self) -> float | None:
        """No token covers more characters of an input text than this, or None where the
        tokenizer does not guarantee a bound.

        The bound holds when every character of the (normalized) text ends up in some token: a BPE
        or Unigram model over bytes (a byte-level pre-tokenizer or byte fallback, so nothing becomes
        one fused unknown token), pre-tokenizers that keep every character, and normalizers that
        shrink a text by at most a known factor (NFC/NFKC compose a few code points into one).
        """
        cfg = json.loads(self._tok.to_str())
        model = cfg.get("model") or {}
        pre = _flatten(cfg.get("pre_tokenizer"), "pretokenizers")
        if model.get("type") not in ("BPE", "Unigram"):
            return None
        # Every byte must have a token of its own, or a character nothing covers could vanish.
        if any(p.get("type") == "ByteLevel" for p in pre):
            from tokenizers.pre_tokenizers import ByteLevel

            covered = all(self._tok.token_to_id(c) is not None for c in ByteLevel.alphabet())
        else:
            covered = bool(model.get("byte_fallback")) and all(
                self._tok.token_to_id(f"<0x{b:02X}>") is not None for b in range(256))
        if not covered:
            return None
        keeps = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}
        if any(p.get("type") not in keeps or p.get("behavior") == "Removed" for p in pre):
            return None
        shrink = 1.0
        for norm in _flatten(cfg.get("normalizer"), "normalizers"):
            t = norm.get("type")
            if t in ("NFC", "NFKC"):
                shrink *= 4.0
            elif t in ("NFD", "NFKD", "Lowercase", "Prepend"):
                pass
            elif t == "Replace" and "String" in (norm.get("pattern") or {}) and norm.get("content"):
                # (a Replace by "" deletes: a text of only the pattern would become nothing)
                shrink *= max(1.0, len(norm["pattern"]["String"]) / len(norm["content"]))
            else:
                return None
        return self.token_extent[0] * shrink

    @staticmethod
    def _token_str(v) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 4096:
            # `tokenizers` releases the GIL in encode_batch (not in encode): a long prompt then
            # tokenizes in a worker thread while the event loop keeps serving.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    @functools.cached_property
    def special_tokens(self) -> frozenset[str]:
        """The added tokens marked special: skip_special_tokens leaves them out of decoded text."""
        return frozenset(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use the completions API")
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise ValueError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            self._compiled = env.from_string(self.chat_template)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes any BOS itself, so special tokens are not added a second time.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _flatten(component: dict | None, key: str) -> list[dict]:
    """A tokenizer.json component and the members of any Sequence in it, as a flat list."""
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [c for sub in component.get(key, []) for c in _flatten(sub, key)]
    return [component]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding the window tokens[prefix:] and subtracting the already-emitted tokens[prefix:read]
    keeps the cost per token constant and lets merges across the boundary (spaces, multi-byte
    characters) render as they would in a full decode. A delta ending in U+FFFD is held back until
    the next token completes the character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # a little left context for correct spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of generation, emit whatever is still held back (even an incomplete char)."""
        full = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        delta = full[len(prefix):] if full.startswith(prefix) else ""
        self.read_offset = len(self.ids)
        self.prefix_offset = self.read_offset
        self.text += delta
        return delta
