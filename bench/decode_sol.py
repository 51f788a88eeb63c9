"""Decode speed of light on a Qwen3-30B-A3B-sized model with dummy weights: single stream and batch 64.

    python bench/decode_sol.py            # on a CUDA machine (bench/gpu_check.sh runs this)
    python bench/decode_sol.py --smoke    # a tiny config of the same shape family, on the CPU

The model is built from a config.json alone (`load_format="dummy"`, bf16): Qwen3-30B-A3B's shapes
(48 layers, D=2048, 32 query / 4 KV heads of 128, 128 experts top-8 of F=768, vocab 151936), a
small tokenizer trained on the spot. Decode tokens/s is measured as (tokens after the first) over
(time for N tokens - time for 1 token), with fresh random prompts every call (no prefix-cache hits).

Speed of light (bench/sol.py) = batch * bandwidth / bytes per step, where bytes per step = every
non-expert weight + distinct experts touched per MoE layer * bytes per expert + the KV cache read.
Distinct experts: top_k for one sequence, E * (1 - (1 - k/E)^B) expected for B sequences under
uniform routing (125.9 of 128 at B = 64). Bandwidth: a device tensor copy measured in the same run.

Dummy weights are drawn on the device here (a CUDA generator, same distribution as the engine's
init_dummy_weights, which draws 30B values on the host CPU: minutes). --engine-dummy-init uses the
engine's own. Imports only the engine (`moe_serve.engine.llm`, which needs torch, tokenizers, tqdm and
msgspec), never the HTTP server. Writes bench/results/decode_sol_<gpu>_<time>.json (not with --smoke).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

import torch  # noqa: E402

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rope_scaling": None, "rms_norm_eps": 1e-6,
    "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# Same family, tiny: every code path of the full run in seconds on a CPU.
SMOKE = {**QWEN3_30B_A3B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
         "moe_intermediate_size": 32, "intermediate_size": 128, "vocab_size": 512,
         "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 2}


def log(msg: str) -> None:
    print(f"[decode_sol {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": "cpu", "gpu": None}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["device"] = "cuda"
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def write_checkpoint(cfg: dict, out_dir: str) -> None:
    from moe_serve.default_model.tokenizer_train import train_tokenizer

    train_tokenizer(out_dir)  # 512-token BPE; ids the model emits beyond it decode to nothing
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def install_device_dummy_init() -> bool:
    """Make load_format="dummy" draw weights on their own device. Same rules as the engine's
    init_dummy_weights (norms 1, e_score_correction_bias 0, else normal with std fan_in^-0.5)."""
    import moe_serve.model_runner as mr

    if not hasattr(mr, "init_dummy_weights"):
        return False

    def init_on_device(model: torch.nn.Module, seed: int = 0) -> None:
        gens: dict[torch.device, torch.Generator] = {}
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or "layernorm" in name:
                    p.fill_(1.0)
                elif "e_score_correction_bias" in name:
                    p.zero_()
                else:
                    g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                    p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)

    mr.init_dummy_weights = init_on_device
    return True


def timed_generate(llm, prompts: list[list[int]], n: int, sync) -> float:
    from moe_serve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    sync()
    dt = time.perf_counter() - t
    got = {len(o.outputs[0].token_ids) for o in outs}
    if got != {n}:
        raise RuntimeError(f"expected {n} tokens per request, got {sorted(got)}")
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=None, help="decode tokens (default 128; smoke 16)")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default 4 GiB; smoke 64 MiB)")
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--engine-dummy-init", action="store_true",
                   help="the engine's own dummy init (host CPU random numbers; minutes at this size)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    n = args.output_len or (16 if args.smoke else 128)
    env = environment()
    log(f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, GPU: {env['gpu'] or 'none'}"
        + (f" ({env['gpu_memory_gib']} GiB)" if env["gpu"] else ""))
    if not args.smoke and env["device"] != "cuda":
        log("no CUDA GPU visible: the full-size run needs one (61 GB of bf16 weights). Use --smoke on a CPU.")
        return 2
    device = torch.device(env["device"] if not args.smoke else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    try:
        from moe_serve import LLM  # noqa: F401  (the engine only: no FastAPI / uvicorn)
        from bench.sol import decode_bytes_of, gb, measure_bandwidth
    except ImportError as e:
        log(f"cannot import the engine: {e}. moe_serve.engine.llm needs torch, tokenizers, tqdm and msgspec "
            f"(moe_serve/protocol.py); install the missing one (pip install {e.name or '...'}).")
        return 2

    cfg = SMOKE if args.smoke else QWEN3_30B_A3B
    tmp = tempfile.mkdtemp(prefix="decode-sol-")
    try:
        write_checkpoint(cfg, tmp)
        if not args.engine_dummy_init and not install_device_dummy_init():
            log("moe_serve.model_runner has no init_dummy_weights to replace: using the engine's own init")
        t0 = time.perf_counter()
        llm = LLM(model=tmp, dtype="bfloat16", load_format="dummy", device="cpu" if args.smoke else "auto",
                  kv_cache_memory=args.kv_cache_memory or ((64 << 20) if args.smoke else (4 << 30)),
                  max_model_len=min(4096, cfg["max_position_embeddings"]), max_num_seqs=max(args.batch, 1),
                  max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                  moe_backend=args.moe_backend, attention_backend=args.attention_backend, show_progress=False)
        sync()
        r = llm.engine.runner
        log(f"model built in {time.perf_counter() - t0:.1f} s: {gb(r.weight_bytes)} of bf16 weights, KV cache "
            f"{gb(r.kv_cache_bytes)}, moe_backend={llm.engine.cfg.moe_backend}, "
            f"attention_backend={llm.engine.cfg.attention_backend}")
        db = decode_bytes_of(llm)
        bw = measure_bandwidth(device, (256 << 20) if args.smoke else (4 << 30), repeats=10)
        log(f"bandwidth ({'CPU' if device.type == 'cpu' else 'device'} copy, read + write): {bw / 1e9:.0f} GB/s; "
            f"per step: non-expert {gb(db.non_expert_bytes)}, {db.num_moe_layers} MoE layers x "
            f"{db.expert_bytes / 1e6:.2f} MB per expert, KV {db.kv_bytes_per_token} B per cached token")

        vocab = 512 if not args.smoke else cfg["vocab_size"]
        rng = random.Random(0)

        def prompts(b: int) -> list[list[int]]:  # fresh every call: no prefix-cache hits
            return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]

        t0 = time.perf_counter()
        for b in sorted({1, args.batch}):  # warm-up: kernel compilation and autotuning for these shapes
            timed_generate(llm, prompts(b), 4, sync)
        log(f"warm-up {time.perf_counter() - t0:.1f} s")

        rows = []
        for b in sorted({1, args.batch}):
            t1 = min(timed_generate(llm, prompts(b), 1, sync) for _ in range(2))
            tn = timed_generate(llm, prompts(b), n, sync)
            step_s = (tn - t1) / (n - 1)
            tok_s = b / step_s
            ctx = b * (args.prompt_len + n / 2)  # mean cached tokens over the decode steps
            step_bytes = db.step_bytes(b, int(ctx))
            sol = db.sol_tokens_per_s(b, int(ctx), bw)
            rows.append({"batch": b, "output_len": n, "prefill_plus_first_token_s": t1, "total_s": tn,
                         "step_ms": 1e3 * step_s, "decode_tokens_per_s": tok_s, "bytes_per_step": step_bytes,
                         "sol_step_ms": 1e3 * step_bytes / bw, "sol_tokens_per_s": sol,
                         "pct_of_sol": 100 * tok_s / sol})
            log(f"batch {b:3d}: {tok_s:9.1f} tok/s ({1e3 * step_s:7.2f} ms/step); speed of light {sol:9.1f} tok/s "
                f"({step_bytes / 1e9:.2f} GB/step, {1e3 * step_bytes / bw:.2f} ms) -> {100 * tok_s / sol:5.1f}% of SOL")
        result = {"environment": env, "smoke": args.smoke, "config": cfg, "prompt_len": args.prompt_len,
                  "bandwidth_bytes_per_s": bw, "decode_bytes": db.as_dict(),
                  "moe_backend": llm.engine.cfg.moe_backend, "attention_backend": llm.engine.cfg.attention_backend,
                  "device_dummy_init": not args.engine_dummy_init, "results": rows}
        out = args.out
        if out is None and not args.smoke:
            gpu = "".join(c if c.isalnum() else "-" for c in (env["gpu"] or "cpu")).strip("-")
            out = str(HERE / "results" / f"decode_sol_{gpu}_{time.strftime('%Y%m%d-%H%M%S')}.json")
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(result, indent=2) + "\n")
            log(f"wrote {out}")
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
