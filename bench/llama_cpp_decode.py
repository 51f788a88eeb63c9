"""CPU decode over packed weights against llama.cpp: the same GGUF files served by moe-serve's offline
`LLM` and by llama.cpp (llama-cpp-python's API), bf16 / Q8_0 / Q4_0 / Q4_K_M, single stream and
--concurrency sequences at once, the same threads, prompts and output lengths, in one run.

    .venv/bin/python bench/llama_cpp_decode.py                    # build the model once, run all
    .venv/bin/python bench/llama_cpp_decode.py --formats Q4_0 --threads 1

The model: a random-init Qwen3-MoE (--layers of --hidden, --experts experts of --moe-intermediate,
top --top-k; the tests' 512-token tokenizer; by default 3.3 GB in bf16 and 0.93 GB in Q4_0, well
above the 480 MiB last-level cache of the Xeon this was written on, so every format's decode reads
from memory), written by transformers as bf16 safetensors and by gguf-py (the
tests' GGUF writer, tests/models/test_gguf.py) as a BF16 GGUF; llama.cpp's own quantizer
(`llama_model_quantize`, run in the peer's interpreter) makes Q8_0, Q4_0 and Q4_K_M from it. With
--quantizer gguf-py the files come from gguf-py's quantizer and the tests' K-quant writer instead
(every 2-D tensor in the one type, norms and router F32).

Rows:
- bf16: ours serves the safetensors (bf16 weights), llama.cpp the BF16 GGUF;
- Q8_0, Q4_0, Q4_K_M: both serve the same .gguf file (ours keeps the blocks packed: 8-bit or 4-bit
  codes, a scale and offset per group; Q8_0 and Q4_0 with their float16 scales and a zero code, the
  file's own bytes: moe_serve/prepare.py `compact_packed_weights`).

Timing, decode only (prefill excluded), greedy, EOS ignored, --output-len tokens per sequence:
- ours: `LLM.generate`, the clock from the end of the engine step that gave every sequence its first
  token to the end of the last step (the engine's `step` wrapped to note when each ends); all
  prompts of a batch are prefilled in one step (max_num_batched_tokens covers them);
- llama.cpp single stream: `Llama.generate` (top_k 1), the clock from the first token to the last;
  concurrent: its low-level API as llama.cpp's batched example and server run it, one `llama_batch`
  of all prompts (n_seq_max = concurrency) for the prefill, then one batch of one token per sequence
  per step, the clock around the decode steps. llama.cpp runs without its AMX buffer type, which
  faults on this machine (refuse_amx; --peer-amx lets it try), with every other CPU path it has.
Each figure is the fastest of --repeats (single stream: on --repeats prompts of their own). On
cores other work keeps busy, more --threads than idle cores stall both engines at every parallel
region (repeats up to 10x apart: bench/results/llama_cpp_decode_*_threads2.md).

Speed of light of a step = bytes it must read / read bandwidth:
  bytes = each engine's own weights a step touches (ours: the held bytes the engine's meter counts,
          moe_serve/speed_of_light.py, packed codes + scales + offsets; llama.cpp: the GGUF tensors'
          bytes, which it keeps as they are) outside the experts + the expected distinct experts of
          each layer at that batch (E * (1 - (1 - k/E)^B), uniform routing) + the KV cache of the mean
          decode context (ours: its cache element size; llama.cpp: f16 K and V);
  bandwidth = a sum over a buffer twice the last-level cache (moe_serve.speed_of_light.measure_bandwidth),
          with --threads threads, at the start and the end of the run; the larger counts.

The peer lives outside the repository (--peer-python, default /opt/llama-venv/bin/python with
llama-cpp-python from PyPI); this file runs there too, as the worker (`--peer-worker`: the standard
library, numpy and llama_cpp only). Writes bench/results/llama_cpp_decode_<model>_threads<n>.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

FORMATS = ("bf16", "Q8_0", "Q4_0", "Q4_K_M")
# llama.cpp's file types (llama_ftype) for its quantizer
LLAMA_FTYPE = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the peer: runs in llama-cpp-python's interpreter ------------------------------------------
def refuse_amx() -> object:
    """Keep llama.cpp off its AMX buffer type, its other CPU paths (repacked Q4_0 / Q4_K, AVX-512
    dot products) untouched: on this machine's VM its AMX matmul faults at its first tile-config
    load (SIGILL; SIGSEGV with the tile permission granted beforehand), so no quantized file would
    run. ggml takes AMX only when Linux grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which
    Linux refuses while a thread's signal stack is smaller than an AMX signal frame: a 4 KiB
    sigaltstack on this thread, set before llama.cpp loads, does that (ggml then logs "AMX is not
    ready to be used!" and picks its next buffer type). Returns the stack, to be kept alive."""
    import ctypes

    class StackT(ctypes.Structure):
        _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(4096)
    ss = StackT(ctypes.cast(buf, ctypes.c_void_p), 0, 4096)
    if ctypes.CDLL(None, use_errno=True).sigaltstack(ctypes.byref(ss), None) != 0:
        raise SystemExit(f"sigaltstack failed (errno {ctypes.get_errno()})")
    return buf


def peer_worker(spec: dict) -> dict:
    """Single-stream and batched decode of spec["gguf"] in llama.cpp; prints nothing but the result."""
    stack = refuse_amx() if spec["no_amx"] else None  # the signal stack outlives llama.cpp's start-up
    import llama_cpp as L
    import numpy as np

    threads, n_out = spec["threads"], spec["output_len"]
    res: dict = {"llama_cpp_version": getattr(L, "__version__", "?"), "amx": "refused" if stack else "allowed",
                 "system_info": L.llama_print_system_info().decode()}
    model_path = spec["gguf"]

    # single stream: the high-level Llama
    llm = L.Llama(model_path=model_path, n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                  verbose=False, seed=0)
    best, tokens = None, None
    warm = spec["singles"][0]
    for _ in llm.generate(warm[:8], top_k=1, temp=0.0, reset=True):
        break
    for prompt in spec["singles"]:
        out, t_first = [], None
        t0 = time.perf_counter()
        for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(tok))
            if t_first is None:
                t_first = time.perf_counter()
            if len(out) == n_out:
                break
        dt = time.perf_counter() - t_first
        rate = (n_out - 1) / dt
        if best is None or rate > best["decode_tokens_per_s"]:
            best = {"decode_tokens_per_s": rate, "first_token_s": t_first - t0, "decode_s": dt}
        tokens = tokens or out
    res["single"] = {**best, "tokens": tokens}
    model = llm._model.model
    n_vocab = llm.n_vocab()

    # concurrent: one llama_batch of all sequences per step (llama.cpp's batched example, its server)
    prompts = spec["batch"]
    B = len(prompts)
    cp = L.llama_context_default_params()
    cp.n_ctx = B * (max(len(p) for p in prompts) + n_out + 16)
    cp.n_batch = max(sum(len(p) for p in prompts), B)
    cp.n_seq_max = B
    cp.n_threads = threads
    cp.n_threads_batch = threads
    res["context_params"] = {"n_ctx": cp.n_ctx, "n_batch": cp.n_batch, "n_ubatch": cp.n_ubatch,
                             "n_seq_max": cp.n_seq_max, "kv_unified": bool(getattr(cp, "kv_unified", False))}
    new_ctx = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
    rates = []
    for rep in range(spec["repeats"]):
        ctx = new_ctx(model, cp)
        if not ctx:
            raise SystemExit("llama.cpp: could not make a context with n_seq_max=%d" % B)
        total = sum(len(p) for p in prompts)
        batch = L.llama_batch_init(max(total, B), 0, B)

        def fill(items):  # (token, pos, seq, logits?)
            batch.n_tokens = len(items)
            for i, (t, pos, s, lg) in enumerate(items):
                batch.token[i] = t
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = 1 if lg else 0

        def argmax_rows(rows):
            return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, r), shape=(n_vocab,)).argmax())
                    for r in rows]

        items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        fill(items)
        t0 = time.perf_counter()
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama.cpp: llama_decode failed on the prefill batch")
        last_rows = [i for i, it in enumerate(items) if it[3]]
        nxt = argmax_rows(last_rows)
        t_prefill = time.perf_counter() - t0
        outs = [[t] for t in nxt]
        pos = [len(p) for p in prompts]
        t1 = time.perf_counter()
        for _ in range(n_out - 1):
            fill([(outs[s][-1], pos[s], s, True) for s in range(B)])
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama.cpp: llama_decode failed on a decode batch")
            for s, t in enumerate(argmax_rows(range(B))):
                outs[s].append(t)
                pos[s] += 1
        dt = time.perf_counter() - t1
        rates.append({"decode_tokens_per_s": B * (n_out - 1) / dt, "prefill_s": t_prefill, "decode_s": dt})
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    res["concurrent"] = {**max(rates, key=lambda r: r["decode_tokens_per_s"]), "all": rates, "sequences": B}
    del llm
    return res


def run_peer(args, gguf_file: str, singles, batch) -> dict:
    spec = {"gguf": gguf_file, "no_amx": not args.peer_amx, "threads": args.threads, "output_len": args.output_len, "singles": singles,
            "batch": batch, "repeats": args.repeats}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run([args.peer_python, str(Path(__file__).resolve()), "--peer-worker", json.dumps(spec)],
                       capture_output=True, text=True, env=env, timeout=args.peer_timeout)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-3000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def quantize_with_llama_cpp(args, src: str, dst: str, ftype: int) -> None:
    code = ("import sys, llama_cpp as L\n"
            "p = L.llama_model_quantize_default_params()\n"
            f"p.ftype = {ftype}\np.nthread = {args.threads}\n"
            "rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)\n"
            "sys.exit(rc)\n")
    tmp = dst + ".part"
    p = subprocess.run([args.peer_python, "-c", code, src, tmp], capture_output=True, text=True)
    if p.returncode != 0 or not os.path.isfile(tmp):
        raise SystemExit(f"llama_model_quantize {src} -> {dst} (ftype {ftype}) failed: {p.stderr[-2000:]}")
    os.replace(tmp, dst)


def peer_version(python: str) -> str | None:
    p = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True,
                       text=True)
    return p.stdout.strip() if p.returncode == 0 else None


# ---- the model and its files -------------------------------------------------------------------
def build(args, root: Path, formats: list[str]) -> tuple[Path, dict[str, Path]]:
    """(bf16 checkpoint directory, GGUF file per format), built once under root."""
    ckpt, files = build_source(args, root)
    for f, ftype in LLAMA_FTYPE.items():
        if f in formats and not files[f].is_file():
            log(f"llama.cpp's quantizer: {files['bf16'].name} -> {files[f].name}")
            quantize_with_llama_cpp(args, str(files["bf16"]), str(files[f]), ftype)
    return ckpt, files


def build_source(args, root: Path) -> tuple[Path, dict[str, Path]]:
    """The bf16 checkpoint and its BF16 GGUF (with --quantizer gguf-py the quantized files too)."""
    ckpt = root / "bf16"
    files = {"bf16": root / "model-BF16.gguf", **{f: root / f"model-{f}.gguf" for f in LLAMA_FTYPE}}
    if not (ckpt / "config.json").is_file() or not files["bf16"].is_file():
        import torch
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        from tests.checkpoints import VOCAB, _tokenizer, widen_
        from tests.models.test_gguf import mix, write_gguf
        from gguf import GGMLQuantizationType as T

        ckpt.mkdir(parents=True, exist_ok=True)
        special = _tokenizer(str(ckpt))
        cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                             moe_intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
                             num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 256,
                             head_dim=64, num_experts=args.experts, num_experts_per_tok=args.top_k,
                             norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=special["<|im_end|>"],
                             pad_token_id=special["<|endoftext|>"], tie_word_embeddings=False)
        log(f"building the model into {root}")
        torch.manual_seed(0)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # made in bf16: a float32 copy of a model this size is not needed
        try:
            m = Qwen3MoeForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(dtype)
        widen_(m, 3)
        m.save_pretrained(str(ckpt))
        todo = [("bf16", T.BF16)]
        if args.quantizer == "gguf-py":
            todo += [("Q8_0", T.Q8_0), ("Q4_0", T.Q4_0), ("Q4_K_M", T.Q4_K)]
        for f, q in todo:  # written under another name first: a file that exists is whole
            tmp = files[f].with_suffix(".part")
            write_gguf(m, str(ckpt), str(tmp), mix(q, q, embed=q))
            os.replace(tmp, files[f])
        del m
    return ckpt, files


def gguf_bytes(path: Path) -> dict:
    """What llama.cpp reads per decode step from a GGUF file (it keeps every tensor as stored): the
    bytes outside the experts (the input embedding, a row gather, left out), one expert slot of each
    layer, the tensor types."""
    import gguf

    r = gguf.GGUFReader(str(path))
    non_expert, experts, types = 0, {}, {}
    E = None
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            experts[layer] = experts.get(layer, 0) + int(t.n_bytes)
            E = int(t.shape[-1])  # gguf-py's shape lists the innermost dimension first: (K, N, E)
        elif t.name != "token_embd.weight":
            non_expert += int(t.n_bytes)
    return {"non_expert_bytes": non_expert, "slot_bytes": [experts[i] // E for i in sorted(experts)],
            "tensor_types": types, "file_bytes": path.stat().st_size}


def expected_hits(E: int, k: int, batch: int) -> float:
    return float(k) if batch == 1 else E * (1.0 - (1.0 - k / E) ** batch)


def step_bytes(b: dict, E: int, k: int, batch: int, context: float, kv_per_token: int) -> float:
    hits = expected_hits(E, k, batch)
    return b["non_expert_bytes"] + hits * sum(b["slot_bytes"]) + batch * context * kv_per_token


# ---- ours --------------------------------------------------------------------------------------
def run_ours(args, path: str, singles, batch) -> dict:
    import gc

    from moe_serve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=len(batch),
              max_num_batched_tokens=max(2048, sum(len(p) for p in batch)), show_progress=False,
              cpu_int8_activations=args.cpu_int8_activations if path.endswith(".gguf") else None)
    cfg = llm.engine.cfg
    res = {"startup_s": time.perf_counter() - t0, "moe_backend": cfg.moe_backend,
           "linear_backend": getattr(cfg, "linear_backend", None), "attention_backend": cfg.attention_backend,
           "int8_activations": any(getattr(m, "cpu_int8_act", False) for m in llm.engine.runner.model.modules())}
    b = llm.engine.meter.bytes
    runner = llm.engine.runner
    kv_per_token = runner.kv_cache_bytes // (runner.num_blocks * runner.cfg.cache.block_size)
    res["bytes"] = {"non_expert_bytes": b.non_expert_bytes, "slot_bytes": list(b.slot_bytes),
                    "kv_bytes_per_token": kv_per_token, "weight_bytes": runner.weight_bytes}
    gc.collect()
    gc.freeze()

    marks: list[tuple[float, list[tuple[str, int]]]] = []  # per engine step: its end, tokens per request
    real_step = llm.engine.step

    def timed_step(*a, **kw):
        outs = real_step(*a, **kw)
        marks.append((time.perf_counter(), [(o.request_id, len(o.new_token_ids)) for o in outs]))
        return outs

    llm.engine.step = timed_step

    def gen(ps, n) -> dict:
        """Decode tokens/s of one generate call: the clock from the end of the step that gave every
        sequence its first token to the end of the last step."""
        marks.clear()
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
        toks = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(x) != n for x in toks):
            raise RuntimeError(f"ours: {[len(x) for x in toks]} output tokens, expected {n} each")
        started, start, decoded = set(), None, 0
        for t, items in marks:
            if start is None:
                started |= {rid for rid, k in items if k}
                if len(started) == len(ps):
                    start, first = t, t
                continue
            decoded += sum(k for _, k in items)
            end = t
        return {"decode_tokens_per_s": decoded / (end - start), "first_token_s": first - t0,
                "decode_s": end - start, "steps": len(marks), "tokens": toks[0]}

    n = args.output_len
    gen([singles[0][:8]], 4)
    gen([p[:8] for p in batch], 4)
    single = [gen([p], n) for p in singles]
    res["single"] = max(single, key=lambda r: r["decode_tokens_per_s"])
    res["single"]["all"] = [r["decode_tokens_per_s"] for r in single]
    res["single"]["tokens"] = single[0]["tokens"]
    conc = [gen(batch, n) for _ in range(args.repeats)]
    for r in conc:
        r.pop("tokens")
    res["concurrent"] = {**max(conc, key=lambda r: r["decode_tokens_per_s"]), "all": conc, "sequences": len(batch)}
    gc.unfreeze()
    llm = None  # the engine's memory back before the next engine starts
    gc.collect()
    return res


# ---- the run -----------------------------------------------------------------------------------
def sol(res: dict, b: dict, E: int, k: int, batch: int, context: float, kv: int, bw: float) -> dict:
    rate = res["decode_tokens_per_s"]
    step_s = batch / rate
    nbytes = step_bytes(b, E, k, batch, context, kv)
    return {"step_ms": 1e3 * step_s, "step_bytes": nbytes, "sol_ms": 1e3 * nbytes / bw,
            "sol_fraction": nbytes / bw / step_s}


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [f"# CPU decode vs llama.cpp: {out['model']}", "",
             f"{m['cpu']} ({m['isa']}, {m['cores']} cores; our kernels {m['kernels']}); {out['threads']} threads "
             f"both engines; llama-cpp-python {out['peer_version']}; read bandwidth "
             f"{out['read_bandwidth_gbps']['start']:.1f} / {out['read_bandwidth_gbps']['end']:.1f} GB/s "
             f"(start / end); load average {out['load_average']['start'][0]:.1f} at the start, "
             f"{out['load_average']['end'][0]:.1f} at the end.", "",
             f"Prompts of {out['prompt_len']} tokens, {out['output_len']} output tokens, decode only (prefill "
             f"excluded), greedy. % SoL: bytes a step must read (each engine's own weights) / read bandwidth / "
             f"step time. Ours with int8 activations: " + (", ".join(
                 f"{r['format']} {'yes' if r.get('ours', {}).get('int8_activations') else 'no'}"
                 for r in out["rows"]) or "-") + " (--cpu-int8-activations: "
             f"{ {None: 'default, on for GGUF', True: 'on', False: 'off'}[out.get('cpu_int8_activations')]})", "",
             "| format | B | ours tok/s | llama.cpp tok/s | ours / llama.cpp | ours % SoL | llama.cpp % SoL |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in out["rows"]:
        for key, B in (("single", 1), ("concurrent", out["concurrency"])):
            o, p = row.get("ours", {}).get(key), row.get("llama_cpp", {}).get(key)
            ot = f"{o['decode_tokens_per_s']:.1f}" if o else "-"
            pt = f"{p['decode_tokens_per_s']:.1f}" if p else "-"
            ratio = f"{o['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x" if o and p else "-"
            osol = f"{100 * o['sol']['sol_fraction']:.0f}%" if o else "-"
            psol = f"{100 * p['sol']['sol_fraction']:.0f}%" if p else "-"
            lines.append(f"| {row['format']} | {B} | {ot} | {pt} | {ratio} | {osol} | {psol} |")
    if out.get("note"):
        lines += ["", out["note"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--peer-worker":
        print(json.dumps(peer_worker(json.loads(sys.argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="our engine's --dtype")
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--quantizer", choices=("llama.cpp", "gguf-py"), default="llama.cpp")
    p.add_argument("--peer-python", default="/opt/llama-venv/bin/python")
    p.add_argument("--peer-amx", action="store_true",
                   help="let llama.cpp use its AMX buffer type (faults on this VM: see refuse_amx)")
    p.add_argument("--peer-timeout", type=float, default=900.0)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--cpu-int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="ours with --cpu-int8-activations / --no-cpu-int8-activations on the GGUF formats (default: "
                        "the engine's, on for GGUF files)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from bench.machine import machine
    from bench.synthetic_models import cache_dir
    from moe_serve.speed_of_light import measure_bandwidth

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    name = (f"qwen3-moe-d{args.hidden}-l{args.layers}-e{args.experts}k{args.top_k}-f{args.moe_intermediate}"
            + ("-ggufpy" if args.quantizer == "gguf-py" else ""))
    formats = args.formats.split(",")
    for fmt in formats:
        if fmt not in FORMATS:
            raise SystemExit(f"--formats: {fmt!r} is not one of {', '.join(FORMATS)}")
    ckpt, files = build(args, Path(cache_dir()) / "llama_cpp_decode" / name, formats)
    bw_start = measure_bandwidth("cpu")
    log(f"{name}: read bandwidth {bw_start / 1e9:.1f} GB/s, load average {load_start}")

    from bench.synthetic_models import token_pool

    pool = token_pool(str(ckpt))
    rng = random.Random(args.seed)
    prompt = lambda: [rng.choice(pool) for _ in range(args.prompt_len)]  # noqa: E731
    singles = [prompt() for _ in range(args.repeats)]
    batch = [prompt() for _ in range(args.concurrency)]
    context = args.prompt_len + args.output_len / 2  # the mean context of the decode steps
    E, k = args.experts, args.top_k
    hcfg = json.loads((ckpt / "config.json").read_text())
    llama_kv = 2 * hcfg["num_hidden_layers"] * hcfg["num_key_value_heads"] * hcfg["head_dim"] * 2  # f16 K, V

    out = {"machine": machine(), "model": name, "config": hcfg, "files": {f: str(v) for f, v in files.items()},
           "threads": args.threads, "prompt_len": args.prompt_len, "output_len": args.output_len,
           "concurrency": args.concurrency, "repeats": args.repeats, "our_dtype": args.dtype,
           "quantizer": args.quantizer, "peer_amx": args.peer_amx, "peer_version": None if args.skip_peer else peer_version(args.peer_python),
           "note": args.note, "cpu_int8_activations": args.cpu_int8_activations, "rows": []}
    for fmt in formats:
        row: dict = {"format": fmt, "gguf": str(files[fmt])}
        row["gguf_bytes"] = gguf_bytes(files[fmt])
        log(f"{fmt}: ours")
        try:
            ours = run_ours(args, str(ckpt) if fmt == "bf16" else str(files[fmt]), singles, batch)
            row["ours"] = ours
            log(f"  ours {fmt}: {ours['single']['decode_tokens_per_s']:.1f} tok/s single, "
                f"{ours['concurrent']['decode_tokens_per_s']:.1f} tok/s at {args.concurrency}")
        except Exception as e:  # a failed row is recorded, the others still run
            row["ours"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
            log(f"  ours {fmt} failed: {row['ours']['error'][:500]}")
        if not args.skip_peer:
            log(f"{fmt}: llama.cpp")
            peer = run_peer(args, str(files[fmt]), singles, batch)
            if "error" not in peer:
                log(f"  llama.cpp {fmt}: {peer['single']['decode_tokens_per_s']:.1f} tok/s single, "
                    f"{peer['concurrent']['decode_tokens_per_s']:.1f} tok/s at {args.concurrency}")
                if "single" in row.get("ours", {}):
                    a, b2 = row["ours"]["single"]["tokens"], peer["single"]["tokens"]
                    row["greedy_prefix_agreement"] = next((i for i, (x, y) in enumerate(zip(a, b2)) if x != y),
                                                          min(len(a), len(b2)))
            else:
                log(f"  llama.cpp {fmt} failed: {peer['error'][-500:]}")
            row["llama_cpp"] = peer
        out["rows"].append(row)
    bw_end = measure_bandwidth("cpu")
    out["read_bandwidth_gbps"] = {"start": bw_start / 1e9, "end": bw_end / 1e9}
    bw = max(bw_start, bw_end)
    for row in out["rows"]:
        for who, b, kv in (("ours", row["ours"].get("bytes"), None), ("llama_cpp", row["gguf_bytes"], llama_kv)):
            r = row.get(who, {})
            for key, B in (("single", 1), ("concurrent", args.concurrency)):
                if key in r:
                    r[key]["sol"] = sol(r[key], b, E, k, B, context, kv or b["kv_bytes_per_token"], bw)
    out["load_average"] = {"start": load_start, "end": os.getloadavg()}
    md = markdown(out)
    print(md)
    dest = Path(args.out or HERE / "results" / f"llama_cpp_decode_{name}_threads{args.threads}.json")
    dest.write_text(json.dumps(out, indent=2))
    dest.with_suffix(".md").write_text(md)
    log(f"wrote {dest} and {dest.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
