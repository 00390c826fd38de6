"""The sm90 decode kernel's inline PTX, run on the CPU (``ptx_subset``), bit for bit against
the format references of ``ops/quant.py``: every e2m1 code pair with every finite e4m3 scale
(NVFP4, compressed KV) and every e4m3 byte with every UE8M0 scale (MXFP8, window KV); and
the epilogue's quad exchange on a simulated warp.

The GPU tests check the kernel end to end; these pin its bit tricks (byte-permute tables,
sign recovery, exact products) in CI, where no GPU runs.
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.quant import e2m1_decode, e4m3_decode, ue8m0_decode
from deepinfer_vllm.ops.triton.sparse_mla_decode_gluon import (FP4_SCALE_PTX, FP4_WORD_PTX, FP8_WORD_PTX,
                                                               STORE16_F32_PTX, STORE16_PTX)
from tests.ops.ptx_subset import run_ptx


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF


def test_fp4_scale_ptx_is_exact():
    """e4m3 scale byte -> the scale in both bf16 halves, for every finite non-negative byte."""
    s = torch.arange(0, 127, dtype=torch.int64)
    (pair,) = run_ptx(FP4_SCALE_PTX, 1, [s])
    want = _bf16_bits(e4m3_decode(s.to(torch.uint8)))
    assert torch.equal(pair & 0xFFFF, want)
    assert torch.equal(pair >> 16, want)


def test_fp4_word_ptx_matches_nvfp4_reference():
    """All 65536 patterns of a word's low 16 bits (every code quadruple, signs and -0
    included) and a random high half, times each finite e4m3 scale: 8 bf16 per word equal
    ``e2m1(code) * e4m3(scale)`` bit for bit."""
    g = torch.Generator().manual_seed(0)
    low = torch.arange(1 << 16, dtype=torch.int64)
    words = low | (torch.randint(0, 1 << 16, low.shape, generator=g, dtype=torch.int64) << 16)
    codes = torch.stack([(words >> (4 * j)) & 0xF for j in range(8)], dim=-1)
    values = e2m1_decode(codes.to(torch.uint8))
    for s in list(range(0, 127, 9)) + [1, 2, 7, 8, 118, 126]:
        scale = torch.full((1,), s, dtype=torch.int64)
        (pair,) = run_ptx(FP4_SCALE_PTX, 1, [scale])
        outs = run_ptx(FP4_WORD_PTX, 8, [words, pair])
        got = torch.stack(outs, dim=-1)
        want = _bf16_bits(values * e4m3_decode(scale.to(torch.uint8)))
        assert torch.equal(got, want), f"scale byte {s}: {int((got != want).sum())} values differ"


def test_fp8_word_ptx_matches_mxfp8_reference():
    """Every e4m3 byte in every lane of a word, times 2^(s - 127) for every UE8M0 byte
    (the subnormal 2^-127 and NaN 255 included): bf16 equal to the reference's rounding."""
    b = torch.arange(256, dtype=torch.int64)
    words = b | (b.roll(1) << 8) | (b.roll(2) << 16) | (b.roll(3) << 24)
    lanes = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    for s in range(256):
        sb = torch.full((1,), s, dtype=torch.uint8)
        factor = ue8m0_decode(sb)
        (f,) = [factor.view(torch.int32).to(torch.int64) & 0xFFFFFFFF]
        got = torch.stack(run_ptx(FP8_WORD_PTX, 4, [words, f]), dim=-1)
        want_f = e4m3_decode(lanes.to(torch.uint8)) * factor
        want = _bf16_bits(want_f)
        nan = torch.isnan(want_f)
        got_f = (got - ((got & 0x8000) << 1)).to(torch.int16).view(torch.bfloat16)
        assert torch.equal(torch.isnan(got_f), nan), f"scale byte {s}: NaN pattern differs"
        assert torch.equal(got[~nan], want[~nan]), f"scale byte {s}: values differ"


_LANE = torch.arange(32, dtype=torch.int64)
_ROW, _Q = _LANE // 4, _LANE % 4  # a wgmma accumulator fragment: row l // 4, quad lane l % 4


def _word(col: torch.Tensor) -> torch.Tensor:
    """A word's identity: its row and its (first) column."""
    return (_ROW << 16) | col


def _run_store(ptx: str, words: list, col0: torch.Tensor, valid_rows: torch.Tensor) -> torch.Tensor:
    """Run an epilogue exchange on a simulated warp, each lane passing the address of the row
    and first column it should store; check it stores there, only where valid, and return
    the stored words of the valid lanes."""
    addr = (_ROW << 20) | col0
    valid = valid_rows.to(torch.int64).expand(col0.shape)
    stores: list = []
    (done,) = run_ptx(ptx, 1, words + [addr, valid], stores)
    assert torch.equal(done, torch.zeros(col0.shape, dtype=torch.int64))
    ((where, data, pred),) = stores
    assert torch.equal(where, addr.expand(col0.shape))
    assert torch.equal(pred, valid != 0)
    return data[pred], pred


def test_store16_ptx_gives_each_lane_8_adjacent_columns():
    """Lane l has, for column groups 4 k + i (i = 0..3), the word of columns 8 (4 k + i) +
    2 (l % 4), + 1. After the exchange each lane stores, at the address it passed, columns
    8 (4 k + l % 4) .. + 7 of its row in order, and nothing for rows marked invalid."""
    k = torch.arange(8, dtype=torch.int64).unsqueeze(-1)  # 8 blocks of 4 column groups x 32 lanes
    words = [_word(8 * (4 * k + i) + 2 * _Q) for i in range(4)]
    col0 = 8 * (4 * k + _Q)
    data, pred = _run_store(STORE16_PTX, words, col0, _ROW < 6)
    want = torch.stack([_word(col0 + 2 * j) for j in range(4)], dim=-1).expand(8, 32, 4)
    assert torch.equal(data, want[pred])


def test_store16_f32_ptx_gives_each_lane_4_adjacent_columns():
    """The split outputs' fp32 fragment: lane l holds columns 16 m + 2 q, + 1 (group A = 2 m)
    and 16 m + 8 + 2 q, + 1 (group B), q = l % 4. After the pair swap an even lane stores
    columns 16 m + 2 q .. + 3, an odd lane 16 m + 8 + 2 q - 2 .. + 3, in order, at the
    address it passed; every column of a valid row exactly once, nothing of invalid rows."""
    m = torch.arange(16, dtype=torch.int64).unsqueeze(-1)  # 16 pairs of column groups x 32 lanes
    a, b = 16 * m + 2 * _Q, 16 * m + 8 + 2 * _Q
    col0 = 16 * m + 2 * _Q + 6 * (_Q & 1)
    data, pred = _run_store(STORE16_F32_PTX, [_word(a), _word(a + 1), _word(b), _word(b + 1)], col0,
                            _ROW != 3)
    want = torch.stack([_word(col0 + j) for j in range(4)], dim=-1).expand(16, 32, 4)
    assert torch.equal(data, want[pred])
    got = data.flatten()
    assert sorted(((got >> 16) * 256 + (got & 0xFFFF)).tolist()) == [
        r * 256 + c for r in range(8) if r != 3 for c in range(256)]
