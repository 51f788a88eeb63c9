"""Attention backends by name: "torch" (the reference, CPU default) and "triton" (CUDA default).

A backend is a module exposing write_kv, write_latent, paged_attention and mla_paged_attention with
the signatures of `attention.backends.reference`. Imports are lazy so CPU users never load Triton.
"""
from __future__ import annotations

import importlib
from types import ModuleType

BACKENDS = {"torch": "attention.backends.reference", "triton": "attention.backends.triton_paged"}


def get_backend(name: str) -> ModuleType:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {tuple(BACKENDS)}")
    return importlib.import_module(BACKENDS[name])
