"""The MoE's clamped SwiGLU in one launch: ``ops.moe.SwiGlu``'s kernel.

Reference: ``(ops.moe.swiglu_clamped(gate, up, limit) * row_weight[:, None]).to(out_dtype)``
(the routing weight optional). Eagerly that is eight or nine launches per site (two widening
casts, two clamps, SiLU, the product, the weight's cast and product, the final cast), each
reading and writing the whole ``[N, W]`` activation in fp32. Here one program per block of
rows and columns reads ``gate`` and ``up`` through their strides (typically the two halves of
the gate/up GEMM's ``[N, 2W]`` output: nothing is copied), computes in fp32 and rounds once.

Numerics (the reference's fp32 operations, one by one, in its order):
  * ``g = min(gate, L)``, ``u = min(max(up, -L), L)`` as ``torch.clamp`` (NaN passes through);
  * ``silu(g) = g / (1 + exp(-g))``, the formula of torch's CUDA and CPU kernels, with an IEEE
    division (``div_rn``) and, on the GPU, libdevice's ``expf`` (the CUDA math library's, which
    torch's kernel calls; launched with ``enable_reflect_ftz=False`` as torch does not flush
    subnormals, and ``enable_fp_fusion=False``);
  * ``silu(g) * u``, then ``* row_weight`` (each one fp32 rounding), then one rounding to
    ``out_dtype``: bf16 by bits, to nearest even (``_narrow``; Triton's interpreter truncates in
    ``.to(tl.bfloat16)``).
So on the GPU the result is the reference's bit for bit (``tests/gpu/test_swiglu.py`` checks
SiLU on every bf16 gate value). Under ``TRITON_INTERPRET=1`` (CPU) there is no libdevice:
``exp`` is evaluated in fp64 and rounded to fp32 (correctly rounded), which reproduces torch's
scalar CPU SiLU (glibc's ``expf``; the batch-invariant reference runs it, ``ops.numerics.pointwise``)
on every bf16 gate value; torch's SIMD SiLU differs from its scalar one on 122 of the 65280 finite
bf16 values here (torch 2.13, by a few fp32 ulps), which after the bf16 rounding moves an output
by at most one ulp. Elementwise: a row's bits never depend on the batch. No host synchronisation.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.stored_gemm import widen_bf16

__all__ = ["IN_DTYPES", "OUT_DTYPES", "swiglu"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH = {} if _INTERPRET else dict(enable_fp_fusion=False, enable_reflect_ftz=False)
# Input (gate/up) dtypes, widened exactly to fp32, and output dtypes, rounded to nearest even
# as torch's ``.to`` rounds.
IN_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_W = 1024
_BLOCK_ELEMS = 4096  # elements per program (rows x columns)
_WARPS = 8

if _INTERPRET:

    @triton.jit
    def _exp(a):
        # exp in fp64 rounded to fp32 (correctly rounded: glibc's expf's bits); what rounds past
        # fp32's largest value is inf, set before the cast (numpy warns on overflowing casts)
        e = tl.exp(tl.minimum(a.to(tl.float64), 89.0))
        return tl.where(e >= 3.4028235677973366e38, float("inf"), e).to(tl.float32)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(a):
        return libdevice.exp(a)


@triton.jit
def _widen(v, IN_BF16: tl.constexpr):
    """bf16 / fp16 -> fp32, exact (bf16 by its bits: the interpreter's cast mangles subnormals)."""
    if IN_BF16:
        return widen_bf16(v)
    return v.to(tl.float32)


@triton.jit
def _narrow(v, OUT_BF16: tl.constexpr):
    """fp32 ``v`` as bf16, to nearest even, by bits (NaN: bf16's quiet NaN), when ``OUT_BF16``
    (the interpreter's cast truncates and mangles subnormals); other dtypes round in the store."""
    out = v
    if OUT_BF16:
        b = v.to(tl.int32, bitcast=True)
        b = tl.where(v == v, (b + 0x7FFF + ((b >> 16) & 1)) >> 16, 0x7FC0)
        out = b.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _swiglu_kernel(
    gate_ptr,
    up_ptr,
    w_ptr,
    out_ptr,
    N,
    W,
    stride_gr,
    stride_gc,
    stride_ur,
    stride_uc,
    stride_w,
    limit,
    live_ptr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    IN_BF16: tl.constexpr,
    OUT_BF16: tl.constexpr,
    HAS_LIVE: tl.constexpr,  # rows at or past *live_ptr are not computed
    TILE_ORDER: tl.constexpr,  # columns stored in the GPU GEMMs' staging order (W a multiple of 128)
    PDL: tl.constexpr,
):
    """Rows ``pid0 * BLOCK_R ...``, columns ``pid1 * BLOCK_W ...`` of the activation."""
    grid_wait(PDL)
    n_rows = N
    if HAS_LIVE:
        n_rows = tl.minimum(tl.load(live_ptr).to(tl.int32), N)
    if tl.program_id(0) * BLOCK_R >= n_rows:
        return
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rows = r.to(tl.int64)[:, None]
    cols = c[None, :]
    m = (r < n_rows)[:, None] & (cols < W)
    g = _widen(tl.load(gate_ptr + rows * stride_gr + cols * stride_gc, mask=m, other=0.0), IN_BF16)
    u = _widen(tl.load(up_ptr + rows * stride_ur + cols * stride_uc, mask=m, other=0.0), IN_BF16)
    if HAS_LIMIT:
        g = tl.where(g > limit, limit, g)
        u = tl.where(u < -limit, -limit, u)
        u = tl.where(u > limit, limit, u)
    a = tl.div_rn(g, 1.0 + _exp(-g)) * u
    if HAS_WEIGHT:
        a = a * tl.load(w_ptr + r.to(tl.int64) * stride_w, mask=r < N, other=0.0)[:, None]
    if TILE_ORDER:
        # column 32q + 8t + 4e + 2j1 + j0 of a 128-column tile goes to place 32t + 16j1 + 8j0 + 2q + e
        # (``quant_gemm.tile_order_columns``, inverted)
        cc = cols % 128
        place = 32 * ((cc // 8) % 4) + 16 * ((cc // 2) % 2) + 8 * (cc % 2) + 2 * (cc // 32) + (cc // 4) % 2
        cols = cols - cc + place
    tl.store(out_ptr + rows * W + cols, _narrow(a, OUT_BF16).to(out_ptr.dtype.element_ty), mask=m)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None,
    row_weight: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    live_rows: torch.Tensor | None = None,
    tile_order: bool = False,
) -> torch.Tensor:
    """``(swiglu_clamped(gate, up, limit) * row_weight[..., None]).to(out_dtype)`` in one launch.

    ``gate``, ``up``: ``[..., W]`` of one shape and dtype (``IN_DTYPES``; fp32 arithmetic), any
    strides; ``row_weight``: ``[...]`` (one per row; cast to fp32 first, as the reference does) or
    None; ``limit=None``: no clamp. Returns a new contiguous tensor of ``out_dtype``
    (``OUT_DTYPES``). ``live_rows``: a one-element integer tensor; rows (of the 2-D view) at or past
    its value are not computed and their output is left unwritten. ``tile_order``: each 128-column tile
    of the output in the GPU GEMMs' staging order (``quant_gemm.to_tile_order`` of the result; ``W`` a
    multiple of 128), so the grouped GEMM that reads it needs no rewrite."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
    if gate.dtype != up.dtype or gate.dtype not in IN_DTYPES or out_dtype not in OUT_DTYPES:
        raise ValueError(f"unsupported dtypes: gate {gate.dtype}, up {up.dtype}, out {out_dtype}")
    shape = gate.shape
    W = shape[-1] if gate.dim() else 1
    if tile_order and W % 128:
        raise ValueError(f"the tile order needs a multiple of 128 columns, got {W}")
    g2 = gate.reshape(-1, W)  # a view for the 2-D halves the layers pass
    u2 = up.reshape(-1, W)
    N = g2.shape[0]
    out = torch.empty(shape, dtype=out_dtype, device=gate.device)
    if N == 0 or W == 0:
        return out
    w = None
    if row_weight is not None:
        w = row_weight.reshape(-1).to(torch.float32)
        if w.numel() != N:
            raise ValueError(f"row_weight has {w.numel()} entries for {N} rows")
    block_w = min(triton.next_power_of_2(W), _MAX_BLOCK_W)
    block_r = max(1, _BLOCK_ELEMS // block_w)
    _swiglu_kernel[(triton.cdiv(N, block_r), triton.cdiv(W, block_w))](
        g2,
        u2,
        g2 if w is None else w,
        out,
        N,
        W,
        g2.stride(0),
        g2.stride(1),
        u2.stride(0),
        u2.stride(1),
        0 if w is None else w.stride(0),
        0.0 if limit is None else float(limit),
        g2 if live_rows is None else live_rows,
        BLOCK_R=block_r,
        BLOCK_W=block_w,
        HAS_LIMIT=limit is not None,
        HAS_WEIGHT=w is not None,
        IN_BF16=gate.dtype == torch.bfloat16,
        OUT_BF16=out_dtype == torch.bfloat16,
        HAS_LIVE=live_rows is not None,
        TILE_ORDER=tile_order,
        num_warps=_WARPS,
        **_LAUNCH,
        **pdl_args(g2.device),
    )
    return out
