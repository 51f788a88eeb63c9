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
    # Kimi-K2 (model_type kimi_k2) is DeepSeek-V3's architecture; its config names either class.
    "KimiK2ForCausalLM": ("moe_serve.models.deepseek_v3", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return list(_MODELS)


def model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {sorted(_MODELS)}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)


def num_logical_experts(architecture: str, hf: dict) -> int:
    return hf.get("num_local_experts") or hf.get("num_experts") or hf.get("n_routed_experts")
