"""The tokenizer files of a build: a `tokenizers.Tokenizer` rebuilt from the GGUF's vocabulary and
merges (checked against SmolLM2's behaviour), tokenizer.json / tokenizer_config.json, and the
chat-template renderer the self-check uses.
"""
from __future__ import annotations

import os

from .gguf_source import GGUF_TOKEN_TYPE_CONTROL, MAX_POSITION_EMBEDDINGS, GGUFTokenizer
from .tiny import write_json


def build_hf_tokenizer(tk: GGUFTokenizer):
    """A `tokenizers.Tokenizer` equivalent to llama.cpp's tokenizer for this vocabulary.

    SmolLM2 is GPT-2 style byte-level BPE (tokenizer.ggml.model "gpt2"). Its llama.cpp pre-tokenizer
    "smollm" first isolates every digit (\\p{N}), then applies GPT-2's split regex; that is the
    Digits(individual_digits) + ByteLevel(use_regex) pair of the original tokenizer.json.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if tk.model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={tk.model!r}: only byte-level BPE ('gpt2') is supported")
    splits = {
        "smollm": [pre_tokenizers.Digits(individual_digits=True)],
        "gpt2": [],
    }
    if tk.pre not in splits:
        raise ValueError(f"tokenizer.ggml.pre={tk.pre!r} is not a pre-tokenizer this converter knows")
    vocab = {token: i for i, token in enumerate(tk.tokens)}
    if len(vocab) != len(tk.tokens):
        raise ValueError("the GGUF vocabulary has duplicate tokens")
    # A byte-level token never contains a real space (it is spelled as U+0120), so one split is exact.
    merges = [tuple(m.split(" ")) for m in tk.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits[tk.pre] + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, kind in zip(tk.tokens, tk.token_types) if kind == GGUF_TOKEN_TYPE_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def check_tokenizer(tok, tk: GGUFTokenizer) -> None:
    """Fail loudly if the rebuilt tokenizer does not behave like SmolLM2's."""
    problems = []
    if tok.get_vocab_size(with_added_tokens=True) != len(tk.tokens):
        problems.append(f"vocab size {tok.get_vocab_size(with_added_tokens=True)} != {len(tk.tokens)}")
    for i in (0, 1, 2, 100, len(tk.tokens) // 2, len(tk.tokens) - 1):
        if tok.id_to_token(i) != tk.tokens[i]:
            problems.append(f"id {i} is {tok.id_to_token(i)!r}, GGUF says {tk.tokens[i]!r}")
    samples = [
        "What is the capital of France?",
        "  Leading spaces, tabs\tand\nnewlines;  double  spaces.",
        "Numbers 2024 and 3.14159 split per digit.",
        "Café naïve — “quotes” 東京 🙂 <b>html</b> x=f(y)**2",
    ]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False).ids
        back = tok.decode(ids, skip_special_tokens=False)
        if back != s:
            problems.append(f"round trip of {s!r} gave {back!r}")
    digits = tok.encode("2024", add_special_tokens=False).tokens
    if digits != ["2", "0", "2", "4"]:
        problems.append(f"'2024' tokenized as {digits}, expected one token per digit")
    for i, t in enumerate(tk.tokens):
        if tk.token_types[i] == GGUF_TOKEN_TYPE_CONTROL and tok.encode(t, add_special_tokens=False).ids != [i]:
            problems.append(f"special token {t!r} does not encode to its id {i}")
    word = tok.encode(" the", add_special_tokens=False).tokens
    if word != ["Ġthe"]:
        problems.append(f"' the' tokenized as {word}, expected ['Ġthe']")
    if problems:
        raise RuntimeError("rebuilt SmolLM2 tokenizer is wrong: " + "; ".join(problems))


def write_tokenizer_files(out_dir: str, tk: GGUFTokenizer) -> None:
    """tokenizer.json (rebuilt from the GGUF) and tokenizer_config.json (chat template, specials)."""
    tok = build_hf_tokenizer(tk)
    check_tokenizer(tok, tk)
    tok.save(os.path.join(out_dir, "tokenizer.json"))

    def name(i):
        return None if i is None else tk.tokens[int(i)]

    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tk.bos_id),
        "eos_token": name(tk.eos_id),
        "pad_token": name(tk.pad_id),
        "unk_token": name(tk.unk_id),
        "add_bos_token": tk.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "chat_template": tk.chat_template,
    })


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """Render a chat template the way Hugging Face does (sandboxed jinja2, trim/lstrip blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)
