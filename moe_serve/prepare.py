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
    memory-bound decode step reads; their panel kernel widens each block of rows once per call for
    prefill rows, up to its sizes: moe_serve/kernels/cpu_ops)."""
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
    from moe_serve.layers.embedding import Embedding
    from moe_serve.layers.linear import Linear

    from moe_serve.layers.experts import PackedExperts
    from moe_serve.platform import fp8_activation_quant, int8_activation_quant

    target = gemm_weight_dtype(model_dtype, device, c_kernels)
    for m in model.modules():  # block-FP8 layers: which kernel runs them is the platform's decision
        if isinstance(m, Linear) and m.weight_scale_inv is not None:
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0  # W8A8's k tiles
        elif isinstance(m, GroupedExperts) and m.fp8_block is not None:
            m.fp8_act_quant = fp8_activation_quant(device) and m.fp8_block[1] % 16 == 0
        # W8A8 int8 checkpoints: the packed kernels' int8 form takes 8-bit per-channel weights
        elif isinstance(m, Linear) and m.qweight is not None and m.int8_activations:
            m.packed_act_quant = (int8_activation_quant(device) and m.packed_bits == 8
                                  and m.packed_group == m.in_features)
        elif isinstance(m, PackedExperts) and m.int8_activations:
            m.act_quant = int8_activation_quant(device) and m.widths == (8, 8) and m.group_sizes == (m.D, m.F)
    params_dtype = params_dtype or model_dtype
    if target == params_dtype:
        return 0
    added = 0
    done: dict[int, nn.Parameter] = {}  # a parameter converted once, wherever it is shared (a tied head)
    narrowing = params_dtype != model_dtype  # float32 activations over the model's bfloat16 weights
    for m, name in gemm_params(model, narrowing):
        if isinstance(m, Linear) and name == "weight" and (m.weight_scale_inv is not None or m.qweight is not None):
            m.dequant_dtype = target  # its FP8 blocks (or packed int4 / int8) dequantize straight to the GEMM dtype
        p = getattr(m, name)
        if p is None or p.dtype == target or p.dtype == torch.float8_e4m3fn:  # FP8 stays FP8
            continue
        if id(p) not in done:
            added += p.numel() * (torch.empty((), dtype=target).element_size() - p.element_size())
            done[id(p)] = nn.Parameter(p.detach().to(target), requires_grad=False)
        setattr(m, name, done[id(p)])
    if narrowing:
        for m in model.modules():
            if isinstance(m, Embedding):
                m.out_dtype = params_dtype
        log.info("activations, norms, attention and the KV cache in %s over %s GEMM weights and embedding table "
                 "(our C kernels widen them in registers): %.1f MiB of weights", str(params_dtype).replace("torch.", ""),
                 str(target).replace("torch.", ""), sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    else:
        log.info("GEMM weights kept in %s on this CPU (no %s matrix instructions): +%.1f MiB, converted once at load",
                 str(target).replace("torch.", ""), str(model_dtype).replace("torch.", ""), added / 2**20)
    return added


def gemm_params(model: nn.Module, with_embedding: bool = False):
    """(module, parameter name) of every GEMM weight kept in the GEMM dtype: linear layers' weights
    and biases (not those a layer uses directly in torch ops), the stacked expert tensors, the LM
    head (a head tied to the embedding gets its own copy unless the table goes too), and with
    with_embedding the embedding tables (their rows then widened to the activations' dtype)."""
    from expert_parallel.runtime.layer import GroupedExperts
    from moe_serve.layers.embedding import Embedding, LMHead
    from moe_serve.layers.linear import Linear

    if with_embedding:
        for m in model.modules():
            if isinstance(m, Embedding):
                yield m, "weight"
    for m in model.modules():
        if isinstance(m, Linear) and not getattr(m, "weight_used_directly", False):
            yield m, "weight"
            yield m, "bias"
        elif isinstance(m, GroupedExperts):
            yield from ((m, n) for n in ("w13", "w2", "w13_bias", "w2_bias"))  # None: MXFP4 / no biases
        elif isinstance(m, LMHead):
            yield m, "weight"


def narrow_before_load(model: nn.Module, target: torch.dtype, activation_dtype: torch.dtype) -> None:
    """A model built in `activation_dtype` whose GEMM weights and embedding tables are kept in
    `target` (EngineConfig.activation_dtype): make those parameters `target` before the loader
    fills them, so the wider copy never exists (its untouched allocation is given back)."""
    from moe_serve.layers.embedding import Embedding

    done: dict[int, nn.Parameter] = {}
    for m, name in gemm_params(model, with_embedding=True):
        p = getattr(m, name)
        if p is None or p.dtype != activation_dtype:
            continue
        if id(p) not in done:
            done[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=target, device=p.device), requires_grad=False)
        setattr(m, name, done[id(p)])
        if isinstance(m, Embedding):
            m.out_dtype = activation_dtype


def fuse_projections(model: nn.Module, device: torch.device) -> int:
    """Projections that read the same input run as one GEMM: for every module that names such
    groups (`fusable_projections()`, e.g. attention's q, k and v), when the group's Linear layers
    are plain (no block-FP8 scales, one dtype, all with or all without bias, weights not used
    directly), their weights (and biases) are stacked into one tensor of which each layer's own
    parameter becomes a row view: no memory is added, the checkpoint names stay, and the module
    gets the stacked tensors (`set_fused`). One weight stream and one kernel call instead of three
    (on the CPU each call's host work is a few microseconds a layer). After the weights are placed
    (place_weights_on_huge_pages): the stacked weight goes on huge pages itself where that applies.
    Packed int4 / int8 layers of one kind (bits, group, input, bias, activation quantization) are
    stacked likewise, codes, scales and offsets, into a Linear of their own the module runs
    (`set_fused_packed`): a packed decode GEMV of a small k or v projection is short enough that
    its call's thread start and end weigh (on this project's Xeon, Q4_0 q/k/v of 1024 x 1024 / 256 /
    256 as three calls ran at 14-19 GB/s). Returns the groups fused."""
    from moe_serve.layers.linear import Linear

    huge = device.type == "cpu" and transparent_huge_pages() == "madvise"
    fused = 0
    for m in model.modules():
        groups = m.fusable_projections() if hasattr(m, "fusable_projections") else []
        for names in groups:
            layers = [getattr(m, n, None) for n in names]
            if hasattr(m, "set_fused_packed") and _packed_alike(layers):
                m.set_fused_packed(names, _stack_packed(layers))
                fused += 1
                continue
            if not all(type(lin) is Linear and lin.weight_scale_inv is None and lin.qweight is None
                       and not getattr(lin, "weight_used_directly", False) for lin in layers):
                continue
            ws = [lin.weight for lin in layers]
            if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or len({lin.bias is None for lin in layers}) != 1:
                continue
            weight = torch.cat([w.detach() for w in ws])
            if huge and weight.numel() * weight.element_size() >= HUGE_PAGE:
                placed = on_huge_pages(weight)
                weight = placed if placed is not None else weight  # None: refused
            bias = None if layers[0].bias is None else torch.cat([lin.bias.detach() for lin in layers])
            sizes = [w.shape[0] for w in ws]
            for lin, w in zip(layers, weight.split(sizes)):
                lin.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                for lin, b in zip(layers, bias.split(sizes)):
                    lin.bias = nn.Parameter(b, requires_grad=False)
            m.set_fused(names, weight, bias)
            fused += 1
    if fused:
        log.info("%d groups of projections fused into one GEMM each (q/k/v)", fused)
    return fused


def compact_packed_weights(model: nn.Module, device: torch.device) -> int:
    """On a CPU, packed int4 / int8 weights in fewer bytes (PackedWeight.compact): those whose offsets
    are exactly -z * scales (the symmetric formats: GGUF Q4_0, Q8_0, Q6_K, GPTQ and compressed-tensors
    without zero points) drop their offsets array and keep the code z (PackedWeight.zero), and scales
    that float16 holds exactly (GGUF's Q4_0 / Q8_0 d, GPTQ's) are kept in float16; our C kernels read
    both. A decode step then reads 0.5625 bytes a Q4_0 weight instead of 0.75 (Q8_0: 1.0625, not 1.25),
    and the memory is freed. Expert layers compact a part (gate/up, down) in every MoE layer or in
    none, so that their slot tensors stay alike for a rebalance. On CUDA the Triton kernels read the
    weights as loaded. Returns the bytes freed; before the weights are placed and fused."""
    from moe_serve.layers.experts import PackedExperts
    from moe_serve.layers.linear import Linear

    if device.type != "cpu":
        return 0
    freed = 0
    for m in model.modules():
        if isinstance(m, Linear):
            freed += m.compact_packed()
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    for part in ("w13", "w2"):
        zs = [m.offsets_zero(part) for m in experts]
        if experts and all(z is not None for z in zs):
            freed += sum(m.drop_offsets(part, z) for m, z in zip(experts, zs))
        hs = [m.half_scales(part) for m in experts]
        if experts and all(h is not None for h in hs):
            freed += sum(m.narrow_scales(part, h) for m, h in zip(experts, hs))
    if freed:
        log.info("packed weights: offsets that are a zero code's and scales exact in float16 kept as such (%.1f MiB "
                 "freed, not read by a decode step)", freed / 2**20)
    return freed


def int8_activations_on(model: nn.Module, mode: bool | None, gguf: bool) -> int:
    """--cpu-int8-activations: whether the packed int4 / int8 layers' calls in our C kernels round their
    activations to int8 (cpu_ops/quant.c's int8-activation tiles, where its weights' group fits them).
    mode True: every packed layer (a model without one is refused); None (the default): those of a GGUF
    file, whose own runtime computes so (llama.cpp takes each product over activations rounded to 8-bit
    blocks), where this CPU's build has vector tiles for it (AVX-512, AVX2); False: none. Only called
    where our C kernels run them (a CPU, cpu_c experts and linear layers, not --batch-invariant).
    Returns the layers."""
    from moe_serve.kernels.cpu_ops import quant
    from moe_serve.layers.experts import PackedExperts
    from moe_serve.layers.linear import Linear

    layers = [m for m in model.modules() if ((isinstance(m, Linear) and m.qweight is not None)
                                             or (isinstance(m, PackedExperts) and not m.float8))
              and (mode or (mode is None and gguf))]
    if mode and not layers:
        raise ValueError("--cpu-int8-activations: this model has no packed int4 / int8 layers (GGUF, GPTQ, AWQ or "
                         "compressed-tensors integer weights) whose activations it would round")
    if layers and mode is None and not quant.act8_vector():
        log.info("packed layers keep float activations: this CPU build's int8-activation tiles are plain C "
                 "(--cpu-int8-activations takes them anyway)")
        return 0
    for m in layers:
        m.cpu_int8_act = True
    if layers:
        why = "--cpu-int8-activations" if mode else "a GGUF file: llama.cpp's numerics"
        log.info("%d packed layers round their activations to int8 per weight group in our C kernels (%s; "
                 "--no-cpu-int8-activations keeps them float)", len(layers), why)
    return len(layers)


def log_float_w8a8(model: nn.Module) -> int:
    """Log the layers whose checkpoint quantizes their inputs to int8 per token (W8A8) that run on float
    inputs here (neither the Triton packed kernels' int8 form nor our C kernels' int8 tiles)."""
    n = sum(bool(getattr(m, "int8_activations", False)) and not (
        getattr(m, "packed_act_quant", False) or getattr(m, "act_quant", False) or getattr(m, "cpu_int8_act", False))
        for m in model.modules())
    if n:
        log.info("W8A8 checkpoint: %d layers' inputs stay float (their checkpoint quantizes them to int8 per token; "
                 "the Triton packed kernels on CUDA do for 8-bit weights per channel, our C kernels on a CPU with "
                 "--cpu-int8-activations, per token where the weights are per channel)", n)
    return n


def _packed_alike(layers: list) -> bool:
    """Packed Linear layers that one packed GEMM can run as one: same bits, group, input size,
    bias or not, activation quantization, dtype to dequantize to, device."""
    from moe_serve.layers.linear import Linear

    if not all(type(lin) is Linear and lin.qweight is not None and lin.weight_scale_inv is None for lin in layers):
        return False
    return len({(lin.packed_bits, lin.packed_group, lin.in_features, lin.bias is None, lin.int8_activations,
                 lin.packed_act_quant, lin.dequant_dtype, lin.qweight.device, lin.qoffsets is None, lin.packed_zero,
                 lin.qscales.dtype)
                for lin in layers}) == 1


def _stack_packed(layers: list):
    """One packed Linear whose codes, scales, offsets (and bias) are the layers' stacked by rows;
    each layer's own parameters become row views of them (no memory added)."""
    from moe_serve.layers.linear import Linear

    first, sizes = layers[0], [lin.out_features for lin in layers]
    with torch.device("meta"):
        fused = Linear(first.in_features, sum(sizes), bias=first.bias is not None)
    fused.weight = None
    held = ("qweight", "qscales") + (("qoffsets",) if first.qoffsets is not None else ())
    for name in held + (("bias",) if first.bias is not None else ()):
        stacked = torch.cat([getattr(lin, name).detach() for lin in layers])
        setattr(fused, name, nn.Parameter(stacked, requires_grad=False))
        for lin, part in zip(layers, stacked.split(sizes)):
            setattr(lin, name, nn.Parameter(part, requires_grad=False))
    for attr in ("packed_bits", "packed_group", "packed_zero", "int8_activations", "packed_act_quant", "dequant_dtype",
                 "cpu_int8_act"):
        setattr(fused, attr, getattr(first, attr))
    return fused


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
