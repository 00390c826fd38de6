"""``ops/npu.py`` (RMSNorm and RoPE on ``torch_npu``'s fused operators) against the references,
with ``torch_npu`` replaced by emulations of its documented formulas (``tests/fake_torch_npu.py``):
this checks the wrappers' layout, mode, signs and dtypes, not CANN's kernels (no NPU here)."""

from __future__ import annotations

import sys

import pytest
import torch
from fake_torch_npu import make

from deepinfer_vllm.ops import npu
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.rope import apply_rope_tail, build_rope_cache


@pytest.fixture
def fake(monkeypatch):
    module = make()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(fake, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 512, generator=g) * 3).to(dtype)
    w = torch.randn(512, generator=g).to(torch.bfloat16)
    got, ref = npu.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)  # fp32 statistics, one rounding: the reference's numerics
    else:
        # The operator keeps fp32 statistics where the fp32 reference uses fp64 (so fp32
        # models keep the reference in ``auto``): within 1.6e-6 relative, about 13 fp32 ulps.
        assert got.dtype == ref.dtype and torch.allclose(got, ref, rtol=1.6e-6, atol=0)
    assert fake.calls == ["npu_rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 64), (9, 4, 192), (9, 3, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_tail_matches_reference_bit_for_bit(fake, dtype, shape, inverse):
    """Same products and sums as the reference (fp32 in, one rounding), so equal bits."""
    g = torch.Generator().manual_seed(1)
    yarn = {
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1
    }
    cache = build_rope_cache(64, 4096, 10000.0, yarn)
    x = torch.randn(*shape, generator=g).to(dtype)
    positions = torch.randint(0, 4096, shape[:1], generator=g)
    got = npu.rope_tail(x, positions, cache, inverse=inverse)
    assert got.dtype == dtype and torch.equal(got, apply_rope_tail(x, positions, cache, inverse=inverse))
    assert fake.calls == ["npu_rotary_mul"]


def test_rope_tail_round_trip_and_untouched_head(fake):
    cache = build_rope_cache(64, 128, 10000.0)
    x = torch.randn(5, 2, 192, dtype=torch.float64).float()
    positions = torch.tensor([0, 3, 17, 64, 127])
    y = npu.rope_tail(x, positions, cache)
    assert torch.equal(y[..., :128], x[..., :128]) and not torch.equal(y[..., 128:], x[..., 128:])
    assert torch.allclose(npu.rope_tail(y, positions, cache, inverse=True), x, atol=1e-5)


@pytest.mark.parametrize("shape", [(4096, 64), (4096, 128, 64), (1, 128, 64)])
def test_rope_tail_layout_is_one_the_operator_documents(fake, monkeypatch, shape):
    """``npu_rotary_mul`` reads its layout from the shapes. Interleave mode documents, for
    A2/A3, SBND ``x`` with S11D ``cos``/``sin`` and ``B * N < 1000``; the 950 asks only that
    the tables broadcast to ``x`` (D <= 1024). The wrapper passes tokens on S (the leading
    axis) and heads on B, so a 4096-token prefill of 128 heads stays within both."""
    seen = []
    emulate = fake.npu_rotary_mul

    def record(x, r1, r2, rotary_mode="half"):
        seen.append((tuple(x.shape), tuple(r1.shape), tuple(r2.shape), rotary_mode))
        return emulate(x, r1, r2, rotary_mode)

    monkeypatch.setattr(fake, "npu_rotary_mul", record)
    cache = build_rope_cache(64, 8192, 10000.0)
    x = torch.randn(*shape).to(torch.bfloat16)
    positions = torch.randint(0, 8192, shape[:1])
    npu.rope_tail(x, positions, cache)
    [(xs, r1, r2, mode)] = seen
    tokens, heads = shape[0], (shape[1] if len(shape) == 3 else 1)
    assert mode == "interleave" and xs == (tokens, heads, 1, 64)  # S, B, N, D
    assert r1 == r2 == (tokens, 1, 1, 64)  # S11D
    assert xs[1] * xs[2] < 1000 and xs[3] % 2 == 0 and xs[3] < 896
    assert torch.broadcast_shapes(xs, r1) == xs


def test_rope_tail_refuses_what_the_operator_does_not_take(fake):
    cache = build_rope_cache(64, 16, 10000.0)
    with pytest.raises(ValueError, match="fewer than 1000 heads.*got 1000 heads"):
        npu.rope_tail(torch.zeros(2, 1000, 64), torch.zeros(2, dtype=torch.long), cache)
    odd = torch.zeros(16, 63)
    with pytest.raises(ValueError, match="even rotary_dim.*rotary_dim 63"):
        npu.rope_tail(torch.zeros(2, 4, 63), torch.zeros(2, dtype=torch.long), odd)
    assert fake.calls == []


def test_rope_tail_refuses_other_shapes_by_name(fake):
    cache = build_rope_cache(64, 16, 10000.0)
    with pytest.raises(ValueError, match=r"positions \[T\]"):
        npu.rope_tail(torch.zeros(4, 2, 64), torch.zeros(4, 2, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="smaller than rotary_dim"):
        npu.rope_tail(torch.zeros(4, 32), torch.zeros(4, dtype=torch.long), cache)
    assert fake.calls == []
