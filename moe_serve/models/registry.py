"""Architecture name (config.json "architectures") -> model class, imported lazily."""
from __future__ import annotations

import importlib

_MODELS = {
    "MixtralForCausalLM": ("moe_serve.models.mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe_serve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV3ForCausalLM": ("moe_serve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe_serve.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "OlmoeForCausalLM": ("moe_serve.models.olmoe", "OlmoeForCausalLM"),
    "Glm4MoeForCausalLM": ("moe_serve.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("moe_serve.models.gpt_oss", "GptOssForCausalLM"),
    "MiniMaxM2ForCausalLM": ("moe_serve.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "Llama4ForCausalLM": ("moe_serve.models.llama4", "Llama4ForCausalLM"),
    # Llama-4's image-text checkpoints: their language model only (text_config, language_model.*).
    "Llama4ForConditionalGeneration": ("moe_serve.models.llama4", "Llama4ForConditionalGeneration"),
    # Kimi-K2 (model_type kimi_k2) is DeepSeek-V3's architecture; its config names either class.
    "KimiK2ForCausalLM": ("moe_serve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # DeepSeek Sparse Attention: DeepSeek-V3.2 and GLM-5.
    "DeepseekV32ForCausalLM": ("moe_serve.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("moe_serve.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "DeepseekV4ForCausalLM": ("moe_serve.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "Qwen3NextForCausalLM": ("moe_serve.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("moe_serve.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
    # Qwen3.5-MoE's image-text checkpoints: their language model only (text_config, model.language_model.*).
    "Qwen3_5MoeForConditionalGeneration": ("moe_serve.models.qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}


# Multimodal architectures served as their language model: config.json's `text_config` is the
# model's config (moe_serve/config.py text_config), the model class skips the other tensors.
_MULTIMODAL = {"Llama4ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def is_multimodal(architecture: str) -> bool:
    return architecture in _MULTIMODAL


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(_MODELS)}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)


def num_logical_experts(architecture: str, hf: dict) -> int:
    return hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
