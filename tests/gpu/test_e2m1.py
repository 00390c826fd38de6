"""ops/triton/e2m1.py: every e2m1 code times 2^-6 times fp16 factors, bit-exact against torch.

On the GPU the PTX path runs (``ASM=True``); under the interpreter the plain-arithmetic path,
which must give the same bits. Factors cover the two callers: powers of two 2^(6 - r) down to
fp16 subnormals (the indexer) and e4m3 scales times 64 (NVFP4 attention keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from conftest import INTERPRET
from deepinfer_vllm.ops.triton.e2m1 import e2m1_pairs_f16, e2m1_quads_f16

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _code_values(codes: torch.Tensor) -> torch.Tensor:
    mag = E2M1[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def _factors() -> torch.Tensor:
    pow2 = [2.0 ** (6 - r) for r in range(31)]
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 64
    return torch.cat([torch.tensor(pow2), e4m3[e4m3 > 0]]).to(torch.float16)


def _want(codes: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    # e2m1 * 2^-6 * f (f carries the 2^6) rounded once to fp16; the fp32 product is exact
    return (_code_values(codes) * f.float() / 64).to(torch.float16)


BLOCK = 1024


@triton.jit
def _pairs_kernel(p_ptr, f_ptr, lo_ptr, hi_ptr, N: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    lo, hi = e2m1_pairs_f16(tl.load(p_ptr + i), tl.load(f_ptr + i), ASM)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)


@triton.jit
def _quads_kernel(w_ptr, f_ptr, c_ptr, N: tl.constexpr, ASM: tl.constexpr):
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    c0, c1, c2, c3 = e2m1_quads_f16(tl.load(w_ptr + i), tl.load(f_ptr + i), ASM)
    tl.store(c_ptr + i, c0)
    tl.store(c_ptr + N + i, c1)
    tl.store(c_ptr + 2 * N + i, c2)
    tl.store(c_ptr + 3 * N + i, c3)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().view(torch.int16)


def test_pairs_every_byte_and_factor(device):
    f = _factors()
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(f.numel())
    fac = f.repeat_interleave(256)
    n = triton.cdiv(packed.numel(), BLOCK) * BLOCK
    packed = torch.cat([packed, torch.zeros(n - packed.numel(), dtype=torch.uint8)])
    fac = torch.cat([fac, torch.ones(n - fac.numel(), dtype=torch.float16)])
    lo = torch.full((n,), float("nan"), dtype=torch.float16, device=device)
    hi = torch.full_like(lo, float("nan"))
    _pairs_kernel[(n // BLOCK,)](packed.to(device), fac.to(device), lo, hi, N=n, ASM=not INTERPRET)
    assert torch.equal(_bits(lo), _bits(_want(packed & 15, fac)))
    assert torch.equal(_bits(hi), _bits(_want(packed >> 4, fac)))


def test_quads_every_word_and_some_factors(device):
    g = torch.Generator().manual_seed(0)
    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    f = _factors()
    fac = f[torch.randint(0, f.numel(), (words.numel(),), generator=g)]
    n = words.numel()
    out = torch.full((4 * n,), float("nan"), dtype=torch.float16, device=device)
    _quads_kernel[(n // BLOCK,)](words.to(device), fac.to(device), out, N=n, ASM=not INTERPRET)
    w = words.to(torch.int32) & 0xFFFF
    for c in range(4):
        assert torch.equal(_bits(out[c * n:(c + 1) * n]), _bits(_want((w >> (4 * c)) & 15, fac))), c
