"""The indexer query's RoPE + MXFP4 round trip: ``RopeTail(qdq="mxfp4")``'s reference is
``quant.mxfp4_qdq(apply_rope_tail(...))``, and the fused Triton kernel (``ops/triton/rope.py``)
gives the round trip of its own rotation bit for bit, on the CPU under Triton's interpreter
(subprocess: ``tests/ops/interpreted.py``), with blocks of zeros, values at MXFP4's amax floor,
e2m1 ties and negative zeros. ``tests/gpu/test_rope.py`` checks the same on the H200 at Flash's
shape (64 heads of 128, rotary 64).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.rope import RopeTail, apply_rope_tail, build_rope_cache
from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_kernels_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def K():
    return interpreted_module("deepinfer_vllm.ops.triton.rope")


def mxfp4_edge_rows(shape, seed: int) -> torch.Tensor:
    """bf16 rows ``shape`` (last dim a multiple of 32) whose 32-entry blocks include all zeros, values
    at MXFP4's amax floor, e2m1 ties (0.25 .. 6 times a power of two per block), negative zeros and a
    wide range of scales (also ``tests/gpu/test_rope.py``'s inputs)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-20, 21, (*shape[:-1], 1), generator=g).float())
    x = torch.randn(*shape, generator=g) * scales
    blocks = x.view(-1, 32)
    assert blocks.shape[0] >= 4
    blocks[0::7] = 0.0
    blocks[1::7] = torch.randn(blocks[1::7].shape, generator=g) * 2.0**-126
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    pick = torch.randint(0, ties.numel(), blocks[2::7].shape, generator=g)
    block_scale = torch.exp2(torch.randint(-8, 8, (blocks[2::7].shape[0], 1), generator=g).float())
    blocks[2::7] = ties[pick] * block_scale
    blocks[3::7, ::3] = -0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("shape,rotary", [((3, 4, 128), 64), ((2, 3, 96), 32), ((5, 64), 32)])
def test_fused_round_trip_is_bit_exact(K, shape, rotary):
    cache = build_rope_cache(rotary, 512, 10000.0)
    x = mxfp4_edge_rows(shape, sum(shape))
    pos = torch.randint(0, 512, shape[:1], generator=torch.Generator().manual_seed(2))
    got = K.rope_tail(x, pos, cache, qdq="mxfp4")
    want = quant.mxfp4_qdq(K.rope_tail(x, pos, cache))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    codes = quant.unpack_fp4(quant.mxfp4_quantize(K.rope_tail(x, pos, cache))[0])
    assert set(codes.unique().tolist()) >= {0, 1, 8}  # zeros, the smallest code, negative zero


@pytest.mark.parametrize("qdq", [None, "mxfp4"])
def test_in_place_writes_the_same_bits(K, qdq):
    cache = build_rope_cache(32, 512, 10000.0)
    x = mxfp4_edge_rows((3, 2, 96), 9)
    pos = torch.randint(0, 512, (3,), generator=torch.Generator().manual_seed(4))
    want = K.rope_tail(x, pos, cache, qdq=qdq)
    y = x.clone()
    assert K.rope_tail(y, pos, cache, qdq=qdq, in_place=True) is y
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    op = RopeTail("cpu", torch.bfloat16)  # the reference op: the same contract
    z = x.clone()
    assert op(z, pos, cache, False, qdq, True) is z
    assert torch.equal(z, op(x, pos, cache, False, qdq))


def test_reference_op_is_rope_then_mxfp4_qdq():
    """``RopeTail`` built for the CPU runs the reference: the rotation, then ``quant.mxfp4_qdq``."""
    op = RopeTail(torch.device("cpu"), torch.float32)
    cache = build_rope_cache(64, 512, 10000.0)
    x = mxfp4_edge_rows((3, 4, 128), 5)
    pos = torch.tensor([0, 17, 511])
    got = op(x, pos, cache, qdq="mxfp4")
    want = quant.mxfp4_qdq(apply_rope_tail(x, pos, cache))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(op(x, pos, cache), apply_rope_tail(x, pos, cache))
    with pytest.raises(ValueError, match="qdq must be"):
        op(x, pos, cache, qdq="nvfp4")


def test_op_runs_the_reference_where_the_kernel_cannot_round_trip(K, monkeypatch):
    """A rotated tail of 16 entries is not whole MXFP4 blocks: the Triton operator runs the reference."""
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    op = RopeTail(torch.device("cpu"), torch.bfloat16)
    assert op.backend == "triton"
    cache = build_rope_cache(16, 64, 10000.0)
    x = mxfp4_edge_rows((3, 2, 64), 9)
    pos = torch.tensor([1, 5, 9])
    want = quant.mxfp4_qdq(apply_rope_tail(x, pos, cache))
    assert torch.equal(op(x, pos, cache, qdq="mxfp4").view(torch.int16), want.view(torch.int16))
