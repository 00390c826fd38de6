"""The accumulation dtype of every "fp32 island", and the one GEMM rule.

The spec computes norms, mHC coefficients, routing, attention softmax, Engram
gates and GEMM accumulations in fp32 and rounds to the activation dtype. On
CPU, fp32 GEMMs and vectorised transcendental kernels round differently for
different row counts (MKL picks other kernels for small M; vector loops treat
their tail with scalar code), so a row's fp32 result depends on which other
rows share the call. A one-ulp change before an FP8/FP4 cast can flip a bin,
and then a prefill split into chunks no longer equals the whole prefill.

When the model runs in float32, the islands therefore accumulate in float64
and round to float32 at the same points: float64 hides those order effects
below the float32 rounding, so results do not depend on batching. In bf16
(the default) the islands are float32, exactly as the spec writes them.
"""

from __future__ import annotations

import torch

__all__ = ["acc_dtype", "gemm"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for activations of ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def gemm(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ w.T`` accumulated in ``acc_dtype(x.dtype)``, rounded once to ``out_dtype`` (x.dtype)."""
    acc = acc_dtype(x.dtype)
    return (x.to(acc) @ w.to(acc).t()).to(x.dtype if out_dtype is None else out_dtype)
