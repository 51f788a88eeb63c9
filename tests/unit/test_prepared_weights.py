"""Weights are prepared once at load: no step converts a parameter. On a CPU without half-precision
matrix instructions a bf16 model's GEMM weights stay bf16 where our C kernels run the experts and
linear layers (widened in registers), and are float32 from load on where torch's GEMMs would run
them; nothing else is converted."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_serve import LLM, SamplingParams
from moe_serve.prepare import gemm_weight_dtype

_CONVERSIONS = {"_to_copy", "to", "copy_"}


class ParamConversions(TorchDispatchMode):
    """Records every dtype conversion whose source is one of the given tensors' storage."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _CONVERSIONS and args and isinstance(args[0], torch.Tensor) and name != "copy_":
            if args[0].data_ptr() in self.ptrs and (kwargs or {}).get("dtype", args[0].dtype) != args[0].dtype:
                self.seen.append(f"{name} of a {tuple(args[0].shape)} parameter")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["cpu_c", "torch"])
@pytest.mark.parametrize("half_matmul", [True, False], ids=["cpu-with-bf16-matmul", "cpu-without"])
@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_bf16_weights_converted_at_most_once(checkpoints, arch, half_matmul, backend, monkeypatch):
    import moe_serve.kernels.cpu_gemm as cpu_gemm

    # Both kinds of CPU, whichever this one is: the decision and the GEMMs read this function.
    monkeypatch.setattr(cpu_gemm, "cpu_has_half_matmul", lambda: half_matmul)
    llm = LLM(checkpoints[arch], dtype="bfloat16", kv_cache_memory=1 << 22, show_progress=False,
              moe_backend=backend, linear_backend=backend)
    model = llm.engine.runner.model
    gemm = gemm_weight_dtype(torch.bfloat16, torch.device("cpu"), c_kernels=backend == "cpu_c")
    assert gemm == (torch.bfloat16 if half_matmul or backend == "cpu_c" else torch.float32)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    # Where our C kernels run every layer kind, activations, norms and the KV cache are float32
    # over the bfloat16 GEMM weights and table (those kernels compute in float32); else bfloat16.
    act = torch.float32 if backend == "cpu_c" else torch.bfloat16
    assert llm.engine.cfg.activation_dtype == act
    assert model.model.norm.weight.dtype == act
    caches = [t for layer in llm.engine.runner.attn_layers for t in vars(layer).values()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 3]
    assert caches and all(t.dtype == act for t in caches)
    experts = [m for m in model.modules() if hasattr(m, "w13")]
    assert experts and all(m.w13.dtype == gemm and m.w2.dtype == gemm for m in experts)
    mode = ParamConversions(list(model.parameters()))
    with mode:
        out = llm.generate([{"prompt_token_ids": [5, 77, 301, 42]}, {"prompt_token_ids": [9, 8, 7]}],
                           SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert mode.seen == [], mode.seen[:5]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process holding address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_cpu_weights_move_onto_huge_pages_unchanged_and_shared_ones_stay_shared():
    from torch import nn

    from moe_serve.prepare import HUGE_PAGE, place_weights_on_huge_pages, transparent_huge_pages

    mode = transparent_huge_pages()
    if mode != "madvise":
        pytest.skip(f"transparent huge pages are {mode!r} here: only 'madvise' mode asks for them")
    g = torch.Generator().manual_seed(0)
    big = nn.Linear(1024, 2048 + 3, bias=False)  # 8 MiB + 12 KiB: 4 whole huge pages and a tail
    small = nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        big.weight.copy_(torch.randn(big.weight.shape, generator=g))
    tied = nn.Linear(1024, 2048 + 3, bias=False)
    tied.weight = big.weight
    model = nn.ModuleList([big, small, tied]).requires_grad_(False)
    want, small_ptr = big.weight.clone(), small.weight.data_ptr()
    moved = place_weights_on_huge_pages(model, torch.device("cpu"))
    assert moved == big.weight.numel() * 4  # the shared tensor counted once; the small one left alone
    assert torch.equal(big.weight, want) and tied.weight is big.weight and small.weight.data_ptr() == small_ptr
    assert big.weight.data_ptr() % HUGE_PAGE == 0
    assert _anon_huge_kb(big.weight.data_ptr()) >= 4 * HUGE_PAGE // 1024  # the whole pages are huge pages
    assert place_weights_on_huge_pages(model, torch.device("meta")) == 0  # not a CPU: nothing to do


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_qkv_projections_fused_into_views_of_one_weight(checkpoints, quantization):
    """Attention's q, k and v projections run as one GEMM over one stacked weight of which the three
    layers' own weights are row views (no memory added, the values the checkpoint has); block-FP8
    layers (weights with scales) are left as they are."""
    import glob
    import os

    from safetensors.torch import load_file

    from moe_serve.layers.attention import GQASelfAttention

    path = checkpoints["qwen3_moe"]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 22, show_progress=False, quantization=quantization)
    attns = [m for m in llm.engine.runner.model.modules() if isinstance(m, GQASelfAttention)]
    assert attns
    if quantization == "fp8":
        assert all(a.qkv_weight is None for a in attns)
        return
    ckpt = {}
    for f in glob.glob(os.path.join(path, "*.safetensors")):
        ckpt.update(load_file(f))
    names = dict(llm.engine.runner.model.named_modules())
    for a in attns:
        w = a.qkv_weight
        assert w is not None and w.shape[0] == a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features
        row = 0
        for proj in (a.q_proj, a.k_proj, a.v_proj):
            assert proj.weight.data_ptr() == w.data_ptr() + row * w.stride(0) * w.element_size()
            name = next(n for n, m in names.items() if m is proj)
            torch.testing.assert_close(proj.weight, ckpt[f"{name}.weight"].to(w.dtype), rtol=0, atol=0)
            row += proj.out_features
    out = llm.generate([{"prompt_token_ids": [5, 77, 301, 42]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
