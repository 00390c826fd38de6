"""ops/triton/rope.py against ``ops.rope.apply_rope_tail``.

Same fp32 rotation; the kernel may fuse a product into an FMA, so a rotated bf16 entry is
within one bf16 ulp of the reference (at least 99% identical) and the leading (NoPE)
entries are copied bit for bit; fp32 inputs within 2 fp32 ulps of |x|. The inverse rotation
undoes the forward one as the reference's does.
"""

from __future__ import annotations

import pytest
import torch
from conftest import shapes
from test_mhc import assert_within_one_ulp

from deepinfer_vllm.ops.rope import apply_rope_tail, build_rope_cache
from deepinfer_vllm.ops.triton.rope import rope_tail
from tests.ops.test_rope_triton import mxfp4_edge_rows

CASES = shapes(
    [((5, 32), 16), ((7, 3, 48), 16), ((2, 17, 64), 64), ((4, 3, 49), 16)],  # 49: pairs not word-aligned
    [((64, 64, 512), 64), ((300, 512), 64)],
)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape,rotary", CASES)
def test_rope_tail_matches_reference(device, shape, rotary, inverse):
    g = torch.Generator().manual_seed(sum(shape))
    cache = build_rope_cache(rotary, 4096, 10000.0).to(device)
    x = (torch.randn(*shape, generator=g) * 4).to(torch.bfloat16).to(device)
    pos = torch.randint(0, 4096, shape[:1], generator=g).to(device)
    got = rope_tail(x, pos, cache, inverse)
    want = apply_rope_tail(x, pos, cache, inverse)
    nope = shape[-1] - rotary
    assert torch.equal(got[..., :nope], want[..., :nope])
    assert_within_one_ulp(got, want)


@pytest.mark.parametrize("qdq", [None, "mxfp4"])
@pytest.mark.parametrize(
    "shape,rotary", shapes([((4, 3, 64), 32)], [((64, 64, 512), 64), ((300, 64, 128), 64)])
)
def test_rope_tail_in_place_equals_out_of_place(device, shape, rotary, qdq):
    """``in_place`` writes the same bits into ``x`` (leading entries untouched without ``qdq``)."""
    cache = build_rope_cache(rotary, 4096, 10000.0).to(device)
    x = mxfp4_edge_rows(shape, sum(shape) + 5).to(device)
    pos = torch.randint(0, 4096, shape[:1], generator=torch.Generator().manual_seed(3)).to(device)
    want = rope_tail(x, pos, cache, qdq=qdq)
    y = x.clone()
    got = rope_tail(y, pos, cache, qdq=qdq, in_place=True)
    assert got.data_ptr() == y.data_ptr()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    strided = torch.zeros(shape[0], 2 * shape[1], shape[2], dtype=x.dtype, device=device)[:, ::2]
    strided.copy_(x)
    rope_tail(strided, pos, cache, inverse=True, in_place=True)
    assert torch.equal(strided.view(torch.int16), rope_tail(x, pos, cache, inverse=True).view(torch.int16))


def test_rope_tail_fp32_and_strided(device):
    g = torch.Generator().manual_seed(3)
    cache = build_rope_cache(16, 64, 10000.0).to(device)
    x = torch.randn(6, 4, 40, generator=g).to(device)[:, ::2]  # strided heads
    pos = torch.arange(6, device=device) * 7
    got, want = rope_tail(x, pos, cache), apply_rope_tail(x, pos, cache)
    assert torch.allclose(got, want, rtol=0, atol=2.5e-7 * x.abs().max().item())


def test_rope_tail_refuses_per_head_positions(device):
    cache = build_rope_cache(16, 64, 10000.0).to(device)
    x = torch.zeros(3, 2, 32, device=device)
    with pytest.raises(ValueError, match="positions \\[T\\]"):
        rope_tail(x, torch.zeros(3, 2, dtype=torch.long, device=device), cache)


QDQ_CASES = shapes(
    [((3, 2, 64), 32), ((4, 3, 96), 32), ((2, 5, 128), 64)], [((64, 64, 128), 64), ((300, 64, 128), 64)]
)


@pytest.mark.parametrize("shape,rotary", QDQ_CASES)
def test_rope_tail_mxfp4_round_trip_is_bit_exact(device, shape, rotary):
    """The fused round trip equals ``quant.mxfp4_qdq`` of the kernel's own rotation bit for bit (the
    rotation itself may differ from the reference's by FMA contraction: compared on the same values)."""
    from deepinfer_vllm.ops import quant

    cache = build_rope_cache(rotary, 4096, 10000.0).to(device)
    x = mxfp4_edge_rows(shape, sum(shape)).to(device)
    pos = torch.randint(0, 4096, shape[:1], generator=torch.Generator().manual_seed(1)).to(device)
    rotated = rope_tail(x, pos, cache)
    got = rope_tail(x, pos, cache, qdq="mxfp4")
    want = quant.mxfp4_qdq(rotated)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_rope_tail_refuses_bad_round_trips(device):
    cache = build_rope_cache(16, 64, 10000.0).to(device)
    x = torch.zeros(3, 2, 48, dtype=torch.bfloat16, device=device)
    pos = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="qdq must be"):
        rope_tail(torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=device), pos, cache, qdq="nvfp4")
    with pytest.raises(ValueError, match="multiples of 32"):
        rope_tail(x, pos, cache, qdq="mxfp4")
