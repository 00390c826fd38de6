import math

import pytest
import torch

from deepinfer_vllm.ops.compressor import compressor_latents, compressor_project, pool_ratio2
from deepinfer_vllm.ops.norm import rms_norm


def test_pool_ratio2_against_loop():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(7, 5, generator=g)
    gt = torch.randn(7, 5, generator=g) * 3
    out = pool_ratio2(u, gt)
    assert out.shape == (3, 5) and out.dtype == torch.float32  # trailing odd row ignored
    for j in range(3):
        for d in range(5):
            a, b = gt[2 * j, d].item(), gt[2 * j + 1, d].item()
            m = max(a, b)
            wa, wb = math.exp(a - m), math.exp(b - m)
            want = (wa * u[2 * j, d].item() + wb * u[2 * j + 1, d].item()) / (wa + wb)
            assert math.isclose(out[j, d].item(), want, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("acc", [torch.float32, torch.float64])
def test_pool_ratio2_op_by_op_form(acc):
    """The explicit form the Triton kernel mirrors: close to softmax pooling, one-hot for
    huge gate gaps (no NaN), the plain mean for equal gates."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(8, 6, generator=g)
    gt = torch.randn(8, 6, generator=g) * 3
    gt[0::2, 0] = 1e4  # first row dominates completely
    gt[1::2, 1] = gt[0::2, 1]  # equal gates
    out = pool_ratio2(u, gt, acc)
    assert out.dtype == acc
    pairs_u, pairs_g = u.to(acc).view(4, 2, 6), gt.to(acc).view(4, 2, 6)
    soft = (torch.softmax(pairs_g, dim=1) * pairs_u).sum(dim=1)
    tol = 1e-6 if acc == torch.float32 else 1e-14
    torch.testing.assert_close(out, soft, rtol=tol, atol=tol)
    assert torch.equal(out[:, 0], pairs_u[:, 0, 0])
    assert torch.equal(out[:, 1], (pairs_u[:, 0, 1] + pairs_u[:, 1, 1]) / 2)


def _naive_latents(h, wkv, wgate, nw, eps, ratio, dtype):
    H = h.double()
    rows = []
    for j in range(h.shape[0] // ratio):
        if ratio == 2:
            u = [wkv.double() @ H[2 * j + t] for t in range(2)]
            gg = [wgate.double() @ H[2 * j + t] for t in range(2)]
            e0, e1 = torch.exp(gg[0]), torch.exp(gg[1])
            v = (e0 * u[0] + e1 * u[1]) / (e0 + e1)
        else:
            v = wkv.double() @ H[j]
        v = v.to(dtype).double()  # rounded before the norm
        v = v / torch.sqrt((v * v).mean() + eps) * nw.double()
        rows.append(v)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1, 2])
def test_latents_against_loop(dtype, ratio):
    g = torch.Generator().manual_seed(ratio)
    T, D, L = 9, 32, 24
    h = torch.randn(T, D, generator=g).to(dtype)
    wkv = torch.randn(L, D, generator=g) * 0.2  # fp32 storage, as NeMo keeps it
    wgate = torch.randn(L, D, generator=g) * 0.2 if ratio == 2 else None
    nw = (torch.rand(L, generator=g) + 0.5).to(torch.bfloat16)
    lat = compressor_latents(h, wkv, wgate, nw, 1e-20, ratio, dtype)
    assert lat.dtype == dtype and lat.shape == (T // ratio, L)
    ref = _naive_latents(h, wkv, wgate, nw, 1e-20, ratio, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(lat.double(), ref, rtol=tol, atol=tol)


def test_ratio2_causality_and_split_chunks():
    g = torch.Generator().manual_seed(7)
    T, D, L = 8, 16, 8
    h = torch.randn(T, D, generator=g).to(torch.bfloat16)
    wkv, wgate = torch.randn(L, D, generator=g), torch.randn(L, D, generator=g)
    nw = torch.ones(L)
    full = compressor_latents(h, wkv, wgate, nw, 1e-20, 2)
    # latent j only depends on rows 2j, 2j+1
    h2 = h.clone()
    h2[5] += 1
    moved = compressor_latents(h2, wkv, wgate, nw, 1e-20, 2)
    assert torch.equal(moved[[0, 1, 3]], full[[0, 1, 3]]) and not torch.equal(moved[2], full[2])
    # serving: chunk A = rows 0..4 (row 4 waits in a ring), chunk B = rows 5..7
    ua, ga = compressor_project(h[:5], wkv, wgate)
    ub, gb = compressor_project(h[5:], wkv, wgate)
    pooled_a = pool_ratio2(ua[:4], ga[:4])
    pooled_b = pool_ratio2(torch.cat([ua[4:], ub[:1]]), torch.cat([ga[4:], gb[:1]]))
    lat = rms_norm(torch.cat([pooled_a, pooled_b]).to(h.dtype), nw, 1e-20)
    assert torch.equal(lat, full[:3])
    # a trailing incomplete group yields nothing
    assert compressor_latents(h[:7], wkv, wgate, nw, 1e-20, 2).shape[0] == 3
    assert compressor_latents(h[:1], wkv, wgate, nw, 1e-20, 2).shape[0] == 0
