"""The one place that picks kernels and communication backends for the hardware, and logs it.

CPU -> torch reference ops and gloo; CUDA -> Triton kernels and NCCL, DeepEP for dispatch where it
is importable. Explicit choices (`moe_backend`, `attention_backend`, `all2all_backend`) override
"auto" for comparisons and tests; models never name a kernel.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("moe_serve.platform")


@dataclass(frozen=True)
class PlatformChoice:
    device: torch.device
    moe_backend: str
    attention_backend: str
    dist_backend: str
    all2all_backend: str


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return dev


def deepep_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None


def choose(device: str = "auto", moe_backend: str = "auto", attention_backend: str = "auto",
           all2all_backend: str = "auto", world_size: int = 1) -> PlatformChoice:
    dev = resolve_device(device)
    on_gpu = dev.type == "cuda"
    for field, value in (("moe_backend", moe_backend), ("attention_backend", attention_backend)):
        if value not in ("auto", "torch", "triton"):
            raise ValueError(f"{field}={value!r} is not one of 'auto', 'torch', 'triton'")
    moe = moe_backend if moe_backend != "auto" else ("triton" if on_gpu else "torch")
    attn = attention_backend if attention_backend != "auto" else ("triton" if on_gpu else "torch")
    if all2all_backend == "auto":
        a2a = "local" if world_size == 1 else ("deepep" if on_gpu and deepep_available() else "all_to_all")
    else:
        a2a = all2all_backend
    choice = PlatformChoice(dev, moe, attn, "nccl" if on_gpu else "gloo", a2a)
    log.info("platform: device=%s moe_backend=%s attention_backend=%s dist_backend=%s all2all_backend=%s",
             dev, moe, attn, choice.dist_backend, a2a)
    return choice


