"""Weights prepared once, at load, for the device the platform chose: a forward never converts a
weight.

On a CPU without bf16/fp16 matrix instructions (no AVX512-BF16, no AMX), half-precision GEMMs run
element by element, many times slower than float32 (moe_serve/kernels/cpu_gemm.py). There the GEMM weights
(linear layers, the stacked expert weights, an untied LM head) of a half-precision model are kept
in float32, converted once here, and the GEMMs run in float32 on upcast activations; embeddings,
norms, activations and the KV cache stay in the model's dtype. The memory cost is logged. On CUDA,
and on CPUs with half-precision matrix instructions, nothing changes.

Where our C kernels run every layer kind of a bfloat16 model on a CPU, the model is built and
loaded in float32 (EngineConfig.activation_dtype) and its GEMM weights and embedding table are
narrowed back to bfloat16 here: activations, norms, attention and the KV cache stay float32.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("moe_serve.prepare")


def gemm_weight_dtype(model_dtype: torch.dtype, device: torch.device, c_kernels: bool = False) -> torch.dtype:
    """The dtype GEMM weights are stored in on this device (the platform's decision): the model's,
    except half precision on a CPU without half-precision matrix instructions, where torch's GEMMs
    would convert the weights on every call: float32 there, unless our C kernels run the experts
    and the linear layers (c_kernels), which widen bfloat16 weights in registers (half the bytes a
    memory-bound decode step reads; longer prefill rows convert per call)."""
    from moe_serve.kernels.cpu_gemm import cpu_has_half_matmul

    if device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16) and not cpu_has_half_matmul():
        return model_dtype if c_kernels and model_dtype == torch.bfloat16 else torch.float32
    return model_dtype


def prepare_gemm_weights(model: nn.Module, model_dtype: torch.dtype, device: torch.device,
                         c_kernels: bool = False, params_dtype: torch.dtype | None = None) -> int:
    """Convert GEMM weights to `gemm_weight_dtype` once; returns the bytes this adds (negative:
    saves). params_dtype: what the model was built and loaded in, when not model_dtype (a bfloat16
    model under float32 activations, EngineConfig.activation_dtype): its GEMM weights and embedding
    table are narrowed back to the model's dtype here, the rest stays in the activations' dtype."""
    from expert_parallel.runtime.layer import GroupedExperts
    from moe_serve.layers.embedding import Embedding, LMHead
    from moe_serve.layers.linear import Linear

    from moe_serve.platform import fp8_activation_quant

    target = gemm_weight_dtype(model_dtype, device, c_kernels)
    for m in model.modules():  # block-FP8 layers: which kernel runs them is the platform's decision
        if isinstance(m, Linear) and m.weight_scale_inv is not None:
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0  # W8A8's k tiles
        elif isinstance(m, GroupedExperts) and m.fp8_block is not None:
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0
    params_dtype = params_dtype or model_dtype
    if target == params_dtype:
        return 0
    added = 0
    done: dict[int, nn.Parameter] = {}  # a parameter converted once, wherever it is shared (a tied head)

    def convert(module: nn.Module, name: str) -> None:
        nonlocal added
        p = getattr(module, name)
        if p is None or p.dtype == target or p.dtype == torch.float8_e4m3fn:  # FP8 stays FP8
            return
        if id(p) not in done:
            added += p.numel() * (torch.empty((), dtype=target).element_size() - p.element_size())
            done[id(p)] = nn.Parameter(p.detach().to(target), requires_grad=False)
        setattr(module, name, done[id(p)])

    narrowing = params_dtype != model_dtype  # float32 activations over the model's bfloat16 weights
    if narrowing:  # the table too (read a row per token), its rows widened as they are looked up
        for m in model.modules():
            if isinstance(m, Embedding):
                convert(m, "weight")
                m.out_dtype = params_dtype

    for m in model.modules():
        if isinstance(m, Linear) and not getattr(m, "weight_used_directly", False):
            if m.weight_scale_inv is not None:
                m.dequant_dtype = target  # its FP8 blocks dequantize straight to the GEMM dtype
            convert(m, "weight")
            convert(m, "bias")
        elif isinstance(m, GroupedExperts):
            convert(m, "w13")  # None for MXFP4 experts, whose uint8 blocks stay as they are
            convert(m, "w2")
            convert(m, "w13_bias")  # GPT-OSS's expert biases (None elsewhere)
            convert(m, "w2_bias")
        elif isinstance(m, LMHead):
            # A head tied to the embedding gets its own float32 copy; the embedding keeps its dtype.
            convert(m, "weight")
    if narrowing:
        log.info("activations, norms, attention and the KV cache in %s over %s GEMM weights and embedding table "
                 "(our C kernels widen them in registers): %.1f MiB of weights", str(params_dtype).replace("torch.", ""),
                 str(target).replace("torch.", ""), sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    else:
        log.info("GEMM weights kept in %s on this CPU (no %s matrix instructions): +%.1f MiB, converted once at load",
                 str(target).replace("torch.", ""), str(model_dtype).replace("torch.", ""), added / 2**20)
    return added


# --- huge pages for the weights a CPU decode step streams ------------------------------------------
HUGE_PAGE = 2 << 20


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None off Linux."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else None


def on_huge_pages(t: torch.Tensor) -> torch.Tensor | None:
    """A contiguous copy of a CPU tensor in a fresh anonymous mapping asked for as transparent huge
    pages (2 MiB aligned, madvised before its first touch, so the copy's page faults take huge
    pages; memory from torch's allocator may be recycled heap whose small pages are already
    mapped); None if refused. Only its whole 2 MiB pages are asked for: a partial last one would
    take memory it does not use. The mapping lives as long as the tensor."""
    import mmap

    nbytes = t.numel() * t.element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    # anonymous and private (a shared mapping is shmem, whose huge pages are another setting),
    # untouched: no page is mapped yet
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # holds a reference to m
    off = (-raw.data_ptr()) % HUGE_PAGE
    whole = nbytes // HUGE_PAGE * HUGE_PAGE
    try:
        if whole:
            m.madvise(mmap.MADV_HUGEPAGE, off, whole)
    except OSError:
        return None
    out = raw[off:off + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def place_weights_on_huge_pages(model: nn.Module, device: torch.device) -> int:
    """CPU, transparent huge pages in "madvise" mode: move every weight of at least 2 MiB onto huge
    pages, once at load; returns the bytes moved. A decode step streams its weights once each:
    with 4 KiB pages every weight row of 1024 float32 is its own page (a TLB miss and a restart of
    the hardware prefetcher per row). Measured on a one-row GEMV over 512 MB of float32 rows, 1
    thread: 18-20 GB/s on 4 KiB pages, 20-26 on huge pages. In "always" mode they are already huge
    pages, in "never" mode nothing can be done; on CUDA nothing applies. Tensors shared by modules
    (a tied LM head) stay shared."""
    if device.type != "cpu" or transparent_huge_pages() != "madvise":
        return 0
    moved: dict[int, nn.Parameter] = {}
    total = 0
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_contiguous() or p.numel() * p.element_size() < HUGE_PAGE:
                continue
            new = moved.get(id(p))
            if new is None:
                t = on_huge_pages(p.detach())
                if t is None:
                    log.info("weights stay on small pages: madvise(MADV_HUGEPAGE) was refused")
                    return total
                new = moved[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                total += p.numel() * p.element_size()
            m._parameters[name] = new
    if moved:
        log.info("weights on transparent huge pages: %d tensors, %.1f MiB (decode streams them faster)", len(moved),
                 total / 2**20)
    return total
