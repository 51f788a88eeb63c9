"""What machine a figure was measured on, written into every CPU result: the CPU model, its vector
ISA (the widest our C kernels use: avx512, avx2, neon, else generic), the flags that decide kernel
paths, the core count, and the kernel set the engine runs there (our C kernels and their ISA, or
torch ops only)."""
from __future__ import annotations

import os
import platform

_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx2", "fma", "f16c")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [fl for fl in _FLAGS if fl in have] + (["asimd"] if "asimd" in have else [])
    except OSError:
        pass
    return []


def isa() -> str:
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags:
        return "avx2"
    return "neon" if "asimd" in flags or platform.machine() in ("aarch64", "arm64") else "generic"


def machine() -> dict:
    """{"cpu", "isa", "flags", "cores", "kernels"}: kernels is "cpu_c/<isa>" where our C kernels run
    (the ISA they were built for), else "torch" (with the reason)."""
    from moe_serve.kernels import cpu_ops

    st = cpu_ops.status()
    kernels = f"cpu_c/{st['isa']}" if st["available"] else f"torch ({st['reason']})"
    return {"cpu": cpu_model(), "isa": isa(), "flags": cpu_flags(), "cores": os.cpu_count(), "kernels": kernels}


def describe() -> str:
    m = machine()
    return f"{m['cpu']} ({m['isa']}; {m['cores']} cores; kernels {m['kernels']})"
