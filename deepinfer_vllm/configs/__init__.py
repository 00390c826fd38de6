"""Configuration classes for the models served by deepinfer-vllm (no vLLM imports)."""

from deepinfer_vllm.configs.deepseek_v41 import (
    ConfigError,
    DeepseekV41Config,
    LayerRole,
    V41Arch,
    register_with_transformers,
)

__all__ = [
    "ConfigError",
    "DeepseekV41Config",
    "LayerRole",
    "V41Arch",
    "register_with_transformers",
]
