"""Who serves DeepseekV41ForCausalLM: the plugin's class where vLLM's in-tree one cannot run,
vLLM's on CUDA/ROCm (until the plugin's runs the release on the GPU), as DEEPINFER_MODEL says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepinfer_vllm.platforms import serving_class

_PROBE = """
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
load_general_plugins()
print(ModelRegistry.models["DeepseekV41ForCausalLM"].module_name)
"""


def _registered_module(env_value: str | None, monkeypatch) -> str:
    if env_value is None:
        monkeypatch.delenv("DEEPINFER_MODEL", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_MODEL", env_value)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_cpu_default_registers_the_plugin_class(monkeypatch):
    assert _registered_module(None, monkeypatch) == "deepinfer_vllm.model_executor.models.deepseek_v41"


def test_vllm_choice_leaves_the_in_tree_class(monkeypatch):
    assert _registered_module("vllm", monkeypatch) == "vllm.models.deepseek_v41"


def test_auto_picks_vllm_on_cuda(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv("DEEPINFER_MODEL", raising=False)
    assert serving_class() == "deepinfer"  # this CPU host
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self=None: True)
    assert serving_class() == "vllm"
    monkeypatch.setenv("DEEPINFER_MODEL", "deepinfer")
    assert serving_class() == "deepinfer"


def test_bad_choice_names_the_setting(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MODEL", "both")
    with pytest.raises(ValueError, match="DEEPINFER_MODEL='both'"):
        serving_class()
