"""Upcycling the dense SmolLM2 into a Mixtral MoE: routers calibrated on the dense model's MLP
inputs, each MLP copied into noisy experts, the config / generation-config contents and the
safetensors writer shared by the MoE build and the dense reference.
"""
from __future__ import annotations

import torch

from .gguf_source import MAX_POSITION_EMBEDDINGS, DenseCheckpoint, GGUFTokenizer, LlamaShape
from .self_check import CheckConfig, CheckModel

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
