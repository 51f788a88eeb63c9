"""Checkpoints for the benchmarks: random-init MoE models big enough to be memory-bound, and the
built-in default model.

`resolve_model(spec)` accepts
- a checkpoint directory (any architecture the engine supports),
- "default": the built-in default model (moe-smollm2-4x135m, or the tiny random fallback). If its
  build's self-check fails (a quality gate, not a shape problem) the same recipe is built once more
  without the check into the benchmark cache, so performance can still be measured; the returned
  description says so,
- "synthetic-mixtral" / "synthetic-qwen3": random-init models written by transformers itself
  (`save_pretrained`, float32 on disk) with a byte-level BPE tokenizer trained at build time,
- "qwen3-moe-tiny" / "qwen3-moe-mid": the same, Qwen3-MoE with 32 experts top-4, head_dim 64 (vLLM's
  CPU backend rejects head_dim 16) and a tokenizer that fills the whole 4096-token vocabulary, so
  every id a random model emits detokenizes the same way in any engine (bench/overhead.py).

Built checkpoints live under $MOE_SERVE_CACHE/bench (default ~/.cache/moe-serve/bench), built once.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The repository root first, and not bench/ itself: bench/kernels.py would shadow the `kernels` package.
sys.path[:] = [str(HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != HERE]

log = logging.getLogger("bench.models")

# About 152M parameters (608 MB in float32, 304 MB in bfloat16): 8 layers of 8 experts (top-2) of
# D=512, F=1408. One decode token reads ~48M of them (2 of 8 experts), far more than the CPU's
# last-level cache, so single-stream decode streams weights from memory.
SYNTHETIC = {
    "synthetic-mixtral": dict(
        architectures=["MixtralForCausalLM"], vocab_size=8192, hidden_size=512, intermediate_size=1408,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=False),
    "synthetic-qwen3": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=8192, hidden_size=512, intermediate_size=1408,
        moe_intermediate_size=704, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False),
    # Memory-bound single-stream decode: ~231 MB read per token in float32 (6 layers of 16 experts of
    # 1024 x 1024, top-2), the shape the CPU speed-of-light figure is quoted for.
    "qwen3-moe-membound": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=4096, hidden_size=1024, intermediate_size=2048,
        moe_intermediate_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False),
    # ~8M parameters (~31 MB float32): per-step host overhead dominates its decode.
    "qwen3-moe-tiny": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=4096, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2,
        head_dim=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, tokenizer_vocab=4096),
    # ~110M parameters (~440 MB float32): 32 experts of F=256 (F=512 would be ~850 MB).
    "qwen3-moe-mid": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=4096, hidden_size=512, intermediate_size=1024,
        moe_intermediate_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=4096,
        rope_theta=10000.0, tie_word_embeddings=False, tokenizer_vocab=4096),
}
BUILD_VERSION = 1


def _tokenizer_corpus(seed: int = 0) -> str:
    """Enough distinct text for a BPE vocabulary of a few thousand merges: the trainer's own corpus
    plus deterministic lines of common words and random letter strings."""
    import random

    from bench.serve import WORDS
    from moe_serve.default_model.tokenizer_train import _CORPUS

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = [_CORPUS]
    for _ in range(4000):
        lines.append(" ".join(rng.choice(WORDS) if rng.random() < 0.6 else
                              "".join(rng.choice(letters) for _ in range(rng.randint(3, 9))) for _ in range(12)))
    return "\n".join(lines)


def cache_dir() -> str:
    root = os.environ.get("MOE_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moe-serve")
    return os.path.join(root, "bench")


def _publish(tmp: str, out: str) -> None:
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


def build_synthetic(name: str, out_dir: str) -> str:
    """Write the random-init checkpoint `name` (a key of SYNTHETIC) into `out_dir`."""
    import torch
    import transformers

    from moe_serve.default_model.tokenizer_train import special_token_ids, train_tokenizer

    spec = dict(SYNTHETIC[name])
    arch = spec.pop("architectures")[0]
    tok_vocab = spec.pop("tokenizer_vocab", None)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=os.path.dirname(out_dir))
    try:
        if tok_vocab:
            train_tokenizer(tmp, tok_vocab, _tokenizer_corpus())
        else:
            train_tokenizer(tmp)
        special = special_token_ids(tmp)
        cfg_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
        cfg = cfg_cls(**spec, eos_token_id=special["<|im_end|>"], bos_token_id=None,
                      pad_token_id=special["<|endoftext|>"])
        torch.manual_seed(0)
        model = getattr(transformers, arch)(cfg).eval()
        from tests.checkpoints import widen_  # the tests' widened init: no near-tied logits

        widen_(model, 1)
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, "bench_build.json"), "w") as f:
            json.dump({"name": name, "version": BUILD_VERSION}, f)
        _publish(tmp, out_dir)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return out_dir


def _built(path: str, name: str) -> bool:
    try:
        with open(os.path.join(path, "bench_build.json")) as f:
            m = json.load(f)
        return m.get("name") == name and m.get("version") == BUILD_VERSION
    except (OSError, ValueError):
        return False


def token_pool(path: str) -> list[int]:
    """Token ids of the checkpoint's tokenizer that are not special tokens (for random-id prompts);
    without tokenizer.json, every id below the model's vocab_size."""
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        return list(range(vocab))
    with open(tok_file) as f:
        tj = json.load(f)
    special = {t["id"] for t in tj.get("added_tokens", [])}
    return [i for i in range(min(vocab, len(tj["model"]["vocab"]))) if i not in special]


def _default_model() -> tuple[str, str, str]:
    """The built-in default model (built once, self-check included, by moe_serve itself)."""
    from moe_serve.default_model import smollm2

    path, desc = smollm2.ensure_default_model()
    return path, os.path.basename(path.rstrip("/")), desc


def ensure_synthetic(name: str, root: str | None = None) -> str:
    """The directory of synthetic checkpoint `name` under `root` (default cache_dir()), built once."""
    path = os.path.join(root or cache_dir(), name)
    if not _built(path, name):
        print(f"[model] building {name} into {path} (once)", flush=True)
        build_synthetic(name, path)
    return path


def describe_synthetic(name: str) -> str:
    s = SYNTHETIC[name]
    return (f"{name}: random-init {s['architectures'][0]}, {s['num_hidden_layers']} layers, "
            f"D={s['hidden_size']}, {s.get('num_local_experts') or s.get('num_experts')} experts "
            f"top-{s['num_experts_per_tok']}")


def resolve_model(spec: str) -> tuple[str, str, str]:
    """`(path, short name for file names, one-line description)` of a benchmark model spec."""
    if spec in SYNTHETIC:
        return ensure_synthetic(spec), spec, describe_synthetic(spec)
    if spec == "default":
        return _default_model()
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise SystemExit(f"--model {spec!r}: not a checkpoint directory (no config.json), and not one of "
                         f"'default', {', '.join(repr(k) for k in SYNTHETIC)}")
    return spec, os.path.basename(os.path.abspath(spec).rstrip("/")), spec


if __name__ == "__main__":
    for a in sys.argv[1:] or ["synthetic-mixtral"]:
        print(resolve_model(a))
