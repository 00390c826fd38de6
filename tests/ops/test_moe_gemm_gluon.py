"""``moe_gemm_gluon.x_tile_order`` (the rewrite of ``x`` in the Gluon GEMMs' staging order) on the CPU under
Triton's interpreter, against the order written out here from the kernels' docstrings: in each 128-column
tile, place ``16s + 8h + 2q + e`` holds column ``32q + 8t + j + 4e`` with ``t = s // 2``,
``j = 2 (s % 2) + h``. The Gluon kernels themselves need sm90 (``tests/gpu``); that their decoded weights
land where this order puts the ``x`` they multiply is checked on the CPU in ``test_e2m1_ptx.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_kernels_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def G():
    return interpreted_module("deepinfer_vllm.ops.triton.moe_gemm_gluon")


def staged(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each 128-column tile in the staging order: bf16 [M, C]."""
    m, c = x.shape
    out = torch.empty_like(x)
    for t in range(c // 128):
        for s in range(8):
            for h in range(2):
                for q in range(4):
                    for e in range(2):
                        src = 32 * q + 8 * (s // 2) + 2 * (s % 2) + h + 4 * e
                        out[:, t * 128 + 16 * s + 8 * h + 2 * q + e] = x[:, t * 128 + src]
    return out


# (row, 128-column tile) items over programs of 32, the last one partial: 1, 6, 45, 34, 85 and 16900 items
@pytest.mark.parametrize("m,c", [(1, 128), (3, 256), (5, 1152), (2, 2048 + 128), (17, 640), (16900, 128)])
def test_x_tile_order_is_the_staging_order(G, m, c):
    g = torch.Generator().manual_seed(m * c)
    x = torch.randn(m, c, generator=g).bfloat16()
    got = G.x_tile_order(x)
    assert got.dtype == torch.int32 and got.shape == (m, c // 2)
    assert torch.equal(got.view(torch.bfloat16), staged(x))
    # every value kept once: the rewrite is a permutation inside each tile
    for t in range(c // 128):
        tile = slice(t * 128, (t + 1) * 128)
        assert torch.equal(got.view(torch.bfloat16)[:, tile].sort(-1).values, x[:, tile].sort(-1).values)


def test_x_tile_order_strided_rows(G):
    """Rows of a wider tensor (``x`` as the activations come: a view with a row stride)."""
    wide = torch.randn(4, 640).bfloat16()
    x = wide[:, 128:512]
    assert torch.equal(G.x_tile_order(x).view(torch.bfloat16), staged(x.contiguous()))


def test_x_tile_order_refuses_what_the_kernels_cannot_take(G):
    with pytest.raises(ValueError, match="multiple of 128"):
        G.x_tile_order(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        G.x_tile_order(torch.zeros(2, 128))
    assert G.x_tile_order(torch.zeros(0, 256, dtype=torch.bfloat16)).shape == (0, 128)
