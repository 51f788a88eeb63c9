"""Router replay (SamplingParams.return_routed_experts): every prompt and output position's routed
experts equal those transformers' own routers choose when it runs the same tokens (forward hooks on
its router modules record their top-k), for Qwen3-MoE (softmax top-k), DeepSeek-V3 (grouped sigmoid
routing with a bias; its first layer dense) and GPT-OSS (biased top-k). Under chunked prefill,
preemption by recompute and prefix-cache hits (a second round of the same prompts), with n-gram
speculation, with an expert placement that permutes and replicates experts, and through online
rebalancing (EPLB): logical ids out.

A position's set of experts may differ only where transformers' own choice is a near-tie: the margin
between its k-th and (k+1)-th selection score (DeepSeek-V3: also between its kept and dropped
groups) under 1e-3, the rule the parity tests use for tokens.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_serve import LLM, SamplingParams
from tests.models.test_hf_parity import hf_model, make_prompts
from tests.models.test_spec_decode import NGRAM, repetitive_prompts

MAX_NEW = 8
TIE = 1e-3


def _kth_margin(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    v = torch.sort(scores_TE, dim=-1, descending=True)[0]
    return v[:, k - 1] - v[:, k]


def _margin(router, logits_TE: torch.Tensor) -> torch.Tensor:
    """Per token, how far transformers' choice is from a tie (its own selection scores)."""
    if hasattr(router, "num_group"):  # DeepSeek-V3: groups first, then experts in the kept groups
        s = logits_TE.sigmoid() + router.e_score_correction_bias
        T, G = s.shape[0], router.num_group
        group = s.view(T, G, -1).topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros_like(group).scatter_(1, torch.topk(group, router.topk_group, dim=-1)[1], 1)
        masked = s.masked_fill(kept.repeat_interleave(s.shape[1] // G, dim=1) == 0, float("-inf"))
        gm = _kth_margin(group, router.topk_group) if router.topk_group < G else torch.full((T,), float("inf"))
        return torch.minimum(gm, _kth_margin(masked, router.top_k))
    return _kth_margin(logits_TE, router.top_k)


def hf_routing(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' routing of one forward over `ids`: sorted top-k ids [positions, MoE layers, k]
    and each (position, layer)'s tie margin [positions, MoE layers]."""
    routers = [m for name, m in model.named_modules() if type(m).__name__.endswith("Router")]
    got: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(mod, args, out):
        logits, _, idx = out
        got.append((torch.sort(idx.reshape(-1, idx.shape[-1]), dim=-1)[0], _margin(mod, logits.reshape(len(ids), -1))))

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    assert len(got) == len(routers) > 0
    return (torch.stack([g[0] for g in got], 1).numpy(), torch.stack([g[1] for g in got], 1).numpy())


def assert_same_routing(model, prompt: list[int], output: list[int], ours) -> None:
    """ours: [prompt + output - 1, layers, k] equal to transformers' over prompt + output[:-1]."""
    fed = prompt + output[:-1]
    ref, margin = hf_routing(model, fed)
    assert ours is not None and ours.dtype == np.int16
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    differ = np.argwhere((np.sort(ours, -1) != ref).any(-1))
    for p, l in differ:
        assert margin[p, l] < TIE, (f"position {p} layer {l}: {sorted(ours[p, l])} vs transformers "
                                    f"{ref[p, l].tolist()} with margin {margin[p, l]:.4g}")
    assert len(differ) <= max(2, ours.shape[0] * ours.shape[1] // 50), f"{len(differ)} near-ties is too many"


def check_generation(llm: LLM, model, prompts: list[list[int]], **sp) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, return_routed_experts=True, **sp))
    for p, o in zip(prompts, outs):
        assert_same_routing(model, p, o.outputs[0].token_ids, o.outputs[0].routed_experts)
    return outs


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_routing_matches_transformers(checkpoints, extra_checkpoints, arch):
    """Chunked prefill mixed with decode, preemption by recompute, then the same prompts again:
    their prompt positions served from the prefix cache carry the rows kept with the blocks."""
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    model = hf_model(path)
    prompts = make_prompts(3)
    # 40 blocks of 4 tokens: fewer than the 11 requests need at once, so requests are preempted.
    llm = LLM(path, dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=16,
              show_progress=False)
    check_generation(llm, model, prompts)
    core = llm.engine
    assert core.scheduler.num_preemptions > 0, "the test meant to exhaust the KV cache did not"
    hits = core.allocator.hit_tokens
    outs = check_generation(llm, model, prompts[-3:])
    assert core.allocator.hit_tokens > hits and any(o.num_cached_tokens > 0 for o in outs)
    feature = core.feature("routed_experts")
    assert not feature._live  # every request's rows were dropped when it ended
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=2))
    assert feature.record not in core.runner.load_hooks and not feature.active  # nobody asks: the hook is off


def test_cache_filled_without_the_field_gives_no_hits_to_it(checkpoints):
    """A prompt cached by a request that did not ask has no rows kept: a request that asks computes
    it again (correct rows, no hit); the next one that asks takes the hit and the kept rows."""
    path = checkpoints["qwen3_moe"]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    prompt = make_prompts(1)[-1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.outputs[0].routed_experts is None
    assert llm.engine.feature("routed_experts").record not in llm.engine.runner.load_hooks
    model = hf_model(path)
    first, second = [check_generation(llm, model, [prompt])[0] for _ in range(2)]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0


def test_ngram_speculation_keeps_only_accepted_positions(checkpoints):
    path = checkpoints["qwen3_moe"]
    model = hf_model(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=96, speculative_config=NGRAM, show_progress=False)
    prompts = [p["prompt_token_ids"] for p in repetitive_prompts(4)]
    check_generation(llm, model, prompts, ignore_eos=True)
    assert llm.engine.spec.num_accepted_tokens > 0, "no draft was accepted: speculation was not exercised"


def test_placement_with_replicas_returns_logical_ids(checkpoints, tmp_path):
    """Slots hold the experts in reverse order and experts 0 and 5 twice: ids are still logical."""
    path = checkpoints["qwen3_moe"]
    E = 8
    row = list(range(E - 1, -1, -1)) + [0, 5]
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"physical_to_logical": [row, row], "gpus": 1, "nodes": 1,
                                     "num_logical_experts": E}))
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 21, expert_placement=str(placement), show_progress=False)
    assert any(getattr(m, "replica_map", None) is not None for m in llm.engine.runner.model.modules())
    check_generation(llm, hf_model(path), make_prompts(5)[:6])


def test_online_rebalancing_keeps_logical_ids(checkpoints):
    """EPLB moves experts between slots (and places replicas) while requests run: the rows stay the
    logical experts transformers chooses, before and after each rebalance."""
    path = checkpoints["qwen3_moe"]
    model = hf_model(path)
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 21, enable_eplb=True, num_redundant_experts=2,
              eplb_window_size=4, eplb_step_interval=3, show_progress=False)
    prompts = make_prompts(4)
    # A placement is tuned in a background thread and switched in at a later step: the requests are
    # served again (each time checked) until a rebalance has landed, however slow the machine.
    done = 0
    for _ in range(30):
        check_generation(llm, model, prompts[:len(prompts) // 2])
        done = llm.engine.stats().eplb.rebalances
        if done:
            break
    assert done > 0, "no rebalance happened in 30 rounds of requests"
    for _ in range(30):
        check_generation(llm, model, prompts[len(prompts) // 2:])  # served by the rebalanced placement
        if llm.engine.stats().eplb.rebalances > done:
            break
    assert llm.engine.stats().eplb.rebalances > done, "no second rebalance in 30 rounds of requests"


def test_rows_kept_before_the_cache_forgot_its_prefixes_are_not_served(checkpoints):
    """After every prefix is forgotten (a weight update flushes the cache), the rows kept by block
    hash are stale: a prompt cached again by a request that did not ask gives no hit to one that
    asks (it computes its rows); a request live across the reset does not keep its rows."""
    path = checkpoints["qwen3_moe"]
    llm = LLM(path, dtype="float32", kv_cache_memory=1 << 20, show_progress=False)
    model = hf_model(path)
    prompt = make_prompts(1)[-1]
    first, hit = [check_generation(llm, model, [prompt])[0] for _ in range(2)]
    assert first.num_cached_tokens == 0 and hit.num_cached_tokens > 0  # rows were kept and served
    llm.engine.scheduler.forget_prefixes(live=True)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3))  # cached again, no rows
    again = check_generation(llm, model, [prompt])[0]
    assert again.num_cached_tokens == 0, "rows kept before the reset were served for a prefix cached after it"
    assert check_generation(llm, model, [prompt])[0].num_cached_tokens > 0  # kept anew from its own rows
