"""Dense FP8 block-scaled GEMM: ``x @ W.T``, W e4m3 ``[N, K]`` with UE8M0 per 32x32 tile.

Same arguments and numbers as ``ops.quant_gemm.fp8_block_gemm`` (fp32 accumulation, one
rounding; the summation order differs). The tile is computed transposed ("swap AB"):
``acc[BN, BM] = W_tile @ x_tile.T``, so the weight, decoded in registers, is the MMA's A
operand and a small batch (``BM`` 16-64) is the narrow N side of the MMA.

The weight tile is decoded to bf16 in registers (``e4m3 * 2^s`` is exactly a bf16 number);
x is taken as given (bf16) or, for act="mxfp8", as its MXFP8 round trip written as bf16 by
``mxfp8_qdq`` (exact) before the GEMM; one bf16 ``tl.dot`` per K tile.
Calls of ``WIDE_ROWS`` rows (17-256) on sm90 go to the wide Gluon kernel (``fp8_gemm_wide_gluon``: the batch on the
wgmma's wide side), smaller decode calls (and up to 64 rows the calls it cannot take) to the Gluon kernel of
``fp8_gemm_gluon`` (weights decoded straight into the wgmma A fragment; both exact for scale bytes up to
``MAX_SCALE_BYTE``, checked when a checkpoint is loaded).
Small M splits K over programs (``SPLIT``); the partial sums go to an fp32 workspace and are
added in a fixed order (deterministic): by each tile's last program up to ``FIXUP_ROWS`` rows
(``splitk.split_fixup``, one launch), else by ``splitk_reduce``. Output rounding to
bf16 is done on the bits (round to nearest even), identical on GPU and interpreter.
No host synchronisation: capturable in a CUDA graph.

Calls of at least ``VENDOR_ROWS`` rows (``VENDOR_ROWS_GROUPED`` when grouped; bf16 out) decode the weight
to a bf16 copy once (``fp8_block_decode``: exact, the same values the kernel decodes per tile) and
multiply it on cuBLAS with fp32 accumulation (reduced-precision reductions switched off for the call):
the same exact products summed in cuBLAS's order. Measured on the H200 at M = 2048-8192 on Flash's
shapes: 643-835 TFLOP/s against 221-425 for the Triton kernel (benchmarks/README.md, "Dense FP8 GEMM
in prefill"); the bf16 copy is transient (2 bytes per weight).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.shared_input import input_form
from deepinfer_vllm.ops.triton.fp8_gemm_gluon import MAX_SCALE_BYTE, gluon_fp8_block_gemm, gluon_fp8_supported
from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_gemm, gluon_fp8_wide_supported
from deepinfer_vllm.ops.triton.mxfp8_quant import mxfp8_qdq
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import (
    FIXUP_ROWS,
    OUT_KINDS,
    sm_count,
    split_counters,
    split_fixup,
    split_k,
    splitk_reduce,
    store_out,
)

__all__ = [
    "ACT_MODES", "MAX_SCALE_BYTE", "VENDOR_ROWS", "dense_kernel", "fp8_block_decode", "fp8_block_gemm",
    "fp32_reductions", "in_wide_rows", "pick_config", "weight_bytes",
]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ACT_MODES = ("bf16", "mxfp8")
# From this many rows the weight is decoded to bf16 once and the product runs on cuBLAS (docstring): at 256 rows
# cuBLAS beat the Triton kernel on every Flash shape, at 128 it lost (H200, `fp8_gemm.py --mid`,
# benchmarks/README.md); block-diagonal (grouped) calls keep the Triton kernel up to 1024 rows (G products).
VENDOR_ROWS = 256
VENDOR_ROWS_GROUPED = 1024
# Calls of these many rows (first included, last not) go to the wide Gluon kernel on sm90 (``fp8_gemm_wide_gluon``:
# each weight byte decoded once per 256 rows into shared memory, the batch on the wgmma's wide side), grouped or
# not, before the choices above and below. Measured (benchmarks/README.md, tenth and eleventh sessions): at 32 and
# 64 rows 10-32% less time than the decode kernel on every Flash shape (H100, `fp8_gemm.py --decode`; 17-31 rows
# run the same tiles as 32 in both), 4-15% more at 16; at 128 rows 5-17% faster than the Triton kernel (H200;
# H100 -8..+4%); at 256 within -14..+11% of the decoded weight on cuBLAS (H200; H100 -29..+9%); 1.2-1.6x slower
# than cuBLAS at 512 on both GPUs.
WIDE_ROWS = (17, 257)


def in_wide_rows(m: int) -> bool:
    """Whether a call of ``m`` rows is in ``WIDE_ROWS`` (read at each call: benchmarks and tests set it)."""
    return WIDE_ROWS[0] <= m < WIDE_ROWS[1]


# --------------------------------------------------------------------------- shared helpers


@triton.jit
def ue8m0(s, SHIFT: tl.constexpr):
    """UE8M0 bytes -> fp32 ``2^(s - 127 + SHIFT)`` from the bits (byte 0 with SHIFT=0:
    the subnormal 2^-127)."""
    si = (s.to(tl.int32) & 0xFF) + SHIFT
    return tl.where(si == 0, 0x400000, si << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_f32(b):
    """e4m3 bytes (uint8) -> exact fp32."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def mma_bf16(a, b, acc, F32_DOT: tl.constexpr):
    """``acc + a @ b`` for bf16 operands. Triton's interpreter mishandles bf16 dots: there
    the operands are widened to fp32 (exact) and multiplied with ``input_precision="ieee"``."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def scale_blocks(w, sw, BN: tl.constexpr, BK: tl.constexpr):
    """Weight tile ``w [BN, BK]`` (fp32) times its per-32-column scales ``sw [BN, BK // 32]``, as bf16."""
    return tl.reshape(tl.reshape(w, [BN, BK // 32, 32]) * sw[:, :, None], [BN, BK]).to(tl.bfloat16)


@triton.jit
def store_tile(
    out_ptr, acc, offs_m, offs_n, omask, pid_k, rows, N, stride_om,
    SPLIT: tl.constexpr, OUT_KIND: tl.constexpr, part_ptr=None, counter_ptr=None, tile=0,
):
    """The epilogue of a ``[BN, BM]`` (column, row) tile: with ``SPLIT > 1`` its fp32 partial sum
    into the workspace ``[SPLIT, rows, N]`` (at ``out_ptr``, which ``splitk_reduce`` adds; or at
    ``part_ptr``, the last program of the tile adding them into ``out``: ``splitk.split_fixup``),
    else the tile rounded into ``out``."""
    if SPLIT > 1:
        if counter_ptr is None:
            ptr = out_ptr + pid_k.to(tl.int64) * rows * N + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(ptr, acc, mask=omask)
        else:
            split_fixup(
                part_ptr, out_ptr, counter_ptr, tile, acc, offs_m, offs_n, omask, pid_k, rows, N, stride_om,
                SPLIT, OUT_KIND,
            )
    else:
        store_out(out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None], acc, omask, OUT_KIND)


def pick_config(m_rows: int, n: int, k: int, active_tiles: int | None = None, sms: int = 132) -> dict:
    """Tile sizes from shapes only. ``active_tiles``: row tiles that carry work (grouped GEMM:
    at most min(rows, experts)); K is split until about two programs per SM have work."""
    if m_rows <= 64:
        cfg = dict(BM=max(16, triton.next_power_of_2(m_rows)), BN=128, BK=128, num_warps=8, num_stages=4)
    elif m_rows < 1024:
        cfg = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4)
    else:
        cfg = dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3)
    if k % cfg["BK"]:
        cfg["BK"] = 32 if k % 64 else 64
    tiles = (active_tiles if active_tiles is not None else triton.cdiv(m_rows, cfg["BM"])) * triton.cdiv(
        n, cfg["BN"]
    )
    k_tiles = triton.cdiv(k, cfg["BK"])
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(8, k_tiles // 2):
        split *= 2
    cfg["SPLIT"] = split
    return cfg


# --------------------------------------------------------------------------- kernel


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    part_ptr,  # SPLIT > 1: fp32 partials [SPLIT, M, N], added by each tile's last program
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_om,
    k_per_split,
    group_n,  # output columns per group (N when not grouped)
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    F32_DOT: tl.constexpr,  # interpreter: bf16 operands multiplied as fp32 (same products)
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    n_mask = offs_n < N
    m_mask = offs_m < M
    group = (pid_n * BN) // group_n  # a tile never straddles groups (BN divides group_n)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + group * K
    ws_rows = ws_ptr + (offs_n // 32).to(tl.int64) * stride_wsn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        kc = k0 // 32 + tl.arange(0, BK // 32)
        cmask = kc * 32 < k_hi
        w = e4m3_f32(tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & kmask[None, :], other=0))
        sw = ue8m0(tl.load(ws_rows[:, None] + kc[None, :], mask=n_mask[:, None] & cmask[None, :], other=0), 0)
        w = scale_blocks(w, sw, BN, BK)
        xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & kmask[None, :], other=0.0)
        acc = mma_bf16(w, tl.trans(xv), acc, F32_DOT)
    omask = n_mask[:, None] & m_mask[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        out_ptr, acc, offs_m, offs_n, omask, pid_k, M, N, stride_om, SPLIT, OUT_KIND, part_ptr, counter_ptr, tile
    )


# --------------------------------------------------------------------------- wrapper


def gemm_output(x: torch.Tensor, rows: int, n: int, out_dtype: torch.dtype | None) -> torch.Tensor:
    """The ``[rows, n]`` output of a GEMM of ``x`` (``out_dtype`` default ``x.dtype``)."""
    out_dtype = out_dtype or x.dtype
    if out_dtype not in OUT_KINDS:
        raise TypeError(f"out_dtype must be fp32, bf16 or fp16, got {out_dtype}")
    return torch.empty(rows, n, dtype=out_dtype, device=x.device)


def weight_bytes(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and scale as the uint8 the kernels read (rows must be contiguous)."""
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    if w.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError("weight and scale rows must be contiguous")
    return w, s


def gemm_activations(x: torch.Tensor, act: str) -> torch.Tensor:
    """The bf16 rows of ``x`` the kernels read: ``x``, or its exact MXFP8 round trip (made once for the
    GEMMs that share ``x``: ``ops.shared_input``)."""
    if act == "mxfp8":
        return input_form(x, "mxfp8", mxfp8_qdq)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"act='bf16' takes bf16 x, got {x.dtype}")
    return x if x.stride(1) == 1 else x.contiguous()


@triton.jit
def _fp8_decode_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr
):
    """``out[n, k] = e4m3(w[n, k]) * 2^(s[n // 32, k // 32] - 127)`` as bf16 (exact: the tile decode)."""
    grid_wait(PDL)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    m = (n < N)[:, None] & (k < K)[None, :]
    rows = n.to(tl.int64)[:, None]
    b = tl.load(w_ptr + rows * stride_w + k[None, :], mask=m, other=0)
    sc = tl.load(s_ptr + (rows // 32) * stride_s + (k // 32)[None, :], mask=m, other=0)
    tl.store(out_ptr + rows * K + k[None, :], (e4m3_f32(b) * ue8m0(sc, 0)).to(tl.bfloat16), mask=m)


def fp8_block_decode(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The bf16 values ``[N, K]`` of an e4m3 ``weight`` with UE8M0 32x32 ``scale`` (the GEMM kernels' decode;
    ``quant.dequant_fp8_block`` rounded to bf16, exact for the scales the kernels take)."""
    w, s = weight_bytes(weight, scale)
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    if n and k:
        _fp8_decode_kernel[(triton.cdiv(n, 32), triton.cdiv(k, 256))](
            w, s, out, n, k, w.stride(0), s.stride(0), BN=32, BK=256, num_warps=4,
            **pdl_args(w.device),
        )
    return out


@contextlib.contextmanager
def fp32_reductions():
    """cuBLAS with fp32 accumulation throughout: reduced-precision (bf16) reductions off for the block, the
    previous setting restored after it (also on an exception)."""
    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced


def _vendor_gemm(
    xv: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, groups: int
) -> torch.Tensor:
    """``out = xv @ decode(W).T`` on cuBLAS, fp32 accumulation (no reduced-precision reductions), bf16 out;
    ``groups > 1``: one product per group, each reading its columns of ``xv`` and writing its columns of
    ``out`` (strided views)."""
    wb = fp8_block_decode(weight, scale)
    n, k = wb.shape
    ng = n // groups
    with fp32_reductions():
        for g in range(groups):
            cols, rows = slice(g * k, (g + 1) * k), slice(g * ng, (g + 1) * ng)
            torch.mm(xv[:, cols], wb[rows].t(), out=out[:, rows])
    return out


def dense_kernel(xv: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out_dtype: torch.dtype, groups: int = 1) -> str:
    """The kernel ``fp8_block_gemm`` runs a call on when given no ``config``: "wide" (``WIDE_ROWS`` on sm90),
    "vendor" (the decoded weight on cuBLAS, from ``VENDOR_ROWS``), "gluon" (the decode kernel on sm90) or "triton".
    ``xv``: the activations the kernels read; ``w``, ``s``: the weight bytes (``weight_bytes``)."""
    m = xv.shape[0]
    gluon_out = out_dtype in (torch.float32, torch.bfloat16)
    if in_wide_rows(m) and gluon_out and gluon_fp8_wide_supported(xv, w, s, groups):
        return "wide"
    if m >= (VENDOR_ROWS if groups == 1 else VENDOR_ROWS_GROUPED) and out_dtype == torch.bfloat16 and xv.is_cuda:
        return "vendor"
    if gluon_out and gluon_fp8_supported(xv, w, s, groups):
        return "gluon"
    return "triton"


def fp8_block_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    act: str = "bf16",
    out_dtype: torch.dtype | None = None,
    *,
    groups: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for ``weight [N, K]`` e4m3 (float8_e4m3fn / uint8) and ``scale
    [N/32, K/32]`` UE8M0 (float8_e8m0fnu / uint8); ``act`` "bf16" or "mxfp8" (x quantised
    here by the Triton quantiser). ``config`` overrides the tile choice (tests, benchmarks).

    ``groups > 1``: a block-diagonal GEMM in one launch. ``x [M, groups * K]``; output
    columns ``g * N/groups ...`` are ``x[:, g*K:(g+1)*K] @ W[g*N/groups:(g+1)*N/groups].T``
    (the attention's grouped output projection)."""
    if act not in ACT_MODES:
        raise ValueError(f"act must be 'bf16' or 'mxfp8', got {act!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != groups * weight.shape[1]:
        raise ValueError(
            f"x [M, {groups} * K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    m, k = x.shape[0], weight.shape[1]
    n = weight.shape[0]
    if groups < 1 or n % (32 * groups):
        raise ValueError(f"N={n} must split into {groups} groups of whole 32-row tiles")
    if k % 32 or n % 32:
        raise ValueError(f"N and K must be multiples of 32, got N={n}, K={k}")
    if tuple(scale.shape) != (n // 32, k // 32):
        raise ValueError(f"scale must be [{n // 32}, {k // 32}], got {tuple(scale.shape)}")
    out = gemm_output(x, m, n, out_dtype)
    out_dtype = out.dtype
    if m == 0:
        return out
    w, s = weight_bytes(weight, scale)
    xv = gemm_activations(x, act)
    if config is None:
        kernel = dense_kernel(xv, w, s, out_dtype, groups)
    else:
        kernel = "wide" if "WGS" in config else "gluon" if "BT" in config else "triton"
    if kernel == "wide":
        return gluon_fp8_wide_gemm(xv, w, s, out, groups=groups, config=config)
    if kernel == "vendor":
        return _vendor_gemm(xv, w, s, out, groups)
    if kernel == "gluon":
        return gluon_fp8_block_gemm(xv, w, s, out, groups=groups, config=config)
    cfg, split, k_per_split = split_k(
        dict(config) if config else pick_config(m, n, k, sms=sm_count(x.device)), k
    )
    group_n = n // groups
    # A grouped tile must not straddle two groups (a power of two >= 32 divides group_n);
    # ungrouped, a tile past N is masked as before.
    while groups > 1 and group_n % cfg["BN"]:
        cfg["BN"] //= 2
    kind = OUT_KINDS[out_dtype]
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    fixup = split > 1 and cfg["BM"] <= FIXUP_ROWS
    _fp8_gemm_kernel[grid](
        xv,
        w,
        s,
        part if split > 1 and not fixup else (out.view(torch.int16) if kind == 1 else out),
        part,
        split_counters(x.device, grid[0] * grid[1]) if fixup else None,
        m,
        n,
        k,
        xv.stride(0),
        w.stride(0),
        s.stride(0),
        out.stride(0),
        k_per_split,
        group_n,
        SPLIT=split,
        OUT_KIND=kind,
        F32_DOT=_INTERPRET,
        **cfg,
        **pdl_args(xv.device),
    )
    if split > 1 and not fixup:
        splitk_reduce(part, out)
    return out
