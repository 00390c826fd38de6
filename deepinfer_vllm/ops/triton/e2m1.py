"""E2M1 (FP4) codes -> fp16 in registers, exactly: the decode shared by the FP4 kernels.

The trick (sm89+): a code ``s e1 e0 m`` moved to ``s 0 0 e1 e0 m 0 0`` is the e4m3 bit
pattern of the code's value times 2^-6, the subnormal 0.5 included. Per 32-bit register a
few shifts and masks build four such bytes, ``cvt.rn.f16x2.e4m3x2`` widens two per
instruction, and ``mul.rn.f16x2`` applies a per-value fp16 factor ``f`` (which carries the
2^6): about 2 instructions per value. The product is exact whenever ``value * f`` is an
fp16 number (for instance ``f`` a power of two, or an e4m3 scale times 64).

Without PTX (Triton's interpreter) ``ASM=False`` computes the same numbers in plain
arithmetic, so the interpreter tests check the math of every caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["QUADS_PTX", "e2m1_pairs_f16", "e2m1_quads_f16", "e2m1_scaled"]

# e4m3 patterns of the low (``l``) and high (``h``) nibbles of the 4 bytes in register ``x``
_E4M3_OF_NIBBLES = """
shl.b32 a, x, 4;
and.b32 a, a, 0x80808080;
shl.b32 b, x, 2;
and.b32 b, b, 0x1C1C1C1C;
or.b32 l, a, b;
shr.b32 b, x, 2;
and.b32 b, b, 0x1C1C1C1C;
and.b32 h, x, 0x80808080;
or.b32 h, h, b;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
"""
_REGS = ".reg .b32 x, a, b, l, h;\n.reg .b16 l0, l1, h0, h1;\n"

# In: $4 = 4 bytes, $5 / $6 = f of bytes (0, 1) / (2, 3). Out: $0, $1 low nibbles of bytes
# (0, 1), (2, 3); $2, $3 high nibbles.
_PAIRS_PTX = tl.constexpr(
    "{\n" + _REGS + "mov.b32 x, $4;\n" + _E4M3_OF_NIBBLES + """
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $6;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $6;
}
""")

# In: $4 = two int16 words, $5 = f of both. Out: $0..$3 = code 0..3 of both words. The byte
# permute first puts each code's two bytes in one half register for the widening.
_QUADS_PTX = tl.constexpr(
    "{\n" + _REGS + "prmt.b32 x, $4, 0, 0x3120;\n" + _E4M3_OF_NIBBLES + """
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, h0;
cvt.rn.f16x2.e4m3x2 $2, l1;
cvt.rn.f16x2.e4m3x2 $3, h1;
mul.rn.f16x2 $0, $0, $5;
mul.rn.f16x2 $1, $1, $5;
mul.rn.f16x2 $2, $2, $5;
mul.rn.f16x2 $3, $3, $5;
}
""")


QUADS_PTX = _QUADS_PTX  # for Gluon kernels (``indexer_gluon``), which cannot call ``tl`` functions


@triton.jit
def e2m1_scaled(nib, sc, OUT: tl.constexpr):
    """e2m1 code (low nibble) times 2^(sc - 127), built as fp32 bits, cast to ``OUT`` (exact)."""
    n = nib.to(tl.int32)
    mag = n & 7
    ebits = (sc.to(tl.int32) - 1) << 23
    bits = tl.where(mag >= 2, (mag << 22) + ebits, tl.where(mag == 1, ebits, 0))
    bits = bits | ((n & 8) << 28)
    return bits.to(tl.float32, bitcast=True).to(OUT)


@triton.jit
def _times_f(code, f32):
    return (e2m1_scaled(code, tl.full(code.shape, 127, tl.int32), tl.float32) * f32).to(tl.float16)


@triton.jit
def e2m1_pairs_f16(packed, f, ASM: tl.constexpr):
    """Both codes of each uint8 (even element in the low nibble) times ``f`` (fp16, same
    shape) -> fp16 ``(lo, hi)``."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _PAIRS_PTX, "=r,=r,=r,=r,r,r,r", [packed, f], dtype=(tl.float16, tl.float16),
            is_pure=True, pack=4,
        )
    else:
        f32 = f.to(tl.float32) * 0.015625
        lo = _times_f(packed & 15, f32)
        hi = _times_f(packed >> 4, f32)
    return lo, hi


@triton.jit
def e2m1_quads_f16(words, f, ASM: tl.constexpr):
    """The 4 codes of each int16 word (code n = bits 4n..4n+3) times ``f`` -> 4 fp16 tensors."""
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _QUADS_PTX, "=r,=r,=r,=r,r,r", [words, f],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2,
        )
    else:
        x = words.to(tl.int32) & 0xFFFF
        f32 = f.to(tl.float32) * 0.015625
        c0 = _times_f(x & 15, f32)
        c1 = _times_f((x >> 4) & 15, f32)
        c2 = _times_f((x >> 8) & 15, f32)
        c3 = _times_f(x >> 12, f32)
    return c0, c1, c2, c3


# --------------------------------------------------------------------------- e2m1 -> e4m3
# For fp8 tensor cores the codes need not be widened at all: every e2m1 value times a power
# of two in [2^-8, 2^6] is an e4m3 number. A code's magnitude (3 bits) picks a byte of an
# 8-byte table with ``prmt`` (the table is the 8 magnitudes, already times the block's power
# of two), and its sign bit is moved onto the byte's bit 7 by a second ``prmt``.
# In: $2 = 4 record bytes (codes 0-7, code n = bits 4n..4n+3); $3 / $7 = table bytes 0-3 /
# 4-7 ($4-$6, $8-$10: the same values again, as ``pack=4`` passes them). Out: $0 = e4m3 of
# codes 0-3, $1 = codes 4-7. 9 instructions per 8 codes (the fp16 path: 18).
E4M3_LOOKUP_PTX = tl.constexpr("""{
.reg .b32 x, x4, xm, s1, m0, m1, z0, z1;
mov.b32 x, $2;
shl.b32 x4, x, 4;
and.b32 xm, x, 0x77777777;
shr.b32 s1, xm, 16;
prmt.b32 m0, $3, $7, xm;
prmt.b32 m1, $3, $7, s1;
prmt.b32 z0, x4, x, 0x5140;
prmt.b32 z1, x4, x, 0x7362;
and.b32 z0, z0, 0x80808080;
and.b32 z1, z1, 0x80808080;
or.b32 $0, z0, m0;
or.b32 $1, z1, m1;
}""")

E4M3_TABLE_SHIFTS = tl.constexpr(32)  # tables for block exponents 0 .. 31 below the key's largest


def e4m3_lookup_tables(device=None, boost: int = 6):
    """``[E4M3_TABLE_SHIFTS, 2]`` int32 on ``device``: row ``d`` holds the e4m3 bytes of the 8
    e2m1 magnitudes times ``2^(boost - d)`` (round to nearest even, so exact for ``d <= boost +
    8``), little-endian, magnitude ``m`` in byte ``m``. Built by device ops only: no host copy,
    so building it does not synchronise the stream."""
    import torch

    m = torch.arange(8, device=device)
    e, frac = (m >> 1).float(), (m & 1).float()
    mags = torch.where(e == 0, 0.5 * frac, (1 + 0.5 * frac) * torch.exp2(e - 1))
    d = torch.arange(E4M3_TABLE_SHIFTS.value, device=device).float()
    vals = mags[None, :] * torch.exp2(boost - d)[:, None]
    b = vals.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)  # all < 0x80: positive
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)
