"""Tiny random checkpoints of every supported architecture, written by transformers itself.

Weights are widened from transformers' 0.02 init (normal with std fan_in^-0.5, norms near 1) so
the top logits are not nearly tied and a token mismatch means a bug. Each checkpoint also
exercises one loading variant: Mixtral uses Hub-style `rope_theta`/`rope_scaling` keys and sharded
files with an index; Qwen3-MoE stores experts as fused 3-D tensors; DeepSeek-V3 carries a
multi-token-prediction layer after its last layer and yarn RoPE scaling.
"""
from __future__ import annotations

import functools
import json
import os

import torch

from moe_serve.default_model.tokenizer_train import special_token_ids, train_tokenizer

VOCAB = 512


def widen_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


# e2m1 magnitudes by code (bit 3 is the sign), as in the OCP microscaling spec.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize (..., R, C) weights to MXFP4 in the Hub's layout (GPT-OSS): blocks (..., R, C/32, 16)
    uint8 with two e2m1 codes per byte (element 2i in the low nibble) and scales (..., R, C/32)
    uint8 e8m0 (2 ** (s - 127)) per 32 values. Each group's scale puts its largest magnitude in
    [4, 8); values round to the nearest e2m1 magnitude (6 at most)."""
    *lead, C = w.shape
    g = w.float().reshape(*lead, C // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.floor(torch.log2(amax)) - 2
    scaled = g / torch.exp2(exp)[..., None]
    mags = torch.tensor(_E2M1)
    code = (scaled.abs()[..., None] - mags).abs().argmin(-1) | ((scaled < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exp + 127).to(torch.uint8).contiguous()


def _tokenizer(path: str) -> dict[str, int]:
    train_tokenizer(path, VOCAB)
    return special_token_ids(path)


def build_mixtral(path: str) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    special = _tokenizer(path)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
                        max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=special["<|im_end|>"],
                        bos_token_id=None, pad_token_id=special["<|endoftext|>"])
    torch.manual_seed(0)
    m = MixtralForCausalLM(cfg).eval()
    widen_(m, 1)
    m.save_pretrained(path, max_shard_size="200KB")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    # Hub-style RoPE keys, as older configs have them.
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.pop("rope_parameters", None)
    c["rope_theta"], c["rope_scaling"] = 10000.0, None
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


def build_qwen3_moe(path: str) -> str:
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    special = _tokenizer(path)
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
                         max_position_embeddings=1024, eos_token_id=special["<|im_end|>"],
                         pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen3MoeForCausalLM(cfg).eval()
    widen_(m, 2)
    m.save_pretrained(path)
    # Rewrite the experts in the fused 3-D layout: gate_up_proj (E, 2F, D), down_proj (E, D, F).
    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for i in (0, 2):
        pre = f"model.layers.{i}.mlp.experts"
        E = cfg.num_experts
        out[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{pre}.{e}.gate_proj.weight"], sd[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)])
        out[f"{pre}.down_proj"] = torch.stack([sd[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _deepseek_fields(special: dict) -> dict:
    """A tiny DeepSeek-V3-style MLA + MoE config (yarn RoPE), shared by its DSA descendants."""
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                max_position_embeddings=1024,
                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                 "mscale": 1.0, "mscale_all_dim": 1.0},
                eos_token_id=special["<|im_end|>"], bos_token_id=None, pad_token_id=special["<|endoftext|>"])


# DSA checkpoints select 8 tokens per query: prompts of 20-60 tokens really are sparse.
DSA_TOPK = 8


def _build_dsa(path: str, config_cls, model_cls, seed: int, **fields) -> str:
    """A tiny DSA model (DeepSeek-V3.2 or GLM-5): the indexer's 8 heads of 16 (rotary on 8 of them)
    select DSA_TOPK tokens. The indexer's key-norm bias is kept small (widen_ would set it near 1,
    a shift common to every key that flattens the scores)."""
    cfg = config_cls(**{**_deepseek_fields(_tokenizer(path)), "index_topk": DSA_TOPK, "index_head_dim": 16,
                        "index_n_heads": 8, **fields})
    torch.manual_seed(0)
    m = model_cls(cfg).eval()
    widen_(m, seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, prm in m.named_parameters():
            if name.endswith("indexer.k_norm.bias"):
                prm.copy_(0.1 * torch.randn(prm.shape, generator=g))
    m.save_pretrained(path)
    return path


def build_deepseek_v32(path: str) -> str:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    return _build_dsa(path, DeepseekV32Config, DeepseekV32ForCausalLM, 21, num_hidden_layers=3)


def build_glm_moe_dsa(path: str) -> str:
    """GLM-5's shape: layers 1 and 3 reuse the selection of the layer before them."""
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    return _build_dsa(path, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, 22, num_hidden_layers=4, n_group=1, topk_group=1,
                      indexer_types=["full", "shared", "full", "shared"])


def _write_mtp_layer(path: str, layer: int, src: int, mtp: dict) -> None:
    """Append a multi-token-prediction layer as the Hub lays it out after DeepSeek-V3's last layer:
    `model.layers.{layer}.` holds a decoder layer (here a copy of layer src), its own copy of the
    input embedding, enorm, hnorm, eh_proj and shared_head (norm, head); config.json says
    num_nextn_predict_layers: 1. mtp: enorm, hnorm, eh_proj, shared_head.norm, shared_head.head."""
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    for k in [k for k in sd if k.startswith(f"model.layers.{src}.")]:
        sd[k.replace(f"model.layers.{src}.", f"model.layers.{layer}.")] = sd[k].clone()
    sd[f"model.layers.{layer}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    for name, t in mtp.items():
        sd[f"model.layers.{layer}.{name}.weight"] = t.contiguous()
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def build_deepseek_v3(path: str) -> str:
    """Three layers (the first dense) and a multi-token-prediction layer of random weights."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**_deepseek_fields(_tokenizer(path)), num_hidden_layers=3)
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    widen_(m, 3)
    m.save_pretrained(path)
    g = torch.Generator().manual_seed(33)
    D, V = cfg.hidden_size, cfg.vocab_size
    _write_mtp_layer(path, 3, 2, {
        "enorm": 1.0 + 0.1 * torch.randn(D, generator=g), "hnorm": 1.0 + 0.1 * torch.randn(D, generator=g),
        "eh_proj": torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5,
        "shared_head.norm": 1.0 + 0.1 * torch.randn(D, generator=g),
        "shared_head.head": torch.randn(V, D, generator=g) * D ** -0.5})
    return path


def build_deepseek_mtp(path: str, copy: bool, num_hidden_layers: int = 1, seed: int = 4, **fields) -> str:
    """A DeepSeek-V3 checkpoint (tiny unless `fields` say otherwise; every layer MoE) with an MTP
    layer. copy: the MTP layer is the model shifted by one token, so its drafts are often right
    (one layer only): eh_proj passes the (unit-RMS) embedding of the next token through, the
    decoder layer is a copy of layer 0 and shared_head the model's final norm and LM head; at
    position p it then runs the model's own layer over tokens 1..p+1 (the model at p+1 sees tokens
    0..p+1). Otherwise random MTP weights (drafts nearly always rejected) after a copy of the last
    layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if copy and num_hidden_layers != 1:
        raise ValueError("an MTP layer that copies the model needs a one-layer model")
    cfg = DeepseekV3Config(**{**_deepseek_fields(_tokenizer(path)), "first_k_dense_replace": 0, **fields},
                           num_hidden_layers=num_hidden_layers)
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    widen_(m, seed)
    with torch.no_grad():
        e = m.model.embed_tokens.weight
        e.div_(e.pow(2).mean(-1, keepdim=True).sqrt())
    m.save_pretrained(path)
    D, V = cfg.hidden_size, cfg.vocab_size
    if copy:
        mtp = {"enorm": torch.ones(D), "hnorm": torch.ones(D),
               "eh_proj": torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1),
               "shared_head.norm": m.model.norm.weight.detach().clone(),
               "shared_head.head": m.lm_head.weight.detach().clone()}
    else:
        g = torch.Generator().manual_seed(seed + 30)
        mtp = {"enorm": 1.0 + 0.1 * torch.randn(D, generator=g), "hnorm": 1.0 + 0.1 * torch.randn(D, generator=g),
               "eh_proj": torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5,
               "shared_head.norm": 1.0 + 0.1 * torch.randn(D, generator=g),
               "shared_head.head": torch.randn(V, D, generator=g) * D ** -0.5}
    _write_mtp_layer(path, num_hidden_layers, num_hidden_layers - 1, mtp)
    return path


def build_deepseek_v3_mtp_copy(path: str) -> str:
    """One MoE layer and an MTP layer that is the model shifted by one token (build_deepseek_mtp)."""
    return build_deepseek_mtp(path, copy=True)


BUILDERS = {"mixtral": build_mixtral, "qwen3_moe": build_qwen3_moe, "deepseek_v3": build_deepseek_v3}


# --- architectures added for checkpoint breadth: built lazily, one at a time, by the tests that use them.
def build_qwen2_moe(path: str) -> str:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    special = _tokenizer(path)
    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         shared_expert_intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                         decoder_sparse_step=1, mlp_only_layers=[1], qkv_bias=True, max_position_embeddings=1024,
                         eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen2MoeForCausalLM(cfg).eval()
    widen_(m, 4)
    m.save_pretrained(path)
    return path


def build_olmoe(path: str) -> str:
    """clip_qkv is set below the widened q/k/v magnitudes, so the clamp really cuts."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    special = _tokenizer(path)
    cfg = OlmoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=False, clip_qkv=1.5, attention_bias=False, max_position_embeddings=1024,
                      eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"], bos_token_id=None,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    m = OlmoeForCausalLM(cfg).eval()
    widen_(m, 5)
    m.save_pretrained(path)
    return path


def build_kimi_k2(path: str) -> str:
    """Kimi-K2's config style on DeepSeek-V3's architecture: model_type kimi_k2, one expert group
    (n_group=topk_group=1), many experts for the size, one dense first layer, Hub-style yarn RoPE with
    Kimi's beta_fast=beta_slow=1 and factor 32, routed_scaling_factor 2.827."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    special = _tokenizer(path)
    rope = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 64,
            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           n_routed_experts=24, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                           first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True,
                           q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                           v_head_dim=16, max_position_embeddings=2048, rope_parameters=rope,
                           eos_token_id=special["<|im_end|>"], bos_token_id=None,
                           pad_token_id=special["<|endoftext|>"])
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(cfg).eval()
    widen_(m, 6)
    m.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["model_type"], c["architectures"] = "kimi_k2", ["DeepseekV3ForCausalLM"]
    r = c.pop("rope_parameters")  # Hub-style keys, as Kimi-K2's config.json has them
    c["rope_theta"] = r.pop("rope_theta")
    c["rope_scaling"] = {"type": r.pop("rope_type"), **r}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


def build_glm4_moe(path: str) -> str:
    """GLM-4.5: head_dim given (not hidden / heads), half the head rotated, q/k norm, attention bias,
    two expert groups of which one is kept, one dense first layer, a multi-token-prediction layer
    after the last one and Hub-style RoPE keys, as the Hub checkpoints have them."""
    from safetensors.torch import load_file, save_file
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    special = _tokenizer(path)
    cfg = Glm4MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=2, topk_group=1,
                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
                        attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=1024,
                        eos_token_id=special["<|im_end|>"], bos_token_id=None,
                        pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Glm4MoeForCausalLM(cfg).eval()
    widen_(m, 7)
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    for k in [k for k in sd if k.startswith("model.layers.2.")]:
        sd[k.replace("model.layers.2.", "model.layers.3.")] = sd[k].clone()
    sd["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    # Hub-style keys, as GLM-4.5's config.json has them: rope_theta and partial_rotary_factor at the top.
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    r = c.pop("rope_parameters")
    c["rope_theta"], c["partial_rotary_factor"] = r["rope_theta"], r["partial_rotary_factor"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


GPT_OSS_WINDOW = 12  # sliding window of the tiny GPT-OSS: 3 blocks of 4 in the parity settings


def _gpt_oss_model(special: dict):
    """Sliding / full / sliding layers with a 12-token window, yarn RoPE without truncation (as
    GPT-OSS has it), attention bias, per-head sinks wide enough to take real weight, expert weights
    widened so the SwiGLU clamp at 7 cuts some values."""
    from transformers import GptOssConfig, GptOssForCausalLM

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                       num_experts_per_tok=3, sliding_window=GPT_OSS_WINDOW, max_position_embeddings=1024,
                       rope_parameters=rope, attention_bias=True, eos_token_id=special["<|im_end|>"],
                       pad_token_id=special["<|endoftext|>"], bos_token_id=None, tie_word_embeddings=False)
    assert cfg.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    torch.manual_seed(0)
    m = GptOssForCausalLM(cfg).eval()
    widen_(m, 8)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.copy_(1.5 * torch.randn(layer.self_attn.sinks.shape, generator=g))
            ex = layer.mlp.experts
            ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 4 * 64 ** -0.5)
            ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.5 * 64 ** -0.5)
            ex.gate_up_proj_bias.copy_(0.5 * torch.randn(ex.gate_up_proj_bias.shape, generator=g))
            ex.down_proj_bias.copy_(0.2 * torch.randn(ex.down_proj_bias.shape, generator=g))
    return m


def build_gpt_oss(path: str) -> str:
    """GPT-OSS in float32, the expert tensors as transformers writes them: gate_up_proj (E, D, 2F)
    with gate and up interleaved, down_proj (E, F, D), their biases."""
    m = _gpt_oss_model(_tokenizer(path))
    m.save_pretrained(path)
    return path


def build_gpt_oss_mxfp4(path: str) -> str:
    """GPT-OSS as it ships: experts in MXFP4 (`*_blocks` / `*_scales` in the Hub's layout,
    quantization_config quant_method mxfp4), everything else unquantized. Next to it, `<path>_oracle`
    holds the same model in float32 with the expert weights transformers' own MXFP4 unpacking gives
    for those bytes: the model transformers runs as the reference."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    special = _tokenizer(path)
    train_tokenizer(path + "_oracle", VOCAB)
    m = _gpt_oss_model(special)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(m.model.layers):
            ex = layer.mlp.experts
            for proj in ("gate_up_proj", "down_proj"):
                w = getattr(ex, proj)  # (E, in, out)
                blocks, scales = pack_mxfp4(w.transpose(1, 2))  # rows are output features
                packed[f"model.layers.{i}.mlp.experts.{proj}_blocks"] = blocks
                packed[f"model.layers.{i}.mlp.experts.{proj}_scales"] = scales
                w.copy_(convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32))
    m.save_pretrained(path + "_oracle")
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in sd.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    out.update(packed)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


def build_minimax_m2(path: str) -> str:
    """MiniMax-M2 as the Hub ships it: q/k norm over the whole projection, a quarter of each head
    rotated (Hub-style `rotary_dim` and `rope_theta` keys, and the Hub's other MiniMax-M2 fields),
    head_dim not hidden / heads, sigmoid routing with a correction bias wide enough to change which
    experts are chosen, per-expert w1/w2/w3 under `block_sparse_moe` and a multi-token-prediction
    layer after the last one."""
    from safetensors.torch import load_file, save_file
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    special = _tokenizer(path)
    cfg = MiniMaxM2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=8,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, num_local_experts=8,
                          num_experts_per_tok=3, max_position_embeddings=1024, eos_token_id=special["<|im_end|>"],
                          bos_token_id=None, pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    torch.manual_seed(0)
    m = MiniMaxM2ForCausalLM(cfg).eval()
    widen_(m, 10)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in m.model.layers:
            b = layer.mlp.e_score_correction_bias
            b.copy_(0.3 * torch.randn(b.shape, generator=g))
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in sd
    for k in [k for k in sd if k.startswith("model.layers.1.")]:
        sd[k.replace("model.layers.1.", "model.layers.2.")] = sd[k].clone()
    sd["model.layers.2.eh_proj.weight"] = torch.randn(64, 128)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    c.update(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
             shared_intermediate_size=0, attn_type_list=[1, 1], use_mtp=True, num_mtp_modules=1,
             mtp_transformer_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


# Llama-4: chunks of 8 tokens (prompts of the parity tests span several, and blocks of 4 split them).
LLAMA4_CHUNK = 8


def _llama4_text_config(special: dict):
    """Four layers covering each kind: NoPE every second layer (no_rope_layer_interval 2: layers 1
    and 3, full attention, temperature-tuned from position 3 on with floor_scale 4), RoPE layers with
    q/k L2 norm and chunked attention (0 and 2), MoE in layers 1 and 2 (top-1 of 4 experts and a
    shared expert), dense MLPs of another width in 0 and 3; llama3 RoPE scaling."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_local_experts=4, num_experts_per_tok=1, moe_layers=[1, 2], no_rope_layer_interval=2,
                            attention_chunk_size=LLAMA4_CHUNK, attn_temperature_tuning=True, floor_scale=4,
                            attn_scale=0.5, use_qk_norm=True, max_position_embeddings=1024,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64},
                            eos_token_id=special["<|im_end|>"], bos_token_id=None,
                            pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)


def build_llama4(path: str) -> str:
    """Llama4ForCausalLM (see _llama4_text_config), its config.json as the Hub's older ones are:
    no `layer_types` and an empty `no_rope_layers` (both derived from the other fields)."""
    from transformers import Llama4ForCausalLM

    special = _tokenizer(path)
    cfg = _llama4_text_config(special)
    assert cfg.no_rope_layers == [1, 0, 1, 0]
    assert cfg.layer_types == ["chunked_attention", "full_attention"] * 2
    torch.manual_seed(0)
    m = Llama4ForCausalLM(cfg).eval()
    widen_(m, 12)
    m.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.pop("layer_types")
    c["no_rope_layers"] = []
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


def build_llama4_multimodal(path: str) -> str:
    """Llama4ForConditionalGeneration: the same kind of language model (other weights) beside a
    tiny vision tower and projector, saved whole (`language_model.*`, `vision_model.*`,
    `multi_modal_projector.*`; config.json with text_config and vision_config)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration, Llama4VisionConfig

    special = _tokenizer(path)
    vision = Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                vision_output_dim=48, image_size=28, patch_size=14, projector_input_dim=48,
                                projector_output_dim=48)
    cfg = Llama4Config(text_config=_llama4_text_config(special).to_dict(), vision_config=vision.to_dict(),
                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    torch.manual_seed(0)
    m = Llama4ForConditionalGeneration(cfg).eval()
    widen_(m, 13)
    m.save_pretrained(path)
    return path


def _widen_qwen3_next(model: torch.nn.Module, seed: int) -> None:
    """widen_, then values suited to Qwen3-Next / Qwen3.5: the zero-centred norms (all but the
    linear attention's gated output norm) near 0, so that (1 + w) is near 1; per value head a decay
    exp(-A * softplus(a + dt_bias)) from nearly 1 to about 0.7 per token (A = exp(A_log) in
    [0.05, 2], softplus(dt_bias) in [0.01, 0.3]), so the recurrent state carries a long history."""
    widen_(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name and "visual" not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 2.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.expm1(torch.empty(p.shape).uniform_(0.01, 0.3, generator=g)).log())


def _qwen3_next_fields(special: dict) -> dict:
    """Four layers, three Gated DeltaNet then one gated full attention (the default 3:1 pattern),
    2 key heads repeated to 4 value heads, key dim twice the value dim; 6 experts, top 2, and a
    shared expert. Each builder sets RoPE (half of each attention head turns)."""
    return dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
                max_position_embeddings=1024, eos_token_id=special["<|im_end|>"], bos_token_id=None,
                pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)


def build_qwen3_next(path: str) -> str:
    """Qwen3NextForCausalLM (see _qwen3_next_fields) with a dense MLP in layer 2 (mlp_only_layers),
    per-expert tensors, and config.json as the Hub's is: no `layer_types` (derived from
    full_attention_interval), rope_theta and partial_rotary_factor at the top level; plus a
    multi-token-prediction tensor (`mtp.*`) to skip."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    special = _tokenizer(path)
    cfg = Qwen3NextConfig(**_qwen3_next_fields(special), intermediate_size=96, mlp_only_layers=[2],
                          norm_topk_prob=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    torch.manual_seed(0)
    m = Qwen3NextForCausalLM(cfg).eval()
    _widen_qwen3_next(m, 14)
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in sd
    sd["mtp.fc.weight"] = torch.randn(64, 128)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c.pop("layer_types")
    rope = c.pop("rope_parameters")
    c.update(full_attention_interval=4, rope_theta=rope["rope_theta"],
             partial_rotary_factor=rope["partial_rotary_factor"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    return path


def _qwen3_5_moe_text_config(special: dict):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_qwen3_next_fields(special),
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                                 "mrope_interleaved": True})


def build_qwen3_5_moe(path: str) -> str:
    """Qwen3_5MoeForCausalLM (see _qwen3_next_fields; an MoE in every layer), experts stored as
    fused 3-D tensors: gate_up_proj (E, 2F, D), down_proj (E, D, F)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeForCausalLM

    special = _tokenizer(path)
    cfg = _qwen3_5_moe_text_config(special)
    torch.manual_seed(0)
    m = Qwen3_5MoeForCausalLM(cfg).eval()
    _widen_qwen3_next(m, 15)
    m.save_pretrained(path)
    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {k: v for k, v in sd.items() if ".experts." not in k}
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts"
        E = cfg.num_experts
        out[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{pre}.{e}.gate_proj.weight"], sd[f"{pre}.{e}.up_proj.weight"]]) for e in range(E)])
        out[f"{pre}.down_proj"] = torch.stack([sd[f"{pre}.{e}.down_proj.weight"] for e in range(E)])
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def build_qwen3_5_moe_vl(path: str) -> str:
    """Qwen3_5MoeForConditionalGeneration: the same kind of language model (other weights) beside a
    tiny vision tower, saved whole (`model.language_model.*`, `model.visual.*`, `lm_head.*`;
    config.json with text_config and vision_config)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeVisionConfig

    special = _tokenizer(path)
    vision = Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                                    out_hidden_size=64, num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=_qwen3_5_moe_text_config(special).to_dict(), vision_config=vision.to_dict(),
                           image_token_id=VOCAB - 1, video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 3,
                           vision_end_token_id=VOCAB - 4, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    _widen_qwen3_next(m, 16)
    m.save_pretrained(path)
    return path


# DeepSeek-V4: groups of 2 (CSA) and 8 (HCA) tokens and a window of 8, so 20-60 token prompts span
# many groups and windows; the indexer keeps 4 entries. Its 8 heads make an all-zero score (every
# head's relu(q . k) zero: an exact tie that transformers breaks by position in its own tensor,
# which differs between a whole prompt and its chunks) rare enough for these prompts.
V4_FIELDS = dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
                 q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8,
                 compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 8},
                 layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
                              "compressed_sparse_attention"],
                 mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2, o_lora_rank=16,
                 index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=2, partial_rotary_factor=0.25,
                 max_position_embeddings=1024)


def build_deepseek_v4(path: str, **fields) -> str:
    """Widened, with the hyper-connections' scales near 1 and a random hash table (transformers
    initialises tid2eid to zeros: every token to expert 0). fields: overrides of V4_FIELDS."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    special = _tokenizer(path)
    cfg = DeepseekV4Config(vocab_size=VOCAB, **{**V4_FIELDS, **fields}, eos_token_id=special["<|im_end|>"],
                           bos_token_id=None, pad_token_id=special["<|endoftext|>"])
    torch.manual_seed(0)
    m = DeepseekV4ForCausalLM(cfg).eval()
    widen_(m, 7)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("scale"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(VOCAB)]))
    m.save_pretrained(path)
    return path


def build_deepseek_v4_mtp(path: str, copy: bool) -> str:
    """A DeepSeek-V4 checkpoint with its MTP layer as the Hub ships it (`mtp.0.*`: e_proj, h_proj,
    enorm, hnorm, norm, hc_head_{fn,base,scale} and a decoder layer's tensors; transformers drops
    them on save, so they are written afterwards). copy: a one-layer model (sliding attention,
    learned routing) with unit-RMS embedding rows and an MTP layer that is the model shifted by one
    token (e_proj = I, h_proj = 0, the layer, hyper head and norm copied): at position p it runs the
    model over tokens 1..p+1, so once the window no longer sees token 0 its drafts are the model's
    own next tokens. Otherwise the four-layer model and random projections and norms around a copy
    of layer 2 (sliding, learned routing): drafts nearly always rejected."""
    from safetensors.torch import load_file, save_file

    if copy:
        build_deepseek_v4(path, num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
        src = 0
    else:
        build_deepseek_v4(path)
        src = 2
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    D = V4_FIELDS["hidden_size"]
    if copy:
        e = sd["model.embed_tokens.weight"]
        sd["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    pre = f"model.layers.{src}."
    for k in [k for k in sd if k.startswith(pre)]:
        sd["mtp.0." + k[len(pre):]] = sd[k].clone()
    for part in ("fn", "base", "scale"):
        sd[f"mtp.0.hc_head_{part}"] = sd[f"model.hc_head.hc_{part}"].clone()
    g = torch.Generator().manual_seed(31)
    if copy:
        mtp = {"e_proj": torch.eye(D), "h_proj": torch.zeros(D, D), "enorm": torch.ones(D), "hnorm": torch.ones(D),
               "norm": sd["model.norm.weight"].clone()}
    else:
        mtp = {"e_proj": torch.randn(D, D, generator=g) * D ** -0.5, "h_proj": torch.randn(D, D, generator=g) * D ** -0.5,
               **{n: 1.0 + 0.1 * torch.randn(D, generator=g) for n in ("enorm", "hnorm", "norm")}}
    for name, t in mtp.items():
        sd[f"mtp.0.{name}.weight"] = t
    save_file({k: v.contiguous() for k, v in sd.items()}, f, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["num_nextn_predict_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return path


def _fp8_ue8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 with power-of-two scales (e8m0, as DeepSeek-V4 ships them): (q, scale)."""
    R, C = w.shape
    nr, nc = -(-R // block[0]), -(-C // block[1])
    pad = torch.zeros(nr * block[0], nc * block[1])
    pad[:R, :C] = w
    amax = pad.view(nr, block[0], nc, block[1]).abs().amax(dim=(1, 3)).clamp(min=2.0 ** -60)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    s = scale.repeat_interleave(block[0], 0)[:R].repeat_interleave(block[1], 1)[:, :C]
    return (w / s).to(torch.float8_e4m3fn), scale


def build_deepseek_v4_fp4(path: str) -> str:
    """DeepSeek-V4's released format, packed from the random checkpoint: linears of attention and the
    shared expert in block FP8 (blocks of 32) with ue8m0 scales (`<name>.scale`, float8_e8m0fnu),
    routed experts FP4 (int8, two e2m1 values a byte, low nibble first; a uint8 e8m0 scale per 32),
    the compressors, indexer head weights, router, norms, embedding and head as they are (as on the
    Hub). `<path>/reference` holds the exactly dequantized weights in float32 (the oracle)."""
    from safetensors.torch import load_file, save_file

    src = build_deepseek_v4_mtp(path + "_src", copy=False)  # with its MTP layer, packed the same way
    sd = load_file(os.path.join(src, "model.safetensors"))
    block = (32, 32)
    out, ref = {}, {}
    for k, v in sd.items():
        stem = k[: -len(".weight")] if k.endswith(".weight") else None
        dense = (stem is not None and v.dim() == 2 and (".attn.w" in k or ".shared_experts." in k
                                                         or k.startswith(("mtp.0.e_proj", "mtp.0.h_proj")))
                 and ".compressor." not in k)
        if ".experts." in k and ".shared_experts." not in k:
            blocks, scales = pack_mxfp4(v)
            out[k] = blocks.reshape(v.shape[0], v.shape[1] // 2).view(torch.int8)
            out[stem + ".scale"] = scales
            from moe_serve.kernels.grouped_gemm.mxfp4 import dequantize_mxfp4

            ref[k] = dequantize_mxfp4(blocks, scales, torch.float32)
        elif dense:
            q, scale = _fp8_ue8m0(v.float(), block)
            out[k], out[stem + ".scale"] = q, scale.to(torch.float8_e8m0fnu)
            s = scale.repeat_interleave(block[0], 0)[: v.shape[0]].repeat_interleave(block[1], 1)[:, : v.shape[1]]
            ref[k] = q.float() * s
        else:
            out[k] = ref[k] = v
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    os.makedirs(os.path.join(path, "reference"), exist_ok=True)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(path, "reference", "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    for d in (path, os.path.join(path, "reference")):
        for name in os.listdir(src):
            if name not in ("config.json", "model.safetensors"):
                os.symlink(os.path.join(src, name), os.path.join(d, name))
    with open(os.path.join(path, "reference", "config.json"), "w") as f:
        json.dump(cfg, f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


EXTRA_BUILDERS = {"qwen2_moe": build_qwen2_moe, "olmoe": build_olmoe, "kimi_k2": build_kimi_k2,
                  "glm4_moe": build_glm4_moe, "gpt_oss": build_gpt_oss, "gpt_oss_mxfp4": build_gpt_oss_mxfp4,
                  "minimax_m2": build_minimax_m2, "llama4": build_llama4, "llama4_mm": build_llama4_multimodal,
                  "qwen3_next": build_qwen3_next, "qwen3_5_moe": build_qwen3_5_moe,
                  "qwen3_5_moe_vl": build_qwen3_5_moe_vl, "deepseek_v32": build_deepseek_v32,
                  "glm_moe_dsa": build_glm_moe_dsa, "deepseek_v3_mtp_copy": build_deepseek_v3_mtp_copy,
                  "deepseek_v4": build_deepseek_v4, "deepseek_v4_fp4": build_deepseek_v4_fp4,
                  "deepseek_v4_mtp": functools.partial(build_deepseek_v4_mtp, copy=False),
                  "deepseek_v4_mtp_copy": functools.partial(build_deepseek_v4_mtp, copy=True)}


class LazyCheckpoints:
    """{name: path}, each checkpoint built on first use and kept for the session."""

    def __init__(self, root, builders: dict):
        self.root, self.builders, self.paths = root, builders, {}

    def __getitem__(self, name: str) -> str:
        if name not in self.paths:
            self.paths[name] = self.builders[name](str(self.root / name))
        return self.paths[name]
