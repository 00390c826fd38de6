"""Batch-invariant mode (``DEEPINFER_BATCH_INVARIANT=1``) of ``ops.numerics``: every row
of a GEMM or pointwise op has the same bits alone and among other rows, and the
values are those of the plain ops up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer_vllm.ops import quant, weight_gemm
from deepinfer_vllm.ops.indexer import index_scores
from deepinfer_vllm.ops.mhc import hc_mix
from deepinfer_vllm.ops.moe import route_sqrtsoftplus
from deepinfer_vllm.ops.numerics import COL_TILE, ROW_TILE, matmul, pointwise, tiled_matmul

DTYPES = (torch.float32, torch.float64)


@pytest.fixture
def invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _rows_alone(f, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K,N", [(128, 64), (64, 2048), (512, 24), (33, 5), (24, 300)])
def test_tiled_matmul_rows_are_independent_of_the_batch(dtype, K, N):
    g = torch.Generator().manual_seed(K * N)
    a = torch.randn(3 * ROW_TILE + 5, K, generator=g, dtype=dtype)
    b = torch.randn(N, K, generator=g, dtype=dtype)
    full = tiled_matmul(a, b)
    assert torch.equal(_rows_alone(lambda r: tiled_matmul(r, b), a), full)
    # any sub-batch, at any offset (other neighbours, other tile positions)
    for lo, hi in [(1, 4), (5, 5 + ROW_TILE), (7, 30)]:
        assert torch.equal(tiled_matmul(a[lo:hi], b), full[lo:hi])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(full, a @ b.t(), rtol=tol, atol=tol * K**0.5)


def test_plain_matmul_is_batch_variant():
    """Why the mode exists: MKL's row count decides the summation order (gemv for one
    row), so one row alone rounds differently from the same row in a batch."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=g)
    b = torch.randn(2048, 128, generator=g)
    assert not torch.equal(a[:1] @ b.t(), (a @ b.t())[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_tiles_make_columns_independent_of_n(dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(20, 4, 64, generator=g, dtype=dtype)  # [t, h, d] like the indexer's queries
    keys = torch.randn(COL_TILE + 37, 64, generator=g, dtype=dtype)
    full = tiled_matmul(a, keys, col_tile=True)
    assert full.shape == (20, 4, keys.shape[0])
    for n in (1, 3, 8, COL_TILE, COL_TILE + 1):
        assert torch.equal(tiled_matmul(a[2:9], keys[:n], col_tile=True), full[2:9, :, :n])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(full, torch.einsum("thd,nd->thn", a, keys), rtol=tol, atol=tol * 8)


def test_matmul_switch(monkeypatch):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(5, 32, generator=g), torch.randn(16, 32, generator=g)
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    assert torch.equal(matmul(a, b), a @ b.t())
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert torch.equal(matmul(a, b), tiled_matmul(a, b))
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_BATCH_INVARIANT"):
        matmul(a, b)


@pytest.mark.parametrize("fn", [torch.sigmoid, F.silu, F.softplus], ids=["sigmoid", "silu", "softplus"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [4, 24, 1300])
def test_pointwise_rows_are_independent_of_the_batch(invariant, fn, dtype, width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(64, width, generator=g, dtype=dtype) * 5
    full = pointwise(fn, x)
    assert torch.equal(_rows_alone(lambda r: pointwise(fn, r), x), full)
    assert torch.equal(pointwise(fn, x[3:40]), full[3:40])
    torch.testing.assert_close(full, fn(x))


def test_plain_sigmoid_is_batch_variant():
    """PyTorch's SIMD sigmoid and its scalar tail kernel differ in the last ulp: a row of
    24 values alone (16 SIMD + 8 scalar) differs from the same row among others."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 24, generator=g) * 5
    alone = _rows_alone(torch.sigmoid, x)
    assert not torch.equal(alone, torch.sigmoid(x))


@pytest.mark.parametrize(
    "fn", [torch.exp, torch.sqrt, torch.rsqrt, torch.log2], ids=["exp", "sqrt", "rsqrt", "log2"]
)
def test_ops_left_unwrapped_agree_on_both_paths(fn):
    """exp, sqrt, rsqrt and log2 stay plain in batch-invariant mode: their SIMD and scalar
    kernels must give the same bits (checked on 2**20 values)."""
    g = torch.Generator().manual_seed(4)
    for dtype in DTYPES:
        x = (
            torch.rand(1 << 20, generator=g, dtype=dtype) * 60 - 50
            if fn is torch.exp
            else torch.rand(1 << 20, generator=g, dtype=dtype) * 10 + 1e-3
        )
        lanes = x.new_empty(x.numel(), 2)
        lanes[:, 0] = x
        assert torch.equal(fn(x), fn(lanes[:, 0]))


def test_quantised_gemms_rows_are_independent_of_the_batch(invariant):
    """FP8 32x32 block and packed FP4 GEMMs (the dense layers and the experts), bf16 rows."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 128, generator=g) * 0.05
    codes, scale = quant.quant_fp8_block(w, weight_gemm.FP8_TILE)
    packed, scale4 = quant.quant_fp4_rows(w)
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    for gemm in (
        lambda r: weight_gemm.gemm_fp8(r, codes, scale),
        lambda r: weight_gemm.gemm_fp4(r, packed, scale4),
    ):
        full = gemm(x)
        assert full.dtype == torch.bfloat16
        assert torch.equal(_rows_alone(gemm, x), full)
        assert torch.equal(gemm(x[9:20]), full[9:20])


def test_model_ops_rows_are_independent_of_the_batch(invariant):
    """mHC mixes, routing and the stored-weight GEMM: one row alone == the row in a batch."""
    g = torch.Generator().manual_seed(6)
    T, hc, D, E = 37, 4, 64, 16
    streams = torch.randn(T, hc, D, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc * (hc + 2), hc * D, generator=g) * 0.1
    base, scale = torch.randn(hc * (hc + 2), generator=g), torch.rand(3, generator=g)
    mixes = hc_mix(streams, fn, base, scale, 1e-6, 1e-6, 20)
    for i in (0, 17, T - 1):
        for alone, batched in zip(hc_mix(streams[i : i + 1], fn, base, scale, 1e-6, 1e-6, 20), mixes):
            assert torch.equal(alone[0], batched[i])
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    gate = torch.randn(E, D, generator=g).to(torch.bfloat16)
    weights, ids = route_sqrtsoftplus(x, gate, torch.zeros(E), 2, 1.5)
    head = torch.randn(300, D, generator=g).to(torch.bfloat16)
    logits = weight_gemm.gemm_stored(x, head, torch.float32)
    for i in (0, 17, T - 1):
        w1, i1 = route_sqrtsoftplus(x[i : i + 1], gate, torch.zeros(E), 2, 1.5)
        assert torch.equal(w1[0], weights[i]) and torch.equal(i1[0], ids[i])
        assert torch.equal(weight_gemm.gemm_stored(x[i : i + 1], head, torch.float32)[0], logits[i])


def test_index_scores_rows_are_independent_of_the_chunk(invariant):
    """A query's scores do not depend on the other queries of its step nor on how many
    keys the step reads (a prefill chunk reads up to its last row's visible count)."""
    g = torch.Generator().manual_seed(7)
    Tq, H, Dk, N = 30, 4, 64, 70
    q = torch.randn(Tq, H, Dk, generator=g).to(torch.bfloat16)
    w = torch.randn(Tq, H, generator=g).to(torch.bfloat16)
    keys = torch.randn(N, Dk, generator=g).to(torch.bfloat16)
    visible = torch.arange(Tq) * 2 + 10
    full = index_scores(q, w, keys, visible)
    for lo, hi in [(0, 1), (5, 12), (29, 30)]:
        n = int(visible[lo:hi].max())
        part = index_scores(q[lo:hi], w[lo:hi], keys[:n], visible[lo:hi])
        assert torch.equal(part, full[lo:hi, :n])
