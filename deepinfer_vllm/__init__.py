"""deepinfer-vllm: DeepSeek's DeepInfer engine for DeepSeek-V4.1-Flash, as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process (engine core, workers, API server), so it is idempotent and
cheap: it records lazy ``module:Class`` strings and imports no model code.
"""

from __future__ import annotations

__version__ = "0.1.0"

V41_ARCH = "DeepseekV41ForCausalLM"
V41_MODEL_CLS = "deepinfer_vllm.model_executor.models.deepseek_v41:DeepseekV41ForCausalLM"
V41_BACKEND_NAME = "DEEPINFER_V41_MLA_SWA"
V41_BACKEND_CLS = "deepinfer_vllm.attention_backends.mla_swa.DeepInferV41Backend"

_registered = False


def register() -> None:
    """Register the V4.1 model class, its config class and attention backend."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_hf_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from deepinfer_vllm.configs.deepseek_v41 import DeepseekV41Config, register_with_transformers

    import deepinfer_vllm.model_executor.quantization  # noqa: F401  (registers the method)

    ModelRegistry.register_model(V41_ARCH, V41_MODEL_CLS)
    # vLLM resolves config classes through its own registry before
    # transformers' AutoConfig; both must see ours.
    dict.__setitem__(vllm_hf_config._CONFIG_REGISTRY, "deepseek_v41", DeepseekV41Config)
    register_with_transformers()
    if V41_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(V41_BACKEND_NAME, V41_BACKEND_CLS)
    _registered = True
