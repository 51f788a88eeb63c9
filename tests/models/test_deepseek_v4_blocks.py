"""DeepSeek-V4's layers outside attention (moe_serve/models/deepseek_v4_blocks.py) against
transformers' own modules with the same random weights: mHC's mixes and the merged streams,
the hyper head, sqrt-softplus and hash routing, the grouped output projection, the limited SwiGLU."""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as transformers_v4

from moe_serve.models import deepseek_v4_blocks as V4


def config(**kw):
    from transformers import DeepseekV4Config

    base = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, head_dim=16, o_groups=2, o_lora_rank=8,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=3,
                hc_sinkhorn_iters=4, num_hidden_layers=2, routed_scaling_factor=1.5, swiglu_limit=0.7)
    return DeepseekV4Config(**(base | kw))


def randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]:
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.5)


def test_hyper_connection_and_head_match_transformers():
    cfg = config()
    theirs = transformers_v4.DeepseekV4HyperConnection(cfg).float()
    randomize(theirs, 0)
    ours = V4.HyperConnection(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    post, comb, collapsed = theirs(x)
    p2, c2, col2 = ours(x.reshape(10, cfg.hc_mult, cfg.hidden_size))
    torch.testing.assert_close(p2, post.reshape(10, -1))
    torch.testing.assert_close(c2, comb.reshape(10, cfg.hc_mult, cfg.hc_mult))
    torch.testing.assert_close(col2, collapsed.reshape(10, -1))
    # Sinkhorn made comb (nearly) doubly stochastic: its columns sum to 1, its rows close to it.
    torch.testing.assert_close(c2.sum(-2), torch.ones(10, cfg.hc_mult), atol=1e-4, rtol=0)
    assert (c2.sum(-1) - 1).abs().max() < 0.05
    out = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    want = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    got = V4.HyperConnection.merge(x.reshape(10, cfg.hc_mult, -1), out.reshape(10, -1), p2, c2)
    torch.testing.assert_close(got, want.reshape(10, cfg.hc_mult, -1))

    head = transformers_v4.DeepseekV4HyperHead(cfg).float()
    randomize(head, 3)
    ours_head = V4.HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
    ours_head.load_state_dict(head.state_dict())
    torch.testing.assert_close(ours_head(x.reshape(10, cfg.hc_mult, -1)), head(x).reshape(10, -1))


def test_routers_match_transformers():
    cfg = config(scoring_func="sqrtsoftplus")
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    theirs = transformers_v4.DeepseekV4TopKRouter(cfg)
    randomize(theirs, 5)
    ours = V4.SqrtSoftplusRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                                 cfg.routed_scaling_factor)
    ours.load_state_dict(theirs.state_dict())
    _, w, ids = theirs(x)
    w2, ids2 = ours(x)
    order, order2 = ids.sort(-1), ids2.sort(-1)
    assert torch.equal(order.values, order2.values)
    torch.testing.assert_close(w2.gather(1, order2.indices), w.gather(1, order.indices))

    hashed = transformers_v4.DeepseekV4HashRouter(cfg)
    randomize(hashed, 6)
    hashed.tid2eid.copy_(torch.randint(0, cfg.n_routed_experts, hashed.tid2eid.shape,
                                       generator=torch.Generator().manual_seed(7)))
    ours_hash = V4.HashRouter(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size,
                              cfg.routed_scaling_factor)
    ours_hash.load_state_dict(hashed.state_dict())
    tok = torch.randint(0, cfg.vocab_size, (7,), generator=torch.Generator().manual_seed(8))
    _, w, ids = hashed(x, tok)
    w2, ids2 = ours_hash(x, tok)
    assert torch.equal(ids2, ids)
    torch.testing.assert_close(w2, w)
    ours_hash.check()
    ours_hash.tid2eid[tok[0]] = cfg.n_routed_experts
    with pytest.raises(ValueError, match="tid2eid"):
        ours_hash.check()


def test_grouped_output_projection_and_limited_swiglu_match_transformers():
    cfg = config()
    attn = transformers_v4.DeepseekV4Attention(cfg, 0)
    per_group = cfg.num_attention_heads * cfg.head_dim // cfg.o_groups
    a = transformers_v4.DeepseekV4GroupedLinear(per_group, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
    b = torch.nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
    randomize(a, 9)
    randomize(b, 10)
    ours = V4.GroupedOutputProjection(cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank,
                                      cfg.hidden_size, torch.float32)
    ours.o_a_proj.weight.data.copy_(a.weight)
    ours.o_b_proj.weight.data.copy_(b.weight)
    assert {"o_a_proj.weight", "o_b_proj.weight"} <= set(attn.state_dict())  # the Hub's names
    x = torch.randn(6, cfg.num_attention_heads, cfg.head_dim, generator=torch.Generator().manual_seed(11))
    want = b(a(x.reshape(1, 6, cfg.o_groups, per_group)).flatten(2))[0]
    torch.testing.assert_close(ours(x), want)

    mlp = transformers_v4.DeepseekV4MLP(cfg)
    randomize(mlp, 12)
    h = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(13)) * 3
    got = mlp.down_proj(V4.limited_swiglu(mlp.gate_proj(h), mlp.up_proj(h), cfg.swiglu_limit))
    torch.testing.assert_close(got, mlp(h))
