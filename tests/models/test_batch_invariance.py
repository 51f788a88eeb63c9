"""--batch-invariant: a request's token ids and logprobs are bitwise the same alone and in company.

Over random batch mixes (how many other requests, their prompt and output lengths, where the target
sits), token budgets (prefill chunk boundaries) and a KV pool small enough to preempt requests (a
token then recomputed inside a prefill rather than decoded), on our C kernels and on the torch
backends, float32 and bfloat16. Hypothesis runs derandomized with a bounded number of examples.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_serve import LLM, SamplingParams

TARGET = [random.Random(7).randrange(10, 400) for _ in range(29)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# (arch, backend, dtype): our C kernels run a bf16 model in float32 activations, torch in bf16
CASES = [("qwen3_moe", "cpu_c", "float32"), ("deepseek_v3", "cpu_c", "float32"),
         ("qwen3_moe", "torch", "bfloat16"), ("deepseek_v3", "torch", "bfloat16"),
         # Gated DeltaNet (linear attention) beside gated full attention and a shared expert
         ("qwen3_next", "cpu_c", "float32"),
         # DeepSeek Sparse Attention: the indexer's top-k and MLA over the selected tokens
         ("deepseek_v32", "cpu_c", "float32"),
         # DeepSeek-V4: compressed / sparse attention over a window and pooled entries, mHC, hash and
         # sqrt-softplus routers, limited-SwiGLU experts, the grouped output projection
         ("deepseek_v4", "cpu_c", "float32")]


def _engine(path: str, backend: str, dtype: str, **kw) -> LLM:
    return LLM(path, dtype=dtype, batch_invariant=True, moe_backend=backend, attention_backend=backend,
               linear_backend=backend, norm_backend=backend, show_progress=False, max_num_seqs=16, **kw)


def _result(out) -> tuple[list[int], list]:
    o = out.outputs[0]
    return list(o.token_ids), [sorted((t, lp.logprob if hasattr(lp, "logprob") else lp) for t, lp in d.items())
                               if isinstance(d, dict) else d for d in o.logprobs]


def _count_preemptions(llm: LLM) -> list[int]:
    """A counter of the scheduler's preemptions, kept as the engine steps."""
    count = [0]
    sched = llm.engine.scheduler
    inner = sched.schedule

    def schedule():
        out = inner()
        count[0] += out.num_preempted
        return out

    sched.schedule = schedule
    return count


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def engines(request, checkpoints, extra_checkpoints):
    """A roomy engine and one with a 16-token budget and a small KV pool (chunks and preemption),
    and the target's result alone on the roomy one."""
    arch, backend, dtype = request.param
    path = checkpoints[arch] if arch in checkpoints else extra_checkpoints[arch]
    roomy = _engine(path, backend, dtype, kv_cache_memory=16 << 20)
    tight = _engine(path, backend, dtype, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16,
                    enable_prefix_caching=False)
    alone = _result(roomy.generate({"prompt_token_ids": TARGET}, PARAMS)[0])
    return roomy, tight, alone, _count_preemptions(tight)


# Hypothesis examples per architecture (default 3): fewer where every token runs one at a time in Python
EXAMPLES = {"qwen3_next": 2, "deepseek_v32": 2, "deepseek_v4": 2}


def _checker(examples: int):
    return settings(max_examples=examples, derandomize=True, deadline=None,
                    suppress_health_check=list(HealthCheck))(given(data=st.data())(_check_mixes))


def _check_mixes(engines, data):
    roomy, tight, alone, _ = engines
    n = data.draw(st.integers(0, 6), label="others")
    lens = data.draw(st.lists(st.integers(1, 60), min_size=n, max_size=n), label="prompt lengths")
    outs = data.draw(st.lists(st.integers(1, 16), min_size=n, max_size=n), label="output lengths")
    at = data.draw(st.integers(0, n), label="target position")
    llm = data.draw(st.sampled_from([roomy, tight]), label="engine")
    rng = random.Random(sum(lens) + 31 * n)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(k)]} for k in lens]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in outs]
    prompts.insert(at, {"prompt_token_ids": TARGET})
    params.insert(at, PARAMS)
    got = _result(llm.generate(prompts, params)[at])
    assert got == alone


def test_bitwise_equal_alone_and_in_company(engines, request):
    _checker(EXAMPLES.get(request.node.callspec.params["engines"][0], 3))(engines)


def test_chunks_and_preemption_match_alone(engines):
    """The 16-token budget cuts the target's prompt in two chunks; six long companions in a 96-slot
    pool preempt requests (the count proves it) and the target still matches itself alone."""
    roomy, tight, alone, preempted = engines
    assert _result(tight.generate({"prompt_token_ids": TARGET}, PARAMS)[0]) == alone
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 400) for _ in range(40)]} for _ in range(6)]
    prompts.insert(2, {"prompt_token_ids": TARGET})
    before = preempted[0]
    got = tight.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2))
    assert preempted[0] > before
    assert _result(got[2]) == alone


def test_refused_where_no_invariant_form(monkeypatch):
    """Every backend name and layer kind has an invariant form (the Triton ones:
    tests/kernels/test_batch_invariant_triton.py; DeepSeek-V4's compressed attention its torch form
    under every attention name); one taken out of the table is refused naming the flag: a backend
    name by `choose`, a layer kind at bind."""
    from torch import nn

    from moe_serve import platform

    choice = platform.choose("cpu", moe_backend="triton", attention_backend="triton", linear_backend="triton",
                             norm_backend="torch", batch_invariant=True)
    ops = platform.resolve_ops(choice.device, "triton", "triton", "triton", "torch", "torch", batch_invariant=True)
    assert {ops.experts.name, ops.attention.name, ops.linear.name} == {"triton+bi"}
    # linear attention's "triton" (what "auto" picks on a GPU) runs the invariant torch form there
    choice = platform.choose("cpu", moe_backend="triton", attention_backend="triton", linear_backend="triton",
                             norm_backend="torch", linear_attention_backend="triton", batch_invariant=True)
    assert platform.resolve_ops(choice.device, "triton", "triton", "triton", "torch", "triton",
                                batch_invariant=True).linear_attention.name == "torch+bi"

    assert ops.compressed_attention.name == "torch+bi"
    monkeypatch.delitem(platform.INVARIANT["norm"], "cpu_c")
    with pytest.raises(ValueError, match=r"--batch-invariant with norm_backend='cpu_c': that backend has no"):
        platform.choose("cpu", moe_backend="torch", attention_backend="torch", linear_backend="torch",
                        norm_backend="cpu_c", batch_invariant=True)
    monkeypatch.delitem(platform.INVARIANT, "compressed_attention")

    class CompressedStandIn(nn.Module):  # a layer kind with no invariant form
        op_kind = "compressed_attention"

    with pytest.raises(ValueError, match=r"--batch-invariant: CompressedStandIn runs compressed attention"):
        platform.bind_ops(CompressedStandIn(), ops)


def test_dsa_forms_per_query_token():
    """The invariant DSA ops (attention/backends/invariant.py): a token's selection and output
    bitwise the same in a prefill chunk alone, as a decode among decodes, in a chunk beside decodes
    and other chunks, and cut into another chunk; and close to the default forms (same selection)."""
    import torch

    from attention.backends import TorchAttention
    from attention.backends.invariant import InvariantTorchAttention
    from attention.metadata import AttentionMetadata

    N, I, NI, L, R, BS, TOPK = 4, 16, 6, 32, 8, 4, 8
    g = torch.Generator().manual_seed(0)
    index_cache, latent = torch.randn(40, BS, I, generator=g), torch.randn(40, BS, L + R, generator=g)

    def rows(n):
        return [torch.randn(n, NI, I, generator=g), torch.randn(n, NI, generator=g), torch.randn(n, N, L, generator=g),
                torch.randn(n, N, R, generator=g)]

    target, tables = rows(48), [list(range(12 + 7 * j, 19 + 7 * j)) for j in range(4)]

    def run(ops, seqs):
        """seqs: (table index or None for the target, query len, seq len); the target's rows by position."""
        meta = AttentionMetadata.build([q for _, q, _ in seqs], [s for _, _, s in seqs],
                                       [list(range(12)) if t is None else tables[t] for t, _, _ in seqs], BS)
        parts = [rows(q) if t is not None else [x[s - q:s] for x in target] for t, q, s in seqs]
        x = [torch.cat(c) for c in zip(*parts)]
        top = ops.dsa_topk(x[0], x[1], index_cache, meta, TOPK, I ** -0.5)
        out = ops.sparse_mla_attention(x[2], x[3], latent, meta, top, 0.1)
        at = sum(q for t, q, _ in seqs[:[t for t, _, _ in seqs].index(None)])
        q, s = next((q, s) for t, q, s in seqs if t is None)
        return {s - q + i: (set(top[at + i].tolist()) - {-1}, out[at + i]) for i in range(q)}

    steps = [[(None, 9, 40)], [(0, 1, 12), (None, 1, 40), (1, 1, 25)],
             [(0, 1, 27), (1, 1, 6), (None, 9, 40), (2, 5, 23)], [(0, 3, 28), (None, 3, 40)]]
    seen = {}
    for seqs in steps:
        default = run(TorchAttention(), seqs)
        for pos, (sel, out) in run(InvariantTorchAttention(), seqs).items():
            assert sel == default[pos][0] and torch.allclose(out, default[pos][1], atol=1e-5)
            first = seen.setdefault(pos, (sel, out))
            assert sel == first[0] and torch.equal(out, first[1]), pos
    assert len(seen) == 9
