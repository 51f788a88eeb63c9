"""Check every Triton kernel against its reference on this GPU, then time them against speed of light.
The checks record which kernels they launched and name any of moe_serve/kernels/specialization.py's KERNELS
that none of them reached.

    python bench/kernels.py            # on a CUDA machine (bench/gpu_check.sh runs this)
    python bench/kernels.py --smoke    # tiny shapes on the CPU through the Triton interpreter

Speed of light (SOL) of a kernel = max(bytes it must move / measured copy bandwidth,
FLOPs / measured bf16 matmul rate), both measured on this card at start. Grouped GEMM is timed at
decode (T = 1..64) and prefill (T = 2048..8192) shapes of Qwen3-30B-A3B (E=128) and DeepSeek-V3
(E=256, this GPU's share of 32 experts under EP=8: pairs routed elsewhere are -1); paged decode
attention at 8K context. Writes bench/results/kernels_<gpu>_<time>.{json,txt}. Installs nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel modules' import (decoration time)

import torch  # noqa: E402
import triton  # noqa: E402

from attention.backends import reference as attn_ref  # noqa: E402
from attention.backends import triton_paged  # noqa: E402
from attention.metadata import AttentionMetadata  # noqa: E402
from moe_serve.kernels.grouped_gemm.align import align_block_size  # noqa: E402
from moe_serve.kernels.grouped_gemm.config import DEFAULT_CONFIGS, tuned_configs  # noqa: E402
from moe_serve.kernels.grouped_gemm.reference import fused_experts_float64, fused_experts_reference  # noqa: E402
from moe_serve.kernels.grouped_gemm.triton_kernel import fused_experts_triton  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
# (name, experts in the model, experts on this GPU, top-k, D, F)
MOE_MODELS = [("qwen3-30b-a3b", 128, 128, 8, 2048, 768), ("deepseek-v3-ep8", 256, 32, 8, 7168, 2048)]
DECODE_T, PREFILL_T = (1, 2, 4, 8, 16, 32, 64), (2048, 4096, 8192)
CHECK_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
BENCH_RTOL = 3e-2  # bf16 Triton vs the bf16 torch reference at the timed shapes


def timeit(fn, graph: bool = False) -> float:
    """Milliseconds per call: do_bench (L2 flushed between calls) or a CUDA-graph replay."""
    if SMOKE:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def measure_roofline() -> tuple[float, float]:
    """(bytes/s of a large device copy counting read + write, bf16 matmul FLOP/s)."""
    n = (1 << 16) if SMOKE else (1 << 30)  # 2 GiB of bf16 per buffer: far past any L2
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV).uniform_()
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * src.element_size() / (timeit(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    m = 256 if SMOKE else 8192
    a = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    flops = 2 * m ** 3 / (timeit(lambda: a @ b) * 1e-3)
    return bw, flops


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ---- inputs ---------------------------------------------------------------------------------------

def moe_inputs(T, E_total, E_local, K, D, F, dtype, seed=0, weights=None):
    """Layer inputs with softmax top-k routing over E_total experts; experts >= E_local are on other
    ranks (-1). Weights are scaled so activations stay O(1)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, generator=g).to(dtype)
    if weights is None:
        weights = ((torch.randn(E_local, 2 * F, D, device=DEV, generator=g) / D ** 0.5).to(dtype),
                   (torch.randn(E_local, D, F, device=DEV, generator=g) / F ** 0.5).to(dtype))
    probs = torch.softmax(torch.randn(T, E_total, device=DEV, generator=g), -1)
    tw, ids = torch.topk(probs, K, dim=-1)
    ids = torch.where(ids < E_local, ids, -1).to(torch.int32)
    return x, weights[0], weights[1], tw, ids


def attn_inputs(B, ctx, q_len, N, G, H, block_size, dtype, seed=0, mla_rope=0):
    """A batch of B sequences of ctx tokens (the last q_len are queries) over shuffled blocks."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-ctx // block_size)
    pool = torch.randperm(B * per_seq + 7, generator=g).tolist()
    tables = [pool[b * per_seq:(b + 1) * per_seq] for b in range(B)]
    meta = AttentionMetadata.build([q_len] * B, [ctx] * B, tables, block_size, device=DEV)
    nb = len(pool)
    if mla_rope:
        cache = torch.randn(nb, block_size, H + mla_rope, device=DEV).to(dtype)
        q = torch.randn(B * q_len, N, H, device=DEV).to(dtype)
        q_pe = torch.randn(B * q_len, N, mla_rope, device=DEV).to(dtype)
        return meta, (q, q_pe, cache)
    k = torch.randn(nb, block_size, G, H, device=DEV).to(dtype)
    v = torch.randn(nb, block_size, G, H, device=DEV).to(dtype)
    q = torch.randn(B * q_len, N, H, device=DEV).to(dtype)
    return meta, (q, k, v)


def _cpu_meta(m: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(m.query_start_loc.cpu(), m.seq_lens.cpu(), m.block_tables.cpu(), m.slot_mapping.cpu(),
                             m.block_size, m.query_lens_cpu, m.seq_lens_cpu, m.max_query_len, m.max_seq_len)


# ---- correctness ----------------------------------------------------------------------------------

def run_checks() -> list[dict]:
    """Each kernel against its reference on this device; returns one record per check. A check that
    raises (a config that does not compile or launch here) is recorded as failed, not skipped."""
    results = []

    def record(name, err, tol):
        ok = err < tol
        results.append({"check": name, "rel_err": err, "tol": tol, "pass": ok})
        print(f"  {'PASS' if ok else 'FAIL'}  {name:58s} rel_err={err:.2e} (tol {tol:.0e})", flush=True)

    def check(name, tol, fn):
        try:
            record(name, fn(), tol)
        except Exception as e:  # noqa: BLE001  the gate reports every failure and goes on
            results.append({"check": name, "rel_err": None, "tol": tol, "pass": False,
                            "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"  FAIL  {name:58s} {type(e).__name__}: {str(e)[:200]}", flush=True)

    def experts_err(args, dtype, config=None):
        out = torch.full(args[0].shape, float("nan"), dtype=dtype, device=DEV)
        fused_experts_triton(*args, config, out_TD=out)
        return rel_err(out, fused_experts_float64(*args))

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # The chosen config at each shape (all decode-sized: the default picks by pairs per expert).
        for T, E_total, E, K, D, F in [(1, 8, 8, 1, 96, 80), (1, 16, 10, 8, 128, 64), (23, 12, 7, 3, 136, 72),
                                       (64, 20, 20, 2, 256, 96)]:
            args = moe_inputs(T, E_total, E, K, D, F, dtype, seed=T)
            check(f"fused_experts T={T} E={E}/{E_total} K={K} D={D} F={F} {dtype}", CHECK_RTOL[dtype],
                  lambda: experts_err(args, dtype))
        # Every default config (decode BM=16, middle BM=32, prefill BM=64) and every tuned entry of
        # this dtype, forced, on shapes with several row blocks per expert and ragged edges.
        configs = [("default", c) for c in DEFAULT_CONFIGS] + [("tuned", c) for dt, c in tuned_configs() if dt == dtype]
        seen = []
        for origin, cfg in configs:
            if cfg in seen:
                continue
            seen.append(cfg)
            name = f"BM={cfg['BLOCK_SIZE_M']} BN={cfg['BLOCK_SIZE_N']} BK={cfg['BLOCK_SIZE_K']} G={cfg['GROUP_SIZE_M']} " \
                   f"w{cfg['num_warps']} s{cfg['num_stages']}"
            shapes = [(40, 8, 6, 4, 48, 40)] if SMOKE else [(300, 16, 12, 4, 200, 136), (1100, 8, 8, 2, 256, 160)]
            for T, E_total, E, K, D, F in shapes:
                args = moe_inputs(T, E_total, E, K, D, F, dtype, seed=T + 1)
                check(f"fused_experts {origin} {name} T={T} E={E} {dtype}", CHECK_RTOL[dtype],
                      lambda: experts_err(args, dtype, cfg))
    x, w13, w2, tw, ids = moe_inputs(0, 8, 8, 2, 64, 32, torch.bfloat16)
    check("fused_experts T=0", 0.5, lambda: float(fused_experts_triton(x, w13, w2, tw, ids).numel()))

    def align_same():  # align on this device must agree exactly with the CPU path
        ids = moe_inputs(300, 64, 40, 8, 16, 16, torch.float32)[4]
        a, b = align_block_size(ids, 40, 64), align_block_size(ids.cpu(), 40, 64)
        fields = ("sorted_pair_ids_S", "expert_ids_B", "num_padded")
        return 0.0 if all(torch.equal(getattr(a, f).cpu(), getattr(b, f)) for f in fields) else 1.0

    check("align_block_size device == cpu", 0.5, align_same)

    def gqa_err(B, ctx, q_len, N, G, H, bs, dtype, splits):
        meta, (q, k, v) = attn_inputs(B, ctx, q_len, N, G, H, bs, dtype, seed=ctx)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
        triton_paged.paged_attention(q, k, v, meta, H ** -0.5, num_splits=splits, out_TNH=out)
        expect = attn_ref.paged_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), _cpu_meta(meta),
                                          H ** -0.5)
        return rel_err(out, expect)

    def mla_err(B, ctx, q_len, N, dtype, splits):
        meta, (q, q_pe, cache) = attn_inputs(B, ctx, q_len, N, 1, 512, 64, dtype, seed=ctx, mla_rope=64)
        out = triton_paged.mla_paged_attention(q, q_pe, cache, meta, 576 ** -0.5, num_splits=splits)
        expect = attn_ref.mla_paged_attention(q.double().cpu(), q_pe.double().cpu(), cache.double().cpu(),
                                              _cpu_meta(meta), 576 ** -0.5)
        return rel_err(out, expect)

    # Decode cases run with the chosen split count and forced to 1 (no split), 5 and MAX_SPLITS.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for B, ctx, q_len, N, G, H, bs in [(3, 1000, 1, 32, 4, 128, 16), (2, 300, 1, 8, 8, 64, 16),
                                           (2, 200, 77, 16, 2, 128, 16), (1, 64, 64, 4, 1, 96, 32)]:
            for splits in ((None, 1, 5, triton_paged.MAX_SPLITS) if q_len == 1 else (None,)):
                check(f"paged_attention B={B} ctx={ctx} q={q_len} N={N} G={G} H={H} S={splits or 'auto'} {dtype}",
                      CHECK_RTOL[dtype], lambda: gqa_err(B, ctx, q_len, N, G, H, bs, dtype, splits))
        for B, ctx, q_len, N in [(2, 700, 1, 16), (1, 100, 30, 8)]:
            for splits in ((None, 1, triton_paged.MAX_SPLITS) if q_len == 1 else (None,)):
                check(f"mla_paged_attention B={B} ctx={ctx} q={q_len} N={N} S={splits or 'auto'} {dtype}",
                      CHECK_RTOL[dtype], lambda: mla_err(B, ctx, q_len, N, dtype, splits))

    def write_kv_diff():
        kv = torch.randn(37, 4, 192, device=DEV, dtype=torch.bfloat16)
        slots = torch.randperm(64 * 16, device=DEV)[:37]
        caches = [torch.zeros(64, 16, 4, 128, device=DEV, dtype=torch.bfloat16),
                  torch.zeros(64, 16, 4, 64, device=DEV, dtype=torch.bfloat16)]
        expect = [c.clone() for c in caches]
        triton_paged.write_kv(kv[..., :128], kv[..., 128:], *caches, slots)
        attn_ref.write_kv(kv[..., :128], kv[..., 128:], *expect, slots)
        lat = torch.zeros(64, 16, 576, device=DEV, dtype=torch.bfloat16)
        lat_expect = lat.clone()
        triton_paged.write_latent(kv.flatten(1)[:, :576], lat, slots)
        attn_ref.write_latent(kv.flatten(1)[:, :576], lat_expect, slots)
        return float(sum((c - e).abs().sum() for c, e in zip(caches + [lat], expect + [lat_expect])))

    check("write_kv (strided k/v views) and write_latent", 1e-30, write_kv_diff)
    for dtype in (torch.bfloat16, torch.float32):
        _more_checks(check, dtype)
    return results


def _more_checks(check, dtype) -> None:
    """The kernels beyond grouped GEMM and plain paged attention, each against its reference: the
    masked grouped GEMM (DeepEP's low-latency layout), block-FP8 linear layers and experts (weight
    only and W8A8, with the activation-quantization kernel), sliding-window / sink / chunked
    attention, the Gated DeltaNet kernels and DeepSeek Sparse Attention's indexer and sparse MLA."""
    from attention.backends import dsa as dsa_ref
    from attention.backends import triton_dsa
    from moe_serve.kernels import fp8_quant
    from moe_serve.kernels.fp8_linear import fp8_linear_triton
    from moe_serve.kernels.gated_delta import reference as gd_ref
    from moe_serve.kernels.gated_delta import triton_kernels as gd_tri
    from moe_serve.kernels.grouped_gemm.masked import masked_experts_triton
    from moe_serve.quantization.fp8 import dequantize_blocks, quantize_blocks

    g = torch.Generator().manual_seed(1)
    tol = CHECK_RTOL[dtype]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEV)

    def masked_err():
        E, C, D, F, counts = 4, 21, 72, 40, [0, 5, 21, 13]
        x, w13, w2 = rnd(E, C, D).to(dtype), rnd(E, 2 * F, D, scale=D ** -0.5).to(dtype), rnd(E, D, F, scale=F ** -0.5).to(dtype)
        count = torch.tensor(counts, dtype=torch.int32, device=DEV)
        got = masked_experts_triton(x, count, w13, w2)
        errs = []
        for e, n in enumerate(counts):
            if n:
                xe = x[e, :n].double().cpu()
                h = torch.nn.functional.silu(xe @ w13[e, :F].double().cpu().T) * (xe @ w13[e, F:].double().cpu().T)
                errs.append(rel_err(got[e, :n], h @ w2[e].double().cpu().T))
        return max(errs)

    check(f"masked grouped GEMM {dtype}", tol, masked_err)
    if dtype == torch.bfloat16:
        def quant_diff():
            x = rnd(7, 300, scale=30).to(dtype)
            q, sc = fp8_quant.quantize_per_token_group(x, 128)
            q_ref, s_ref = fp8_quant.quantize_per_token_group_reference(x, 128)
            return float((q.float() - q_ref.float()).abs().max() + (sc - s_ref).abs().max())

        check("fp8 activation quantization (per token, 128 channels)", 1e-30, quant_diff)

        def fp8_linear_err(act_quant):
            M, N, K, block = 9, 150, 300, (128, 128)
            w = rnd(N, K, scale=K ** -0.5)
            q, sc = quantize_blocks(w.cpu(), block)
            x = rnd(M, K).to(dtype)
            xd = x.double().cpu()
            if act_quant:
                xq, xs = fp8_quant.quantize_per_token_group_reference(x.cpu(), 128)
                xd = xq.double() * xs.double().repeat_interleave(128, 1)[:, :K]
            want = xd @ dequantize_blocks(q, sc, block, torch.float64).T
            return rel_err(fp8_linear_triton(x, q.to(DEV), sc.to(DEV), block, act_quant=act_quant), want)

        check("fp8 linear, weight only (w8a16)", 2e-2, lambda: fp8_linear_err(False))
        check("fp8 linear, W8A8", 2e-2, lambda: fp8_linear_err(True))

        def fp8_experts_err():
            T, E, K, D, F, block = 11, 6, 2, 256, 128, (128, 128)
            args = list(moe_inputs(T, E, E, K, D, F, dtype, seed=3))
            deq = []
            for i in (1, 2):  # w13, w2 per expert to FP8 blocks
                qs = [quantize_blocks(w.float().cpu(), block) for w in args[i]]
                args[i] = torch.stack([q for q, _ in qs]).to(DEV)
                scales = torch.stack([sc for _, sc in qs]).to(DEV)
                deq.append((args[i], scales, torch.stack([dequantize_blocks(q, sc, block, torch.float64)
                                                          for q, sc in qs])))
            got = fused_experts_triton(args[0], args[1], args[2], args[3], args[4], w13_scale=deq[0][1],
                                       w2_scale=deq[1][1], scale_block=block)
            want = fused_experts_float64(args[0].cpu(), deq[0][2], deq[1][2], args[3].cpu(), args[4].cpu())
            return rel_err(got, want)

        check("fp8 experts, weight only", 2e-2, fp8_experts_err)

    def windowed_err(**kw):
        meta, (q, k, v) = attn_inputs(2, 90, 1, 8, 2, 64, 16, dtype, seed=9)
        if kw.get("sinks") is not None:
            kw["sinks"] = kw["sinks"].to(DEV)
        got = triton_paged.paged_attention(q, k, v, meta, 0.125, **kw)
        ref_kw = {k2: (v2.cpu() if isinstance(v2, torch.Tensor) else v2) for k2, v2 in kw.items()}
        want = attn_ref.paged_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), _cpu_meta(meta), 0.125,
                                        **ref_kw)
        return rel_err(got, want)

    check(f"paged attention, sliding window 24 {dtype}", tol, lambda: windowed_err(sliding_window=24))
    check(f"paged attention, sinks {dtype}", tol, lambda: windowed_err(sinks=torch.randn(8, generator=g)))
    check(f"paged attention, chunked 32 {dtype}", tol, lambda: windowed_err(attention_chunk=32))

    def gated_delta_err():
        B, H, Kd, Vd, C, W = 3, 4, 64, 64, 48, 4
        q_lens, ctx = [1, 9, 1], [5, 0, 3]
        T = sum(q_lens)
        slots = torch.tensor([2, 0, 5], device=DEV)
        q, k, v = rnd(T, H, Kd).to(dtype), rnd(T, H, Kd).to(dtype), rnd(T, H, Vd).to(dtype)
        gdec, beta = -torch.rand(T, H, generator=g).to(DEV), torch.rand(T, H, generator=g).to(DEV).to(dtype)
        state = rnd(6, H, Kd, Vd, scale=0.1)
        state_ref = state.double().cpu()
        got = gd_tri.gated_delta_rule(q, k, v, gdec, beta, state, slots, q_lens, ctx, Kd ** -0.5)
        want = gd_ref.gated_delta_rule(q.double().cpu(), k.double().cpu(), v.double().cpu(), gdec.double().cpu(),
                                       beta.double().cpu(), state_ref, slots.cpu(), q_lens, ctx, Kd ** -0.5)
        x, w = rnd(T, C).to(dtype), rnd(C, W, scale=0.5).to(dtype)
        cs = rnd(6, C, W - 1).to(dtype)
        cs_ref = cs.double().cpu()
        y = gd_tri.causal_conv1d(x, w, None, cs, slots, q_lens, ctx)
        y_ref = gd_ref.causal_conv1d(x.double().cpu(), w.double().cpu(), None, cs_ref, slots.cpu(), q_lens, ctx)
        return max(rel_err(got, want), rel_err(state, state_ref), rel_err(y, y_ref))

    check(f"gated delta rule + conv1d (prefill and decode) {dtype}", max(tol, 1e-4), gated_delta_err)

    def dsa_err():
        meta, (q, q_pe, cache) = attn_inputs(3, 120, 1, 16, 1, 512, 16, dtype, seed=4, mla_rope=64)
        keys = rnd(cache.shape[0], cache.shape[1], 128).to(dtype)
        qi, wi = rnd(q.shape[0], 16, 128).to(dtype), torch.rand(q.shape[0], 16, generator=g).to(DEV)
        sel = triton_dsa.dsa_topk(qi, wi, keys, meta, 32, 128 ** -0.5)
        cmeta = _cpu_meta(meta)
        sel_ref = dsa_ref.dsa_topk(qi.double().cpu(), wi.double().cpu(), keys.double().cpu(), cmeta, 32, 128 ** -0.5)
        agree = sum(len(set(a) & set(b)) for a, b in zip(sel.cpu().tolist(), sel_ref.tolist())) / sel_ref.numel()
        got = triton_paged.sparse_mla_attention(q, q_pe, cache, meta, sel, 576 ** -0.5)
        want = dsa_ref.sparse_mla_attention(q.double().cpu(), q_pe.double().cpu(), cache.double().cpu(), cmeta,
                                            sel.cpu(), 576 ** -0.5)
        return max(rel_err(got, want), 1.0 - agree if dtype == torch.float32 else 0.0)

    check(f"DSA indexer top-k + sparse MLA {dtype}", tol, dsa_err)


# ---- timing ---------------------------------------------------------------------------------------

def sol_row(kind, name, t_tri, t_graph, t_ref, nbytes, flops, bw, peak, **extra) -> dict:
    """One table row; % of SOL uses the CUDA-graph time where measured (launch overhead excluded)."""
    sol_ms = max(nbytes / bw, flops / peak) * 1e3
    best = t_graph if t_graph is not None else t_tri
    return {"kind": kind, "shape": name, "triton_ms": t_tri, "triton_graph_ms": t_graph, "torch_ms": t_ref,
            "sol_ms": sol_ms, "pct_of_sol": 100 * sol_ms / best, "speedup_vs_torch": t_ref / best,
            "bytes": nbytes, "flops": flops, **extra}


def bench_grouped_gemm(bw: float, peak: float) -> list[dict]:
    rows = []
    models = [("qwen3-tiny", 16, 16, 4, 64, 48), ("dsv3-tiny", 32, 8, 4, 96, 64)] if SMOKE else MOE_MODELS
    decode, prefill = ((1, 4), (64,)) if SMOKE else (DECODE_T, PREFILL_T)
    for name, E_total, E, K, D, F in models:
        weights = None
        for T in decode + prefill:
            x, w13, w2, tw, ids = moe_inputs(T, E_total, E, K, D, F, torch.bfloat16, seed=T, weights=weights)
            weights = (w13, w2)
            out = torch.empty_like(x)
            f_tri = lambda: fused_experts_triton(x, w13, w2, tw, ids, out_TD=out)  # noqa: E731
            f_ref = lambda: fused_experts_reference(x, w13, w2, tw, ids)  # noqa: E731
            err = rel_err(f_tri(), f_ref())  # both bf16: each rounds h and y once
            t_tri = timeit(f_tri)
            t_graph = timeit(f_tri, graph=True) if T in decode and not SMOKE else None
            t_ref = timeit(f_ref)
            valid = ids[ids >= 0]
            active = int(torch.unique(valid).numel())
            # Minimum traffic: each routed-to expert's weights once, x in, out back.
            nbytes = active * 3 * F * D * 2 + 2 * T * D * 2
            flops = 6 * int(valid.numel()) * F * D
            rows.append(sol_row("grouped_gemm", f"{name} T={T}", t_tri, t_graph, t_ref, nbytes, flops, bw, peak,
                                rel_err_vs_torch=err, active_experts=active))
            print_row(rows[-1])
        del weights
    return rows


def bench_attention(bw: float, peak: float) -> list[dict]:
    rows = []
    ctx = 128 if SMOKE else 8192
    gqa = (8, 2, 64) if SMOKE else (32, 4, 128)  # Qwen3-30B-A3B: 32 q heads, 4 kv heads, head dim 128
    mla = (16, 64, 16) if SMOKE else (128, 512, 64)  # DeepSeek-V3: 128 heads, L=512, R=64
    for B in ((1, 2) if SMOKE else (1, 64)):
        N, G, H = gqa
        meta, (q, k, v) = attn_inputs(B, ctx, 1, N, G, H, 16, torch.bfloat16, seed=B)
        out = torch.empty_like(q)
        f_tri = lambda: triton_paged.paged_attention(q, k, v, meta, H ** -0.5, out_TNH=out)  # noqa: E731
        f_ref = lambda: attn_ref.paged_attention(q, k, v, meta, H ** -0.5)  # noqa: E731
        err = rel_err(f_tri(), f_ref())
        t_tri, t_graph, t_ref = timeit(f_tri), None if SMOKE else timeit(f_tri, graph=True), timeit(f_ref)
        rows.append(sol_row("paged_decode", f"gqa N={N} G={G} H={H} B={B} ctx={ctx}", t_tri, t_graph, t_ref,
                            B * ctx * G * 2 * H * 2 + 2 * B * N * H * 2, 4 * B * N * ctx * H, bw, peak,
                            rel_err_vs_torch=err))
        print_row(rows[-1])
        del k, v
        N, L, R = mla
        meta, (q, q_pe, cache) = attn_inputs(B, ctx, 1, N, 1, L, 64, torch.bfloat16, seed=B, mla_rope=R)
        out = torch.empty_like(q)
        scale = (L + R) ** -0.5
        f_tri = lambda: triton_paged.mla_paged_attention(q, q_pe, cache, meta, scale, out_TNL=out)  # noqa: E731
        f_ref = lambda: attn_ref.mla_paged_attention(q, q_pe, cache, meta, scale)  # noqa: E731
        err = rel_err(f_tri(), f_ref())
        t_tri, t_graph, t_ref = timeit(f_tri), None if SMOKE else timeit(f_tri, graph=True), timeit(f_ref)
        rows.append(sol_row("mla_decode", f"mla N={N} L={L} R={R} B={B} ctx={ctx}", t_tri, t_graph, t_ref,
                            B * ctx * (L + R) * 2 + B * N * (2 * L + R) * 2, 2 * B * N * ctx * (2 * L + R), bw, peak,
                            rel_err_vs_torch=err))
        print_row(rows[-1])
        del cache
    return rows


HEADER = (f"{'kernel':13s} {'shape':40s} {'triton us':>10s} {'graph us':>9s} {'torch us':>10s} {'SOL us':>8s} "
          f"{'%SOL':>6s} {'x torch':>8s} {'err':>8s}")


def format_row(r: dict) -> str:
    graph = f"{r['triton_graph_ms'] * 1e3:9.1f}" if r["triton_graph_ms"] is not None else f"{'-':>9s}"
    return (f"{r['kind']:13s} {r['shape']:40s} {r['triton_ms'] * 1e3:10.1f} {graph} {r['torch_ms'] * 1e3:10.1f} "
            f"{r['sol_ms'] * 1e3:8.1f} {r['pct_of_sol']:6.1f} {r['speedup_vs_torch']:8.2f} {r['rel_err_vs_torch']:8.1e}")


def print_row(r: dict) -> None:
    print(format_row(r), flush=True)


def environment() -> dict:
    env = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "cuda": torch.version.cuda, "interpreter": SMOKE}
    if DEV.type == "cuda":
        props = torch.cuda.get_device_properties(DEV)
        env.update(gpu=torch.cuda.get_device_name(DEV), sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2 ** 30, 1))
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = "unknown"
    else:
        env.update(gpu="cpu (Triton interpreter)", driver="n/a")
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device visible; run on a GPU machine, or use --smoke to exercise the "
              "script on the CPU through the Triton interpreter.", file=sys.stderr)
        return 2
    t_start = time.time()
    env = environment()
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    torch.manual_seed(0)
    checks, ran, never = [], [], []
    if not args.skip_checks:
        from moe_serve.kernels import specialization

        print("correctness (each kernel against its reference on this device):", flush=True)
        with specialization.record(run=True) as launches:
            checks = run_checks()
        ran = sorted({x.kernel for x in launches})
        never = [k for k in specialization.KERNELS if k not in ran]
        print(f"kernels checked: {len(ran)} of the {len(specialization.KERNELS)} the engine can launch"
              + (f"; never launched: {never}" if never else " (all)"), flush=True)
    bw, peak = measure_roofline()
    print(f"measured: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    print(HEADER)
    rows = bench_grouped_gemm(bw, peak) + bench_attention(bw, peak)
    failed = [c["check"] for c in checks if not c["pass"]]
    # The timed shapes (prefill T=2048..8192 included) are checked too: Triton against the torch
    # reference, both in bf16 (each rounds h and y once).
    for r in rows:
        r["pass"] = r["rel_err_vs_torch"] < BENCH_RTOL
        if not r["pass"]:
            failed.append(f"{r['kind']} {r['shape']} rel_err_vs_torch={r['rel_err_vs_torch']:.2e} >= {BENCH_RTOL}")
            print(f"  FAIL  {failed[-1]}", flush=True)
    elapsed = time.time() - t_start

    stamp = time.strftime("%Y%m%d-%H%M%S")
    gpu = env["gpu"].split(" (")[0].replace(" ", "_")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = args.out_dir / f"kernels_{gpu}_{stamp}"
    report = {"environment": env, "roofline": {"copy_bytes_per_s": bw, "bf16_flops_per_s": peak},
              "checks": checks, "kernels_checked": ran, "kernels_never_launched": never, "benchmarks": rows,
              "failed_checks": failed, "elapsed_s": elapsed}
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["environment: " + ", ".join(f"{k}={v}" for k, v in env.items()),
             f"measured: copy bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s",
             f"checks: {len(checks) + len(rows) - len(failed)}/{len(checks) + len(rows)} passed"
             + (f"; FAILED: {failed}" if failed else ""),
             f"kernels checked: {ran}" + (f"; never launched: {never}" if never else ""),
             "%SOL and 'x torch' use the CUDA-graph time where there is one (L2 not flushed between replays).",
             HEADER] + [format_row(r) for r in rows] + [f"elapsed {elapsed:.0f} s"]
    base.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"checks: {len(checks) + len(rows) - len(failed)}/{len(checks) + len(rows)} passed; wrote {base}.json and .txt "
          f"in {elapsed:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
