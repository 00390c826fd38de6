"""PyTorch references of the two weight GEMMs on V4.1's released formats.

* ``fp8_block_gemm``: ``x @ W.T`` for a dense FP8 E4M3 weight ``[N, K]`` with one UE8M0
  scale per 32x32 tile ``[N/32, K/32]``.
* ``grouped_fp4_gemm``: routed experts, packed E2M1 ``[E, N, K/2]`` (element ``2i`` in
  the low nibble) with UE8M0 per 1x32 ``[E, N, K/32]``; rows of ``x`` grouped by expert.

Activations: ``act="bf16"`` multiplies ``x`` as given; ``act="mxfp8"`` first replaces it by
``mxfp8_dequantize(mxfp8_quantize(x))`` (e4m3 values with a UE8M0 scale per 1x32 along K,
what DeepInfer feeds its FP8 GEMMs). Weights are decoded exactly (``ops.quant``), products
are accumulated in ``ops.numerics.acc_dtype(x.dtype)`` (fp32 for bf16 activations, fp64 for
fp32 ones, as every reference here) through ``ops.numerics.matmul``, and rounded once to
``out_dtype`` (default ``x.dtype``). The model's expert-by-expert path
(``ops.weight_gemm``) computes the same products the same way.

The Triton kernels (``ops/triton/fp8_gemm.py``, ``ops/triton/moe_gemm.py``) take the same
arguments. They sum in another order, so they agree within fp32 summation error, not bit
for bit. Imports no vLLM.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import quant
from .numerics import acc_dtype, matmul

__all__ = [
    "ACT_MODES",
    "activations",
    "fp8_block_gemm",
    "from_tile_order",
    "grouped_fp4_gemm",
    "tile_order_columns",
    "to_tile_order",
]

ACT_MODES = ("bf16", "mxfp8")


def tile_order_columns() -> Tensor:
    """int64 ``[128]``: the column of a 128-column tile of activations that each place holds when the GPU
    GEMMs stage them (``ops/triton/moe_gemm_gluon.py``): place ``16s + 8h + 2q + e`` holds column ``32q + 8t +
    j + 4e`` with ``t = s // 2``, ``j = 2 (s % 2) + h``: the places of 32-column block ``q`` are those with
    ``(p // 2) % 4 == q`` (so a per-32-column format such as MXFP8 must be applied before the reordering, not
    after)."""
    p = torch.arange(128)
    s, h, q, e = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
    return 32 * q + 8 * (s // 2) + 2 * (s % 2) + h + 4 * e


def _tile_index(k: int, device: torch.device, inverse: bool) -> Tensor:
    if k % 128:
        raise ValueError(f"the tile order needs a multiple of 128 columns, got {k}")
    cols = tile_order_columns()
    if inverse:
        cols = torch.argsort(cols)
    return (torch.arange(k // 128)[:, None] * 128 + cols[None, :]).flatten().to(device)


def to_tile_order(x: Tensor) -> Tensor:
    """``x [..., K]`` with each 128-column tile in the staging order (``tile_order_columns``)."""
    return x[..., _tile_index(x.shape[-1], x.device, inverse=False)]


def from_tile_order(x: Tensor) -> Tensor:
    """The inverse of ``to_tile_order``."""
    return x[..., _tile_index(x.shape[-1], x.device, inverse=True)]


def activations(x: Tensor, act: str) -> Tensor:
    """The activations a GEMM multiplies, in the accumulation dtype: ``x`` itself or its
    MXFP8 round trip (exact in either dtype)."""
    if act not in ACT_MODES:
        raise ValueError(f"act must be one of {ACT_MODES}, got {act!r}")
    acc = acc_dtype(x.dtype)
    if act == "mxfp8":
        return quant.mxfp8_dequantize(*quant.mxfp8_quantize(x), dtype=acc)
    return x.to(acc)


def _check_x(x: Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
    if k % quant.MX_BLOCK:
        raise ValueError(f"K must be a multiple of {quant.MX_BLOCK}, got {k}")


def fp8_block_gemm(
    x: Tensor, weight: Tensor, scale: Tensor, act: str = "bf16", out_dtype: torch.dtype | None = None
) -> Tensor:
    """``x [M, K] @ W.T`` with ``W = dequant_fp8_block(weight [N, K], scale [N/32, K/32])``.

    Products and sums in the accumulation dtype, one rounding to ``out_dtype`` (default
    ``x.dtype``)."""
    n, k = weight.shape
    _check_x(x, k)
    xa = activations(x, act)
    w = quant.dequant_fp8_block(weight, scale, 32, xa.dtype)
    return matmul(xa, w).to(out_dtype or x.dtype)


def grouped_fp4_gemm(
    x: Tensor,
    expert_offsets: Tensor,
    weight: Tensor,
    scale: Tensor,
    act: str = "bf16",
    out_dtype: torch.dtype | None = None,
    *,
    rows: Tensor | None = None,
    x_tile_ordered: bool = False,
) -> Tensor:
    """Rows ``expert_offsets[e]:expert_offsets[e+1]`` of ``x [R, K]`` (with ``rows [R]``: of
    ``x[rows]``) times expert ``e``'s decoded ``W_e.T`` (``weight [E, N, K/2]``, ``scale
    [E, N, K/32]``) -> ``[R, N]``. ``x_tile_ordered``: ``x``'s columns are in the staging order
    (``to_tile_order(x)``, as a kernel that writes them for the GPU GEMM gives them).

    ``expert_offsets`` is ``[E+1]``, ``offsets[0] == 0``, nondecreasing, ``offsets[-1] <= R``; rows past
    ``offsets[-1]`` are zero. Same accumulation and rounding as ``fp8_block_gemm``.
    (A reference: it reads the offsets on the host.)"""
    e_count, n, kh = weight.shape
    k = 2 * kh
    _check_x(x, k)
    if x_tile_ordered:
        x = from_tile_order(x)
    if rows is not None:
        x = x[rows]
    if expert_offsets.shape != (e_count + 1,):
        raise ValueError(f"expert_offsets must be [{e_count + 1}], got {tuple(expert_offsets.shape)}")
    offs = [int(v) for v in expert_offsets.tolist()]
    if any(b < a for a, b in zip(offs, offs[1:])) or offs[0] != 0 or offs[-1] > x.shape[0]:
        raise ValueError(
            f"expert_offsets must start at 0, be nondecreasing and end <= {x.shape[0]}, got {offs}"
        )
    xa = activations(x, act)
    out = torch.zeros(x.shape[0], n, dtype=xa.dtype, device=x.device)
    for e in range(e_count):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = matmul(xa[lo:hi], quant.dequant_fp4_rows(weight[e], scale[e], xa.dtype))
    return out.to(out_dtype or x.dtype)
