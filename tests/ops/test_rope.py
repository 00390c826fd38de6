import cmath
import math

import pytest
import torch

from deepinfer_vllm.ops.rope import apply_rope_tail, build_rope_cache, rope_inv_freq, yarn_correction_range

FLASH_YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
              "original_max_position_embeddings": 65536}
TINY_YARN = {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
             "original_max_position_embeddings": 1024}


def test_yarn_bounds():
    assert yarn_correction_range(64, 160000, 32, 1, 65536) == (15, 25)
    assert yarn_correction_range(64, 160000, 32, 1, 1024) == (4, 14)


@pytest.mark.parametrize("scaling,lowhigh,factor", [(FLASH_YARN, (15, 25), 16.0), (TINY_YARN, (4, 14), 4.0)])
def test_yarn_inv_freq(scaling, lowhigh, factor):
    inv = rope_inv_freq(64, 160000, scaling).double()
    low, high = lowhigh
    for i in range(32):
        base = 160000.0 ** (-2 * i / 64)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        want = base * (1 - ramp) + base / factor * ramp
        assert math.isclose(inv[i].item(), want, rel_tol=2e-6)
    assert math.isclose(inv[0].item(), 1.0) and math.isclose(inv[31].item(), 160000.0 ** (-62 / 64) / factor, rel_tol=2e-6)


def test_cache_layout_and_position_zero():
    cache = build_rope_cache(64, 50, 10000.0, None)
    assert cache.dtype == torch.float32 and cache.shape == (50, 64)
    assert torch.equal(cache[0, :32], torch.ones(32)) and torch.equal(cache[0, 32:], torch.zeros(32))
    for p in (1, 7, 49):
        for i in (0, 5, 31):
            ang = p * 10000.0 ** (-2 * i / 64)
            assert math.isclose(cache[p, i].item(), math.cos(ang), abs_tol=3e-6)
            assert math.isclose(cache[p, 32 + i].item(), math.sin(ang), abs_tol=3e-6)


def test_pair_rotation_is_complex_multiply():
    # D = 10, rotary_dim = 4: dims 0..5 untouched, pairs (6,7) and (8,9) rotated
    cache = build_rope_cache(4, 20, 100.0, None)
    x = torch.arange(30, dtype=torch.float32).view(3, 10) / 7 - 1
    pos = torch.tensor([0, 3, 17])
    y = apply_rope_tail(x, pos, cache)
    assert torch.equal(y[:, :6], x[:, :6])
    for t in range(3):
        for j in range(2):
            theta = 100.0 ** (-2 * j / 4)
            z = complex(x[t, 6 + 2 * j].item(), x[t, 7 + 2 * j].item()) * cmath.exp(1j * pos[t].item() * theta)
            assert math.isclose(y[t, 6 + 2 * j].item(), z.real, abs_tol=1e-5)
            assert math.isclose(y[t, 7 + 2 * j].item(), z.imag, abs_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inverse_and_head_broadcast(dtype):
    g = torch.Generator().manual_seed(1)
    cache = build_rope_cache(64, 4096, 160000.0, TINY_YARN)
    x = torch.randn(6, 3, 512, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 2, 100, 1023, 4095])
    y = apply_rope_tail(x, pos, cache)
    assert y.dtype == dtype
    assert torch.equal(y[..., :448], x[..., :448])
    per_row = apply_rope_tail(x, pos.view(6, 1).expand(6, 3), cache)
    assert torch.equal(per_row, y)  # positions [T] broadcast over heads == explicit [T, H]
    flat = apply_rope_tail(x[:, 1], pos, cache)  # [T, D] with positions [T]
    assert torch.equal(flat, y[:, 1])
    back = apply_rope_tail(y, pos, cache, inverse=True)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(back.float(), x.float(), rtol=tol, atol=tol)
    # position 0 is the identity
    assert torch.equal(y[0], x[0])
