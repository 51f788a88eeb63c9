"""DeepSeek-V4 (DeepseekV4ForCausalLM): shared-K=V multi-query attention over a sliding window plus
compressed entries of the whole context, manifold-constrained hyper-connections (mHC), hash-routed
MoE in the first layers and sqrt-softplus routing after them (deepseek_v4_blocks.py has the pieces
outside attention).

Attention of layer type
- `sliding_attention`: the last `sliding_window` tokens' K (= V), attention sinks per head;
- `heavily_compressed_attention` (HCA): the window, plus one compressed entry per finished group
  of m' tokens: the group's raw projections `wkv(x)` pooled by a softmax over `wgate(x) + ape[j]`
  (per channel, j the token's place in the group), RMS-normed, rotated at position w * m';
- `compressed_sparse_attention` (CSA): the same at m tokens, each entry pooled over 2m tokens (the
  first half of the previous group's projections, the second half of its own; the first group
  has no previous one), and a lightning indexer (its own compressor at index_head_dim, queries
  from the q_a projection, sum_h w_h relu(q_h . k)) that picks the `index_topk` entries a query
  attends to.
A query at p sees entry w once the group is complete ((w + 1) m - 1 <= p). Queries are RMS-normed
per head without weight; q and K are rotated (interleaved pairs, on the last qk_rope_head_dim
channels: the "main" RoPE on sliding layers, the "compress" one on the others) and the output's
rotated channels rotated back at the query's position before the grouped output projection.

The attention itself (its caches, the compressors' pooling, the indexer's choice, the softmax with
sinks) is attention/compressed.py's `CompressedAttention`, run by the backend moe_serve/platform.py
binds (op kind "compressed_attention"); this file builds q, K and the raw rows and owns the weights.

Checkpoint names are the Hub's (`layers.{i}.attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`,
`embed`, `head`, ...), with or without transformers' `model.` prefix. The MTP layer (`mtp.0.*`) is
V4MTPLayer when speculative decoding asks for method "mtp" (the streams it reads are the stack's
output; the hyper head and final norm run in compute_logits), skipped with a log line otherwise. Quantized as released: block FP8 linears with float32 or ue8m0 (one
exponent byte) scales, `<name>.scale` beside `<name>.weight`; `expert_dtype: fp4` experts kept
packed in memory (GPT-OSS's MXFP4 expert op: decoded tile by tile in the Triton kernel on GPUs,
dequantized per step for the routed experts by torch ops on the CPU).
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from attention.compressed import CompressedAttention, Compressor, Indexer, rope_tail
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.layer import MoE, MoEContext, run_to_end
from expert_parallel.runtime.step import NO_STEP, MoEStep
from moe_serve.layers.embedding import Embedding, LMHead
from moe_serve.layers.experts import LimitedSwiGLU, LimitedSwiGLUExpert, Mxfp4Experts
from moe_serve.layers.linear import Linear
from moe_serve.layers.norm import RMSNorm
from moe_serve.layers.rotary import inv_freq_and_scale
from moe_serve.models.base import CausalLM
from moe_serve.quantization.fp8 import scale_to_e8m0
from moe_serve.models.deepseek_v4_blocks import (GroupedOutputProjection, HashRouter, HyperConnection, HyperHead,
                                                 SqrtSoftplusRouter, unweighted_rms_norm)

log = logging.getLogger("moe_serve.models.deepseek_v4")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class V4Rope:
    """cos and sin (T, R/2) of one of V4's two RoPEs ("main", "compress") at any positions."""

    def __init__(self, params: dict, dim: int, max_position: int):
        self.inv_freq, self.scale = inv_freq_and_scale(params, dim, max_position)

    def cos_sin(self, positions: torch.Tensor, pointwise=None) -> tuple[torch.Tensor, torch.Tensor]:
        """pointwise(fn, t): how cos and sin run (a batch-invariant linear backend's padded rows:
        torch's vectorised body and scalar tail differ in the last bit), else torch's."""
        f = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        if pointwise is not None:
            return pointwise(torch.cos, f) * self.scale, pointwise(torch.sin, f) * self.scale
        return f.cos() * self.scale, f.sin() * self.scale


class V4Attention(nn.Module):
    """q (from the q_a projection), the shared K (= V) and the compressors' raw rows of a layer's
    tokens, attended by `attention` (attention/compressed.py), then the grouped output projection."""

    def __init__(self, hf: dict, layer_type: str, window_span: int, dtype):
        super().__init__()
        D, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.H, self.hd = hf["num_attention_heads"], hf["head_dim"]
        self.eps, self.layer_type = eps, layer_type
        self.window = int(hf["sliding_window"])
        q_rank = hf["q_lora_rank"]
        self.wq_a = Linear(D, q_rank, dtype=dtype)
        self.q_norm = RMSNorm(q_rank, eps, dtype)
        self.wq_b = Linear(q_rank, self.H * self.hd, dtype=dtype)
        self.wkv = Linear(D, self.hd, dtype=dtype)
        self.kv_norm = RMSNorm(self.hd, eps, dtype)
        self.o = GroupedOutputProjection(self.H, self.hd, hf["o_groups"], hf["o_lora_rank"], D, dtype)
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.rope_type = "main" if layer_type == SLIDING else "compress"
        self.compressor = self.indexer = None
        if layer_type != SLIDING:
            m = compress_rates(hf)[layer_type]
            self.compressor = Compressor(D, self.hd, m, layer_type == CSA, eps, dtype)
            if layer_type == CSA:
                self.indexer = Indexer(D, q_rank, hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"], m,
                                       eps, dtype)
        self.attention = CompressedAttention(self.H, self.hd, self.window, window_span, dtype, self.compressor,
                                             self.indexer)

    def forward(self, x_TD: torch.Tensor, positions_T: torch.Tensor, meta: AttentionMetadata,
                ropes: dict, rope_fns: dict) -> torch.Tensor:
        T = x_TD.shape[0]
        cos, sin = ropes[self.rope_type]
        q_resid = self.q_norm(self.wq_a(x_TD))
        q = unweighted_rms_norm(self.wq_b(q_resid).view(T, self.H, self.hd), self.eps)
        q = rope_tail(q, cos, sin)
        rows = [rope_tail(self.kv_norm(self.wkv(x_TD)), cos, sin)]
        if self.compressor is not None:
            rows += self.compressor.raw(x_TD)
        index_q = None
        if self.indexer is not None:
            rows += self.indexer.compressor.raw(x_TD)
            index_q = self.indexer.queries(q_resid, x_TD, *ropes["compress"])
        out = self.attention(q, rows, index_q, meta, rope_fns["compress"], self.sinks)
        return self.o(rope_tail(out, cos, -sin))


class V4DecoderLayer(nn.Module):
    """Decoder layer i of `layer_types` / `mlp_layer_types`; the MTP layer (i = num_hidden_layers)
    passes its attention type and routing."""

    def __init__(self, hf: dict, i: int, window_span: int, moe: MoEContext, dtype, layer_type: str | None = None,
                 hashed: bool | None = None):
        super().__init__()
        D, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        N, iters, hc_eps = hf["hc_mult"], hf.get("hc_sinkhorn_iters", 20), hf.get("hc_eps", 1e-6)
        self.attn_hc = HyperConnection(D, N, iters, hc_eps, eps)
        self.ffn_hc = HyperConnection(D, N, iters, hc_eps, eps)
        self.attn_norm = RMSNorm(D, eps, dtype)
        self.ffn_norm = RMSNorm(D, eps, dtype)
        self.attn = V4Attention(hf, layer_type or layer_types(hf)[i], window_span, dtype)
        E, K, F = hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]
        scale = float(hf.get("routed_scaling_factor", 1.0))
        self.hashed = mlp_layer_types(hf)[i] == "hash_moe" if hashed is None else hashed
        router = (HashRouter(D, E, K, hf["vocab_size"], scale) if self.hashed else
                  SqrtSoftplusRouter(D, E, K, scale))
        limit = hf.get("swiglu_limit")
        n_shared = hf.get("n_shared_experts") or 0
        shared = LimitedSwiGLUExpert(D, F * n_shared, limit, dtype) if n_shared else None
        fp4 = fp4_experts(hf)
        self.ffn = MoE(D, F, E, router, moe, dtype, shared_experts=shared, layer_index=i,
                       experts_cls=Mxfp4Experts if fp4 else None,
                       experts_kwargs=dict(activation=LimitedSwiGLU(limit), **({"bias": False} if fp4 else {})))

    def stages(self, h_TND, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep, ropes, rope_fns):
        ops = self.attn.wq_a.ops  # the linear backend, for the hyper-connections' batch-invariant forms
        post, comb, x = self.attn_hc(h_TND, ops)
        a = self.attn(self.attn_norm(x), positions_T, meta, ropes, rope_fns)
        h_TND = HyperConnection.merge(h_TND, a, post, comb, ops)
        post, comb, x = self.ffn_hc(h_TND, ops)
        y = yield from self.ffn.stages(self.ffn_norm(x), step, ids_T if self.hashed else None)
        return HyperConnection.merge(h_TND, y, post, comb, ops)


class V4Stack(nn.Module):
    """embed -> hc_mult copies of each token's embedding -> layers: the streams, flattened (T, N*D).
    The hyper head and the final norm run in `DeepseekV4ForCausalLM.compute_logits` (on the sampled
    rows only), so the MTP layer reads the streams as the reference's does."""

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        super().__init__()
        D, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.N = hf["hc_mult"]
        rates = compress_rates(hf)
        types = layer_types(hf)
        self.span = span = max([int(hf["sliding_window"])] + [2 * rates[CSA] for t in types if t == CSA]
                               + [rates[HCA] for t in types if t == HCA])
        self.embed_tokens = Embedding(hf["vocab_size"], D, dtype)
        self.layers = nn.ModuleList([V4DecoderLayer(hf, i, span, moe, dtype) for i in range(hf["num_hidden_layers"])])
        self.hc_head = HyperHead(D, self.N, hf.get("hc_eps", 1e-6), eps)
        self.norm = RMSNorm(D, eps, dtype)
        R = int(hf.get("qk_rope_head_dim") or hf["head_dim"] * float(hf.get("partial_rotary_factor", 64 / 512)))
        max_pos = hf.get("max_position_embeddings", 4096)
        self.ropes = {t: V4Rope(p, R, max_pos) for t, p in rope_types(hf).items()}

    def forward(self, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep = NO_STEP) -> torch.Tensor:
        return run_to_end(self.stages(ids_T, positions_T, meta, step))

    def stages(self, ids_T, positions_T, meta: AttentionMetadata, step: MoEStep = NO_STEP):
        e = self.embed_tokens(ids_T)
        h = e[:, None, :].expand(-1, self.N, -1).contiguous()
        ropes = {t: r.cos_sin(positions_T, self.pointwise()) for t, r in self.ropes.items()}
        for layer in self.layers:
            h = yield from layer.stages(h, ids_T, positions_T, meta, step, ropes, self.ropes)
        return h.flatten(1)

    def final(self, h_BX: torch.Tensor) -> torch.Tensor:
        """(B, N*D) streams -> (B, D): the hyper head, then the final norm."""
        return self.norm(self.hc_head(h_BX.view(h_BX.shape[0], self.N, -1), self.linear_ops()))

    def linear_ops(self):
        """The linear backend bound to the model's Linears (every one has the same)."""
        return self.layers[0].attn.wq_a.ops

    def pointwise(self):
        """The linear backend's elementwise form under --batch-invariant, else None (torch's, as
        before): what the RoPE angles' cos and sin run on."""
        ops = self.linear_ops()
        return ops.pointwise if getattr(ops, "batch_invariant", False) else None


class V4MTPLayer(nn.Module):
    """DeepSeek-V4's multi-token-prediction layer (`mtp.0.*` on the Hub): a decoder layer (sliding
    attention, learned routing unless the model's hash layers reach its index) fed
    e_proj(enorm(embed(t_{p+1}))) added to every stream of h_proj(hnorm(streams_p)); its own hyper
    head and norm, the model's embedding and LM head. Its input at p is the target's streams at p
    (or its own on a chained pass); spec_decode/mtp.py runs it."""

    def __init__(self, hf: dict, stack: V4Stack, lm_head: LMHead, moe: MoEContext, dtype, moe_index: int,
                 hashed: bool):
        super().__init__()
        D, eps = hf["hidden_size"], hf.get("rms_norm_eps", 1e-6)
        self.N = hf["hc_mult"]
        self.e_proj = Linear(D, D, dtype=dtype)
        self.h_proj = Linear(D, D, dtype=dtype)
        self.enorm = RMSNorm(D, eps, dtype)
        self.hnorm = RMSNorm(D, eps, dtype)
        self.norm = RMSNorm(D, eps, dtype)
        self.hc_head = HyperHead(D, self.N, hf.get("hc_eps", 1e-6), eps)
        self.block = V4DecoderLayer(hf, moe_index, stack.span, moe, dtype, layer_type=SLIDING, hashed=hashed)
        self._shared = (stack, lm_head)  # not submodules: the model's own, loaded once

    def forward(self, embed: nn.Module, rotary, ids_T: torch.Tensor, positions_T: torch.Tensor,
                prev_h_TX: torch.Tensor, meta: AttentionMetadata, step: MoEStep = NO_STEP) -> torch.Tensor:
        stack = self._shared[0]
        T, D = ids_T.shape[0], self.norm.weight.shape[0]
        e = self.e_proj(self.enorm(embed(ids_T)))
        h = self.h_proj(self.hnorm(prev_h_TX.reshape(T * self.N, D))).view(T, self.N, D)
        x = h + e[:, None, :]
        ropes = {t: r.cos_sin(positions_T, stack.pointwise()) for t, r in stack.ropes.items()}
        return run_to_end(self.block.stages(x, ids_T, positions_T, meta, step, ropes, stack.ropes)).flatten(1)

    def draft_ids(self, g_BX: torch.Tensor) -> torch.Tensor:
        g = self.norm(self.hc_head(g_BX.view(g_BX.shape[0], self.N, -1), self.e_proj.ops))
        return self._shared[1](g).argmax(dim=-1)


def fp4_experts(hf: dict) -> bool:
    """The routed experts ship as FP4 (quantization_config.expert_dtype, or the config's own field)."""
    q = hf.get("quantization_config") or {}
    return q.get("quant_method") == "fp8" and (q.get("expert_dtype") or hf.get("expert_dtype")) == "fp4"


_EXPERT = re.compile(r"^(?P<prefix>(?:model\.layers\.\d+|mtp\.0\.block)\.ffn)\.experts\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<part>weight|weight_scale_inv)$")


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        by_rate = {0: SLIDING, 4: CSA, 128: HCA}
        types = [by_rate.get(r, r) for r in hf["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    if len(types) != n or set(types) - {SLIDING, CSA, HCA}:
        raise ValueError(f"layer_types={types!r} must give one of {SLIDING!r}, {CSA!r}, {HCA!r} for each of the "
                         f"{n} layers")
    return types


def mlp_layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    types = hf.get("mlp_layer_types")
    if types is None:
        k = hf.get("num_hash_layers", 3)
        types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    types = list(types)[:n]
    if len(types) != n or set(types) - {"hash_moe", "moe"}:
        raise ValueError(f"mlp_layer_types={types!r} must give 'hash_moe' or 'moe' for each of the {n} layers")
    return types


def compress_rates(hf: dict) -> dict:
    rates = dict(hf.get("compress_rates") or {CSA: 4, HCA: 128})
    if hf.get("compress_rate_csa"):
        rates[CSA] = hf["compress_rate_csa"]
    if hf.get("compress_rate_hca"):
        rates[HCA] = hf["compress_rate_hca"]
    for t, r in rates.items():
        if int(r) < 1:
            raise ValueError(f"compress_rates[{t!r}]={r} must be at least 1")
    return {t: int(r) for t, r in rates.items()}


def rope_types(hf: dict) -> dict:
    """{"main": params, "compress": params}: as the config nests them, or derived as transformers
    does (main: rope_theta, default; compress: compress_rope_theta with the top-level scaling,
    yarn without its attention factor)."""
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        out = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        flat.setdefault("rope_type", flat.pop("type", "default"))
        out = {"main": {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)},
               "compress": {**flat, "rope_theta": hf.get("compress_rope_theta", 160000.0)}}
        if out["compress"]["rope_type"] == "yarn":
            out["compress"].setdefault("attention_factor", 1.0)
    for name, p in out.items():
        p.setdefault("rope_type", p.pop("type", "default"))
        if p["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"rope_parameters[{name!r}] rope_type={p['rope_type']!r} is not supported for "
                             f"DeepSeek-V4 (default, yarn)")
        if p["rope_type"] == "yarn":
            p.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    return out


# Hub name (after an optional "model." prefix) -> ours.
_RENAMES = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^embed_tokens\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head[._](?:hc_)?(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.hc_attn_(fn|base|scale)$", r"model.layers.\1.attn_hc.\2"),
    (r"^layers\.(\d+)\.hc_ffn_(fn|base|scale)$", r"model.layers.\1.ffn_hc.\2"),
    (r"^layers\.(\d+)\.attn\.wo_a\.(weight|weight_scale_inv)$", r"model.layers.\1.attn.o.o_a_proj.\2"),
    (r"^layers\.(\d+)\.attn\.wo_b\.(weight|weight_scale_inv)$", r"model.layers.\1.attn.o.o_b_proj.\2"),
    (r"^layers\.(\d+)\.attn\.norm\.weight$", r"model.layers.\1.attn.kv_norm.weight"),
    (r"^layers\.(\d+)\.attn\.attn_sink$", r"model.layers.\1.attn.sinks"),
    (r"^layers\.(\d+)\.ffn\.gate\.bias$", r"model.layers.\1.ffn.gate.e_score_correction_bias"),
    (r"^layers\.(\d+)\.", r"model.layers.\1."),
)


class DeepseekV4ForCausalLM(CausalLM):
    expert_names = {"w1": "gate", "w3": "up", "w2": "down"}

    def __init__(self, hf: dict, moe: MoEContext, dtype):
        for field in ("hc_mult", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window",
                      "n_routed_experts"):
            if not hf.get(field):
                raise ValueError(f"DeepSeek-V4 config needs {field!r}")
        if (hf.get("num_key_value_heads") or 1) != 1:
            raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']}: DeepSeek-V4 attention has one "
                             "shared K=V head")
        if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(f"scoring_func={hf['scoring_func']!r} is not supported for DeepSeek-V4 (sqrtsoftplus)")
        if not hf.get("norm_topk_prob", True):
            raise ValueError("norm_topk_prob=false is not supported for DeepSeek-V4")
        nn.Module.__init__(self)
        self.hf = hf
        self.num_hidden_layers = hf["num_hidden_layers"]
        self.model = V4Stack(hf, moe, dtype)
        self.lm_head = LMHead(hf["vocab_size"], hf["hidden_size"], dtype)
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.mtp = None
        self._mtp_logged = False
        self.fp4 = fp4_experts(hf)
        if self.fp4:
            q = dict(hf["quantization_config"])
            q.setdefault("expert_dtype", "fp4")
            hf["quantization_config"] = q  # the loader's FP8 config sees it too
            self._experts = {f"model.layers.{i}.ffn": layer.ffn.experts for i, layer in enumerate(self.model.layers)}
            ex = next(iter(self._experts.values()))
            E, twoF = ex.w13_blocks.shape[:2]
            D = ex.w2_blocks.shape[1]
            log.info("FP4 experts kept compressed (two e2m1 values a byte, an e8m0 scale per 32): %.1f MiB on "
                     "this rank (the Triton experts kernel decodes tiles as it loads them; torch ops dequantize "
                     "one layer's routed experts per step)",
                     len(self._experts) * E * 3 * (twoF // 2) * D * 17 / 32 / 2**20)

    def compute_logits(self, h_BX: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.final(h_BX))

    def add_mtp_layers(self, moe: MoEContext, dtype) -> int:
        """The checkpoint's multi-token-prediction layer (`num_nextn_predict_layers`: one on the
        released checkpoints) as `self.mtp[0]`, its MoE layer after the model's own. As in
        DeepSeek's reference, its attention is sliding-window only and its routing is hashed only
        when the model's hash layers (`num_hash_layers`, or the leading `hash_moe` layers) reach its
        index. Returns its count."""
        from moe_serve.spec_decode.mtp import one_mtp_layer, place_mtp_experts

        hf = self.hf
        n = one_mtp_layer(hf)
        L = self.num_hidden_layers
        n_hash = hf.get("num_hash_layers")
        if n_hash is None:
            types = mlp_layer_types(hf)
            n_hash = next((i for i, t in enumerate(types) if t != "hash_moe"), len(types))
            if n_hash == len(types):
                n_hash = max(n_hash, 3)  # every layer hashed: the reference's default count decides
        moe_index = self.num_moe_layers
        place_mtp_experts(moe, hf["n_routed_experts"], moe_index)
        layer = V4MTPLayer(hf, self.model, self.lm_head, moe, dtype, moe_index, hashed=L < int(n_hash))
        self.mtp = nn.ModuleList([layer])
        if self.fp4:
            self._experts["mtp.0.block.ffn"] = layer.block.ffn.experts
        return n

    def _mtp_name(self, rest: str) -> str | None:
        """`mtp.0.<rest>` (Hub) -> ours: its own projections, norms and hyper head by name, the
        decoder layer's tensors as a layer's, under `mtp.0.block`; None for a copy of the model's
        embedding or head."""
        head = rest.split(".")[0]
        if head in ("embed", "embed_tokens", "head", "lm_head", "shared_head"):
            return None
        if head in ("e_proj", "h_proj", "enorm", "hnorm", "norm"):
            return f"mtp.0.{rest}"
        m = re.match(r"^hc_head[._](?:hc_)?(fn|base|scale)$", rest)
        if m:
            return f"mtp.0.hc_head.hc_{m.group(1)}"
        L = self.num_hidden_layers
        name = f"layers.{L}.{rest}"
        for pat, rep in _RENAMES:
            new = re.sub(pat, rep, name)
            if new != name:
                return new.replace(f"model.layers.{L}.", "mtp.0.block.", 1)
        return name

    def loads_own_scales(self, name: str) -> bool:
        return self.fp4 and _EXPERT.match(name) is not None

    def load_checkpoint_tensor(self, name: str, raw: str, f) -> list[str] | None:
        """FP4 experts: each expert's w1 / w3 (gate / up rows of w13) and w2, int8 with two e2m1
        values a byte (the low nibble first) and one e8m0 scale per 32 inputs, into the MXFP4 stacks
        (only the experts this rank holds are read)."""
        m = _EXPERT.match(name) if self.fp4 else None
        if m is None or m.group("prefix") not in self._experts:
            return None
        ex = self._experts[m.group("prefix")]
        e, w, part = int(m.group("e")), m.group("w"), m.group("part")
        key = "w2" if w == "w2" else "w13"
        blocks, scales = getattr(ex, f"{key}_blocks"), getattr(ex, f"{key}_scales")
        R, G = scales.shape[1:]
        if w != "w2":
            R //= 2
        rows = slice(R, 2 * R) if w == "w3" else slice(0, R)
        done = [f"{m.group('prefix')}.experts.{key}_{'blocks' if part == 'weight' else 'scales'}"]
        if not ex.holds(e):
            return done
        t = f.get_tensor(raw)
        if part == "weight":
            if t.element_size() != 1 or tuple(t.shape) != (R, G * 16):
                raise ValueError(f"tensor {raw!r} has shape {tuple(t.shape)} {t.dtype}, expected ({R}, {G * 16}) "
                                 "bytes (FP4: two values a byte)")
            t = t.view(torch.uint8).reshape(R, G, 16)
            target = blocks
        else:
            if tuple(t.shape) != (R, G):
                raise ValueError(f"tensor {raw!r} has shape {tuple(t.shape)}, expected ({R}, {G}) (a scale per 32)")
            t = scale_to_e8m0(t)
            target = scales
        for slot in ex.slots_of[e]:
            target.data[slot, rows].copy_(t)
        return done

    def check_loaded(self) -> None:
        for m in self.modules():
            if isinstance(m, HashRouter):
                m.check()

    def checkpoint_name(self, name: str) -> str | None:
        bare = name[len("model."):] if name.startswith("model.") else name
        if bare.endswith(".scale"):  # the Hub's block scales: <linear>.scale beside <linear>.weight
            bare = bare[: -len(".scale")] + ".weight_scale_inv"
        if bare.startswith("mtp.0.") and self.mtp is not None:
            return self._mtp_name(bare[len("mtp.0."):])
        if bare.startswith("mtp.") or bare.startswith("mtp_"):
            if not self._mtp_logged:
                log.info("skipping the checkpoint's multi-token-prediction layer (mtp.*): not used without "
                         "speculative decoding")
                self._mtp_logged = True
            return None
        m = re.match(r"layers\.(\d+)\.", bare)
        if m and int(m.group(1)) >= self.num_hidden_layers:
            return None
        if self.tie_word_embeddings and bare in ("head.weight", "lm_head.weight"):
            return None
        for pat, rep in _RENAMES:
            new = re.sub(pat, rep, bare)
            if new != bare:
                return new
        return bare
