"""The decode speed of light (moe_serve/speed_of_light.py): the bytes the engine counts for its
decode steps, against a count made by hand from the checkpoint's files, its config and
transformers' own routing of the same tokens; and the fraction it reports."""
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from moe_serve import LLM, SamplingParams

N_OUT = 6  # tokens per request: the first from the prefill step, then N_OUT - 1 decode steps


def by_hand(path: str, seqs: list[list[int]], prompt_lens: list[int]) -> int:
    """Bytes of every decode step of `seqs` (prompt + generated tokens, all prefilled in one step
    and decoded together), from the checkpoint alone: weights outside the experts (the untied input
    embedding is gathered, not read), the distinct experts transformers routes each step's tokens
    to per MoE layer, and K/V of the tokens each layer's query sees (a sliding layer its window)."""
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(os.path.join(path, "config.json")))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in tensors.values())
    non_expert = sum(t.numel() * 4 for k, t in tensors.items()
                     if ".mlp.experts." not in k and k != "model.embed_tokens.weight")
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    per_expert: dict[int, int] = {}  # layer index -> bytes of one expert (weights and biases)
    for k, t in tensors.items():
        if ".mlp.experts." in k:
            layer = int(k.split(".")[2])
            assert t.shape[0] == E
            per_expert[layer] = per_expert.get(layer, 0) + t[0].numel() * 4
    moe_layers = sorted(per_expert)
    kv_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V of one token, one layer
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    routes = []  # per sequence: per MoE layer, (T, top_k) expert ids
    with torch.no_grad():
        for s in seqs:
            out = hf(torch.tensor([s[:-1]]), output_router_logits=True)
            logits = [r for r in out.router_logits if r.shape[-1] == E]
            assert len(logits) == len(moe_layers)
            routes.append([r.reshape(len(s) - 1, E).topk(cfg["num_experts_per_tok"], -1).indices for r in logits])
    total = 0
    for j in range(1, N_OUT):  # decode step j: each sequence's token at position P + j - 1
        total += non_expert
        for li, layer in enumerate(moe_layers):
            hit = set()
            for b, p in enumerate(prompt_lens):
                hit |= set(routes[b][li][p + j - 1].tolist())
            total += len(hit) * per_expert[layer]
        for p in prompt_lens:
            n = p + j  # tokens cached once this step wrote its own
            total += sum((min(n, window) if kind == "sliding_attention" else n) * kv_token for kind in kinds)
    return total


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_decode_bytes_match_a_count_by_hand(arch, checkpoints, extra_checkpoints):
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    llm = LLM(path, dtype="float32", num_kv_blocks=64, speed_of_light_window=1e9, show_progress=False)
    meter = llm.engine.meter
    rng = random.Random(3)
    for batch in (1, 8):
        prompts = [[rng.randrange(10, 500) for _ in range(rng.randrange(4, 20))] for _ in range(batch)]
        before = (meter.total_bytes, meter.total_steps, meter.total_seconds)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=N_OUT, temperature=0, ignore_eos=True), use_tqdm=False)
        steps = meter.total_steps - before[1]
        counted = meter.total_bytes - before[0]
        seconds = meter.total_seconds - before[2]
        assert steps == N_OUT - 1, f"batch {batch}: {steps} decode steps metered"
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        assert counted == by_hand(path, seqs, [len(p) for p in prompts]), f"batch {batch}"
        # The gauge: the window's bytes at the bandwidth, over the window's time.
        assert meter.fraction == pytest.approx(counted / meter.bandwidth / seconds, rel=1e-9)
        assert llm.engine.stats().decode_sol_fraction == meter.fraction > 0


def test_bandwidth_override_and_refusal(checkpoints):
    from moe_serve.speed_of_light import device_bandwidth

    assert device_bandwidth("cpu", 123.0) == (123e9, "--memory-bandwidth")
    with pytest.raises(ValueError, match="memory_bandwidth"):
        LLM(checkpoints["qwen3_moe"], dtype="float32", memory_bandwidth=0.0, show_progress=False)
    bw, source = device_bandwidth("cpu")
    assert bw > 1e8 and "measured" in source
