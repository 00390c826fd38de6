"""vLLM's config registry: DeepInfer's V4.1 config class for ``model_type: deepseek_v41``.

**vLLM behaviour (0.32).** ``vllm/transformers_utils/config.py`` resolves a checkpoint's
config class through its own registry, ``_CONFIG_REGISTRY`` (a ``LazyConfigDict`` from
``model_type`` to a class of ``vllm.transformers_utils.configs``), before transformers'
``AutoConfig``, and registers the class it finds with ``AutoConfig`` again on every load
(``_register_config_class``, ``exist_ok=True``). Its entry ``deepseek_v41`` is vLLM's
own ``DeepseekV41Config``. vLLM has no public way to register a config class.

**Why it is insufficient.** DeepInfer's model class reads DeepInfer's config class
(``configs.DeepseekV41Config``: the checkpoint's fields as V4.1's architecture needs
them). With vLLM's entry, every load would hand the model vLLM's class and re-register it
with ``AutoConfig`` over ours.

**What the patch does.** ``apply()`` sets the registry's ``deepseek_v41`` entry to
DeepInfer's class (a class value: ``LazyConfigDict`` returns classes as they are), and
registers it with ``AutoConfig`` too (``configs.register_with_transformers``).

**Applied** by the plugin entry point (``deepinfer_vllm.register``), in every process
(API server, engine core, workers), where DeepInfer's class serves V4.1
(``DEEPINFER_MODEL``); where vLLM's in-tree class serves it, nothing is changed.

**Removable** when vLLM lets a plugin register a config class (or resolves a model's
config through the model class); ``tests/patch/test_config_registry.py`` checks vLLM's
entry and fails when it changes.
"""

from __future__ import annotations


def apply() -> None:
    """DeepInfer's ``DeepseekV41Config`` for ``model_type: deepseek_v41``, in vLLM's config
    registry and transformers' ``AutoConfig``. Idempotent."""
    from vllm.transformers_utils import config as vllm_hf_config

    from deepinfer_vllm.configs import MODEL_TYPE, DeepseekV41Config, register_with_transformers

    dict.__setitem__(vllm_hf_config._CONFIG_REGISTRY, MODEL_TYPE, DeepseekV41Config)
    register_with_transformers()
