"""The prompt-length bound the server refuses long prompts by, before tokenizing: no token of the
model stands for more than `chars_per_token` characters, so a text has at least chars / that many
tokens. Checked as a property on the tests' tokenizer; tokenizers without such a bound get none."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve.entrypoints.openai.request_limits import BadRequest, PromptLimits, default_max_body_bytes
from moe_serve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(checkpoints):
    return Tokenizer(checkpoints["qwen3_moe"])


def test_longest_token_measured_over_the_vocabulary(tok):
    chars, nbytes = tok.token_extent
    assert chars == len("<|endoftext|>") == 13 and nbytes >= 13  # (raw byte-level forms are wider in UTF-8)
    assert tok.chars_per_token == 13


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL), st.sampled_from([" ", "  ", "\n", "é"])),
                max_size=40).map("".join))
def test_a_text_has_at_least_chars_over_bound_tokens(tok, text):
    for add_special in (True, False):
        n = len(tok.encode(text, add_special_tokens=add_special))
        assert n >= math.ceil(len(text) / tok.chars_per_token), (text, n)


def _write(tmp_path, name, build) -> str:
    from tokenizers import Tokenizer as HF

    d = tmp_path / name
    d.mkdir()
    t: HF = build()
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({}))
    return str(d)


def test_tokenizers_without_a_bound_get_none(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, normalizers, pre_tokenizers

    def wordpiece():  # a long unknown word is one [UNK]
        t = HF(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
        t.pre_tokenizer = pre_tokenizers.Whitespace()
        return t

    def bpe_with_unk():  # unknown characters fuse into one unknown token
        return HF(models.BPE({"<unk>": 0, "a": 1}, [], unk_token="<unk>", fuse_unk=True))

    def byte_level(norm, alphabet=True):
        def build():
            chars = pre_tokenizers.ByteLevel.alphabet() if alphabet else ["a", "b"]
            t = HF(models.BPE({c: i for i, c in enumerate(sorted(chars))}, []))
            t.pre_tokenizer = pre_tokenizers.ByteLevel()
            if norm is not None:
                t.normalizer = norm
            return t
        return build

    assert Tokenizer(_write(tmp_path, "wp", wordpiece)).chars_per_token is None
    assert Tokenizer(_write(tmp_path, "unk", bpe_with_unk)).chars_per_token is None
    assert Tokenizer(_write(tmp_path, "strip", byte_level(normalizers.StripAccents()))).chars_per_token is None
    # bytes without a token of their own are dropped: no bound
    assert Tokenizer(_write(tmp_path, "ab", byte_level(None, alphabet=False))).chars_per_token is None
    plain = Tokenizer(_write(tmp_path, "plain", byte_level(None)))
    assert plain.chars_per_token == plain.token_extent[0] == 1
    nfc = Tokenizer(_write(tmp_path, "nfc", byte_level(normalizers.NFC())))
    assert nfc.chars_per_token == 4 * nfc.token_extent[0]  # composition can fold a few code points into one


def test_prompt_limits_name_the_field():
    lim = PromptLimits(max_model_len=128, chars_per_token=10, kv_block_size=16, kv_blocks=8)
    lim.check_chars(1269, None)  # at least 127 tokens: may fit
    with pytest.raises(BadRequest) as e:
        lim.check_chars(1271, None)
    assert e.value.param == "prompt" and "at least 128 tokens" in str(e.value)
    with pytest.raises(BadRequest) as e:
        lim.check_chars(500, 100)
    assert e.value.param == "max_tokens"
    with pytest.raises(BadRequest) as e:
        lim.check_chars(10**6, None, "messages", slack=4)
    assert e.value.param == "messages" and "4x" in str(e.value)
    small = PromptLimits(max_model_len=1024, chars_per_token=None, kv_block_size=16, kv_blocks=8)
    small.check_chars(10**7, None)  # no bound: only tokenizing tells
    with pytest.raises(BadRequest) as e:
        small.check_tokens(100, 100)
    assert e.value.param == "max_tokens" and "13 KV cache blocks" in str(e.value) and "holds 8 blocks" in str(e.value)
    with pytest.raises(BadRequest) as e:
        small.check_tokens(200, None)
    assert e.value.param == "prompt" and "KV cache" in str(e.value)
    small.check_tokens(100, 28)  # 128 tokens: exactly 8 blocks


def test_default_body_limit():
    # 4x the longest prompt in bytes (JSON escapes, several messages) + 1 MiB
    assert default_max_body_bytes(1024, 13, 512) == (1 << 20) + 4 * 1024 * 13
    assert default_max_body_bytes(1024, 2, 151_000) == (1 << 20) + 4 * 1024 * 8  # as token ids "123456, "
