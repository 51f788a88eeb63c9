"""User-facing engine settings (the LLM(...) keywords and the CLI flags), resolved into EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from moe_serve import platform
from moe_serve.config import CacheConfig, EngineConfig, GraphConfig, ModelConfig, ParallelConfig, SchedulerConfig


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    load_format: str = "auto"
    quantization: str | None = None
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default: memory_fraction of what is free
    num_kv_blocks: int | None = None  # exact block count, overriding the memory budget
    memory_fraction: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto | fp8 | fp8_e4m3 | fp8_e5m2: what the KV cache stores
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    moe_backend: str = "auto"
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    norm_backend: str = "auto"
    linear_attention_backend: str = "auto"
    all2all_backend: str = "auto"
    expert_placement: str | None = None
    enable_overlap: bool = False
    overlap_min_tokens: int = 64
    expert_load_window: int = 100
    expert_load_record: str | None = None
    enable_eplb: bool = False
    num_redundant_experts: int | None = None  # None: the default (0) or --eplb-config's
    eplb_window_size: int | None = None
    eplb_step_interval: int | None = None
    eplb_config: str | None = None  # JSON object; its keys win over the three above
    replica_split: str = "balanced"  # balanced | round_robin (placement.ReplicaMap)
    show_progress: bool = True
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    max_capture_size: int | None = None  # largest decode batch captured as a graph (default max_num_seqs, <= 512)
    pad_decode: bool | None = None  # None: pad decode batches where graphs are captured; True/False forces
    memory_bandwidth: float | None = None  # GB/s for the decode speed of light (default: table or measured)
    speed_of_light_window: float = 5.0  # seconds of decode steps per speed-of-light window (0: every step)
    speculative_config: dict | str | None = None  # {"method": "ngram", "num_speculative_tokens": K, ...}
    disaggregation_mode: str = "none"  # prefill | decode (moe_serve/disagg)
    disaggregation_transfer_backend: str = "nixl"  # nixl | mooncake
    disaggregation_timeout: float = 60.0  # seconds a prompt's KV may take to arrive
    batch_invariant: bool = False  # outputs bitwise independent of batching (moe_serve/platform.py INVARIANT)
    kv_offloading_size: float | None = None  # GB of host memory for evicted KV blocks (moe_serve/kv_offload)
    kv_offloading_disk: str | None = None  # a directory for evicted KV blocks below the host tier
    kv_offloading_disk_size: float | None = None  # GB the disk tier may take
    # packed layers' calls in our C kernels over int8 activations: None (default) for GGUF files, as llama.cpp
    cpu_int8_activations: bool | None = None

    def create_engine_config(self, rank: int = 0, world_size: int = 1) -> EngineConfig:
        mc = ModelConfig.from_path(self.model, self.dtype, self.max_model_len, self.load_format, self.seed,
                                   self.quantization)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        from moe_serve.config import parse_kv_cache_dtype

        parse_kv_cache_dtype(self.kv_cache_dtype)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.overlap_min_tokens < 0:
            raise ValueError(f"overlap_min_tokens={self.overlap_min_tokens} must be >= 0")
        if self.expert_load_window < 0:
            raise ValueError(f"expert_load_window={self.expert_load_window} must be >= 0")
        if self.max_capture_size is not None and self.max_capture_size < 1:
            raise ValueError(f"max_capture_size={self.max_capture_size} must be >= 1")
        if self.memory_bandwidth is not None and not self.memory_bandwidth > 0:
            raise ValueError(f"memory_bandwidth={self.memory_bandwidth} GB/s must be positive")
        if not self.speed_of_light_window >= 0:
            raise ValueError(f"speed_of_light_window={self.speed_of_light_window} s must be >= 0")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        from expert_parallel.placement.map import SPLITS

        if self.replica_split not in SPLITS:
            raise ValueError(f"replica_split={self.replica_split!r} must be one of {list(SPLITS)}")
        from expert_parallel.rebalance.config import resolve_eplb

        eplb = resolve_eplb(self.enable_eplb, self.num_redundant_experts, self.eplb_window_size,
                            self.eplb_step_interval, self.eplb_config)
        if eplb is not None and mc.weight_quantization:
            raise ValueError(f"--enable-eplb with quantized weights ({mc.weight_quantization}) is not supported yet: "
                             "rebalancing moves unquantized expert weights only")
        from moe_serve.disagg.transfer import ENGINES

        if self.disaggregation_mode not in ("none", "prefill", "decode"):
            raise ValueError(f"disaggregation_mode={self.disaggregation_mode!r} must be none, prefill or decode")
        if self.disaggregation_transfer_backend not in ENGINES:
            raise ValueError(f"disaggregation_transfer_backend={self.disaggregation_transfer_backend!r} must be one "
                             f"of {', '.join(ENGINES)}")
        if not self.disaggregation_timeout > 0:
            raise ValueError(f"disaggregation_timeout={self.disaggregation_timeout} must be > 0")
        from moe_serve.spec_decode import SpeculativeConfig

        speculative = SpeculativeConfig.parse(self.speculative_config)
        from moe_serve.kv_offload import resolve_kv_offload

        kv_offload = resolve_kv_offload(self.kv_offloading_size, self.kv_offloading_disk,
                                        self.kv_offloading_disk_size, self.enable_prefix_caching)
        choice = platform.choose(self.device, self.moe_backend, self.attention_backend, self.all2all_backend,
                                 world_size, mc.hf.get("hidden_size"), self.linear_backend, self.norm_backend,
                                 self.linear_attention_backend, self.batch_invariant)
        if self.cpu_int8_activations:
            if choice.device.type != "cpu" or (choice.moe_backend, choice.linear_backend) != ("cpu_c", "cpu_c"):
                raise ValueError(f"--cpu-int8-activations rounds the activations of our C kernels' packed layers: it "
                                 f"needs a CPU with both the experts and the linear layers in cpu_c (here: device "
                                 f"{choice.device}, --moe-backend {choice.moe_backend}, --linear-backend "
                                 f"{choice.linear_backend})")
            if self.batch_invariant:
                raise ValueError("--cpu-int8-activations with --batch-invariant is not supported: the invariant "
                                 "kernels take float activations")

        return EngineConfig(
            model=mc,
            cache=CacheConfig(self.block_size, self.num_kv_blocks or 0, self.kv_cache_memory or 0,
                              self.enable_prefix_caching, self.memory_fraction, self.kv_cache_dtype),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs),
            parallel=ParallelConfig(rank, world_size, choice.all2all_backend, self.expert_placement,
                                    self.enable_overlap, self.overlap_min_tokens, self.expert_load_window,
                                    self.expert_load_record, eplb=eplb, replica_split=self.replica_split),
            device=choice.device,
            moe_backend=choice.moe_backend,
            attention_backend=choice.attention_backend,
            linear_backend=choice.linear_backend,
            norm_backend=choice.norm_backend,
            linear_attention_backend=choice.linear_attention_backend,
            graphs=GraphConfig(self.enforce_eager, self.max_capture_size, self.pad_decode),
            memory_bandwidth_gbps=self.memory_bandwidth,
            speed_of_light_window_s=self.speed_of_light_window,
            speculative=speculative,
            disaggregation_mode=self.disaggregation_mode,
            disaggregation_transfer_backend=self.disaggregation_transfer_backend,
            disaggregation_timeout_s=self.disaggregation_timeout,
            batch_invariant=self.batch_invariant,
            kv_offload=kv_offload,
            cpu_int8_activations=self.cpu_int8_activations,
        )

    # --- CLI ------------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
        g = p.add_argument_group("engine")
        g.add_argument("--model", required=model_required, default=None,
                       help="Hugging Face checkpoint directory, or a GGUF file (or a directory holding one) "
                            "(default: the built-in default model)")
        g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
        g.add_argument("--quantization", default=None, choices=["fp8"],
                       help="fp8: quantize an unquantized checkpoint's linear and expert weights to block FP8 "
                            "(128x128) while loading (block-FP8 checkpoints load as FP8 without it)")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
        g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV block count (overrides memory)")
        g.add_argument("--memory-fraction", type=float, default=0.9)
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
                       help="what the KV cache stores: auto (the activation dtype) | fp8 (= fp8_e4m3) | fp8_e5m2: one "
                            "byte a value (about 2x a bf16 cache's tokens), scaled by the checkpoint's k/v_scale if any")
        g.add_argument("--max-num-batched-tokens", type=int, default=2048)
        g.add_argument("--max-num-seqs", type=int, default=64)
        names = "auto (cpu_c on CPUs where our C kernels build, else torch; triton on CUDA) | torch (torch ops only)"
        g.add_argument("--moe-backend", default="auto", choices=["auto", *platform.OPS["experts"]],
                       help="the routed experts' kernels: " + names + " | cpu_c | triton")
        g.add_argument("--attention-backend", default="auto", choices=["auto", *platform.OPS["attention"], *platform.ALIASES],
                       help="paged attention: " + names + " | cpu_c | triton")
        g.add_argument("--linear-backend", default="auto", choices=["auto", *platform.OPS["linear"]],
                       help="linear layers: " + names + " | cpu_c | triton (block FP8 in Triton; dense in torch)")
        g.add_argument("--norm-backend", default="auto", choices=["auto", *platform.OPS["norm"]],
                       help="RMSNorm and the fused q/k norm + RoPE: " + names + " | cpu_c")
        g.add_argument("--linear-attention-backend", default="auto",
                       choices=["auto", *platform.OPS["linear_attention"]],
                       help="linear attention (Gated DeltaNet: short convolution and delta rule): auto (triton "
                            "on CUDA, cpu_c on CPUs where the C kernels build) | torch (torch ops only) | cpu_c "
                            "(decode steps in C) | triton")
        g.add_argument("--all2all-backend", default="auto",
                       choices=["auto", "all_to_all", "allgather", "deepep", "reference"])
        g.add_argument("--expert-placement", default=None, help="placement JSON from `moe-serve placement tune`")
        g.add_argument("--enable-overlap", action="store_true",
                       help="split each step into two micro-batches to hide dispatch/combine behind compute")
        g.add_argument("--overlap-min-tokens", type=int, default=64,
                       help="steps with fewer tokens (on every rank) run unsplit")
        g.add_argument("--expert-load-record", default=None,
                       help="record expert load per window and write it to this JSON file at shutdown")
        g.add_argument("--expert-load-window", type=int, default=100, help="steps per expert-load window")
        g.add_argument("--enable-eplb", action="store_true",
                       help="rebalance experts while serving: re-tune the placement from recent load and move weights")
        g.add_argument("--num-redundant-experts", type=int, default=None,
                       help="spare expert slots beyond one per logical expert (with --enable-eplb; default 0)")
        g.add_argument("--eplb-window-size", type=int, default=None,
                       help="steps of recorded expert load each rebalance is tuned on (default 1000)")
        g.add_argument("--eplb-step-interval", type=int, default=None,
                       help="model steps between rebalances (default 3000)")
        g.add_argument("--eplb-config", default=None,
                       help='the EPLB settings as JSON: {"window_size": S, "step_interval": K, '
                            '"num_redundant_experts": N}')
        g.add_argument("--replica-split", default="balanced", choices=["balanced", "round_robin"],
                       help="how an expert's replicas share its tokens: balanced (from each step's counts, evening "
                            "out the ranks; default) or round_robin (evenly)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no CUDA graphs: decode steps run eagerly and are not padded")
        g.add_argument("--max-capture-size", type=int, default=None,
                       help="largest decode batch captured as a CUDA graph (default: max-num-seqs, at most 512)")
        g.add_argument("--pad-decode", action="store_const", const=True, default=None,
                       help="pad decode batches to the capture sizes even without CUDA graphs (testing; slower on CPU)")
        g.add_argument("--memory-bandwidth", type=float, default=None,
                       help="memory bandwidth in GB/s for the decode speed of light in /metrics and the logs "
                            "(default: the datasheet figure of a known GPU, else a read stream measured at start-up, kept a day for the machine)")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding as JSON: {"method": "ngram", "num_speculative_tokens": K, '
                            '"prompt_lookup_min": a, "prompt_lookup_max": b} (drafts from the context\'s own '
                            'n-grams, verified in one forward; greedy output is unchanged)')
        _add_kv_movement_args(g)
        g.add_argument("--cpu-int8-activations", action=argparse.BooleanOptionalAction, default=None,
                       help="on a CPU, packed int4 / int8 layers (GGUF, GPTQ, AWQ, compressed-tensors) in our C "
                            "kernels round their activations to int8 per weight group and take integer products (VNNI "
                            "where the CPU has it): faster, not the float numerics. Default: on for GGUF files (llama.cpp's "
                            "own numerics) where the kernels have vector code for it (AVX-512, AVX2), off for the "
                            "other formats; --no-cpu-int8-activations: float everywhere")
        g.add_argument("--batch-invariant", action="store_true",
                       help="a request's tokens and logprobs bitwise the same whatever shares its steps (batch "
                            "size, prefill chunking, preemption, other requests): kernels with one fixed reduction "
                            "order per output (slower; refused with backends that have no such form)")
        g.add_argument("--speed-of-light-window", type=float, default=5.0,
                       help="seconds of decode steps over which the speed-of-light fraction is taken and logged")

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, model: str) -> "EngineArgs":
        kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
        kw["model"] = model
        return cls(**kw)


def _add_kv_movement_args(g) -> None:
    """The flags that move KV between instances (disaggregation) and below the device (KV tiers)."""
    g.add_argument("--disaggregation-mode", default="none", choices=["none", "prefill", "decode"],
                   help="prefill: compute prompts whose KV a decode instance asked for and write it there; "
                        "decode: take requests, have a prefill instance compute their prompts "
                        "(kv_transfer_params.prefill_url, set by `moe-serve router --prefill ... --decode ...`) "
                        "and decode. Both sides must serve the same model, dtype and block size")
    g.add_argument("--disaggregation-transfer-backend", default="nixl", choices=["nixl", "mooncake"],
                   help="the transfer engine that moves KV between instances (nixl: NIXL over UCX; mooncake: "
                        "Mooncake's transfer engine)")
    g.add_argument("--disaggregation-timeout", type=float, default=60.0,
                   help="seconds a prompt's KV may take to arrive from the prefill instance before this "
                        "instance computes the prompt itself")
    g.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GB of host memory that keeps KV blocks evicted from the prefix cache; a prompt whose "
                        "prefix is found there has it copied back instead of recomputed (on a CPU the host "
                        "tier is the same memory: use the disk tier)")
    g.add_argument("--kv-offloading-disk", default=None,
                   help="a directory for a disk tier below the host tier (needs --kv-offloading-disk-size); "
                        "a full or failing disk only makes prompts recompute")
    g.add_argument("--kv-offloading-disk-size", type=float, default=None,
                   help="GB the disk tier may take under --kv-offloading-disk (least recently used out first)")
