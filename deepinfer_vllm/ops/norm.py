"""RMSNorm: the reference (fp32 statistics and product, one rounding to the activation dtype)
and the operator a layer builds, which runs it or a device kernel."""

from __future__ import annotations

import torch

from .dispatch import KernelOp
from .numerics import acc_dtype

__all__ = ["RMSNorm", "rms_norm"]


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


class RMSNorm(KernelOp):
    """``rms_norm(x, weight, eps)``: the reference, one Triton kernel per call
    (``ops/triton/mhc.py``) or ``torch_npu``'s fused RmsNorm (``ops/npu.py``)."""

    name = "rms_norm"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.mhc", "npu": "deepinfer_vllm.ops.npu"}

    def forward_native(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def forward_triton(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def forward_npu(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)
