"""Parameters that are not linears: held in the dtype the checkpoint stores them.

Every holder names its dtype: vLLM builds models under the model dtype as
torch's default dtype, which would round fp32 checkpoint tensors (mHC
projections, sinks, routing biases) or widen bf16 ones. The operators upcast
what they read to the accumulation dtype, so holding the stored values is
exact. Linears are vLLM's parallel linear layers with
``DeepInferV41QuantConfig`` (``model_executor.quantization``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import RowParallelLinear

from deepinfer_vllm.attention_backends.kernel_select import choose_fused_kernels
from deepinfer_vllm.model_executor.layers.parallel import all_reduce
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.numerics import acc_dtype

__all__ = ["V41Norm", "V41RowParallelLinear", "fused_kernels", "held", "linear", "ue8m0_dtype"]


def fused_kernels(x: torch.Tensor) -> str:
    """Where the per-token chains (mHC sites, RMSNorm, RoPE) of ``x`` run: ``"triton"``,
    ``"npu"`` (RMSNorm and RoPE on ``torch_npu``) or ``"torch"`` (``choose_fused_kernels``)."""
    return choose_fused_kernels(x.device, x.dtype)


def held(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter of the checkpoint's dtype, filled by the loader."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def ue8m0_dtype() -> torch.dtype:
    """The dtype UE8M0 scale parameters are held in: ``torch.float8_e8m0fnu`` (the
    checkpoint's), unless the platform names another through ``ue8m0_storage_dtype``
    (DeepInfer's Ascend platform: ``uint8``, as its device layer decides: e8m0 tensors are
    not known to work on an NPU). Loading reinterprets the bytes, never converts them, and
    every reader (``ops.quant``) takes either dtype, so the numbers are the same."""
    import vllm.platforms

    # On the class: vLLM's Platform.__getattr__ would warn about the name on other platforms.
    platform_cls = type(vllm.platforms.current_platform)
    return getattr(platform_cls, "ue8m0_storage_dtype", None) or torch.float8_e8m0fnu


class V41Norm(nn.Module):
    """RMSNorm with the release's bf16 weight (``ops.norm.rms_norm``: fp32 statistics,
    one rounding to the input dtype)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = held(dim, dtype=torch.bfloat16)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = fused_kernels(x)
        if where == "triton":
            from deepinfer_vllm.ops.triton.mhc import rms_norm as fused_rms_norm

            return fused_rms_norm(x, self.weight, self.eps)
        if where == "npu":
            from deepinfer_vllm.ops import npu

            return npu.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def linear(layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A replicated linear's GEMM rounded to ``out_dtype`` (default ``x.dtype``).

    Only for layers without a TP split: it calls the quant method directly, so
    a parallel layer's collectives would be skipped.
    """
    return layer.quant_method.apply(layer, x, out_dtype=out_dtype)


class V41RowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` whose TP partial sums are reduced before the one rounding.

    Each rank's partial product stays in the accumulation dtype through the
    all-reduce and the sum is rounded once to the input dtype, so a split
    projection rounds where the unsplit one does (summing rounded partials
    would not).
    """

    def __init__(self, input_size: int, output_size: int, *, quant_config, prefix: str):
        super().__init__(
            input_size, output_size, bias=False, quant_config=quant_config, prefix=prefix, return_bias=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.quant_method.apply(self, x, out_dtype=acc_dtype(x.dtype))
        if self.tp_size > 1:
            partial = all_reduce(get_tp_group(), partial)
        return partial.to(x.dtype)
