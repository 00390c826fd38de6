"""RMSNorm reference (spec §16: fp32 reduction, one rounding to the activation dtype)."""

from __future__ import annotations

import torch

from .numerics import acc_dtype

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension of ``x``.

    Numerics: ``x`` is upcast to fp32, ``rsqrt(mean(x^2) + eps)`` is computed in fp32,
    the product ``x * rstd * weight`` is formed in fp32 (``weight`` upcast; ``None``
    means no weight) and the result is rounded once to ``x.dtype``.
    """
    xf = x.to(acc_dtype(x.dtype))
    rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)
