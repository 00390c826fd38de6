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


# torch_npu calls that run ``torch_npu.npu._lazy_init`` (ACL initialised, a context on the
# current device, NPU 0 unless one was set) or act on the current device; the stub records
# each in ``module.context_calls``. Context-free: ``device_count`` (the driver's count) and
# ``torch_npu._C._npu_getDeviceName`` (aclrtGetSocName).
CONTEXT_CALLS = (
    "get_device_name", "get_device_properties", "mem_get_info", "current_device", "synchronize",
    "set_device", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "empty_cache",
)


def make_torch_npu(
    soc: str = "Ascend950PR", count: int = 8, total: int = 128 << 30, soc_binding: bool = True
) -> types.ModuleType:
    """A ``torch_npu`` whose ``npu`` namespace answers like CANN on ``count`` NPUs of ``soc``.
    ``soc_binding=False``: a torch_npu without the context-free SoC query."""
    calls: list[tuple] = []
    context_calls: list[str] = []

    def record(name, result=None):
        def fn(*args, **kwargs):
            calls.append((name, args))
            return result

        return fn

    def in_context(name, fn):
        def call(*args, **kwargs):
            context_calls.append(name)
            return fn(*args, **kwargs)

        return call

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
        current_device=lambda: 0,
        stream=lambda s: s,
    )
    for name in CONTEXT_CALLS:
        setattr(npu, name, in_context(name, getattr(npu, name)))
    module = types.ModuleType("torch_npu")
    module.npu = npu
    module._C = types.SimpleNamespace(**({"_npu_getDeviceName": lambda: soc} if soc_binding else {}))
    module.calls = calls
    module.context_calls = context_calls
    return module


@pytest.fixture
def clean_env(monkeypatch):
    for name in DETECTION_ENV:
        monkeypatch.delenv(name, raising=False)
    from deepinfer_vllm.platforms import ascend
    from deepinfer_vllm.platforms.ascend import device as npu

    monkeypatch.setattr(ascend, "_said", set())
    # The device layer is one per process: no NPU selected at the start of a test.
    monkeypatch.setattr(npu._get(False), "selected", None)
    # No vllm-ascend and no torch_npu unless a test installs one.
    monkeypatch.setitem(sys.modules, "vllm_ascend", None)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    return monkeypatch


@pytest.fixture
def host(clean_env):
    """Set up a host: ``host(soc=..., count=..., vllm_ascend=...)``; returns the stub module."""

    def setup(soc: str | None = "Ascend950PR", count: int = 8, vllm_ascend: bool = False, soc_binding=True):
        module = None
        if soc is not None:
            module = make_torch_npu(soc, count, soc_binding=soc_binding)
            clean_env.setitem(sys.modules, "torch_npu", module)
        if vllm_ascend:
            clean_env.setitem(sys.modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
        return module

    return setup
