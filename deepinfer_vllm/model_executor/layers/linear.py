"""Linears of V4.1 beyond vLLM's: the GEMM of a replicated linear with its output dtype, and
a row-parallel linear that reduces its partial sums before rounding.

Linears are vLLM's parallel linear layers with ``DeepInferV41QuantConfig``
(``model_executor.quantization``), whose methods hold the released weight formats.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed import get_tp_group
from vllm.model_executor.layers.linear import RowParallelLinear

from deepinfer_vllm.model_executor.layers.parallel import all_reduce
from deepinfer_vllm.ops.numerics import acc_dtype

__all__ = ["V41RowParallelLinear", "linear"]


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
        if self.tp_size == 1:  # the one rounding happens in the GEMM (no separate cast)
            return self.quant_method.apply(self, x, out_dtype=x.dtype)
        partial = self.quant_method.apply(self, x, out_dtype=acc_dtype(x.dtype))
        return all_reduce(get_tp_group(), partial).to(x.dtype)
