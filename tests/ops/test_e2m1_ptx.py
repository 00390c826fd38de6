"""The shared e2m1 decode PTX of ``ops/triton/e2m1.py`` (indexer and Triton decode kernels),
run on the CPU by ``ptx_subset``: codes times an fp16 factor equal ``e2m1(code) * f / 64``
bit for bit, for every code pattern of the packed inputs."""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.quant import e2m1_decode
from deepinfer_vllm.ops.triton import e2m1, fp8_gemm_gluon, moe_gemm, moe_gemm_gluon
from tests.ops.ptx_subset import run_ptx


def _f16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF


def _factors() -> list[float]:
    # powers of two as the indexer uses them (2^(6 - r)), and e4m3 scales times 64 (decode)
    return [64.0, 32.0, 2.0 ** -8, 1.0, 0.5 * 64, 448.0 * 64 / 2, 0.125 * 64]


def test_quads_ptx():
    """Two int16 words per register (pack=2): out n = code n of both words times f."""
    g = torch.Generator().manual_seed(1)
    w0 = torch.arange(1 << 16, dtype=torch.int64)
    w1 = torch.randint(0, 1 << 16, w0.shape, generator=g, dtype=torch.int64)
    for f in _factors():
        fb = int(_f16_bits(torch.tensor(f)))
        outs = run_ptx(e2m1.QUADS_PTX.value, 4, [w0 | (w1 << 16), torch.tensor(fb | (fb << 16))])
        for n, out in enumerate(outs):
            for half, w in ((0, w0), (1, w1)):
                code = ((w >> (4 * n)) & 0xF).to(torch.uint8)
                want = _f16_bits(e2m1_decode(code).double() * f / 64)
                assert torch.equal((out >> (16 * half)) & 0xFFFF, want), (f, n, half)


def test_pairs_ptx():
    """Four bytes per register (pack=4): low / high nibbles of bytes (0, 1) and (2, 3), each
    pair with its own factor."""
    x = torch.randint(0, 1 << 32, (1 << 15,), generator=torch.Generator().manual_seed(2), dtype=torch.int64)
    x = torch.cat([x, torch.arange(1 << 16, dtype=torch.int64)])  # every pattern of bytes 0-1
    for f in _factors():
        fa = int(_f16_bits(torch.tensor(f)))
        fb = int(_f16_bits(torch.tensor(f / 2)))
        lo01, lo23, hi01, hi23 = run_ptx(e2m1._PAIRS_PTX.value, 4,
                                         [x, torch.tensor(fa | (fa << 16)), torch.tensor(fb | (fb << 16))])
        cases = ((lo01, 0, f, 0), (lo23, 16, f / 2, 0), (hi01, 0, f, 4), (hi23, 16, f / 2, 4))
        for out, shift, factor, nib in cases:
            for half in (0, 1):
                byte = (x >> (shift + 8 * half)) & 0xFF
                code = ((byte >> nib) & 0xF).to(torch.uint8)
                want = _f16_bits(e2m1_decode(code).double() * factor / 64)
                assert torch.equal((out >> (16 * half)) & 0xFFFF, want), (f, shift, nib, half)


def test_e4m3_lookup_ptx():
    """Four record bytes (eight codes) per register: every code of every byte pattern times
    2^(6 - d), d = 0..31, equals torch's round-to-nearest-even e4m3 of the exact product."""
    tables = e2m1.e4m3_lookup_tables().to(torch.int64) & 0xFFFFFFFF
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.arange(1 << 16, dtype=torch.int64),  # every pattern of bytes 0-1 ...
                   torch.arange(1 << 16, dtype=torch.int64) << 16,  # ... and of bytes 2-3
                   torch.randint(0, 1 << 32, (1 << 12,), generator=g, dtype=torch.int64)])
    for d in range(e2m1.E4M3_TABLE_SHIFTS.value):
        lo, hi = tables[d, 0].view(1), tables[d, 1].view(1)
        outs = run_ptx(e2m1.E4M3_LOOKUP_PTX.value, 2, [x, lo, lo, lo, lo, hi, hi, hi, hi])
        for n in range(8):
            code = ((x >> (4 * n)) & 0xF).to(torch.uint8)
            want = (e2m1_decode(code).double() * 2.0 ** (6 - d)).to(torch.float32)
            want = want.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
            got = (outs[n // 4] >> (8 * (n % 4))) & 0xFF
            assert torch.equal(got, want), (d, n)


def test_expert_bf16_ptx():
    """The routed-expert GEMM's decode (``moe_gemm._E2M1_BF16_PTX``): four packed bytes and their
    block's UE8M0 scale byte s -> the eight codes times 2^(s - 127) as bf16, bit for bit, for every
    pattern of bytes 0-1 (bytes 2-3 random) and every scale byte the kernel takes (0 .. 128)."""
    x = torch.randint(0, 1 << 32, (1 << 12,), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    x = torch.cat([x, torch.arange(1 << 16, dtype=torch.int64) * 0x10001])
    assert moe_gemm.MAX_SCALE_BYTE == 128
    for s in [0, 1, 2, 64, 100, 119, 121, 126, 127, 128]:
        lo01, lo23, hi01, hi23 = run_ptx(moe_gemm._E2M1_BF16_PTX.value, 4, [x, torch.tensor(s)])
        for out, first, nib in ((lo01, 0, 0), (lo23, 2, 0), (hi01, 0, 4), (hi23, 2, 4)):
            for half in (0, 1):
                code = ((x >> (8 * (first + half) + nib)) & 0xF).to(torch.uint8)
                want = (e2m1_decode(code).double() * 2.0 ** (s - 127)).to(torch.bfloat16)
                got = ((out >> (16 * half)) & 0xFFFF).to(torch.int16)
                assert torch.equal(got, want.view(torch.int16)), (s, first, nib, half)


def test_expert_pair_ptx():
    """The Gluon expert GEMM's decode (``moe_gemm_gluon.E2M1_PAIR_PTX``): one word (nibbles n0..n7, n0 the low
    nibble of byte 0) and the bf16x2 multiplier 2^(s - 1) -> eight bf16 outputs (n0, n4, n1, n5, n2, n6, n3,
    n7), each code times 2^(s - 127), bit for bit, for every pattern of bytes 0-1 and of bytes 2-3 and every
    scale byte the kernel takes (0 .. 128)."""
    pat = torch.arange(1 << 16, dtype=torch.int64)
    x = torch.cat([pat, pat << 16, pat * 0x10001])
    for s in [0, 1, 2, 64, 100, 119, 121, 126, 127, 128]:
        outs = run_ptx(moe_gemm_gluon.E2M1_PAIR_PTX, 8, [x, torch.tensor(s * 0x00800080 + 0x3F003F00)])
        for o, out in enumerate(outs):
            nibble = o // 2 + 4 * (o % 2)
            code = ((x >> (4 * nibble)) & 0xF).to(torch.uint8)
            want = (e2m1_decode(code).double() * 2.0 ** (s - 127)).to(torch.bfloat16)
            assert torch.equal((out & 0xFFFF).to(torch.int16), want.view(torch.int16)), (s, o)


def test_dense_e4m3_ptx():
    """The Gluon dense FP8 GEMM's decode (``fp8_gemm_gluon.E4M3_PTX``): one word of e4m3 bytes b0..b3 and the
    bf16x2 multiplier 2^(s - 7) -> four bf16 values, each byte's value times 2^(s - 127), bit for bit, for every
    pattern of bytes 0-1 and of bytes 2-3 and a spread of scale bytes up to ``MAX_SCALE_BYTE`` (134)."""
    pat = torch.arange(1 << 16, dtype=torch.int64)
    x = torch.cat([pat, pat << 16, pat * 0x10001])
    assert fp8_gemm_gluon.MAX_SCALE_BYTE == 134
    for s in [0, 1, 3, 10, 64, 100, 120, 126, 127, 128, 131, 134]:
        outs = run_ptx(fp8_gemm_gluon.E4M3_PTX, 4, [x, torch.tensor(s * 0x00800080 + 0x3C003C00)])
        for j, out in enumerate(outs):
            byte = ((x >> (8 * j)) & 0xFF).to(torch.uint8)
            value = byte.view(torch.float8_e4m3fn).double()
            finite = value.isfinite()  # 0x7F / 0xFF are NaN in e4m3fn; a checkpoint holds none
            want = (value * 2.0 ** (s - 127)).to(torch.bfloat16).view(torch.int16)
            got = (out & 0xFFFF).to(torch.int16)
            assert torch.equal(got[finite], want[finite]), (s, j)


def test_dense_e4m3_tiled_ptx():
    """The Gluon dense FP8 GEMM's decode for tile-ordered ``x`` (``fp8_gemm_gluon.E4M3_TILED_PTX``): words a,
    b and the multiplier 2^(s - 7) -> (a0, b0, a1, b1, a2, b2, a3, b3), each value times 2^(s - 127), bit for
    bit, for every pattern of each byte pair (a_i, b_i) and a spread of scale bytes."""
    pat = torch.arange(1 << 16, dtype=torch.int64)
    lo, hi = pat & 0xFF, pat >> 8
    g = torch.Generator().manual_seed(7)
    noise = torch.randint(0, 1 << 32, (2, pat.numel()), generator=g, dtype=torch.int64)
    for s in [0, 3, 120, 127, 134]:  # the scale multiply is test_dense_e4m3_ptx's (every scale case there)
        for i in range(4):  # byte i of both words takes every pair of values; the other bytes random
            keep = ~(0xFF << (8 * i)) & 0xFFFFFFFF
            a = (noise[0] & keep) | (lo << (8 * i))
            b = (noise[1] & keep) | (hi << (8 * i))
            mult = torch.tensor(s * 0x00800080 + 0x3C003C00)
            outs = run_ptx(fp8_gemm_gluon.E4M3_TILED_PTX, 8, [a, b, mult])
            for o, out in enumerate(outs):
                word = (a, b)[o % 2]
                byte = ((word >> (8 * (o // 2))) & 0xFF).to(torch.uint8)
                value = byte.view(torch.float8_e4m3fn).double()
                finite = value.isfinite()
                want = (value * 2.0 ** (s - 127)).to(torch.bfloat16).view(torch.int16)
                assert torch.equal((out & 0xFFFF).to(torch.int16)[finite], want[finite]), (s, i, o)


def _staged_columns() -> torch.Tensor:
    """The staging order written out from the kernels' docstrings: place ``16s + 8h + 2q + e`` of a 128-column
    tile holds column ``32q + 8t + j + 4e``, ``t = s // 2``, ``j = 2 (s % 2) + h``."""
    cols = torch.empty(128, dtype=torch.int64)
    for s in range(8):
        for h in range(2):
            for q in range(4):
                for e in range(2):
                    cols[16 * s + 8 * h + 2 * q + e] = 32 * q + 8 * (s // 2) + 2 * (s % 2) + h + 4 * e
    return cols


def test_tile_order_columns_is_the_documented_order():
    cols = moe_gemm_gluon.tile_order_columns()
    assert torch.equal(cols, _staged_columns())
    assert torch.equal(cols.sort().values, torch.arange(128))


def _fragment_places(word_of_lane: int, outputs: int) -> list[tuple[int, int, int, int]]:
    """(lane q, word-group t, output o, logical column) of ``moe_gemm_gluon.place_fragment``, the join both
    kernels' decodes (expert, dense tiled) end with: output ``o = 2i + e`` of register ``i`` (``i = 2 i1 + i0``)
    of group ``t`` is logical column ``32t + 16 i1 + 8 i0 + 2q + e``."""
    return [
        (q, t, o, 32 * t + 16 * ((o // 2) // 2) + 8 * ((o // 2) % 2) + 2 * q + o % 2)
        for q in range(4)
        for t in range(word_of_lane)
        for o in range(outputs)
    ]


def test_expert_fragment_matches_staged_x():
    """One weight row's 128-code tile through the Gluon expert kernel's decode and join (emulated: lane
    q's words ``4q .. 4q + 3``) lands at the places where the staging order puts the ``x`` column it
    multiplies: the A fragment equals the decoded row permuted by ``tile_order_columns``, bit for bit."""
    g = torch.Generator().manual_seed(8)
    row = torch.randint(0, 256, (64,), generator=g, dtype=torch.int64)  # 64 packed bytes, 128 codes
    s = 121
    codes = torch.stack([row & 0xF, row >> 4], -1).reshape(128).to(torch.uint8)  # column 2b: low nibble of b
    decoded = (e2m1_decode(codes).double() * 2.0 ** (s - 127)).to(torch.bfloat16).view(torch.int16)
    words = (row.view(16, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)  # word 4q + t
    frag = torch.empty(128, dtype=torch.int16)
    outs = run_ptx(moe_gemm_gluon.E2M1_PAIR_PTX, 8, [words, torch.tensor(s * 0x00800080 + 0x3F003F00)])
    for q, t, o, col in _fragment_places(4, 8):
        frag[col] = (outs[o][4 * q + t] & 0xFFFF).to(torch.int16)
    assert torch.equal(frag, decoded[moe_gemm_gluon.tile_order_columns()])


def test_dense_tiled_fragment_matches_staged_x():
    """The same for the dense FP8 kernel with tile-ordered ``x``: lane q's 32 bytes are words ``8q .. 8q +
    7``, taken in pairs ``(2t, 2t + 1)``."""
    g = torch.Generator().manual_seed(9)
    row = torch.randint(0, 256, (128,), generator=g, dtype=torch.int64)
    row[(row & 0x7F) == 0x7F] = 0x3C  # no NaN codes (a checkpoint holds none)
    s = 125
    value = row.to(torch.uint8).view(torch.float8_e4m3fn).double()
    decoded = (value * 2.0 ** (s - 127)).to(torch.bfloat16).view(torch.int16)
    words = (row.view(32, 4) << torch.tensor([0, 8, 16, 24])).sum(-1)  # word 8q + w
    frag = torch.empty(128, dtype=torch.int16)
    outs = run_ptx(fp8_gemm_gluon.E4M3_TILED_PTX, 8,
                   [words[0::2], words[1::2], torch.tensor(s * 0x00800080 + 0x3C003C00)])
    for q, t, o, col in _fragment_places(4, 8):
        frag[col] = (outs[o][4 * q + t] & 0xFFFF).to(torch.int16)
    assert torch.equal(frag, decoded[moe_gemm_gluon.tile_order_columns()])
