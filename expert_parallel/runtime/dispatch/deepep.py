"""Dispatch/combine through DeepEP's fused NVLink/RDMA kernels (the `deep_ep` package, CUDA only).

Shape legend: T tokens on this rank, K top-k, D hidden size, W EP world size, E local experts
(slots_per_rank), C = W * max_low_latency_tokens rows per local expert in low-latency mode, R rows
received.

NOT RUN IN THIS REPOSITORY'S CI: DeepEP needs Hopper-class GPUs, NVSHMEM and (across nodes) RDMA NICs.
It targets DeepEP's V1 `deep_ep.Buffer` API (not the later ElasticBuffer). The calls follow
deep_ep/buffer.py (Buffer, get_dispatch_layout, dispatch, combine,
clean_low_latency_buffer, low_latency_dispatch, low_latency_combine, get_low_latency_rdma_size_hint,
Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint); tests/distributed/test_dispatch.py
(test_deepep_matches_reference) checks them against the reference on a multi-GPU machine.

Two modes, one Buffer (created with low_latency_mode=True so it can serve both; DeepEP requires
clean_low_latency_buffer after normal kernels before the next low-latency kernel, which we track):
  normal       (prefill-sized batches) get_dispatch_layout + dispatch: each token goes once to each
               rank holding one of its experts; DeepEP returns recv_topk_idx already as local expert
               ids with -1 elsewhere, which is exactly our contract. combine sums *without* weights,
               matching our y_RD (already weighted partial sums).
  low_latency  (decode-sized batches, T <= max_low_latency_tokens on every rank) low_latency_dispatch
               returns an expert-major layout (E, C, D) with recv_count_E valid rows per expert: a
               token appears once per local expert it chose, not once per rank. We present it as
               x_RD = (E*C, D) (for bf16 x a view into DeepEP's buffer, which the next-but-one
               low-latency call overwrites: consume it before then), topk_ids_RK = (E*C, 1) holding e for the first
               recv_count_E[e] rows of expert e and -1 for the rest, and topk_weights_RK = 1.
               low_latency_combine applies the routing weights itself, so y_RD rows must be
               *unweighted* expert outputs, which a GEMM given weight 1 produces. The output also
               carries expert_major = (x_ECD, recv_count_E): the MoE layer then runs the masked
               grouped GEMM (moe_serve/kernels/grouped_gemm/masked.py) on the (E, C, D) layout, which computes
               and writes only the recv_count_E[e] valid rows of each expert (low_latency_combine
               sends only those back), instead of all E*C rows through the generic kernel.
"auto" picks from the largest T over the group. The engine agrees on that once per step (the core
loop's MAX all-reduce) and passes it in the step (`MoEStep.max_tokens_any_rank`), so the choice costs
nothing per layer; without it (a forward outside the engine's steps) each dispatch agrees by itself (one small all_reduce
on the EP group and a host sync per MoE layer). With two overlapped micro-batches the step's maximum
bounds each micro-batch's T, so low-latency is chosen only when every call fits. Engines that run
prefill and decode on separate instances can fix the mode instead.
Tokens travel as bfloat16 (DeepEP's normal and low-latency kernels take bf16 or fp8+scales); x in
another dtype is cast on the way and the outputs are cast back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from expert_parallel.runtime.dispatch.base import Dispatcher, DispatchOutput, Pending
from expert_parallel.runtime.step import NO_STEP, MoEStep

NEEDS_DEEPEP = ("all2all_backend='deepep' needs the deep_ep package and a CUDA device; it builds from "
                "source against NVSHMEM (README.md: Installing DeepEP), or use all2all_backend='all_to_all'")
MODES = ("auto", "normal", "low_latency")


@dataclass
class DeepEPHandle:
    """mode: "normal" or "low_latency". native: DeepEP's own handle for that mode. num_tokens: T.
    topk_ids_TK (T, K) int64 / topk_weights_TK (T, K) float32: the routing, which low_latency_combine
    needs again. recv_count_E: (E,) int32 valid rows per local expert (low-latency mode only)."""

    mode: str
    native: Any
    num_tokens: int
    topk_ids_TK: torch.Tensor | None = None
    topk_weights_TK: torch.Tensor | None = None
    recv_count_E: torch.Tensor | None = None


def choose_mode(mode: str, max_tokens: int | None, max_low_latency_tokens: int, T: int = 0) -> str:
    """The kernels for one dispatch: `mode` unless "auto", else low-latency when the largest T over
    the EP group (max_tokens, the same on every rank) fits max_low_latency_tokens. T is this call's
    own count, which a fixed per-step maximum must bound."""
    if mode not in MODES:
        raise ValueError(f"deepep mode={mode!r} is not one of {MODES}")
    if mode != "auto":
        return mode
    if max_tokens is None or T > max_tokens:
        raise ValueError(f"deepep mode 'auto' needs the group's largest T: got max_tokens={max_tokens} for T={T}")
    return "low_latency" if max_tokens <= max_low_latency_tokens else "normal"


def low_latency_output(recv_x_ECD: torch.Tensor, recv_count_E: torch.Tensor, handle: Any,
                       dtype: torch.dtype) -> DispatchOutput:
    """DeepEP's low-latency receive (x (E, C, D), recv_count_E valid rows per local expert) as a
    DispatchOutput: expert_major = (x_ECD, recv_count_E) for the masked grouped GEMM, and the flat
    form of the Dispatcher contract (x_RD = its (E*C, D) view, ids e for the valid rows of expert
    e and -1 for the others, weights 1) for any expert op that takes routed rows. No host sync."""
    E, C, D = recv_x_ECD.shape
    device = recv_x_ECD.device
    x_ECD = recv_x_ECD.to(dtype)  # no copy when dtype is DeepEP's bf16
    row_C = torch.arange(C, device=device)
    valid_EC = row_C.unsqueeze(0) < recv_count_E.to(torch.int64).unsqueeze(1)
    expert_EC = torch.arange(E, device=device).unsqueeze(1).expand(E, C)
    ids_R1 = torch.where(valid_EC, expert_EC, torch.full_like(expert_EC, -1)).reshape(E * C, 1)
    ones_R1 = torch.ones(E * C, 1, dtype=torch.float32, device=device)
    return DispatchOutput(x_ECD.reshape(E * C, D), ids_R1, ones_R1, handle, expert_major=(x_ECD, recv_count_E))


def _import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise RuntimeError(f"{NEEDS_DEEPEP} (import deep_ep failed: {e})") from e
    if not torch.cuda.is_available():
        raise RuntimeError(f"{NEEDS_DEEPEP} (torch.cuda.is_available() is False)")
    return deep_ep


class DeepEPDispatcher(Dispatcher):
    """DeepEP normal and low-latency dispatch/combine behind our interface.

    Args (constructor):
        num_slots: physical expert slots in the EP group; must be divisible by world_size.
        rank: this rank's index in `group`.
        world_size: W, the size of `group`.
        group: the EP process group (NCCL); None = the default group.
        mode: "auto" (choose per call by the largest T over the group), "normal" or "low_latency".
        max_low_latency_tokens: the most tokens any rank sends in one low-latency dispatch; sizes the
            RDMA buffer and must be the same on every rank.
        num_sms: SMs DeepEP's normal kernels may use (even); None keeps DeepEP's default.
    """

    name = "deepep"

    def __init__(self, num_slots: int, rank: int = 0, world_size: int = 1, group=None, *,
                 mode: str = "auto", max_low_latency_tokens: int = 128, num_sms: int | None = None):
        super().__init__(num_slots, rank, world_size, group)
        self._deep_ep = _import_deep_ep()
        if mode not in MODES:
            raise ValueError(f"deepep mode={mode!r} is not one of {MODES}")
        self.mode = mode
        self.max_low_latency_tokens = max_low_latency_tokens
        if num_sms is not None:
            self._deep_ep.Buffer.set_num_sms(num_sms)
        self._buffer = None
        self._buffer_hidden = None
        self._last_mode: str | None = None


    def _get_buffer(self, hidden: int):
        """Create the Buffer on first use, when D is known. Collective (all_gather_object inside),
        which is safe because every rank calls dispatch in lockstep."""
        if self._buffer is not None and self._buffer_hidden == hidden:
            return self._buffer
        Buffer = self._deep_ep.Buffer
        group = self.group if self.group is not None else dist.group.WORLD
        hidden_bytes = hidden * 2  # bf16 on the wire
        num_nvl_bytes = num_rdma_bytes = 0
        if self.mode != "low_latency":
            for cfg in (Buffer.get_dispatch_config(self.world_size), Buffer.get_combine_config(self.world_size)):
                num_nvl_bytes = max(num_nvl_bytes, cfg.get_nvl_buffer_size_hint(hidden_bytes, self.world_size))
                num_rdma_bytes = max(num_rdma_bytes, cfg.get_rdma_buffer_size_hint(hidden_bytes, self.world_size))
        low_latency = self.mode != "normal"
        if low_latency:
            num_rdma_bytes = max(num_rdma_bytes, Buffer.get_low_latency_rdma_size_hint(
                self.max_low_latency_tokens, hidden, self.world_size, self.num_slots))
        # Queue pairs: low-latency kernels want one per local expert, normal internode kernels one
        # per SM channel; a buffer serving both takes the larger.
        qps = {"normal": Buffer.num_sms, "low_latency": self.slots_per_rank,
               "auto": max(Buffer.num_sms, self.slots_per_rank)}[self.mode]
        self._buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency,
                              num_qps_per_rank=qps)
        self._buffer_hidden = hidden
        return self._buffer

    def _choose_mode(self, T: int, device: torch.device, step: MoEStep) -> str:
        if self.mode == "auto" and step.max_tokens_any_rank is None:
            # Every rank must pick the same kernels, so decide on the largest T in the group.
            max_T = torch.tensor([T], dtype=torch.int64, device=device)
            dist.all_reduce(max_T, op=dist.ReduceOp.MAX, group=self.group)
            return choose_mode(self.mode, int(max_T.item()), self.max_low_latency_tokens)
        return choose_mode(self.mode, step.max_tokens_any_rank, self.max_low_latency_tokens, T)

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 step: MoEStep = NO_STEP) -> DispatchOutput:
        return self.dispatch_async(x_TD, topk_ids_TK, topk_weights_TK, step).wait()

    def combine(self, y_RD: torch.Tensor, handle: "DeepEPHandle") -> torch.Tensor:
        return self.combine_async(y_RD, handle).wait()

    def dispatch_async(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                       step: MoEStep = NO_STEP) -> Pending:
        """Start dispatch; `.wait()` gives the DispatchOutput. Normal mode finishes on DeepEP's
        communication stream (async_finish; wait() makes the compute stream wait for its event);
        low-latency mode only issues the sends (return_recv_hook) and wait() calls the receive hook,
        so the other micro-batch's kernels run while the data is on the wire.

        Args:
            x_TD: (T, D) CUDA tokens, bf16 preferred (other float dtypes are cast to bf16 and back).
            topk_ids_TK: (T, K) int global slot ids in [0, num_slots), -1 for none.
            topk_weights_TK: (T, K) float routing weights.
        Returns:
            DispatchOutput; x_RD in x's dtype, topk_ids_RK int64 local ids or -1, topk_weights_RK
            float32, handle a DeepEPHandle. See the module docstring for the low-latency layout.
        """
        T, D = x_TD.shape
        buffer = self._get_buffer(D)
        mode = self._choose_mode(T, x_TD.device, step)
        x_bf16 = x_TD.to(torch.bfloat16)
        topk_idx = topk_ids_TK.to(torch.int64).contiguous()   # DeepEP requires int64 indices
        weights = topk_weights_TK.to(torch.float32).contiguous()

        if mode == "normal":
            num_per_rank, num_per_rdma_rank, num_per_expert, is_token_in_rank, _ = \
                buffer.get_dispatch_layout(topk_idx, self.num_slots)
            recv_x, recv_ids, recv_w, _, native, event = buffer.dispatch(
                x_bf16, num_tokens_per_rank=num_per_rank, num_tokens_per_rdma_rank=num_per_rdma_rank,
                is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_per_expert,
                topk_idx=topk_idx, topk_weights=weights, async_finish=True)
            self._last_mode = "normal"

            def finish_normal() -> DispatchOutput:
                event.current_stream_wait()
                # Weights of -1 slots are unspecified in DeepEP's output; zero them so nothing reads junk.
                w = recv_w.masked_fill(recv_ids < 0, 0.0)
                return DispatchOutput(recv_x.to(x_TD.dtype), recv_ids.to(torch.int64), w,
                                      DeepEPHandle("normal", native, T))

            return Pending(finish_normal)

        if T > self.max_low_latency_tokens:
            raise ValueError(f"low-latency dispatch of T={T} tokens exceeds "
                             f"max_low_latency_tokens={self.max_low_latency_tokens}")
        if self._last_mode == "normal":
            # Normal kernels dirty the region low-latency kernels expect zeroed.
            buffer.clean_low_latency_buffer(self.max_low_latency_tokens, D, self.num_slots)
        recv_x_ECD, recv_count_E, native, _, hook = buffer.low_latency_dispatch(
            x_bf16, topk_idx, self.max_low_latency_tokens, self.num_slots, use_fp8=False, return_recv_hook=True)
        self._last_mode = "low_latency"
        return Pending(lambda: self._finish_low_latency(hook, recv_x_ECD, recv_count_E, native, T, topk_idx,
                                                        weights, x_TD))

    def _finish_low_latency(self, hook, recv_x_ECD, recv_count_E, native, T, topk_idx, weights, x_TD):
        hook()  # receive: the tensors below are valid from here on
        handle = DeepEPHandle("low_latency", native, T, topk_idx, weights, recv_count_E)
        return low_latency_output(recv_x_ECD, recv_count_E, handle, x_TD.dtype)

    def combine_async(self, y_RD: torch.Tensor, handle: DeepEPHandle) -> Pending:
        """Args: y_RD (R, D) rows in dispatch's layout (weighted partial sums in normal mode,
        unweighted expert outputs in low-latency mode). `.wait()` gives (T, D) in y's dtype."""
        buffer = self._buffer
        y_bf16 = y_RD.to(torch.bfloat16)
        if handle.mode == "normal":
            out_TD, _, event = buffer.combine(y_bf16, handle.native, async_finish=True)
            self._last_mode = "normal"
            return Pending(lambda: (event.current_stream_wait(), out_TD.to(y_RD.dtype))[1])
        E = self.slots_per_rank
        y_ECD = y_bf16.reshape(E, -1, y_RD.shape[1])
        out_TD, _, hook = buffer.low_latency_combine(y_ECD, handle.topk_ids_TK, handle.topk_weights_TK,
                                                     handle.native, return_recv_hook=True)
        return Pending(lambda: (hook(), out_TD.to(y_RD.dtype))[1])
