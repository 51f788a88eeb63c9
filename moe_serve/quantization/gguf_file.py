"""A GGUF checkpoint (llama.cpp's one-file format) as the engine's start-up sees it: which file a
`--model` names, the file read and checked (a truncated or corrupt file, an architecture or a
tensor type we do not serve are refused here, naming them), the model config and the tokenizer.

`--model` may name the .gguf file itself or a directory holding exactly one .gguf and no
safetensors. The config is transformers' reading of the file's architecture keys
(`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`, what a transformers or vLLM user
gets), completed with the keys it does not map (the experts' size `expert_feed_forward_length`,
the shared expert's, Mixtral's expert counts: transformers reads a "llama" file as a dense Llama)
and with `quantization_config: {"quant_method": "gguf"}`. The tokenizer is transformers' conversion
of the file's `tokenizer.ggml.*` vocabulary and merges; the end-of-sequence and beginning tokens,
whether a prompt starts with the latter (`add_bos_token`) and the chat template come from the same
metadata.
"""
from __future__ import annotations

import functools
import os

# GGUF general.architecture -> (transformers model_type, our architecture name). Mixtral's GGUF
# is "llama" with experts (`llama.expert_count`; transformers would read it as a dense Llama); a
# dense Llama and other architectures (GPT-OSS's GGUF: MXFP4 experts, tensor names transformers'
# GGUF reading does not know) are refused naming them.
ARCHITECTURES = {
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "minimax-m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "llama": ("mixtral", "MixtralForCausalLM"),
}


def gguf_path(path: str) -> str | None:
    """The GGUF file `path` names (the file, or the one .gguf of a directory without safetensors), or
    None when it is not a GGUF checkpoint. A directory with several .gguf files is an error naming them."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if not ggufs or any(n.endswith(".safetensors") for n in names):
        return None
    if len(ggufs) > 1:
        raise ValueError(f"model={path!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}): name one of them "
                         f"(split GGUF files are not supported)")
    return os.path.join(path, ggufs[0])


def reader(path: str):
    """The checked reader of the file (_reader), read once per version of the file (its path,
    modification time and size key the cache; the tokenizer's likewise)."""
    st = os.stat(path)
    return _reader(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int):
    """gguf.GGUFReader over the file (memory-mapped), checked: a bad magic, a header or tensor data
    that runs past the end of the file (the reader's views would come out short), one part of a
    split GGUF, or a tensor of a type we do not load (gguf_types.check_type) is a ValueError naming
    the file (or the tensor)."""
    from gguf import GGUFReader

    from moe_serve.quantization.gguf_types import check_type

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"GGUF file {path!r} does not start with the GGUF magic (got {magic!r}): not a GGUF file, "
                         f"or a corrupt one")
    try:
        r = GGUFReader(path)
    except Exception as e:  # a header or tensor data cut short or garbled: numpy / struct errors
        raise ValueError(f"GGUF file {path!r} ({os.path.getsize(path)} bytes) is truncated or corrupt: reading it "
                         f"failed ({e})") from e
    if (parts := field(r, "split.count", 1)) > 1:
        raise ValueError(f"GGUF file {path!r} is part {field(r, 'split.no', 0) + 1} of a split GGUF of {parts} files, "
                         f"which this engine does not load: merge the parts into one file first "
                         f"(llama.cpp's llama-gguf-split --merge)")
    for t in r.tensors:
        check_type(t.name, int(t.tensor_type), logical_shape(t))
    return r


def logical_shape(t) -> tuple[int, ...]:
    """A reader tensor's shape in torch order (GGUF lists its dimensions innermost first)."""
    return tuple(int(d) for d in reversed(t.shape.tolist()))


def field(r, key: str, default=None):
    """A metadata value: a string, a number, or a list of them (default when absent)."""
    from gguf import GGUFValueType

    f = r.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        if len(f.types) > 1 and f.types[1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def architecture(path: str) -> str:
    """The file's general.architecture, refused (naming it) unless we serve it."""
    arch = field(reader(path), "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} has architecture {arch!r}, which this engine does not serve from GGUF; "
                         f"supported GGUF architectures: {', '.join(sorted(ARCHITECTURES))} (llama: Mixtral's, "
                         f"with experts)")
    if arch == "llama" and not field(reader(path), "llama.expert_count"):
        raise ValueError(f"GGUF file {path!r} has architecture 'llama' without experts (llama.expert_count): a dense "
                         f"Llama, which this engine does not serve; only Mixtral's llama files (with experts) are")
    return arch


def hf_config(path: str) -> dict:
    """The model's config (config.json's fields) from the file's metadata."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch = architecture(path)
    r = reader(path)
    model_type, cls = ARCHITECTURES[arch]
    parsed = load_gguf_checkpoint(path, return_tensors=False)["config"]
    parsed.pop("model_type", None)
    # Keys transformers does not map for these architectures.
    if (moe_ff := field(r, f"{arch}.expert_feed_forward_length")) is not None:
        parsed["moe_intermediate_size"] = int(moe_ff)
    if (shared_ff := field(r, f"{arch}.expert_shared_feed_forward_length")) is not None:
        parsed["shared_expert_intermediate_size"] = int(shared_ff)
    if arch == "llama":  # Mixtral: feed_forward_length is each expert's size
        parsed.update(num_local_experts=int(field(r, "llama.expert_count")),
                      num_experts_per_tok=int(field(r, "llama.expert_used_count")))
    hf = AutoConfig.for_model(model_type, **parsed).to_dict()
    hf["architectures"] = [cls]
    hf["quantization_config"] = {"quant_method": "gguf"}
    eos = field(r, "tokenizer.ggml.eos_token_id")
    if eos is not None:
        hf["eos_token_id"] = int(eos)
    return hf


def tokenizer_parts(path: str):
    """(tokenizers.Tokenizer, tokenizer_config-like dict: bos/eos tokens, chat_template, add_bos_token)
    from the file's tokenizer metadata, through transformers' GGUF tokenizer conversion (made once
    per file: the front end and the core each open the tokenizer)."""
    st = os.stat(path)
    fast, config = _tokenizer_parts(path, st.st_mtime_ns, st.st_size)
    return fast, dict(config)


@functools.lru_cache(maxsize=2)
def _tokenizer_parts(path: str, mtime_ns: int, size: int):
    from transformers import AutoTokenizer

    r = reader(path)
    tokens = field(r, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"GGUF file {path!r} has no tokenizer.ggml.tokens: the tokenizer must be in the file")
    fast = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path)).backend_tokenizer

    def token(key):
        i = field(r, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id"),
              "pad_token": token("tokenizer.ggml.padding_token_id"),
              "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
              "chat_template": field(r, "tokenizer.chat_template")}
    bos = config["bos_token"]
    if config["add_bos_token"] and bos is not None and fast.encode("a").ids[:1] != [fast.token_to_id(bos)]:
        # the file asks for a BOS before every prompt (llama.cpp adds it); the conversion did not
        from tokenizers import processors

        add_bos = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
                                                special_tokens=[(bos, fast.token_to_id(bos))])
        fast.post_processor = processors.Sequence([p for p in (fast.post_processor, add_bos) if p is not None])
    return fast, config

