"""Parameter holders and the one GEMM convention of the CPU path.

Every holder names its dtype: vLLM builds models under the model dtype as
torch's default dtype, which would silently round fp32 checkpoint tensors
(mHC projections, sinks) to bf16.

Checkpoint weights are FP8/FP4; they are dequantised once at load time. The
values are exact in bf16 (e4m3 and e2m1 codes times a power of two), and the
CPU path keeps them in fp32 so every GEMM is an fp32 GEMM whose result is
rounded once to the activation dtype, exactly as the per-operator references
in ``deepinfer_vllm.ops`` compute. (AVX2 CPUs have no fast bf16 GEMM anyway.)
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.ops.numerics import gemm


def dense(out_features: int, in_features: int) -> nn.Parameter:
    """An fp32 weight ``[out, in]`` filled by the loader."""
    return nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32), requires_grad=False)


def vector(n: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False)


def stacked(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` accumulated in ``acc_dtype(x.dtype)``, rounded once to ``x.dtype``."""
    return gemm(x, weight)
