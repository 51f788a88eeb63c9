"""Quantized checkpoints: which formats load, and how their weights are kept and used.

`fp8.py` block-scaled FP8 (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8, GLM-4.5-FP8 on the Hub, and
`--quantization fp8` for an unquantized checkpoint). MXFP4 expert weights (GPT-OSS) live beside the
expert op in moe_serve/kernels/grouped_gemm/mxfp4.py.
`packed.py` the packed int4 / int8 weight (PackedWeight: codes, per-group scales and offsets) every
integer format converts into at load, and its float32 reference `dequantize()`;
`compressed_tensors.py` compressed-tensors' pack-quantized checkpoints (W4A16 / W8A16, as
llm-compressor writes them), kept packed.
"""
