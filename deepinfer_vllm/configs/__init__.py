"""DeepSeek-V4.1 configuration (no vLLM imports).

* ``hf_config``: ``DeepseekV41Config``, the Transformers config class (nested or flat
  ``config.json``), and ``ConfigError``;
* ``arch``: ``V41Arch``, the validated record of every dimension the model needs;
* ``roles``: ``LayerRole``, what each layer owns and reads, and its validation.
"""

from deepinfer_vllm.configs.arch import V41Arch
from deepinfer_vllm.configs.hf_config import (
    ARCHITECTURE,
    DSPARK_DRAFT_ARCHITECTURE,
    MODEL_TYPE,
    ConfigError,
    DeepseekV41Config,
    is_v41_config,
    register_with_transformers,
)
from deepinfer_vllm.configs.roles import LayerRole

__all__ = [
    "ARCHITECTURE",
    "DSPARK_DRAFT_ARCHITECTURE",
    "MODEL_TYPE",
    "ConfigError",
    "DeepseekV41Config",
    "LayerRole",
    "V41Arch",
    "is_v41_config",
    "register_with_transformers",
]
