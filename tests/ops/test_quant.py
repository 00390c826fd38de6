"""Tests for ``deepinfer_vllm.ops.quant``.

Expected bytes in the hand-worked tests were derived on paper from the format
definitions (docs/architecture.md, "Number formats"), not by running the code under test. The larger tests
compare against ``_Oracle``: an independent numpy model that finds the nearest
grid point by brute force (ties to the even code) and takes ceil(log2) from
``frexp``, sharing no code with the implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepinfer_vllm.ops import quant as q

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def u8(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def f32(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def block(head: list[float], size: int) -> torch.Tensor:
    """A block of ``size`` values starting with ``head`` and padded with zeros."""
    return torch.tensor(head + [0.0] * (size - len(head)), dtype=torch.float32)


def assert_same_float(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise float equality (distinguishes -0.0 and matches NaN with NaN)."""
    a = actual.float().cpu().contiguous().view(torch.int32)
    e = expected.float().cpu().contiguous().view(torch.int32)
    nan = torch.isnan(actual.float().cpu())
    assert torch.equal(nan, torch.isnan(expected.float().cpu()))
    assert torch.equal(a[~nan], e[~nan])


# ---------------------------------------------------------------------------
# Independent oracle (numpy)
# ---------------------------------------------------------------------------


def _e4m3_magnitude(code: int) -> float:
    exp, man = code >> 3, code & 7
    return man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)


E4M3_GRID = np.array([_e4m3_magnitude(c) for c in range(127)])  # codes 0..126, ascending
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class _Oracle:
    """Brute-force model of the three cache formats on fp32 numpy input."""

    @staticmethod
    def nearest_even(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
        d = np.abs(a.astype(np.float64)[..., None] - grid)
        lo = d.argmin(-1)
        hi = np.minimum(lo + 1, len(grid) - 1)
        d_lo = np.take_along_axis(d, lo[..., None], -1)[..., 0]
        d_hi = np.take_along_axis(d, hi[..., None], -1)[..., 0]
        return np.where((d_hi == d_lo) & (lo % 2 == 1), hi, lo)

    @staticmethod
    def ceil_log2(r: np.ndarray) -> np.ndarray:
        m, e = np.frexp(r.astype(np.float64))
        return np.where(m == 0.5, e - 1, e)

    @classmethod
    def pow2_format(
        cls, x: np.ndarray, group: int, floor: float, qmax: float, grid: np.ndarray, sign_bit: int
    ):
        b = x.reshape(*x.shape[:-1], -1, group)
        amax = np.maximum(np.abs(b).max(-1), np.float32(floor))
        e = cls.ceil_log2(amax / np.float32(qmax))  # fp32 division
        v = b.astype(np.float64) * 2.0 ** (-e[..., None])
        mag = cls.nearest_even(np.abs(v), grid)
        codes = mag | (np.signbit(b).astype(np.int64) * sign_bit)
        deq = np.where(np.signbit(b), -1.0, 1.0) * grid[mag] * 2.0 ** e[..., None]
        return codes.reshape(x.shape), (e + 127).astype(np.int64), deq.reshape(x.shape)

    @classmethod
    def mxfp8(cls, x: np.ndarray):
        return cls.pow2_format(x, 32, 1e-4, 448.0, E4M3_GRID, 0x80)

    @classmethod
    def mxfp4(cls, x: np.ndarray):
        return cls.pow2_format(x, 32, 6 * 2.0**-126, 6.0, E2M1_GRID, 0x8)

    @classmethod
    def nvfp4(cls, x: np.ndarray):
        b = x.reshape(*x.shape[:-1], -1, 16)
        amax = np.maximum(np.abs(b).max(-1), np.float32(6 * 2.0**-9))
        requested = np.minimum(amax * np.float32(1 / 6), np.float32(448))  # fp32 multiply
        scode = cls.nearest_even(requested, E4M3_GRID)
        s = E4M3_GRID[scode].astype(np.float32)
        v = b * (np.float32(1) / s)[..., None]  # fp32 reciprocal, fp32 multiply
        mag = cls.nearest_even(np.abs(v), E2M1_GRID)
        codes = mag | (np.signbit(b).astype(np.int64) * 0x8)
        deq = np.where(np.signbit(b), -1.0, 1.0) * E2M1_GRID[mag] * s[..., None].astype(np.float64)
        return codes.reshape(x.shape), scode, deq.reshape(x.shape)


def _check_against_oracle(fmt: str, x: torch.Tensor) -> None:
    codes, scales, deq = getattr(_Oracle, fmt)(x.float().cpu().numpy())
    values, scale_bytes = q.quantize(fmt, x)
    got_codes = values if fmt == "mxfp8" else q.unpack_fp4(values)
    np.testing.assert_array_equal(got_codes.cpu().numpy().astype(np.int64), codes)
    np.testing.assert_array_equal(scale_bytes.cpu().numpy().astype(np.int64), scales)
    out = q.dequantize(fmt, values, scale_bytes, torch.float32)
    np.testing.assert_array_equal(out.cpu().numpy().astype(np.float64), deq)


def _structured_vector(seed: int, dim: int = 512) -> torch.Tensor:
    """bf16-valued vector: one block per magnitude from 2**-30 to 2**20, a zero
    block, and values placed on rounding ties of the element grids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dim, generator=g)
    nblocks = dim // 32
    mags = 2.0 ** torch.linspace(-30, 20, nblocks)
    x = (x.view(nblocks, 32) * mags[:, None]).flatten()
    x[32:64] = 0.0
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)
    x[64:96] = ties * torch.tensor([1.0, -1.0]).repeat(16)
    x[96:100] = torch.tensor([448.0, 1.0625, -1.1875, 2.0**-10])
    return x.bfloat16().float()


# ---------------------------------------------------------------------------
# E4M3
# ---------------------------------------------------------------------------


def test_e4m3_encode_hand_vectors():
    x = f32(1.0, -2.5, 448.0, 2.0**-9, 2.0**-6, 7 * 2.0**-9, 240.0, 0.0, -0.0)
    assert q.e4m3_encode(x).tolist() == [0x38, 0xC2, 0x7E, 0x01, 0x08, 0x07, 0x77, 0x00, 0x80]


def test_e4m3_encode_ties_to_even():
    # 1.0625 is halfway between 1.0 (0x38, mantissa 000) and 1.125 (0x39): even -> 0x38.
    # 1.1875 is halfway between 1.125 (0x39) and 1.25 (0x3A): even -> 0x3A.
    # Subnormal ties: 2**-10 between 0 and 2**-9 -> 0; 1.5 * 2**-9 -> 2 * 2**-9 (0x02).
    # 464 is halfway between 448 (0x7E) and 480 (would be 0x7F = NaN): even -> 448.
    x = f32(1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 464.0, -1.0625)
    assert q.e4m3_encode(x).tolist() == [0x38, 0x3A, 0x00, 0x02, 0x02, 0x7E, 0xB8]
    # One fp32 ulp above the tie rounds up.
    assert q.e4m3_encode(f32(1.0625 + 2.0**-23)).tolist() == [0x39]


def test_e4m3_encode_saturates_and_nan():
    x = f32(449.0, 480.0, 1e6, float("inf"), -1e6, float("-inf"), float("nan"))
    assert q.e4m3_encode(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


def test_e4m3_decode_hand_vectors():
    out = q.e4m3_decode(u8(0x38, 0xC2, 0x7E, 0x01, 0x08, 0x77, 0x00, 0x80, 0x7F, 0xFF))
    nan = float("nan")
    assert_same_float(out, f32(1.0, -2.5, 448.0, 2.0**-9, 2.0**-6, 240.0, 0.0, -0.0, nan, nan))


def test_e4m3_all_256_bytes():
    def reference(b: int) -> float:
        sign = -1.0 if b & 0x80 else 1.0
        if b & 0x7F == 0x7F:
            return math.nan
        return sign * _e4m3_magnitude(b & 0x7F)

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = q.e4m3_decode(codes)
    assert_same_float(decoded, torch.tensor([reference(b) for b in range(256)], dtype=torch.float32))
    # The fast decode (torch's float8_e4m3fn) equals the bit-level definition.
    assert_same_float(decoded, q.e4m3_decode_bits(codes))
    assert_same_float(q.e4m3_decode_bits(codes), torch.tensor([reference(b) for b in range(256)]))
    finite = ~torch.isnan(decoded)
    assert finite.sum() == 254
    assert torch.equal(q.e4m3_encode(decoded)[finite], codes[finite])


def test_e4m3_encode_matches_torch_cast_in_range():
    bf16_bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = bf16_bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x) & (x.abs() <= 448)]
    mags = torch.from_numpy(E4M3_GRID).float()
    mids = (mags[:-1] + mags[1:]) / 2  # exact in fp32
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    x = torch.cat([x, near, -near, torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 448])
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q.e4m3_encode(x), expected)


# ---------------------------------------------------------------------------
# UE8M0 and ceil_log2
# ---------------------------------------------------------------------------


def test_ue8m0_decode():
    out = q.ue8m0_decode(u8(127, 128, 126, 0, 254, 100, 255))
    assert_same_float(out, f32(1.0, 2.0, 0.5, 2.0**-127, 2.0**127, 2.0**-27, float("nan")))
    every = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    powers = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float32)
    assert_same_float(q.ue8m0_decode(every), powers)
    if hasattr(torch, "float8_e8m0fnu"):
        assert_same_float(q.ue8m0_decode(every.view(torch.float8_e8m0fnu)), q.ue8m0_decode(every))
        assert_same_float(q.ue8m0_decode(every), every.view(torch.float8_e8m0fnu).float())


def test_ue8m0_lookup_equals_its_definition():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_same_float(q.ue8m0_decode(every), q.ue8m0_decode_bits(every))
    grid = every[torch.randperm(256, generator=torch.Generator().manual_seed(0))].view(16, 16)
    assert_same_float(q.ue8m0_decode(grid), q.ue8m0_decode_bits(grid))


def test_weight_decoders_into_a_workspace_equal_the_references():
    """The per-GEMM decoders (fp32 and fp64 outputs) give the reference dequantisers' values."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 160, generator=g) * 3
    codes, scales = q.quant_fp8_block(w)
    packed, row_scales = q.quant_fp4_rows(torch.randn(2, 40, 96, generator=g))
    for dtype in (torch.float32, torch.float64):
        out = q.dequant_fp8_block_into(torch.empty(96, 160, dtype=dtype), codes, scales)
        assert_same_float(out, q.dequant_fp8_block(codes, scales, 32, torch.float32).to(dtype))
        out = q.dequant_fp4_rows_into(torch.empty(2, 40, 96, dtype=dtype), packed, row_scales)
        assert_same_float(out, q.dequant_fp4_rows(packed, row_scales, torch.float32).to(dtype))


def test_ue8m0_encode_exponent_clamps():
    e = torch.tensor([0, 1, -1, -127, 127, -300, 300])
    assert q.ue8m0_encode_exponent(e).tolist() == [127, 128, 126, 0, 254, 0, 254]


def test_ceil_log2_hand_vectors():
    x = f32(1.0, 1.0 + 2.0**-23, 0.75, 0.5, 448.0, 3.0, 2.0**-126, 2.0**-149, 3 * 2.0**-149)
    assert q.ceil_log2(x).tolist() == [0, 1, 0, -1, 9, 2, -126, -149, -147]
    edge = f32(2.0**-130, 2.0**-130 + 2.0**-149, 3.4028234663852886e38, float("inf"), 0.0, -4.0)
    assert q.ceil_log2(edge).tolist() == [-130, -129, 128, 128, -150, 2]
    assert q.ceil_log2(x).dtype == torch.int32


def test_ceil_log2_exact_on_random_bit_patterns():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(1, 0x7F800000, (3000,), generator=g, dtype=torch.int64).to(torch.int32)
    bits = torch.cat([bits, torch.arange(1, 300, dtype=torch.int32)])  # small subnormals
    x = bits.view(torch.float32)
    expected = []
    for v in x.tolist():
        m, e = math.frexp(v)
        expected.append(e - 1 if m == 0.5 else e)
    assert q.ceil_log2(x).tolist() == expected


# ---------------------------------------------------------------------------
# E2M1 and packing
# ---------------------------------------------------------------------------


def test_e2m1_encode_hand_vectors():
    x = f32(0.0, 0.25, 0.26, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
    assert q.e2m1_encode(x).tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 4, 4]
    x = f32(2.5, 3.0, 3.5, 4.0, 5.0, 5.1, 6.0, 7.0, 1e9, float("inf"))
    assert q.e2m1_encode(x).tolist() == [4, 5, 6, 6, 6, 7, 7, 7, 7, 7]


def test_e2m1_encode_signs():
    # -0.0 and negatives that round to zero keep the sign bit: code 8 (decodes to -0.0).
    x = f32(-0.75, -0.0, -0.1, -7.0, -2.5, float("nan"), float("-inf"))
    assert q.e2m1_encode(x).tolist() == [10, 8, 8, 15, 12, 7, 15]


def test_e2m1_all_16_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = q.e2m1_decode(codes)
    assert_same_float(values, f32(0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6))
    assert_same_float(q.E2M1_VALUES, values)
    assert torch.equal(q.e2m1_encode(values), codes)


def test_pack_fp4_nibble_order():
    assert q.pack_fp4(u8(1, 2)).tolist() == [0x21]
    assert q.pack_fp4(u8(0xF, 0x0, 0x3, 0xA)).tolist() == [0x0F, 0xA3]
    packed = q.pack_fp4(torch.arange(16, dtype=torch.uint8).view(2, 8))
    assert packed.shape == (2, 4)
    assert packed.tolist() == [[0x10, 0x32, 0x54, 0x76], [0x98, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(q.unpack_fp4(packed), torch.arange(16, dtype=torch.uint8).view(2, 8))


def test_unpack_fp4_accepts_int8_storage():
    stored = torch.tensor([-95, 0x21, -1], dtype=torch.int8)  # bytes 0xA1, 0x21, 0xFF
    assert q.unpack_fp4(stored).tolist() == [1, 10, 1, 2, 15, 15]


def test_pack_fp4_rejects_odd_length():
    with pytest.raises(ValueError):
        q.pack_fp4(u8(1, 2, 3))


# ---------------------------------------------------------------------------
# MXFP8 (window KV)
# ---------------------------------------------------------------------------


def test_mxfp8_amax_on_power_of_two_boundary():
    # amax = 448 * 4: s = 2**2 exactly (byte 129); 1792/4 = 448, 4/4 = 1, -14/4 = -3.5.
    values, scales = q.mxfp8_quantize(block([1792.0, 4.0, -14.0], 32))
    assert scales.tolist() == [129]
    assert values[:4].tolist() == [0x7E, 0x38, 0xC6, 0x00]
    # Just above the boundary the scale doubles: 1800/8 = 225 -> 224 (0x76).
    values, scales = q.mxfp8_quantize(block([1800.0], 32))
    assert scales.tolist() == [130] and values[0].item() == 0x76
    # A small exact boundary: amax = 448 * 2**-20 -> byte 107.
    values, scales = q.mxfp8_quantize(block([448.0 * 2.0**-20], 32))
    assert scales.tolist() == [107] and values[0].item() == 0x7E


def test_mxfp8_zero_and_tiny_blocks_use_floor():
    # 1e-4 / 448 = 2.23e-7 lies in (2**-23, 2**-22]: s = 2**-22, byte 105.
    values, scales = q.mxfp8_quantize(torch.zeros(2, 32))
    assert scales.tolist() == [[105], [105]] and not values.any()
    # 1e-6 * 2**22 = 4.19 -> 4.0 (0x48).
    values, scales = q.mxfp8_quantize(block([1e-6], 32))
    assert scales.tolist() == [105] and values[0].item() == 0x48


def test_mxfp8_saturating_block():
    # Non-finite input: the exponent clamps at 127 (byte 254, never the NaN byte),
    # inf saturates to 448 and finite values underflow to signed zero.
    values, scales = q.mxfp8_quantize(block([float("inf"), -1.0, float("-inf")], 32))
    assert scales.tolist() == [254]
    assert values[:4].tolist() == [0x7E, 0x80, 0xFE, 0x00]


@pytest.mark.parametrize("device", DEVICES)
def test_mxfp8_512_vector_against_oracle(device):
    x = _structured_vector(seed=2).to(device)
    _check_against_oracle("mxfp8", x)
    values, scales = q.mxfp8_quantize(x)
    assert values.shape == (512,) and scales.shape == (16,)
    assert values.dtype == scales.dtype == torch.uint8
    assert scales[1].item() == 105  # the zero block


# ---------------------------------------------------------------------------
# NVFP4 (compressed KV)
# ---------------------------------------------------------------------------


def test_nvfp4_amax_on_scale_boundary():
    # amax = 6 * 1.0: s = e4m3(6 * fp32(1/6)) = 1.0 (0x38); values map 1:1 onto the grid.
    # codes: 6->7, 1->2, -0.5->9, 3->5, 0.25->0 (tie), 0.75->2 (tie), -5->14 (tie to 4), 2.5->4.
    packed, scales = q.nvfp4_quantize(block([6.0, 1.0, -0.5, 3.0, 0.25, 0.75, -5.0, 2.5], 16))
    assert scales.tolist() == [0x38]
    assert packed.tolist() == [0x27, 0x59, 0x20, 0x4E, 0, 0, 0, 0]


def test_nvfp4_scale_rounds_ties_to_even_then_saturates_values():
    # 6.375 / 6 = 1.0625, an e4m3 tie -> 1.0. Then 6.375 / 1.0 > 6 saturates to 6.
    packed, scales = q.nvfp4_quantize(block([6.375, -6.375, 1.0625], 16))
    assert scales.tolist() == [0x38]
    assert packed[:2].tolist() == [0xF7, 0x02]
    assert q.nvfp4_dequantize(packed, scales)[:3].tolist() == [6.0, -6.0, 1.0]


def test_nvfp4_saturating_scale():
    # 6000 / 6 = 1000 clamps to 448 (0x7E); 6000/448 = 13.4 -> 6, 1344/448 = 3,
    # 100/448 = 0.22 -> 0, 200/448 = 0.45 -> 0.5.
    packed, scales = q.nvfp4_quantize(block([6000.0, 1344.0, 100.0, 200.0, -6000.0], 16))
    assert scales.tolist() == [0x7E]
    assert packed[:3].tolist() == [0x57, 0x10, 0x0F]


def test_nvfp4_zero_block_uses_floor():
    # floor 6 * 2**-9 gives the smallest e4m3 scale 2**-9 (0x01).
    packed, scales = q.nvfp4_quantize(torch.zeros(3, 32))
    assert scales.tolist() == [[1, 1]] * 3 and not packed.any()
    # 2**-12 / 2**-9 = 0.125 -> 0; 2**-10 / 2**-9 = 0.5 -> code 1.
    packed, scales = q.nvfp4_quantize(block([2.0**-12, 2.0**-10], 16))
    assert scales.tolist() == [1] and packed[0].item() == 0x10


def test_nvfp4_multiplies_by_rounded_reciprocal():
    # amax = 90 * 2**-9 -> s = 15 * 2**-9 = 0.029296875 (0x0F). fp32(1/s) is rounded
    # up, so 1.25*s, 2.5*s, 5*s land just above the e2m1 ties and round up
    # (codes 3, 5, 7); an exact x / s would give 1.0, 2.0, 4.0 (codes 2, 4, 6).
    s = 15 * 2.0**-9
    packed, scales = q.nvfp4_quantize(block([6 * s, 1.25 * s, 2.5 * s, 5 * s, -1.25 * s], 16))
    assert scales.tolist() == [0x0F]
    assert packed[:3].tolist() == [0x37, 0x75, 0x0B]


def test_nvfp4_scale_multiplies_amax_by_fp32_one_sixth():
    # fp32 amax = 1.78125 - 2**-23. amax / 6 = 0.296875 - 2**-23/6 rounds (fp32) below
    # the e4m3 tie 0.296875 -> 0.28125 (0x29). amax * fp32(1/6) (fp32(1/6) is 1/6 *
    # (1 + 2**-25)) is within half an ulp of the tie, rounds onto it, and the tie
    # goes to the even mantissa: 0.3125 (0x2A). The kernel multiplies.
    packed, scales = q.nvfp4_quantize(block([1.78125 - 2.0**-23], 16))
    assert scales.tolist() == [0x2A]
    # 1.7812499 / 0.3125 = 5.69999 -> 6 (code 7).
    assert packed[0].item() == 0x07


def test_nvfp4_qdq_is_not_idempotent_for_subnormal_scales():
    # 9 * 2**-9: s = e4m3(1.5 * 2**-9) = 2 * 2**-9 (tie to even), 4.5 -> 4 -> 2**-6.
    # Again: s = e4m3(2**-6 / 6) = 2**-9, 8 saturates to 6 -> 6 * 2**-9.
    x = block([9 * 2.0**-9], 16)
    once = q.nvfp4_qdq(x)
    assert once[0].item() == 2.0**-6
    assert q.nvfp4_qdq(once)[0].item() == 6 * 2.0**-9


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_512_vector_against_oracle(device):
    x = _structured_vector(seed=3).to(device)
    _check_against_oracle("nvfp4", x)
    packed, scales = q.nvfp4_quantize(x)
    assert packed.shape == (256,) and scales.shape == (32,)


# ---------------------------------------------------------------------------
# MXFP4 (index Q/K)
# ---------------------------------------------------------------------------


def test_mxfp4_amax_on_power_of_two_boundary():
    # amax = 6 * 2: s = 2 (byte 128); 12->6 (7), 1->0.5 (1), -3->-1.5 (11),
    # 5->2.5 tie->2 (4), 0.5->0.25 tie->0, -0.0 -> 8.
    packed, scales = q.mxfp4_quantize(block([12.0, 1.0, -3.0, 5.0, 0.5, -0.0], 32))
    assert scales.tolist() == [128]
    assert packed[:4].tolist() == [0x17, 0x4B, 0x80, 0x00]
    # Just above: 12.5/6 > 2 -> s = 4 (byte 129), 12.5/4 = 3.125 -> 3 (5).
    packed, scales = q.mxfp4_quantize(block([12.5], 32))
    assert scales.tolist() == [129] and packed[0].item() == 0x05


def test_mxfp4_zero_block_uses_floor():
    # floor 6 * 2**-126 -> s = 2**-126 (byte 1).
    packed, scales = q.mxfp4_quantize(torch.zeros(128))
    assert scales.tolist() == [1, 1, 1, 1] and not packed.any()


def test_mxfp4_saturating_block():
    packed, scales = q.mxfp4_quantize(block([float("inf"), 1.0], 32))
    assert scales.tolist() == [254] and packed[0].item() == 0x07


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [128, 512])
def test_mxfp4_vector_against_oracle(device, dim):
    x = _structured_vector(seed=4, dim=dim).to(device)
    _check_against_oracle("mxfp4", x)
    packed, scales = q.mxfp4_quantize(x)
    assert packed.shape == (dim // 2,) and scales.shape == (dim // 32,)


# ---------------------------------------------------------------------------
# Properties on random data
# ---------------------------------------------------------------------------

FORMATS = ["mxfp8", "nvfp4", "mxfp4"]


def _random_activations(seed: int, shape=(4, 8, 512)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 3)
    return x.bfloat16().float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_random_data_matches_oracle(fmt, device):
    _check_against_oracle(fmt, _random_activations(10).view(-1, 512).to(device))


def _bounded_elements(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Elements whose block scale is exact enough for the half-ulp bound to hold.

    MX scales are exact powers of two, so every element qualifies. An NVFP4 scale
    is amax/6 rounded to e4m3: below 2**-6 (subnormal e4m3, up to 1/3 relative
    error) or clamped at 448 it can leave |x/s| far above 6; those blocks are
    covered by the hand-worked tests instead.
    """
    if fmt != "nvfp4":
        return torch.ones_like(x, dtype=torch.bool)
    amax = x.unflatten(-1, (-1, 16)).abs().amax(-1)
    ok = (amax >= 6 * 2.0**-6) & (amax <= 6 * 448.0)
    return ok.repeat_interleave(16, -1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_within_half_ulp_of_block_scale(fmt):
    x = _random_activations(11)
    values, scales = q.quantize(fmt, x)
    err = (q.dequantize(fmt, values, scales) - x).abs()
    group = 16 if fmt == "nvfp4" else 32
    s = (q.e4m3_decode(scales) if fmt == "nvfp4" else q.ue8m0_decode(scales)).repeat_interleave(group, -1)
    v = x.abs() / s
    if fmt == "mxfp8":
        half_ulp = torch.clamp(v / 16, min=2.0**-10)  # 3 mantissa bits; subnormal step 2**-9
    else:
        half_ulp = torch.clamp(v / 4, min=0.25)  # steps 0.5 / 1 / 2; NVFP4 overshoot (<= 6.4) < v/4
    mask = _bounded_elements(fmt, x)
    assert mask.float().mean() > 0.75
    assert torch.all((err <= half_ulp * s)[mask])


@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_is_idempotent_on_values(fmt):
    # NVFP4 blocks with subnormal scales are not idempotent (see the hand-worked test).
    x = _random_activations(12)
    y = q.dequantize(fmt, *q.quantize(fmt, x))
    again = q.dequantize(fmt, *q.quantize(fmt, y))
    mask = _bounded_elements(fmt, x)
    assert mask.float().mean() > 0.75
    assert torch.equal(again[mask], y[mask])


def _canonical_codes(fmt: str, g: torch.Generator, rows: int = 64, dim: int = 512):
    """Random representable (values, scales) whose block maxima pin the scale."""
    if fmt == "mxfp8":
        mag = torch.randint(0, 0x7F, (rows, dim), generator=g)
        mag.view(rows, -1, 32)[..., 0] = torch.randint(0x77, 0x7F, (rows, dim // 32), generator=g)  # 240..448
        values = (mag | (torch.randint(0, 2, (rows, dim), generator=g) << 7)).to(torch.uint8)
        scales = torch.randint(106, 241, (rows, dim // 32), generator=g).to(torch.uint8)
        return values, scales
    group = 16 if fmt == "nvfp4" else 32
    codes = torch.randint(0, 16, (rows, dim), generator=g)
    signs = torch.randint(0, 2, (rows, dim // group), generator=g)
    codes.view(rows, -1, group)[..., 0] = 7 + 8 * signs  # +-6 pins the scale
    if fmt == "nvfp4":
        scales = torch.randint(1, 0x7F, (rows, dim // 16), generator=g)  # every positive finite e4m3
    else:
        scales = torch.randint(1, 253, (rows, dim // 32), generator=g)  # 6 * 2**125 still finite
    return q.pack_fp4(codes.to(torch.uint8)), scales.to(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_of_dequantize_reproduces_bytes(fmt):
    values, scales = _canonical_codes(fmt, torch.Generator().manual_seed(13))
    again = q.quantize(fmt, q.dequantize(fmt, values, scales))
    assert torch.equal(again[0], values)
    assert torch.equal(again[1], scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_qdq_bf16_returns_input_dtype_and_exact_values(fmt):
    x = _random_activations(14).bfloat16()
    y = getattr(q, f"{fmt}_qdq")(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # Every dequantised value is exact in bf16, so the fp32 path rounds to the same.
    assert torch.equal(y.float(), getattr(q, f"{fmt}_qdq")(x.float()))


def test_leading_shapes():
    x = _random_activations(15, shape=(2, 3, 5, 512))
    for fmt, (vb, sb) in {"mxfp8": (512, 16), "nvfp4": (256, 32), "mxfp4": (256, 16)}.items():
        values, scales = q.quantize(fmt, x)
        assert values.shape == (2, 3, 5, vb) and scales.shape == (2, 3, 5, sb)
        flat = q.quantize(fmt, x.reshape(-1, 512))
        assert torch.equal(values.reshape(-1, vb), flat[0]) and torch.equal(scales.reshape(-1, sb), flat[1])


def test_rejects_bad_dims():
    with pytest.raises(ValueError):
        q.mxfp8_quantize(torch.zeros(48))
    with pytest.raises(ValueError):
        q.nvfp4_quantize(torch.zeros(24))
    with pytest.raises(TypeError):
        q.e4m3_decode(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------------
# Weight formats
# ---------------------------------------------------------------------------


def test_dequant_fp8_block_hand_vector():
    w = torch.full((33, 33), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # all 1.0
    scale = torch.tensor([[127, 128], [129, 130]], dtype=torch.uint8)
    if hasattr(torch, "float8_e8m0fnu"):
        scale = scale.view(torch.float8_e8m0fnu)
    out = q.dequant_fp8_block(w, scale)
    assert out.shape == (33, 33) and out.dtype == torch.float32
    assert out[:32, :32].eq(1.0).all() and out[:32, 32].eq(2.0).all()
    assert out[32, :32].eq(4.0).all() and out[32, 32].item() == 8.0
    assert q.dequant_fp8_block(w, scale, dtype=torch.bfloat16).dtype == torch.bfloat16


def _oracle_fp8_block(w: np.ndarray, b: int = 32):
    """Tile-by-tile MXFP8 rule on a 2-D fp32 array (edge tiles are partial)."""
    rows, cols = w.shape
    codes = np.zeros((rows, cols), dtype=np.int64)
    deq = np.zeros((rows, cols))
    scales = np.zeros((-(-rows // b), -(-cols // b)), dtype=np.int64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = w[i * b : (i + 1) * b, j * b : (j + 1) * b]
            amax = np.maximum(np.abs(tile).max(), np.float32(1e-4))
            e = int(_Oracle.ceil_log2(np.asarray(amax / np.float32(448))))
            mag = _Oracle.nearest_even(np.abs(tile.astype(np.float64) * 2.0**-e), E4M3_GRID)
            codes[i * b : (i + 1) * b, j * b : (j + 1) * b] = mag | (np.signbit(tile) * 0x80)
            sign = np.where(np.signbit(tile), -1.0, 1.0)
            deq[i * b : (i + 1) * b, j * b : (j + 1) * b] = sign * E4M3_GRID[mag] * 2.0**e
            scales[i, j] = e + 127
    return codes, scales, deq


@pytest.mark.parametrize("shape", [(40, 70), (64, 128)])
def test_fp8_block_round_trip(shape):
    g = torch.Generator().manual_seed(20)
    w = torch.randn(shape, generator=g) * 0.02
    w[:32, :32] = 0.0  # an all-zero tile
    w[-1, -1] = 3.0  # an outlier in a partial edge tile
    values, scales = q.quant_fp8_block(w)
    assert values.shape == shape and values.dtype == torch.uint8
    assert scales.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    assert scales[0, 0].item() == 105
    codes, exp_scales, deq = _oracle_fp8_block(w.numpy())
    np.testing.assert_array_equal(values.numpy().astype(np.int64), codes)
    np.testing.assert_array_equal(scales.numpy().astype(np.int64), exp_scales)
    out = q.dequant_fp8_block(values, scales)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), deq)
    # Re-quantising the dequantised weight gives back the same values.
    assert torch.equal(q.dequant_fp8_block(*q.quant_fp8_block(out)), out)


def test_fp8_block_batched_matches_per_slice():
    w = torch.randn(3, 40, 70, generator=torch.Generator().manual_seed(21))
    values, scales = q.quant_fp8_block(w)
    assert values.shape == (3, 40, 70) and scales.shape == (3, 2, 3)
    for i in range(3):
        v, s = q.quant_fp8_block(w[i])
        assert torch.equal(values[i], v) and torch.equal(scales[i], s)
    assert torch.equal(q.dequant_fp8_block(values, scales)[1], q.dequant_fp8_block(values[1], scales[1]))


def test_dequant_fp4_rows_hand_vector():
    # Byte 0x21 holds column 0 = code 1 (0.5) low and column 1 = code 2 (1.0) high;
    # 0xF9 holds -0.5 (9) and -6 (15); scale byte 128 = 2.
    packed = torch.zeros(2, 16, dtype=torch.int8)
    packed[0, 0] = 0x21
    packed[1, 15] = torch.tensor(0xF9, dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128], [126]], dtype=torch.uint8)
    out = q.dequant_fp4_rows(packed, scale, torch.bfloat16)
    assert out.shape == (2, 32) and out.dtype == torch.bfloat16
    assert out[0, :3].tolist() == [1.0, 2.0, 0.0] and out[0, 3:].eq(0).all()
    assert out[1, 30:].tolist() == [-0.25, -3.0] and out[1, :30].eq(0).all()


def test_fp4_rows_round_trip():
    w = torch.randn(16, 2560, generator=torch.Generator().manual_seed(22)) * 0.05
    packed, scale = q.quant_fp4_rows(w)
    assert packed.shape == (16, 1280) and scale.shape == (16, 80)
    codes, exp_scales, deq = _Oracle.mxfp4(w.numpy())
    np.testing.assert_array_equal(q.unpack_fp4(packed).numpy().astype(np.int64), codes)
    np.testing.assert_array_equal(scale.numpy().astype(np.int64), exp_scales)
    out = q.dequant_fp4_rows(packed.view(torch.int8), scale)  # as stored in the checkpoint
    np.testing.assert_array_equal(out.numpy().astype(np.float64), deq)


def test_fp8_rows_round_trip():
    rows = torch.randn(10, 256, generator=torch.Generator().manual_seed(23))
    values, scale = q.quant_fp8_rows(rows)
    assert values.shape == (10, 256) and scale.shape == (10, 8)
    codes, exp_scales, deq = _Oracle.mxfp8(rows.numpy())
    np.testing.assert_array_equal(values.numpy().astype(np.int64), codes)
    np.testing.assert_array_equal(scale.numpy().astype(np.int64), exp_scales)
    out = q.dequant_fp8_rows(values.view(torch.float8_e4m3fn), scale, torch.float32)
    np.testing.assert_array_equal(out.numpy().astype(np.float64), deq)


# ---------------------------------------------------------------------------
# Cache records and dispatch
# ---------------------------------------------------------------------------


def test_record_bytes():
    assert q.record_bytes("mxfp8", 512) == (512, 16)
    assert q.record_bytes("nvfp4", 512) == (256, 32)
    assert q.record_bytes("mxfp4", 128) == (64, 4)
    assert (q.WINDOW_VALUE_BYTES, q.WINDOW_SCALE_BYTES) == (512, 16)
    assert (q.COMPRESSED_VALUE_BYTES, q.COMPRESSED_SCALE_BYTES) == (256, 32)
    assert (q.INDEX_VALUE_BYTES, q.INDEX_SCALE_BYTES) == (64, 4)
    assert sum(q.record_bytes("mxfp8", 512)) == 528
    assert sum(q.record_bytes("nvfp4", 512)) == 288
    assert sum(q.record_bytes("mxfp4", 128)) == 68
    with pytest.raises(ValueError):
        q.record_bytes("fp16", 512)
    with pytest.raises(ValueError):
        q.record_bytes("nvfp4", 520)


def test_page_layout_values_then_scales():
    x = _random_activations(30, shape=(3, 128))
    values, scales = q.quantize("mxfp4", x)
    page = q.pack_page(values, scales)
    assert page.shape == (3 * 68,)
    assert torch.equal(page[:64], values[0]) and torch.equal(page[64:128], values[1])
    assert torch.equal(page[192:196], scales[0]) and torch.equal(page[200:204], scales[2])
    padded = torch.cat([page, torch.full((20,), 0xAA, dtype=torch.uint8)])  # page rounding
    v, s = q.unpack_page(padded, "mxfp4", 128, n=3)
    assert torch.equal(v, values) and torch.equal(s, scales)
    with pytest.raises(ValueError):
        q.unpack_page(page, "mxfp4", 128, n=4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dispatch_matches_direct_calls(fmt):
    x = _random_activations(31, shape=(2, 512))
    direct_q = getattr(q, f"{fmt}_quantize")
    direct_dq = getattr(q, f"{fmt}_dequantize")
    values, scales = q.quantize(fmt, x)
    expected = direct_q(x)
    assert torch.equal(values, expected[0]) and torch.equal(scales, expected[1])
    out = q.dequantize(fmt, values, scales, torch.bfloat16)
    assert torch.equal(out, direct_dq(values, scales, torch.bfloat16))
    with pytest.raises(ValueError):
        q.quantize("int4", x)
