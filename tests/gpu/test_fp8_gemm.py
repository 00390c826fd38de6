"""ops/triton/fp8_gemm.py and ops/triton/mxfp8_quant.py against their PyTorch references.

* ``mxfp8_quantize``: bytes identical to ``ops.quant.mxfp8_quantize`` (wide magnitudes, zeros,
  infinities, bf16 and fp32 input); ``mxfp8_qdq`` bits identical to the bf16 round trip.
* ``fp8_block_gemm``: the kernel and ``ops.quant_gemm.fp8_block_gemm`` on identical inputs,
  both act modes. fp32 outputs within the fp32 summation bound
  ``2e-6 * K * (|x_used| @ |W|.T)``; bf16 outputs within one bf16 ulp of the fp32 reference
  (plus that bound). Split-K and every tile configuration the wrapper picks; bitwise
  run-to-run determinism; CUDA-graph capture and replay equal to eager bit for bit.
* The Gluon decode kernel (``fp8_gemm_gluon``, M <= 64 on sm90, forced by configs with ``BT``): every batch
  tile, ring depth and split, every e4m3 byte and scale byte it takes (the refusal of larger scale bytes
  at load: ``tests/ops/test_quant_gemm.py``). The wide kernel (``fp8_gemm_wide_gluon``, configs with ``WGS``)
  likewise, and grouped.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import INTERPRET, shapes

from deepinfer_vllm.ops import quant, quant_gemm
from deepinfer_vllm.ops.triton.fp8_gemm import (
    VENDOR_ROWS,
    VENDOR_ROWS_GROUPED,
    WIDE_ROWS,
    fp8_block_decode,
    fp8_block_gemm,
)
from deepinfer_vllm.ops.triton.mxfp8_quant import mxfp8_qdq, mxfp8_quantize

ACTS = ["bf16", "mxfp8"]


@functools.lru_cache(maxsize=4)
def make_weight(n: int, k: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weight with tile magnitudes spread over 2^-6..2^3 (scales differ tile to tile);
    built on the device (cached: the Flash shapes are large)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device) * 0.02
    e = torch.randint(-6, 4, (n // 32, 1, k // 32, 1), generator=g, device=device).float()
    w = w * torch.exp2(e).expand(n // 32, 32, k // 32, 32).reshape(n, k)
    v, s = quant.quant_fp8_block(w)
    return v.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def make_x(m: int, k: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g) * torch.exp2(
        torch.randint(-4, 5, (m, k // 32, 1), generator=g).float()
    ).expand(m, k // 32, 32).reshape(m, k)
    return x.to(torch.bfloat16).to(device)


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at ``|v|`` (fp64)."""
    _, e = torch.frexp(v.double().abs())
    return torch.exp2((e - 8).double()).clamp_min(2.0**-133)


def check(got: torch.Tensor, ref32: torch.Tensor, x_used: torch.Tensor, w: torch.Tensor) -> None:
    k = w.shape[1]
    bound = 2e-6 * k * (x_used.double().abs() @ w.double().abs().t()) + 1e-30
    g, r = got.double(), ref32.double()
    err = (g - r).abs()
    if got.dtype == torch.bfloat16:
        bound = bound + bf16_ulp(ref32)
    # NaN fails (``err > bound`` alone would let it pass) unless the reference has it there too
    bad = ~((err <= bound) | (g == r) | (g.isnan() & r.isnan()))
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.numel()} outside the bound ({int(g.isnan().sum())} NaN; first at "
        f"{bad.nonzero()[:4].tolist()}); worst {(err / bound).nan_to_num(float('inf')).max():.3g}x"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", shapes([(7, 96), (33, 256)], [(1, 5120), (300, 8192), (4096, 2048)]))
def test_mxfp8_quantize_bytes(device, dtype, m, k):
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * torch.exp2(
        torch.randint(-60, 60, (m, k // 32, 1), generator=g).float()
    ).expand(m, k // 32, 32).reshape(m, k)
    x[0, :32] = 0.0
    x[0, 32:64] = -0.0
    x[-1, -3] = float("inf")
    x[-1, -40] = -float("inf")
    x = x.to(dtype)
    v, s = mxfp8_quantize(x.to(device))
    rv, rs = quant.mxfp8_quantize(x)
    assert torch.equal(v.cpu(), rv) and torch.equal(s.cpu(), rs)
    want = quant.mxfp8_dequantize(rv, rs).to(torch.bfloat16)  # exact: e4m3 times 2^e
    assert torch.equal(mxfp8_qdq(x.to(device)).cpu().view(torch.int16), want.view(torch.int16))


CONFIGS = [
    None,
    dict(BM=16, BN=32, BK=64, SPLIT=3, num_warps=4),  # split K added by each tile's last program
    dict(BM=32, BN=64, BK=32, SPLIT=2, num_warps=4),  # split K added by splitk_reduce
    dict(BM=32, BN=64, BK=32, SPLIT=1, num_warps=4),
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    shapes(
        [(1, 64, 128, 0), (5, 96, 256, 1), (40, 64, 96, 2), (17, 32, 64, 0)],
        [
            (1, 1536, 5120, 0),
            (64, 5120, 8192, 0),
            (256, 4608, 5120, 0),
            (300, 1792, 5120, 0),
            (2048, 5120, 8192, 0),
            (77, 1536, 5120, 1),
        ],
    ),
)
def test_fp8_gemm_matches_reference(device, act, out_dtype, m, n, k, cfg):
    w, s = make_weight(n, k, seed=n + k, device=device)
    x = make_x(m, k, seed=m, device=device)
    got = fp8_block_gemm(x, w, s, act, out_dtype, config=CONFIGS[cfg])
    ref = quant_gemm.fp8_block_gemm(x, w, s, act, torch.float32)
    assert got.shape == (m, n) and got.dtype == out_dtype
    check(got, ref, quant_gemm.activations(x, act), quant.dequant_fp8_block(w, s))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(
    "m,groups,n_group,k",
    shapes(
        [(3, 2, 64, 96), (20, 4, 96, 64)],
        [(1, 8, 1024, 512), (64, 8, 1024, 512), (700, 16, 1024, 512), (VENDOR_ROWS_GROUPED, 16, 1024, 512)],
    ),
)
def test_fp8_gemm_grouped_matches_reference(device, act, m, groups, n_group, k):
    """Block-diagonal GEMM (the attention's grouped output projection): group ``g``'s
    columns of x times its rows of W, each group against the reference."""
    w, s = make_weight(groups * n_group, k, seed=groups + k, device=device)
    x = make_x(m, groups * k, seed=m + 1, device=device)
    got = fp8_block_gemm(x, w, s, act, torch.bfloat16, groups=groups)
    assert got.shape == (m, groups * n_group)
    check_groups(got, x, w, s, act, groups)


def check_groups(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, act: str, groups: int):
    """Each group's output columns of a block-diagonal GEMM against the reference on its columns of ``x``."""
    n_group, k = w.shape[0] // groups, x.shape[1] // groups
    for g in range(groups):
        rows, cols = slice(g * n_group, (g + 1) * n_group), slice(g * k, (g + 1) * k)
        w_g, s_g = w[rows], s[g * n_group // 32 : (g + 1) * n_group // 32]
        ref = quant_gemm.fp8_block_gemm(x[:, cols], w_g, s_g, act, torch.float32)
        check(got[:, rows], ref, quant_gemm.activations(x[:, cols], act), quant.dequant_fp8_block(w_g, s_g))


def test_fp8_gemm_grouped_refuses_bad_shapes(device):
    w, s = make_weight(96, 64, seed=1, device=device)
    x = make_x(2, 2 * 64, seed=2, device=device)
    with pytest.raises(ValueError, match="groups of whole 32-row tiles"):
        fp8_block_gemm(x, w, s, groups=2)  # 48 rows per group
    with pytest.raises(ValueError, match=r"x \[M, 3 \* K\]"):
        fp8_block_gemm(x, w, s, groups=3)  # x has 2 groups' columns


GLUON_CONFIGS = [
    dict(BT=8, NS=4, SPLIT=1),
    dict(BT=16, NS=3, SPLIT=2),
    dict(BT=32, NS=4, SPLIT=4),
    dict(BT=64, NS=2, SPLIT=1),
    dict(BT=16, NS=4, SPLIT=3, MAXNREG=96),
    dict(BT=8, WG=2, NS=4, SPLIT=2),
    dict(BT=64, WG=2, NS=3, SPLIT=3),
    dict(BT=32, WG=2, NS=2, SPLIT=1),
    dict(BT=8, NS=4, SPLIT=2, ASYNC=True),
    dict(BT=64, WG=2, NS=3, SPLIT=2, ASYNC=True),
    dict(BT=16, WG=1, NS=2, SPLIT=1, ASYNC=True),
    dict(BT=32, WG=2, NS=4, SPLIT=2, ASYNC=True),
    # x's tiles gathered 4 bytes at a time (the default below 32 rows) or copied from x_tile_order's rewrite
    dict(BT=64, WG=2, NS=3, SPLIT=2, X_TILED=False),
    dict(BT=32, WG=2, NS=4, SPLIT=2, ASYNC=True, X_TILED=False),
    dict(BT=8, NS=4, SPLIT=2, X_TILED=True),
    dict(BT=16, WG=2, NS=3, SPLIT=1, ASYNC=True, X_TILED=True),
    # warp-specialised (one warpgroup, x gathered): split K added by the last program or by splitk_reduce
    dict(BT=8, NS=4, SPLIT=1, WS=True, MAXNREG=64, LOAD_REGS=40),
    dict(BT=16, NS=4, SPLIT=3, WS=True, MAXNREG=64, LOAD_REGS=40, FIXUP=True),
    dict(BT=16, NS=6, SPLIT=2, WS=True, MAXNREG=64, LOAD_REGS=40, FIXUP=False),
    dict(BT=8, NS=3, SPLIT=2, WS=True),
]


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize(
    "cfg",
    [
        dict(BT=128, WG=2, NS=2, SPLIT=1),
        dict(BT=128, WG=1, NS=3, SPLIT=2, ASYNC=True),
        dict(BT=64, WG=2, NS=3, SPLIT=2),
    ],
)
@pytest.mark.parametrize("m,n,k", [(200, 4608, 5120), (256, 1792, 5120)])
def test_gluon_fp8_gemm_large_batches(device, cfg, m, n, k):
    """Decode of 128-512 rows (``benchmarks/gpu/fp8_gemm.py --mid``; not chosen by default): 128-row batch
    tiles and several 64-row tiles, rows past M masked."""
    w, s = make_weight(n, k, seed=n + k, device=device)
    x = make_x(m, k, seed=m, device=device)
    got = fp8_block_gemm(x, w, s, "bf16", torch.bfloat16, config=cfg)
    ref = quant_gemm.fp8_block_gemm(x, w, s, "bf16", torch.float32)
    check(got, ref, quant_gemm.activations(x, "bf16"), quant.dequant_fp8_block(w, s))


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize("m,n,k,groups", [(1, 5120, 8192, 1), (13, 4608, 5120, 1), (16, 2048, 2 * 1024, 2)])
def test_gluon_fp8_warp_specialised_is_bit_identical(device, m, n, k, groups):
    """The warp-specialised decode kernel (a producer warp copies by TMA and cp.async) gives the bits of the kernel
    whose threads copy their own bytes, with the same tiles and a synchronous wgmma (the same decode, the same
    products in the same order), split K included."""
    w, s = make_weight(n, k, seed=n + k + m, device=device)
    x = make_x(m, groups * k, seed=m + 1, device=device)
    for base in (dict(BT=8 if m <= 8 else 16, NS=4, SPLIT=1), dict(BT=16, NS=4, SPLIT=2, FIXUP=True)):
        for out_dtype in (torch.float32, torch.bfloat16):
            got = fp8_block_gemm(x, w, s, "bf16", out_dtype, groups=groups,
                                 config=dict(base, WS=True, MAXNREG=64, LOAD_REGS=40))
            want = fp8_block_gemm(x, w, s, "bf16", out_dtype, groups=groups, config=dict(base, ASYNC=False))
            assert torch.equal(got, want), (m, n, k, groups, base, out_dtype)


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize("m,n,k,groups", [(33, 4608, 5120, 1), (64, 5120, 8192, 1), (64, 2048, 2 * 1024, 2)])
def test_gluon_fp8_x_tiled_is_bit_identical(device, m, n, k, groups):
    """``X_TILED`` stages ``x`` in the tile order and pairs the weights to match; the gathers stage natural
    column pairs. With ``x`` and ``w`` permuted inside each 128-column tile so that the gathers put every
    value where the tile order puts it (the permutation stays inside each 32-column scale block), the two give
    the same bits."""
    from deepinfer_vllm.ops.triton.moe_gemm_gluon import tile_order_columns

    p = torch.arange(128)
    s_, h, q, e = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
    gathered_cols = 32 * q + 4 * s_ + 2 * h + e  # the column the gathers stage at place p
    perm = torch.empty(128, dtype=torch.int64)
    perm[gathered_cols] = tile_order_columns()
    assert torch.equal(perm // 32, torch.arange(128) // 32)
    kg = k // groups
    cols = (torch.arange(kg // 128)[:, None] * 128 + perm[None, :]).flatten().to(device)
    w, s = make_weight(n, kg, seed=n + k, device=device)
    x = make_x(m, k, seed=m, device=device)
    x_perm = x.view(m, groups, kg)[:, :, cols].reshape(m, k).contiguous()
    for base in (dict(BT=64, WG=2, NS=3, SPLIT=2), dict(BT=32, WG=2, NS=4, SPLIT=1, ASYNC=True)):
        tiled = fp8_block_gemm(
            x, w, s, "bf16", torch.float32, groups=groups, config={**base, "X_TILED": True}
        )
        gathered = fp8_block_gemm(
            x_perm, w.view(torch.uint8)[:, cols].contiguous().view(w.dtype), s, "bf16", torch.float32,
            groups=groups,
            config={**base, "X_TILED": False},
        )
        assert torch.equal(tiled.view(torch.int32), gathered.view(torch.int32))


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
def test_gluon_fp8_shared_input_rewrites_x_once(device, monkeypatch):
    """GEMMs of one ``x`` inside ``shared_inputs(x)`` (``wq_a`` and ``wkv`` at 64 rows on the decode kernel, whose
    64-row tiles read ``x`` rewritten) launch ``x_tile_order`` once and give the bits of separate calls; captured in
    a CUDA graph, the replay rewrites the new ``x``."""
    from deepinfer_vllm.ops.shared_input import shared_inputs
    from deepinfer_vllm.ops.triton import fp8_gemm, fp8_gemm_gluon

    monkeypatch.setattr(fp8_gemm, "WIDE_ROWS", (0, 0))  # (64 rows go to the wide kernel by default: no rewrite)
    made = []
    rewrite = fp8_gemm_gluon.x_tile_order
    monkeypatch.setattr(fp8_gemm_gluon, "x_tile_order", lambda t: made.append(1) or rewrite(t))
    ws = [make_weight(n, 5120, seed=n, device=device) for n in (1024, 512)]
    x = make_x(64, 5120, seed=5, device=device)

    def both():
        return [fp8_block_gemm(x, w, s, "bf16", torch.bfloat16) for w, s in ws]

    alone = both()
    assert len(made) == 2
    with shared_inputs(x):
        shared = both()
    assert len(made) == 3
    for a, b in zip(alone, shared):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with shared_inputs(x):
        both()  # made outside the capture: not reused inside it
        assert len(made) == 4
        with torch.cuda.graph(graph):
            captured = both()
    assert len(made) == 5
    x.copy_(make_x(64, 5120, seed=6, device=device))
    graph.replay()
    want = both()
    for a, b in zip(want, captured):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", range(len(GLUON_CONFIGS)))
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (5, 128, 384), (16, 1536, 5120), (33, 4608, 5120), (64, 5120, 8192)])
def test_gluon_fp8_gemm_matches_reference(device, act, out_dtype, cfg, m, n, k):
    """The decode kernel of ``fp8_gemm_gluon`` (forced by a config with ``BT``) on every batch tile, one and two
    warpgroups, ring depths and K splits, rows past M masked."""
    w, s = make_weight(n, k, seed=n + k, device=device)
    x = make_x(m, k, seed=m + cfg, device=device)
    got = fp8_block_gemm(x, w, s, act, out_dtype, config=GLUON_CONFIGS[cfg])
    ref = quant_gemm.fp8_block_gemm(x, w, s, act, torch.float32)
    assert got.shape == (m, n) and got.dtype == out_dtype
    check(got, ref, quant_gemm.activations(x, act), quant.dequant_fp8_block(w, s))


def every_byte_weight(device) -> tuple[torch.Tensor, torch.Tensor]:
    """A [1152, 1024] weight holding every e4m3 byte but the NaNs (all 256 in its first two rows) and every scale
    byte 0 .. MAX_SCALE_BYTE (one per 32x32 tile: 1152 tiles >= 135 scale bytes)."""
    from deepinfer_vllm.ops.triton.fp8_gemm_gluon import MAX_SCALE_BYTE

    n, k = 1152, 1024
    g = torch.Generator().manual_seed(11)
    wb = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    wb[:2] = torch.arange(256, dtype=torch.uint8).repeat(2, k // 256)
    wb[(wb & 0x7F) == 0x7F] = 0x3C  # no NaN
    sb = (torch.arange(n // 32 * (k // 32)) % (MAX_SCALE_BYTE + 1)).to(torch.uint8).view(n // 32, k // 32)
    return wb.view(torch.float8_e4m3fn).to(device), sb.view(torch.float8_e8m0fnu).to(device)


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize("m", [1, 64])
def test_gluon_fp8_gemm_every_byte(device, m):
    """Every e4m3 byte but the NaNs and every scale byte 0 .. MAX_SCALE_BYTE (one per 32x32 tile) through the
    decode kernel, against the reference."""
    w, s = every_byte_weight(device)
    x = make_x(m, w.shape[1], seed=12, device=device)
    for out_dtype in (torch.float32, torch.bfloat16):
        cfg = dict(BT=8, SPLIT=2) if m == 1 else dict(BT=64, WG=2, NS=3, SPLIT=2)
        got = fp8_block_gemm(x, w, s, "bf16", out_dtype, config=cfg)
        ref = quant_gemm.fp8_block_gemm(x, w, s, "bf16", torch.float32)
        check(got, ref, x, quant.dequant_fp8_block(w, s))


WIDE_CONFIGS = [
    dict(WGS=4, NS=2, SPLIT=1),
    dict(WGS=4, NS=2, SPLIT=3),
    dict(WGS=2, NS=2, SPLIT=2),
    dict(WGS=2, NS=2, SPLIT=1),
    dict(WGS=1, NS=3, SPLIT=1),
]


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", range(len(WIDE_CONFIGS)))
@pytest.mark.parametrize("m,n,k", [(65, 128, 384), (200, 4608, 5120), (256, 1792, 5120), (300, 5120, 8192)])
def test_gluon_fp8_wide_matches_reference(device, act, out_dtype, cfg, m, n, k):
    """The wide kernel of ``fp8_gemm_wide_gluon`` (forced by a config with ``WGS``): two and four warpgroups
    of batch rows, ring depths and K splits, rows past M masked, several row tiles."""
    w, s = make_weight(n, k, seed=n + k, device=device)
    x = make_x(m, k, seed=m + cfg, device=device)
    got = fp8_block_gemm(x, w, s, act, out_dtype, config=WIDE_CONFIGS[cfg])
    ref = quant_gemm.fp8_block_gemm(x, w, s, act, torch.float32)
    assert got.shape == (m, n) and got.dtype == out_dtype
    check(got, ref, quant_gemm.activations(x, act), quant.dequant_fp8_block(w, s))


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels need an sm90 GPU")
def test_gluon_fp8_wide_grouped_and_every_byte(device):
    """The grouped output projection's layout (two groups: each group's columns of ``x`` times its rows of
    W), and every e4m3 byte but the NaNs under every scale byte 0 .. MAX_SCALE_BYTE, against the reference;
    the default configuration bit for bit run to run."""
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config

    groups, n_group, k = 2, 1024, 512
    w, s = make_weight(groups * n_group, k, seed=3, device=device)
    x = make_x(256, groups * k, seed=4, device=device)
    got = fp8_block_gemm(x, w, s, "bf16", torch.bfloat16, groups=groups, config=WIDE_CONFIGS[1])
    check_groups(got, x, w, s, "bf16", groups)

    w, s = every_byte_weight(device)
    n, k = w.shape
    x = make_x(192, k, seed=12, device=device)
    cfg = gluon_fp8_wide_config(192, n, k)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp8_block_gemm(x, w, s, "bf16", out_dtype, config=cfg)
        ref = quant_gemm.fp8_block_gemm(x, w, s, "bf16", torch.float32)
        check(got, ref, x, quant.dequant_fp8_block(w, s))
        assert torch.equal(got, fp8_block_gemm(x, w, s, "bf16", out_dtype, config=cfg))


def test_fp8_block_decode_is_exact(device):
    """Every finite e4m3 byte under scale bytes over the range (kept normal in bf16 under the
    interpreter, whose bf16 casts mishandle subnormals): ``dequant_fp8_block`` rounded to bf16, bit
    for bit."""
    lo = 27 if INTERPRET else 0
    scales = torch.arange(lo, 254, 4, dtype=torch.int32).to(torch.uint8)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.int32).to(torch.uint8)
    w = torch.cat([finite, finite[:2]]).repeat(32 * scales.numel(), 1)  # [32 * S, 256]
    s = scales.view(-1, 1).expand(-1, 8).contiguous()  # [S, 8]: one scale per 32 rows
    w, s = w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)
    got = fp8_block_decode(w.to(device), s.to(device)).cpu()
    want = quant.dequant_fp8_block(w, s).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(INTERPRET, reason="cuBLAS needs a GPU")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(
    "m,n,k", [(max(VENDOR_ROWS, WIDE_ROWS[1]), 1792, 5120), (2048, 4608, 5120), (4096, 5120, 8192)]
)
def test_prefill_rows_on_cublas_match_reference(device, act, m, n, k):
    """From ``VENDOR_ROWS`` rows past ``WIDE_ROWS`` (bf16 out): the decoded weight on cuBLAS, within the
    kernels' bound, repeatable, and the caller's reduced-precision setting left as it was."""
    w, s = make_weight(n, k, seed=n + k, device=device)
    x = make_x(m, k, seed=m, device=device)
    flags = torch.backends.cuda.matmul
    before = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = True
    try:
        got = fp8_block_gemm(x, w, s, act)
        assert flags.allow_bf16_reduced_precision_reduction
    finally:
        flags.allow_bf16_reduced_precision_reduction = before
    ref = quant_gemm.fp8_block_gemm(x, w, s, act, torch.float32)
    check(got, ref, quant_gemm.activations(x, act), quant.dequant_fp8_block(w, s))
    assert torch.equal(got.view(torch.int16), fp8_block_gemm(x, w, s, act).view(torch.int16))
    triton_path = fp8_block_gemm(x, w, s, act, config=dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3))
    assert (triton_path == got).float().mean().item() > 0.99  # the same products, another summation order


@pytest.mark.parametrize("act", ACTS)
def test_fp8_gemm_deterministic(device, act):
    m, n, k = (9, 64, 256) if INTERPRET else (48, 5120, 8192)
    w, s = make_weight(n, k, seed=3, device=device)
    x = make_x(m, k, seed=4, device=device)
    a = fp8_block_gemm(x, w, s, act)
    b = fp8_block_gemm(x, w, s, act)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("act", ["bf16", "mxfp8"])
@pytest.mark.parametrize("m", [4, 64, 512])
def test_fp8_gemm_cuda_graph(device, act, m):
    n, k = 1536, 5120
    w, s = make_weight(n, k, seed=5, device=device)
    x_static = make_x(m, k, seed=6, device=device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_block_gemm(x_static, w, s, act)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fp8_block_gemm(x_static, w, s, act)
    for seed in (7, 8):
        x_new = make_x(m, k, seed=seed, device=device)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_static.view(torch.int16), fp8_block_gemm(x_new, w, s, act).view(torch.int16))
