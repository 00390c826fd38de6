"""The accumulation dtype of every "fp32 island", and the one GEMM rule.

V4.1 computes norms, mHC coefficients, routing, attention softmax, Engram
gates and GEMM accumulations in fp32 and rounds to the activation dtype. On
CPU, fp32 GEMMs and vectorised transcendental kernels round differently for
different row counts (MKL picks other kernels for small M; vector loops treat
their tail with scalar code), so a row's fp32 result depends on which other
rows share the call. A one-ulp change before an FP8/FP4 cast can flip a bin,
and then a prefill split into chunks no longer equals the whole prefill.

When the model runs in float32, the islands therefore accumulate in float64
and round to float32 at the same points: float64 hides those order effects
below the float32 rounding, so results do not depend on batching. In bf16
(the default) the islands are float32, exactly as the model defines them.

Batch-invariant mode (``DEEPINFER_BATCH_INVARIANT=1``) removes the effects
themselves, so a row's bits never depend on its step's other rows, in any
dtype (the setting is read on each call of ``matmul`` and ``pointwise``: they are
functions shared by the model's operators, the full-sequence reference model and the
tools, with no construction to read it at):

* ``matmul``: MKL's sgemm/dgemm sums a row in an order chosen by the row count
  M (gemv for M=1, other blockings for small M) and by the operand's address
  alignment. Here the rows are copied into fresh zero-padded ``ROW_TILE``-row
  tiles and multiplied as one batched GEMM of identical ``[ROW_TILE, K] @ [K,
  N]`` problems, so every row goes through the same kernel at the same
  alignment. ``col_tile`` does the same for a right operand whose row count
  varies from step to step (the indexer's keys): MKL also changes kernels for
  small N.
* ``pointwise``: PyTorch's vectorised loops compute sigmoid / SiLU / softplus
  with a SIMD kernel that differs from their scalar kernel in the last ulp,
  and give the scalar kernel each thread's tail, so an element's bits depend
  on where it lands in the flattened tensor. Here the op reads a stride-2
  copy, which TensorIterator cannot vectorise: every element takes the scalar
  kernel. (exp, sqrt, rsqrt and log2 give the same bits on both paths; they
  stay as they are, and ``tests/ops/test_batch_invariant.py`` checks that.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from deepinfer_vllm import envs

__all__ = ["COL_TILE", "ROW_TILE", "acc_dtype", "device_constant", "gemm", "matmul", "pointwise", "tiled_matmul"]

# Rows per GEMM tile in batch-invariant mode. A single decode row costs a
# whole tile; larger tiles make prefill GEMMs faster (benchmarks/README.md,
# "batch invariance").
ROW_TILE = 8
# Columns per tile for right operands whose row count varies (``col_tile=True``).
COL_TILE = 128


@functools.lru_cache(maxsize=256)
def device_constant(name: str, values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The constant table ``name`` on ``device``, built once per device: a device step then
    never copies it from the host (a copy the GPU would wait on). ``name`` keys the cache
    (equal tuples can differ, e.g. in the sign of a zero). Read-only."""
    return torch.tensor(values, dtype=dtype, device=device)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for activations of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` accumulated in ``acc_dtype(x.dtype)``, rounded once to ``out_dtype`` (x.dtype)."""
    acc = acc_dtype(x.dtype)
    return matmul(x.to(acc), w.to(acc)).to(x.dtype if out_dtype is None else out_dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, col_tile: bool = False) -> torch.Tensor:
    """``a @ b.T`` (``a [..., K]``, ``b [N, K]``, one dtype) in that dtype: the plain
    product, or in batch-invariant mode ``tiled_matmul`` (``col_tile``: ``N`` varies
    between calls and is tiled too)."""
    if envs.batch_invariant():
        return tiled_matmul(a, b, col_tile)
    return a @ b.t()


def tiled_matmul(a: torch.Tensor, b: torch.Tensor, col_tile: bool = False) -> torch.Tensor:
    """``a @ b.T`` whose every row is computed by one fixed kernel call shape at one
    alignment, so its bits do not depend on the other rows of ``a`` (nor, with
    ``col_tile``, on ``N``).

    ``a``'s rows are copied into a fresh zero-padded buffer of whole ``ROW_TILE``-row
    tiles, every row starting 64-byte aligned (``K`` is padded with zeros to a whole
    number of 64 bytes where it is not one already, and ``b`` with it; a zero
    column adds exact zeros), and multiplied by ``b.T`` as one ``bmm`` of identical
    ``[ROW_TILE, K] @ [K, N]`` problems (``b`` broadcast, not copied). With
    ``col_tile``, ``b`` is zero-padded to whole ``COL_TILE``-row blocks and each block
    is one such ``bmm``.
    """
    lead, K = a.shape[:-1], a.shape[-1]
    M = a.numel() // K if K else 0
    N = b.shape[0]
    if M == 0 or K == 0:
        return (a.reshape(M, K) @ b.t()).reshape(*lead, N)
    per = 64 // a.element_size()
    Kp = -(-K // per) * per
    tiles = -(-M // ROW_TILE)
    rows = a.new_zeros(tiles * ROW_TILE, Kp)
    rows[:M, :K] = a.reshape(M, K)
    if Kp != K or col_tile:
        n_pad = -(-N // COL_TILE) * COL_TILE if col_tile else N
        padded = b.new_zeros(n_pad, Kp)
        padded[:N, :K] = b
        b = padded
    b = b.contiguous()
    rows = rows.view(tiles, ROW_TILE, Kp)
    if not col_tile:
        out = torch.bmm(rows, b.t().expand(tiles, Kp, N))
        return out.view(tiles * ROW_TILE, N)[:M].reshape(*lead, N)
    out = a.new_empty(tiles * ROW_TILE, b.shape[0])
    for lo in range(0, b.shape[0], COL_TILE):
        part = torch.bmm(rows, b[lo : lo + COL_TILE].t().expand(tiles, Kp, COL_TILE))
        out[:, lo : lo + COL_TILE] = part.view(tiles * ROW_TILE, COL_TILE)
    return out[:M, :N].reshape(*lead, N)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (sigmoid, SiLU, softplus); in batch-invariant
    mode computed on a stride-2 copy of ``x``, so every element goes through ``fn``'s
    scalar kernel, wherever it lies in the tensor."""
    if not envs.batch_invariant():
        return fn(x)
    lanes = x.new_empty(x.numel(), 2)
    lanes[:, 0] = x.reshape(-1)
    return fn(lanes[:, 0]).reshape(x.shape)
