"""Bit-exact PyTorch reference for every number format of DeepSeek-V4.1-Flash.

The formats: docs/architecture.md, "Number formats"; where each is used: docs/design-notes.md,
"KV cache layout". Everything here is element-wise or block-wise torch
code (no Python loops over elements), works for any leading shape and on any
device, and never imports vLLM.

Element formats
  * E4M3 (OCP "e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448,
    no infinity, 0x7F/0xFF are NaN. Encoding is round-to-nearest-even and
    saturates to +-448 (infinities included).
  * UE8M0: one unsigned exponent byte ``b`` meaning ``2**(b - 127)``; 255 is NaN.
    Every encoder here clamps the exponent to [-127, 127] so 255 is never written.
  * E2M1 (FP4): nibble = sign bit (bit 3) + magnitude code 0..7 for
    {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Encoding is round-to-nearest, ties to the even
    code, saturating at +-6 (NaN and infinities saturate too). The sign nibble
    bit copies the input's sign bit, so -0.0 and negatives that round to zero
    become code 8 (-0.0), as in DeepSeek's torch reference.
    Two codes per byte, even element in the LOW nibble.

Block formats (``x`` of shape ``[..., D]``, blocks along the last dim)
  * MXFP8 (window KV, activations, Engram rows): e4m3 values, UE8M0 scale per 32.
  * NVFP4 (compressed KV): e2m1 values, e4m3 scale per 16, no global scale.
  * MXFP4 (index Q/K, routed-expert weights): e2m1 values, UE8M0 scale per 32.
  * Dense FP8 weights: e4m3 values, UE8M0 scale per 32x32 tile.

Arithmetic of the quantisers (exactly what DeepInfer's store kernel computes):
the input is upcast to fp32 (exact for bf16), the block amax and all scale
arithmetic are fp32, and the block values are multiplied in fp32 by the inverse
scale before rounding. For the power-of-two formats the inverse scale is exact.
For NVFP4 the requested scale is ``amax * fp32(1/6)`` and the values are
``x * fp32(1/s)`` - a multiply by the rounded reciprocal, not a division: for a
few inputs this lands on the other side of an e2m1 tie than ``x / s`` would
(see ``nvfp4_quantize``). Kernels that see bf16 activations compute the amax in
bf16, which is the same number.

Non-finite input: infinities saturate (and pin a UE8M0 exponent at 127). A NaN
makes its block's amax NaN here (``torch.amax`` propagates it) while GPU max
reductions may skip it, so blocks holding NaN are outside the bit-exact contract.
CPU and CUDA give identical bytes for everything else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .numerics import device_constant

__all__ = [
    "E4M3_MAX",
    "E2M1_MAX",
    "E2M1_VALUES",
    "MXFP8_AMAX_FLOOR",
    "NVFP4_AMAX_FLOOR",
    "MXFP4_AMAX_FLOOR",
    "e4m3_encode",
    "e4m3_decode",
    "ue8m0_decode",
    "ue8m0_decode_bits",
    "ue8m0_encode_exponent",
    "ceil_log2",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "dequant_fp8_block",
    "dequant_fp8_block_into",
    "quant_fp8_block",
    "dequant_fp4_rows",
    "dequant_fp4_rows_into",
    "quant_fp4_rows",
    "dequant_fp8_rows",
    "quant_fp8_rows",
    "mxfp8_quantize",
    "mxfp8_dequantize",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "mxfp8_qdq",
    "nvfp4_qdq",
    "mxfp4_qdq",
    "QuantFormat",
    "record_bytes",
    "pack_page",
    "unpack_page",
    "WINDOW_VALUE_BYTES",
    "WINDOW_SCALE_BYTES",
    "COMPRESSED_VALUE_BYTES",
    "COMPRESSED_SCALE_BYTES",
    "INDEX_VALUE_BYTES",
    "INDEX_SCALE_BYTES",
    "quantize",
    "dequantize",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0**-9

# Block amax floors (docs/architecture.md, "Number formats"): they keep every scale a finite, normal number and
# make all-zero blocks well defined.
MXFP8_AMAX_FLOOR = 1e-4
NVFP4_AMAX_FLOOR = E2M1_MAX * E4M3_MIN_SUBNORMAL  # smallest scale is 2**-9
MXFP4_AMAX_FLOOR = E2M1_MAX * 2.0**-126  # smallest scale is 2**-126

UE8M0_BIAS = 127
UE8M0_MIN_EXP = -127
UE8M0_MAX_EXP = 127

MX_BLOCK = 32
NV_BLOCK = 16

_E2M1_VALUE_LIST = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_VALUES = torch.tensor(_E2M1_VALUE_LIST, dtype=torch.float32)
# Both values of every packed byte (low nibble first): one lookup decodes a byte.
_E2M1_BYTE_PAIRS = torch.stack(
    (E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)), dim=-1
)
# Decision points between neighbouring e2m1 magnitudes; a tie at an odd index
# (0.75, 1.75, 3.5) belongs to the upper, even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)

_BYTE_DTYPES = {torch.uint8, torch.int8, torch.float8_e4m3fn}
if hasattr(torch, "float8_e8m0fnu"):
    _BYTE_DTYPES.add(torch.float8_e8m0fnu)


# ---------------------------------------------------------------------------
# Bit-level helpers
# ---------------------------------------------------------------------------


def _as_u8(t: Tensor) -> Tensor:
    """Reinterpret a one-byte storage tensor (int8 packed FP4, float8 views) as uint8."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype not in _BYTE_DTYPES:
        raise TypeError(f"expected a byte tensor (uint8/int8/float8), got {t.dtype}")
    return t.view(torch.uint8)


def _from_bits(bits: Tensor) -> Tensor:
    """int32 IEEE-754 bit patterns -> float32."""
    return bits.to(torch.int32).view(torch.float32)


def _pow2(e: Tensor) -> Tensor:
    """Exact ``2**e`` in fp32 for integer ``e`` in [-149, 127], built from bits.

    Avoids ``exp2``/``pow``, whose accuracy is a library choice, and covers the
    subnormal 2**-127 that UE8M0 byte 0 stands for.
    """
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return _from_bits(torch.where(e >= -126, normal, subnormal))


def _blocks(x: Tensor, block: int) -> Tensor:
    """View ``[..., D]`` as ``[..., D // block, block]``."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.unflatten(-1, (x.shape[-1] // block, block))


def _apply_scales(values: Tensor, scales: Tensor, block: int) -> Tensor:
    """Multiply ``[..., D]`` fp32 values by per-block fp32 scales ``[..., D // block]``."""
    v = _blocks(values, block)
    if scales.shape != v.shape[:-1]:
        raise ValueError(
            f"scale shape {tuple(scales.shape)} does not match values {tuple(values.shape)} / {block}"
        )
    return (v * scales.unsqueeze(-1)).flatten(-2)


# ---------------------------------------------------------------------------
# Element formats
# ---------------------------------------------------------------------------


def ceil_log2(x: Tensor) -> Tensor:
    """``ceil(log2(|x|))`` as int32, read exactly from the fp32 bit pattern.

    ``torch.log2`` can round a value just above a power of two down onto it, which
    would pick a scale one binade too small; the exponent/mantissa fields cannot.
    Normal numbers give ``exponent + (mantissa != 0)``; subnormals are handled
    exactly (``m * 2**-149`` -> ``-149 + ceil_log2(m)``). Zero gives -150 (below
    every fp32 magnitude), infinity 128, NaN 129. Input is upcast to fp32 first.
    """
    bits = x.float().view(torch.int32) & 0x7FFFFFFF
    exp = bits >> 23
    man = bits & 0x7FFFFF
    normal = exp - 127 + (man != 0).to(torch.int32)
    # A subnormal's mantissa integer is exact in fp32 and normal there.
    mbits = man.float().view(torch.int32)
    subnormal = (mbits >> 23) - 127 + ((mbits & 0x7FFFFF) != 0).to(torch.int32) - 149
    out = torch.where(exp == 0, subnormal, normal)
    return torch.where(bits == 0, torch.full_like(out, -150), out)


def ue8m0_decode_bits(b: Tensor) -> Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> ``2**(b - 127)`` in fp32; 255 -> NaN
    (the definition, from the exponent alone)."""
    b = _as_u8(b).to(torch.int32)
    value = _pow2(b - UE8M0_BIAS)
    return torch.where(b == 255, torch.full_like(value, float("nan")), value)


_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_TABLES: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}


def _table(name: str, values: Tensor, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values`` on ``device`` in ``dtype``, copied once per (device, dtype)."""
    key = (name, device, dtype)
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = values.to(device=device, dtype=dtype)
    return table


def _lookup(name: str, values: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``values[b]`` for every byte of ``b`` (into ``out``, in its dtype, when given)."""
    u = _as_u8(b)
    dtype = torch.float32 if out is None else out.dtype
    table = _table(name, values, u.device, dtype)
    flat = None if out is None else out.view(-1)
    return torch.index_select(table, 0, u.reshape(-1).to(torch.int32), out=flat).view(u.shape)


_UE8M0_VALUES = ue8m0_decode_bits(_BYTES)


def ue8m0_decode(b: Tensor) -> Tensor:
    """UE8M0 bytes (uint8 or float8_e8m0fnu) -> ``2**(b - 127)`` in fp32; 255 -> NaN.

    One lookup in the 256 values ``ue8m0_decode_bits`` defines (equal byte for byte;
    weight GEMMs decode scales on every call)."""
    return _lookup("ue8m0", _UE8M0_VALUES, b)


def ue8m0_encode_exponent(e: Tensor) -> Tensor:
    """Integer exponents -> UE8M0 bytes ``e + 127``, clamped to [-127, 127] (never NaN)."""
    return (e.to(torch.int32).clamp(UE8M0_MIN_EXP, UE8M0_MAX_EXP) + UE8M0_BIAS).to(torch.uint8)


def e4m3_encode(x: Tensor) -> Tensor:
    """Round to OCP E4M3 (nearest, ties to even), saturating to +-448; returns bytes.

    Implemented on fp32 bits rather than with ``.to(torch.float8_e4m3fn)`` so the
    out-of-range and NaN behaviour does not depend on the torch version or
    device; the tests check that both agree on every in-range input tried.
    NaN encodes as 0x7F (0xFF with the sign bit set).
    """
    x = x.float()
    sign = torch.signbit(x).to(torch.uint8) << 7
    a = x.abs().clamp(max=E4M3_MAX)
    # Normal range: keep 3 of the 23 mantissa bits with round-half-even, then
    # rebias the exponent from 127 to 7 (a mantissa carry bumps the exponent).
    bits = a.view(torch.int32)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) >> 20) - ((127 - 7) << 3)
    # Subnormal range (< 2**-6): the code is the value in units of 2**-9;
    # torch.round is half-to-even and a * 512 is exact. Rounding up to 8 gives
    # 0x08 = 2**-6, the smallest normal, as it should.
    subnormal = torch.round(a * 512.0).to(torch.int32)
    code = torch.where(a < 2.0**-6, subnormal, normal)
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8) | sign


def e4m3_decode_bits(b: Tensor) -> Tensor:
    """E4M3 bytes -> fp32 from the bit layout alone (the independent definition)."""
    b = _as_u8(b).to(torch.int32)
    mag = b & 0x7F
    exp = mag >> 3
    normal = _from_bits((mag << 20) + ((127 - 7) << 23))
    subnormal = (mag & 0x7).float() * E4M3_MIN_SUBNORMAL
    v = torch.where(exp == 0, subnormal, normal)
    v = torch.where(mag == 0x7F, torch.full_like(v, float("nan")), v)
    return torch.where((b & 0x80) != 0, -v, v)


_E4M3_VALUES = e4m3_decode_bits(_BYTES)


def e4m3_decode(b: Tensor, out: Tensor | None = None) -> Tensor:
    """E4M3 bytes (uint8 or float8_e4m3fn) -> fp32 (exact); 0x7F/0xFF -> NaN.

    One lookup in the 256 values ``e4m3_decode_bits`` defines, which torch's
    ``float8_e4m3fn`` cast also gives (checked byte by byte); on the CPU the
    lookup is about 5x faster than that cast (0.6 against 3 ns per byte), and
    decoding dominates reading the MXFP8 window cache and FP8 weights. ``out``
    (fp32 or fp64, ``b``'s shape) receives the values in its own dtype.
    """
    return _lookup("e4m3", _E4M3_VALUES, b, out)


def e2m1_encode(x: Tensor) -> Tensor:
    """Round to E2M1 codes 0..15 (nearest, ties to even code, saturate at +-6).

    The magnitude code counts the decision midpoints strictly below ``|x|``; a
    value exactly on a midpoint whose upper neighbour has the even code
    (0.75, 1.75, 3.5) moves up. NaN saturates like infinity. The sign bit is
    copied from ``x`` (so -0.0 -> code 8).
    """
    x = x.float()
    a = x.abs()
    a = torch.where(torch.isnan(a), torch.full_like(a, E2M1_MAX), a)
    mids = device_constant("e2m1_midpoints", _E2M1_MIDPOINTS, torch.float32, x.device)
    code = torch.bucketize(a, mids).to(torch.uint8)
    tie_up = torch.zeros_like(a, dtype=torch.bool)
    for m in _E2M1_TIES_UP:
        tie_up |= a == m
    code = code + tie_up.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """E2M1 codes (low nibble of each byte) -> fp32."""
    codes = _as_u8(codes)
    table = device_constant("e2m1_values", _E2M1_VALUE_LIST, torch.float32, codes.device)
    return table[(codes & 0xF).long()]


def pack_fp4(codes: Tensor) -> Tensor:
    """``[..., N]`` codes -> ``[..., N // 2]`` bytes; element ``2i`` in the low nibble."""
    codes = _as_u8(codes)
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of FP4 codes")
    lo = codes[..., 0::2] & 0xF
    hi = codes[..., 1::2] & 0xF
    return lo | (hi << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """``[..., M]`` packed bytes (uint8, or the checkpoint's int8) -> ``[..., 2M]`` codes."""
    packed = _as_u8(packed)
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------
# Runtime block formats
# ---------------------------------------------------------------------------


def _pow2_block_exponent(amax: Tensor, floor: float, qmax: float) -> Tensor:
    """``clamp(ceil(log2(max(amax, floor) / qmax)), -127, 127)`` with fp32 arithmetic.

    The division is a true fp32 division, as in the kernels (tensor / tensor:
    torch may turn division by a Python scalar into a multiply by its rounded
    reciprocal on CUDA). An exhaustive sweep over fp32 found that the multiply
    would only change the exponent for subnormal amax, which the floors exclude.
    """
    a = amax.clamp_min(floor)
    ratio = a / torch.full_like(a, qmax)
    return ceil_log2(ratio).clamp(UE8M0_MIN_EXP, UE8M0_MAX_EXP)


def _mx_quantize(x: Tensor, floor: float, qmax: float) -> tuple[Tensor, Tensor]:
    """Shared MX recipe: scale ``2**e`` per 32 values, returns ``(scaled values, e)``."""
    blocks = _blocks(x.float(), MX_BLOCK)
    e = _pow2_block_exponent(blocks.abs().amax(dim=-1), floor, qmax)
    # x * 2**-e is exact (barring underflow far below the element grid).
    scaled = blocks * _pow2(-e).unsqueeze(-1)
    return scaled.flatten(-2), e


def mxfp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """MXFP8: ``[..., D]`` -> e4m3 bytes ``[..., D]`` and UE8M0 bytes ``[..., D / 32]``.

    Per 32 values: ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, value
    ``e4m3(x / s)`` (never beyond 448 by construction), scale byte ``log2(s) + 127``.
    """
    scaled, e = _mx_quantize(x, MXFP8_AMAX_FLOOR, E4M3_MAX)
    return e4m3_encode(scaled), ue8m0_encode_exponent(e)


def mxfp8_dequantize(values: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """MXFP8 bytes -> ``e4m3(v) * 2**(s - 127)`` (exact in fp32), then cast to ``dtype``."""
    return _apply_scales(e4m3_decode(values), ue8m0_decode(scales), MX_BLOCK).to(dtype)


def _nvfp4_scale(amax: Tensor) -> Tensor:
    """E4M3 scale byte ``e4m3(min(max(amax, 6 * 2**-9) * fp32(1/6), 448))``.

    The multiply by the fp32 constant 1/6 is the kernel's. It gives the same byte
    as ``amax / 6`` for every bf16 amax, but not for 15 fp32 ones, e.g.
    ``1.78125 - 2**-23``: its quotient is just below the e4m3 tie 0.296875, its
    product rounds onto the tie, which goes to the even 0.3125 (0x2A, not 0x29).
    The smallest scale is exactly 2**-9.
    """
    a = amax.clamp_min(NVFP4_AMAX_FLOOR)
    requested = (a * torch.full_like(a, 1.0 / E2M1_MAX)).clamp(max=E4M3_MAX)
    return e4m3_encode(requested)


def nvfp4_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """NVFP4 (no global scale): ``[..., D]`` -> packed e2m1 ``[..., D / 2]`` and
    e4m3 scale bytes ``[..., D / 16]``.

    Values are ``e2m1(x * fp32(1 / s))``: the fp32 reciprocal of the e4m3 scale is
    rounded, so e.g. with ``s = 15 * 2**-9`` the input ``1.25 * s`` becomes
    ``1.2500001`` and rounds to 1.5 (the exact quotient 1.25 would tie to 1.0).
    This matches DeepInfer's store kernel and DeepSeek's torch reference. As ``s``
    is rounded, ``|x / s|`` may exceed 6 slightly; such values saturate to +-6.
    """
    blocks = _blocks(x.float(), NV_BLOCK)
    scale_bytes = _nvfp4_scale(blocks.abs().amax(dim=-1))
    inv_scale = torch.reciprocal(e4m3_decode(scale_bytes))
    codes = e2m1_encode(blocks * inv_scale.unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), scale_bytes


def nvfp4_dequantize(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """NVFP4 bytes -> ``e2m1(code) * e4m3(scale)`` (exact in fp32), then cast to ``dtype``."""
    values = e2m1_decode(unpack_fp4(packed))
    return _apply_scales(values, e4m3_decode(scales), NV_BLOCK).to(dtype)


def mxfp4_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """MXFP4: ``[..., D]`` -> packed e2m1 ``[..., D / 2]`` and UE8M0 bytes ``[..., D / 32]``.

    Per 32 values: ``s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6))`` (exponent
    clamped to [-127, 127]), values ``e2m1(x / s)``, scale byte ``log2(s) + 127``.
    """
    scaled, e = _mx_quantize(x, MXFP4_AMAX_FLOOR, E2M1_MAX)
    return pack_fp4(e2m1_encode(scaled)), ue8m0_encode_exponent(e)


def mxfp4_dequantize(packed: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """MXFP4 bytes -> ``e2m1(code) * 2**(s - 127)`` (exact in fp32), then cast to ``dtype``."""
    values = e2m1_decode(unpack_fp4(packed))
    return _apply_scales(values, ue8m0_decode(scales), MX_BLOCK).to(dtype)


def mxfp8_qdq(x: Tensor) -> Tensor:
    """Quantise to MXFP8 and back, returned in ``x.dtype`` (the window-KV boundary)."""
    return mxfp8_dequantize(*mxfp8_quantize(x), dtype=x.dtype)


def nvfp4_qdq(x: Tensor) -> Tensor:
    """Quantise to NVFP4 and back, returned in ``x.dtype`` (the compressed-KV boundary)."""
    return nvfp4_dequantize(*nvfp4_quantize(x), dtype=x.dtype)


def mxfp4_qdq(x: Tensor) -> Tensor:
    """Quantise to MXFP4 and back, returned in ``x.dtype`` (the index Q/K boundary)."""
    return mxfp4_dequantize(*mxfp4_quantize(x), dtype=x.dtype)


# ---------------------------------------------------------------------------
# Checkpoint weight formats
# ---------------------------------------------------------------------------


def dequant_fp8_block(
    w: Tensor, scale: Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Dense FP8 weight ``[..., R, C]`` with UE8M0 tile scales ``[..., ceil(R/b), ceil(C/b)]``.

    ``W[r, c] = e4m3(w[r, c]) * 2**(scale[r // b, c // b] - 127)``; the product is
    exact in fp32 and rounded once to ``dtype``.
    """
    values = e4m3_decode(w)
    rows, cols = values.shape[-2:]
    tiles = (-(-rows // block), -(-cols // block))
    if tuple(scale.shape[-2:]) != tiles:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not tile a {rows}x{cols} weight by {block}")
    s = ue8m0_decode(scale).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (values * s[..., :rows, :cols]).to(dtype)


def dequant_fp8_block_into(out: Tensor, w: Tensor, scale: Tensor, block: int = 32) -> Tensor:
    """``dequant_fp8_block`` written into ``out`` (fp32 or fp64, shape of ``w``), without
    materialising the expanded scales: the values of every weight GEMM, decoded when it runs.

    Every product is exact in fp32, so the result equals ``dequant_fp8_block(...).to(out.dtype)``.
    """
    rows, cols = w.shape[-2:]
    if out.shape != w.shape or out.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"out must be fp32/fp64 of shape {tuple(w.shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if rows % block or cols % block:
        return out.copy_(dequant_fp8_block(w, scale, block, torch.float32))
    tiles = (*w.shape[:-2], rows // block, block, cols // block, block)
    if tuple(scale.shape[-2:]) != (tiles[-4], tiles[-2]):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not tile a {rows}x{cols} weight by {block}")
    e4m3_decode(w, out=out)
    out.view(tiles).mul_(ue8m0_decode(scale).to(out.dtype)[..., :, None, :, None])
    return out


def quant_fp8_block(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantise a dense weight ``[..., R, C]`` to e4m3 bytes + UE8M0 tile scales.

    Per ``block x block`` tile (edge tiles are partial):
    ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``, values ``e4m3(w / s)``.
    """
    rows, cols = w.shape[-2:]
    pad_r, pad_c = (-rows) % block, (-cols) % block
    # Zero padding cannot change a tile's amax (|w| >= 0).
    padded = F.pad(w.float(), (0, pad_c, 0, pad_r))
    nr, nc = (rows + pad_r) // block, (cols + pad_c) // block
    tiles = padded.unflatten(-1, (nc, block)).unflatten(-3, (nr, block))  # [..., nr, b, nc, b]
    e = _pow2_block_exponent(tiles.abs().amax(dim=(-3, -1)), MXFP8_AMAX_FLOOR, E4M3_MAX)
    scaled = tiles * _pow2(-e)[..., :, None, :, None]
    values = e4m3_encode(scaled.flatten(-4, -3).flatten(-2))
    return values[..., :rows, :cols].contiguous(), ue8m0_encode_exponent(e)


def dequant_fp4_rows(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Routed-expert MXFP4 weight: packed ``[..., R, C/2]`` (int8 or uint8) with UE8M0
    ``[..., R, C/32]`` -> ``[..., R, C]``: ``e2m1(nibble) * 2**(scale[r, c // 32] - 127)``."""
    return mxfp4_dequantize(packed, scale, dtype)


def dequant_fp4_rows_into(out: Tensor, packed: Tensor, scale: Tensor) -> Tensor:
    """``dequant_fp4_rows`` written into ``out`` (fp32 or fp64, ``[..., R, C]``): one lookup
    of both nibbles of every byte, then one multiply by the row's per-32 scales (exact)."""
    p = _as_u8(packed)
    if out.shape[:-1] != p.shape[:-1] or out.shape[-1] != 2 * p.shape[-1]:
        raise ValueError(f"out shape {tuple(out.shape)} does not unpack {tuple(p.shape)}")
    if out.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"out must be fp32 or fp64, got {out.dtype}")
    pairs = _table("e2m1_pairs", _E2M1_BYTE_PAIRS, out.device, out.dtype)
    torch.index_select(pairs, 0, p.reshape(-1).to(torch.int32), out=out.view(-1, 2))
    out.view(*out.shape[:-1], -1, MX_BLOCK).mul_(ue8m0_decode(scale).to(out.dtype).unsqueeze(-1))
    return out


def quant_fp4_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``[..., R, C]`` to MXFP4 rows (same rule as the index format)."""
    return mxfp4_quantize(w)


def dequant_fp8_rows(w: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Engram table rows: e4m3 ``[..., R, C]`` with UE8M0 ``[..., R, C/32]`` -> ``[..., R, C]``."""
    return mxfp8_dequantize(w, scale, dtype)


def quant_fp8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``[..., R, C]`` to e4m3 with a UE8M0 scale per 1x32 (the MXFP8 rule)."""
    return mxfp8_quantize(w)


# ---------------------------------------------------------------------------
# Cache records and dispatch
# ---------------------------------------------------------------------------

QuantFormat = Literal["mxfp8", "nvfp4", "mxfp4"]

# fmt -> (bits per value, values per one-byte scale)
_RECORD_GEOMETRY: dict[str, tuple[int, int]] = {
    "mxfp8": (8, MX_BLOCK),
    "nvfp4": (4, NV_BLOCK),
    "mxfp4": (4, MX_BLOCK),
}


def _geometry(fmt: str) -> tuple[int, int]:
    try:
        return _RECORD_GEOMETRY[fmt]
    except KeyError:
        known = sorted(_RECORD_GEOMETRY)
        raise ValueError(f"unknown quant format {fmt!r}; expected one of {known}") from None


def record_bytes(fmt: QuantFormat, dim: int) -> tuple[int, int]:
    """Bytes of one cache entry of ``dim`` values: ``(value_bytes, scale_bytes)``."""
    bits, group = _geometry(fmt)
    if dim % group:
        raise ValueError(f"{fmt} needs a dim that is a multiple of {group}, got {dim}")
    return dim * bits // 8, dim // group


WINDOW_VALUE_BYTES, WINDOW_SCALE_BYTES = record_bytes("mxfp8", 512)  # 512 + 16 = 528
COMPRESSED_VALUE_BYTES, COMPRESSED_SCALE_BYTES = record_bytes("nvfp4", 512)  # 256 + 32 = 288
INDEX_VALUE_BYTES, INDEX_SCALE_BYTES = record_bytes("mxfp4", 128)  # 64 + 4 = 68


def pack_page(values: Tensor, scales: Tensor) -> Tensor:
    """Lay ``n`` records out as one page: ``[..., n, vb]`` values then ``[..., n, sb]`` scales.

    Returns ``[..., n * (vb + sb)]`` uint8 ("values region first, then scales
    region", docs/architecture.md, "Page layout"); any page padding is the caller's business.
    """
    values, scales = _as_u8(values), _as_u8(scales)
    if values.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"values {tuple(values.shape)} and scales {tuple(scales.shape)} differ in entries")
    return torch.cat((values.flatten(-2), scales.flatten(-2)), dim=-1)


def unpack_page(page: Tensor, fmt: QuantFormat, dim: int, n: int) -> tuple[Tensor, Tensor]:
    """Views of the ``n`` records in a page: ``([..., n, vb], [..., n, sb])``.

    Bytes past ``n * (vb + sb)`` (page rounding) are ignored.
    """
    page = _as_u8(page)
    vb, sb = record_bytes(fmt, dim)
    if page.shape[-1] < n * (vb + sb):
        raise ValueError(f"page of {page.shape[-1]} bytes cannot hold {n} {fmt} records of {vb + sb} bytes")
    values = page[..., : n * vb].unflatten(-1, (n, vb))
    scales = page[..., n * vb : n * (vb + sb)].unflatten(-1, (n, sb))
    return values, scales


_CODECS: dict[str, tuple[Callable[[Tensor], tuple[Tensor, Tensor]], Callable[..., Tensor]]] = {
    "mxfp8": (mxfp8_quantize, mxfp8_dequantize),
    "nvfp4": (nvfp4_quantize, nvfp4_dequantize),
    "mxfp4": (mxfp4_quantize, mxfp4_dequantize),
}


def quantize(fmt: QuantFormat, x: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise ``x [..., D]`` to ``(values, scales)`` bytes of the named cache format."""
    _geometry(fmt)
    return _CODECS[fmt][0](x)


def dequantize(
    fmt: QuantFormat, values: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Decode ``(values, scales)`` bytes of the named cache format to ``dtype``."""
    _geometry(fmt)
    return _CODECS[fmt][1](values, scales, dtype)
