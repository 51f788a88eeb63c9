"""Compile every Triton kernel configuration the engine can choose, ahead of time, for NVIDIA GPUs.

    python -m moe_serve.kernels.aot_check --arch 90 100      # sm_90 (H100/H200) and sm_100 (B200/GB200)
    python -m moe_serve.kernels.aot_check --only attn        # kernels or configurations whose name has "attn"
    python -m moe_serve.kernels.aot_check --list             # what would be compiled, without compiling
    python -m moe_serve.kernels.aot_check --quick --dtype bf16   # one per kernel / dtype / code path (the test suite's)
    python -m moe_serve.kernels.aot_check --kv-cache-dtype fp8_e4m3 --only kv=   # FP8 KV caches' variants only

No GPU is needed: `triton.compile` takes an `ASTSource` and a `GPUTarget`, and Triton's bundled
ptxas turns the PTX into a cubin for the named architecture. What is compiled is what the backends
launch: the variants each Triton backend declares (TritonExperts' configs and launches,
TritonAttention.steps, TritonLinear.ROW_TILES: the same calls the start-up warm-up makes) are
recorded from the backend's own launch, run for stand-in layers of a model's shapes on "meta"
tensors (moe_serve/kernels/specialization.py), so each configuration's constexprs,
launch options, argument types and Triton's marks on the arguments (an integer equal to 1 becomes a
constant; integers divisible by 16 and 16-byte-aligned pointers are marked divisible, which decides
whether loads vectorise) are those of the real launch. A compile without those marks is another
variant, with more registers (it made the decode gate/up tile look like spilling 4.7 KB; as
launched it spills nothing). The configurations, per model of MODELS (plus --model files) and
dtype it is served in (bf16 / fp16; fp32 too for the small fp32 test checkpoint and --model files):
  - grouped GEMM: each default config (decode / middle / prefill) and each entry of each tuned file
    in moe_serve/kernels/grouped_gemm/configs/, gated (gate/up) and ungated (down), with block-FP8 weights and
    W8A8 in bf16; the masked grouped GEMM (DeepEP's low-latency layout) likewise; the models'
    expert variants (GPT-OSS: biases and the clamped SwiGLU; DeepSeek-V4: the limited SwiGLU),
    dense, block FP8 and W8A8 in bf16, and, where the model ships them, MXFP4 weights read packed
    (in bf16 the decode tile with every activation, with and without biases, too);
  - top-k sum, KV / latent writes, paged attention (decode with and without split-K, prefill; the
    sparse mode of DSA models) and the split reduce; the DSA indexer's scores; the writes, attention
    and indexer each also over FP8 caches (--kv-cache-dtype: float8_e4m3fn and float8_e5m2, "kv=" in
    the line; the quick set: one per FP8 type and attention path, DSA's sparse one apart);
    FP8 linear layers and activation quantization;
  - packed int4 / int8 weights (PACKED_MODELS' experts, a 2048 x 7168 linear layer): the packed
    grouped GEMM per config, bits and group size (128, 32, per channel), the packed linear per row
    tile, bias or not, and W8A8 (per-channel int8 weights, int8 activations) with its per-token
    quantizer in bf16 ("packed" in every line's users: --only packed);
  - linear attention (Gated DeltaNet) where the model has it: the convolution (decode and prefill
    forms), the recurrent decode kernel and the chunked prefill pair, with the recurrent state
    cached in float32 and in the model dtype.
Identical configurations (same kernel, argument types and marks, constexprs, launch options) are
compiled once. tests/kernels/test_aot_check.py checks that an engine run's launches are all among them.

Each line gives registers per thread and spill-store bytes (ptxas -v: the numbers a GPU later
reports as n_regs / n_spills) and the shared memory in the compiled kernel's metadata (`shared`);
a kernel needing more shared memory than the architecture has counts as failed, since it would
fail at its first launch. The last line is
    aot: N configurations compiled for sm_90, sm_100; F failed
where N counts configurations that compiled for every listed architecture and F those that failed
for at least one; the exit status is 1 if F > 0. A grouped-GEMM configuration (default or tuned) or
a decode configuration spilling more than --max-spill bytes per thread (64) on any architecture
counts as failed, named on a SPILL line; the line before the compile time counts every spilling
configuration and names the worst. Compiles run in a pool of --jobs processes, each
into a fresh Triton cache (so nothing is a cache hit).
"""
from __future__ import annotations

import os

if __name__ in ("__main__", "__mp_main__"):  # the command and its compile workers, not an importer
    # Compiled kernels, not the interpreter: @triton.jit reads this when the kernel modules load.
    os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
import multiprocessing  # noqa: E402

import torch  # noqa: E402

DTYPE_SIG = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES = tuple(DTYPE_SIG)
# --kv-cache-dtype fp8_e4m3 / fp8_e5m2: K/V, latent and index-key caches of these types, a variant of
# each cache-reading or -writing kernel (the pointer's element type), named "kv=<type>" in its line.
KV_FP8 = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# --kv-cache-dtype's values (vLLM's names; "auto": the caches in the activation dtype) -> cache dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Shared memory a block may use (the opt-in maximum): 227 KiB on both Hopper and Blackwell.
MAX_SHARED = {90: 232448, 100: 232448}
# The kernels, as "module:function".
from moe_serve.kernels.specialization import (ATTN, FP8_LINEAR, GEMM, INDEX, INT8_QUANT, LINEAR,  # noqa: E402,F401
                                              LINEAR_ATTENTION, MASKED, PACKED_GEMM, PACKED_LINEAR, QUANT, REDUCE,
                                              TOPK, WRITE)
from moe_serve.kernels import specialization  # noqa: E402
# Spill-store bytes per thread above which a grouped-GEMM or decode configuration fails the check
# (--max-spill): a few words spilled around the epilogue cost nothing measurable, a register file's
# worth of accumulator spilled in the main loop does.
DEFAULT_MAX_SPILL = 64


@dataclass(frozen=True)
class ModelShape:
    """What the kernel configurations depend on: hidden size D, top-k K of E experts of width F, and
    the attention heads (GQA: N query heads over G kv heads of H (values Hv); MLA: N heads over a
    latent of L + R). Sizes matter beyond the tiles: Triton marks each integer argument divisible
    by 16 or not, and compiles a variant per mark."""
    name: str
    D: int
    K: int
    N: int
    E: int = 8
    F: int = 0
    G: int = 1
    H: int = 0
    Hv: int = 0
    L: int = 0
    R: int = 0
    # The engine serves a checkpoint in its own dtype (dtype="auto") or the one asked for. These
    # checkpoints are bf16, and half precision is the only sensible request at their size; fp32 is
    # what the small float32 test checkpoints are served in (see ModelConfig / parse_dtype).
    dtypes: tuple = (torch.bfloat16, torch.float16)
    sinks: bool = False  # GPT-OSS: attention sinks in every layer, sliding-window and full layers
    chunked: bool = False  # Llama-4: chunked-attention layers beside full ones
    # Linear-attention (Gated DeltaNet) layers, where the model has them (Qwen3-Next): LH value heads
    # (q/k heads repeated to them) of key / value dims LK / LV, a short convolution of LC channels
    # and width LW.
    LH: int = 0
    LK: int = 0
    LV: int = 0
    LC: int = 0
    LW: int = 0
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): an indexer of IH heads of ID selecting
    # index_topk tokens for the MLA.
    IH: int = 0
    ID: int = 0
    # The experts' variant: the activation ("silu"; "clamped": GPT-OSS's ClampedSwiGLU; "limited":
    # DeepSeek-V4's LimitedSwiGLU), per-expert biases, and MXFP4 weights (GPT-OSS, DeepSeek-V4's
    # fp4 experts) beside the dense ones.
    act: str = "silu"
    bias: bool = False
    mxfp4: bool = False
    # False: only the experts' kernels are compiled (attention that is not the Triton paged kernel's).
    attention: bool = True

    @property
    def variant(self) -> bool:
        """Experts with biases or another activation than SwiGLU."""
        return self.act != "silu" or self.bias

    @property
    def mla(self) -> bool:
        return self.L > 0

    @property
    def dsa(self) -> bool:
        return self.IH > 0

    @property
    def linear_attention(self) -> bool:
        return self.LH > 0


MODELS = (
    ModelShape("qwen3-30b-a3b", D=2048, K=8, E=128, F=768, N=32, G=4, H=128, Hv=128),
    ModelShape("qwen3-235b-a22b", D=4096, K=8, E=128, F=1536, N=64, G=4, H=128, Hv=128),
    ModelShape("mixtral-8x7b", D=4096, K=2, E=8, F=14336, N=32, G=8, H=128, Hv=128),
    ModelShape("deepseek-v3", D=7168, K=8, E=256, F=2048, N=128, L=512, R=64),
    ModelShape("deepseek-v2-lite", D=2048, K=6, E=64, F=1408, N=16, L=512, R=64),
    ModelShape("deepseek-v3.2", D=7168, K=8, E=256, F=2048, N=128, L=512, R=64, IH=64, ID=128),
    ModelShape("glm-5", D=6144, K=8, E=256, F=2048, N=64, L=512, R=64, IH=32, ID=128),
    ModelShape("gpt-oss-120b", D=2880, K=4, E=128, F=2880, N=64, G=8, H=64, Hv=64, sinks=True, act="clamped",
               bias=True, mxfp4=True),
    ModelShape("llama-4-scout", D=5120, K=1, E=16, F=8192, N=40, G=8, H=128, Hv=128, chunked=True),
    # 3 of 4 layers Gated DeltaNet (16 key heads repeated to 32 value heads), the others gated GQA
    ModelShape("qwen3-next-80b-a3b", D=2048, K=10, E=512, F=512, N=16, G=2, H=256, Hv=256,
               LH=32, LK=128, LV=128, LC=2 * 16 * 128 + 32 * 128, LW=4),
    # its experts only (FP4, limited SwiGLU; its attention has no Triton kernel here)
    ModelShape("deepseek-v4", D=4096, K=6, E=256, F=2048, N=64, act="limited", mxfp4=True, attention=False),
    # the built-in random test checkpoint (moe_serve/default_model/tiny.py)
    ModelShape("moe-tiny", D=64, K=2, E=4, F=128, N=4, G=2, H=16, Hv=16, dtypes=DTYPES),
)
# The engine's KV block size (EngineArgs.block_size's default): attention launches pass it as an
# integer Triton marks, so the probes use the same.
ENGINE_BLOCK_SIZE = 16


def model_from_hf_config(path: str) -> ModelShape:
    """The shape of a Hugging Face config.json (Qwen3-MoE / Mixtral GQA, or DeepSeek MLA; Llama-4's
    chunked layers where attention_chunk_size is set)."""
    from moe_serve.config import text_config

    with open(path) as f:
        hf = text_config(json.load(f))  # a multimodal checkpoint's: its language model's
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    K = hf.get("num_experts_per_tok", 2)
    E = next((hf[k] for k in ("n_routed_experts", "num_experts", "num_local_experts") if hf.get(k)), 8)
    F = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    dtypes = DTYPES  # whatever the file says, --model compiles every dtype
    q = hf.get("quantization_config") or {}
    experts = {}
    if hf.get("model_type") == "gpt_oss":
        experts = dict(act="clamped", bias=True, mxfp4=q.get("quant_method") == "mxfp4")
    elif hf.get("model_type") == "deepseek_v4":
        experts = dict(act="limited" if hf.get("swiglu_limit") is not None else "silu", attention=False,
                       mxfp4=q.get("quant_method") == "fp8" and (q.get("expert_dtype") or hf.get("expert_dtype")) == "fp4")
    if "kv_lora_rank" in hf:
        return ModelShape(name, D=D, K=K, E=E, F=F, N=N, L=hf["kv_lora_rank"], R=hf["qk_rope_head_dim"],
                          dtypes=dtypes, IH=hf.get("index_n_heads", 0) if hf.get("index_topk") else 0,
                          ID=hf.get("index_head_dim", 0) if hf.get("index_topk") else 0, **experts)
    H = hf.get("head_dim") or D // N
    linear = {}
    if hf.get("linear_num_value_heads"):  # Qwen3-Next / Qwen3.5: Gated DeltaNet layers
        LH, LK, LV = hf["linear_num_value_heads"], hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        linear = dict(LH=LH, LK=LK, LV=LV, LC=2 * hf["linear_num_key_heads"] * LK + LH * LV,
                      LW=hf["linear_conv_kernel_dim"])
    return ModelShape(name, D=D, K=K, E=E, F=F, N=N, G=hf.get("num_key_value_heads", N), H=H, Hv=H, dtypes=dtypes,
                      sinks=hf.get("model_type") == "gpt_oss", chunked=bool(hf.get("attention_chunk_size")), **linear,
                      **experts)


@dataclass
class Job:
    """One configuration: kernel ("module:function"), the type of each runtime argument and Triton's
    mark on it ("1": specialised to the constant 1, "D": divisible by 16 / 16-byte aligned, ""), the
    constexprs, launch options, and the users that chose it. Built from a recorded launch
    (moe_serve/kernels/specialization.py), so it is the variant the launch compiles on a GPU."""
    kernel: str
    types: dict
    constexprs: dict
    options: dict
    marks: dict = field(default_factory=dict)
    users: list = field(default_factory=list)

    @property
    def short(self) -> str:
        return self.kernel.split(":")[1].strip("_").replace("_kernel", "")

    def key(self) -> tuple:
        return (self.kernel, tuple(sorted(self.types.items())), tuple(sorted(self.marks.items())),
                tuple(sorted(self.constexprs.items())), tuple(sorted(self.options.items())))

    @property
    def kv_fp8(self) -> str | None:
        """The FP8 type of the KV cache this attention / cache-write / indexer configuration reads or
        writes ("fp8e4nv", "fp8e5"); None for any other cache or kernel."""
        if self.kernel not in (ATTN, WRITE, INDEX):
            return None
        kv = self.types.get("k_ptr") or self.types.get("cache_ptr") or ""
        return kv.lstrip("*") if kv.startswith("*fp8") else None

    @property
    def dtype(self) -> str:
        """The activation / cache dtype of this configuration (bf16, fp16 or fp32): the first such
        pointer's element type, integer ones passed over (packed codes, int8 activations)."""
        for arg in ("a_ptr", "q_ptr", "y_ptr", "src_ptr", "out_ptr", "k_ptr", "x_ptr", "c_ptr"):
            if arg in self.types and not self.types[arg].lstrip("*").startswith(("i", "u")):
                return self.types[arg].lstrip("*")
        return "?"

    def describe(self) -> str:
        hidden = {"UPCAST", "PREC"}
        cx = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in self.constexprs.items()
                      if k not in hidden)
        if "ids_ptr" in self.types:
            cx += f" ids={self.types['ids_ptr'].lstrip('*')}"
        if self.kv_fp8:
            cx += f" kv={self.kv_fp8}"
        # Runtime integers that are neither 1 nor divisible by 16 (model sizes such as a 48-wide
        # expert, unaligned views): the variant differs from the aligned one of the same tiles.
        odd = [n for n, m in self.marks.items() if m == "" and self.types[n] in ("i32", "i64")
               and n not in self.unspecialised]
        if odd:
            cx += " odd=" + ",".join(odd)
        return f"{self.short} {cx} w{self.options.get('num_warps', 4)} s{self.options.get('num_stages', 3)}"

    @property
    def unspecialised(self) -> frozenset:
        import importlib

        module, name = self.kernel.split(":")
        return specialization.do_not_specialize(getattr(importlib.import_module(module), name))


def job_from_launch(launch: "specialization.Launch") -> Job:
    """The configuration a recorded launch compiles (UPCAST off: compiled code never upcasts)."""
    constexprs = dict(launch.constexprs)
    if "UPCAST" in constexprs:
        constexprs["UPCAST"] = False
    return Job(launch.kernel, launch.types, constexprs, dict(launch.options), launch.marks)


def _split_options(launch: dict) -> tuple[dict, dict]:
    launch = dict(launch)
    options = {k: launch.pop(k) for k in ("num_warps", "num_stages") if k in launch}
    if "UPCAST" in launch:
        launch["UPCAST"] = False  # compiled code never upcasts (that is for the interpreter)
    return launch, options


# ---- probes: the launchers run on meta tensors under specialization.record --------------------------

_META = torch.device("meta")



def _probe(call) -> list:
    """The launches `call` makes, as the compiled engine makes them: the activation quantizer, which
    runs its torch reference under the interpreter, takes its kernel path here too (nothing runs)."""
    from moe_serve.kernels import fp8_quant

    interpreted, fp8_quant._INTERPRETED = fp8_quant._INTERPRETED, False
    try:
        with specialization.record() as launches:
            call()
    finally:
        fp8_quant._INTERPRETED = interpreted
    return launches


# What is compiled is what the backends' own launchers launch (attention/backends TritonAttention,
# moe_serve/kernels/grouped_gemm TritonExperts, moe_serve/kernels/linear TritonLinear: the same calls the start-up
# warm-up makes, moe_serve/kernel_warmup.py), for stand-in layers of each model's shapes: the
# engine's own layer classes, built on the "meta" device.


def _activation(m: ModelShape):
    """The expert activation object the model's layers pass (its constants are runtime arguments)."""
    from moe_serve.kernels.grouped_gemm.reference import ClampedSwiGLU

    if m.act == "clamped":
        return ClampedSwiGLU(1.702, 7.0)
    if m.act == "limited":
        from moe_serve.layers.experts import LimitedSwiGLU

        return LimitedSwiGLU(10.0)
    return "silu"


def _moe_stand_in(m: ModelShape, dt, weights: str = "plain", E: int | None = None, variant: bool = False):
    """An MoE layer's experts and router top-k as the backend reads them: weights "plain" (dt),
    "fp8" (block FP8, weight-only), "w8a8" or "mxfp4" (packed, as GPT-OSS and DeepSeek-V4 ship
    them); SwiGLU without biases unless `variant` (always for MXFP4): m's activation and biases."""
    from types import SimpleNamespace

    from expert_parallel.runtime.layer import GroupedExperts

    E = E or m.E
    kw = dict(bias=m.bias, activation=_activation(m)) if variant or weights == "mxfp4" else {}
    with torch.device(_META):
        if weights == "mxfp4":
            from moe_serve.layers.experts import Mxfp4Experts

            return SimpleNamespace(experts=Mxfp4Experts(E, m.D, m.F, list(range(E)), dt, **kw),
                                   gate=SimpleNamespace(top_k=m.K))
        experts = GroupedExperts(E, m.D, m.F, list(range(E)), dt, **kw)
        if weights != "plain":
            experts.to_block_fp8((128, 128))
            experts.fp8_act_quant = weights == "w8a8"
    return SimpleNamespace(experts=experts, gate=SimpleNamespace(top_k=m.K))


def _experts_probe(m: ModelShape, dt, cfg: dict | None, weights: str = "plain", ids=torch.int64,
                   variant: bool = False) -> list:
    """The grouped GEMM on m's expert shapes with config cfg (None: the kernel's own choice), a
    decode-sized batch (the config is forced, so T only sets the top-k launch)."""
    from moe_serve.kernels.grouped_gemm import TritonExperts

    return _probe(lambda: TritonExperts("cuda").launch(_moe_stand_in(m, dt, weights, variant=variant), dt, cfg, ids))


def _masked_probe(m: ModelShape, dt, cfg: dict, fp8: bool) -> list:
    """The masked grouped GEMM over DeepEP's expert-major layout: 8 local experts of 128 rows each."""
    from moe_serve.kernels.grouped_gemm import TritonExperts

    moe = _moe_stand_in(m, dt, "fp8" if fp8 else "plain", E=8)
    return _probe(lambda: TritonExperts("cuda").launch_masked(moe, dt, cfg, 128))


def _attention_layer(m: ModelShape, kind: str):
    """kind: "" (full attention), "sliding" or "chunked" (see _attention_kinds)."""
    from attention.layer import PagedAttention, PagedDSAAttention, PagedMLAAttention

    with torch.device(_META):
        if m.dsa:
            return PagedDSAAttention(m.L, m.R, 0.1, 2048, m.ID, m.ID ** -0.5, m.IH)
        if m.mla:
            return PagedMLAAttention(m.L, m.R, 0.1)
        return PagedAttention(m.N, m.G, m.H, 0.1, v_head_dim=m.Hv, sliding_window=128 if kind == "sliding" else None,
                              sinks=m.sinks, attention_chunk=128 if kind == "chunked" else None)


def _attention_kinds(m: ModelShape) -> list[str]:
    """The kinds of attention layer the model has: full, GPT-OSS's sliding-window ones (the models
    with sinks), Llama-4's chunked ones."""
    return [""] + ["sliding"] * m.sinks + ["chunked"] * m.chunked


def _attention_probe(m: ModelShape, dt, step: tuple, kind: str = "", backend=None, cache_dt=None) -> list:
    """The KV / latent write and one attention call (plus the split reduce) for one of the steps
    the attention backend declares (TritonAttention.steps; backend: another such class), over
    caches of cache_dt (None: dt; an FP8 type under --kv-cache-dtype fp8*)."""
    from attention.backends import TritonAttention

    _, q_lens, seq_lens, S = step
    return _probe(lambda: (backend or TritonAttention)("cuda").launch(_attention_layer(m, kind), m.N, dt, q_lens, seq_lens, S,
                                                         ENGINE_BLOCK_SIZE, cache_dt))


def _linear_attention_probe(m: ModelShape, dt, state_dt, step: tuple) -> list:
    """The convolution and the gated delta rule of one of the steps the linear-attention backend
    declares (TritonLinearAttention.steps), the recurrent state cached in state_dt."""
    from moe_serve.kernels.gated_delta import LinearAttentionShape, TritonLinearAttention

    shape = LinearAttentionShape(m.LH, m.LK, m.LV, m.LC, m.LW, state_dtype=state_dt)
    _, q_lens, ctx_lens = step
    return _probe(lambda: TritonLinearAttention("cuda").launch(shape, dt, q_lens, ctx_lens))


# Packed int4 / int8 weights (moe_serve/quantization/packed.py: compressed-tensors, GPTQ and AWQ
# checkpoints; GGUF files) on the shapes such checkpoints are published for; the group sizes they use
# (128 the usual; 32 GGUF's blocks and a narrower K tile; 16 the sub-blocks of GGUF's Q6_K and Q5_K,
# held a byte a code, as a Q4_K_M file's down experts are) and per channel. Gate/up and down launch
# apart, each with its own bits and group, so a file mixing them (Q4_K_M: 4-bit g32 gate/up, 8-bit
# g16 down) launches what these combinations do.
PACKED_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "moe-tiny")
PACKED_GROUPS = (128, 32, 16, None)  # None: per channel


def _packed_moe_stand_in(m: ModelShape, dt, bits: int, group: int | None):
    """An MoE layer's packed experts (PackedExperts, "meta") and router top-k as the backend reads them."""
    from types import SimpleNamespace

    from moe_serve.layers.experts import PackedExperts

    with torch.device(_META):
        experts = PackedExperts(m.E, m.D, m.F, list(range(m.E)), dt, bits, (group or m.D, group or m.F))
    return SimpleNamespace(experts=experts, gate=SimpleNamespace(top_k=m.K))


def _packed_experts_probe(m: ModelShape, dt, cfg: dict, bits: int, group: int | None, ids=torch.int64,
                          act_quant: bool = False) -> list:
    """The packed grouped GEMM with config cfg: through TritonExperts (W4A16 / W8A16, what the
    warm-up launches), or with act_quant the kernel's W8A8 form called directly (no loader sets it yet)."""
    from moe_serve.kernels.grouped_gemm import TritonExperts

    moe = _packed_moe_stand_in(m, dt, bits, group)
    if not act_quant:
        return _probe(lambda: TritonExperts("cuda").launch(moe, dt, cfg, ids))
    from moe_serve.kernels.grouped_gemm.triton_packed import fused_experts_packed_triton

    w13, w2 = moe.experts.op_weights()
    T = 4
    return _probe(lambda: fused_experts_packed_triton(
        torch.empty(T, m.D, dtype=dt, device=_META), w13, w2, torch.empty(T, m.K, device=_META),
        torch.empty(T, m.K, dtype=ids, device=_META), cfg, act_quant=True))


def _packed_linear_layer(N: int, K: int, dt, bits: int, group: int | None, bias: bool):
    """A Linear kept packed (Linear.to_packed), "meta"."""
    from moe_serve.layers.linear import Linear

    with torch.device(_META):
        layer = Linear(K, N, bias=bias, dtype=dt)
        layer.to_packed(bits, group or K)
    return layer


def _packed_linear_probe(N: int, K: int, M: int, dt, bits: int, group: int | None, bias: bool,
                         act_quant: bool = False) -> list:
    """A packed linear layer over M rows: through TritonLinear, or its W8A8 form called directly."""
    from moe_serve.kernels.linear import TritonLinear
    from moe_serve.kernels.packed_linear import packed_linear_triton

    layer = _packed_linear_layer(N, K, dt, bits, group, bias)
    if not act_quant:
        return _probe(lambda: TritonLinear("cuda").launch(layer, dt, M))
    return _probe(lambda: packed_linear_triton(torch.empty(M, K, dtype=dt, device=_META), layer.packed(), layer.bias,
                                               act_quant=True))


def _add_packed_launches(models, dtypes, gemm_cfgs, add_launches) -> None:
    """The packed int4 / int8 kernels: the grouped GEMM on PACKED_MODELS' expert shapes (each
    default and tuned config, 4 and 8 bits, PACKED_GROUPS; W8A8, per channel, in bf16), the linear
    layer per row tile (bias or not; W8A8 in bf16) and the int8 activation quantizer. Users all say "packed"
    (--only packed / --skip packed)."""
    from moe_serve.kernels.linear import TritonLinear

    for m in (m for m in models if m.name in PACKED_MODELS):
        for dt, cfg, origin in gemm_cfgs:
            if dt not in m.dtypes or origin == "batch-invariant":  # the invariant experts refuse packed weights
                continue
            groups = [g for g in PACKED_GROUPS if g is None or (m.D % g == 0 and m.F % g == 0)]
            d = DTYPE_SIG[dt]
            for bits in (4, 8):
                for group in groups:
                    g = f"g{group}" if group else "per-channel"
                    for ids in (torch.int64, torch.int32):  # router ids are int64; remapped placements give int32
                        add_launches(_packed_experts_probe(m, dt, cfg, bits, group, ids), {
                            PACKED_GEMM: lambda j, g=g, bits=bits, d=d, o=origin:
                            f"packed int{bits} {g} {o} {m.name} {'w13' if j.constexprs['GATED'] else 'w2'} {d}"})
            if dt == torch.bfloat16:
                add_launches(_packed_experts_probe(m, dt, cfg, 8, None, act_quant=True), {
                    PACKED_GEMM: lambda j, o=origin: f"packed w8a8 {o} {m.name} "
                                                     f"{'w13' if j.constexprs['GATED'] else 'w2'} bf16",
                    INT8_QUANT: "packed w8a8 activation quant bf16"})
    N, K = 2048, 7168
    for dt in dtypes:
        d = DTYPE_SIG[dt]
        for M in TritonLinear.ROW_TILES:
            row = f"{' decode' if M == 1 else ''} M={M}"
            for bits in (4, 8):
                for group in PACKED_GROUPS:
                    for bias in (False, True):
                        add_launches(_packed_linear_probe(N, K, M, dt, bits, group, bias), {
                            PACKED_LINEAR: f"packed linear{row} int{bits} g{group or 'channel'} bias={int(bias)} {d}"})
            if dt == torch.bfloat16:
                add_launches(_packed_linear_probe(N, K, M, dt, 8, None, False, act_quant=True), {
                    PACKED_LINEAR: f"packed linear{row} w8a8 per-channel bf16",
                    INT8_QUANT: "packed w8a8 activation quant bf16"})


def _fp8_linear_probe(N: int, K: int, M: int, bias: bool, act_quant: bool) -> list:
    """A block-FP8 linear layer (bf16 activations) over M rows, through the linear backend."""
    from moe_serve.kernels.linear import TritonLinear
    from moe_serve.layers.linear import Linear

    with torch.device(_META):
        layer = Linear(K, N, bias=bias, dtype=torch.bfloat16)
        layer.to_block_fp8((128, 128))
    layer.fp8_act_quant = act_quant
    return _probe(lambda: TritonLinear("cuda").launch(layer, torch.bfloat16, M))


def _invariant_linear_probe(N: int, K: int, dt, bias: bool) -> list:
    """A dense linear layer through --batch-invariant's Triton linear (its one tile for every M)."""
    from moe_serve.kernels.batch_invariant import InvariantTritonLinear
    from moe_serve.layers.linear import Linear

    with torch.device(_META):
        layer = Linear(K, N, bias=bias, dtype=dt)
    return _probe(lambda: InvariantTritonLinear("cuda").launch(layer, dt, 1))


def _add_invariant_launches(models, dtypes, add_launches, kv_cache_dtypes=(None,)) -> None:
    """--batch-invariant's Triton launches: the dense linear (one tile per dtype and bias) and the
    attention steps of InvariantTritonAttention (the decode tile for prefill chunks too: decode's
    variants, so they add users, not compiles). Its experts' config is among gemm_cfgs; its FP8
    linear row tile among TritonLinear.ROW_TILES. DSA has no invariant form (refused)."""
    from attention.backends.invariant import InvariantTritonAttention

    for dt in dtypes:
        for bias in (False, True):
            add_launches(_invariant_linear_probe(2048, 7168, dt, bias),
                         {LINEAR: f"batch-invariant linear (decode, prefill) bias={int(bias)} {DTYPE_SIG[dt]}"})
    for m in models:
        for dt in (dt for dt in dtypes if dt in m.dtypes) if m.attention and not m.dsa else ():
            for step in InvariantTritonAttention.steps(max_len=40, split=False):
                for kind, cache_dt in ((k, c) for k in _attention_kinds(m) for c in kv_cache_dtypes):
                    kv = f" kv={KV_FP8[cache_dt]}" if cache_dt else ""
                    user = f"{m.name} batch-invariant {step[0]}{' ' + kind if kind else ''} {DTYPE_SIG[dt]}{kv}"
                    add_launches(_attention_probe(m, dt, step, kind, InvariantTritonAttention, cache_dt),
                                 {ATTN: user, WRITE: f"{m.name} {DTYPE_SIG[dt]}{kv}"})


def enumerate_jobs(models=MODELS, dtypes=DTYPES, inject_broken: bool = False, quick: bool = False,
                   kv_cache_dtypes=tuple(KV_CACHE_DTYPES.values())) -> list[Job]:
    """Every configuration the launchers can choose for these models and dtypes, deduplicated; with
    quick, only `quick_jobs` of them. Each is recorded from the launcher itself, run on meta tensors
    of the model's shapes, so types, Triton's integer and alignment marks, constexprs and launch
    options are those of a real launch. kv_cache_dtypes: the KV caches' element types the attention
    launches are enumerated over (None: the activation dtype; by default that and both FP8 types)."""
    from attention.backends import TritonAttention
    from moe_serve.kernels.gated_delta import TritonLinearAttention
    from moe_serve.kernels.grouped_gemm import config as gcfg

    jobs: dict[tuple, Job] = {}

    def add(job: Job, user: str) -> None:
        jobs.setdefault(job.key(), job).users.append(user)

    def add_launches(launches, users: dict):
        """users: kernel -> user name, or a function of the job giving it; kernels not named are skipped."""
        for launch in launches:
            if launch.kernel in users:
                job = job_from_launch(launch)
                u = users[launch.kernel]
                add(job, u(job) if callable(u) else u)

    def gemm_user(origin, d, suffix=""):
        return lambda job: f"{origin} {'w13' if job.constexprs['GATED'] else 'w2'} {d}{suffix}"

    # Each default config is named after the batches it serves (decode / middle / prefill).
    default_names = ("default decode", "default middle", "default prefill")
    gemm_cfgs = [(dt, cfg, name) for dt in dtypes for cfg, name in zip(gcfg.DEFAULT_CONFIGS, default_names)]
    gemm_cfgs += [(dt, cfg, "tuned") for dt, cfg in gcfg.tuned_configs() if dt in dtypes]
    gemm_cfgs += [(dt, gcfg.INVARIANT_CONFIG, "batch-invariant") for dt in dtypes]  # --batch-invariant's one tile
    for m in models:
        for dt, cfg, origin in gemm_cfgs:
            if dt not in m.dtypes:
                continue
            d = DTYPE_SIG[dt]
            add_launches(_experts_probe(m, dt, cfg), {GEMM: gemm_user(origin, d)})
            # Masked grouped GEMM (DeepEP low-latency layout): the same configs, gate/up and down
            # (not --batch-invariant's: its experts never take the masked GEMM).
            masked = origin != "batch-invariant"
            if masked:
                add_launches(_masked_probe(m, dt, cfg, False), {MASKED: gemm_user(f"{origin} masked", d)})
            if dt == torch.bfloat16:  # block-FP8 experts with bf16 activations: weight-only and W8A8
                add_launches(_experts_probe(m, dt, cfg, "fp8"), {GEMM: gemm_user(origin, d, " fp8-weights")})
                add_launches(_experts_probe(m, dt, cfg, "w8a8"), {GEMM: gemm_user(origin, d, " fp8-w8a8"),
                                                                 QUANT: "fp8 activation quant bf16"})
                if masked:
                    add_launches(_masked_probe(m, dt, cfg, True),
                                 {MASKED: gemm_user(f"{origin} masked", d, " fp8-weights")})
            # The model's expert variant (biases, another activation): dense (and block FP8 in bf16),
            # and MXFP4 where the model ships so.
            kinds = ("plain",) + ("fp8", "w8a8") * (dt == torch.bfloat16) if m.variant else ()
            suffix = f" {m.act}{' bias' if m.bias else ''}"
            for weights in kinds + ("mxfp4",) * m.mxfp4:
                add_launches(_experts_probe(m, dt, cfg, weights, variant=True),
                             {GEMM: gemm_user(origin, d, f" {weights if weights != 'plain' else 'dense'}{suffix}"),
                              QUANT: "fp8 activation quant bf16"})
            if m.mxfp4 and dt == torch.bfloat16 and origin == "default decode":
                # The MXFP4 kernel's every activation, with and without biases, on this shape.
                for act in ("silu", "limited", "clamped"):
                    for bias in (False, True):
                        v = replace(m, act=act, bias=bias)
                        add_launches(_experts_probe(v, dt, cfg, "mxfp4"),
                                     {GEMM: gemm_user(origin, d, f" mxfp4 {act}{' bias' if bias else ''}")})
    if inject_broken:
        # A config tl.dot cannot compile (K tile < 16), and a gate/up tile too large for 4 warps'
        # registers (64 x 256 rows and columns, two fp32 accumulators: ~2.2 KB spilled per thread):
        # both must be reported. They are the decode default's launches of the first model with
        # their tiles changed, so everything else is real.
        base = [job_from_launch(x) for x in _experts_probe(models[0], torch.bfloat16, gcfg.DECODE_CONFIG)
                if x.kernel == GEMM]
        for job in base:
            add(replace(job, constexprs={**job.constexprs, "BLOCK_SIZE_K": 8}, users=[]),
                f"broken {'w13' if job.constexprs['GATED'] else 'w2'} bf16")
        w13 = next(j for j in base if j.constexprs["GATED"])
        add(replace(w13, constexprs={**w13.constexprs, "BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 64},
                    users=[]), "broken spilling w13 bf16")

    if torch.bfloat16 in dtypes:  # block-FP8 dense layers (moe_serve/kernels/fp8_linear.py): each M bucket, bias or not
        from moe_serve.kernels.linear import TritonLinear

        N, K = 2048, 7168
        for M in TritonLinear.ROW_TILES:
            for bias in (False, True):
                for aq in (False, True):
                    user = (f"fp8 linear{' decode' if M == 1 else ''} M={M} bias={int(bias)} "
                            f"{'w8a8' if aq else 'w8a16'} bf16")
                    add_launches(_fp8_linear_probe(N, K, M, bias, aq),
                                 {FP8_LINEAR: user, QUANT: "fp8 activation quant bf16"})

    _add_invariant_launches(models, dtypes, add_launches, kv_cache_dtypes)
    _add_packed_launches(models, dtypes, gemm_cfgs, add_launches)
    for m in models:
        for dt in (dt for dt in dtypes if dt in m.dtypes):
            d = DTYPE_SIG[dt]
            for ids in (torch.int64, torch.int32):  # router ids are int64; remapped placements give int32
                add_launches(_experts_probe(m, dt, None, ids=ids), {TOPK: f"{m.name} {d}"})
            for step in TritonAttention.steps(max_len=40, split=True) if m.attention else ():
                for kind in _attention_kinds(m):
                    for cache_dt in kv_cache_dtypes:  # the model dtype's cache, FP8 caches
                        kv = f" kv={KV_FP8[cache_dt]}" if cache_dt else ""
                        user = f"{m.name} {step[0]}{' ' + kind if kind else ''} {d}{kv}"
                        add_launches(_attention_probe(m, dt, step, kind, cache_dt=cache_dt),
                                     {ATTN: user, REDUCE: f"{m.name} {d}", WRITE: f"{m.name} {d}{kv}",
                                      INDEX: f"{m.name} indexer {step[0]} {d}{kv}"})
            if not m.linear_attention:
                continue
            for state_dt in dict.fromkeys((torch.float32, dt)):
                for name, *step in TritonLinearAttention.steps():
                    user = f"{m.name} linear attention {name} {d} state {DTYPE_SIG[state_dt]}"
                    add_launches(_linear_attention_probe(m, dt, state_dt, (name, *step)),
                                 {k: user for k in LINEAR_ATTENTION})
    return quick_jobs(list(jobs.values())) if quick else list(jobs.values())


def is_decode(job: Job) -> bool:
    """A configuration some decode step launches (the decode-default grouped GEMM tile, decode
    attention, the M=1 FP8 linear), by the users enumerate_jobs gave it."""
    return any("decode" in u for u in job.users)


def spill_checked(job: Job) -> bool:
    """Held to --max-spill: every grouped-GEMM configuration (default or tuned, plain or masked)
    and every decode configuration."""
    return job.kernel in (GEMM, MASKED, PACKED_GEMM) or is_decode(job)


def quick_jobs(jobs: list[Job]) -> list[Job]:
    """One configuration per kernel, dtype and code path (gate/up or down, split-K or not, MLA or
    GQA, the weight and activation types, the experts' activation and biases): the first
    enumerated, which is the decode default where the kernel has one (jobs are enumerated decode
    default first), plus every tuned entry. The default of `--quick`, what the test suite compiles
    on each change."""
    by_path: dict[tuple, Job] = {}
    for j in jobs:
        c = j.constexprs
        path = (j.kernel, j.dtype, j.types.get("a_ptr") or j.types.get("x_ptr"), j.types.get("b_ptr"), c.get("GATED"),
                c.get("SPLIT_K"), c.get("HAS_ROPE"), c.get("DECODE"), c.get("ACT"), c.get("HAS_BIAS"), c.get("BITS"),
                c.get("A_INT8"))
        if j.kv_fp8:
            # FP8 caches: one per cache type and attention path (DSA's sparse tile apart from MLA's),
            # whatever the activation dtype (the first enumerated: bf16 where the model serves it):
            # the FP8 variant differs only in its cache loads and stores, and the activation dtypes'
            # code is the quick set's over their own caches.
            path = (j.kernel, j.kv_fp8, c.get("SPLIT_K"), c.get("HAS_ROPE"), c.get("SPARSE"))
        if j.kernel in (GEMM, MASKED) and any(u.startswith("tuned") for u in j.users):
            path += (j.key(),)  # every tuned entry
        by_path.setdefault(path, j)
    return list(by_path.values())


# ---- compiling (in worker processes) ---------------------------------------------------------------

_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_usage(log: str) -> tuple[int, int] | None:
    regs, spills = _PTXAS_REGS.search(log), _PTXAS_SPILLS.search(log)
    if not regs:
        return None
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def _ptxas_rerun(ptx: str, arch: int) -> tuple[int, int]:
    """ptxas -v on the kernel's PTX: for Triton versions that cannot print the log of their own run."""
    import subprocess

    from triton.backends.nvidia import compiler as nv

    try:
        ptxas = nv.get_ptxas(arch).path
    except TypeError:  # older signature without the arch
        ptxas = nv.get_ptxas().path
    gpu = nv.sm_arch_from_capability(arch) if hasattr(nv, "sm_arch_from_capability") else f"sm_{arch}a"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=300)
    usage = _ptxas_usage(r.stderr + r.stdout)
    if usage is None:
        raise RuntimeError(f"ptxas -v printed no register count: {r.stderr[-500:]}")
    return usage


def compile_job(job: Job, arch: int) -> dict:
    """Compile one configuration for sm_<arch>; a record with regs, spills, shared, or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import warnings

    # Triton 3.9 warns once per process that its FP-fusion default will change; the engine's launches
    # get the same default as these compiles, so it says nothing about this check.
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    t0 = time.perf_counter()
    rec = {"arch": arch, "ok": False}
    try:
        module, name = job.kernel.split(":")
        fn = getattr(importlib.import_module(module), name)
        signature, constexprs, attrs = {}, {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in job.constexprs:
                signature[arg] = "constexpr"
                constexprs[(i,)] = job.constexprs[arg]
            elif arg not in job.types:
                raise TypeError(f"aot_check has no type for argument {arg!r} of {job.kernel}")
            elif job.marks.get(arg) == "1":  # Triton turns an integer argument equal to 1 into a constant
                signature[arg] = "constexpr"
                constexprs[(i,)] = 1
            else:
                signature[arg] = job.types[arg]
                if job.marks.get(arg) == "D":
                    attrs[(i,)] = [["tt.divisibility", 16]]
        unknown = set(job.constexprs) - set(fn.arg_names)
        if unknown:
            raise TypeError(f"{job.kernel} has no arguments {sorted(unknown)}")
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and hasattr(knobs.nvidia, "dump_ptxas_log"):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v of the real compile, printed to stdout
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                    options=dict(job.options))
        usage = _ptxas_usage(log.getvalue()) or _ptxas_rerun(kernel.asm["ptx"], arch)
        rec.update(regs=usage[0], spills=usage[1], shared=int(kernel.metadata.shared))
        limit = MAX_SHARED.get(arch)
        if limit is not None and rec["shared"] > limit:
            raise RuntimeError(f"needs {rec['shared']} bytes of shared memory; sm_{arch} has {limit}")
        rec["ok"] = True
    except Exception as e:  # any failure to compile is a result, not a crash of the whole check
        # Triton's CompilationError quotes the source first and ends with the reason: keep both ends.
        msg = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
        parts = msg if len(msg) <= 3 else [msg[0], "...", *msg[-2:]]
        rec["error"] = f"{type(e).__name__}: " + " | ".join(parts)[-600:]
    rec["seconds"] = time.perf_counter() - t0
    return rec


def _cost(job: Job) -> int:
    """Rough compile cost, to start the slow ones first."""
    c = job.constexprs
    tile = 1
    for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "BLOCK_Q", "BLOCK_QH", "BLOCK_N", "BLOCK_HD"):
        tile *= c.get(k, 1)
    return tile * job.options.get("num_warps", 4) * (2 if c.get("GATED") else 1)


def _names_any(j: Job, words: list[str]) -> bool:
    """Whether j's kernel, description or one of its users contains one of words."""
    return any(w in j.kernel or w in j.describe() or any(w in u for u in j.users) for w in words)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moe_serve.kernels.aot_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, nargs="+", default=[90, 100], help="CUDA compute capabilities")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--only", nargs="+", default=None,
                   help="only configurations whose kernel, description or user contains one of these")
    p.add_argument("--skip", nargs="+", default=None, metavar="WORD",
                   help="leave out configurations whose kernel, description or user contains one of these")
    p.add_argument("--model", action="append", default=[], help="also a model's config.json (repeatable)")
    p.add_argument("--dtype", nargs="+", choices=[DTYPE_SIG[d] for d in DTYPES], default=None)
    p.add_argument("--kv-cache-dtype", nargs="+", choices=list(KV_CACHE_DTYPES), default=list(KV_CACHE_DTYPES),
                   help="the KV caches' element types to compile the attention kernels for (default: all; "
                        "'auto': the activation dtype)")
    p.add_argument("--inject-broken", action="store_true",
                   help="add a grouped-GEMM config that cannot compile and one that spills (tests that both "
                        "are caught)")
    p.add_argument("--list", action="store_true", help="print the configurations, compile nothing")
    p.add_argument("--quick", action="store_true",
                   help="one configuration per kernel, dtype and code path (decode defaults first) plus every "
                        "tuned grouped-GEMM entry: what the test suite compiles")
    p.add_argument("--max-spill", type=int, default=DEFAULT_MAX_SPILL, metavar="BYTES",
                   help="fail a grouped-GEMM or decode configuration spilling more than this many bytes per "
                        f"thread on any architecture (default {DEFAULT_MAX_SPILL}; -1: report only)")
    args = p.parse_args(argv)

    models = MODELS + tuple(model_from_hf_config(m) for m in args.model)
    dtypes = tuple(d for d in DTYPES if args.dtype is None or DTYPE_SIG[d] in args.dtype)
    kv_dtypes = tuple(KV_CACHE_DTYPES[k] for k in dict.fromkeys(args.kv_cache_dtype))
    jobs = enumerate_jobs(models, dtypes, args.inject_broken, args.quick, kv_dtypes)
    if args.only:
        jobs = [j for j in jobs if _names_any(j, args.only)]
    if args.skip:
        jobs = [j for j in jobs if not _names_any(j, args.skip)]
    jobs.sort(key=_cost, reverse=True)
    archs = list(dict.fromkeys(args.arch))
    names = ", ".join(f"sm_{a}" for a in archs)
    if args.list:
        for j in jobs:
            print(f"{j.dtype:4s} {j.describe():92s} [{'; '.join(j.users[:3])}{' ...' if len(j.users) > 3 else ''}]")
        print(f"aot: {len(jobs)} configurations for {names} (listed, not compiled)")
        return 0

    import triton

    print(f"aot_check: triton {triton.__version__}, {len(jobs)} configurations x {names}, {args.jobs} processes",
          flush=True)
    t0 = time.time()
    cache = tempfile.mkdtemp(prefix="aot-triton-cache-")
    os.environ["TRITON_CACHE_DIR"] = cache  # inherited by the workers: every compile is a real one
    tasks = [(j, a) for j in jobs for a in archs]
    failed: dict[tuple, list] = {}
    spills: dict[tuple, tuple[int, int, Job]] = {}  # job key -> (worst spill bytes, its arch, job)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
            futures = [pool.submit(compile_job, j, a) for j, a in tasks]
            for (job, arch), fut in zip(tasks, futures):
                try:
                    rec = fut.result()
                except Exception as e:  # a worker died (e.g. a crash inside the compiler)
                    rec = {"arch": arch, "ok": False, "error": f"{type(e).__name__}: {e}", "seconds": 0.0}
                head = f"sm_{arch:<3d} {job.dtype:4s} {job.describe():92s}"
                if rec["ok"]:
                    print(f"  ok   {head} regs {rec['regs']:3d}  spills {rec['spills']:5d} B  "
                          f"shared {rec['shared']:6d} B  {rec['seconds']:5.1f} s", flush=True)
                    if rec["spills"] > spills.get(job.key(), (0,))[0]:
                        spills[job.key()] = (rec["spills"], arch, job)
                else:
                    failed.setdefault(job.key(), []).append(arch)
                    print(f"  FAIL {head} {rec['error']}  [used by: {'; '.join(job.users[:4])}]", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    over = []
    for key, (b, arch, job) in sorted(spills.items(), key=lambda kv: -kv[1][0]):
        if args.max_spill >= 0 and b > args.max_spill and spill_checked(job) and key not in failed:
            over.append(key)
            print(f"  SPILL sm_{arch:<3d} {job.dtype:4s} {job.describe()} spills {b} B > --max-spill "
                  f"{args.max_spill} B  [used by: {'; '.join(job.users[:4])}]", flush=True)
    worst = max(spills.values(), key=lambda v: v[0], default=None)
    print(f"aot: {len(spills)} configurations spill registers" + (
        f" (most: {worst[0]} B on sm_{worst[1]}, {worst[2].describe()})" if worst else "")
        + f"; {len(over)} grouped-GEMM or decode configurations over {args.max_spill} B", flush=True)
    for key in over:
        failed.setdefault(key, [])
    n_ok = len(jobs) - len(failed)
    print(f"aot_check: {len(tasks)} compiles in {time.time() - t0:.0f} s", flush=True)
    print(f"aot: {n_ok} configurations compiled for {names}; {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
