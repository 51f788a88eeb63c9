"""GGUF checkpoints (`--model file.gguf`, or a directory holding one): greedy tokens equal
transformers loading the same file (`from_pretrained(dir, gguf_file=...)`, which dequantizes every
tensor with gguf-py); block-quantized weights stay packed in memory; the config and tokenizer come
from the file's metadata; unsupported types and architectures, truncated and corrupt files are
refused at start-up, naming them.

The files are written here with gguf-py's GGUFWriter from tiny random transformers checkpoints
(llama.cpp's tensor names and metadata keys; the tokenizer's vocabulary and merges as
`tokenizer.ggml.*`), quantized by gguf-py's own quantizer, or for the K-quants by the tests' writer
(tests/unit/test_gguf_types.py), which gguf-py's reference dequantization checks there.
transformers' GGUF reading leaves out the experts' size (`expert_feed_forward_length`), so the
oracle gets that field from the source config; everything else it reads from the file. Mixtral's
GGUF (architecture "llama" with experts) it reads as a dense Llama: there the oracle is
transformers' Mixtral over gguf-py's dequantization of the file's tensors.
"""
from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from moe_serve import LLM
from moe_serve.config import ModelConfig
from moe_serve.tokenizer import Tokenizer
from tests.models.test_hf_parity import assert_same_greedy, check_greedy_parity, hf_greedy, make_prompts
from tests.unit.test_gguf_types import quantize_any

_QWEN_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


def build_qwen3_moe_256(path: str):
    """A tiny Qwen3-MoE whose linear inputs are 256 wide (a K-quant block per row)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.checkpoints import VOCAB, _tokenizer, widen_

    special = _tokenizer(path)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                         eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg).eval()
    widen_(m, 5)
    return m


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_moe_gguf_src"))
    return path, build_qwen3_moe_256(path)


def build_qwen2_moe_256(path: str):
    """A tiny Qwen2-MoE (q/k/v biases, a gated shared expert) with 256-wide linear inputs."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from tests.checkpoints import VOCAB, _tokenizer, widen_

    special = _tokenizer(path)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                         shared_expert_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                         qkv_bias=True, max_position_embeddings=1024, eos_token_id=special["<|im_end|>"],
                         pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen2MoeForCausalLM(cfg).eval()
    widen_(m, 6)
    return m


def build_minimax_m2_256(path: str):
    """A tiny MiniMax-M2 (q/k norm over the whole projection, a quarter of each head rotated, sigmoid
    routing with a correction bias wide enough to change the choice) with 256-wide linear inputs."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    from tests.checkpoints import VOCAB, _tokenizer, widen_

    special = _tokenizer(path)
    cfg = MiniMaxM2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=16,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=1024, eos_token_id=special["<|im_end|>"],
                          bos_token_id=None, pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = MiniMaxM2ForCausalLM(cfg).eval()
    widen_(m, 7)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.e_score_correction_bias.copy_(0.3 * torch.randn(cfg.num_local_experts, generator=g))
    return m


def build_mixtral_256(path: str):
    """A tiny Mixtral with 256-wide linear inputs (llama.cpp writes it as architecture "llama")."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from tests.checkpoints import VOCAB, _tokenizer, widen_

    special = _tokenizer(path)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=1024, eos_token_id=special["<|im_end|>"], bos_token_id=None,
                        pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = MixtralForCausalLM(cfg).eval()
    widen_(m, 9)
    return m


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for the "llama" architecture (rotary pairs interleaved
    per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_SHARED = {"mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
           "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """llama.cpp's tensor names for a transformers Qwen3-MoE, Qwen2-MoE or MiniMax-M2 (experts stacked
    (E, F, D) / (E, D, F); Qwen2-MoE's q/k/v biases, shared expert and its (D,) gate; MiniMax-M2's
    router bias `exp_probs_b`)."""
    sd, cfg = model.state_dict(), model.config
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    F = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, g in {**_QWEN_BLOCK, **_SHARED}.items():
            for suffix in ("weight", "bias"):
                if f"{p}{hf}.{suffix}" in sd:
                    out[f"blk.{i}.{g}.{suffix}"] = sd[f"{p}{hf}.{suffix}"]
        if f"blk.{i}.ffn_gate_inp_shexp.weight" in out:
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = out[f"blk.{i}.ffn_gate_inp_shexp.weight"].reshape(-1)
        if f"{p}mlp.e_score_correction_bias" in sd:
            out[f"blk.{i}.exp_probs_b.bias"] = sd[f"{p}mlp.e_score_correction_bias"]
        if cfg.model_type == "mixtral":
            out[f"blk.{i}.attn_q.weight"] = llama_permute(out[f"blk.{i}.attn_q.weight"], cfg.num_attention_heads)
            out[f"blk.{i}.attn_k.weight"] = llama_permute(out[f"blk.{i}.attn_k.weight"], cfg.num_key_value_heads)
        gate_up = sd[p + "mlp.experts.gate_up_proj"]
        out[f"blk.{i}.ffn_gate_exps.weight"] = gate_up[:, :F]
        out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, F:]
        out[f"blk.{i}.ffn_down_exps.weight"] = sd[p + "mlp.experts.down_proj"]
    return out


def write_tokenizer(w, tok_dir: str, bos: str | None = None) -> None:
    """The tokenizer.json / tokenizer_config.json of tok_dir as GGUF `tokenizer.*` metadata; `bos`: a
    token the file asks to put before every prompt (add_bos_token)."""
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        tj = json.load(f)
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        tc = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in tj["added_tokens"]})
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in tj["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_pad_token_id(vocab[tc["pad_token"]])
    if bos is not None:
        w.add_bos_token_id(vocab[bos])
    w.add_add_bos_token(bos is not None)
    w.add_chat_template(tc["chat_template"])


def write_gguf(model, tok_dir: str, out_file: str, qtype_of, arch: str | None = None,
               extra: dict[str, int] | None = None, bos: str | None = None) -> str:
    """The model as a GGUF file, each tensor in qtype_of(gguf name, array)'s type; `extra`: more
    integer (uint16) metadata; `bos`: write_tokenizer's."""
    import gguf

    cfg = model.config
    arch = arch or {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "minimax_m2": "minimax-m2",
                    "mixtral": "llama"}[cfg.model_type]
    w = gguf.GGUFWriter(out_file, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if cfg.model_type == "mixtral":
        w.add_rope_dimension_count(head_dim)
    if cfg.model_type == "minimax_m2":
        w.add_rope_dimension_count(cfg.rotary_dim)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    for key, value in (extra or {}).items():
        w.add_uint16(key, value)
    write_tokenizer(w, tok_dir, bos)
    for name, t in gguf_tensors(model).items():
        x = t.detach().float().contiguous().numpy()
        q = qtype_of(name, x)
        if q == T.F32:
            w.add_tensor(name, x)
        elif q == T.F16:
            w.add_tensor(name, x.astype(np.float16))
        elif q == T.BF16:
            w.add_tensor(name, t.detach().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8),
                         raw_dtype=T.BF16)
        elif q == T.Q2_K:  # a type we refuse: its bytes never load, zeros will do
            w.add_tensor(name, np.zeros((*x.shape[:-1], x.shape[-1] // 256 * 84), dtype=np.uint8), raw_dtype=q)
        else:
            w.add_tensor(name, quantize_any(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


def mix(linear: T, experts: T, down: T | None = None, embed: T = T.Q8_0):
    """A type chooser as llama.cpp's presets mix them: norms and the router in F32, the embedding
    and output head `embed`, attention `linear`, gate/up experts `experts`, down experts `down`."""
    def choose(name: str, x: np.ndarray) -> T:
        if x.ndim == 1 or "ffn_gate_inp" in name:
            return T.F32
        if name in ("token_embd.weight", "output.weight"):
            return embed
        if "ffn_down_exps" in name:
            return down or experts
        return experts if "_exps" in name else linear
    return choose


def oracle(gguf_file: str, source_model):
    """transformers' model from the same GGUF file (its own dequantization); the experts' size,
    which its GGUF config mapping lacks, from the source config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d, f = os.path.dirname(gguf_file), os.path.basename(gguf_file)
    cfg = AutoConfig.from_pretrained(d, gguf_file=f)
    if hasattr(cfg, "moe_intermediate_size"):
        cfg.moe_intermediate_size = source_model.config.moe_intermediate_size
    if hasattr(cfg, "shared_expert_intermediate_size"):
        cfg.shared_expert_intermediate_size = source_model.config.shared_expert_intermediate_size
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, config=cfg, dtype=torch.float32).eval()


def light_parity(path: str, model, seed: int, n: int = 5):
    """Greedy tokens on three prompts, computed in float (transformers' arithmetic: the int8
    activations GGUF files get by default are test_cpu_int8_activations_*'s)."""
    prompts = make_prompts(seed)[3:6]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, cpu_int8_activations=False)
    from moe_serve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=n))
    for p, o in zip(prompts, outs):
        assert_same_greedy(model, p, o.outputs[0].token_ids, hf_greedy(model, p, n))
    return llm


def test_q4_k_m_greedy_matches_transformers(source, tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M mix (Q4_K attention and gate/up experts, Q6_K down experts, Q8_0
    embedding and head) under chunked prefill, preemption and prefix hits, served from the
    directory holding the file (the other tests name the file). Decode-sized calls over these
    layouts (4 bits group 32; gate/up experts 4-bit beside down experts a code a byte, Q6_K's group
    16) run in our C kernels
    (cpu_ops/quant.c, the CPU's default backends)."""
    from moe_serve.kernels.cpu_ops import quant

    if not quant.cpu_ops.available():
        pytest.fail("the C kernels did not build here (cpu_ops.status())")
    calls = {"quant_linear": 0, "quant_experts": 0}
    for name in calls:
        def spy(*a, _real=getattr(quant, name), _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(quant, name, spy)
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "model-Q4_K_M.gguf"), mix(T.Q4_K, T.Q4_K, T.Q6_K))
    hf = oracle(f, model)
    plain = dict(model.named_parameters())  # the oracle holds the quantized weights, not the source's
    assert not torch.equal(dict(hf.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                           plain["model.layers.0.self_attn.q_proj.weight"])
    check_greedy_parity(str(tmp_path), hf, 70, cpu_int8_activations=False)
    assert calls["quant_linear"] > 0 and calls["quant_experts"] > 0, calls


@pytest.mark.parametrize("linear,experts,down,embed", [
    (T.Q5_K, T.Q4_0, T.Q5_0, T.F16),
    (T.Q4_1, T.Q5_1, T.Q8_0, T.BF16),
    (T.Q8_0, T.Q8_0, T.F16, T.F32),
], ids=["Q5_K-Q4_0-Q5_0-F16", "Q4_1-Q5_1-Q8_0-BF16", "float-down-experts"])
def test_types_greedy_match_transformers(source, tmp_path, linear, experts, down, embed):
    """The other types (4-bit gate/up experts beside 8-bit down experts, each at its own width); a
    layer whose down experts are F16 loads its experts dense."""
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "m.gguf"), mix(linear, experts, down, embed))
    ours = light_parity(f, oracle(f, model), 72).engine.runner.model
    assert (ours.model.layers[0].mlp.experts.w13 is None) == (down != T.F16)


def test_qwen2_moe_greedy_matches_transformers(tmp_path):
    """Qwen2-MoE's GGUF: q/k/v biases (F32), the shared expert's gate (F32, (D,) in the file), Q4_K
    attention, shared expert and gate/up experts, Q6_K down experts."""
    src = str(tmp_path / "src")
    model = build_qwen2_moe_256(src)
    f = write_gguf(model, src, str(tmp_path / "qwen2moe.gguf"), mix(T.Q4_K, T.Q4_K, T.Q6_K))
    assert ModelConfig.from_path(f).hf["shared_expert_intermediate_size"] == 256
    light_parity(f, oracle(f, model), 73)


def test_minimax_m2_greedy_matches_transformers(tmp_path):
    """MiniMax-M2's GGUF: w1/w3/w2 experts (Q4_K, Q6_K down), the router's correction bias
    `exp_probs_b` and whole-projection q/k norms (F32), partial rotary from rope.dimension_count."""
    src = str(tmp_path / "src")
    model = build_minimax_m2_256(src)
    f = write_gguf(model, src, str(tmp_path / "minimax.gguf"), mix(T.Q4_K, T.Q4_K, T.Q6_K))
    hf = ModelConfig.from_path(f).hf
    assert (hf["rotary_dim"], hf["scoring_func"], hf["head_dim"]) == (16, "sigmoid", 64)
    ref = oracle(f, model)
    bias = "model.layers.1.mlp.e_score_correction_bias"  # the oracle read the bias from the file
    assert torch.equal(ref.state_dict()[bias], model.state_dict()[bias])
    light_parity(f, ref, 74)


def test_packed_weights_stay_packed_in_memory(source, tmp_path):
    """Q4_K weights keep a byte per two codes and a float32 scale and offset per 32 (0.25 + 0.125 of
    bf16's bytes); the symmetric Q8_0 and Q4_0 a byte per code (per two codes) and their block's
    float16 scale per 32, their offsets (-128 and -8 times the scale) dropped for a zero code (0.5 +
    0.03125, 0.25 + 0.03125: the GGUF blocks' own bytes); no dense copy of a quantized weight."""
    src, model = source
    for qtype, ratio in ((T.Q4_K, 0.375), (T.Q8_0, 0.53125), (T.Q4_0, 0.28125)):
        f = write_gguf(model, src, str(tmp_path / f"{qtype.name}.gguf"), mix(qtype, qtype, embed=qtype))
        ours = LLM(f, dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False).engine.runner.model
        params = dict(ours.named_parameters())
        packed = {n: p for n, p in params.items() if n.endswith(("qweight", "qscales", "qoffsets", "_scales",
                                                                  "_offsets"))}
        assert any("experts.w13_qweight" in n for n in packed) and any("o_proj.qweight" in n for n in packed)
        assert all(p.dtype == torch.uint8 for n, p in packed.items() if "qweight" in n)
        logical = sum(p.numel() * (1 if qtype == T.Q8_0 else 2) for n, p in packed.items() if "qweight" in n)
        offsets = [n for n in packed if "offsets" in n]
        assert bool(offsets) == (qtype == T.Q4_K), offsets[:3]
        scales = {p.dtype for n, p in packed.items() if "scales" in n}
        assert scales == {torch.float32 if qtype == T.Q4_K else torch.float16}
        zeros = {ours.model.layers[0].self_attn.o_proj.packed_zero, *ours.model.layers[0].mlp.experts.zeros}
        assert zeros == {0 if qtype == T.Q4_K else 128 if qtype == T.Q8_0 else 8}
        packed_bytes = sum(p.numel() * p.element_size() for p in packed.values())
        assert packed_bytes == pytest.approx(ratio * 2 * logical, rel=1e-6), (qtype, packed_bytes / (2 * logical))
        assert ours.model.layers[0].self_attn.q_proj.weight is None
        assert ours.model.layers[0].mlp.experts.w13 is None
    # Q4_K_M: the Q4_K gate/up experts stay two codes a byte beside the Q6_K down experts' one.
    f = write_gguf(model, src, str(tmp_path / "Q4_K_M.gguf"), mix(T.Q4_K, T.Q4_K, T.Q6_K))
    ex = LLM(f, dtype="bfloat16", kv_cache_memory=1 << 20, show_progress=False).engine.runner.model.model.layers[0].mlp.experts
    assert ex.widths == (4, 8)
    assert ex.w13_qweight.shape[-1] * 2 == ex.D and ex.w2_qweight.shape[-1] == ex.F


def test_config_and_tokenizer_from_the_file(source, tmp_path):
    """The config the engine builds from the metadata has the source checkpoint's values; the
    tokenizer encodes as the source tokenizer.json does and carries the eos token and template."""
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "m.gguf"), mix(T.Q8_0, T.Q8_0))
    mc = ModelConfig.from_path(f)
    assert mc.architecture == "Qwen3MoeForCausalLM"
    assert mc.weight_quantization == "gguf"
    c = model.config
    for key in ("hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts_per_tok", "norm_topk_prob",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
        assert mc.hf[key] == getattr(c, key), key
    assert mc.hf["num_local_experts"] == c.num_experts  # transformers 5's name for it
    assert mc.hf["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)
    assert mc.eos_token_ids == {c.eos_token_id}
    from tokenizers import Tokenizer as HFTokenizer

    ref = HFTokenizer.from_file(os.path.join(src, "tokenizer.json"))
    tok = Tokenizer(f)
    text = "Hello, world! Café, 東京は日本の首都です。 <|im_start|>user\nhi<|im_end|>"
    assert tok.encode(text) == ref.encode(text).ids
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == c.eos_token_id
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a file that asks for a BOS before every prompt (tokenizer.ggml.add_bos_token) gets one
    f = write_gguf(model, src, str(tmp_path / "bos.gguf"), mix(T.Q8_0, T.Q8_0), bos="<|endoftext|>")
    tok = Tokenizer(f)
    bos = ref.token_to_id("<|endoftext|>")
    assert tok.bos_token == "<|endoftext|>"
    assert tok.encode(text) == [bos] + ref.encode(text).ids
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text).ids


def test_structured_output_over_the_file_tokenizer(source, tmp_path):
    """Grammars compile over the GGUF file's tokenizer: a choice constrains the output to one of its
    strings; a weight update of a GGUF model is refused naming the format."""
    from moe_serve import SamplingParams
    from moe_serve.structured_output.params import StructuredOutputsParams
    from moe_serve.weights import tensor_loader

    src, model = source
    f = write_gguf(model, src, str(tmp_path / "m.gguf"), mix(T.Q8_0, T.Q8_0))
    llm = LLM(f, dtype="float32", kv_cache_memory=1 << 22, show_progress=False)
    choices = ["Paris", "Berlin and Rome"]
    out = llm.generate([{"prompt_token_ids": make_prompts(3)[4]}],
                       SamplingParams(temperature=0, max_tokens=20,
                                      structured_outputs=StructuredOutputsParams(choice=choices)))
    assert out[0].outputs[0].text in choices
    with pytest.raises(ValueError, match="weight updates of a gguf"):
        tensor_loader(llm.engine.runner.model, torch.float32, f)


def test_unsupported_type_refused_naming_tensor_and_type(source, tmp_path):
    """A tensor of a type we do not load (here Q2_K) fails start-up, naming the tensor, the type
    and GGUF, before any weight loads."""
    src, model = source
    choose = mix(T.Q8_0, T.Q8_0)
    f = write_gguf(model, src, str(tmp_path / "q2k.gguf"),
                   lambda name, x: T.Q2_K if name == "blk.1.ffn_down_exps.weight" else choose(name, x))
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.1.ffn_down_exps.weight' has type Q2_K, which this "
                                         r"engine does not load"):
        LLM(f, show_progress=False)


def test_truncated_and_corrupt_files_refused(source, tmp_path):
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "m.gguf"), mix(T.Q8_0, T.Q8_0))
    data = open(f, "rb").read()
    cut = tmp_path / "cut" / "m.gguf"
    cut.parent.mkdir()
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match=r"GGUF file .*cut/m.gguf' \(\d+ bytes\) is truncated or corrupt"):
        LLM(str(cut), show_progress=False)
    head = tmp_path / "head" / "m.gguf"
    head.parent.mkdir()
    head.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"GGUF file .*head/m.gguf' \(200 bytes\) is truncated or corrupt"):
        LLM(str(head.parent), show_progress=False)
    bad = tmp_path / "bad" / "m.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUG" + data[4:])
    with pytest.raises(ValueError, match=r"does not start with the GGUF magic \(got b'GGUG'\)"):
        LLM(str(bad), show_progress=False)


def test_unsupported_architecture_refused_naming_it(source, tmp_path):
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "m.gguf"), mix(T.Q8_0, T.Q8_0), arch="deepseek2")
    with pytest.raises(ValueError, match=r"architecture 'deepseek2'.*supported GGUF architectures: llama, "
                                         r"minimax-m2, qwen2moe, qwen3moe"):
        ModelConfig.from_path(f)


def test_directory_with_several_gguf_files_and_split_files_refused(source, tmp_path):
    src, model = source
    f = write_gguf(model, src, str(tmp_path / "a.gguf"), mix(T.Q8_0, T.Q8_0))
    shutil.copy(f, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        ModelConfig.from_path(str(tmp_path))
    # the first part of a split file (llama-gguf-split writes split.no / split.count into each part)
    part = write_gguf(model, src, str(tmp_path / "m-00001-of-00003.gguf"), mix(T.Q8_0, T.Q8_0),
                      extra={"split.no": 0, "split.count": 3})
    with pytest.raises(ValueError, match=r"part 1 of a split GGUF of 3 files"):
        ModelConfig.from_path(part)


def _int8_activation_hooks(model, experts: int):
    """transformers' model computing as --cpu-int8-activations does: every linear product over a packed
    weight (all but the router, whose rows are the experts) takes its input rounded to int8 per 32
    (d = max|x| / 127, round to nearest even), F.linear patched while the returned context is open."""
    import contextlib

    import torch.nn.functional as F

    plain = F.linear

    def linear(x, w, b=None):
        if w.shape[0] != experts and w.shape[-1] % 32 == 0:
            xg = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
            d = xg.abs().amax(-1, keepdim=True) / 127
            xg = torch.where(d > 0, torch.round(xg / torch.where(d > 0, d, 1)).clamp(-127, 127) * d, 0)
            x = xg.reshape(x.shape)
        return plain(x, w, b)

    @contextlib.contextmanager
    def patched():
        impl = model.config._experts_implementation
        model.config._experts_implementation = "eager"  # its experts through F.linear (not grouped_mm)
        F.linear = torch.nn.functional.linear = linear
        try:
            yield model
        finally:
            F.linear = torch.nn.functional.linear = plain
            model.config._experts_implementation = impl

    return patched()


def test_cpu_int8_activations_serve_the_rounded_arithmetic(source, tmp_path, caplog):
    """A Q4_0 file served with the defaults rounds its packed layers' activations to int8, as llama.cpp
    does (where this build's int8 tiles are vector code: AVX-512 or AVX2), --cpu-int8-activations
    forces it elsewhere: the packed calls take the int8-activation path (quant.c's counter moves),
    and the greedy tokens are those of transformers computing with its linear inputs rounded the
    same way (a token may differ only where transformers' top two are within the rounding's reach);
    --no-cpu-int8-activations keeps them float; refused where it cannot be honoured, naming the flag."""
    from moe_serve import SamplingParams
    from moe_serve.engine.args import EngineArgs
    from moe_serve.kernels.cpu_ops import quant

    src, model = source
    f = write_gguf(model, src, str(tmp_path / "q40.gguf"), mix(T.Q4_0, T.Q4_0, embed=T.Q8_0))
    ref = oracle(f, model)
    with caplog.at_level(logging.INFO, logger="moe_serve"):
        llm = LLM(f, dtype="float32", kv_cache_memory=1 << 22, show_progress=False,
                  cpu_int8_activations=None if quant.act8_vector() else True)
    if quant.act8_vector():
        assert "round their activations to int8 per weight group in our C kernels (a GGUF file" in caplog.text
    plain = LLM(f, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, cpu_int8_activations=False)
    ran = quant.act8_run()
    plain.generate([{"prompt_token_ids": make_prompts(31)[0]}], SamplingParams(temperature=0, max_tokens=3))
    assert quant.act8_run() == ran
    del plain
    prompts = make_prompts(31)[3:6]
    ran = quant.act8_run()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6))
    assert quant.act8_run() > ran
    with _int8_activation_hooks(ref, model.config.num_experts) as hooked:
        for p, o in zip(prompts, outs):
            ours, theirs = list(o.outputs[0].token_ids), hf_greedy(hooked, p, 6)
            for i, (a, b) in enumerate(zip(ours, theirs)):
                if a != b:
                    with torch.no_grad():
                        top = torch.topk(hooked(torch.tensor([p + theirs[:i]])).logits[0, -1], 2).values
                    assert float(top[0] - top[1]) < 0.05, (i, a, b, float(top[0] - top[1]))
                    break
    # Prompts of 1, 3 and 7 tokens: the prefill's calls are decode-sized too (the panel GEMM, float,
    # takes more rows), so every product is rounded: the logprobs of our tokens are transformers'
    # rounded ones, nearer than its float ones
    short = make_prompts(31)[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in short],
                        SamplingParams(temperature=0, max_tokens=4, logprobs=0))
    worst = {"rounded": 0.0, "float": 0.0}
    for p, o in zip(short, outs):
        toks = list(o.outputs[0].token_ids)
        ours = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]
        with torch.no_grad():
            ids = torch.tensor([p + toks[:-1]])
            with _int8_activation_hooks(ref, model.config.num_experts) as hooked:
                rounded = torch.log_softmax(hooked(ids).logits[0, len(p) - 1:].float(), -1)
            plain = torch.log_softmax(ref(ids).logits[0, len(p) - 1:].float(), -1)
        for i, t in enumerate(toks):
            worst["rounded"] = max(worst["rounded"], abs(ours[i] - rounded[i, t].item()))
            worst["float"] = max(worst["float"], abs(ours[i] - plain[i, t].item()))
    # (an activation that lands on a rounding tie in one and not the other moves by one int8 step: a
    # few thousandths of a nat here, against a tenth between the rounded and the float arithmetic)
    assert worst["rounded"] < 0.03 and worst["rounded"] < 0.3 * worst["float"], worst
    with pytest.raises(ValueError, match="--cpu-int8-activations .*--moe-backend torch"):
        EngineArgs(f, moe_backend="torch", cpu_int8_activations=True).create_engine_config()
    with pytest.raises(ValueError, match="--cpu-int8-activations with --batch-invariant"):
        EngineArgs(f, batch_invariant=True, cpu_int8_activations=True).create_engine_config()
