"""Engine configuration: frozen dataclasses, every "auto" resolved before freezing.

Errors name the field and the value that is wrong.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def text_config(hf: dict) -> dict:
    """The language model's config of a multimodal checkpoint (config.json with a `text_config`
    beside its `vision_config`, as Llama-4's ...ForConditionalGeneration has it): `text_config`, with
    the top level's fields it lacks (dtype, quantization_config, architectures); other configs as
    they are."""
    sub = hf.get("text_config")
    if not isinstance(sub, dict):
        return hf
    return {**{k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}, **sub}


def parse_dtype(value: str | torch.dtype, hf_config: dict | None = None) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if value == "auto":
        hf_dtype = (hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype") or "float32"
        # float32 checkpoints are served in float32; half-precision ones in their own dtype.
        return _DTYPES.get(hf_dtype, torch.float32)
    if value not in _DTYPES:
        raise ValueError(f"dtype={value!r} is not one of 'auto', {sorted(set(_DTYPES))}")
    return _DTYPES[value]


@dataclass(frozen=True)
class ModelConfig:
    path: str
    hf: dict  # the checkpoint's config.json, as read (a multimodal one's language model: `text_config`)
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    load_format: str  # "safetensors" | "dummy"
    seed: int = 0
    quantization: str | None = None  # "fp8": quantize an unquantized checkpoint to block FP8 at load

    @property
    def weight_quantization(self) -> str | None:
        """How the weights are kept: the checkpoint's quant_method, or what --quantization asks for."""
        return (self.hf.get("quantization_config") or {}).get("quant_method") or self.quantization

    @staticmethod
    def from_path(path: str, dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                  load_format: str = "auto", seed: int = 0, quantization: str | None = None) -> "ModelConfig":
        from moe_serve.quantization import gguf_file

        cfg_file = os.path.join(path, "config.json")
        if (gguf := gguf_file.gguf_path(path)) is not None:  # a GGUF file: the config from its metadata
            cfg_file, hf = gguf, gguf_file.hf_config(gguf)
        elif not os.path.isfile(cfg_file):
            raise ValueError(f"model={path!r}: no config.json there (expected a Hugging Face checkpoint directory "
                             f"or a .gguf file)")
        else:
            with open(cfg_file) as f:
                hf = json.load(f)
        archs = hf.get("architectures") or []
        from moe_serve.models.registry import is_multimodal, supported_architectures

        arch = next((a for a in archs if a in supported_architectures()), None)
        if arch is None:
            raise ValueError(f"architectures={archs} in {cfg_file} is not supported; "
                             f"supported: {sorted(supported_architectures())}")
        if is_multimodal(arch):  # only its language model is served
            if not isinstance(hf.get("text_config"), dict):
                raise ValueError(f"architectures={archs} in {cfg_file}: {arch} needs a `text_config` object")
            hf = text_config(hf)
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format={load_format!r} is not one of 'auto', 'safetensors', 'dummy'")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization={quantization!r} is not one of: fp8")
        q = hf.get("quantization_config") or {}
        if q.get("quant_method") == "fp8":
            from moe_serve.quantization.fp8 import BlockFp8Config

            BlockFp8Config.from_hf(q)  # a malformed config fails here, naming the field
        elif q.get("quant_method") in ("compressed-tensors", "awq", "gptq"):
            from moe_serve.quantization import formats

            formats.validate(q)  # a packed int4/int8 scheme we do not serve fails here, naming it
        if q and quantization and q.get("quant_method") != quantization:
            raise ValueError(f"quantization={quantization!r}, but the checkpoint is already quantized "
                             f"(quant_method={q.get('quant_method')!r})")
        limit = int(hf.get("max_position_embeddings", 4096))
        if max_model_len is None:
            max_model_len = limit
        elif max_model_len < 1 or max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [1, max_position_embeddings={limit}]")
        return ModelConfig(path=path, hf=hf, architecture=arch, dtype=parse_dtype(dtype, hf),
                           max_model_len=max_model_len,
                           load_format="safetensors" if load_format == "auto" else load_format, seed=seed,
                           quantization=quantization)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (self.hf.get("eos_token_id"), self._generation_config().get("eos_token_id")):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(int(i) for i in src)
        return frozenset(ids)

    def _generation_config(self) -> dict:
        p = os.path.join(self.path, "generation_config.json")
        if os.path.isfile(p):
            with open(p) as f:
                return json.load(f)
        return {}


# --kv-cache-dtype (vLLM's flag): "auto" keeps K/V in the activation dtype; "fp8" is fp8_e4m3.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def parse_kv_cache_dtype(value: str) -> torch.dtype | None:
    """The FP8 type --kv-cache-dtype asks for, or None for "auto" (the activation dtype)."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={value!r} (--kv-cache-dtype) is not one of {list(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[value]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # 0: from the memory budget
    kv_cache_memory: int = 0  # bytes; 0: memory_fraction of what is free
    enable_prefix_caching: bool = True
    memory_fraction: float = 0.9
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2 (KV_CACHE_DTYPES)

    def __post_init__(self):
        parse_kv_cache_dtype(self.kv_cache_dtype)  # a bad name fails here, naming the flag


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64


@dataclass(frozen=True)
class ParallelConfig:
    rank: int = 0
    world_size: int = 1
    all2all_backend: str = "all_to_all"
    expert_placement: str | None = None
    enable_overlap: bool = False  # two micro-batches: one's dispatch/combine behind the other's compute
    overlap_min_tokens: int = 64  # below this many tokens (max over ranks) a step is not split
    expert_load_window: int = 100  # steps per expert-load window (0: no recorder)
    expert_load_record: str | None = None  # record from the start; written here at shutdown
    eplb: Any = None  # expert_parallel.rebalance.config.EplbConfig: rebalance experts while serving (None: off)
    replica_split: str = "balanced"  # how replicas share an expert's tokens (placement.ReplicaMap)


@dataclass(frozen=True)
class GraphConfig:
    """Decode steps padded to a ladder of batch sizes (`moe_serve.cuda_graph`) and one graph per size:
    on CUDA a captured CUDA graph, on the CPU a recording of the forward (moe_serve/cpu_graph.py, where
    runner/graphs.py `cpu_graphs_apply`). pad_decode None: pad where graphs are captured (without
    enforce_eager); True forces the padded path (eager where no graph is captured, for tests), False
    turns it off."""
    enforce_eager: bool = False
    max_capture_size: int | None = None  # None: max_num_seqs (capped at 512; on the CPU at 32)
    pad_decode: bool | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: torch.device
    moe_backend: str  # the experts backend (moe_serve/platform.py OPS["experts"])
    attention_backend: str
    extra: dict = field(default_factory=dict)
    graphs: GraphConfig = field(default_factory=GraphConfig)
    linear_backend: str = "torch"
    norm_backend: str = "torch"
    linear_attention_backend: str = "torch"
    memory_bandwidth_gbps: float | None = None  # the speed of light's bandwidth (moe_serve/speed_of_light.py)
    speed_of_light_window_s: float = 5.0
    speculative: object | None = None  # spec_decode.SpeculativeConfig, or None (off)
    # Prefill/decode disaggregation (moe_serve/disagg): "none" | "prefill" | "decode"; the transfer
    # engine that moves KV between instances; seconds a KV write may take before it is given up.
    disaggregation_mode: str = "none"
    disaggregation_transfer_backend: str = "nixl"
    disaggregation_timeout_s: float = 60.0
    # A request's tokens and logprobs bitwise the same whatever shares its steps (platform.INVARIANT)
    batch_invariant: bool = False
    kv_offload: object | None = None  # kv_offload.KVOffloadConfig: KV tiers below the device (None: off)
    # Packed int4 / int8 layers in our C kernels round their activations to int8 per weight group and
    # take integer products (cpu_ops/quant.c): True every packed layer, None (the default) those of a
    # GGUF file, as llama.cpp computes (prepare.int8_activations_on), False none
    cpu_int8_activations: bool | None = None

    @property
    def activation_dtype(self) -> torch.dtype:
        """What activations, norms, attention and the KV cache run in: the model's dtype, except a
        bfloat16 model on a CPU whose layers all run in our C kernels (experts, linear, attention,
        norms): float32 there, over GEMM weights and an embedding table kept in bfloat16 (the
        kernels widen them in registers). Those kernels compute in float32, so bfloat16 activations
        would only be converted around every op (and norms and attention fall back to torch ops)."""
        if self.device.type == "cpu" and self.model.dtype == torch.bfloat16 and self.moe_backend == "cpu_c" and \
                self.linear_backend == "cpu_c" and self.attention_backend == "cpu_c" and self.norm_backend == "cpu_c":
            return torch.float32
        return self.model.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What every K/V cache tensor holds (paged K and V, MLA latents, DSA index keys, DeepSeek-V4's
        rows): the FP8 type of --kv-cache-dtype, else the activation dtype. Linear-attention state
        keeps the activation dtype either way."""
        return parse_kv_cache_dtype(self.cache.kv_cache_dtype) or self.activation_dtype
