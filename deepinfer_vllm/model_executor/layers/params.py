"""What a layer is built with: parameters held in the dtype the checkpoint stores them, and
the device and dtype its operators are chosen for.

Every holder names its dtype: vLLM builds models under the model dtype as
torch's default dtype, which would round fp32 checkpoint tensors (mHC
projections, sinks, routing biases) or widen bf16 ones. The operators upcast
what they read to the accumulation dtype, so holding the stored values is
exact.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["built_for", "held", "ue8m0_dtype"]


def built_for() -> tuple[torch.device, torch.dtype]:
    """The device and dtype of the model being built: torch's defaults, which vLLM's loader
    sets to the target device and the model dtype while it constructs the model. A layer's
    operators (``ops.dispatch.KernelOp``) choose their kernels for these, once."""
    return torch.get_default_device(), torch.get_default_dtype()


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
