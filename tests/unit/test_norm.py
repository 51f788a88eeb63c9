"""RMSNorm against a float64 reference of the reference models' formula, fused path and half."""
import pytest
import torch

from moe_serve.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=str)
def test_rmsnorm_matches_float64(dtype, tol):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-5, dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    x = (3 * torch.randn(5, 2, 96, generator=g)).to(dtype)
    xd = x.double()
    want = norm.weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = norm(x)
    assert got.dtype == dtype
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < tol
