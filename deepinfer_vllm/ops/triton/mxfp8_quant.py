"""MXFP8 activation quantiser, bit-exact with ``ops.quant.mxfp8_quantize``.

``x [M, K]`` (bf16 / fp32) -> e4m3 bytes ``[M, K]`` and UE8M0 bytes ``[M, K/32]``: per 32
values ``e = clamp(ceil_log2(max(amax, 1e-4) / 448), -127, 127)``, values ``e4m3(x * 2^-e)``.
The encoders are the integer / single-IEEE-operation ones of ``cache_store`` (same launch
flags), so GPU and interpreter give the reference's bytes. ``mxfp8_qdq`` writes the round
trip as bf16 instead (exact): what the GEMM wrappers multiply for ``act="mxfp8"``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.triton.cache_store import (
    _LAUNCH,
    _e4m3_decode,
    _e4m3_magnitude,
    _f32_bits,
    _mul,
    _pow2,
    _pow2_exponent,
)
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args

__all__ = ["mxfp8_quantize", "mxfp8_qdq"]


@triton.jit
def _mxfp8_quant_kernel(
    x_ptr,
    v_ptr,
    s_ptr,
    M,
    K,
    x_stride,
    v_stride,
    s_stride,
    ROWS: tl.constexpr,
    NB: tl.constexpr,  # 32-blocks per program
    X_BF16: tl.constexpr,  # x is bf16 passed as int16 bits
    FLOOR_BITS: tl.constexpr,
    QMAX: tl.constexpr,
    QDQ: tl.constexpr,  # write the round trip as bf16 bits to v_ptr (no scales), else bytes
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * NB + tl.arange(0, NB)
    j = tl.arange(0, 32)
    col = b[:, None] * 32 + j[None, :]  # [NB, 32]
    r64 = r.to(tl.int64)
    bmask = (r < M)[:, None] & (b * 32 < K)[None, :]
    m3 = bmask[:, :, None] & (j >= 0)[None, None, :]
    xoff = r64[:, None, None] * x_stride + col[None, :, :]
    if X_BF16:
        h = tl.load(x_ptr + xoff, mask=m3, other=0)
        x = ((h.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + xoff, mask=m3, other=0.0)
    amax = tl.max(tl.abs(x), axis=2)
    e = _pow2_exponent(amax, FLOOR_BITS, QMAX)
    y = _mul(x, _pow2(-e)[:, :, None])
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    mag = _e4m3_magnitude(tl.minimum(tl.abs(y), 448.0))
    vptr = v_ptr + r64[:, None, None] * v_stride + col[None, :, :]
    if QDQ:
        # e4m3(y) * 2^e is exact in fp32 and in bf16 (8 significant bits at most, e >= -22)
        val = _mul(_e4m3_decode(mag), _pow2(e)[:, :, None])
        bits = (val.to(tl.int32, bitcast=True) >> 16) | (sign << 15)
        tl.store(vptr, bits.to(tl.int16), mask=m3)
    else:
        tl.store(vptr, (mag | (sign << 7)).to(tl.uint8), mask=m3)
        tl.store(s_ptr + r64[:, None] * s_stride + b[None, :], (e + 127).to(tl.uint8), mask=bmask)


def mxfp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (bf16/fp32, rows contiguous) -> ``(values uint8 [M, K], scales uint8 [M, K/32])``,
    the bytes of ``ops.quant.mxfp8_quantize(x)``. No host synchronisation."""
    return _launch(x, qdq=False)


def mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` -> bf16 ``mxfp8_dequantize(mxfp8_quantize(x))`` (exact in bf16: e4m3 values
    times powers of two >= 2^-22), what the GEMMs multiply for ``act="mxfp8"``."""
    return _launch(x, qdq=True)


def _launch(x: torch.Tensor, qdq: bool):
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bf16 or fp32, got {x.dtype}")
    m, k = x.shape
    if k % quant.MX_BLOCK:
        raise ValueError(f"K must be a multiple of 32, got {k}")
    if m and x.stride(1) != 1:
        x = x.contiguous()
    values = torch.empty(m, k, dtype=torch.bfloat16 if qdq else torch.uint8, device=x.device)
    scales = values if qdq else torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    if m == 0 or k == 0:
        return values if qdq else (values, scales)
    nb = min(triton.next_power_of_2(k // 32), 8)
    rows = 4
    grid = (triton.cdiv(m, rows), triton.cdiv(k // 32, nb))
    _mxfp8_quant_kernel[grid](
        x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        values.view(torch.int16) if qdq else values,
        scales,
        m,
        k,
        x.stride(0),
        values.stride(0),
        scales.stride(0),
        ROWS=rows,
        NB=nb,
        X_BF16=x.dtype == torch.bfloat16,
        FLOOR_BITS=_f32_bits(quant.MXFP8_AMAX_FLOOR),
        QMAX=quant.E4M3_MAX,
        QDQ=qdq,
        num_warps=4,
        **_LAUNCH,
        **pdl_args(x.device),
    )
    return values if qdq else (values, scales)
