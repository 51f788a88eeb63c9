"""Launch configs for the grouped GEMM: tuned JSON files per (E, N, K, dtype, device), or a default.

A config file lives in `configs/` and is named
    E={E},N={N},K={K},dtype={bf16|fp16|fp32},device={device name with spaces as _}.json
where N is the expert intermediate size F (w13 has 2N rows) and K the hidden size D. It maps a batch
size (number of tokens T, as a string) to a config dict; the loader picks the entry whose batch size
is nearest to the actual T. `python -m moe_serve.kernels.grouped_gemm.tune` writes these files.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Every key a config must carry; triton.Config-style launch options included.
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def device_name(device: torch.device) -> str:
    """The name config files are keyed by: the CUDA device name with spaces as '_', else 'cpu'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return device.type


def config_file_name(E: int, N: int, K: int, dtype: torch.dtype, device: str) -> str:
    return f"E={E},N={N},K={K},dtype={DTYPE_NAMES[dtype]},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_configs(E: int, N: int, K: int, dtype: torch.dtype, device: str) -> dict[int, dict] | None:
    """All tuned entries of one shape on one device, keyed by batch size; None if no file exists."""
    path = CONFIG_DIR / config_file_name(E, N, K, dtype, device)
    if not path.is_file():
        return None
    with open(path) as f:
        raw = json.load(f)
    configs = {int(m): cfg for m, cfg in raw.items()}
    for m, cfg in configs.items():
        validate_config(cfg, where=f"{path.name}[{m}]")
    return configs


def validate_config(cfg: dict, where: str = "config") -> None:
    """Reject a config the kernels cannot run, naming the field and its value."""
    for key in CONFIG_KEYS:
        if key not in cfg:
            raise ValueError(f"{where}: missing {key}")
    for key in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
        v = cfg[key]
        # tl.dot needs every tile dimension >= 16 and a power of two.
        if v < 16 or v & (v - 1):
            raise ValueError(f"{where}: {key}={v} must be a power of two >= 16")
    if cfg["GROUP_SIZE_M"] < 1:
        raise ValueError(f"{where}: GROUP_SIZE_M={cfg['GROUP_SIZE_M']} must be >= 1")


# The default configs, from decode (few rows per expert) to prefill. Decode is weight-bandwidth
# bound with few rows per expert: narrow N tiles spread one expert's weights over many programs so
# the memory system sees enough parallel loads. Prefill is compute bound; the gated GEMM keeps two
# 64x128 fp32 accumulators, hence 8 warps.
DECODE_CONFIG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                 "num_warps": 4, "num_stages": 3}
MIDDLE_CONFIG = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                 "num_warps": 4, "num_stages": 3}
PREFILL_CONFIG = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 8,
                  "num_warps": 8, "num_stages": 3}
DEFAULT_CONFIGS = (DECODE_CONFIG, MIDDLE_CONFIG, PREFILL_CONFIG)
# --batch-invariant: the one config every batch size launches (no choice by T: the tile and its K
# step fix each product's reduction order; moe_serve/kernels/triton_invariant.py). The middle tile:
# decode steps waste at most half a row block, prefill keeps 4 warps busy.
INVARIANT_CONFIG = MIDDLE_CONFIG


def default_config(T: int, E: int, top_k: int) -> dict:
    """A reasonable config when no tuned file matches, chosen by the mean pairs per expert."""
    pairs_per_expert = T * top_k / max(E, 1)
    if pairs_per_expert <= 16:
        return dict(DECODE_CONFIG)
    if pairs_per_expert <= 64:
        return dict(MIDDLE_CONFIG)
    return dict(PREFILL_CONFIG)


def tuned_configs() -> list[tuple[torch.dtype, dict]]:
    """Every entry of every tuned file in CONFIG_DIR, with the dtype its file name gives."""
    dtypes = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    out = []
    for path in sorted(CONFIG_DIR.glob("E=*.json")):
        fields = dict(part.split("=", 1) for part in path.stem.split(","))
        with open(path) as f:
            raw = json.load(f)
        for m, cfg in raw.items():
            validate_config(cfg, where=f"{path.name}[{m}]")
            out.append((dtypes[fields["dtype"]], cfg))
    return out


def get_config(E: int, N: int, K: int, dtype: torch.dtype, T: int, top_k: int,
               device: torch.device) -> dict:
    """The tuned entry nearest to batch size T for this shape and device, else the default."""
    configs = load_configs(E, N, K, dtype, device_name(device)) if dtype in DTYPE_NAMES else None
    if not configs:
        return default_config(T, E, top_k)
    nearest = min(configs, key=lambda m: (abs(m - T), m))
    return dict(configs[nearest])
