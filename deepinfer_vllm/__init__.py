"""deepinfer-vllm: DeepSeek's DeepInfer engine for DeepSeek-V4.1-Flash, as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process (engine core, workers, API server), so it is idempotent and
cheap: it records lazy ``module:Class`` strings and imports no model code.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

V41_ARCH = "DeepseekV41ForCausalLM"
V41_MODEL_CLS = "deepinfer_vllm.model_executor.models.deepseek_v41:DeepseekV41ForCausalLM"
V41_BACKEND_NAME = "DEEPINFER_V41_MLA_SWA"
V41_BACKEND_CLS = "deepinfer_vllm.attention_backends.mla_swa.DeepInferV41Backend"

_registered = False
logger = logging.getLogger(__name__)


def _configure_logging() -> None:
    """Send the plugin's log records through vLLM's ``vllm`` logger: vLLM configures
    only that logger (level and handlers, possibly after this runs), so records of a
    logger outside it would be dropped."""
    logging.getLogger(__name__).parent = logging.getLogger("vllm")


def serving_class() -> str:
    """``deepinfer`` or ``vllm``: who serves V4.1 in this process (``DEEPINFER_MODEL``)."""
    from deepinfer_vllm import envs

    choice = envs.model_choice()
    if choice != "auto":
        return choice
    from vllm.platforms import current_platform

    return "vllm" if current_platform.is_cuda_alike() else "deepinfer"


def register() -> None:
    """Register the V4.1 model class, its config class and attention backend (where
    vLLM's in-tree class serves V4.1, none of them), and the serving fixes
    (``entrypoints``: tool-call parser, bounded JSON grammars) for either class."""
    global _registered
    if _registered:
        return
    _configure_logging()
    from deepinfer_vllm import entrypoints

    entrypoints.install()
    if serving_class() == "vllm":
        logger.info(
            "DeepSeek-V4.1 is served by vLLM's in-tree class; deepinfer-vllm registers no model "
            "(DEEPINFER_MODEL=deepinfer selects the plugin's class), only its serving fixes"
        )
        _registered = True
        return
    from vllm import ModelRegistry
    from vllm.transformers_utils import config as vllm_hf_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from deepinfer_vllm.configs import DeepseekV41Config, register_with_transformers

    import deepinfer_vllm.model_executor.quantization  # noqa: F401  (registers the method)

    ModelRegistry.register_model(V41_ARCH, V41_MODEL_CLS)
    # vLLM resolves config classes through its own registry before
    # transformers' AutoConfig; both must see ours.
    dict.__setitem__(vllm_hf_config._CONFIG_REGISTRY, "deepseek_v41", DeepseekV41Config)
    register_with_transformers()
    if V41_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(V41_BACKEND_NAME, V41_BACKEND_CLS)
    logger.info("DeepSeek-V4.1 is served by deepinfer-vllm's class (%s)", V41_MODEL_CLS)
    _registered = True
