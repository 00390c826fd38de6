"""A stub ``torch_npu`` (injected into ``sys.modules``) and a clean environment for detection."""

from __future__ import annotations

import sys
import types

import pytest

# Loaded before any test installs a stub: transformers probes ``find_spec("torch_npu")``
# while vLLM's config modules load, which a stub without a spec would break.
import vllm.config  # noqa: F401,E402
import vllm.engine.arg_utils  # noqa: F401,E402

DETECTION_ENV = ("DEEPINFER_PLATFORM", "DEEPINFER_SIMULATED_NPU", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS")


def make_torch_npu(soc: str = "Ascend950PR", count: int = 8, total: int = 128 << 30) -> types.ModuleType:
    """A ``torch_npu`` whose ``npu`` namespace answers like CANN on ``count`` NPUs of ``soc``."""
    calls: list[tuple] = []

    def record(name, result=None):
        def fn(*args, **kwargs):
            calls.append((name, args))
            return result

        return fn

    npu = types.SimpleNamespace(
        is_available=lambda: count > 0,
        device_count=lambda: count,
        get_device_name=lambda i=0: soc,
        get_device_properties=lambda i=0: types.SimpleNamespace(total_memory=total),
        mem_get_info=lambda d=None: (total // 2, total),
        memory_allocated=lambda d=None: 1 << 20,
        max_memory_allocated=lambda d=None: 2 << 20,
        reset_peak_memory_stats=record("reset_peak_memory_stats"),
        empty_cache=record("empty_cache"),
        set_device=record("set_device"),
        synchronize=record("synchronize"),
        manual_seed_all=record("manual_seed_all"),
        Stream=type("Stream", (), {"__init__": lambda self, *a, **k: setattr(self, "args", a)}),
        Event=type("Event", (), {"__init__": lambda self, *a, **k: setattr(self, "args", a)}),
        current_stream=lambda d=None: "current",
        stream=lambda s: s,
    )
    module = types.ModuleType("torch_npu")
    module.npu = npu
    module.calls = calls
    return module


@pytest.fixture
def clean_env(monkeypatch):
    for name in DETECTION_ENV:
        monkeypatch.delenv(name, raising=False)
    from deepinfer_vllm.platforms import ascend

    monkeypatch.setattr(ascend, "_said", set())
    # No vllm-ascend and no torch_npu unless a test installs one.
    monkeypatch.setitem(sys.modules, "vllm_ascend", None)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    return monkeypatch


@pytest.fixture
def host(clean_env):
    """Set up a host: ``host(soc=..., count=..., vllm_ascend=...)``; returns the stub module."""

    def setup(soc: str | None = "Ascend950PR", count: int = 8, vllm_ascend: bool = False):
        module = None
        if soc is not None:
            module = make_torch_npu(soc, count)
            clean_env.setitem(sys.modules, "torch_npu", module)
        if vllm_ascend:
            clean_env.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
        return module

    return setup
