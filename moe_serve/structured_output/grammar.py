"""Structured-output specs -> xgrammar grammars: the front end's check and the core's compiler.

The front end checks a spec by building its xgrammar `Grammar` (JSON schema / regex / EBNF
parsing, no tokenizer: cheap, and everything xgrammar can refuse is refused here), in the
tokenization thread pool, remembered per (kind, spec). The core compiles the same spec against the
tokenizer (`GrammarManager`) in a background thread, once per (kind, spec): the compiled grammar is
shared by every request with that spec and each request gets its own matcher.
"""
from __future__ import annotations

import collections
import functools
import json
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .params import StructuredOutputsParams

log = logging.getLogger("moe_serve.structured_output")

# JSON output: any whitespace where JSON allows it (what models write), at most this many
# whitespace characters in a row, so a sampled output cannot spin in blanks for ever.
MAX_JSON_WHITESPACE = 4

_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_message(e: BaseException) -> str:
    """xgrammar's error text without its timestamp and source-file prefix."""
    return _XGR_PREFIX.sub("", str(e).strip()).strip()


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# A JSON string of plain characters (no escapes, no control characters), as a schema pattern.
_PLAIN_CHARS = '[^\\x00-\\x1f"\\\\]'
_DATA_KEYS = ("enum", "const", "default", "examples")  # values there are data, not schemas


def _exact_length_strings(node):
    """The schema with every string that has minLength/maxLength but no pattern or format given as
    a pattern of the same length over plain characters. xgrammar 0.2.9 generates such strings
    from a class that lets raw control characters through (invalid JSON) and no escapes; the
    pattern allows the same characters less the control ones, so the length semantics are kept."""
    if isinstance(node, list):
        return [_exact_length_strings(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in _DATA_KEYS else _exact_length_strings(v)) for k, v in node.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out) and \
            not any(k in out for k in ("pattern", "format", "enum", "const")):
        lo, hi = out.get("minLength", 0), out.get("maxLength")
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{'' if hi is None else hi}}}$"
            out.pop("minLength", None)
            out.pop("maxLength", None)
    return out


def build_grammar(kind: str, spec: str):
    """The xgrammar Grammar of a (kind, spec) key (`StructuredOutputsParams.key`); raises
    ValueError with xgrammar's reason when it cannot be built."""
    import xgrammar as xgr

    try:
        if kind == "json":
            try:
                spec = json.dumps(_exact_length_strings(json.loads(spec)), ensure_ascii=False)
            except ValueError:
                pass  # not JSON: xgrammar says so below
            return xgr.Grammar.from_json_schema(spec, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
                                                strict_mode=True)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(xgrammar_message(e)) from None
    raise ValueError(f"unknown structured output kind {kind!r}")


@functools.lru_cache(maxsize=1024)
def _check_key(kind: str, spec: str) -> str | None:
    try:
        build_grammar(kind, spec)
    except ValueError as e:
        return str(e) or "xgrammar could not build the grammar"
    return None


def check_spec(params: StructuredOutputsParams) -> None:
    """Raise ValueError (xgrammar's reason) if the spec cannot be compiled. Remembered per spec."""
    error = _check_key(*params.key)
    if error is not None:
        raise ValueError(error)


class GrammarState:
    """One request's matcher: the grammar's position after the output tokens so far."""

    __slots__ = ("matcher", "rejected")

    def __init__(self, matcher):
        self.matcher = matcher
        self.rejected = False  # a token the grammar did not allow was sampled (never expected)

    def accept(self, token_id: int) -> None:
        if not self.rejected and not self.matcher.accept_token(token_id):
            self.rejected = True

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of `tokens` (draft tokens) the grammar allows from here, short of a
        token that would end it; the matcher is left where it was."""
        n = 0
        for t in tokens:
            if self.rejected or not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():
                n -= 1
                self.matcher.rollback(1)
                break
        if n:
            self.matcher.rollback(n)
        return tokens[:n]


class GrammarManager:
    """The core's compiler: xgrammar TokenizerInfo for the model's logits width (which may exceed
    the tokenizer's vocabulary; the extra ids are never allowed), compiles in one background
    thread, one cache entry (a Future) per (kind, spec), least recently used evicted."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids, cache_size: int = 256):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None  # built in the worker thread (imports xgrammar and transformers)
        self.num_compiled = 0

    def compiled(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar for params (done at once when cached)."""
        key = params.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            fut = self._pool.submit(self._compile, key)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, key: tuple[str, str]):
        if self._compiler is None:
            self._compiler = self._make_compiler()
        grammar = build_grammar(*key)
        compiled = self._compiler.compile_grammar(grammar)
        self.num_compiled += 1
        return compiled

    def _make_compiler(self):
        import xgrammar as xgr

        info = tokenizer_info(self.tokenizer_path, self.vocab_size, self.stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1), cache_enabled=False)

    def state(self, compiled) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(compiled))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_info(tokenizer_path: str, vocab_size: int, stop_token_ids):
    """xgrammar's TokenizerInfo for the checkpoint's tokenizer.json, for logits of width vocab_size
    (ids the tokenizer lacks are never allowed), ending on stop_token_ids.

    Built from the `tokenizers` object itself: the vocabulary by id, and the vocabulary's byte
    encoding (byte-level, byte fallback or raw) and prefix-space handling read by xgrammar from
    the tokenizer's serialized form, which is what `TokenizerInfo.from_huggingface` does with a
    transformers fast tokenizer (tests check the two agree) without needing transformers here."""
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer

    from moe_serve.quantization import gguf_file

    gguf = gguf_file.gguf_path(tokenizer_path)  # a GGUF file's tokenizer comes from its metadata
    tok = gguf_file.tokenizer_parts(gguf)[0] if gguf else HFTokenizer.from_file(os.path.join(tokenizer_path,
                                                                                             "tokenizer.json"))
    detect = getattr(xgr.TokenizerInfo, "_detect_metadata_from_hf", None)
    if detect is None:  # another xgrammar: go through transformers
        from transformers import PreTrainedTokenizerFast

        return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok),
                                                  vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * size
    for token, i in vocab.items():
        encoded[i] = token
    meta = detect(tok.to_str())
    return xgr.TokenizerInfo(encoded[:vocab_size] if size > vocab_size else encoded, vocab_type=meta["vocab_type"],
                             vocab_size=vocab_size, stop_token_ids=list(stop_token_ids),
                             add_prefix_space=meta["add_prefix_space"])
