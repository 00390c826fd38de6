"""ops/triton/stored_gemm.py (bf16 x times a bf16 / fp32 weight on bf16 tensor cores) against the
fp64 product of the same values.

The kernel adds the exact products ``x*w`` (an fp32 weight split into three bf16 parts) in
fp32: ``3K`` terms (``K`` for a bf16 weight), each group aligned and truncated by the tensor
cores, so every fp32 output is within ``terms * 2^-23 * (|x| @ |W|.T)`` of the fp64 product
(the worst-case bound of an fp32 sum of that many terms, with the truncating unit 2^-23);
bf16 outputs within that plus one bf16 ulp. That bound is too loose to see a missing low
part of the weight, so sums that are exact in fp32 (one-hot rows of x; sparse x of +-1 times
20-bit integer weights) are compared bit for bit: they fail if any part of the split is lost.
Shapes of the release: the compressor's fp32 ``[512, 5120]`` and the router's bf16
``[384, 5120]``, M = 1 ... 8192 (from ``VENDOR_ROWS`` on cuBLAS: the same bound, the same exact sums), forced
K splits; bitwise run-to-run determinism; CUDA-graph replay equal to eager bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import INTERPRET, shapes

from deepinfer_vllm.ops.triton.stored_gemm import VENDOR_ROWS, stored_gemm

RELEASE = [(512, 5120, torch.float32), (384, 5120, torch.bfloat16)]
CONFIGS = [
    None,
    dict(BM=16, BN=32, BK=32, SPLIT=3, num_warps=4),  # split K added by each tile's last program
    dict(BM=32, BN=64, BK=64, SPLIT=1, num_warps=4),
    dict(BM=16, BN=64, BK=64, SPLIT=16, num_warps=4),
    dict(BM=32, BN=32, BK=32, SPLIT=2, num_warps=4),  # split K added by splitk_reduce
    dict(GEMV=True, BN=16, BK=64, SPLIT=7, num_warps=4),  # the CUDA-core path, split K, up to 2 rows
    dict(BM=16, BN=64, BK=64, SPLIT=16, num_warps=4),  # the tensor cores at 1-2 rows
]


@functools.lru_cache(maxsize=4)
def make_weight(n: int, k: int, dtype: torch.dtype, seed: int, device) -> torch.Tensor:
    """Full-significand weights, row magnitudes spread over 2^-8 .. 2^3."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 * torch.exp2(torch.randint(-8, 4, (n, 1), generator=g).float())
    return w.to(dtype).to(device)


def make_x(m: int, k: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    e = torch.randint(-4, 5, (m, k // 32, 1), generator=g).float()
    x = torch.randn(m, k, generator=g) * torch.exp2(e).expand(m, k // 32, 32).reshape(m, k)
    return x.to(torch.bfloat16).to(device)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v.double().abs())
    return torch.exp2((e - 8).double()).clamp_min(2.0**-133)


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    k = w.shape[1]
    terms = 3 * k if w.dtype == torch.float32 else k
    want = x.double() @ w.double().t()
    bound = terms * 2.0**-23 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + bf16_ulp(want)
    err = (got.double() - want).abs()
    bad = ~(err <= bound)  # NaN fails too (``err > bound`` is false for it)
    worst = (err / bound).nan_to_num(float("inf")).max()
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outside the bound; worst {worst:.3g}x"


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("out_dtype", [F32, BF16])
@pytest.mark.parametrize(
    "m,n,k,w_dtype,cfg",
    shapes(
        [
            (m, n, k, dt, c)
            for dt in (F32, BF16)
            for m, n, k, c in [
                (1, 64, 128, 0), (7, 96, 256, 1), (40, 64, 96, 2), (17, 32, 256, 3), (2, 40, 192, 5)
            ]
        ],
        [(m, n, k, dt, 0) for n, k, dt in RELEASE for m in (1, 2, 4, 7, 64, 256, 8192)]
        + [(77, 512, 5120, F32, 1), (5, 512, 5120, F32, 3), (300, 384, 5120, BF16, 1)]
        + [(m, n, k, dt, c) for n, k, dt in RELEASE for m in (1, 2) for c in (5, 6)],
    ),
)
def test_stored_gemm_matches_fp64(device, out_dtype, m, n, k, w_dtype, cfg):
    w = make_weight(n, k, w_dtype, seed=n + k, device=device)
    x = make_x(m, k, seed=m, device=device)
    got = stored_gemm(x, w, out_dtype, config=CONFIGS[cfg])
    assert got.shape == (m, n) and got.dtype == out_dtype
    check(got, x, w)


@pytest.mark.parametrize("n,k,w_dtype", shapes([(64, 256, torch.float32), (32, 96, torch.bfloat16)], RELEASE))
def test_stored_gemm_one_hot_rows_are_exact(device, n, k, w_dtype):
    """x rows ``+-2^j e_k``: the output is the weight's column times 2^j, bit for bit
    (fp32 weights: hi + mid + lo must all arrive)."""
    w = make_weight(n, k, w_dtype, seed=3, device=device)
    m = 64
    g = torch.Generator().manual_seed(4)
    cols = torch.randint(0, k, (m,), generator=g)
    sign = torch.randint(0, 2, (m,), generator=g) * 2 - 1
    scale = torch.exp2(torch.randint(-6, 7, (m,), generator=g).float()) * sign
    x = torch.zeros(m, k)
    x[torch.arange(m), cols] = scale
    x = x.to(torch.bfloat16).to(device)
    want = (w.t()[cols.to(device)].float() * scale.to(device)[:, None]).float()
    for cfg in (None, CONFIGS[1]):
        got = stored_gemm(x, w, torch.float32, config=cfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for rows in (1, 2):  # the CUDA-core path (default up to 2 rows)
        got = stored_gemm(x[:rows], w, torch.float32)
        assert torch.equal(got.view(torch.int32), want[:rows].view(torch.int32))


@pytest.mark.parametrize("k", shapes([256], [5120]))
def test_stored_gemm_exact_sums_are_exact(device, k):
    """Weights ``+-i * 2^e`` with ``i < 2^20`` (20 significant bits: every part of the split is
    used) and x rows of 16 entries +-1: every partial sum is an fp32 number, so the output equals
    the fp64 product bit for bit."""
    n, m = 96, 24
    g = torch.Generator().manual_seed(5)
    sign = torch.randint(0, 2, (n, k), generator=g) * 2 - 1
    ints = torch.randint(1 << 19, 1 << 20, (n, k), generator=g).double() * sign
    w = (ints * torch.exp2(torch.randint(-30, 10, (n, 1), generator=g).double())).float()
    x = torch.zeros(m, k)
    for i in range(m):
        x[i, torch.randperm(k, generator=g)[:16]] = (torch.randint(0, 2, (16,), generator=g) * 2 - 1).float()
    x, w = x.to(torch.bfloat16).to(device), w.to(device)
    want = (x.double() @ w.double().t()).float()
    assert (want.double() == x.double() @ w.double().t()).all()  # every sum is an fp32 number
    for cfg in (None, CONFIGS[1], CONFIGS[3]):
        got = stored_gemm(x, w, torch.float32, config=cfg)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for rows in range(0, m, 2):  # the CUDA-core path, two rows at a time
        for cfg in (None, CONFIGS[5]):
            got = stored_gemm(x[rows : rows + 2], w, torch.float32, config=cfg)
            assert torch.equal(got.view(torch.int32), want[rows : rows + 2].view(torch.int32))
    if not INTERPRET:  # prefill rows on cuBLAS: each part's sums are exact too (multiples of 2^e below 2^24)
        reps = -(-VENDOR_ROWS // m)
        got = stored_gemm(x.repeat(reps, 1), w, torch.float32)
        assert got.shape[0] >= VENDOR_ROWS
        assert torch.equal(got.view(torch.int32), want.repeat(reps, 1).view(torch.int32))


def test_stored_gemm_special_values(device):
    """Infinite weights give +-inf (NaN against a zero x), NaN weights NaN, as the fp32 product."""
    k = 64
    w = make_weight(4, k, torch.float32, seed=6, device=device).clone()
    w[0, 3] = float("inf")
    w[1, 5] = -float("inf")
    w[2, 7] = float("nan")
    x = make_x(3, k, seed=7, device=device)
    x[2, 5] = 0.0
    got = stored_gemm(x, w, torch.float32)
    for rows in (slice(0, 2), slice(2, 3)):  # the CUDA-core path and the tensor cores agree on them
        gemv = stored_gemm(x[rows], w, torch.float32, config=CONFIGS[5])
        assert torch.equal(gemv.isnan(), stored_gemm(x[rows], w, torch.float32, config=CONFIGS[6]).isnan())
        assert torch.equal(gemv.isnan(), got[rows].isnan())
    want = (x.float() @ w.t()).cpu()
    got = got.cpu()
    assert torch.equal(got[:, :3].isnan(), want[:, :3].isnan())
    assert torch.equal(got[:, :3].isinf(), want[:, :3].isinf())
    assert torch.equal(got[:, :3].sign()[want[:, :3].isinf()], want[:, :3].sign()[want[:, :3].isinf()])


def test_stored_gemm_refuses_bad_inputs(device):
    w = make_weight(32, 64, torch.float32, seed=8, device=device)
    x = make_x(2, 64, seed=9, device=device)
    with pytest.raises(TypeError, match="bf16 x"):
        stored_gemm(x.float(), w)
    with pytest.raises(TypeError, match="bf16 or fp32 weight"):
        stored_gemm(x, w.half())
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        stored_gemm(x[:, :32], w)
    with pytest.raises(ValueError, match="contiguous"):
        stored_gemm(x, w.t().contiguous().t())
    out = stored_gemm(x[:0], w)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("n,k,w_dtype", shapes([(64, 256, torch.float32)], RELEASE))
def test_stored_gemm_deterministic(device, n, k, w_dtype):
    w = make_weight(n, k, w_dtype, seed=12, device=device)
    for m in (1, 2, 9) if INTERPRET else (1, 2, 64, 256, 8192):
        x = make_x(m, k, seed=13, device=device)
        a = stored_gemm(x, w, torch.float32)
        b = stored_gemm(x, w, torch.float32)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("n,k,w_dtype", RELEASE)
@pytest.mark.parametrize("m", [1, 2, 64, 256, 1024])  # 1024: cuBLAS (VENDOR_ROWS)
def test_stored_gemm_cuda_graph(device, n, k, w_dtype, m):
    w = make_weight(n, k, w_dtype, seed=14, device=device)
    x_static = make_x(m, k, seed=15, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        stored_gemm(x_static, w, torch.float32)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = stored_gemm(x_static, w, torch.float32)
    for seed in (16, 17):
        x_new = make_x(m, k, seed=seed, device=device)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        eager = stored_gemm(x_new, w, torch.float32)
        assert torch.equal(out_static.view(torch.int32), eager.view(torch.int32))
