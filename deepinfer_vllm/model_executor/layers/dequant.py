"""Weights stay in their released formats; each GEMM decodes what it needs when it runs.

Parameters hold the checkpoint's bytes (FP8 E4M3 with 32x32 UE8M0 tiles, packed
E2M1 experts with UE8M0 per 1x32, bf16 / fp32 where the release keeps them).
A GEMM decodes its weight into one process-wide workspace, in the
accumulation dtype of the activations (``ops.numerics.acc_dtype``: fp32 for
bf16 models, fp64 for fp32 models), and multiplies. The decoded values are
exact, so the products are those of a model holding dequantised weights; the
workspace is reused by every GEMM of every layer, and weights with many rows
are decoded and multiplied a row block at a time, so it never holds more than
``WORKSPACE_ELEMENTS`` values per decode (splitting the output rows of a GEMM leaves
every output element's sum unchanged). The multiply is ``ops.numerics.matmul``
(fixed row tiles in batch-invariant mode).

FP8 and FP4 GEMMs take their activations as ``DEEPINFER_GEMM_ACTIVATIONS``
says (as computed, or MXFP8-quantised as DeepInfer does), and on CUDA run the
Triton kernels where ``choose_gemm_kernels`` picks them (bf16 models); the
decode-and-multiply here is their reference path.
"""

from __future__ import annotations

import torch

from deepinfer_vllm import envs
from deepinfer_vllm.attention_backends.kernel_select import choose_gemm_kernels
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.numerics import acc_dtype, matmul

__all__ = [
    "WORKSPACE_ELEMENTS",
    "Workspace",
    "decode_fp4_rows",
    "decode_fp8_block",
    "decode_stored",
    "gemm_fp4",
    "gemm_fp8",
    "gemm_input",
    "gemm_stored",
    "use_gemm_kernels",
    "workspace",
]

# 2**20 values (4 MiB of fp32, 8 MiB of fp64): a decoded block stays in cache
# for its GEMM (benchmarks/README.md, "resident formats": 2**22 made the
# head's decode-and-multiply twice as slow as 2**20).
WORKSPACE_ELEMENTS = 1 << 20
FP8_TILE = 32


class Workspace:
    """One growable buffer per (device, dtype); ``view`` hands out its front.

    Callers use a view before asking for the next one (decode, multiply,
    decode, ...); the buffer only grows, to the largest request made.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= int(s)
        key = (torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:n].view(shape)


workspace = Workspace()


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``[R, C]`` with UE8M0 32x32 tiles -> the workspace, in ``dtype``."""
    out = workspace.view(tuple(weight.shape), dtype, weight.device)
    return quant.dequant_fp8_block_into(out, weight, scale, FP8_TILE)


def decode_fp4_rows(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 ``[R, C/2]`` with UE8M0 per 1x32 -> the workspace ``[R, C]``, in ``dtype``."""
    out = workspace.view((*weight.shape[:-1], 2 * weight.shape[-1]), dtype, weight.device)
    return quant.dequant_fp4_rows_into(out, weight, scale)


def decode_stored(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bf16 / fp32 weight widened into the workspace (the same weight if already ``dtype``)."""
    if weight.dtype == dtype:
        return weight
    return workspace.view(tuple(weight.shape), dtype, weight.device).copy_(weight)


def _row_blocks(rows: int, cols: int, align: int) -> list[tuple[int, int]]:
    """Row ranges whose decoded size fits the workspace (multiples of ``align`` rows)."""
    step = max(align, (WORKSPACE_ELEMENTS // max(cols, 1)) // align * align)
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def _gemm_blocks(x: torch.Tensor, rows: int, cols: int, align: int, decode, out_dtype) -> torch.Tensor:
    acc = acc_dtype(x.dtype)
    xa = x.to(acc)
    if rows * cols <= WORKSPACE_ELEMENTS:
        return matmul(xa, decode(0, rows, acc)).to(out_dtype)
    out = torch.empty(*x.shape[:-1], rows, dtype=out_dtype, device=x.device)
    for lo, hi in _row_blocks(rows, cols, align):
        out[..., lo:hi] = matmul(xa, decode(lo, hi, acc)).to(out_dtype)
    return out


def gemm_input(x: torch.Tensor) -> torch.Tensor:
    """The activations an FP8 / FP4 weight GEMM multiplies: ``x``, or its MXFP8
    quantise-dequantise (``DEEPINFER_GEMM_ACTIVATIONS=mxfp8``)."""
    return quant.mxfp8_qdq(x) if envs.gemm_activations() == "mxfp8" else x


def use_gemm_kernels(x: torch.Tensor) -> bool:
    """Whether the weight GEMMs of activations ``x`` run the Triton kernels."""
    return choose_gemm_kernels(x.device, x.dtype) == "triton"


def gemm_fp8(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ W.T`` for an FP8 block-scaled ``W``: accumulated in ``acc_dtype(x.dtype)``,
    rounded once to ``out_dtype`` (default ``x.dtype``), as ``ops.numerics.gemm``."""
    rows, cols = weight.shape
    if use_gemm_kernels(x):
        from deepinfer_vllm.ops.triton.fp8_gemm import fp8_block_gemm

        y = fp8_block_gemm(x.reshape(-1, cols), weight, scale, envs.gemm_activations(), out_dtype or x.dtype)
        return y.view(*x.shape[:-1], rows)
    x = gemm_input(x)

    def decode(lo, hi, dtype):
        return decode_fp8_block(weight[lo:hi], scale[lo // FP8_TILE : -(-hi // FP8_TILE)], dtype)

    return _gemm_blocks(x, rows, cols, FP8_TILE, decode, out_dtype or x.dtype)


def gemm_fp8_grouped(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Block-diagonal ``gemm_fp8``: ``x [T, G, K]``, group ``g`` times rows ``g*N/G ...`` of
    ``W [N, K]`` -> ``[T, G, N/G]``. One launch on the GEMM kernels; a loop over the
    groups on the reference."""
    T, groups, cols = x.shape
    rows = weight.shape[0] // groups
    if use_gemm_kernels(x):
        from deepinfer_vllm.ops.triton.fp8_gemm import fp8_block_gemm

        y = fp8_block_gemm(
            x.reshape(T, groups * cols),
            weight,
            scale,
            envs.gemm_activations(),
            out_dtype or x.dtype,
            groups=groups,
        )
        return y.view(T, groups, rows)
    out = torch.empty(T, groups, rows, dtype=out_dtype or x.dtype, device=x.device)
    for g in range(groups):
        lo = g * rows
        out[:, g] = gemm_fp8(
            x[:, g], weight[lo : lo + rows], scale[lo // FP8_TILE : (lo + rows) // FP8_TILE], out_dtype
        )
    return out


def gemm_fp4(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x @ W.T`` for a routed expert's packed E2M1 ``W`` (UE8M0 per 1x32), same rules."""
    rows, cols = weight.shape[0], 2 * weight.shape[1]
    x = gemm_input(x)

    def decode(lo, hi, dtype):
        return decode_fp4_rows(weight[lo:hi], scale[lo:hi], dtype)

    return _gemm_blocks(x, rows, cols, 1, decode, out_dtype or x.dtype)


def gemm_stored(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T`` for a bf16 / fp32 ``W``, with the same accumulation and rounding."""
    rows, cols = weight.shape

    def decode(lo, hi, dtype):
        return decode_stored(weight[lo:hi], dtype)

    return _gemm_blocks(x, rows, cols, 1, decode, out_dtype or x.dtype)
