"""ops/triton/mhc.py against the mHC references (``ops.mhc``, ``ops.norm``).

Same inputs, same fp32 arithmetic; the kernels differ only in summation order, FMA
contraction and the last bits of ``exp``, so: ``pre`` / ``post`` within 2e-5 and ``comb``
within 1e-4 of the reference (absolute; the coefficients are O(1)); bf16 outputs within one
bf16 ulp of the reference (two for collapse + norm, which rounds twice) plus the fp32
summation bound where a sum cancels, at least 99% of them identical. Rows are computed independently of the
batch (a row's bits alone equal its bits in a batch), and runs are bitwise repeatable.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET, shapes

from deepinfer_vllm.ops import mhc as ref
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.triton import mhc

HC, ITERS, RMS_EPS, HC_EPS = 4, 20, 1e-6, 1e-6
CASES = shapes([(1, 64), (5, 96), (19, 256), (6, 1280)], [(64, 5120), (300, 5120), (2048, 4096)])


def make(T: int, D: int, device, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(T, HC, D, generator=g) * torch.rand(T, HC, 1, generator=g) * 3).to(dtype)
    fn = torch.randn(HC * (HC + 2), HC * D, generator=g) * (HC * D) ** -0.5
    base = torch.randn(HC * (HC + 2), generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    return [t.to(device) for t in (streams, fn, base, scale)]


def assert_within_one_ulp(out: torch.Tensor, want: torch.Tensor, ulps: int = 1, terms=None) -> None:
    """bf16 ``out`` within ``ulps`` bf16 ulps of ``want`` everywhere, identical on >= 99%.

    ``terms``: the magnitude of the fp32 sum behind each entry (sum of |products|); it adds
    the fp32 summation-order bound ``2^-20 * terms`` where the sum cancels."""
    assert out.dtype == want.dtype and out.shape == want.shape
    o, w = out.float(), want.float()
    ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))))
    bound = ulps * ulp + 1e-30 + (0.0 if terms is None else 2.0**-20 * terms.float())
    err = (o - w).abs()
    assert bool((err <= bound).all()), f"worst {(err / bound).max().item():.3g}x the bound"
    assert (o == w).float().mean().item() >= 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,D", CASES)
def test_hc_mix(T, D, device, dtype):
    """bf16 streams: the projection on bf16 tensor cores (fn split exactly in three); fp32
    streams: the fp32 ``ieee`` dot. The same tolerances for both."""
    streams, fn, base, scale = make(T, D, device, dtype=dtype)
    got = mhc.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    want = ref.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    for g, w, tol in zip(got, want, (2e-5, 2e-5, 1e-4)):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert (g - w).abs().max().item() <= tol
    # the Sinkhorn output's columns sum to ~1 (the last normalisation is over columns)
    assert torch.allclose(got[2].sum(dim=1), torch.ones(T, HC, device=device), atol=1e-4)


@pytest.mark.parametrize("T,D", CASES)
def test_hc_collapse_norm(T, D, device):
    streams, *_ = make(T, D, device, seed=1)
    g = torch.Generator().manual_seed(2)
    pre = (torch.rand(T, HC, generator=g) + 0.1).to(device)
    weight = (torch.rand(D, generator=g) + 0.5).to(torch.bfloat16).to(device)
    got = mhc.hc_collapse_norm(streams, pre, weight, RMS_EPS)
    # The collapse is rounded to bf16 before the norm: a last-bit difference in its fp32 sum can
    # move that rounding by one ulp and the output by one more (two roundings: two ulps).
    y = ref.hc_collapse(streams, pre).float()
    rstd = torch.rsqrt(y.square().mean(-1, keepdim=True) + RMS_EPS)
    terms = (streams.float().abs() * pre.unsqueeze(-1)).sum(1) * rstd * weight.float()
    assert_within_one_ulp(got, rms_norm(ref.hc_collapse(streams, pre), weight, RMS_EPS), ulps=2, terms=terms)


@pytest.mark.parametrize("T,D", CASES)
def test_rms_norm(T, D, device):
    x = (torch.randn(T, 2, D, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16).to(device)
    weight = (torch.rand(D, generator=torch.Generator().manual_seed(7)) + 0.5).to(torch.bfloat16).to(device)
    assert_within_one_ulp(mhc.rms_norm(x, weight, RMS_EPS), rms_norm(x, weight, RMS_EPS))


@pytest.mark.parametrize("T,D", CASES)
def test_hc_expand(T, D, device):
    streams, fn, base, scale = make(T, D, device, seed=3)
    _, post, comb = ref.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(device)
    terms = post.unsqueeze(-1) * y.float().abs().unsqueeze(1) + torch.einsum(
        "tjk,tjd->tkd", comb, streams.float().abs()
    )
    got = mhc.hc_expand(y, streams, post, comb)
    assert_within_one_ulp(got, ref.hc_expand(y, streams, post, comb), terms=terms)


@pytest.mark.skipif(
    INTERPRET, reason="the interpreter's tl.dot is numpy's BLAS, whose rows depend on the tile"
)
def test_rows_do_not_depend_on_the_batch(device):
    T, D = 300, 5120
    streams, fn, base, scale = make(T, D, device, seed=5)
    full = mhc.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    for rows in (slice(0, 1), slice(3, 7), slice(T - 2, T)):
        part = mhc.hc_mix(streams[rows], fn, base, scale, RMS_EPS, HC_EPS, ITERS)
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows])
    again = mhc.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    assert all(torch.equal(a, b) for a, b in zip(again, full))


@pytest.mark.skipif(
    INTERPRET, reason="the interpreter's tl.dot is numpy's BLAS, whose rows depend on the tile"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_row_tile(device, dtype):
    """The projection's row tile grows with the step (``mix_tile``): a row's bits are the same
    whichever tile computed it. Rows of very different magnitudes (2^-40 .. 2^40 within a
    token) make any change of summation order visible."""
    T, D = 1100, 5120
    tiles = {mhc.mix_tile(t) for t in (1, 63, 64, 1023, T)}
    assert len(tiles) == 3 and mhc.mix_tile(T) != mhc.mix_tile(1)  # every switch is crossed below
    streams, fn, base, scale = make(T, D, device, seed=8, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    spread = torch.exp2(torch.randint(-40, 41, (T, HC, D), generator=g).float()).to(device)
    streams = (streams.float() * spread).to(dtype)
    full = mhc.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, ITERS)
    for rows in (slice(0, 1), slice(5, 68), slice(100, 1023), slice(T - 64, T)):
        part = mhc.hc_mix(streams[rows], fn, base, scale, RMS_EPS, HC_EPS, ITERS)
        for a, b in zip(part, full):
            assert torch.equal(a, b[rows])


@pytest.mark.parametrize("T,D", shapes([(3, 96), (5, 256)], [(8192, 5120)]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_broadcast_view_reads_as_its_copy(T, D, device, dtype):
    """The first site's streams are ``broadcast_streams``' view (stream stride 0): mix, collapse +
    norm and expand give the bits they give on the same streams copied out (96: the mix copies,
    its K step would straddle two streams)."""
    _, fn, base, scale = make(T, D, device, seed=11, dtype=dtype)
    g = torch.Generator().manual_seed(12)
    e = (torch.randn(T, D, generator=g) * 3).to(dtype).to(device)
    view = ref.broadcast_streams(e, HC)
    assert view.stride(1) == 0
    copy = view.contiguous()
    for a, b in zip(
        mhc.hc_mix(view, fn, base, scale, RMS_EPS, HC_EPS, ITERS),
        mhc.hc_mix(copy, fn, base, scale, RMS_EPS, HC_EPS, ITERS),
    ):
        assert torch.equal(a, b)
    pre = torch.rand(T, HC, generator=g).to(device) + 0.5
    w = torch.randn(D, generator=g).to(dtype).to(device)
    assert torch.equal(mhc.hc_collapse_norm(view, pre, w, RMS_EPS), mhc.hc_collapse_norm(copy, pre, w, RMS_EPS))
    y = torch.randn(T, D, generator=g).to(dtype).to(device)
    post = torch.rand(T, HC, generator=g).to(device) * 2
    comb = torch.rand(T, HC, HC, generator=g).to(device)
    out = mhc.hc_expand(y, view, post, comb)
    assert out.is_contiguous() and torch.equal(out, mhc.hc_expand(y, copy, post, comb))


def test_bad_shapes_are_refused(device):
    streams, fn, base, scale = make(2, 64, device)
    with pytest.raises(ValueError, match="fn must be fp32"):
        mhc.hc_mix(streams, fn[:, :-1], base, scale, RMS_EPS, HC_EPS, ITERS)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        mhc.hc_mix(streams, fn, base, scale, RMS_EPS, HC_EPS, 0)
