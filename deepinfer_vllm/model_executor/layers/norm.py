"""V4.1's RMSNorm layer: the release's bf16 weight, and the operators that normalise with it."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.model_executor.layers.params import built_for, held
from deepinfer_vllm.ops.mhc import HcCollapseNorm
from deepinfer_vllm.ops.norm import RMSNorm

__all__ = ["V41Norm"]


class V41Norm(nn.Module):
    """RMSNorm with the release's bf16 weight (``ops.norm.rms_norm``: fp32 statistics,
    one rounding to the input dtype). ``collapse`` normalises the collapse of mHC streams
    (a sublayer's or the head's input) in one operator."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = held(dim, dtype=torch.bfloat16)
        self.eps = eps
        device, dtype = built_for()
        self.norm = RMSNorm(device, dtype)
        self.collapse_norm = HcCollapseNorm(device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)

    def collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``rms_norm(hc_collapse(streams, pre))`` with this norm's weight."""
        return self.collapse_norm(streams, pre, self.weight, self.eps)
