"""The torch reference's batched decode path equals running each sequence on its own."""
import torch

from attention.backends import reference as ref
from attention.metadata import AttentionMetadata


def test_batched_decode_equals_per_sequence():
    g = torch.Generator().manual_seed(0)
    nb, bs, G, N, H, L, R = 12, 4, 2, 6, 8, 16, 4
    k = torch.randn(nb, bs, G, H, generator=g)
    v = torch.randn(nb, bs, G, H, generator=g)
    lat = torch.randn(nb, bs, L + R, generator=g)
    seq_lens = [5, 1, 9, 13]
    tables = [[3, 7], [0], [11, 2, 5], [1, 4, 6, 8]]  # holes and out-of-order blocks
    meta = AttentionMetadata.build([1] * 4, seq_lens, tables, bs)
    q = torch.randn(4, N, H, generator=g)
    ql, qp = torch.randn(4, N, L, generator=g), torch.randn(4, N, R, generator=g)
    out = ref.paged_attention(q, k, v, meta, 0.3)
    mla = ref.mla_paged_attention(ql, qp, lat, meta, 0.3)
    for b in range(4):
        one = AttentionMetadata.build([1], [seq_lens[b]], [tables[b]], bs)
        torch.testing.assert_close(out[b:b + 1], ref.paged_attention(q[b:b + 1], k, v, one, 0.3))
        torch.testing.assert_close(mla[b:b + 1], ref.mla_paged_attention(ql[b:b + 1], qp[b:b + 1], lat, one, 0.3))


def test_mixed_step_decodes_batched_then_prefill_chunks():
    """Decodes first, then a prefill chunk and a whole prompt (the scheduler's order): equal to
    running each sequence on its own."""
    g = torch.Generator().manual_seed(1)
    nb, bs, G, N, H, L, R = 16, 4, 2, 4, 8, 16, 4
    k = torch.randn(nb, bs, G, H, generator=g)
    v = torch.randn(nb, bs, G, H, generator=g)
    lat = torch.randn(nb, bs, L + R, generator=g)
    q_lens, seq_lens = [1, 1, 1, 3, 6], [6, 2, 10, 7, 6]
    tables = [[3, 7], [0], [11, 2, 5], [1, 4], [9, 12]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs)
    T = sum(q_lens)
    q = torch.randn(T, N, H, generator=g)
    ql, qp = torch.randn(T, N, L, generator=g), torch.randn(T, N, R, generator=g)
    out = ref.paged_attention(q, k, v, meta, 0.3)
    mla = ref.mla_paged_attention(ql, qp, lat, meta, 0.3)
    s = 0
    for b, n in enumerate(q_lens):
        one = AttentionMetadata.build([n], [seq_lens[b]], [tables[b]], bs)
        torch.testing.assert_close(out[s:s + n], ref.paged_attention(q[s:s + n], k, v, one, 0.3))
        torch.testing.assert_close(mla[s:s + n], ref.mla_paged_attention(ql[s:s + n], qp[s:s + n], lat, one, 0.3))
        s += n
