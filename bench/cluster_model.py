"""Analytic decode throughput per GPU for a DeepSeek-V3-sized MoE under wide expert parallelism.

Deployment modelled: data-parallel attention (every GPU holds the attention, dense-layer, shared-expert
and lm_head weights and its own sequences' KV cache) and expert parallelism over W GPUs (each holds
(256 + redundant) / W routed experts), DeepEP-low-latency-style dispatch (fp8 tokens, one copy per
(token, expert) pair) and combine (bf16), B sequences per GPU, one token each per step (no MTP).

Per step and GPU, each part is a roofline max(bytes / achievable HBM bandwidth, FLOPs / achievable
FLOP rate):
  dense    attention projections, the 3 dense FFN layers, shared experts, router, lm_head
  attn     MLA core over the KV cache: B * ctx * 61 * (512 + 64) elements read; absorbed-MLA FLOPs
           2 * heads * ((512 + 64) + 512) per (query, cached token)
  moe      local experts that got at least one token (weights read) / B * top_k expert FLOPs
  comm     58 layers * (dispatch + combine): copies within the NVLink domain over NVLink, the rest
           over the scale-out NIC, each direction at link bandwidth * link efficiency, plus a fixed
           latency per collective
step = compute + comm - overlap_efficiency * min(compute, comm)  (two-micro-batch overlap hides at
most the shorter of the two). Throughput = B / step. B is the largest batch that (a) fits the KV cache
in HBM after the weights, (b) stays under --max-batch, and (c) when a per-user speed target is given,
keeps 1 / step above it.

The efficiency factors are the model's only fitted knobs; their defaults are round numbers from
public kernel measurements on Hopper (FlashMLA ~3 TB/s of 3.35 and ~600 of 989 TFLOP/s; DeepEP
low-latency ~40 GB/s on 50 GB/s NICs), not fitted to the figures printed beside the predictions.

Blackwell derate. With those Hopper fractions of peak, the GB200 rows predicted 1.94x (FP8 MoE, BF16
KV) and 1.65x (NVFP4 MoE, FP8 KV) the published figures while the Hopper rows land at 1.02-1.08x.
The peaks themselves are NVIDIA's dense datasheet figures per GPU (GB200: 8 TB/s HBM3e, 2.5 / 5 /
10 PFLOP/s BF16 / FP8 / FP4; 1.8 TB/s NVLink 5 = 900 GB/s each way), so they are not the error.
What differs: the Hopper checks are communication-bound (58 layers of dispatch + combine over
400 Gb/s NICs take half to two thirds of the step), so they barely test the compute fractions; in
an NVL72 domain the traffic stays on NVLink and the step is compute-bound (dense + attention + MoE
~70% of it), so the Hopper fractions of peak are what the GB200 rows rest on. And the two GB200
rows share the same communication (same EP48 domain, same FP8 dispatch) but differ in compute, and
the gap between model and figure scales with their compute: the compute parts would have to take
2.34x (FP8 row) and 2.19x (NVFP4 row) as long to meet the figures exactly, while the communication
alone cannot close both (it would need +16 ms in one row and +7.5 ms in the other from identical
traffic). The sources say why: SGLang's GB200 posts (Part I, 2025-06-16: "kernels not saturating
memory bandwidth or compute capacity" listed as future work; Part II, 2025-09-25) ran the first
Blackwell releases of DeepGEMM, FlashInfer / CUTLASS MLA and DeepEP. So on Blackwell the HBM, GEMM
and attention efficiencies are multiplied by BLACKWELL_DERATE = 0.45 (one factor, fitted to the two
GB200 figures: 1/0.45 = 2.22, between 2.19 and 2.34), which puts both GB200 rows within ~5% of the
figures (the link efficiency is not derated). It is a statement about the software those figures
were measured with, not about the hardware: `--blackwell-derate 1` gives the Hopper-efficiency
prediction, printed beside the calibrated one as an upper bound. The GB300 row uses the same
derate and has no published figure to check it against.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V3 / R1 dimensions (config.json of the released checkpoint)."""

    layers: int = 61
    moe_layers: int = 58
    hidden: int = 7168
    vocab: int = 129280
    heads: int = 128
    q_lora: int = 1536
    kv_lora: int = 512
    rope_dim: int = 64
    nope_dim: int = 128
    v_dim: int = 128
    dense_ffn: int = 18432
    expert_ffn: int = 2048
    experts: int = 256
    top_k: int = 8
    shared_experts: int = 1

    def attn_params(self) -> int:
        D, H = self.hidden, self.heads
        q = D * self.q_lora + self.q_lora * H * (self.nope_dim + self.rope_dim)
        kv = D * (self.kv_lora + self.rope_dim) + self.kv_lora * H * (self.nope_dim + self.v_dim)
        return q + kv + H * self.v_dim * D

    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    def replicated_params(self) -> int:
        """Weights every DP-attention GPU holds and reads each step (lm_head counted separately)."""
        dense_layers = self.layers - self.moe_layers
        return (self.layers * self.attn_params() + dense_layers * 3 * self.hidden * self.dense_ffn
                + self.moe_layers * (self.shared_experts * self.expert_params() + self.experts * self.hidden))

    def kv_elems_per_token(self) -> int:
        return self.layers * (self.kv_lora + self.rope_dim)


@dataclass(frozen=True)
class Hardware:
    """Per-GPU peak numbers (dense tensor FLOP/s; link bandwidths per direction)."""

    name: str
    hbm_bw: float
    hbm_bytes: float
    bf16_flops: float
    fp8_flops: float
    fp4_flops: float | None
    nvlink_bw: float
    nic_bw: float
    nvlink_domain: int
    blackwell: bool = False  # HBM / GEMM / attention efficiencies take BLACKWELL_DERATE (module docstring)


HARDWARE = {
    "h100": Hardware("H100 SXM (8/node, NVLink 450 GB/s, IB 400 Gb/s per GPU)",
                     3.35e12, 80e9, 989e12, 1979e12, None, 450e9, 50e9, 8),
    "h800": Hardware("H800 SXM (8/node, NVLink 200 GB/s, IB 400 Gb/s per GPU)",
                     3.35e12, 80e9, 989e12, 1979e12, None, 200e9, 50e9, 8),
    "gb200": Hardware("GB200 NVL72 (72 GPUs on NVLink 900 GB/s)",
                      8.0e12, 186e9, 2.5e15, 5.0e15, 10e15, 900e9, 50e9, 72, blackwell=True),
    "gb300": Hardware("GB300 NVL72 (72 GPUs on NVLink 900 GB/s)",
                      8.0e12, 279e9, 2.5e15, 5.0e15, 15e15, 900e9, 100e9, 72, blackwell=True),
}
# Fitted to SGLang's two GB200 NVL72 decode figures (CHECKS; reasoning in the module docstring).
BLACKWELL_DERATE = 0.45
# bytes per weight including block scales (fp8: 1 per 128x128 block; nvfp4: 1 fp8 per 16)
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / 16384, "nvfp4": 0.5 + 1 / 16}


@dataclass(frozen=True)
class Scenario:
    hw: str
    ep: int
    ctx: int                        # average KV length per sequence during decode
    weights: str = "fp8"            # routed/shared expert and attention weight format
    kv: str = "bf16"                # KV cache and attention math format
    redundant: int = 0              # extra expert replicas (EPLB)
    max_batch: int = 256            # per-GPU cap, e.g. DeepEP's num_max_dispatch_tokens_per_rank
    user_tps: float | None = None   # per-user tokens/s target, None = saturate
    dispatch_fp8: bool = True


@dataclass(frozen=True)
class Efficiency:
    mem: float = 0.8
    gemm: float = 0.6
    attn: float = 0.6
    link: float = 0.8
    latency_us: float = 15.0       # fixed cost of one dispatch or one combine
    overlap: float = 0.8
    blackwell_derate: float = BLACKWELL_DERATE  # times mem / gemm / attn on Blackwell; 1 = Hopper fractions

    def compute(self, hw: "Hardware") -> tuple[float, float, float]:
        """(mem, gemm, attn) efficiencies on this hardware."""
        k = self.blackwell_derate if hw.blackwell else 1.0
        return self.mem * k, self.gemm * k, self.attn * k


def step_parts(m: ModelConfig, hw: Hardware, sc: Scenario, eff: Efficiency, B: int) -> dict:
    """Seconds per decode step for B sequences per GPU, by part."""
    wb = WEIGHT_BYTES[sc.weights]
    gemm_rate = {"bf16": hw.bf16_flops, "fp8": hw.fp8_flops, "nvfp4": hw.fp4_flops}[sc.weights]
    if gemm_rate is None:
        raise ValueError(f"weights={sc.weights!r} has no tensor-core rate on {hw.name}")
    mem_eff, gemm_eff, attn_eff = eff.compute(hw)
    hbm, gemm = hw.hbm_bw * mem_eff, gemm_rate * gemm_eff
    rep = m.replicated_params()
    lm_head = m.vocab * m.hidden
    dense = max((rep * wb + lm_head * 2) / hbm, 2 * (rep + lm_head) * B / gemm)

    kv_b = 2 if sc.kv == "bf16" else 1
    attn_rate = (hw.bf16_flops if sc.kv == "bf16" else hw.fp8_flops) * attn_eff
    attn_flops = B * sc.ctx * m.layers * 2 * m.heads * (m.kv_lora + m.rope_dim + m.kv_lora)
    attn = max(B * sc.ctx * m.kv_elems_per_token() * kv_b / hbm, attn_flops / attn_rate)

    slots = m.experts + sc.redundant
    per_gpu = slots / sc.ep
    pairs_per_slot = B * sc.ep * m.top_k / slots
    active = per_gpu * (1 - math.exp(-pairs_per_slot))  # Poisson chance a slot gets >= 1 token
    moe = max(m.moe_layers * active * m.expert_params() * wb / hbm,
              m.moe_layers * B * m.top_k * 2 * m.expert_params() / gemm)

    copies = B * m.top_k * (1 - 1 / sc.ep)  # pairs whose expert is on another GPU
    in_domain = (min(hw.nvlink_domain, sc.ep) - 1) / max(sc.ep - 1, 1)
    per_copy = m.hidden * ((1 + 4 / 128) if sc.dispatch_fp8 else 2) + m.hidden * 2  # dispatch + combine
    nvl_t = copies * in_domain * per_copy / (hw.nvlink_bw * eff.link)
    nic_t = copies * (1 - in_domain) * per_copy / (hw.nic_bw * eff.link)
    comm = m.moe_layers * (max(nvl_t, nic_t) + 2 * eff.latency_us * 1e-6)
    return {"dense": dense, "attn": attn, "moe": moe, "comm": comm}


def step_time(parts: dict, overlap: float) -> float:
    compute = parts["dense"] + parts["attn"] + parts["moe"]
    return compute + parts["comm"] - overlap * min(compute, parts["comm"])


def max_batch_by_memory(m: ModelConfig, hw: Hardware, sc: Scenario) -> int:
    """Sequences whose KV fits in 90% of HBM after this GPU's weights (activations in the rest)."""
    wb = WEIGHT_BYTES[sc.weights]
    weights = (m.replicated_params() * wb + 2 * m.vocab * m.hidden * 2
               + (m.experts + sc.redundant) / sc.ep * m.moe_layers * m.expert_params() * wb)
    kv_per_seq = sc.ctx * m.kv_elems_per_token() * (2 if sc.kv == "bf16" else 1)
    return max(0, int((0.9 * hw.hbm_bytes - weights) // kv_per_seq))


def operating_point(m, hw, sc, eff, overlap) -> tuple[int, dict, float]:
    """Largest B within memory, the batch cap and the per-user speed target."""
    B = min(sc.max_batch, max_batch_by_memory(m, hw, sc))
    while B > 1 and sc.user_tps and 1 / step_time(step_parts(m, hw, sc, eff, B), overlap) < sc.user_tps:
        B -= 1
    parts = step_parts(m, hw, sc, eff, max(B, 1))
    return B, parts, step_time(parts, overlap)


# Published decode figures to check against. Each is a claim by its source, measured under conditions
# the scenario approximates; "assumed" marks inputs the source does not state.
CHECKS = [
    ("DeepSeek, 'DeepSeek-V3/R1 Inference System Overview' (open-infra-index, 2025-03-01): ~14.8k "
     "output tok/s per H800 node in decode = ~1,850 per GPU; 24 h average, 20-22 tok/s per user, "
     "average KV length 4,989, EP144 over 18 nodes, 2 routed experts per GPU (32 redundant), FP8 "
     "dispatch / BF16 combine. KV format assumed bf16.",
     Scenario("h800", 144, 4989, redundant=32, user_tps=21.0), 1850.0),
    ("LMSYS/SGLang, 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism "
     "on 96 H100 GPUs' (2025-05-05): 22.3k output tok/s per node of 8 H100 = ~2,790 per GPU, "
     "2,000-token inputs, decode saturated; decode EP72 (9 nodes) and ~100 output tokens assumed; "
     "the later GB200 post says this baseline used simulated MTP, which the model does not have.",
     Scenario("h100", 72, 2050), 2790.0),
    ("LMSYS/SGLang with NVIDIA, 'Deploying DeepSeek on GB200 NVL72 ... (Part I)' (2025-06-16): "
     "7,583 output tok/s per GPU in decode, 2,000-token inputs, 12 trays (EP48), no MTP; BF16 KV.",
     Scenario("gb200", 48, 2050), 7583.0),
    ("LMSYS/SGLang, '... GB200 NVL72 ... (Part II)' (2025-09-25): 9,087 tok/s per GPU with BF16 "
     "attention and FP8 MoE; 13,386 with FP8 attention and NVFP4 MoE (this row), 2,000-token inputs.",
     Scenario("gb200", 48, 2050, weights="nvfp4", kv="fp8"), 13386.0),
    ("Prediction only: a whole GB300 NVL72 rack as one EP72 decode group, 2,000-token inputs, NVFP4 "
     "MoE, FP8 KV. (SGLang's published GB300 figure, 226 tok/s per GPU, is for 128K-input / 8K-output "
     "serving with MTP and a different layout, so it is not compared here.)",
     Scenario("gb300", 72, 2050, weights="nvfp4", kv="fp8"), None),
]


def measured_overlap() -> tuple[float | None, str]:
    """overlap_efficiency from bench/results/*.json measured on CUDA (NCCL), and where it came from.
    Values measured with gloo on CPU are reported but not used: CPU ranks share cores with compute."""
    found, ignored = [], []
    for path in sorted(RESULTS.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for o in data.get("overlap", []) if isinstance(data, dict) else []:
            (found if data.get("device_type") == "cuda" else ignored).append((o["overlap_efficiency"], path.name))
    if found:
        return sum(v for v, _ in found) / len(found), f"measured on CUDA in {', '.join(sorted({p for _, p in found}))}"
    note = "; ".join(f"{p}: {v:.2f} (CPU/gloo, not used)" for v, p in ignored)
    return None, note or "no measurement in bench/results/"


def report(m, sc, eff, overlap, published=None, label=None, sweep=(16, 32, 64, 128, 256)) -> None:
    hw = HARDWARE[sc.hw]
    print(f"\n== {label or sc.hw}: {hw.name}, EP{sc.ep}, ctx {sc.ctx}, weights {sc.weights}, KV {sc.kv}"
          + (f", redundant {sc.redundant}" if sc.redundant else "")
          + (f", per-user target {sc.user_tps:g} tok/s" if sc.user_tps else ""))
    print(f"   max batch by HBM: {max_batch_by_memory(m, hw, sc)} seqs/GPU; cap {sc.max_batch}")
    print(f"   {'B':>5} {'dense ms':>8} {'attn ms':>8} {'moe ms':>7} {'comm ms':>8} "
          f"{'tok/s/GPU no-ovl':>16} {f'ovl {overlap:.2f}':>10}")
    for B in sweep:
        p = step_parts(m, hw, sc, eff, B)
        print(f"   {B:>5} {p['dense'] * 1e3:>8.2f} {p['attn'] * 1e3:>8.2f} {p['moe'] * 1e3:>7.2f} "
              f"{p['comm'] * 1e3:>8.2f} {B / step_time(p, 0.0):>16.0f} {B / step_time(p, overlap):>10.0f}")
    if max_batch_by_memory(m, hw, sc) < 1:
        print("   does not fit: this GPU's weights leave no HBM for one sequence's KV cache at this EP size")
        return
    B0, _, t0 = operating_point(m, hw, sc, eff, 0.0)
    B1, _, t1 = operating_point(m, hw, sc, eff, overlap)
    print(f"   operating point: no overlap B={B0} -> {B0 / t0:,.0f} tok/s/GPU ({1 / t0:.1f} tok/s/user); "
          f"overlap {overlap:.2f} B={B1} -> {B1 / t1:,.0f} tok/s/GPU ({1 / t1:.1f} tok/s/user)")
    if hw.blackwell and eff.blackwell_derate != 1.0:
        Bu, _, tu = operating_point(m, hw, sc, replace(eff, blackwell_derate=1.0), 0.0)
        print(f"   upper bound (Hopper efficiencies, no Blackwell derate): no overlap B={Bu} -> {Bu / tu:,.0f} "
              f"tok/s/GPU" + (f" = {Bu / tu / published:.2f}x published" if published else ""))
    if published:
        print(f"   published: {published:,.0f} tok/s/GPU -> model/published = {B0 / t0 / published:.2f} "
              f"(no overlap), {B1 / t1 / published:.2f} (overlap)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hw", choices=sorted(HARDWARE), default=None, help="one custom scenario instead of the checks")
    p.add_argument("--ep", type=int, default=72)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--weights", choices=sorted(WEIGHT_BYTES), default="fp8")
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--batch", type=int, default=256, help="per-GPU batch cap")
    p.add_argument("--user-tps", type=float, default=None, help="per-user tokens/s target")
    p.add_argument("--redundant", type=int, default=0)
    p.add_argument("--overlap-efficiency", type=float, default=None,
                   help="default: measured on CUDA in bench/results/*.json, else 0.8")
    for f in ("mem", "gemm", "attn", "link"):
        p.add_argument(f"--{f}-eff", type=float, default=getattr(Efficiency, f))
    p.add_argument("--latency-us", type=float, default=Efficiency.latency_us)
    p.add_argument("--blackwell-derate", type=float, default=BLACKWELL_DERATE,
                   help="factor on the HBM/GEMM/attention efficiencies on GB200/GB300 (1 = Hopper's; see above)")
    a = p.parse_args()

    measured, source = measured_overlap()
    overlap = a.overlap_efficiency if a.overlap_efficiency is not None else (measured if measured is not None else 0.8)
    how = ("--overlap-efficiency" if a.overlap_efficiency is not None
           else (source if measured is not None else f"assumed default 0.8 ({source})"))
    eff = Efficiency(a.mem_eff, a.gemm_eff, a.attn_eff, a.link_eff, a.latency_us, overlap, a.blackwell_derate)
    m = ModelConfig()
    print(f"DeepSeek-V3: {m.layers * m.attn_params() / 1e9:.1f}B attention, {m.replicated_params() / 1e9:.1f}B "
          f"replicated per GPU (+{m.vocab * m.hidden / 1e9:.2f}B lm_head), {m.expert_params() / 1e6:.1f}M per expert")
    print(f"efficiencies: HBM {eff.mem}, GEMM {eff.gemm}, attention {eff.attn}, link {eff.link}, "
          f"{eff.latency_us:g} us per collective; overlap efficiency {overlap:.2f} from {how}; "
          f"x{eff.blackwell_derate:g} on HBM/GEMM/attention on Blackwell (calibrated to the GB200 figures)")
    if a.hw:
        sc = Scenario(a.hw, a.ep, a.ctx, a.weights, a.kv, a.redundant, a.batch, a.user_tps)
        report(m, sc, eff, overlap)
        return
    for text, sc, published in CHECKS:
        report(m, sc, eff, overlap, published, label=text.split(",")[0])
        print("   source: " + text)


if __name__ == "__main__":
    main()
