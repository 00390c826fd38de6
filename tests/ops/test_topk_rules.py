"""The register top-k's block-size rule (pure Python: runs without a GPU)."""

import itertools

import pytest

from deepinfer_vllm.ops.triton.topk import REG_MAX, choose_reg_reduction, reg_fits


@pytest.mark.parametrize("n,k,want", [
    # s1 = max(4096 / k, n / 4096) rounded up to a power of two, hand-computed
    (8192, 512, 8), (131072, 512, 32), (16384, 2048, 4),
    (131072, 2048, 8),   # 32 would gather 65536 entries: halved until k * s1 <= 16384
    (4096, 512, 1),      # s1 = 8 keeps 4096 of 4096 entries: no reduction
    (1 << 20, 512, None),  # 32768 block maxima do not fit, 64 blocks of 512 gather too many
    (1 << 20, 64, 64),     # more than 32 where the block maxima need it
])
def test_choose_reg_reduction_golden(n, k, want):
    assert choose_reg_reduction(n, k) == want


def test_choose_reg_reduction_properties():
    for n, k in itertools.product((1, 7, 300, 4096, 5000, 16384, 16385, 40000, 131072, 600000, 1 << 20),
                                  (1, 4, 64, 512, 2048, 8192)):
        s1 = choose_reg_reduction(n, k)
        if s1 is None:  # nothing fits: neither the whole row nor any block size
            assert not any(reg_fits(n, k, 1 << e) for e in range(0, 21))
            continue
        assert s1 & (s1 - 1) == 0 and reg_fits(n, k, s1)
        assert s1 <= 32 or -(-n // 32) > REG_MAX  # larger blocks only where 32 does not fit
        if s1 > 1 and n <= REG_MAX:  # a row that fits whole is reduced only to half or less
            assert 2 * k * s1 <= n
