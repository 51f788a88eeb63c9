"""`moe-serve env`: what will run on this machine and why, before a model is loaded.

    moe-serve env                          # readable
    moe-serve env --json                   # machine-readable
    moe-serve env --world-size 8 --hidden-size 7168   # the dispatch an EP job of that shape gets

It reports the versions (Python, torch, Triton, transformers, CUDA, NCCL), the device and what the
platform picks for each kind of op (moe_serve/platform.py `choose`, the same call the engine makes),
the CPU's ISA and whether our C kernels build here (and why not), which --kv-cache-dtype values each
attention backend serves and with what, which weight formats each backend serves and how
(moe_serve/quantization/formats.py `WEIGHT_FORMATS`: dense, block FP8, MXFP4, compressed-tensors,
GPTQ, AWQ), transparent huge pages, DeepEP / NVSHMEM and which modes the EP size allows, and for
each missing piece the command that adds it.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform as py_platform
import sys

# CPU features that decide a kernel path here, as /proc/cpuinfo names them.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
             "amx_bf16", "amx_tile", "asimd", "sve")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu() -> dict:
    model, flags = py_platform.processor() or py_platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"model": model, "arch": py_platform.machine(), "cores": os.cpu_count(),
            "isa": [f for f in ISA_FLAGS if f in flags]}


def collect(world_size: int = 1, hidden_size: int | None = None) -> dict:
    """Everything `moe-serve env` reports, as a dict (the --json output)."""
    import torch

    from moe_serve.kernels import cpu_ops
    from moe_serve import platform
    from moe_serve.prepare import transparent_huge_pages
    from moe_serve.quantization import formats

    cuda = torch.cuda.is_available()
    env: dict = {
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "triton": _version("triton"),
                     "transformers": _version("transformers"), "moe_serve": _version("moe-serve"),
                     "cuda": torch.version.cuda, "nccl": None},
        "cpu": _cpu(),
        "cpu_kernels": cpu_ops.status(),
        "transparent_huge_pages": transparent_huge_pages(),
        "gpus": [],
    }
    if cuda:
        try:
            env["versions"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"index": i, "name": p.name, "capability": f"sm_{p.major}{p.minor}",
                                "memory_gib": round(p.total_memory / 2**30, 1), "sms": p.multi_processor_count})
    choice = platform.choose("auto", world_size=world_size, hidden_size=hidden_size)
    env["platform"] = {"device": str(choice.device), "moe_backend": choice.moe_backend,
                       "attention_backend": choice.attention_backend, "linear_backend": choice.linear_backend,
                       "norm_backend": choice.norm_backend, "linear_attention_backend": choice.linear_attention_backend,
                       "dist_backend": choice.dist_backend, "all2all_backend": choice.all2all_backend,
                       "world_size": world_size, "hidden_size": hidden_size}
    env["kv_cache_dtypes"] = {name: (cls.kv_cache_dtypes() if hasattr(cls, "kv_cache_dtypes")
                                     else {"auto": "the activation dtype", "fp8": "not declared by the backend"})
                              for name, cls in platform.OPS["attention"].items()}
    env["weight_formats"] = formats.weight_formats()
    usable, low_latency, why = platform.deepep_support(hidden_size, world_size)
    env["deepep"] = {"installed": importlib.util.find_spec("deep_ep") is not None,
                     "nvshmem": importlib.util.find_spec("nvshmem") is not None or _version("nvidia-nvshmem-cu12")
                     is not None, "ep_size_supported": usable, "low_latency_supported": low_latency, "why": why}
    env["missing"] = _missing(env, cuda)
    return env


def _missing(env: dict, cuda: bool) -> list[dict]:
    """What is absent that something here would use, and the command that adds it."""
    out = []
    ck = env["cpu_kernels"]
    if not ck["available"] and env["platform"]["device"] == "cpu":
        if ck["compiler"] is None:
            out.append({"what": "a C compiler (the CPU kernels)", "why": ck["reason"],
                        "command": "apt-get install -y gcc   # or set CC"})
        elif "MOE_SERVE_CPU_ISA" in ck["reason"]:
            out.append({"what": "the CPU kernels for the ISA asked for", "why": ck["reason"],
                        "command": "unset MOE_SERVE_CPU_ISA   # build for this CPU"})
    if env["transparent_huge_pages"] == "never":
        out.append({"what": "transparent huge pages (weights streamed at decode)", "why": "the kernel's mode is never",
                    "command": "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled"})
    if env["versions"]["triton"] is None:
        out.append({"what": "Triton (the GPU kernels; the interpreter tests)", "why": "not installed",
                    "command": f"{sys.executable} -m pip install triton"})
    if cuda and not env["deepep"]["installed"]:
        out.append({"what": "DeepEP (the fast expert dispatch on NVLink/RDMA)", "why": "not importable",
                    "command": "see README.md, 'Installing DeepEP'"})
    return out


def _print(env: dict) -> None:
    v, c, ck, pl = env["versions"], env["cpu"], env["cpu_kernels"], env["platform"]
    print("versions: " + ", ".join(f"{k} {x}" for k, x in v.items() if x))
    print(f"cpu: {c['model']} ({c['arch']}, {c['cores']} cores); ISA: {' '.join(c['isa']) or 'baseline'}")
    print(f"cpu kernels (moe_serve/kernels/cpu_ops): {'yes' if ck['available'] else 'no'} - {ck['reason']}"
          + (f"; {', '.join(ck['sources'])}" if ck["available"] else ""))
    print(f"transparent huge pages: {env['transparent_huge_pages']}")
    for g in env["gpus"]:
        print(f"gpu {g['index']}: {g['name']} {g['capability']}, {g['memory_gib']} GiB, {g['sms']} SMs")
    if not env["gpus"]:
        print("gpu: none visible")
    print(f"platform (EP {pl['world_size']}): device {pl['device']}; experts {pl['moe_backend']}, attention "
          f"{pl['attention_backend']}, linear {pl['linear_backend']}, norm {pl['norm_backend']}, linear attention "
          f"{pl['linear_attention_backend']}; process groups {pl['dist_backend']}, dispatch {pl['all2all_backend']}")
    for name, dtypes in env["kv_cache_dtypes"].items():
        print(f"kv cache dtypes ({name} attention): " + "; ".join(f"{k}: {v}" for k, v in dtypes.items()))
    backend = pl["moe_backend"]
    print(f"weight formats (served here by the {backend} backend; --json: every backend):")
    for name, f in env["weight_formats"].items():
        print(f"  {name}: {f['what']}; {f['backends'].get(backend, 'not served')}")
    d = env["deepep"]
    print(f"deepep: {'installed' if d['installed'] else 'not installed'}, nvshmem "
          f"{'found' if d['nvshmem'] else 'not found'}; {d['why']}")
    for m in env["missing"]:
        print(f"missing: {m['what']} ({m['why']}): {m['command']}")
    if not env["missing"]:
        print("missing: nothing this machine would use")


def add_env_parser(sub) -> None:
    p = sub.add_parser("env", help="what will run on this machine and why (versions, ISA, kernels, backends)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--world-size", type=int, default=1, help="the expert-parallel size to choose the dispatch for")
    p.add_argument("--hidden-size", type=int, default=None, help="the model's hidden size (DeepEP's low-latency "
                                                                  "kernels take a few)")
    p.set_defaults(fn=cmd_env)


def cmd_env(ns: argparse.Namespace) -> int:
    if ns.world_size < 1:
        raise ValueError(f"--world-size={ns.world_size} must be at least 1")
    env = collect(ns.world_size, ns.hidden_size)
    if ns.json:
        print(json.dumps(env, indent=2))
    else:
        _print(env)
    return 0
