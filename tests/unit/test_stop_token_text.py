"""The token that stops a request (EOS, stop_token_ids) is in token_ids but not in the text, also
when special tokens are kept (skip_special_tokens=false, as tool-call parsers of Mistral's
[TOOL_CALLS] need), unless include_stop_str_in_output, as in vLLM."""
from __future__ import annotations

from moe_serve.engine.output_processor import OutputProcessor
from moe_serve.protocol import EngineCoreOutput
from moe_serve.sampling_params import SamplingParams
from moe_serve.tokenizer import Tokenizer


def _text(tok, ids, stop_reason, **kw):
    op = OutputProcessor(tok)
    op.add_request("r", tok.encode("Hello"), SamplingParams(max_tokens=16, **kw))
    text = ""
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        (out,), _ = op.process([EngineCoreOutput("r", [t], last, "stop" if last else None,
                                                 stop_reason if last else None)])
        text += out.new_text
    return text


def test_stop_token_not_in_text(checkpoints):
    tok = Tokenizer(checkpoints["qwen3_moe"])
    body = tok.encode("The capital of France")
    eos = tok.eos_token_id
    plain = tok.decode(body, False)
    assert _text(tok, body + [eos], None, skip_special_tokens=False) == plain
    assert _text(tok, body + [eos], None, skip_special_tokens=False, include_stop_str_in_output=True) == \
        plain + "<|im_end|>"
    assert _text(tok, body + [eos], None) == plain
    # A stop_token_ids token, even an ordinary one, is left out of the text too.
    stop = tok.encode(" Paris")[-1]
    assert _text(tok, body + [stop], stop, stop_token_ids=[stop]) == plain


def test_mistral_markers_reach_the_parser_without_eos(checkpoints, tmp_path):
    """A tokenizer whose [TOOL_CALLS] is a special token (as Mistral's): the parser asks for special
    tokens to be kept, and the text it then gets ends without the EOS token's text."""
    import json
    import os
    import shutil

    from moe_serve.entrypoints.openai.tool_parsers import PARSERS

    src = checkpoints["qwen3_moe"]
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    merges = tj["model"]["merges"]
    last = "".join(merges.pop()) if isinstance(merges[-1], list) else merges.pop().replace(" ", "")
    bot = tj["model"]["vocab"].pop(last)
    tj["added_tokens"].append({"id": bot, "content": "[TOOL_CALLS]", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    tok = Tokenizer(str(tmp_path))
    assert "[TOOL_CALLS]" in tok.special_tokens
    parser = PARSERS["mistral"](tok, [])
    assert parser.needs_special_tokens and not PARSERS["hermes"](tok, []).needs_special_tokens
    ids = tok.encode("Sure.") + [bot] + tok.encode('[{"name": "f", "arguments": {"x": 1}}]') + [tok.eos_token_id]
    assert "[TOOL_CALLS]" not in _text(tok, ids, None)  # dropped when special tokens are skipped
    out = parser.parse(_text(tok, ids, None, skip_special_tokens=False))
    assert out.content == "Sure." and [(c.function.name, c.function.arguments) for c in out.tool_calls] == \
        [("f", '{"x": 1}')]
