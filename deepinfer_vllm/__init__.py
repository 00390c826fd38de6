"""deepinfer-vllm: DeepSeek's DeepInfer engine for DeepSeek-V4.1-Flash, as a vLLM plugin.

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process (engine core, workers, API server), so it is idempotent and
cheap: it records lazy ``module:Class`` strings and imports no model code.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

__all__ = ["register"]

V41_MODEL_CLS = "deepinfer_vllm.model_executor.models.deepseek_v41:DeepseekV41ForCausalLM"
V41_BACKEND_NAME = "DEEPINFER_V41_MLA_SWA"

_registered = False
logger = logging.getLogger(__name__)


def _configure_logging() -> None:
    """Send the plugin's log records through vLLM's ``vllm`` logger: vLLM configures
    only that logger (level and handlers, possibly after this runs), so records of a
    logger outside it would be dropped."""
    logging.getLogger(__name__).parent = logging.getLogger("vllm")


def register() -> None:
    """Register the V4.1 model class, its config class (``patch.config_registry``) and
    attention backend (where vLLM's in-tree class serves V4.1, none of them), and the
    serving fixes (``entrypoints``: tool-call parser, ``patch.structured_outputs``) for
    either class."""
    global _registered
    if _registered:
        return
    _configure_logging()
    from deepinfer_vllm import entrypoints
    from deepinfer_vllm.platforms import serving_class

    entrypoints.install()
    if serving_class() == "vllm":
        logger.info(
            "DeepSeek-V4.1 is served by vLLM's in-tree class; deepinfer-vllm registers no model "
            "(DEEPINFER_MODEL=deepinfer selects the plugin's class), only its serving fixes"
        )
        _registered = True
        return
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    import deepinfer_vllm.model_executor.quantization  # noqa: F401  (registers the method)
    from deepinfer_vllm.configs import ARCHITECTURE
    from deepinfer_vllm.patch import config_registry
    from deepinfer_vllm.platforms.v41_config import V41_BACKEND

    ModelRegistry.register_model(ARCHITECTURE, V41_MODEL_CLS)
    config_registry.apply()  # our config class, in vLLM's config registry and AutoConfig
    if V41_BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(V41_BACKEND_NAME, V41_BACKEND)
    logger.info("DeepSeek-V4.1 is served by deepinfer-vllm's class (%s)", V41_MODEL_CLS)
    _registered = True
