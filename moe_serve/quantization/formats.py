"""Which packed int4 / int8 checkpoint format a quantization_config names: validation at start-up
(errors name the field and the format) and the collector the weight loader feeds each format's
tensors to (moe_serve/weights.py), converting them into PackedWeight."""
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
