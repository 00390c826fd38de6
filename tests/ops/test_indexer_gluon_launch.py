"""Launch-shape rules of the Gluon indexer (pure Python: they run without a GPU)."""

import itertools
from types import SimpleNamespace

import pytest

from deepinfer_vllm.ops.triton.indexer_gluon import _resident_ctas, program_tiles


@pytest.mark.parametrize("regs,shared,want", [
    (72, 21504, 7),    # 72 x 32 = 2304 registers per warp, 9216 per CTA: 7 in 64K
    (70, 21504, 7),    # 2240 -> 2304 per warp (units of 256)
    (78, 21504, 6),    # 2496 -> 2560 per warp, 10240 per CTA: 6
    (40, 21504, 10),   # registers allow 12; 228 KiB / (21 + 1) KiB = 10
    (72, 100 << 10, 2),  # shared memory bound: 228 / 101
    (16, 1024, 16),    # capped at 16 CTAs of 4 warps (64 warps per SM)
])
def test_resident_ctas(regs, shared, want):
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared))
    assert _resident_ctas(kernel) == want


@pytest.mark.parametrize("tokens,row_tiles,slots,want", [
    # hand-computed: 524288 tiles / (5 x 924) = 113.5 -> 114; 18 programs of 114 cover 2048
    (256, 2048, 924, 114),
    # 65536 / 4620 -> 15 < 16: 16, 32 programs per token
    (128, 512, 924, 16),
    # 8192 / 4620 -> 2 < 16, and 16 tiles still fill half a wave (2 x 8192 / 924 -> 18):
    # 16, 8 programs per token
    (64, 128, 924, 16),
    # 2048 tiles of one token: 16 per program would be 128 programs, under half a wave;
    # 2 x 2048 / 924 -> 5, 410 programs of 5 (the last 3)
    (1, 2048, 924, 5),
    (1, 1, 924, 1),
])
def test_program_tiles_golden(tokens, row_tiles, slots, want):
    assert program_tiles(tokens, row_tiles, slots) == want


def test_program_tiles_properties():
    for tokens, row_tiles, slots in itertools.product((1, 3, 16, 64, 256, 1024), (1, 5, 64, 129, 512, 2048, 4096),
                                                      (132, 792, 924)):
        tiles = program_tiles(tokens, row_tiles, slots)
        per_token = -(-row_tiles // tiles)
        assert 1 <= tiles <= min(256, row_tiles)
        assert tiles * (per_token - 1) < row_tiles <= tiles * per_token  # no empty program
        assert tiles == -(-row_tiles // per_token)  # a token's programs are equally long
        work = tokens * row_tiles
        if 5 * slots * 32 <= work <= 5 * slots * 256 and row_tiles >= 256:
            assert tokens * per_token >= 4.8 * slots  # about five waves of programs
        if 2 * work >= 16 * slots:  # a program of 16 tiles would fill half a wave: none shorter
            assert per_token <= -(-row_tiles // 16)
