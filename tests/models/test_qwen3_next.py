"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE (Qwen3_5MoeForCausalLM, and the language model
of Qwen3_5MoeForConditionalGeneration): our model, stepped by hand over a paged KV cache and
per-sequence state slots, gives transformers' float32 logits for a whole prompt in one step, for
the same prompt in two chunks, and for a prompt then greedy decode steps (the same tokens as
transformers' generate), also with several sequences of each kind in one step and state slots
holding garbage; the linear-attention states carry the history (resetting one moves the logits);
layer kinds follow transformers; the image-text checkpoint serves its language model; config
values transformers' model does not compute are refused by name."""
from __future__ import annotations

import pytest
import torch

from attention.state import StateCache
from attention.layer import PagedAttention
from attention.metadata import AttentionMetadata
from expert_parallel.runtime.dispatch.local import LocalDispatcher
from expert_parallel.runtime.layer import MoE, MoEContext
from moe_serve.config import ModelConfig
from moe_serve.models.registry import model_class, num_logical_experts
from moe_serve.weights import load_weights
from tests.models.test_hf_parity import check_greedy_parity, hf_greedy
from tests.models.test_llama4 import _copy_with_config

ARCHS = ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_vl"]
BLOCK = 4
ATOL = 1e-4  # float32 logits (their magnitudes are a few units)


def reference(path: str):
    """transformers' model of the checkpoint, float32 (the image-text class for the image-text one)."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

    cfg = ModelConfig.from_path(path, "float32")
    image_text = cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    cls = Qwen3_5MoeForConditionalGeneration if image_text else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0]


class Seq:
    def __init__(self, slot: int):
        self.slot, self.tokens, self.blocks = slot, [], []


class Stepper:
    """Our model of a checkpoint over a paged KV cache and a pool of state slots, stepped by hand:
    each step packs some new tokens of several sequences, as the engine's scheduler would."""

    def __init__(self, path: str, dtype=torch.float32, slots: int = 8, blocks: int = 128):
        cfg = ModelConfig.from_path(path, dtype)
        E = num_logical_experts(cfg.architecture, cfg.hf)
        self.model = model_class(cfg.architecture)(cfg.hf, MoEContext(LocalDispatcher(E)), cfg.dtype).eval()
        load_weights(self.model, path, cfg.dtype, show_progress=False)
        g = torch.Generator().manual_seed(0)
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.bind([torch.zeros(s, dtype=cfg.dtype) for s in m.cache_shape(blocks, BLOCK)])
            elif isinstance(m, StateCache):  # garbage: a fresh sequence must not read its slot
                m.bind([torch.randn(s, generator=g).to(d) for s, d in m.cache_shapes(slots)])
        self.free_blocks = list(range(blocks))

    def step(self, work: list[tuple[Seq, list[int]]]) -> list[torch.Tensor]:
        """Each (sequence, new tokens) of one step; the logits of every new token, per sequence."""
        q_lens, seq_lens, ids, positions = [], [], [], []
        for seq, new in work:
            start = len(seq.tokens)
            seq.tokens += new
            while len(seq.blocks) * BLOCK < len(seq.tokens):
                seq.blocks.append(self.free_blocks.pop(0))
            q_lens.append(len(new))
            seq_lens.append(len(seq.tokens))
            ids += new
            positions += range(start, len(seq.tokens))
        meta = AttentionMetadata.build(q_lens, seq_lens, [s.blocks for s, _ in work], BLOCK)
        meta.state_slots = torch.tensor([s.slot for s, _ in work], dtype=torch.int64)
        with torch.no_grad():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions), meta)).float()
        return list(logits.split(q_lens))

    def state_caches(self) -> list[StateCache]:
        return [m for m in self.model.modules() if isinstance(m, StateCache)]


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def refs():
    return {}


def ref_model(extra_checkpoints, refs, arch):
    if arch not in refs:
        refs[arch] = reference(extra_checkpoints[arch])
    return refs[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(extra_checkpoints, refs, arch):
    check_greedy_parity(extra_checkpoints[arch], ref_model(extra_checkpoints, refs, arch), 400 + ARCHS.index(arch))


def test_decode_forward_has_no_host_sync(extra_checkpoints, monkeypatch):
    from tests.unit import test_decode_capturable

    test_decode_capturable.test_decode_forward_has_no_host_sync(extra_checkpoints, "qwen3_next", monkeypatch)


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_prompt_and_two_chunks(extra_checkpoints, refs, arch):
    """A 37-token prompt in one step, and again in chunks of 14 and 23 tokens (the second starting
    mid-block, from the first's conv and recurrent states), give transformers' logits."""
    path = extra_checkpoints[arch]
    ids = prompt(1, 37)
    expected = hf_logits(ref_model(extra_checkpoints, refs, arch), ids)
    ours = Stepper(path)
    (whole,) = ours.step([(Seq(5), ids)])
    torch.testing.assert_close(whole, expected, atol=ATOL, rtol=0)
    seq = Seq(2)
    (first,) = ours.step([(seq, ids[:14])])
    (second,) = ours.step([(seq, ids[14:])])
    torch.testing.assert_close(torch.cat([first, second]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_then_decode(extra_checkpoints, refs, arch):
    """A prompt, then one token per step: greedy tokens equal transformers' generate, and each
    step's logits its forward over the whole sequence."""
    path = extra_checkpoints[arch]
    model = ref_model(extra_checkpoints, refs, arch)
    ids, n = prompt(2, 19), 10
    expected_tokens = hf_greedy(model, ids, n)
    ours, seq = Stepper(path), Seq(6)
    (logits,) = ours.step([(seq, ids)])
    rows = [logits[-1]]
    for _ in range(n - 1):
        (logits,) = ours.step([(seq, [int(rows[-1].argmax())])])
        rows.append(logits[-1])
    tokens = [int(r.argmax()) for r in rows]
    assert tokens == expected_tokens
    expected = hf_logits(model, ids + tokens)[len(ids) - 1:]
    torch.testing.assert_close(torch.stack(rows), expected[:n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_mixed_steps_of_several_sequences(extra_checkpoints, refs, arch):
    """Steps as the scheduler packs them: decodes first (two, then three of them), then prefill
    chunks, some sequences fresh and some continuing, each at its own state slot (slots start as
    garbage); every sequence's logits equal transformers' over its own tokens."""
    path = extra_checkpoints[arch]
    model = ref_model(extra_checkpoints, refs, arch)
    ours = Stepper(path)
    a, b, c, d = Seq(7), Seq(0), Seq(3), Seq(4)
    pa, pb, pc, pd = prompt(10, 9), prompt(11, 22), prompt(12, 1), prompt(13, 6)
    got = {s: [] for s in (a, b, c, d)}

    def run(work):
        for (s, _), logits in zip(work, ours.step(work)):
            got[s].append(logits)

    run([(a, pa), (b, pb[:10])])
    run([(a, [pb[0]]), (c, pc), (b, pb[10:]), (d, pd[:4])])  # c: a one-token prompt, fresh, among decodes
    run([(a, [pb[1]]), (c, [pb[2]]), (b, [pb[3]]), (d, pd[4:])])
    run([(d, [pa[0]]), (a, [pa[1]]), (c, [pa[2]]), (b, [pa[3]])])
    for s in (a, b, c, d):
        torch.testing.assert_close(torch.cat(got[s]), hf_logits(model, s.tokens), atol=ATOL, rtol=0)


def test_states_carry_the_history(extra_checkpoints, refs):
    """Both states matter: zeroing a sequence's conv or recurrent state between two chunks moves
    the next chunk's logits well beyond rounding (the decays keep a long history)."""
    path = extra_checkpoints["qwen3_next"]
    ids = prompt(3, 40)
    expected = hf_logits(ref_model(extra_checkpoints, refs, "qwen3_next"), ids)[20:]
    for entry in (0, 1):  # conv state, recurrent state
        ours, seq = Stepper(path), Seq(1)
        ours.step([(seq, ids[:20])])
        for cache in ours.state_caches():
            cache.caches[entry][seq.slot].zero_()
        (after,) = ours.step([(seq, ids[20:])])
        assert (after - expected)[-1].abs().max() > 0.5, entry


def test_bfloat16_close_to_float32(extra_checkpoints, refs):
    """In bfloat16 our logits stay as close to transformers' float32 ones as transformers' own
    bfloat16 forward does."""
    from transformers import AutoModelForCausalLM

    path = extra_checkpoints["qwen3_next"]
    ids = prompt(4, 30)
    ref = torch.log_softmax(hf_logits(ref_model(extra_checkpoints, refs, "qwen3_next"), ids).double(), -1)
    hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    theirs = torch.log_softmax(hf_logits(hf16, ids).double(), -1)
    seq, ours = Seq(0), Stepper(path, torch.bfloat16)
    (first,) = ours.step([(seq, ids[:12])])
    (second,) = ours.step([(seq, ids[12:])])
    ours_lp = torch.log_softmax(torch.cat([first, second]).double(), -1)
    our_err, hf_err = (ours_lp - ref).abs().max().item(), (theirs - ref).abs().max().item()
    assert our_err <= max(0.15, 1.5 * hf_err + 0.05), (our_err, hf_err)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_layer_kinds_follow_transformers(extra_checkpoints, refs, arch):
    """Linear or full attention per layer (Qwen3-Next's from full_attention_interval, as the Hub's
    config.json has it), MoE or dense MLP per layer, shared experts in every MoE layer."""
    ours = Stepper(extra_checkpoints[arch], slots=1, blocks=1).model
    theirs = ref_model(extra_checkpoints, refs, arch)
    kinds = [(layer.layer_type, isinstance(layer.mlp, MoE)) for layer in ours.model.layers]
    assert kinds == [(t, hasattr(layer.mlp, "experts")) for t, layer in zip(theirs.config.layer_types,
                                                                           theirs.model.layers)]
    assert [t for t, _ in kinds] == ["linear_attention"] * 3 + ["full_attention"]
    assert all(layer.mlp.shared_experts is not None for layer in ours.model.layers if isinstance(layer.mlp, MoE))
    assert ours.model.layers[0].linear_attn.num_v_heads == 2 * ours.model.layers[0].linear_attn.num_k_heads


def test_image_text_checkpoint_config_is_its_text_config(extra_checkpoints):
    from moe_serve.models.registry import supported_architectures

    cfg = ModelConfig.from_path(extra_checkpoints["qwen3_5_moe_vl"], "float32")
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert cfg.hf["model_type"] == "qwen3_5_moe_text" and "vision_config" not in cfg.hf
    assert {"Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"} <= \
        set(supported_architectures())


@pytest.mark.parametrize("arch, fields, match", [
    ("qwen3_next", {"hidden_act": "gelu"}, r"Qwen3NextForCausalLM with hidden_act='gelu' is not supported"),
    ("qwen3_next", {"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]},
     r"layer_types=.*need 4 of 'linear_attention' / 'full_attention'"),
    ("qwen3_next", {"linear_num_value_heads": 3},
     r"linear_num_value_heads=3 is not a multiple of linear_num_key_heads=2"),
    ("qwen3_5_moe", {"mlp_only_layers": [1]}, r"Qwen3_5MoeForCausalLM with mlp_only_layers=\[1\] is not supported"),
    ("qwen3_5_moe", {"norm_topk_prob": False}, r"Qwen3_5MoeForCausalLM with norm_topk_prob=False is not supported"),
])
def test_other_variants_refused(extra_checkpoints, tmp_path, arch, fields, match):
    path = _copy_with_config(extra_checkpoints[arch], tmp_path / "variant", **fields)
    cfg = ModelConfig.from_path(path, "float32")
    with pytest.raises(ValueError, match=match):
        model_class(cfg.architecture)(cfg.hf, MoEContext(LocalDispatcher(6)), torch.float32)


@pytest.mark.parametrize("seed", range(4))
def test_random_schedules_give_the_same_tokens(extra_checkpoints, refs, seed):
    """Property over schedules for a hybrid model: block size, token budget (so prefill chunks end at
    every offset, and at the snapshot boundary), cache size (preemption by recompute) and prefix
    caching are drawn at random; requests sharing prefixes arrive in two waves so the second hits
    the first's blocks and restores its state snapshots. Every schedule gives transformers' greedy
    tokens, and every block and state slot is returned."""
    check_random_schedule(extra_checkpoints["qwen3_next"], ref_model(extra_checkpoints, refs, "qwen3_next"), seed)


def check_random_schedule(path: str, model, seed: int) -> None:
    """One random schedule (block size, token budget, cache size, prefix caching) of prompts sharing
    prefixes, in two waves: transformers' greedy tokens, and every block and state slot returned."""
    import random

    from moe_serve import LLM, SamplingParams
    from tests.models.test_hf_parity import assert_same_greedy, make_prompts

    rng = random.Random(seed)
    prompts = make_prompts(300 + seed)
    rng.shuffle(prompts)
    prompts += prompts[:3]  # repeated in the second wave: hits on their own blocks / snapshots when still cached
    expected = [hf_greedy(model, p, 6) for p in prompts]
    bs = rng.choice([2, 4, 8])
    llm = LLM(path, dtype="float32", block_size=bs,
              num_kv_blocks=rng.randint(60 // bs + 2, 400 // bs), max_num_batched_tokens=rng.randint(5, 40),
              max_num_seqs=rng.randint(2, 8), enable_prefix_caching=rng.random() < 0.75, show_progress=False)
    params = SamplingParams(temperature=0, max_tokens=6)
    half = (len(prompts) - 3) // 2
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:half]], params)
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[half:]], params)
    for p, o, e in zip(prompts, outs, expected):
        assert_same_greedy(model, p, o.outputs[0].token_ids, e)
    kv = llm.engine.scheduler.kv
    assert kv.in_use == 0
    kv.check_invariants()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_overlap_gives_identical_tokens(extra_checkpoints, arch):
    """Two overlapped micro-batches give the plain path's tokens: a sequence cut across them
    continues in the second from the conv and recurrent states the first left in its slot."""
    from tests.unit import test_overlap

    test_overlap.test_overlap_gives_identical_tokens(extra_checkpoints, arch)
