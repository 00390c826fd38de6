"""ops/triton/moe_gemv.py (decode GEMV of the routed experts) against ``ops.quant_gemm.grouped_fp4_gemm``.

Mirrors ``test_moe_gemm.py`` with the same inputs and the same bound: fp32 outputs within
``2e-6 * K * (|x_used| @ |W|.T)`` of the fp32 reference, bf16 within that plus one bf16 ulp
(``test_fp8_gemm.check``); the summation order differs from ``grouped_fp4_gemm``, so no bitwise
comparison with it. Rows past ``offsets[-1]`` must be exactly zero (output memory poisoned
first), empty experts (about a third), both act modes, T = 1 / 4 / 64 (rows routed to an
expert: 1-9), the three row-pass widths (1, 2, 4 with exact tails) and the tensor-core pass,
K split or not, fewer persistent programs than items (bit-equal to one item per program).
Run-to-run determinism and rows past ``offsets[-1]`` alone: ``test_moe_gemm.py`` (both kernels).
On the GPU also Flash's w13 (N=4608, K=5120) and w2 (N=5120, K=2304) over the 48 experts of
one EP=8 rank and CUDA-graph replay (new activations and offsets)
equal to eager bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET, poison_, shapes
from test_fp8_gemm import ACTS, make_x
from test_moe_gemm import check_grouped, make_experts, make_offsets

from deepinfer_vllm.ops import quant_gemm
from deepinfer_vllm.ops.triton.moe_gemv import gemv_config, grouped_fp4_gemv

CONFIGS = [
    None,  # gemv_config's choice
    dict(BN=32, NB=2, ROWS=4, SPLIT=2, STAGES=2, num_warps=4),
    dict(BN=16, NB=1, ROWS=2, SPLIT=3, STAGES=3, num_warps=2),
    dict(BN=32, NB=4, ROWS=1, SPLIT=1, STAGES=1, num_warps=4),
    dict(BN=32, NB=2, DOT=True, SPLIT=2, STAGES=2, num_warps=4),
    dict(BN=64, NB=4, ROWS=4, SPLIT=4, GRID=3, num_warps=4),  # persistent: several items per program
]


def counts_offsets(counts: list[int], r: int, device, dtype=torch.int32) -> torch.Tensor:
    offs = torch.tensor([0] + list(counts), dtype=torch.long).cumsum(0)
    assert int(offs[-1]) <= r
    return offs.to(dtype).to(device)


def run_check(device, e, n, k, r, offs, act, out_dtype, cfg, seed):
    w, s = make_experts(e, n, k, seed=e + n + k, device=device)
    x = make_x(r, k, seed=seed, device=device)
    poison_(torch.empty(r, n, dtype=out_dtype, device=device))  # the allocator hands this memory out next
    got = grouped_fp4_gemv(x, offs, w, s, act, out_dtype, config=cfg)
    ref = quant_gemm.grouped_fp4_gemm(x, offs, w, s, act, torch.float32)
    assert got.shape == (r, n) and got.dtype == out_dtype
    check_grouped(got, ref, x, act, w, s, offs)
    return got


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "e,n,k,r,cfg",
    shapes(
        [
            (6, 64, 256, 1, 0),  # T=1: one row
            (6, 64, 256, 1, 2),
            (5, 64, 128, 4, 0),  # T=4
            (5, 64, 128, 4, 1),
            (3, 32, 96, 9, 2),
            (7, 64, 256, 64, 0),  # T=64: several rows per expert
            (7, 64, 256, 64, 1),
            (7, 64, 256, 64, 3),
            (7, 64, 256, 64, 4),
            (4, 64, 64, 20, 5),
        ],
        [
            (48, 4608, 5120, 1, 0),  # Flash w13 / w2, decode T = 1, 4, 64, 256 (rows on one rank)
            (48, 5120, 2304, 1, 0),
            (48, 4608, 5120, 4, 0),
            (48, 4608, 5120, 48, 0),
            (48, 5120, 2304, 48, 0),
            (48, 4608, 5120, 192, 0),
            (48, 5120, 2304, 192, 4),
            (8, 512, 1024, 300, 1),
        ],
    ),
)
def test_moe_gemv_matches_reference(device, act, out_dtype, e, n, k, r, cfg):
    tail = 0 if r == 1 else min(3, r - 1)
    offs = make_offsets(
        e, r, seed=r + e, device=device, tail=tail, dtype=torch.int64 if r % 2 else torch.int32
    )
    run_check(device, e, n, k, r, offs, act, out_dtype, CONFIGS[cfg], seed=r)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(
    "cfg",
    [
        dict(BN=32, NB=2, ROWS=4, SPLIT=2),
        dict(BN=32, NB=2, ROWS=2, SPLIT=1),
        dict(BN=32, NB=2, ROWS=1, SPLIT=3),
        dict(BN=32, NB=2, DOT=True, SPLIT=2),
    ],
)
def test_moe_gemv_small_row_counts(device, act, cfg):
    """Every row count 0..9 per expert (the passes of 4, 2, 1 and the masked 3), empty experts
    between them, rows past offsets[-1]."""
    counts = [1, 0, 2, 3, 0, 4, 5, 6, 7, 0, 8, 9]
    e, n, k, r = len(counts), 32, 128, sum(counts) + 2
    run_check(device, e, n, k, r, counts_offsets(counts, r, device), act, torch.float32, cfg, seed=5)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dot", [False, True])
def test_moe_gemv_persistent_grid(device, act, dot):
    """Fewer programs than items (each walks items pid, pid + G, ...): the same bits as one
    item per program."""
    e, n, k, r = 6, 64, 128, 30
    offs = make_offsets(e, r, seed=23, device=device, tail=4)
    w, s = make_experts(e, n, k, seed=21, device=device)
    x = make_x(r, k, seed=22, device=device)
    base = dict(BN=32, NB=2, ROWS=4, DOT=dot, SPLIT=2)
    want = grouped_fp4_gemv(x, offs, w, s, act, torch.bfloat16, config={**base, "GRID": 10**6})
    for g in (1, 3, 7):
        poison_(torch.empty(r, n, dtype=torch.bfloat16, device=device))
        got = grouped_fp4_gemv(x, offs, w, s, act, torch.bfloat16, config={**base, "GRID": g})
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), g
    check_grouped(want, quant_gemm.grouped_fp4_gemm(x, offs, w, s, act, torch.float32), x, act, w, s, offs)


def test_moe_gemv_config_covers_device():
    """T=1 (one expert) gets about PPS programs per SM from the K split alone; many experts
    need no split."""
    for n, k in ((4608, 5120), (5120, 2304)):
        cfg = gemv_config(1, 48, n, k, sms=132)
        items = (n // cfg["BN"]) * cfg["SPLIT"]
        assert 2 * 132 <= items <= cfg["PPS"] * 132, (n, k, cfg)
        assert gemv_config(192, 48, n, k, sms=132)["SPLIT"] == 1


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("act", ["bf16", "mxfp8"])
@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 2304)])
@pytest.mark.parametrize("r", [1, 48, 192])
def test_moe_gemv_cuda_graph(device, act, n, k, r):
    e = 48
    w, s = make_experts(e, n, k, seed=11, device=device)
    x_static = make_x(r, k, seed=12, device=device)
    offs_static = make_offsets(e, r, seed=13, device=device, tail=0 if r == 1 else 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_fp4_gemv(x_static, offs_static, w, s, act)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = grouped_fp4_gemv(x_static, offs_static, w, s, act)
    for seed in (14, 15):
        x_new = make_x(r, k, seed=seed, device=device)
        offs_new = make_offsets(e, r, seed=seed, device=device, tail=0 if r == 1 else seed - 14)
        x_static.copy_(x_new)
        offs_static.copy_(offs_new)
        graph.replay()
        torch.cuda.synchronize()
        want = grouped_fp4_gemv(x_new, offs_new, w, s, act)
        assert torch.equal(out_static.view(torch.int16), want.view(torch.int16))
