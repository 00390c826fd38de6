import math

import pytest
import torch

from deepinfer_vllm.ops.norm import rms_norm


def _naive(x, w, eps):
    rows = []
    for row in x.double().tolist():
        r = 1.0 / math.sqrt(sum(v * v for v in row) / len(row) + eps)
        rows.append([v * r * (1.0 if w is None else float(w[i])) for i, v in enumerate(row)])
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_naive(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 48, generator=g) * 3).to(dtype)
    w = (torch.rand(48, generator=g) + 0.5).to(torch.bfloat16)
    y = rms_norm(x, w, 1e-20)
    assert y.dtype == dtype and y.shape == x.shape
    ref = _naive(x, w.float(), 1e-20)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    else:
        # single rounding of an (almost) exact value: at most one bf16 ulp away, mostly equal
        assert ((y.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-30).all()
        assert (y == ref.to(dtype)).float().mean() > 0.95


def test_rms_norm_no_weight_and_eps():
    x = torch.zeros(2, 8)
    y = rms_norm(x, None, 1e-6)
    assert torch.equal(y, torch.zeros(2, 8))  # eps keeps the zero row finite
    x = torch.tensor([[3.0, 4.0]])
    torch.testing.assert_close(rms_norm(x, None, 0.0), torch.tensor([[3.0, 4.0]]) / math.sqrt(12.5))
