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
