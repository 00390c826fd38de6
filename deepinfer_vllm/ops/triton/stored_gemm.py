"""GEMM of bf16 activations with a stored bf16 or fp32 weight, on bf16 tensor cores, exactly.

Same arguments and numbers as ``ops.weight_gemm.gemm_stored`` for bf16 ``x`` (the reference
widens x and W to fp32 and multiplies: fp32 products, fp32 sums, one rounding); only the
summation order differs.

The exact split. An fp32 weight ``w`` is the sum of three bf16 numbers, computed on the bits:
``hi = w`` with its low 16 bits cleared, ``r = w - hi`` (exact: the low 16 significand bits),
``mid = r`` with its low 16 bits cleared, ``lo = r - mid`` (the rest, at most 8 significant
bits, cleared the same way). ``hi + mid + lo == w`` exactly for every ``w`` whose set
significand bits all lie at or above 2^-133 (bf16's smallest subnormal): every ``|w| >=
2^-110`` (normal fp32 from there down to 2^-126 and all fp32 subnormals keep only their bits
at or above 2^-133: the error is under 2^-133 per weight, a truncation towards zero), zeros,
infinities (``hi = w``, ``mid = lo = 0``) and NaNs (NaN parts). A bf16 times a bf16 has at
most 16 significant bits, so each product ``x*hi``, ``x*mid``, ``x*lo`` is exact in fp32 (when
it is not below fp32's normal range) and three bf16 tensor-core dots with fp32 accumulation
add exactly the products ``x*w`` of the reference, split into three exact parts: the result
is an fp32 sum of ``3K`` exact terms. (TF32 / tf32x3 would round the weight: not used.) A bf16
weight is one dot. The tensor cores align each group of products to the largest exponent
and truncate (they do not round to nearest), so the stated bound of the fp32 sum is
``3K * 2^-23 * sum_k |x_k w_k|`` (tests/gpu/test_stored_gemm.py), of the order of the
reference's own ``K * 2^-24 * sum``; it is bit-exact whenever every partial sum is
representable (checked).

Layout as ``ops/triton/fp8_gemm.py`` (whose helpers it imports): the tile is computed
transposed, ``acc[BN, BM] = W_tile @ x_tile.T``, so the weight, split in registers, is the
MMA's A operand and a small batch is the narrow side; small M splits K over programs into an
fp32 workspace added in a fixed order (deterministic: by each tile's last program up to
``splitk.FIXUP_ROWS`` rows, ``split_fixup``, else by ``splitk_reduce``); output rounded once,
on the bits. Tile and split from shapes only; no host synchronisation
(capturable in a CUDA graph). Triton's interpreter multiplies the bf16 parts as fp32 (exact).

One or two rows (``GEMV_ROWS``: a decode step of one or two tokens) run on CUDA cores instead
(``_stored_gemv_kernel``): each weight is read once and multiplied in fp32 by every row of x
held in registers (the product exact or fused into the sum's one rounding: within the same
bound, bit-exact where every partial sum is representable), K split over up to 8 programs per
SM, the lanes summed by a fixed tree. Measured on the H200 (benchmarks/README.md, "The layer
step, third session"): 7.8 against 10.6 us for the fp32 ``[512, 5120]`` at one row, where a
plain reader of the same 10.5 MB takes 5.3 us; from three rows the tensor cores are as fast.

Prefill-sized calls (at least ``VENDOR_ROWS`` rows, on CUDA) run on cuBLAS instead, as the dense
FP8 GEMM's do: bf16 operands with fp32 output (``out_dtype``) and fp32 accumulation (reduced-precision
reductions off), a bf16 weight in one product, an fp32 weight as its three exact bf16 parts (the split above,
one pass over the weight per call), ``lo`` first, each next part's product added to the previous ones in the
GEMM's epilogue (``addmm``): the same exact products, summed in cuBLAS's order within each part and then part
by part, so the bound above holds; the result is rounded once to ``out_dtype``. (The Triton kernel reached
about 420 TFLOP/s of bf16 work at 8192 rows, counting the three parts; cuBLAS reaches ~650-790 on the dense
FP8 GEMM's decoded weights.)
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.fp8_gemm import (
    fp32_reductions,
    gemm_output,
    pick_config,
    store_tile,
)
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import (
    FIXUP_ROWS,
    OUT_KINDS,
    sm_count,
    split_counters,
    split_k,
    splitk_reduce,
)

__all__ = ["bf16x3", "dot_bf16", "gemv_config", "split_bf16x3", "stored_config", "stored_gemm", "widen_bf16"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_SPLIT = 16  # K splits of a decode-sized call (the compressor's N = 512 is 4 row tiles)
GEMV_ROWS = 2  # calls of at most this many rows run on CUDA cores (``_stored_gemv_kernel``)
VENDOR_ROWS = 1024  # from this many rows on CUDA: cuBLAS (docstring; 8192 rows measured, 256 not yet)


# --------------------------------------------------------------------------- the split


@triton.jit
def _trunc16(v):
    """fp32 ``v`` with its low 16 bits cleared (a bf16 number, ``v`` truncated towards zero)."""
    return (v.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _as_bf16(v):
    """fp32 ``v`` whose low 16 bits are zero -> the same number as bf16, by its bits (Triton's
    interpreter converts fp32 subnormals to bf16 wrongly; the GPU's rounding would be exact)."""
    return (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def widen_bf16(v):
    """bf16 -> fp32, exact, by the bits (subnormals too, also in Triton's interpreter)."""
    return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def bf16x3(w):
    """fp32 ``w`` -> bf16 ``(hi, mid, lo)`` with ``hi + mid + lo == w`` exactly (module
    docstring: the range); each part is a bf16 number before it is narrowed by its bits."""
    hi = _trunc16(w)
    finite = (w.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000
    # An infinity's rest is 0 (inf - inf would be NaN); a NaN's stays NaN.
    r = tl.where(finite | (w != w), w - hi, 0.0)
    mid = _trunc16(r)
    lo = _trunc16(r - mid)
    return _as_bf16(hi), _as_bf16(mid), _as_bf16(lo)


@triton.jit
def dot_bf16(a, b, acc, F32_DOT: tl.constexpr):
    """``acc + a @ b`` for bf16 operands on the tensor cores (fp32 accumulation). Triton's
    interpreter mishandles bf16 dots: there the operands are widened (exactly, by their bits)
    and multiplied with ``input_precision="ieee"``."""
    if F32_DOT:
        return tl.dot(widen_bf16(a), widen_bf16(b), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _split_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    hi, mid, lo = bf16x3(tl.load(w_ptr + i, mask=mask, other=0.0))
    tl.store(out_ptr + i, hi.to(tl.int16, bitcast=True), mask=mask)
    tl.store(out_ptr + n + i, mid.to(tl.int16, bitcast=True), mask=mask)
    tl.store(out_ptr + 2 * n + i, lo.to(tl.int16, bitcast=True), mask=mask)


def split_bf16x3(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' split of an fp32 tensor: bf16 ``(hi, mid, lo)`` of its shape (for tests)."""
    flat = w.detach().reshape(-1).contiguous().float()
    out = torch.empty(3, flat.numel(), dtype=torch.int16, device=w.device)
    if flat.numel():
        _split_kernel[(triton.cdiv(flat.numel(), 1024),)](
            flat, out, flat.numel(), BLOCK=1024, **pdl_args(flat.device)
        )
    hi, mid, lo = out.view(torch.bfloat16)
    return hi.view(w.shape), mid.view(w.shape), lo.view(w.shape)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _stored_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,  # SPLIT > 1: fp32 partials [SPLIT, M, N], added by each tile's last program
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    W_F32: tl.constexpr,  # fp32 weight: three bf16 dots (hi, mid, lo), else one
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
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & kmask[None, :], other=0.0)
        xt = tl.trans(tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & kmask[None, :], other=0.0))
        if W_F32:
            hi, mid, lo = bf16x3(w)
            acc = dot_bf16(hi, xt, acc, F32_DOT)
            acc = dot_bf16(mid, xt, acc, F32_DOT)
            acc = dot_bf16(lo, xt, acc, F32_DOT)
        else:
            acc = dot_bf16(w, xt, acc, F32_DOT)
    omask = n_mask[:, None] & m_mask[None, :]
    tile = pid_m * tl.num_programs(0) + pid_n
    store_tile(
        out_ptr, acc, offs_m, offs_n, omask, pid_k, M, N, stride_om, SPLIT, OUT_KIND, part_ptr, counter_ptr, tile
    )


@triton.jit
def _stored_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,  # SPLIT > 1: fp32 partials [SPLIT, M, N], added by each tile's last program
    counter_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,
    BM: tl.constexpr,  # every row of x (M <= BM <= GEMV_ROWS)
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    W_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """A few rows of x on CUDA cores: each program streams ``BN`` weight rows over its K split once,
    multiplying every row of x held in registers; one fp32 accumulator per (weight row, x row, K
    lane), summed over the lanes by a fixed tree at the end."""
    grid_wait(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BN, BM, BK], tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < k_hi
        w = tl.load(w_rows + kk[None, :], mask=n_mask[:, None] & kmask[None, :], other=0.0)
        if not W_F32:
            w = widen_bf16(w)
        xv = widen_bf16(tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & kmask[None, :], other=0.0))
        acc += w[:, None, :] * xv[None, :, :]
    total = tl.sum(acc, axis=2)
    omask = n_mask[:, None] & m_mask[None, :]
    store_tile(
        out_ptr, total, offs_m, offs_n, omask, pid_k, M, N, stride_om, SPLIT, OUT_KIND, part_ptr, counter_ptr,
        pid_n,
    )


# --------------------------------------------------------------------------- wrapper


def gemv_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """The CUDA-core path's tiles (``m <= GEMV_ROWS``): 16 weight rows x 256 columns per step, K
    split until about 8 programs per SM (one row of x) or 2 (two rows) have work. Measured on the
    H200 against 16-64 rows, 64-256 columns and 2-8 programs per SM (benchmarks/README.md, "The
    layer step, third session")."""
    cfg = dict(GEMV=True, BN=16, BK=256, num_warps=4, num_stages=3)
    programs = (8 if m == 1 else 2) * sms
    cfg["SPLIT"] = max(1, min(triton.cdiv(k, cfg["BK"]), triton.cdiv(programs, triton.cdiv(n, cfg["BN"]))))
    return cfg


def stored_config(m: int, n: int, k: int, w_fp32: bool, sms: int = 132) -> dict:
    """Tiles and K splits from shapes only: up to ``GEMV_ROWS`` rows the CUDA-core kernel
    (``gemv_config``); else ``fp8_gemm.pick_config``'s tiles, the K tile at most
    64 for an fp32 weight (its stages stay in shared memory) and 128-row tiles from M = 1024
    (three A operands and the accumulator stay in registers), four warps per 64 weight rows
    (one MMA layout for its three dots); K split into up to ``MAX_SPLIT`` parts until about two
    programs per SM have work, the row tile halved to 64 first where the weight has few rows
    (the compressor's 512)."""
    if m <= GEMV_ROWS:
        return gemv_config(m, n, k, sms)
    cfg = pick_config(m, n, k, sms=sms)
    cfg.pop("SPLIT")
    if w_fp32:
        cfg["BK"] = min(cfg["BK"], 64)
        cfg["BM"] = min(cfg["BM"], 128)
    k_tiles = triton.cdiv(k, cfg["BK"])
    m_tiles = triton.cdiv(m, cfg["BM"])
    if m_tiles * triton.cdiv(n, cfg["BN"]) * min(MAX_SPLIT, max(k_tiles // 2, 1)) < 2 * sms:
        cfg["BN"] = 64
    if w_fp32:
        # Warps along the weight rows only: 64 per warpgroup. At 8 warps on a 64-row tile Triton gives the
        # three register-operand dots two MMA layouts and converts the accumulator between them through
        # shared memory twice per K tile (the kernel ran at ~1.2 TFLOP/s per program, benchmarks/README.md).
        cfg["num_warps"] = 4 * (cfg["BN"] // 64)
    tiles = m_tiles * triton.cdiv(n, cfg["BN"])
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(MAX_SPLIT, k_tiles // 2):
        split *= 2
    cfg["SPLIT"] = split
    return cfg


def _vendor_stored(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ W.T`` on cuBLAS (module docstring): one product for a bf16 weight, three added in the
    epilogue, smallest part first, for an fp32 one."""
    with fp32_reductions():
        if weight.dtype == torch.bfloat16:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        hi, mid, lo = split_bf16x3(weight)
        acc = torch.mm(x, lo.t(), out_dtype=torch.float32)
        acc = torch.addmm(acc, x, mid.t(), out_dtype=torch.float32)
        return torch.addmm(acc, x, hi.t(), out_dtype=torch.float32)


def stored_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for bf16 ``x`` and a bf16 / fp32 ``weight [N, K]`` (contiguous rows):
    fp32 accumulation of the exact products, rounded once to ``out_dtype`` (default
    ``x.dtype``; fp32, bf16 or fp16). ``config`` overrides the tiles (tests, benchmarks)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"stored_gemm takes bf16 x, got {x.dtype}")
    if weight.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"stored_gemm takes a bf16 or fp32 weight, got {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    m, k = x.shape
    n = weight.shape[0]
    out = gemm_output(x, m, n, out_dtype)
    if m == 0:
        return out
    if k == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    w_fp32 = weight.dtype == torch.float32
    if config is None and m >= VENDOR_ROWS and x.is_cuda:
        return _vendor_stored(x, weight).to(out.dtype)
    cfg, split, k_per_split = split_k(
        dict(config) if config else stored_config(m, n, k, w_fp32, sms=sm_count(x.device)), k
    )
    kind = OUT_KINDS[out.dtype]
    if cfg.pop("GEMV", False):
        if m > GEMV_ROWS:
            raise ValueError(f"the CUDA-core path takes at most {GEMV_ROWS} rows, got {m}")
        kernel, cfg["BM"] = _stored_gemv_kernel, triton.next_power_of_2(m)
        tiles = (triton.cdiv(n, cfg["BN"]),)  # every row of x in one tile
    else:
        kernel = _stored_gemm_kernel
        cfg["F32_DOT"] = _INTERPRET
        tiles = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]))
    grid = (*tiles, split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    fixup = split > 1 and cfg["BM"] <= FIXUP_ROWS
    kernel[grid](
        x,
        weight,
        part if split > 1 and not fixup else (out.view(torch.int16) if kind == 1 else out),
        part,
        split_counters(x.device, math.prod(tiles)) if fixup else None,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        SPLIT=split,
        OUT_KIND=kind,
        W_F32=w_fp32,
        **cfg,
        **pdl_args(x.device),
    )
    if split > 1 and not fixup:
        splitk_reduce(part, out)
    return out
