"""Attention backends: one object per way of running paged attention, chosen once at start-up by
moe_serve/platform.py and bound to every attention layer.

- `TorchAttention` ("torch"): torch ops only (attention/backends/reference.py), the reference
  every kernel is tested against;
- `CpuCAttention` ("cpu_c"): the same, with our C kernels (moe_serve/kernels/cpu_ops/attention.c) taking a
  step's decodes and prefill chunks where they fit (float32 CPU tensors), read in place from the
  cache, and the new keys and values written into it in one call;
- `TritonAttention` ("triton"): the Triton kernels (attention/backends/triton_paged.py), imported
  on first use so CPU users never load Triton.

Every backend has write_kv, write_latent, paged_attention and mla_paged_attention with the
signatures of `attention.backends.reference`, and dsa_topk and sparse_mla_attention with those of
`attention.backends.dsa`; `num_splits` (split-K) is the Triton kernel's.
"""
from __future__ import annotations

import importlib

import torch

from attention.backends import dsa, reference
from moe_serve.kernels import cpu_ops


class TorchAttention:
    name = "torch"
    captures_graphs = False  # its decode step can be held in a CUDA graph
    gather_pool = None  # buffers its decode gathers reuse (CpuCAttention's; none here: graphs, GPUs)

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def capturable(self) -> "TorchAttention":
        """The backend a captured (or capture-checked) step runs: torch ops only."""
        return TorchAttention(self.device)

    def write_kv(self, k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T) -> None:
        reference.write_kv(k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T)

    def write_latent(self, latent_TC, latent_cache, slot_mapping_T) -> None:
        reference.write_latent(latent_TC, latent_cache, slot_mapping_T)

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
        return reference.paged_attention(q_TNH, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                         sinks=sinks, attention_chunk=attention_chunk)

    def mla_paged_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, scale: float) -> torch.Tensor:
        return reference.mla_paged_attention(q_latent_TNL, q_pe_TNR, latent_cache, meta, scale, self.gather_pool)

    def dsa_topk(self, q_TNI, w_TN, index_cache, meta, topk: int, scale: float) -> torch.Tensor:
        return dsa.dsa_topk(q_TNI, w_TN, index_cache, meta, topk, scale, self.gather_pool)

    def sparse_mla_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale: float) -> torch.Tensor:
        return dsa.sparse_mla_attention(q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale)

    def warm_up(self, layer, num_heads: int, dtype: torch.dtype, block_size: int, max_len: int, split: bool,
                cache_dtype: torch.dtype | None = None) -> None:
        """Compile what this backend can launch for the layer ahead of serving: nothing for torch ops."""

    @classmethod
    def kv_cache_dtypes(cls) -> dict[str, str]:
        """The --kv-cache-dtype values this backend serves, each with what runs it (`moe-serve env`)."""
        fp8 = "torch ops: stored saturated, widened to float32 to attend"
        return {"auto": "the activation dtype", "fp8_e4m3": fp8, "fp8_e5m2": fp8}

    def __repr__(self) -> str:
        return type(self).__name__ + "()"


class CpuCAttention(TorchAttention):
    """The C kernels attend to every key of the context: sliding-window, chunked and sink layers
    take the torch ops (reference.paged_attention does not hand them to `fast`)."""

    name = "cpu_c"

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.gather_pool = {}  # a CPU's decode gathers reuse their buffers: no page faults per step

    @classmethod
    def kv_cache_dtypes(cls) -> dict[str, str]:
        """As TorchAttention's, naming where the C decode kernel reads an FP8 cache itself."""
        out = super().kv_cache_dtypes()
        for name, dtype in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
            q, cache = torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=dtype)
            if cpu_ops.decode_attention_fits(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                                             torch.ones(1, dtype=torch.int32)):
                out[name] = "C kernels (float32 activations), widened in registers; torch ops otherwise"
        return out

    def write_kv(self, k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T) -> None:
        if cpu_ops.write_kv_fits(k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T):  # one C call, not two ops
            cpu_ops.write_kv(k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T)
        else:
            super().write_kv(k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T)

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, sliding_window: int | None = None,
                        sinks: torch.Tensor | None = None, attention_chunk: int | None = None) -> torch.Tensor:
        return reference.paged_attention(q_TNH, k_cache, v_cache, meta, scale, sliding_window=sliding_window,
                                         sinks=sinks, attention_chunk=attention_chunk, fast=self)

    def decodes(self, q_TNH, k_cache, v_cache, meta, scale: float) -> torch.Tensor | None:
        """(nd, N, Hv) float32 attention of the step's leading decodes by the C kernel, reading keys
        and values in place from the cache; None where it does not apply (no decodes, other dtypes)."""
        nd = meta.leading_decodes
        if not nd:
            return None
        q = q_TNH if nd == q_TNH.shape[0] else q_TNH[:nd]
        if not cpu_ops.decode_attention_fits(q, k_cache, v_cache, meta.block_tables, meta.seq_lens):
            return None
        return cpu_ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)

    def prefills(self, q_TNH, k_cache, v_cache, meta, scale: float, nd: int, out: torch.Tensor) -> bool:
        """The step's sequences after its nd leading decodes by the C kernel in one call (float32),
        written into out; False where it does not apply (then nothing is written)."""
        if out.dtype != torch.float32:
            return False
        if not (cpu_ops.decode_attention_fits(q_TNH, k_cache, v_cache, meta.block_tables, meta.seq_lens)
                and meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.is_contiguous()):
            return False
        cpu_ops.prefill_attention(q_TNH, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  nd, meta.num_seqs, out, scale)
        return True


class TritonAttention:
    name = "triton"
    captures_graphs = True

    def __init__(self, device: torch.device | str = "cuda"):
        self.device = torch.device(device)
        self._k = None

    @property
    def kernels(self):
        if self._k is None:  # lazy: triton is heavy
            self._k = importlib.import_module("attention.backends.triton_paged")
        return self._k

    def capturable(self) -> "TritonAttention":
        return self

    def write_kv(self, k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T) -> None:
        self.kernels.write_kv(k_TGH, v_TGH, k_cache, v_cache, slot_mapping_T)

    def write_latent(self, latent_TC, latent_cache, slot_mapping_T) -> None:
        self.kernels.write_latent(latent_TC, latent_cache, slot_mapping_T)

    def paged_attention(self, q_TNH, k_cache, v_cache, meta, scale: float, *, num_splits: int | None = None,
                        sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                        attention_chunk: int | None = None) -> torch.Tensor:
        return self.kernels.paged_attention(q_TNH, k_cache, v_cache, meta, scale, num_splits=num_splits,
                                            sliding_window=sliding_window, sinks=sinks, attention_chunk=attention_chunk)

    def mla_paged_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, scale: float, *,
                            num_splits: int | None = None) -> torch.Tensor:
        return self.kernels.mla_paged_attention(q_latent_TNL, q_pe_TNR, latent_cache, meta, scale,
                                                num_splits=num_splits)

    # DSA (DeepSeek-V3.2, GLM-5): the indexer's scores in Triton (attention/backends/triton_dsa.py) and
    # torch's top-k; the sparse MLA is the attention kernel's SPARSE mode.
    def dsa_topk(self, q_TNI, w_TN, index_cache, meta, topk: int, scale: float) -> torch.Tensor:
        return self.dsa_kernels.dsa_topk(q_TNI, w_TN, index_cache, meta, topk, scale)

    def sparse_mla_attention(self, q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale: float, *,
                             num_splits: int | None = None) -> torch.Tensor:
        return self.kernels.sparse_mla_attention(q_latent_TNL, q_pe_TNR, latent_cache, meta, topk_TK, scale,
                                                 num_splits=num_splits)

    @property
    def dsa_kernels(self):
        return importlib.import_module("attention.backends.triton_dsa")

    @staticmethod
    def steps(max_len: int, split: bool) -> list[tuple[str, list[int], list[int], int]]:
        """The kinds of step a layer's forward launches differently, as (name, query lengths,
        context lengths, split-K partitions): decode (one query token per sequence), with split
        also split-K over a long context (the engine splits decode keys only where it counts SMs),
        and a chunked prefill beside a decode."""
        steps = [("decode", [1, 1], [1, 2], 1)]
        if split:
            steps.append(("decode split", [1, 1], [max_len, max_len], 2))
        steps.append(("prefill", [4, 1], [4, 9], 1))
        return steps

    def launch(self, layer, num_heads: int, dtype: torch.dtype, q_lens: list[int], seq_lens: list[int],
               num_splits: int, block_size: int, cache_dtype: torch.dtype | None = None) -> None:
        """The layer's cache write and attention (and split reduce) for one step, as its forward
        calls them, over "meta" tensors: compiled, not run. cache_dtype: the K/V caches' element
        type (--kv-cache-dtype: float8_e4m3fn / float8_e5m2), by default the activations' dtype; the
        kernels take it from the cache pointer, so an FP8 cache is a variant of its own."""
        from attention.metadata import AttentionMetadata

        dev = torch.device("meta")
        tables = [[0] * -(-s // block_size) for s in seq_lens]
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, block_size, device=dev)
        T = sum(q_lens)
        caches = [torch.empty(s, dtype=cache_dtype or dtype, device=dev) for s in layer.cache_shape(1, block_size)]
        if layer.latent:
            L, R = layer.kv_lora_rank, layer.rope_dim
            self.write_latent(torch.empty(T, L + R, dtype=dtype, device=dev), caches[0], meta.slot_mapping)
            q_lat, q_pe = (torch.empty(T, num_heads, d, dtype=dtype, device=dev) for d in (L, R))
            if getattr(layer, "index_head_dim", None):  # DSA: the indexer, then attention over its selection
                NI, ID = layer.index_heads, layer.index_head_dim
                self.write_latent(torch.empty(T, ID, dtype=dtype, device=dev), caches[1], meta.slot_mapping)
                self.dsa_topk(torch.empty(T, NI, ID, dtype=dtype, device=dev),
                              torch.empty(T, NI, dtype=torch.float32, device=dev), caches[1], meta, layer.topk,
                              layer.index_scale)
                sel = torch.empty(T, min(layer.topk, max(seq_lens)), dtype=torch.int64, device=dev)
                self.sparse_mla_attention(q_lat, q_pe, caches[0], meta, sel, layer.scale, num_splits=num_splits)
            else:
                self.mla_paged_attention(q_lat, q_pe, caches[0], meta, layer.scale, num_splits=num_splits)
        else:
            G, H, Hv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
            self.write_kv(torch.empty(T, G, H, dtype=dtype, device=dev), torch.empty(T, G, Hv, dtype=dtype, device=dev),
                          caches[0], caches[1], meta.slot_mapping)
            self.paged_attention(torch.empty(T, layer.num_heads, H, dtype=dtype, device=dev), caches[0], caches[1],
                                 meta, layer.scale, num_splits=num_splits, sliding_window=layer.sliding_window,
                                 sinks=layer.sinks, attention_chunk=layer.attention_chunk)

    def warm_up(self, layer, num_heads: int, dtype: torch.dtype, block_size: int, max_len: int, split: bool,
                cache_dtype: torch.dtype | None = None) -> None:
        """Every variant the layer launches: one launch per kind of step (`steps`), over caches of
        cache_dtype (None: dtype)."""
        for _, q_lens, seq_lens, S in self.steps(max_len, split):
            self.launch(layer, num_heads, dtype, q_lens, seq_lens, S, block_size, cache_dtype)

    @classmethod
    def kv_cache_dtypes(cls) -> dict[str, str]:
        """The --kv-cache-dtype values this backend serves, each with what runs it (`moe-serve env`)."""
        fp8 = "Triton kernels: written saturated (round to nearest even), widened to float32 as loaded"
        return {"auto": "the activation dtype", "fp8_e4m3": fp8, "fp8_e5m2": fp8}

    def __repr__(self) -> str:
        return "TritonAttention()"


# By name, for tests and benchmarks that call one backend directly (the engine's table is in platform.py).
_BY_NAME = {cls.name: cls for cls in (TorchAttention, CpuCAttention, TritonAttention)}


def get_backend(name: str):
    if name not in _BY_NAME:
        raise ValueError(f"attention_backend={name!r} is not one of {tuple(_BY_NAME)}")
    return _BY_NAME[name]()  # device-independent: the tensors' device rules
