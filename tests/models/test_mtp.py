"""Speculative decoding with the checkpoint's own multi-token-prediction (MTP) layer
(moe_serve/spec_decode/mtp.py) on tiny DeepSeek-V3 checkpoints whose MTP layer is written as the
Hub lays it out (`model.layers.{num_hidden_layers}.`: enorm, hnorm, eh_proj, a decoder layer,
shared_head, a copy of the embedding).

The drafts themselves are checked against a float64 reference built from transformers' own
modules (the target's final hidden states from its forward, the MTP decoder layer run as a
transformers DeepSeek-V3 layer), at every step of a generation whose drafts are mostly rejected:
so the MTP layer's cache after rollbacks equals one computed afresh. The output stays the plain
engine's (and transformers') under greedy decoding and seeded sampling, with random MTP weights
and with an MTP layer that drafts well.
"""
from __future__ import annotations

import random
import tempfile

import pytest
import torch

from moe_serve import LLM, SamplingParams
from moe_serve.protocol import NewRequest
from moe_serve.spec_decode import SpeculativeConfig
from tests.checkpoints import VOCAB
from tests.models.test_hf_parity import assert_same_greedy, hf_greedy, hf_model


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def engines(path: str, k: int, **kw):
    common = dict(dtype="float32", num_kv_blocks=kw.pop("num_kv_blocks", 96), show_progress=False, **kw)
    return LLM(path, **common), LLM(path, speculative_config=mtp(k), **common)


class MtpReference:
    """The MTP layer in float64 from transformers' modules: the target's final (normed) hidden
    states come from transformers' forward; the MTP decoder layer runs as layer 0 of a one-layer
    transformers DeepSeek-V3 whose final norm and LM head are shared_head's, fed the eh_proj
    inputs as embeddings."""

    def __init__(self, path: str):
        from safetensors.torch import load_file, save_file
        from transformers import AutoConfig, DeepseekV3ForCausalLM

        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                           experts_implementation="eager").eval()
        cfg = AutoConfig.from_pretrained(path)
        L = cfg.num_hidden_layers
        sd = load_file(f"{path}/model.safetensors")
        pre = f"model.layers.{L}."
        mtp = {k[len(pre):]: v.to(torch.float64) for k, v in sd.items() if k.startswith(pre)}
        block_sd = {f"model.layers.0.{k}": v for k, v in mtp.items()
                    if k.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")}
        block_sd["model.norm.weight"] = mtp["shared_head.norm.weight"]
        block_sd["lm_head.weight"] = mtp["shared_head.head.weight"]
        block_sd["model.embed_tokens.weight"] = mtp["embed_tokens.weight"]
        with tempfile.TemporaryDirectory() as d:  # transformers reads the Hub layout (per-expert tensors) itself
            AutoConfig.from_pretrained(path, num_hidden_layers=1, first_k_dense_replace=0).save_pretrained(d)
            save_file({k: v.contiguous() for k, v in block_sd.items()}, f"{d}/model.safetensors",
                      metadata={"format": "pt"})
            self.block = DeepseekV3ForCausalLM.from_pretrained(d, dtype=torch.float64,
                                                               experts_implementation="eager").eval()
        self.mtp, self.eps = mtp, cfg.rms_norm_eps
        self.emb = sd["model.embed_tokens.weight"].to(torch.float64)

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def _x(self, token: int, pos: int, prev_h: torch.Tensor) -> torch.Tensor:
        e = self.emb[token] if pos > 0 else torch.zeros_like(self.emb[token])
        cat = torch.cat([self._norm(e, self.mtp["enorm.weight"]), self._norm(prev_h, self.mtp["hnorm.weight"])])
        return self.mtp["eh_proj.weight"] @ cat

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """The k greedy drafts after `tokens` (the last one not yet computed by the target), and
        each one's top-2 logit margin."""
        h = self.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        xs = [self._x(tokens[p + 1], p, h[p]) for p in range(len(tokens) - 1)]
        out, margins = [], []
        captured = {}
        hook = self.block.model.layers[0].register_forward_hook(
            lambda m, i, o: captured.__setitem__("g", o[0] if isinstance(o, tuple) else o))
        try:
            for j in range(k):
                n = len(xs)
                logits = self.block(inputs_embeds=torch.stack(xs)[None],
                                    position_ids=torch.arange(n)[None]).logits[0, -1]
                top = torch.topk(logits, 2).values
                margins.append(float(top[0] - top[1]))
                d = int(logits.argmax())
                out.append(d)
                g = captured["g"].reshape(n, -1)[-1]
                xs.append(self._x(d, n, g))
        finally:
            hook.remove()
        return out, margins


@pytest.mark.parametrize("k", [3])
def test_drafts_equal_a_float64_reference_at_every_step(checkpoints, k):
    """Random MTP weights: nearly every draft is rejected, and the chained passes write past the
    accepted tokens and across 4-token block boundaries; the drafts of every step still equal a
    fresh computation over the tokens so far."""
    path = checkpoints["deepseek_v3"]
    ref = MtpReference(path)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=4, show_progress=False,
              speculative_config=mtp(k), enable_prefix_caching=False)
    core = llm.engine
    prompt = prompts(1, seed=5)[0] + [11, 12, 13, 14, 15, 16, 17]
    core.add_request(NewRequest("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    checked = 0
    while core.has_unfinished():
        core.step()
        req = core.scheduler.requests.get("r")
        if req is None or not req.spec_token_ids:
            continue
        want, margins = ref.drafts(req.all_token_ids, len(req.spec_token_ids))
        for got, w, m in zip(req.spec_token_ids, want, margins):
            if m < 1e-3:
                break  # a genuine near-tie: the chain may legitimately go either way from here
            assert got == w, (req.all_token_ids, req.spec_token_ids, want, margins)
            checked += 1
    assert checked >= 10 * k


@pytest.mark.parametrize("arch,k", [("deepseek_v3", 2), ("deepseek_v3_mtp_copy", 3)])
def test_greedy_output_is_the_plain_engines_and_transformers(arch, k, checkpoints, extra_checkpoints):
    """With a token budget that chunks prompts and mixes prefill chunks with verify steps."""
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    plain, spec = engines(path, k, max_num_batched_tokens=24)
    ps = prompts(8, seed=1)
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    assert got == want
    model = hf_model(path)
    for p, ours in list(zip(ps, got))[:3]:
        assert_same_greedy(model, p, ours, hf_greedy(model, p, len(ours)))
    s = spec.engine.spec
    assert s.num_drafts > 0 and sum(s.accepted_per_pos) == s.num_accepted_tokens
    if arch == "deepseek_v3_mtp_copy":
        # The layer drafts well: most drafts are accepted, and far fewer steps run than tokens.
        assert s.num_accepted_tokens > 0.4 * s.num_draft_tokens, (s.num_accepted_tokens, s.num_draft_tokens)
        assert spec.engine.num_steps < plain.engine.num_steps


def test_seeded_sampling_stops_and_preemption_reproduce(extra_checkpoints):
    """Seeded sampling, stop tokens inside an accepted run, and a cache small enough that requests
    are preempted and recomputed: each request's tokens are the plain engine's."""
    path = extra_checkpoints["deepseek_v3_mtp_copy"]
    plain, spec = engines(path, 3, block_size=4, num_kv_blocks=40, max_num_seqs=8)
    ps = prompts(10, seed=2)
    sps = [SamplingParams(max_tokens=30, temperature=0.8 if i % 2 else 0, seed=7 + i, logprobs=1,
                          stop_token_ids=[int(ps[i][-1])] if i % 3 == 0 else None) for i in range(10)]
    a = plain.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
    b = spec.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
        lx = [next(iter(d.values())).logprob for d in x.outputs[0].logprobs]
        ly = [next(iter(d.values())).logprob for d in y.outputs[0].logprobs]
        assert ly == pytest.approx(lx, abs=1e-4)
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec.num_accepted_tokens > 0
    assert spec.engine.allocator.usage == 0  # every block back, lookahead slots included


def test_models_without_mtp_layers_are_refused_naming_the_field(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.method='mtp'.*Qwen3MoeForCausalLM"):
        LLM(checkpoints["qwen3_moe"], dtype="float32", num_kv_blocks=16, show_progress=False,
            speculative_config=mtp(1))
    import json
    import shutil

    path = tmp_path / "no_mtp"
    shutil.copytree(checkpoints["deepseek_v3"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        LLM(str(path), dtype="float32", num_kv_blocks=16, show_progress=False, speculative_config=mtp(1))
    with pytest.raises(ValueError, match="prompt_lookup_min applies to method 'ngram'"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}').num_speculative_tokens == 2


def test_structured_outputs_keep_their_grammar_and_the_plain_output(extra_checkpoints):
    """MTP drafts are cut to what the grammar allows before they are verified: seeded JSON output
    (whose drafts, the unconstrained argmax, rarely fit) and a regex that forbids one letter
    (whose drafts mostly fit) equal the plain engine's and match."""
    import json
    import re

    import jsonschema

    from moe_serve.structured_output import StructuredOutputsParams as SO

    schema = {"type": "array", "minItems": 2, "maxItems": 3,
              "items": {"type": "object", "properties": {"name": {"enum": ["ab", "cd", "efg"]},
                                                         "id": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["name", "id"], "additionalProperties": False}}
    plain, spec = engines(extra_checkpoints["deepseek_v3_mtp_copy"], 3, num_kv_blocks=200)
    params = [SamplingParams(temperature=0.8 * (s % 2), seed=s, max_tokens=150, structured_outputs=SO(json=schema))
              for s in range(2)]
    params += [SamplingParams(temperature=0, max_tokens=40, structured_outputs=SO(regex=r"[^e]*"))]
    prompts = ["JSON please"] * 2 + ["The quick brown fox jumps over"]
    a = plain.generate(prompts, params, use_tqdm=False)
    b = spec.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
    for y in b[:2]:
        assert y.outputs[0].finish_reason == "stop", y.outputs[0].text
        jsonschema.validate(json.loads(y.outputs[0].text), schema)
    assert re.fullmatch(r"[^e]*", b[2].outputs[0].text) and len(b[2].outputs[0].token_ids) == 40
    s = spec.engine.spec
    assert s.num_draft_tokens >= s.num_accepted_tokens > 0


def _verify_run(path: str, pad: bool, static_buffers: bool = False, **kw):
    """Greedy tokens of MTP (K = 2) runs where verify steps pad to their ladder (pad_decode: the
    CUDA path's padding, eager here), and the (sequences, tokens each) of every uniform verify
    forward. static_buffers: padded verify steps go through uncaptured verify graphs (the model
    runs on the static buffers and metadata a captured graph reads)."""
    from moe_serve.cuda_graph import DecodeGraphs

    llm = LLM(path, dtype="float32", num_kv_blocks=96, max_num_seqs=16, show_progress=False, pad_decode=pad,
              speculative_config=mtp(2), **kw)
    runner = llm.engine.runner
    if static_buffers:
        runner.verify_graphs = DecodeGraphs(runner.model, runner.verify_pad_sizes, runner.batch.max_blocks,
                                            runner.batch.block_size, runner.batch.max_model_len, runner.scratch_block,
                                            runner.device, query_len=3)
    model, plain, seen = runner.model, runner.model.forward, []

    def forward(ids_T, positions_T, meta, step):
        if set(meta.query_lens_cpu) == {3}:
            seen.append((meta.num_seqs, step.static_rows))
        return plain(ids_T, positions_T, meta, step)

    model.forward = forward
    ps = prompts(5, seed=4)
    sps = [SamplingParams(max_tokens=10 + 3 * i, temperature=0, ignore_eos=True) for i in range(5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sps, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seen, runner


def test_verify_steps_pad_to_their_ladder_with_the_same_tokens(extra_checkpoints):
    """Where graphs are captured, verify steps (each sequence its last token and K drafts) pad to a
    ladder of their own, dummy sequences of 1 + K tokens in the scratch block, every MoE layer
    told the fixed row count; on the CPU the padding is forced and runs eagerly. Tokens equal the
    unpadded run's. (The verify graphs' static buffers run through the Triton backends, which is
    what they hold: tests/kernels/test_engine_triton.py.)"""
    path = extra_checkpoints["deepseek_v3_mtp_copy"]
    want, seen_plain, _ = _verify_run(path, pad=False)
    assert all(rows is None for _, rows in seen_plain)
    got, seen, runner = _verify_run(path, pad=True)
    assert got == want
    assert runner.verify_q == 3 and runner.verify_pad_sizes == [1, 2, 4, 8, 16]
    assert seen and all(B in runner.verify_pad_sizes and rows == 3 * B for B, rows in seen)
    assert any(B == 8 for B, _ in seen)  # 5 sequences padded to 8
