"""ops/triton/stored_gemm.py on the CPU under Triton's interpreter, small shapes.

* The split of an fp32 weight into bf16 ``hi + mid + lo``: bit-exact (the fp64 sum of the parts
  equals ``w``) for random values over the whole exponent range and edge values, where the
  module docstring says it is (``|w| >= 2^-110``, zeros, infinities); below, within 2^-133.
* Small GEMMs (fp32 and bf16 weights, fp32 and bf16 out, K splits) against the fp64 product
  within the fp32 summation bound of ``tests/gpu/test_stored_gemm.py``, and bit for bit where
  the sums are exact (one-hot rows of x).
* ``StoredGemm``'s Triton path (as on a CUDA device) against its reference; fp32 x keeps the
  reference.

The kernels run under the interpreter in a subprocess (``tests/ops/interpreted.py``).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops.weight_gemm import StoredGemm, gemm_stored
from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_kernels_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def K():
    return interpreted_module("deepinfer_vllm.ops.triton.stored_gemm")


def _edge_values() -> torch.Tensor:
    bits = torch.tensor(
        [
            0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
            0x00000001, 0x807FFFFF, 0x00400000, 0x00010000,  # fp32 subnormals
            0x00800000, 0x00FFFFFF, 0x80800001,  # smallest normals
            0x08800000, 0x08FFFFFF, 0x887FFFFF, 0x08800001,  # 2^-110 .. below it
            0x3F800001, 0x3FFFFFFF, 0x3F80FFFF, 0x3F808001, 0xBF7FFFFF,  # around 1
            0x7F7FFFFF, 0xFF7FFFFF, 0x7F000001,  # the largest
        ],
        dtype=torch.int64,
    )
    return bits.to(torch.int32).view(torch.float32)


def test_split_is_exact(K):
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31, (20000,), generator=g, dtype=torch.int64).to(torch.int32)
    w = torch.cat([_edge_values(), random_bits.view(torch.float32)])
    w = w[~w.isnan()]
    hi, mid, lo = K.split_bf16x3(w)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    total = hi.double() + mid.double() + lo.double()
    wd = w.double()
    exact = (wd.abs() >= 2.0**-110) | (wd == 0) | wd.isinf()
    assert exact.sum() > 15000  # the random values cover the range
    assert torch.equal(total[exact], wd[exact])
    assert ((total[~exact] - wd[~exact]).abs() < 2.0**-133).all()
    # hi is w truncated to bf16 (the largest part), the rest ordered by magnitude
    assert torch.equal(hi.view(torch.int16), (w.view(torch.int32) >> 16).to(torch.int16))
    finite = ~wd.isinf()
    assert (mid.double().abs()[finite] <= hi.double().abs()[finite] * 2.0**-7).all()
    assert (lo.double().abs()[finite] <= hi.double().abs()[finite] * 2.0**-15 + 2.0**-133).all()


def test_split_nan_and_infinity(K):
    w = torch.tensor([float("inf"), -float("inf"), float("nan")])
    nans = torch.tensor([0x7F800001, 0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    w = torch.cat([w, nans])
    hi, mid, lo = K.split_bf16x3(w)
    assert torch.equal(hi[:2].float(), w[:2]) and (mid[:2] == 0).all() and (lo[:2] == 0).all()
    assert (hi[2:].double() + mid[2:].double() + lo[2:].double()).isnan().all()


def _check(got, x, w):
    terms = 3 * w.shape[1] if w.dtype == torch.float32 else w.shape[1]
    want = x.double() @ w.double().t()
    bound = terms * 2.0**-23 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    if got.dtype == torch.bfloat16:
        _, e = torch.frexp(want.abs())
        bound = bound + torch.exp2((e - 8).double())
    assert ((got.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 64, 128, None),  # the CUDA-core path (up to GEMV_ROWS rows)
        (2, 40, 256, dict(GEMV=True, BN=16, BK=32, SPLIT=3, num_warps=4)),  # its split K, a partial row tile
        (2, 64, 160, dict(GEMV=True, BN=32, BK=64, SPLIT=1, num_warps=4)),
        (1, 64, 128, dict(BM=16, BN=64, BK=64, SPLIT=2, num_warps=4)),  # tensor cores at one row
        (9, 96, 160, dict(BM=16, BN=32, BK=32, SPLIT=3, num_warps=4)),  # split K added by the last program
        (20, 32, 64, dict(BM=32, BN=32, BK=32, SPLIT=2, num_warps=4)),  # split K added by splitk_reduce
    ],
)
def test_small_gemms(K, w_dtype, out_dtype, m, n, k, cfg):
    g = torch.Generator().manual_seed(m + n)
    e = torch.randint(-8, 4, (n, 1), generator=g).float()
    w = (torch.randn(n, k, generator=g) * torch.exp2(e)).to(w_dtype)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = K.stored_gemm(x, w, out_dtype, config=cfg)
    assert got.shape == (m, n) and got.dtype == out_dtype
    _check(got, x, w)


def test_one_hot_rows_are_exact(K):
    """x rows ``+-2^j e_k``: the weight's columns times 2^j bit for bit (all three parts arrive)."""
    n, k, m = 48, 96, 16
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, 1), generator=g).float())
    cols = torch.randint(0, k, (m,), generator=g)
    scale = torch.exp2(torch.randint(-6, 7, (m,), generator=g).float())
    x = torch.zeros(m, k)
    x[torch.arange(m), cols] = scale
    got = K.stored_gemm(x.to(torch.bfloat16), w, torch.float32)
    assert torch.equal(got, w.t()[cols] * scale[:, None])
    got = K.stored_gemm(x[:2].to(torch.bfloat16), w, torch.float32)  # the CUDA-core path
    assert torch.equal(got, w.t()[cols[:2]] * scale[:2, None])


def test_gemv_path_is_chosen_and_refuses_more_rows(K):
    assert K.stored_config(K.GEMV_ROWS, 512, 5120, True).get("GEMV")
    assert not K.stored_config(K.GEMV_ROWS + 1, 512, 5120, True).get("GEMV")
    w, x = torch.randn(32, 64), torch.randn(K.GEMV_ROWS + 1, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        K.stored_gemm(x, w, config=dict(GEMV=True, BN=32, BK=64, SPLIT=1, num_warps=4))


def test_fp32_weight_tiles_put_one_warpgroup_on_64_weight_rows(K):
    """Warps only along the weight rows for an fp32 weight's three dots: on 8 warps a 64-row tile got two MMA
    layouts on sm90 and its accumulator went through shared memory twice per K tile (2.2x slower at 256 rows on an
    H100; ``tests/gpu/compile_sm90.py`` fails such a kernel). bf16 weights (one dot) keep their tiles' warps."""
    for m in range(K.GEMV_ROWS + 1, 1100, 7):
        cfg = K.stored_config(m, 512, 5120, True)
        assert cfg["num_warps"] == 4 * cfg["BN"] // 64, (m, cfg)
    assert K.stored_config(256, 384, 5120, False)["num_warps"] == 8


def test_stored_gemm_op_triton_path(K):
    op = StoredGemm("cpu", torch.bfloat16)
    assert op.backend == "torch"
    op.kernels = K  # as on a CUDA device
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(2, 3, 128, generator=g).to(torch.bfloat16)
    got = op.forward_triton(x, w, torch.float32)
    assert got.shape == (2, 3, 64)
    _check(got.view(6, 64), x.view(6, 128), w)
    assert op.forward_triton(x, w).dtype == torch.bfloat16
    xf = x.float()
    assert torch.equal(op.forward_triton(xf, w), gemm_stored(xf, w))  # fp32 models: the reference
