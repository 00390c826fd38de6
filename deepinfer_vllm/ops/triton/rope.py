"""RoPE on the tail of every head in one launch (reference: ``ops.rope.apply_rope_tail``), optionally
followed in the same launch by the MXFP4 round trip of every head (``qdq="mxfp4"``: the indexer query,
reference ``ops.quant.mxfp4_qdq(apply_rope_tail(...))``).

The reference is a dozen small kernels per call (gather, slices, four products, stack,
cast, concatenation) and the attention calls it six times per layer. Here one program per
token and block of heads reads the position's cos/sin row once, rotates the GPT-J pairs of
the last ``rotary_dim`` entries in fp32, rounds once and copies the leading entries (none
``in_place``). A bf16 pair is one aligned 4-byte word, read and written as one (two 2-byte
accesses per pair measured 2-8x slower on the H200 at prefill: benchmarks/README.md).
The products may be fused into FMAs, so a rotated entry can differ from the reference in
its last fp32 bit before the rounding (``tests/gpu/test_rope.py`` states the tolerance).

The MXFP4 round trip works on the rounded rotation, per block of 32 entries of a head (the leading
entries' blocks and the rotated tail's; the tail's pairs ``(2i, 2i + 1)`` of 16 consecutive ``i`` make
one block): the encoders of ``cache_store`` (integer / single IEEE operations, launched without FMA
contraction or flush-to-zero), so the round trip is bit-exact with ``ops.quant.mxfp4_qdq`` of the same
rotated values; each ``e2m1 * 2^e`` is exact in bf16 and fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.triton.cache_store import _LAUNCH, _e2m1, _f32_bits, _mul, _pow2, _pow2_exponent
from deepinfer_vllm.ops.triton.mhc import _narrow
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args

__all__ = ["QDQ_FORMATS", "rope_tail"]

QDQ_FORMATS = (None, "mxfp4")  # round trips the fused kernel applies after the rotation
_FLOOR_BITS = _f32_bits(quant.MXFP4_AMAX_FLOOR)


@triton.jit
def _widen(v, BF16: tl.constexpr):
    """Loaded values as fp32: bf16 arrives as its int16 bits (widened on the bits: Triton's
    interpreter mishandles bf16 subnormals in casts)."""
    if BF16:
        w = ((v.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        w = v.to(tl.float32)
    return w


@triton.jit
def _bits(v, BF16: tl.constexpr):
    """fp32 ``v`` holding values of the output dtype, as stored: bf16 as its int16 bits."""
    if BF16:
        stored = (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
    else:
        stored = v
    return stored


@triton.jit
def _mxfp4_round_trip(v, e):
    """``e2m1(v * 2^-e) * 2^e`` for fp32 ``v`` and block exponents ``e`` broadcast to it (exact)."""
    code = _e2m1(_mul(v, _pow2(-e)))
    m = code & 7
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, (2 + (m & 1)).to(tl.float32) * _pow2((m >> 1) - 2))
    mag = _mul(mag, _pow2(e))
    # the sign on the bits: compiled Triton negates as 0 - x, which loses e2m1's negative zero
    return (mag.to(tl.int32, bitcast=True) | ((code >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _rope_tail_kernel(
    x_ptr,
    pos_ptr,
    cache_ptr,
    out_ptr,
    H,
    D,
    x_stride_t,
    x_stride_h,
    out_stride_t,
    out_stride_h,
    SIGN: tl.constexpr,  # +1 forward, -1 inverse rotation
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    OUT_BF16: tl.constexpr,
    FLOOR_BITS: tl.constexpr,  # fp32 bits of MXFP4's amax floor
    QDQ: tl.constexpr,  # MXFP4 round trip of every 32-entry block after the rotation
    COPY_LEAD: tl.constexpr,  # copy the leading entries unchanged (False: out is x, in place)
    PAIR32: tl.constexpr,  # bf16 with every pair 4-byte aligned in x and out: pairs as int32 words
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    i = tl.arange(0, HALF)
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + p * (2 * HALF) + i)[None, :]
    sin = tl.load(cache_ptr + p * (2 * HALF) + HALF + i)[None, :] * SIGN
    src = x_ptr + t * x_stride_t + h.to(tl.int64)[:, None] * x_stride_h
    dst = out_ptr + t * out_stride_t + h.to(tl.int64)[:, None] * out_stride_h
    nope = D - 2 * HALF
    m2 = hm[:, None] & (i >= 0)[None, :]
    if PAIR32:  # bf16: a pair is one 4-byte word (a in the low half), one load and one store per pair
        word = tl.load((src + nope).to(tl.pointer_type(tl.int32)) + i[None, :], mask=m2, other=0)
        a = (word << 16).to(tl.float32, bitcast=True)
        b = (word & -65536).to(tl.float32, bitcast=True)
    else:
        a = _widen(tl.load(src + nope + 2 * i[None, :], mask=m2, other=0), OUT_BF16)
        b = _widen(tl.load(src + nope + 2 * i[None, :] + 1, mask=m2, other=0), OUT_BF16)
    ra = _narrow(a * cos - b * sin, OUT_BF16)
    rb = _narrow(a * sin + b * cos, OUT_BF16)
    if QDQ:
        # the tail's blocks: pairs 16j .. 16j + 15 (entries 32j .. 32j + 31 of the tail)
        NBR: tl.constexpr = HALF // 16
        ra3 = tl.reshape(ra, [BH, NBR, 16])
        rb3 = tl.reshape(rb, [BH, NBR, 16])
        amax = tl.maximum(tl.max(tl.abs(ra3), axis=2), tl.max(tl.abs(rb3), axis=2))
        e_tail = _pow2_exponent(amax, FLOOR_BITS, 6.0)[:, :, None]
        ra = tl.reshape(_mxfp4_round_trip(ra3, e_tail), [BH, HALF])
        rb = tl.reshape(_mxfp4_round_trip(rb3, e_tail), [BH, HALF])
    if PAIR32:
        pair = ((ra.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (rb.to(tl.int32, bitcast=True) & -65536)
        tl.store((dst + nope).to(tl.pointer_type(tl.int32)) + i[None, :], pair, mask=m2)
    else:
        tl.store(dst + nope + 2 * i[None, :], _bits(ra, OUT_BF16), mask=m2)
        tl.store(dst + nope + 2 * i[None, :] + 1, _bits(rb, OUT_BF16), mask=m2)
    if QDQ:
        c32 = tl.arange(0, 32)
        for c0 in range(0, nope, 32):
            cm = hm[:, None] & (c0 + c32 >= 0)[None, :]
            v = _widen(tl.load(src + c0 + c32[None, :], mask=cm, other=0), OUT_BF16)
            e_lead = _pow2_exponent(tl.max(tl.abs(v), axis=1), FLOOR_BITS, 6.0)[:, None]
            tl.store(dst + c0 + c32[None, :], _bits(_mxfp4_round_trip(v, e_lead), OUT_BF16), mask=cm)
    elif COPY_LEAD:
        c = tl.arange(0, BD)
        for c0 in range(0, nope, BD):
            cm = hm[:, None] & (c0 + c < nope)[None, :]
            tl.store(dst + c0 + c[None, :], tl.load(src + c0 + c[None, :], mask=cm), mask=cm)


def _words_aligned(x3: torch.Tensor, out: torch.Tensor, nope: int) -> bool:
    """Whether every rotated pair of ``x3`` and ``out`` ([T, H, D], 2-byte entries) starts 4-byte aligned."""
    even = all(v % 2 == 0 for v in (*x3.stride()[:2], *out.stride()[:2], nope))
    return even and x3.data_ptr() % 4 == 0 and out.data_ptr() % 4 == 0


def rope_tail(
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    inverse: bool = False,
    qdq: str | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """``apply_rope_tail`` for ``x [T, D]`` or ``[T, H, D]`` with one position per token
    (``positions [T]``); a new tensor in ``x.dtype``, or with ``in_place`` written into ``x`` (then
    only the rotated tail moves unless ``qdq`` rewrites every entry). ``qdq="mxfp4"``: then the
    MXFP4 round trip of every head (``quant.mxfp4_qdq``; D and the rotated tail multiples of 32)."""
    if qdq not in QDQ_FORMATS:
        raise ValueError(f"qdq must be one of {QDQ_FORMATS}, got {qdq!r}")
    if x.dim() not in (2, 3) or positions.shape != x.shape[:1]:
        raise ValueError(
            f"x [T, D] or [T, H, D] with positions [T] expected, got {tuple(x.shape)}, "
            f"{tuple(positions.shape)}"
        )
    rotary = cache.shape[-1]
    D = x.shape[-1]
    if D < rotary or rotary & (rotary - 1) or cache.dtype != torch.float32:
        raise ValueError(f"rotary_dim {rotary} must be a power of two <= {D} with an fp32 cache")
    if qdq is not None and x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the MXFP4 round trip takes bf16 or fp32 x, got {x.dtype}")
    if qdq is not None and (D % quant.MX_BLOCK or rotary % quant.MX_BLOCK):
        raise ValueError(f"the MXFP4 round trip needs D ({D}) and rotary_dim ({rotary}) multiples of 32")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        if in_place:
            return x.copy_(rope_tail(x, positions, cache, inverse, qdq))
        x3 = x3.contiguous()
    T, H, _ = x3.shape
    out = x3 if in_place else torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        bh = min(16, triton.next_power_of_2(H))
        bf16 = x.dtype == torch.bfloat16
        _rope_tail_kernel[(T, triton.cdiv(H, bh))](
            x3.view(torch.int16) if bf16 else x3,
            positions.contiguous(),
            cache.contiguous(),
            out.view(torch.int16) if bf16 else out,
            H,
            D,
            x3.stride(0),
            x3.stride(1),
            out.stride(0),
            out.stride(1),
            SIGN=-1.0 if inverse else 1.0,
            HALF=rotary // 2,
            BH=bh,
            BD=128,
            OUT_BF16=x.dtype == torch.bfloat16,
            FLOOR_BITS=_FLOOR_BITS,
            QDQ=qdq is not None,
            COPY_LEAD=not in_place,
            PAIR32=bf16 and _words_aligned(x3, out, D - rotary),
            num_warps=4,
            **_LAUNCH,
            **pdl_args(x3.device),
        )
    return x if in_place else out.view(x.shape)
