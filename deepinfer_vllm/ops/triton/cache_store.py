"""Quantise-and-store of cache records, and the ratio-2 compressor's gated pooling.

``store_records`` writes rows into vLLM-paged caches in one pass (addressing the pages from
the block table itself), bit-exact with ``ops.paged_records.store_paged`` (``ops.quant`` encoders);
``pool_pairs`` takes each token's ratio-2 pair from the step's rows or the compressor ring
and is ``ops.compressor.pool_ratio2`` followed by the model's rounding to the model dtype,
bit-exact with it on the same device; ``ring_write`` then keeps the ring (references:
``ops.compressor.step_pair_rows`` and ``ring_write_reference``).

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
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args

__all__ = ["store_records", "pool_pairs", "ring_write"]

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
    table_ptr,
    req_ptr,
    entry_ptr,
    keep_ptr,
    cache_ptr,
    n,
    x_row_stride,
    table_stride,
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
    HAS_KEEP: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    live = r < n
    if HAS_KEEP:
        live = live & (tl.load(keep_ptr + r, mask=live, other=0) != 0)
    entry = tl.load(entry_ptr + r, mask=live, other=0).to(tl.int64)
    req = tl.load(req_ptr + r, mask=live, other=0).to(tl.int64)
    col = entry // N  # entry e: page column e // N, record e % N (paged_records.store_paged)
    off = entry - col * N
    blk = tl.load(table_ptr + req * table_stride + col, mask=live, other=0).to(tl.int64)
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
    cache: torch.Tensor,
    fmt: str | RecordFormat,
    block_table: torch.Tensor,
    req: torch.Tensor,
    entry: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> None:
    """Quantise ``x [n, D]`` (bf16/fp32) to ``fmt`` and store row i as entry ``entry[i]`` of
    request row ``req[i]`` of ``block_table``, unless ``keep[i]`` is False.

    ``cache`` is a layer's uint8 view ``[num_blocks, (1,) N, R]`` (block stride may exceed
    ``N * R``); entry ``e`` is record ``e % N`` of the page in column ``e // N``. The stored
    places must be distinct and inside the table and cache (not checked: that would sync).
    Same bytes as ``paged_records.store_paged`` for every finite or infinite input (blocks
    holding NaN are outside the contract, see ops/quant.py).
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
    for label, t in (("req", req), ("entry", entry)):
        if t.shape != (n,):
            raise ValueError(f"{label} must be [{n}], got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{label} must be int32/int64, got {t.dtype}")
    if keep is not None and (keep.shape != (n,) or keep.dtype != torch.bool):
        raise ValueError(f"keep must be bool [{n}], got {tuple(keep.shape)} {keep.dtype}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        got = f"{tuple(block_table.shape)} {block_table.dtype}"
        raise ValueError(f"block_table must be int32/int64 [R, W], got {got}")
    devices = {t.device for t in (cache, x, req, entry, block_table) + (() if keep is None else (keep,))}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(str(d) for d in devices)}")
    vb, sb = quant.record_bytes(name, dim)  # validates dim against the block
    _, num_states, block_stride = _page_geometry(cache, vb + sb)
    if n == 0:
        return
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    blk = _BLOCKS[name]
    nb = dim // blk
    nbp = triton.next_power_of_2(nb)
    rows = max(1, min(triton.next_power_of_2(n), 2048 // (nbp * blk)))
    xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
    grid = (triton.cdiv(n, rows),)
    _store_records_kernel[grid](
        xin,
        block_table,
        req.contiguous(),
        entry.contiguous(),
        xin if keep is None else keep.contiguous().view(torch.uint8),
        cache,
        n,
        x.stride(0),
        block_table.stride(0),
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
        HAS_KEEP=keep is not None,
        num_warps=4,
        **_LAUNCH,
        **pdl_args(xin.device),
    )


# ---------------------------------------------------------------------------
# pool_pairs
# ---------------------------------------------------------------------------


@triton.jit
def _pool_pairs_kernel(
    u_ptr,
    g_ptr,
    ring_ptr,
    table_ptr,
    req_ptr,
    pos_ptr,
    ctx_ptr,
    out_ptr,
    entry_ptr,
    keep_ptr,
    n,
    u_stride,
    g_stride,
    table_stride,
    ring_block_stride,
    ring_row_stride,
    CAP: tl.constexpr,  # ring rows per request
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    ACC_FP64: tl.constexpr,  # fp64 accumulation, fp32 output; else fp32 -> bf16 bits
    PDL: tl.constexpr,
):
    """Token ``r`` at position ``p``: pool the pair ``(p - 1, p)``; the first row is the step's row
    ``r - 1`` when position ``p - 1`` is in this step, else the ring's row ``(p - 1) % CAP``."""
    grid_wait(PDL)
    pid = tl.program_id(0)
    r = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live = r < n
    p = tl.load(pos_ptr + r, mask=live, other=0).to(tl.int64)
    q = tl.load(req_ptr + r, mask=live, other=0).to(tl.int64)
    in_step = (p - 1) >= tl.load(ctx_ptr + q, mask=live, other=0).to(tl.int64)
    blk = tl.load(table_ptr + q * table_stride, mask=live, other=0).to(tl.int64)
    back = tl.maximum(p - 1, 0) % CAP
    c = tl.arange(0, BLOCK_D)
    cm = (c < D)[None, :]
    m_step = (live & in_step)[:, None] & cm
    m_ring = (live & (in_step == 0))[:, None] & cm
    mask = live[:, None] & cm
    u_row = u_ptr + r[:, None] * u_stride + c[None, :]
    g_row = g_ptr + r[:, None] * g_stride + c[None, :]
    f_ring = ring_ptr + (blk * ring_block_stride + back * ring_row_stride)[:, None] + c[None, :]
    u_prev = tl.load(u_row - u_stride, mask=m_step, other=0.0)
    g_prev = tl.load(g_row - g_stride, mask=m_step, other=0.0)
    u0 = tl.where(m_step, u_prev, tl.load(f_ring, mask=m_ring, other=0.0))
    g0 = tl.where(m_step, g_prev, tl.load(f_ring + D, mask=m_ring, other=0.0))
    u1 = tl.load(u_row, mask=mask, other=0.0)
    g1 = tl.load(g_row, mask=mask, other=0.0)
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
    tl.store(entry_ptr + r, p // 2, mask=live)
    tl.store(keep_ptr + r, (p % 2 == 1).to(tl.uint8), mask=live)


@triton.jit
def _ring_write_kernel(
    u_ptr,
    g_ptr,
    ring_ptr,
    table_ptr,
    req_ptr,
    pos_ptr,
    seq_ptr,
    n,
    u_stride,
    g_stride,
    table_stride,
    ring_block_stride,
    ring_row_stride,
    CAP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Row ``r`` into its request's ring at ``pos % CAP`` when it is among the request's last
    ``CAP`` positions (the older rows of a long chunk would collide)."""
    grid_wait(PDL)
    r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    live = r < n
    p = tl.load(pos_ptr + r, mask=live, other=0).to(tl.int64)
    q = tl.load(req_ptr + r, mask=live, other=0).to(tl.int64)
    live = live & (p >= tl.load(seq_ptr + q, mask=live, other=0).to(tl.int64) - CAP)
    blk = tl.load(table_ptr + q * table_stride, mask=live, other=0).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mask = live[:, None] & (c < D)[None, :]
    dst = ring_ptr + (blk * ring_block_stride + (p % CAP) * ring_row_stride)[:, None] + c[None, :]
    tl.store(dst, tl.load(u_ptr + r[:, None] * u_stride + c[None, :], mask=mask), mask=mask)
    tl.store(dst + D, tl.load(g_ptr + r[:, None] * g_stride + c[None, :], mask=mask), mask=mask)


def _check_step(u, g, ring, block_table, req, pos, lens) -> None:
    if u.dim() != 2 or u.shape != g.shape or u.dtype != torch.float32 or g.dtype != torch.float32:
        got = f"{tuple(u.shape)} {u.dtype}, {tuple(g.shape)} {g.dtype}"
        raise ValueError(f"u and g must be fp32 [T, D], got {got}")
    if ring.dim() != 3 or ring.dtype != torch.float32 or ring.shape[2] != 2 * u.shape[1]:
        got = f"{tuple(ring.shape)} {ring.dtype}"
        raise ValueError(f"ring must be fp32 [num_blocks, capacity, {2 * u.shape[1]}] ([u | g]), got {got}")
    n = u.shape[0]
    for label, t in (("req", req), ("pos", pos)):
        if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{label} must be int32/int64 [{n}], got {tuple(t.shape)} {t.dtype}")
    if block_table.dim() != 2 or lens.dim() != 1:
        got = f"{tuple(block_table.shape)}, {tuple(lens.shape)}"
        raise ValueError(f"block_table [R, W] and lengths [R] expected, got {got}")
    if u.stride(1) != 1 or g.stride(1) != 1 or ring.stride(2) != 1:
        strides = f"{u.stride()}, {g.stride()}, {ring.stride()}"
        raise ValueError(f"u, g and ring rows must be contiguous, got strides {strides}")
    devices = {t.device for t in (u, g, ring, block_table, req, pos, lens)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(str(d) for d in devices)}")


def pool_pairs(
    u: torch.Tensor,
    g: torch.Tensor,
    ring: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    context_lens: torch.Tensor,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated pooling of every token's ratio-2 pair: ``(latents [T, D], entry [T], closes [T])``.

    ``u``, ``g [T, D]`` are the step's fp32 compressor rows (token ``t`` at position ``pos[t]`` of
    request row ``req[t]``, a request's tokens consecutive; any row strides); ``ring [num_blocks,
    capacity, 2 * D]`` holds earlier steps' rows laid out ``[u | g]``, request ``r``'s in block
    ``block_table[r, 0]`` at ``position % capacity``. The pair's first row is the step's previous
    row when position ``pos - 1 >= context_lens[req]``, else the ring's. Latents are
    ``pool_ratio2`` of the pair rounded to ``out_dtype``: bf16 (fp32 arithmetic) or fp32 (fp64 arithmetic, as the reference does for fp32
    models); ``entry = pos // 2``; ``closes``: odd positions (the pairs that complete). Every
    token's pair is pooled, so sizes never depend on device values. Run before ``ring_write``.
    """
    _check_step(u, g, ring, block_table, req, pos, context_lens)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be bf16 (fp32 pooling) or fp32 (fp64 pooling), got {out_dtype}")
    n, d = u.shape
    dev = u.device
    out = torch.empty(n, d, dtype=out_dtype, device=dev)
    entry = torch.empty(n, dtype=torch.int64, device=dev)
    closes = torch.empty(n, dtype=torch.bool, device=dev)
    if n == 0:
        return out, entry, closes
    block_d = triton.next_power_of_2(d)
    rows_per = max(1, min(triton.next_power_of_2(n), 2048 // block_d))
    fp64 = out_dtype == torch.float32
    _pool_pairs_kernel[(triton.cdiv(n, rows_per),)](
        u,
        g,
        ring,
        block_table,
        req,
        pos,
        context_lens,
        out if fp64 else out.view(torch.int16),
        entry,
        closes.view(torch.uint8),
        n,
        u.stride(0),
        g.stride(0),
        block_table.stride(0),
        ring.stride(0),
        ring.stride(1),
        CAP=ring.shape[1],
        D=d,
        BLOCK_D=block_d,
        ROWS=rows_per,
        ACC_FP64=fp64,
        num_warps=4,
        **_LAUNCH,
        **pdl_args(u.device),
    )
    return out, entry, closes


def ring_write(
    ring: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
) -> None:
    """Store each request's rows ``[u | g]`` of its last ``capacity`` positions (``pos >=
    seq_lens[req] - capacity``) in its ring, at ``pos % capacity`` (``pool_pairs``' addressing)."""
    _check_step(u, g, ring, block_table, req, pos, seq_lens)
    n, d = u.shape
    if n == 0:
        return
    block_d = triton.next_power_of_2(d)
    rows_per = max(1, min(triton.next_power_of_2(n), 2048 // block_d))
    _ring_write_kernel[(triton.cdiv(n, rows_per),)](
        u,
        g,
        ring,
        block_table,
        req,
        pos,
        seq_lens,
        n,
        u.stride(0),
        g.stride(0),
        block_table.stride(0),
        ring.stride(0),
        ring.stride(1),
        CAP=ring.shape[1],
        D=d,
        BLOCK_D=block_d,
        ROWS=rows_per,
        num_warps=4,
        **pdl_args(u.device),
    )
