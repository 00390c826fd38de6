"""Which platform claims the host: DeepInfer's Ascend plugin, its CPU plugin, vllm-ascend, or stock vLLM.

Hosts are simulated with a stub ``torch_npu`` in ``sys.modules`` (see conftest);
this machine is CPU-only with vLLM's CPU build, so DeepInfer's CPU plugin would
claim it unless the Ascend plugin does.
"""

from __future__ import annotations

import itertools

import pytest

from deepinfer_vllm import platforms
from deepinfer_vllm.platforms import ascend
from deepinfer_vllm.platforms.ascend import device as npu

OURS = ascend.ASCEND_PLATFORM


def test_ascend_950_is_ours_and_logged(host, log_lines):
    host(soc="Ascend950PR")
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() == OURS
    assert "DeepInfer's Ascend platform runs this host (Ascend950PR)" in "\n".join(logged)
    assert platforms.cpu_platform_plugin() is None


@pytest.mark.parametrize("soc", ["Ascend950DT", "Ascend950PR", "Ascend 950PR"])
def test_every_950_variant(host, soc):
    host(soc=soc)
    assert ascend.ascend_platform_plugin() == OURS


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9392", "Ascend310P3"])
def test_other_soc_stands_aside_and_says_how_to_force(host, log_lines, soc):
    host(soc=soc)
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() is None
    assert f"Ascend SoC {soc} is not an Ascend 950" in "\n".join(logged)
    assert "DEEPINFER_PLATFORM=ascend" in "\n".join(logged)


def test_other_soc_forced_with_ascend_mode(host, clean_env, log_lines):
    host(soc="Ascend910B3")
    clean_env.setenv("DEEPINFER_PLATFORM", "ascend")
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() == OURS
    assert "not an Ascend 950" in "\n".join(logged)


def test_no_torch_npu_is_not_ours(host, clean_env):
    host(soc=None)
    assert not npu.torch_npu_installed()
    assert ascend.ascend_platform_plugin() is None
    clean_env.setenv("DEEPINFER_PLATFORM", "ascend")
    assert ascend.ascend_platform_plugin() is None


def test_no_visible_npu_is_not_ours(host):
    host(soc="Ascend950PR", count=0)
    assert ascend.ascend_platform_plugin() is None


def test_vllm_ascend_installed_takes_the_host(host, log_lines):
    host(soc="Ascend950PR", vllm_ascend=True)
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() is None
    assert "vllm-ascend is installed" in "\n".join(logged)
    assert "VLLM_PLUGINS=deepinfer_vllm,deepinfer_ascend" in "\n".join(logged)


def test_vllm_ascend_excluded_through_vllm_plugins(host, clean_env):
    host(soc="Ascend950PR", vllm_ascend=True)
    clean_env.setenv("VLLM_PLUGINS", "deepinfer_vllm,deepinfer_ascend")
    assert ascend.ascend_platform_plugin() == OURS
    clean_env.setenv("VLLM_PLUGINS", "deepinfer_vllm,deepinfer_ascend,ascend")
    assert ascend.ascend_platform_plugin() is None


def test_ascend_mode_does_not_override_vllm_ascend(host, clean_env, log_lines):
    """Both claiming would stop vLLM; the user is told how to choose instead."""
    host(soc="Ascend950PR", vllm_ascend=True)
    clean_env.setenv("DEEPINFER_PLATFORM", "ascend")
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() is None
    assert "VLLM_PLUGINS" in "\n".join(logged)


def test_off_and_cpu_target_never_claim(host, clean_env):
    host(soc="Ascend950PR")
    clean_env.setenv("DEEPINFER_PLATFORM", "off")
    assert ascend.ascend_platform_plugin() is None
    clean_env.setenv("DEEPINFER_SIMULATED_NPU", "1")
    assert ascend.ascend_platform_plugin() is None
    clean_env.setenv("DEEPINFER_PLATFORM", "auto")
    clean_env.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert ascend.ascend_platform_plugin() is None


def test_simulated_npu_claims_a_cpu_host(host, clean_env, log_lines):
    host(soc=None)
    clean_env.setenv("DEEPINFER_SIMULATED_NPU", "1")
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert ascend.ascend_platform_plugin() == OURS
    assert "For tests only" in "\n".join(logged)
    assert platforms.cpu_platform_plugin() is None


def test_simulated_npu_is_off_by_default_and_validated(clean_env):
    from deepinfer_vllm import envs

    assert envs.simulated_npu() is False
    clean_env.setenv("DEEPINFER_SIMULATED_NPU", "yes")
    with pytest.raises(ValueError, match="DEEPINFER_SIMULATED_NPU"):
        envs.simulated_npu()


def test_platform_values(clean_env):
    from deepinfer_vllm import envs

    for value in ("auto", "off", "ascend"):
        clean_env.setenv("DEEPINFER_PLATFORM", value)
        assert envs.platform_mode() == value
    clean_env.setenv("DEEPINFER_PLATFORM", "npu")
    with pytest.raises(ValueError, match="DEEPINFER_PLATFORM"):
        ascend.ascend_platform_plugin()


def test_cpu_host_without_npu_stays_on_cpu_platform(host):
    host(soc=None)
    assert ascend.ascend_platform_plugin() is None
    assert platforms.cpu_platform_plugin() == platforms.CPU_PLATFORM


def _claimants() -> list[str]:
    """vLLM's rule: out-of-tree plugins allowed by VLLM_PLUGINS that return a class path.
    vllm-ascend's plugin claims every host it is installed on."""
    import os
    import sys

    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else allowed.split(",")
    plugins = {"deepinfer_cpu": platforms.cpu_platform_plugin, "deepinfer_ascend": ascend.ascend_platform_plugin}
    if sys.modules.get("vllm_ascend") is not None:
        plugins["ascend"] = lambda: "vllm_ascend.platform.NPUPlatform"
    return [name for name, fn in plugins.items() if (allowed is None or name in allowed) and fn() is not None]


SOCS = (None, "Ascend950PR", "Ascend910B3")
MODES = ("auto", "off", "ascend")
PLUGIN_SETTINGS = (None, "deepinfer_vllm,deepinfer_cpu,deepinfer_ascend", "deepinfer_vllm,deepinfer_ascend,ascend")


@pytest.mark.parametrize(
    "soc, vllm_ascend, mode, simulated, plugins",
    list(itertools.product(SOCS, (False, True), MODES, (False, True), PLUGIN_SETTINGS)),
)
def test_never_two_out_of_tree_platforms(host, clean_env, soc, vllm_ascend, mode, simulated, plugins):
    host(soc=soc, vllm_ascend=vllm_ascend)
    clean_env.setenv("DEEPINFER_PLATFORM", mode)
    if simulated:
        clean_env.setenv("DEEPINFER_SIMULATED_NPU", "1")
    if plugins is not None:
        clean_env.setenv("VLLM_PLUGINS", plugins)
    claimed = _claimants()
    assert len(claimed) <= 1, claimed
    if mode == "off":
        assert "deepinfer_ascend" not in claimed and "deepinfer_cpu" not in claimed
    vllm_ascend_claims = vllm_ascend and (plugins is None or "ascend" in plugins.split(","))
    expected_ours = (
        mode != "off"
        and (plugins is None or "deepinfer_ascend" in plugins)
        and not vllm_ascend_claims
        and (simulated or (soc is not None and (soc.startswith("Ascend950") or mode == "ascend")))
    )
    if vllm_ascend_claims:
        assert claimed == ["ascend"]
    assert ("deepinfer_ascend" in claimed) == expected_ours, claimed


def test_device_layer_choice(clean_env):
    assert npu.get().simulated is False
    clean_env.setenv("DEEPINFER_SIMULATED_NPU", "1")
    layer = npu.get()
    assert isinstance(layer, npu.SimulatedNPU)
    assert (layer.device_type, layer.dispatch_key, layer.dist_backend) == ("cpu", "CPU", "gloo")
    assert npu.is_ascend_950(layer.soc_name(0))
    real = npu.TorchNPU()
    assert (real.device_type, real.dispatch_key, real.dist_backend) == ("npu", "PrivateUse1", "hccl")
    assert real.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"


def test_device_layer_calls_go_to_torch_npu(host):
    stub = host(soc="Ascend950DT", count=2)
    layer = npu.TorchNPU()
    assert layer.is_available() and layer.device_count() == 2
    assert layer.soc_name(1) == "Ascend950DT"
    assert layer.mem_get_info() == (64 << 30, 128 << 30)
    layer.set_device(1)
    assert layer.total_memory(1) == 128 << 30
    layer.synchronize()
    layer.manual_seed_all(7)
    layer.empty_cache()
    assert [name for name, _ in stub.calls] == ["set_device", "synchronize", "manual_seed_all", "empty_cache"]
    assert layer.Stream is stub.npu.Stream and layer.Event is stub.npu.Event


def test_simulated_layer_needs_no_torch_npu(host):
    host(soc=None)
    layer = npu.SimulatedNPU()
    free, total = layer.mem_get_info()
    assert 0 < free <= total
    stream, event = layer.Stream(), layer.Event()
    stream.wait_stream(None)
    event.record()
    assert event.query()
    layer.synchronize()
    with layer.stream(stream):
        pass


def test_broken_torch_npu_is_no_npu(host):
    stub = host(soc="Ascend950PR")

    def boom(*a):
        raise RuntimeError("ACL not initialised")

    stub.npu.device_count = boom
    stub.npu.get_device_name = boom
    stub._C._npu_getDeviceName = boom
    layer = npu.TorchNPU()
    assert layer.device_count() == 0 and layer.soc_name() is None
    assert ascend.ascend_platform_plugin() is None


def test_detection_and_platform_queries_open_no_device(host):
    """vLLM resolves the platform and asks its device name and memory in the API server and
    the engine core too: none of it may call a torch_npu function that initialises the device
    (a context on NPU 0 for the life of the process)."""
    from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform as P

    stub = host(soc="Ascend950DT", count=4)
    assert ascend.ascend_platform_plugin() == OURS
    assert P.get_device_name() == "Ascend950DT" and P.device_count() == 4
    with pytest.raises(NotImplementedError, match="after it selected its device"):
        P.get_device_total_memory()
    assert stub.context_calls == []


def test_vllm_batch_defaults_fall_back_without_touching_the_npu(host, monkeypatch):
    """vLLM's API server sizes its default batch from the device's memory and catches a
    refusal: the defaults for an unknown device, and no device context."""
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    from deepinfer_vllm.platforms.ascend.platform import DeepInferAscendPlatform

    stub = host(soc="Ascend950PR")
    monkeypatch.setattr(arg_utils, "current_platform", DeepInferAscendPlatform())
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size=1)
    # vLLM's values for a device below 70 GiB or of unknown memory (arg_utils.get_batch_defaults).
    assert (tokens[UsageContext.LLM_CLASS], tokens[UsageContext.OPENAI_API_SERVER]) == (8192, 2048)
    assert seqs[UsageContext.LLM_CLASS] == 256
    assert stub.context_calls == []


def test_memory_and_soc_after_the_worker_selected_its_npu(host):
    stub = host(soc="Ascend950PR", soc_binding=False)
    layer = npu.get()
    assert layer.soc_name() is None  # older torch_npu: its get_device_name would open NPU 0
    assert stub.context_calls == []
    layer.set_device(5)
    assert layer.selected == 5
    assert layer.soc_name(5) == "Ascend950PR" and layer.total_memory(5) == 128 << 30
    assert stub.context_calls == ["set_device", "get_device_name", "get_device_properties"]


@pytest.mark.parametrize("mode, ours", [("auto", False), ("ascend", True)])
def test_soc_unreadable_without_a_device(host, clean_env, log_lines, mode, ours):
    """A torch_npu without the context-free SoC query: the platform stands aside in ``auto``
    (it cannot tell a 950) and says how to choose it; ``ascend`` takes the host."""
    stub = host(soc="Ascend950PR", soc_binding=False)
    clean_env.setenv("DEEPINFER_PLATFORM", mode)
    with log_lines("deepinfer_vllm.platforms.ascend") as logged:
        assert (ascend.ascend_platform_plugin() == OURS) is ours
    text = "\n".join(logged)
    assert "gives their SoC name only after opening a device" in text
    assert ("DEEPINFER_PLATFORM=ascend" in text) and stub.context_calls == []
