"""The quantisation method vLLM records for V4.1 checkpoints.

The released ``quantization_config`` says ``quant_method: fp8``; left alone,
vLLM would route it to its own FP8/DeepGEMM method (bf16 only, GPU kernels).
DeepInfer's model reads the released formats itself, so this method claims
V4.1 checkpoints, allows every activation dtype the platform does, and gives
no vLLM layer a quant method.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

METHOD_NAME = "deepinfer_v41"


def _is_v41(hf_config: Any) -> bool:
    return getattr(hf_config, "model_type", None) == "deepseek_v41"


@register_quantization_config(METHOD_NAME)
class DeepInferV41QuantConfig(QuantizationConfig):
    """FP8 32x32 UE8M0 dense weights + packed FP4 experts, handled by the model."""

    def __init__(self, released: dict[str, Any]):
        super().__init__()
        self.released = dict(released)

    def get_name(self) -> str:
        return METHOD_NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DeepInferV41QuantConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if user_quant not in (None, METHOD_NAME):
            return None
        return METHOD_NAME if _is_v41(hf_config) else None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None
