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
engine's own. Two ways to run, the first whose imports work (or the second with --model-only):
  engine      `moe_serve.LLM` end to end (scheduler, sampler, detokenizer): needs tokenizers, tqdm
              and msgspec besides torch;
  model-only  the same model modules (`moe_serve.models`, attention, MoE layers, Triton kernels)
              driven by a fixed-batch loop here: one prefill, then decode steps of forward + greedy
              argmax on preallocated device metadata, replayed as one CUDA graph per step on a GPU.
              Needs torch (and Triton on a GPU) only, so it runs on a bare GPU machine; it measures
              the model's step, without the engine's per-step host work.
Never imports the HTTP server. Writes bench/results/decode_sol_<gpu>_<time>.json (not with --smoke).
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


def init_on_device(model: torch.nn.Module, seed: int = 0) -> None:
    """Dummy weights drawn on each parameter's own device. Same rules as the engine's
    init_dummy_weights (norms 1, e_score_correction_bias 0, else normal with std fan_in^-0.5)."""
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


def install_device_dummy_init() -> bool:
    """Make the engine's load_format="dummy" draw weights on their own device (init_on_device)."""
    import moe_serve.runner.loading as loading

    if not hasattr(loading, "init_dummy_weights"):
        return False
    loading.init_dummy_weights = init_on_device
    return True


class ModelOnlyDecoder:
    """The engine's model modules on a fixed batch: prefill once, then greedy decode steps.

    Every sequence of a batch has the same prompt length, so each decode step's metadata is
    computable on the device from the last one (context + 1, the next slot from the block table):
    no host->device copy or host sync inside the step loop, and on CUDA the step is captured once as
    a graph and replayed (as the engine does for decode). Block b * per_seq + i holds sequence b's
    i-th block.
    """

    def __init__(self, hf: dict, device: torch.device, moe_backend: str, attention_backend: str,
                 max_batch: int, max_len: int, block_size: int = 16, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        from attention.layer import PagedAttention, PagedMLAAttention
        from expert_parallel.runtime.dispatch.local import LocalDispatcher
        from expert_parallel.runtime.layer import MoEContext, num_default_slots
        from moe_serve import platform
        from moe_serve.models.registry import model_class, num_logical_experts

        arch = hf["architectures"][0]
        choice = platform.choose(device.type, moe_backend, attention_backend)
        self.moe_backend, self.attention_backend = choice.moe_backend, choice.attention_backend
        ctx = MoEContext(LocalDispatcher(num_default_slots(num_logical_experts(arch, hf), 1)))
        self.dtype = dtype
        with torch.device(device):
            self.model = model_class(arch)(hf, ctx, self.dtype)
        platform.bind_ops(self.model, platform.resolve_ops(device, choice.moe_backend, choice.attention_backend,
                                                           choice.linear_backend, choice.norm_backend))
        self.model.requires_grad_(False)
        self.model.eval()
        init_on_device(self.model, seed)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.device, self.block_size = device, block_size
        self.per_seq = -(-max_len // block_size)
        num_blocks = max_batch * self.per_seq
        layers = [m for m in self.model.modules() if isinstance(m, (PagedAttention, PagedMLAAttention))]
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = sum(elem * _numel(s) for layer in layers for s in layer.cache_shape(1, 1))
        for layer in layers:
            layer.bind([torch.zeros(s, dtype=self.dtype, device=device) for s in layer.cache_shape(num_blocks, block_size)])
        self.kv_cache_bytes = num_blocks * block_size * self.kv_bytes_per_token
        self.max_len = self.per_seq * block_size
        self.state: dict[int, tuple] = {}
        self.graphs: dict[int, tuple] = {}
        self.graph_failed = False

    def _meta(self, B: int, q_len: int, ctx: int):
        from attention.metadata import AttentionMetadata

        tables = [list(range(b * self.per_seq, (b + 1) * self.per_seq)) for b in range(B)]
        return AttentionMetadata.build([q_len] * B, [ctx] * B, tables, self.block_size, device=self.device)

    def _step(self, tok_B, pos_B, meta):
        h = self.model(tok_B, pos_B, meta)
        return self.model.compute_logits(h).argmax(-1)

    def _decode_state(self, B: int, ctx: int):
        """Static decode buffers for batch B (made once per B, so a captured graph keeps reading
        them), reset to a first decode step at context ctx (this step's token included)."""
        from attention.metadata import AttentionMetadata

        m = self._meta(B, 1, ctx)
        if B not in self.state:
            self.state[B] = (m, torch.empty(B, dtype=torch.int64, device=self.device))
        meta, pos = self.state[B]
        meta.seq_lens.copy_(m.seq_lens)
        meta.slot_mapping.copy_(m.slot_mapping)
        meta.seq_lens_cpu, meta.max_seq_len = [ctx] * B, ctx
        meta.backend_plans.clear()  # per-step plans a backend cached on the metadata
        pos.fill_(ctx - 1)
        return meta, pos

    def _advance(self, meta, pos):
        """Next decode step's context, position and slot, in place on the device (and the host
        lengths, which the torch backend reads; a replayed graph reads only the device ones)."""
        pos += 1
        meta.seq_lens += 1
        meta.seq_lens_cpu, meta.max_seq_len = [c + 1 for c in meta.seq_lens_cpu], meta.max_seq_len + 1
        meta.backend_plans.clear()
        blocks = meta.block_tables.gather(1, (pos // self.block_size)[:, None])[:, 0]
        meta.slot_mapping.copy_(blocks.to(torch.int64) * self.block_size + pos % self.block_size)

    def generate(self, prompts: list[list[int]], n: int, use_graph: bool) -> list[list[int]]:
        """Greedy decode n tokens for equal-length prompts; returns the token ids (read at the end)."""
        B, L = len(prompts), len(prompts[0])
        if L + n > self.max_len:
            raise ValueError(f"prompt {L} + output {n} tokens exceed max_len={self.max_len}")
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=self.device)
        pos = torch.arange(L, device=self.device).repeat(B)
        meta = self._meta(B, L, L)
        h = self.model(ids, pos, meta)
        last = meta.query_start_loc[1:].to(torch.int64) - 1
        tok = self.model.compute_logits(h.index_select(0, last)).argmax(-1)
        out = [tok]
        if n > 1:
            dmeta, dpos = self._decode_state(B, L + 1)
            graph = None
            if use_graph and self.device.type == "cuda" and not self.graph_failed:
                try:
                    graph = self._graph(B, dmeta, dpos, tok)
                except RuntimeError as e:  # e.g. a host sync inside the step: measure it eagerly
                    self.graph_failed = True
                    log(f"CUDA graph capture failed ({str(e)[:200]}): eager decode steps from here on")
                    dmeta, dpos = self._decode_state(B, L + 1)
            for _ in range(n - 1):
                if graph is not None:
                    g, tok_in, tok_out = graph
                    tok_in.copy_(tok)
                    g.replay()
                    tok = tok_out.clone()
                else:
                    tok = self._step(tok, dpos, dmeta)
                self._advance(dmeta, dpos)
                out.append(tok)
        return torch.stack(out, 1).tolist()

    def _graph(self, B: int, meta, pos, tok):
        """A CUDA graph of one decode step over batch B's static buffers (captured once per B)."""
        if B not in self.graphs:
            # Host-side lengths only size launches (the split count; any count is right for any
            # context): capture with the longest context these runs reach.
            meta.seq_lens_cpu, meta.max_seq_len = [self.max_len] * B, self.max_len
            meta.backend_plans.clear()
            tok_in = tok.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up outside the capture: kernel compiles, allocator pools
                    self._step(tok_in, pos, meta)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                tok_out = self._step(tok_in, pos, meta)
            self.graphs[B] = (g, tok_in, tok_out)
        return self.graphs[B]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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


def engine_importable() -> str | None:
    """None if `moe_serve.LLM` imports here, else the missing module's name."""
    try:
        from moe_serve import LLM  # noqa: F401  (the engine only: no FastAPI / uvicorn)
    except ImportError as e:
        return e.name or str(e)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config on the CPU")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=None, help="decode tokens (default 128; smoke 16)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="engine mode: bytes (default 4 GiB; smoke 64 MiB)")
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--engine-dummy-init", action="store_true",
                   help="engine mode: the engine's own dummy init (host CPU random numbers; minutes at this size)")
    p.add_argument("--model-only", action="store_true",
                   help="drive the model modules directly (no tokenizer/scheduler/sampler; torch and Triton only)")
    p.add_argument("--no-cuda-graph", action="store_true", help="model-only mode: eager decode steps")
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
    from bench.sol import decode_bytes_of, decode_bytes_of_model, gb, measure_bandwidth

    mode = "model-only" if args.model_only else "engine"
    if mode == "engine" and (missing := engine_importable()) is not None:
        log(f"the engine does not import here (no module {missing!r}; moe_serve.LLM needs tokenizers, tqdm and "
            f"msgspec): measuring the model alone (--model-only)")
        mode = "model-only"

    cfg = SMOKE if args.smoke else QWEN3_30B_A3B
    tmp = tempfile.mkdtemp(prefix="decode-sol-")
    try:
        t0 = time.perf_counter()
        if mode == "engine":
            from moe_serve import LLM

            write_checkpoint(cfg, tmp)
            if not args.engine_dummy_init and not install_device_dummy_init():
                log("moe_serve.runner.loading has no init_dummy_weights to replace: using the engine's own init")
            llm = LLM(model=tmp, dtype="bfloat16", load_format="dummy", device="cpu" if args.smoke else "auto",
                      kv_cache_memory=args.kv_cache_memory or ((64 << 20) if args.smoke else (4 << 30)),
                      max_model_len=min(4096, cfg["max_position_embeddings"]), max_num_seqs=max(args.batch, 1),
                      max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                      moe_backend=args.moe_backend, attention_backend=args.attention_backend, show_progress=False)
            r = llm.engine.runner
            weight_bytes, kv_bytes = r.weight_bytes, r.kv_cache_bytes
            backends = (llm.engine.cfg.moe_backend, llm.engine.cfg.attention_backend)
            db = decode_bytes_of(llm)

            def timed(prompts: list[list[int]], k: int) -> float:
                return timed_generate(llm, prompts, k, sync)
        else:
            dec = ModelOnlyDecoder(cfg, device, args.moe_backend, args.attention_backend, max(args.batch, 1),
                                   args.prompt_len + n + 1)
            weight_bytes, kv_bytes = dec.weight_bytes, dec.kv_cache_bytes
            backends = (dec.moe_backend, dec.attention_backend)
            db = decode_bytes_of_model(dec.model, dec.kv_bytes_per_token)

            def timed(prompts: list[list[int]], k: int) -> float:
                sync()
                t = time.perf_counter()
                toks = dec.generate(prompts, k, use_graph=not args.no_cuda_graph)  # reads tokens: synced
                dt = time.perf_counter() - t
                if {len(x) for x in toks} != {k}:
                    raise RuntimeError(f"expected {k} tokens per sequence")
                return dt
        sync()
        log(f"[{mode}] model built in {time.perf_counter() - t0:.1f} s: {gb(weight_bytes)} of bf16 weights, KV cache "
            f"{gb(kv_bytes)}, moe_backend={backends[0]}, attention_backend={backends[1]}")
        bw = measure_bandwidth(device, (256 << 20) if args.smoke else (4 << 30), repeats=10)
        log(f"bandwidth ({'CPU' if device.type == 'cpu' else 'device'} copy, read + write): {bw / 1e9:.0f} GB/s; "
            f"per step: non-expert {gb(db.non_expert_bytes)}, {db.num_moe_layers} MoE layers x "
            f"{db.expert_bytes / 1e6:.2f} MB per expert, KV {db.kv_bytes_per_token} B per cached token")

        vocab = 512 if not args.smoke else cfg["vocab_size"]
        rng = random.Random(0)

        def prompts(b: int) -> list[list[int]]:  # fresh every call: no prefix-cache hits
            return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(b)]

        t0 = time.perf_counter()
        for b in sorted({1, args.batch}):  # warm-up: kernel compilation, autotuning, graph capture
            timed(prompts(b), 4)
        log(f"warm-up {time.perf_counter() - t0:.1f} s")

        rows = []
        for b in sorted({1, args.batch}):
            t1 = min(timed(prompts(b), 1) for _ in range(2))
            tn = timed(prompts(b), n)
            step_s = (tn - t1) / (n - 1)
            tok_s = b / step_s
            ctx = b * (args.prompt_len + n / 2)  # mean cached tokens over the decode steps
            step_bytes = db.step_bytes(b, int(ctx))
            sol = db.sol_tokens_per_s(b, int(ctx), bw)
            rows.append({"batch": b, "output_len": n, "prefill_plus_first_token_s": t1, "total_s": tn,
                         "step_ms": 1e3 * step_s, "decode_tokens_per_s": tok_s, "bytes_per_step": step_bytes,
                         "sol_step_ms": 1e3 * step_bytes / bw, "sol_tokens_per_s": sol,
                         "pct_of_sol": 100 * tok_s / sol})
            log(f"[{mode}] batch {b:3d}: {tok_s:9.1f} tok/s ({1e3 * step_s:7.2f} ms/step); speed of light "
                f"{sol:9.1f} tok/s ({step_bytes / 1e9:.2f} GB/step, {1e3 * step_bytes / bw:.2f} ms) -> "
                f"{100 * tok_s / sol:5.1f}% of SOL")
        result = {"environment": env, "smoke": args.smoke, "mode": mode, "config": cfg, "prompt_len": args.prompt_len,
                  "bandwidth_bytes_per_s": bw, "decode_bytes": db.as_dict(),
                  "moe_backend": backends[0], "attention_backend": backends[1],
                  "cuda_graph": mode == "model-only" and bool(dec.graphs) and not dec.graph_failed,
                  "device_dummy_init": mode == "model-only" or not args.engine_dummy_init, "results": rows}
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
