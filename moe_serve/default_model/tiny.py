"""A tiny random mixture-of-experts checkpoint in Hugging Face's Mixtral layout, built in milliseconds.

The checkpoint is what `MixtralForCausalLM.from_pretrained` reads: `config.json`,
`generation_config.json`, `model.safetensors` with Mixtral's per-expert tensor names, and a real
byte-level BPE tokenizer (from `tokenizer_train`). It needs no network and no transformers, so the
engine's own tests and the server's fallback can always build one.

Also home of `atomic_directory`, the one way the built-in checkpoints reach their final folder:
everything is written into a temporary sibling folder which is renamed into place at the end, so
another process sees either no model or a whole one, never a half-written one.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import torch
from safetensors.torch import save_file

from .tokenizer_train import special_token_ids, train_tokenizer

logger = logging.getLogger(__name__)

TINY_MODEL_NAME = "moe-tiny-random"

# Shapes of the tiny model. Small enough to build and run anywhere, big enough to have every
# feature the engine must get right: GQA (4 query heads over 2 KV heads), several layers, more
# experts than top-k, an untied lm_head.
TINY_SHAPES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)


# ----------------------------------------------------------------------------------------------
# Atomic folder publication


def _is_destination_taken(err: OSError) -> bool:
    # POSIX says ENOTEMPTY or EEXIST when renaming a folder onto a non-empty one; Windows raises
    # FileExistsError (or PermissionError while a reader holds a file open).
    return isinstance(err, (FileExistsError, PermissionError)) or err.errno in (errno.ENOTEMPTY, errno.EEXIST)


def publish_directory(tmp_dir: str, out_dir: str, replace: bool = True) -> bool:
    """Rename the finished `tmp_dir` to `out_dir`. Returns True if ours is now at `out_dir`.

    If `out_dir` already holds something: with `replace`, the old folder is first renamed aside and
    deleted after ours is in place; without it, ours is deleted and False is returned (another
    process won the race and its copy, complete by the same argument, stays).
    """
    try:
        os.rename(tmp_dir, out_dir)
        return True
    except OSError as err:
        if not _is_destination_taken(err):
            raise
    if not replace:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
    parent, name = os.path.split(os.path.abspath(out_dir))
    old = os.path.join(parent, f".old-{name}-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, old)
    os.rename(tmp_dir, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return True


@contextlib.contextmanager
def atomic_directory(out_dir: str, replace: bool = True) -> Iterator[str]:
    """Yield an empty temporary folder next to `out_dir`; on success it becomes `out_dir`.

    The temporary folder lives in the same parent so the final step is a rename within one file
    system. If the body raises, the temporary folder is removed and `out_dir` is untouched.
    """
    parent, name = os.path.split(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=parent)
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private; the published model should not be
        yield tmp_dir
        for entry in os.scandir(tmp_dir):  # some writers (safetensors) create files 0600
            if entry.is_file():
                os.chmod(entry.path, 0o644)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    publish_directory(tmp_dir, out_dir, replace=replace)


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# The tiny model


def tiny_config(bos_token_id: int, eos_token_id: int, pad_token_id: int) -> dict:
    """config.json of the tiny model, in Mixtral's schema."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **TINY_SHAPES,
        "head_dim": TINY_SHAPES["hidden_size"] // TINY_SHAPES["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
    }


def tiny_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under Mixtral's Hugging Face tensor names.

    Linear weights have std 1/sqrt(fan_in), about 50x transformers' 0.02 init: every sub-layer
    (attention, each expert, the router) then moves the residual stream by an amount of order one,
    so a bug in any of them changes the logits visibly, and the logits (std ~2) have clear top-2
    margins instead of near-ties. Norm weights are 1 + noise rather than exactly 1 so that an
    engine which forgets to load them is caught too.
    """
    gen = torch.Generator().manual_seed(seed)
    d, f = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    n_q, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * (gain / in_features**0.5)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(d, generator=gen)

    tensors = {"model.embed_tokens.weight": torch.randn(config["vocab_size"], d, generator=gen)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = norm()
        tensors[p + "self_attn.q_proj.weight"] = linear(n_q * head_dim, d)
        tensors[p + "self_attn.k_proj.weight"] = linear(n_kv * head_dim, d)
        tensors[p + "self_attn.v_proj.weight"] = linear(n_kv * head_dim, d)
        tensors[p + "self_attn.o_proj.weight"] = linear(d, n_q * head_dim)
        tensors[p + "post_attention_layernorm.weight"] = norm()
        tensors[p + "block_sparse_moe.gate.weight"] = linear(config["num_local_experts"], d)
        for j in range(config["num_local_experts"]):
            e = f"{p}block_sparse_moe.experts.{j}."
            tensors[e + "w1.weight"] = linear(f, d)  # gate projection
            tensors[e + "w2.weight"] = linear(d, f)  # down projection
            tensors[e + "w3.weight"] = linear(f, d)  # up projection
    tensors["model.norm.weight"] = norm()
    tensors["lm_head.weight"] = linear(config["vocab_size"], d, gain=2.0)
    return {name: t.contiguous() for name, t in tensors.items()}


def write_tiny_model(out_dir: str, seed: int = 0) -> None:
    """Write the tiny checkpoint's files into the existing folder `out_dir` (not atomic)."""
    train_tokenizer(out_dir, vocab_size=TINY_SHAPES["vocab_size"])
    ids = special_token_ids(out_dir)
    config = tiny_config(
        bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"]
    )
    save_file(tiny_tensors(config, seed), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    write_json(os.path.join(out_dir, "config.json"), config)
    write_json(
        os.path.join(out_dir, "generation_config.json"),
        {
            "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"],
            "pad_token_id": config["pad_token_id"],
        },
    )


def build_tiny_model(out_dir: str, seed: int = 0) -> str:
    """Write the tiny random Mixtral checkpoint (with tokenizer) to `out_dir`; returns `out_dir`.

    Deterministic in `seed`. An existing `out_dir` is replaced atomically.
    """
    with atomic_directory(out_dir) as tmp:
        write_tiny_model(tmp, seed)
    logger.info("built the tiny random MoE checkpoint %s (seed %d)", out_dir, seed)
    return out_dir
