"""Quantise-and-store of cache records, and the ratio-2 compressor's gated pooling.

``store_records`` writes rows into vLLM-paged caches in one pass, bit-exact with
``ops.paged_records.write_records_at_slots`` (``ops.quant`` encoders);
``pool_pairs`` is ``ops.compressor.pool_ratio2`` followed by the model's rounding
to the model dtype, bit-exact with it on the same device.

How bit-exactness is kept (see ``ops/quant.py`` for the arithmetic itself):
  * every encoder is integer arithmetic on fp32 bit patterns or exact comparisons;
  * the few float operations that round (``amax / qmax``, ``amax * fp32(1/6)``,
    ``1 / s``, ``x * (1/s)`` and the pooling formula) are single IEEE operations:
    ``tl.math.div_rn`` (Triton's ``/`` is approximate) and libdevice ``*_rn``
    functions, and kernels launch with ``enable_fp_fusion=False`` so nothing is
    contracted into an FMA;
  * kernels launch with ``enable_reflect_ftz=False``: by default Triton's libdevice
    flushes subnormals (exp of a very negative gate, a subnormal input times 2**126)
    while torch's CUDA build does not;
  * bf16 is widened and narrowed with bit arithmetic, never with a cast, so the
    CPU interpreter (whose fp32->bf16 cast truncates) gives the same bytes.
Under ``TRITON_INTERPRET=1`` libdevice is unavailable; the helpers then use plain
numpy-backed operations (single IEEE operations too) and ``tl.exp`` (numpy's exp,
which differs from torch's CPU exp in the last ulp: tests patch the reference).
"""

from __future__ import annotations

import os
import struct

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.paged_records import RecordFormat

__all__ = ["store_records", "pool_pairs"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH = dict(enable_fp_fusion=False, enable_reflect_ftz=False)

_FMT_CODE = {"mxfp8": 0, "nvfp4": 1, "mxfp4": 2}


def _f32_bits(v: float) -> int:
    """The int32 bit pattern of ``fp32(v)`` (round to nearest), for constants built from bits."""
    return struct.unpack("<i", struct.pack("<f", v))[0]


if _INTERPRET:

    @triton.jit
    def _mul(a, b):
        return a * b

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _div(a, b):
        return a / b  # numpy: correctly rounded

    @triton.jit
    def _exp(a):
        return tl.exp(a)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _mul(a, b):
        return libdevice.mul_rn(a, b)

    @triton.jit
    def _add(a, b):
        return libdevice.add_rn(a, b)

    @triton.jit
    def _div(a, b):
        return libdevice.div_rn(a, b)

    @triton.jit
    def _exp(a):
        return libdevice.exp(a)


# ---------------------------------------------------------------------------
# Bit-level encoders (mirror ops/quant.py)
# ---------------------------------------------------------------------------


@triton.jit
def _f32_const(bits: tl.constexpr):
    return tl.full([], bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_magnitude(a):
    """fp32 ``a`` in [0, 448] -> e4m3 code 0..126 (nearest, ties to even)."""
    bits = a.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) >> 20) - ((127 - 7) << 3)
    # Below 2**-6 the code is a in units of 2**-9 (a * 512 is exact); adding
    # and removing 2**23 rounds it to an integer, half to even.
    y = a * 512.0
    sub = ((y + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(a < 0.015625, sub, normal)


@triton.jit
def _e4m3_decode(code):
    """Positive e4m3 code (int32) -> exact fp32."""
    normal = ((code << 20) + ((127 - 7) << 23)).to(tl.float32, bitcast=True)
    sub = (code & 7).to(tl.float32) * 0.001953125
    return tl.where((code >> 3) == 0, sub, normal)


@triton.jit
def _e2m1(y):
    """fp32 -> e2m1 code 0..15: midpoints counted, ties to the even code, sign copied."""
    a = tl.abs(y)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


@triton.jit
def _pow2_exponent(a, FLOOR_BITS: tl.constexpr, QMAX: tl.constexpr):
    """``clamp(ceil_log2(max(a, floor) / qmax), -127, 127)``; the ratio is normal or inf."""
    a = tl.maximum(a, _f32_const(FLOOR_BITS))
    ratio = tl.math.div_rn(a, tl.full([], QMAX, tl.float32))
    rb = ratio.to(tl.int32, bitcast=True)
    e = (rb >> 23) - 127 + ((rb & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _pow2(k):
    """Exact fp32 ``2**k`` for integer k in [-127, 127] (2**-127 is subnormal)."""
    normal = (k + 127) << 23
    sub = 1 << tl.minimum(tl.maximum(k + 149, 0), 22)
    return tl.where(k >= -126, normal, sub).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------
# store_records
# ---------------------------------------------------------------------------


@triton.jit
def _store_records_kernel(
    x_ptr,
    slot_ptr,
    cache_ptr,
    n,
    x_row_stride,
    block_stride,
    N: tl.constexpr,  # records per page
    VB: tl.constexpr,  # value bytes per record
    SB: tl.constexpr,  # scale bytes per record
    FMT: tl.constexpr,  # 0 mxfp8, 1 nvfp4, 2 mxfp4
    X_BF16: tl.constexpr,  # x is bf16 passed as int16 bits
    BLK: tl.constexpr,  # values per scale
    NB: tl.constexpr,  # scale blocks per record
    NBP: tl.constexpr,  # NB rounded up to a power of two
    ROWS: tl.constexpr,  # records per program
    FLOOR_BITS: tl.constexpr,  # fp32 bits of the amax floor
    QMAX: tl.constexpr,  # largest element magnitude (MX formats)
    INV6_BITS: tl.constexpr,  # fp32 bits of 1/6 (NVFP4)
):
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slot_ptr + r, mask=r < n, other=-1).to(tl.int64)
    live = slot >= 0
    blk = tl.where(live, slot, 0) // N
    off = tl.where(live, slot, 0) - blk * N
    page = cache_ptr + blk * block_stride  # [ROWS]

    b = tl.arange(0, NBP)
    j = tl.arange(0, BLK)
    col = b[:, None] * BLK + j[None, :]  # [NBP, BLK]
    bmask = (live[:, None] & (b < NB)[None, :])  # [ROWS, NBP]
    m3 = bmask[:, :, None] & (j >= 0)[None, None, :]  # [ROWS, NBP, BLK]
    xoff = r.to(tl.int64)[:, None, None] * x_row_stride + col[None, :, :]
    if X_BF16:
        h = tl.load(x_ptr + xoff, mask=m3, other=0)
        x = ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + xoff, mask=m3, other=0.0)
    amax = tl.max(tl.abs(x), axis=2)  # [ROWS, NBP]

    if FMT == 1:
        # NVFP4: e4m3 scale of amax * fp32(1/6), values times the rounded 1/s.
        a = tl.maximum(amax, _f32_const(FLOOR_BITS))
        req = tl.minimum(_mul(a, _f32_const(INV6_BITS)), 448.0)
        sbyte = _e4m3_magnitude(req)
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), _e4m3_decode(sbyte))
    else:
        e = _pow2_exponent(amax, FLOOR_BITS, QMAX)
        sbyte = e + 127
        inv = _pow2(-e)
    y = _mul(x, inv[:, :, None])

    vbase = page + off * VB  # [ROWS]
    if FMT == 0:
        sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
        code = _e4m3_magnitude(tl.minimum(tl.abs(y), 448.0)) | (sign << 7)
        vptr = vbase[:, None, None] + col[None, :, :]
        tl.store(vptr, code.to(tl.uint8), mask=m3)
    else:
        HALF: tl.constexpr = BLK // 2
        code = _e2m1(y)
        lo, hi = tl.split(tl.reshape(code, [ROWS, NBP, HALF, 2]))
        jh = tl.arange(0, HALF)
        vcol = b[:, None] * HALF + jh[None, :]
        vptr = vbase[:, None, None] + vcol[None, :, :]
        m3h = bmask[:, :, None] & (jh >= 0)[None, None, :]
        tl.store(vptr, (lo | (hi << 4)).to(tl.uint8), mask=m3h)

    sptr = page[:, None] + N * VB + off[:, None] * SB + b[None, :]
    tl.store(sptr, sbyte.to(tl.uint8), mask=bmask)


_FLOORS = {
    "mxfp8": quant.MXFP8_AMAX_FLOOR,
    "nvfp4": quant.NVFP4_AMAX_FLOOR,
    "mxfp4": quant.MXFP4_AMAX_FLOOR,
}
_BLOCKS = {"mxfp8": quant.MX_BLOCK, "nvfp4": quant.NV_BLOCK, "mxfp4": quant.MX_BLOCK}


def _page_geometry(cache: torch.Tensor, record: int) -> tuple[int, int, int]:
    """``(num_blocks, records per page, block stride)`` of a cache layer view, validated."""
    if cache.dtype != torch.uint8:
        raise TypeError(f"cache must be a uint8 view, got {cache.dtype}")
    if cache.dim() == 4:
        if cache.shape[1] != 1:
            raise ValueError(f"4-d cache must be [num_blocks, 1, N, R], got {tuple(cache.shape)}")
        cache = cache.squeeze(1)
    if cache.dim() != 3:
        raise ValueError(f"cache must be [num_blocks, (1,) N, R], got {tuple(cache.shape)}")
    num_blocks, num_states, rec = cache.shape
    if rec != record:
        raise ValueError(f"cache records are {rec} bytes, the format needs {record}")
    if cache.stride(2) != 1 or (num_states > 1 and cache.stride(1) != record):
        raise ValueError(f"cache pages must be contiguous inside, got strides {cache.stride()}")
    if num_blocks > 1 and cache.stride(0) < num_states * record:
        page = num_states * record
        raise ValueError(f"block stride {cache.stride(0)} is smaller than a page ({page} bytes)")
    return num_blocks, num_states, cache.stride(0)


def store_records(
    cache: torch.Tensor, fmt: str | RecordFormat, slots: torch.Tensor, x: torch.Tensor
) -> None:
    """Quantise ``x [n, D]`` (bf16/fp32) to ``fmt`` and store row i at ``slots[i]``.

    ``cache`` is a layer's uint8 view ``[num_blocks, (1,) N, R]`` (block stride may
    exceed ``N * R``); ``slot = block * N + offset``, slots < 0 are skipped; slots
    must be distinct and below ``num_blocks * N`` (not checked: that would sync).
    Same bytes as ``paged_records.write_records_at_slots`` for every finite or
    infinite input (blocks holding NaN are outside the contract, see ops/quant.py).
    """
    name = fmt.fmt if isinstance(fmt, RecordFormat) else fmt
    if name not in _FMT_CODE:
        raise ValueError(f"unknown format {name!r}; expected one of {sorted(_FMT_CODE)}")
    if x.dim() != 2:
        raise ValueError(f"x must be [n, D], got {tuple(x.shape)}")
    n, dim = x.shape
    if isinstance(fmt, RecordFormat) and fmt.dim != dim:
        raise ValueError(f"x has {dim} dims, the record format {dim} != {fmt.dim}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bf16 or fp32, got {x.dtype}")
    if n and x.stride(1) != 1:
        raise ValueError(f"x rows must be contiguous, got strides {x.stride()}")
    if slots.dim() != 1 or slots.shape[0] != n:
        raise ValueError(f"slots must be [{n}], got {tuple(slots.shape)}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots must be int32/int64, got {slots.dtype}")
    if not (cache.device == x.device == slots.device):
        raise ValueError(f"devices differ: cache {cache.device}, x {x.device}, slots {slots.device}")
    vb, sb = quant.record_bytes(name, dim)  # validates dim against the block
    _, num_states, block_stride = _page_geometry(cache, vb + sb)
    if n == 0:
        return
    blk = _BLOCKS[name]
    nb = dim // blk
    nbp = triton.next_power_of_2(nb)
    rows = max(1, min(triton.next_power_of_2(n), 2048 // (nbp * blk)))
    xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    grid = (triton.cdiv(n, rows),)
    _store_records_kernel[grid](
        xin,
        slots.contiguous(),
        cache,
        n,
        x.stride(0),
        block_stride,
        N=num_states,
        VB=vb,
        SB=sb,
        FMT=_FMT_CODE[name],
        X_BF16=x.dtype == torch.bfloat16,
        BLK=blk,
        NB=nb,
        NBP=nbp,
        ROWS=rows,
        FLOOR_BITS=_f32_bits(_FLOORS[name]),
        QMAX=quant.E4M3_MAX if name == "mxfp8" else quant.E2M1_MAX,
        INV6_BITS=_f32_bits(1.0 / quant.E2M1_MAX),
        num_warps=4,
        **_LAUNCH,
    )


# ---------------------------------------------------------------------------
# pool_pairs
# ---------------------------------------------------------------------------


@triton.jit
def _pool_pairs_kernel(
    first_ptr,
    second_ptr,
    out_ptr,
    n,
    first_stride,
    second_stride,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    ACC_FP64: tl.constexpr,  # fp64 accumulation, fp32 output; else fp32 -> bf16 bits
):
    pid = tl.program_id(0)
    r = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mask = (r < n)[:, None] & (c < D)[None, :]
    f = first_ptr + r[:, None] * first_stride + c[None, :]
    s = second_ptr + r[:, None] * second_stride + c[None, :]
    u0 = tl.load(f, mask=mask, other=0.0)
    g0 = tl.load(f + D, mask=mask, other=0.0)
    u1 = tl.load(s, mask=mask, other=0.0)
    g1 = tl.load(s + D, mask=mask, other=0.0)
    if ACC_FP64:
        u0 = u0.to(tl.float64)
        g0 = g0.to(tl.float64)
        u1 = u1.to(tl.float64)
        g1 = g1.to(tl.float64)
    # pool_ratio2, op for op: m = max(g0, g1); e_i = exp(g_i - m);
    # v = (e0 * u0 + e1 * u1) / (e0 + e1), each op rounded once.
    m = tl.maximum(g0, g1)
    e0 = _exp(g0 - m)
    e1 = _exp(g1 - m)
    v = _div(_add(_mul(e0, u0), _mul(e1, u1)), _add(e0, e1))
    o = out_ptr + r[:, None] * D + c[None, :]
    if ACC_FP64:
        tl.store(o, v.to(tl.float32), mask=mask)
    else:
        # fp32 -> bf16, nearest even, from the bits (finite or inf input).
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(o, rounded.to(tl.int16), mask=mask)


def pool_pairs(first: torch.Tensor, second: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Gated pooling of ratio-2 pairs: ``pool_ratio2(pair_u, pair_g, acc_dtype(out_dtype)).to(out_dtype)``.

    ``first`` / ``second`` are the pairs' fp32 rows ``[n, 2 * D]`` laid out ``[u | g]``
    (the model's step rows or ring rows; any row stride). Returns ``[n, D]`` in
    ``out_dtype``: bf16 (fp32 arithmetic) or fp32 (fp64 arithmetic, as the
    reference does for fp32 models).
    """
    if first.dim() != 2 or first.shape != second.shape:
        shapes = f"{tuple(first.shape)}, {tuple(second.shape)}"
        raise ValueError(f"first/second must both be [n, 2*D], got {shapes}")
    if first.dtype != torch.float32 or second.dtype != torch.float32:
        raise TypeError(f"pair rows must be fp32, got {first.dtype}, {second.dtype}")
    if first.shape[1] % 2:
        raise ValueError(f"rows must hold u then g (even width), got {first.shape[1]}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bf16 (fp32 pooling) or fp32 (fp64 pooling), got {out_dtype}")
    if first.device != second.device:
        raise ValueError(f"devices differ: {first.device}, {second.device}")
    if first.stride(1) != 1 or second.stride(1) != 1:
        raise ValueError(f"pair rows must be contiguous, got strides {first.stride()}, {second.stride()}")
    n, d = first.shape[0], first.shape[1] // 2
    out = torch.empty(n, d, dtype=out_dtype, device=first.device)
    if n == 0:
        return out
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(triton.next_power_of_2(n), 2048 // block_d))
    fp64 = out_dtype == torch.float32
    _pool_pairs_kernel[(triton.cdiv(n, rows),)](
        first,
        second,
        out if fp64 else out.view(torch.int16),
        n,
        first.stride(0),
        second.stride(0),
        D=d,
        BLOCK_D=block_d,
        ROWS=rows,
        ACC_FP64=fp64,
        num_warps=4,
        **_LAUNCH,
    )
    return out
