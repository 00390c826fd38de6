"""``patch.config_registry``: vLLM's config registry names its own V4.1 config class; the
patch puts DeepInfer's there (and in ``AutoConfig``)."""

from __future__ import annotations

import inspect
import subprocess
import sys

STOCK = """
from vllm.transformers_utils.config import _CONFIG_REGISTRY
cls = _CONFIG_REGISTRY["deepseek_v41"]
print(type(_CONFIG_REGISTRY).__name__, cls.__module__, cls.__name__)
"""


def test_vllms_registry_still_has_its_own_v41_config_class():
    """In a fresh process (the plugin not registered): vLLM maps ``deepseek_v41`` to its own
    class. When this fails, vLLM dropped or renamed the entry: check the patch is still needed."""
    run = subprocess.run([sys.executable, "-c", STOCK], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == [
        "LazyConfigDict", "vllm.transformers_utils.configs.deepseek_v41", "DeepseekV41Config"
    ]


def test_vllm_still_registers_its_class_with_autoconfig_on_every_load():
    """vLLM's config parser (``HFConfigParser.parse``) takes the registry's class and hands it
    to ``AutoConfig`` again when it loads a config, so an ``AutoConfig`` registration alone
    would be overwritten."""
    from vllm.transformers_utils import config as vllm_hf_config

    assert "AutoConfig.register(model_type, config_class, exist_ok=True)" in inspect.getsource(
        vllm_hf_config._register_config_class
    )
    parse = inspect.getsource(vllm_hf_config.HFConfigParser.parse)
    assert "config_class = _CONFIG_REGISTRY[model_type]" in parse
    assert "_register_config_class(model_type, config_class)" in parse


def test_apply_puts_deepinfers_class_in_both_registries():
    from transformers import AutoConfig
    from vllm.transformers_utils import config as vllm_hf_config

    from deepinfer_vllm.configs import DeepseekV41Config
    from deepinfer_vllm.patch import config_registry

    config_registry.apply()
    config_registry.apply()  # idempotent
    assert vllm_hf_config._CONFIG_REGISTRY["deepseek_v41"] is DeepseekV41Config
    assert type(AutoConfig.for_model("deepseek_v41")) is DeepseekV41Config
    vllm_hf_config._maybe_register_hf_config(AutoConfig.for_model("deepseek_v41"))  # what a load does
    assert type(AutoConfig.for_model("deepseek_v41")) is DeepseekV41Config
