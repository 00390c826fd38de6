"""RoPE on the tail of every head in one launch (reference: ``ops.rope.apply_rope_tail``).

The reference is a dozen small kernels per call (gather, slices, four products, stack,
cast, concatenation) and the attention calls it six times per layer. Here one program per
token and block of heads reads the position's cos/sin row once, rotates the GPT-J pairs of
the last ``rotary_dim`` entries in fp32, rounds once and copies the leading entries.
The products may be fused into FMAs, so a rotated entry can differ from the reference in
its last fp32 bit before the rounding (``tests/gpu/test_rope.py`` states the tolerance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.mhc import _narrow

__all__ = ["rope_tail"]


@triton.jit
def _rope_tail_kernel(
    x_ptr,
    pos_ptr,
    cache_ptr,
    out_ptr,
    H,
    D,
    x_stride_t,
    x_stride_h,
    SIGN: tl.constexpr,  # +1 forward, -1 inverse rotation
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    i = tl.arange(0, HALF)
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + p * (2 * HALF) + i)[None, :]
    sin = tl.load(cache_ptr + p * (2 * HALF) + HALF + i)[None, :] * SIGN
    src = x_ptr + t * x_stride_t + h.to(tl.int64)[:, None] * x_stride_h
    dst = out_ptr + (t * H + h.to(tl.int64)[:, None]) * D
    nope = D - 2 * HALF
    m2 = hm[:, None] & (i >= 0)[None, :]
    a = tl.load(src + nope + 2 * i[None, :], mask=m2, other=0.0).to(tl.float32)
    b = tl.load(src + nope + 2 * i[None, :] + 1, mask=m2, other=0.0).to(tl.float32)
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    tl.store(dst + nope + 2 * i[None, :], _narrow(ra, OUT_BF16).to(out_ptr.dtype.element_ty), mask=m2)
    tl.store(dst + nope + 2 * i[None, :] + 1, _narrow(rb, OUT_BF16).to(out_ptr.dtype.element_ty), mask=m2)
    c = tl.arange(0, BD)
    for c0 in range(0, nope, BD):
        cm = hm[:, None] & (c0 + c < nope)[None, :]
        tl.store(dst + c0 + c[None, :], tl.load(src + c0 + c[None, :], mask=cm), mask=cm)


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``apply_rope_tail`` for ``x [T, D]`` or ``[T, H, D]`` with one position per token
    (``positions [T]``); a new tensor in ``x.dtype``."""
    if x.dim() not in (2, 3) or positions.shape != x.shape[:1]:
        raise ValueError(
            f"x [T, D] or [T, H, D] with positions [T] expected, got {tuple(x.shape)}, "
            f"{tuple(positions.shape)}"
        )
    rotary = cache.shape[-1]
    D = x.shape[-1]
    if D < rotary or rotary & (rotary - 1) or cache.dtype != torch.float32:
        raise ValueError(f"rotary_dim {rotary} must be a power of two <= {D} with an fp32 cache")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    T, H, _ = x3.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T and H:
        bh = min(16, triton.next_power_of_2(H))
        _rope_tail_kernel[(T, triton.cdiv(H, bh))](
            x3,
            positions.contiguous(),
            cache.contiguous(),
            out,
            H,
            D,
            x3.stride(0),
            x3.stride(1),
            SIGN=-1.0 if inverse else 1.0,
            HALF=rotary // 2,
            BH=bh,
            BD=128,
            OUT_BF16=x.dtype == torch.bfloat16,
            num_warps=4,
        )
    return out.view(x.shape)
