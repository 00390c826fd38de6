"""Platform plugin activation and the V4.1-only behaviour of our CPU platform."""

from __future__ import annotations

import os

import pytest

from deepinfer_vllm import platforms


def test_plugin_activates_on_cpu_only_host(monkeypatch):
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.delenv("DEEPINFER_PLATFORM", raising=False)
    assert platforms.cpu_platform_plugin() == platforms.CPU_PLATFORM


def test_plugin_bypasses(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLATFORM", "off")
    assert platforms.cpu_platform_plugin() is None
    monkeypatch.setenv("DEEPINFER_PLATFORM", "auto")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert platforms.cpu_platform_plugin() is None
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidia0" or real_exists(p))
    assert platforms.cpu_platform_plugin() is None


def test_bad_platform_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLATFORM", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_PLATFORM"):
        platforms.cpu_platform_plugin()


def test_current_platform_is_ours():
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "DeepInferCpuPlatform"


def test_sparse_selector_routes_v41_to_our_backend():
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    from deepinfer_vllm.platforms.cpu import V41_BACKEND, DeepInferCpuPlatform

    sparse = SimpleNamespace(use_sparse=True, use_mla=True)
    with pytest.raises(NotImplementedError):
        CpuPlatform.get_attn_backend_cls(None, sparse)  # what stock vLLM does for V4.1
    assert DeepInferCpuPlatform.get_attn_backend_cls(None, sparse) == V41_BACKEND
