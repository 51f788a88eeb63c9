"""GPT-OSS (GptOssForCausalLM, model_type gpt_oss), as transformers' GptOss computes it.

Attention: GQA with bias on q/k/v/o, yarn RoPE over the whole head, a learned sink logit per head
in every softmax's denominator, and layers alternating between a sliding window of
`sliding_window` keys and full attention as `layer_types` says. (Every request keeps all its KV
blocks: the full layers read them, so a sliding layer's old blocks cannot be freed early.)

Experts: a router with a bias whose top-k logits are softmaxed; experts with biases on both
projections and the clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate), gate <= 7, |up| <= 7).
Checkpoints interleave gate and up (`gate_up_proj[..., 2i]` is gate i, `2i + 1` up i); they are
de-interleaved at load so w13 keeps the [gate; up] layout every expert op uses.

Packed int4 / int8 checkpoints (compressed-tensors, GPTQ, AWQ: moe_serve/quantization/formats.py)
come with the experts as llm-compressor linearizes them to quantize: per-expert `gate_proj`,
`up_proj`, `down_proj` (under `mlp.experts.{e}.` or `mlp.experts.experts.{e}.`), each packed,
each with its float bias; they load into PackedExperts with biases.

MXFP4 (quantization_config quant_method "mxfp4", how GPT-OSS ships): the experts come as
`*_blocks` (uint8, two e2m1 values per byte) and `*_scales` (uint8 e8m0 per 32 values), biases
unquantized. On the CPU and on CUDA they stay compressed in memory: the Triton grouped GEMM (CUDA's
expert backend) decodes each weight tile in registers as it loads it, the torch ops dequantize the
routed experts of each step (moe_serve/kernels/grouped_gemm/mxfp4.py). On other devices, or with
`mxfp4_compressed = False`, they are dequantized once at load into ordinary expert weights (the
memory cost is logged).
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from expert_parallel.runtime.layer import MoE, MoEContext
from expert_parallel.runtime.router import TopKThenSoftmaxRouter
from moe_serve.kernels.grouped_gemm.mxfp4 import dequantize_mxfp4
from moe_serve.kernels.grouped_gemm.reference import ClampedSwiGLU
from moe_serve.layers.attention import GQASelfAttention
from moe_serve.layers.experts import Mxfp4Experts
from moe_serve.layers.rotary import RotaryEmbedding, rope_config
from moe_serve.models.base import CausalLM, DecoderStack
from moe_serve.models.decoder_layer import DecoderLayer

log = logging.getLogger("moe_serve.models.gpt_oss")

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)"
                            r"(?P<part>_bias|_blocks|_scales|)$")
# a linearized expert's bias (packed checkpoints: its weight loads as any per-expert weight)
_EXPERT_BIAS = re.compile(r"^(?P<prefix>.*\.mlp)\.experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.bias$")


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """Rows [g0, u0, g1, u1, ...] -> [g0, g1, ...; u0, u1, ...] along dim 0."""
    return torch.cat([t[0::2], t[1::2]], dim=0)


class GptOssForCausalLM(CausalLM):
    # fused 3-D expert tensors load by load_checkpoint_tensor; per-expert ones (packed checkpoints) by name
    expert_names = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    quant_methods = ("mxfp4",)
    name_rewrites = ((r"\.self_attn\.sinks$", ".self_attn.attn.sinks"), (r"\.mlp\.router\.", ".mlp.gate."),
                     (r"\.mlp\.experts\.experts\.(\d+)\.", r".mlp.experts.\1."))
    # MXFP4 experts kept compressed: None decides by device (the CPU and CUDA: yes; elsewhere dequantized
    # at load).
    mxfp4_compressed: bool | None = None
    COMPRESSED_ON = ("cpu", "cuda")

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        D, E = hf["hidden_size"], hf["num_local_experts"]
        heads = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or heads
        head_dim = hf.get("head_dim") or D // heads
        eps = hf.get("rms_norm_eps", 1e-5)
        n = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                                 for i in range(n)]
        if len(layer_types) != n or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types={layer_types!r}: need {n} of 'sliding_attention' / 'full_attention'")
        window = hf.get("sliding_window")
        quant = (hf.get("quantization_config") or {}).get("quant_method")
        self.mxfp4 = quant == "mxfp4"
        # Compressed in memory on the CPU and CUDA (read packed by the Triton kernel, or dequantized
        # per step by torch ops); elsewhere dequantized at load.
        packed_here = torch.get_default_device().type in self.COMPRESSED_ON
        self.compressed = self.mxfp4 and (packed_here if self.mxfp4_compressed is None else self.mxfp4_compressed)
        rotary = RotaryEmbedding(head_dim, rope_config(hf), hf.get("max_position_embeddings", 4096))
        act = ClampedSwiGLU(float(hf.get("swiglu_alpha", 1.702)), float(hf.get("swiglu_limit", 7.0)))
        F = hf["intermediate_size"]
        layers = []
        for i in range(n):
            sliding = layer_types[i] == "sliding_attention"
            attn = GQASelfAttention(D, heads, kv, head_dim, rotary, dtype,
                                    bias=bool(hf.get("attention_bias", True)),
                                    sliding_window=window if sliding and window else None, sinks=True)
            router = TopKThenSoftmaxRouter(D, E, hf["num_experts_per_tok"])
            ffn = MoE(D, F, E, router, moe, dtype, experts_cls=Mxfp4Experts if self.compressed else None,
                      experts_kwargs=dict(bias=True, activation=act), layer_index=i)
            layers.append(DecoderLayer(D, eps, attn, ffn, "mlp", dtype))
        super().__init__(hf, DecoderStack(hf["vocab_size"], D, layers, eps, dtype, rotary), dtype)
        self._experts = _ExpertsOf(self, [f"model.layers.{i}.mlp" for i in range(n)])
        self._pending: dict[str, torch.Tensor] = {}  # MXFP4 blocks waiting for their scales (dequantize at load)
        if self.mxfp4:
            ex = self._experts["model.layers.0.mlp"]
            slots = ex.w13_bias.shape[0]
            packed = n * slots * 3 * F * D * 17 // 32  # 16 bytes of values + 1 scale per 32 weights
            if self.compressed:
                from moe_serve.kernels.grouped_gemm.mxfp4 import MAX_DEQUANT_BYTES

                per_layer = slots * 3 * F * D * 4
                log.info("MXFP4 experts kept compressed: %.1f MiB on this rank; the Triton expert kernel reads "
                         "them packed, torch ops dequantize the routed experts of one layer at a time into "
                         "reused buffers of at most %.1f MiB", packed / 2**20,
                         min(per_layer, max(MAX_DEQUANT_BYTES, 3 * F * D * 4)) / 2**20)
            else:
                dense = n * slots * 3 * F * D * torch.empty((), dtype=dtype).element_size()
                log.info("MXFP4 experts dequantized at load to %s: %.1f MiB on this rank instead of %.1f MiB "
                         "compressed (+%.1f MiB)", str(dtype).replace("torch.", ""), dense / 2**20,
                         packed / 2**20, (dense - packed) / 2**20)

    def load_checkpoint_tensor(self, name: str, raw: str, f) -> list[str] | None:
        """Expert tensors (weights, biases, MXFP4 blocks / scales), each read only for the experts
        this rank holds and de-interleaved; everything else loads by name (None)."""
        m = _EXPERT_TENSOR.match(name)
        if m is None or m.group("prefix") not in self._experts:
            b = _EXPERT_BIAS.match(name)
            if b is None or b.group("prefix") not in self._experts:
                return None
            ex, e, kind = self._experts[b.group("prefix")], int(b.group("e")), self.expert_names[b.group("proj")]
            if not hasattr(ex, "load_bias"):
                raise ValueError(f"tensor {raw!r}: per-expert biases load into packed experts only (a packed "
                                 f"checkpoint's linearized experts); these experts are {type(ex).__name__}")
            if ex.holds(e):  # other ranks' experts are never read
                ex.load_bias(e, kind, f.get_tensor(raw), raw)
            return [f"{b.group('prefix')}.experts.{'w2' if kind == 'down' else 'w13'}_bias"]
        ex = self._experts[m.group("prefix")]
        proj, part = m.group("proj"), m.group("part")
        w13 = proj == "gate_up_proj"
        sl = f.get_slice(raw)
        shape = tuple(sl.get_shape())
        F = ex.F
        D = ex.w2_bias.shape[1]
        out_rows, cols = (2 * F, D) if w13 else (D, F)
        want = {"": (cols, out_rows), "_bias": (out_rows,), "_blocks": (out_rows, cols // 32, 16),
                "_scales": (out_rows, cols // 32)}[part]
        if shape[1:] != want:
            raise ValueError(f"tensor {raw!r} has shape {shape}, expected (E, {', '.join(map(str, want))})")
        if part in ("_blocks", "_scales") and not self.mxfp4:
            raise ValueError(f"tensor {raw!r} is MXFP4 but config.json has no quantization_config "
                             f"with quant_method 'mxfp4'")
        key = "w13" if w13 else "w2"
        filled = []
        for e, slots in ex.slots_of.items():
            t = sl[e]  # reads expert e's rows only
            if part == "":
                t = t.t()  # (in, out) on disk -> (out, in)
            if w13:
                t = _deinterleave(t)
            if part == "_bias":
                target = getattr(ex, f"{key}_bias")
            elif part == "" or not self.compressed:
                if part:  # MXFP4 into dense weights: wait for the other half of the pair
                    other = f"{m.group('prefix')}.{key}.{e}.{'_scales' if part == '_blocks' else '_blocks'}"
                    if other not in self._pending:
                        self._pending[f"{m.group('prefix')}.{key}.{e}.{part}"] = t
                        continue
                    partner = self._pending.pop(other)
                    blocks, scales = (t, partner) if part == "_blocks" else (partner, t)
                    t = dequantize_mxfp4(blocks.to(torch.uint8), scales.to(torch.uint8), torch.float32)
                target = getattr(ex, key)
            else:
                target = getattr(ex, f"{key}{part}")
            for s in slots:
                target.data[s].copy_(t.to(target.dtype))
            filled = [f"{m.group('prefix')}.experts.{target_name(ex, target)}"]
        return filled or ["(pending MXFP4 half)"]


class _ExpertsOf(dict):
    """Each MoE layer's experts by prefix, looked up when asked: a packed checkpoint's loader puts
    PackedExperts in place of the dense ones before loading."""

    def __init__(self, model: nn.Module, prefixes: list[str]):
        super().__init__((p, None) for p in prefixes)
        self.model = model

    def __getitem__(self, prefix: str) -> nn.Module:
        if prefix not in self:
            raise KeyError(prefix)
        return self.model.get_submodule(prefix).experts


def target_name(ex: nn.Module, target: torch.Tensor) -> str:
    for name, p in ex.named_parameters(recurse=False):
        if p is target:
            return name
    raise KeyError("expert parameter not found")
