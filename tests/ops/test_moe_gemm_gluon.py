"""``moe_gemm_gluon.x_tile_order`` (the rewrite of ``x`` in the Gluon GEMMs' staging order) on the CPU under
Triton's interpreter, against the gather the kernels do without it, written out here from their docstrings:
in each 128-column tile, shared-memory pair ``P = 8s + 4h + q`` holds ``x``'s column pair ``16q + 2s + h``
(columns ``2 pair`` and ``2 pair + 1``). The Gluon kernels themselves need sm90 (``tests/gpu``, where
``X_TILED`` must give the same bits as the gathers).
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


def staged_by_gather(x: torch.Tensor) -> torch.Tensor:
    """What the kernels' 4-byte gathers place in shared memory, tile after tile: bf16 [M, C]."""
    m, c = x.shape
    out = torch.empty_like(x)
    for t in range(c // 128):
        for s in range(8):
            for h in range(2):
                for q in range(4):
                    logical, physical = 8 * s + 4 * h + q, 16 * q + 2 * s + h
                    dst, src = t * 128 + 2 * logical, t * 128 + 2 * physical
                    out[:, dst : dst + 2] = x[:, src : src + 2]
    return out


# (row, 128-column tile) items over programs of 32, the last one partial: 1, 6, 45, 34, 85 and 16900 items
@pytest.mark.parametrize("m,c", [(1, 128), (3, 256), (5, 1152), (2, 2048 + 128), (17, 640), (16900, 128)])
def test_x_tile_order_is_the_gather(G, m, c):
    g = torch.Generator().manual_seed(m * c)
    x = torch.randn(m, c, generator=g).bfloat16()
    got = G.x_tile_order(x)
    assert got.dtype == torch.int32 and got.shape == (m, c // 2)
    assert torch.equal(got.view(torch.bfloat16), staged_by_gather(x))
    # every value kept once: the rewrite is a permutation inside each tile
    for t in range(c // 128):
        tile = slice(t * 128, (t + 1) * 128)
        assert torch.equal(got.view(torch.bfloat16)[:, tile].sort(-1).values, x[:, tile].sort(-1).values)


def test_x_tile_order_strided_rows(G):
    """Rows of a wider tensor (``x`` as the activations come: a view with a row stride)."""
    wide = torch.randn(4, 640).bfloat16()
    x = wide[:, 128:512]
    assert torch.equal(G.x_tile_order(x).view(torch.bfloat16), staged_by_gather(x.contiguous()))


def test_x_tile_order_refuses_what_the_kernels_cannot_take(G):
    with pytest.raises(ValueError, match="multiple of 128"):
        G.x_tile_order(torch.zeros(2, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 128"):
        G.x_tile_order(torch.zeros(2, 128))
    assert G.x_tile_order(torch.zeros(0, 256, dtype=torch.bfloat16)).shape == (0, 128)
