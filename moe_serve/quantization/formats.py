"""Which packed int4 / int8 checkpoint format a quantization_config names: validation at start-up
(errors name the field and the format) and the collector the weight loader feeds each format's
tensors to (moe_serve/weights.py), converting them into PackedWeight; and the table of which weight
formats each backend serves (`WEIGHT_FORMATS`, printed by `moe-serve env`)."""
from __future__ import annotations

PACKED_METHODS = ("compressed-tensors", "awq", "gptq")


def validate(q: dict) -> None:
    """A packed format's quantization_config, refused (ValueError naming the field) if not served."""
    method = q.get("quant_method")
    if method == "compressed-tensors":
        from moe_serve.quantization.compressed_tensors import CompressedTensorsConfig

        CompressedTensorsConfig.from_hf(q)
    elif method == "awq":
        from moe_serve.quantization.gptq_awq import AwqScheme

        AwqScheme.from_hf(q)
    elif method == "gptq":
        from moe_serve.quantization.gptq_awq import GptqScheme

        GptqScheme.from_hf(q)


def packed_collector(hf: dict):
    """The collector of a packed checkpoint's tensors, or None when the config names no packed format."""
    q = hf.get("quantization_config") or {}
    method = q.get("quant_method")
    if method == "compressed-tensors":
        from moe_serve.quantization.compressed_tensors import CompressedTensorsConfig, PackedTensors

        return PackedTensors(CompressedTensorsConfig.from_hf(q))
    if method == "awq":
        from moe_serve.quantization.gptq_awq import AwqScheme, AwqTensors

        return AwqTensors(AwqScheme.from_hf(q))
    if method == "gptq":
        from moe_serve.quantization.gptq_awq import GptqScheme, GptqTensors

        return GptqTensors(GptqScheme.from_hf(q))
    return None


# The weight formats each backend serves, and how: `moe-serve env` prints this table, and the serving
# guide's "Quantized checkpoints" section says the same. Backends are the expert / linear ops
# (moe_serve/platform.py OPS): torch ops, our C kernels (cpu_c), Triton (triton).
_PACKED_HOW = {"torch": "dequantized per call (torch ops)",
               "cpu_c": "linear calls and plain SwiGLU experts (no biases) in cpu_ops/quant.c: decode GEMVs read "
                        "the packed bytes once, prefills run a panel GEMM over rows widened a block at a time; "
                        "experts with biases dequantized (torch ops)",
               "triton": "packed kernels (packed_linear.py, grouped_gemm/triton_packed.py): codes decoded in "
                         "registers"}
WEIGHT_FORMATS: dict[str, dict] = {
    "dense": {"what": "bf16 / fp16 / fp32 safetensors",
              "backends": {"torch": "torch ops", "cpu_c": "C kernels for float32 / bf16 weights, torch ops otherwise",
                           "triton": "Triton grouped GEMM for experts, torch (cuBLAS) linear"}},
    "fp8": {"what": "block FP8 (quant_method fp8, or --quantization fp8): e4m3 weights, float32 scales per block",
            "backends": {"torch": "dequantized per call", "cpu_c": "dequantized per call (torch ops)",
                         "triton": "tiles dequantized as they load (W8A16, W8A8 on sm_89+)"}},
    "mxfp4": {"what": "MXFP4 experts (quant_method mxfp4: GPT-OSS as released)",
              "backends": {"torch": "routed experts dequantized per step",
                           "cpu_c": "routed experts dequantized per step (torch ops)",
                           "triton": "blocks decoded in registers"}},
    "compressed-tensors pack-quantized": {
        "what": "W4A16 / W8A16 (int4 / int8 weights per group or channel, zero points or not), kept packed",
        "backends": _PACKED_HOW},
    "compressed-tensors int-quantized": {
        "what": "W8A8 int8 (int8 weights per channel or group, kept int8), activations int8 per token",
        "backends": {**_PACKED_HOW,
                     "torch": _PACKED_HOW["torch"] + "; activations stay float",
                     "cpu_c": _PACKED_HOW["cpu_c"] + "; activations stay float",
                     "triton": _PACKED_HOW["triton"] + "; per-channel weights: activations quantized to int8 per "
                               "token, int8 x int8 products (not yet run on a GPU); per group: float"}},
    "compressed-tensors float-quantized": {
        "what": "FP8 dynamic (e4m3 weights per channel), kept FP8 as block FP8 with one block a row",
        "backends": {"torch": "dequantized per call; activations stay float",
                     "cpu_c": "dequantized per call (torch ops); activations stay float",
                     "triton": "the block-FP8 kernels with (1, K) blocks: linear layers quantize activations per "
                               "token on sm_89+ (the checkpoint's scheme), experts weight-only (not yet run on a "
                               "GPU)"}},
    "gptq": {"what": "GPTQ 4 / 8-bit (checkpoint_format gptq or gptq_v2, no activation order), kept packed",
             "backends": _PACKED_HOW},
    "awq": {"what": "AutoAWQ 4-bit 'gemm', kept packed", "backends": _PACKED_HOW},
    "gguf": {"what": "GGUF files (--model file.gguf) of Qwen3-MoE, Qwen2-MoE, MiniMax-M2, Mixtral: F32 / F16 / BF16 "
                     "as float; Q4_0, Q4_1, Q4_K kept 4-bit, Q5_0, Q5_1, Q8_0, Q5_K, Q6_K kept a byte a code "
                     "(exact); embedding, head and routers dequantized at load; other types refused",
             "backends": _PACKED_HOW},
}


def weight_formats() -> dict[str, dict]:
    """WEIGHT_FORMATS (a copy), the table `moe-serve env` reports."""
    return {name: {"what": f["what"], "backends": dict(f["backends"])} for name, f in WEIGHT_FORMATS.items()}
