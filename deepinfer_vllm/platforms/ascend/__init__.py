"""DeepInfer's Ascend 950 platform, and its ``vllm.platform_plugins`` detection.

vLLM resolves its platform by calling every platform plugin; an out-of-tree
plugin that returns a class path wins over the built-in ones, and two
out-of-tree plugins that both return one stop vLLM ("Only one platform plugin
can be activated"). :func:`ascend_platform_plugin` therefore claims the host
only where no other out-of-tree platform will, in this order:

1. ``DEEPINFER_PLATFORM=off`` or ``VLLM_TARGET_DEVICE=cpu``: never.
2. vllm-ascend installed and its plugin allowed (``VLLM_PLUGINS`` unset, or
   naming its entry): never. vllm-ascend's plugin claims every host it is
   installed on, so claiming too would stop vLLM; the log says how to choose
   ours (``VLLM_PLUGINS=deepinfer_vllm,deepinfer_ascend`` or uninstall it).
   DeepInfer's CPU plugin stands aside there too.
3. ``DEEPINFER_SIMULATED_NPU=1`` (tests only): ours; the device layer is the
   :class:`~.device.SimulatedNPU` stub (DeepInfer's CPU plugin stands aside).
4. No ``torch_npu``: never (not an Ascend host as far as vLLM can run).
5. No NPU visible: never.
6. The SoC is an Ascend 950: ours. Another SoC: ours only with
   ``DEEPINFER_PLATFORM=ascend`` (logged as untested); otherwise the log names
   the SoC and the way to force ours. A SoC that cannot be read without opening
   a device (a torch_npu older than the pinned one): ours only with
   ``DEEPINFER_PLATFORM=ascend``.

Steps 5 and 6 ask the driver (device count, SoC name) and open no device
context: vLLM runs this in every process, and a context opened here would hold
memory on NPU 0 for the life of the API server, the engine core and each worker
(``device.py``'s docstring). vllm-ascend's ``register()`` decides without any
query (its build names the SoC); this plugin shares the host with vllm-ascend's
and the CPU platform, so it must know the SoC, and asks the one query that
needs no context.

Every outcome past step 1 is logged once per process, naming the platform
that will run.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ASCEND_PLATFORM = "deepinfer_vllm.platforms.ascend.platform.DeepInferAscendPlatform"
# Our entry in ``vllm.platform_plugins`` (setup.py) and vllm-ascend's package.
ENTRY_NAME = "deepinfer_ascend"
VLLM_ASCEND_PACKAGE = "vllm_ascend"

_said: set[str] = set()


def _say(level: int, msg: str, *args) -> None:
    key = msg % args if args else msg
    if key not in _said:
        _said.add(key)
        logger.log(level, msg, *args)


def _allowed_plugins() -> list[str] | None:
    """``VLLM_PLUGINS`` as vLLM reads it (None: every plugin loads)."""
    raw = os.environ.get("VLLM_PLUGINS")
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def vllm_ascend_installed() -> bool:
    import importlib.util
    import sys

    if VLLM_ASCEND_PACKAGE in sys.modules:
        return sys.modules[VLLM_ASCEND_PACKAGE] is not None
    try:
        return importlib.util.find_spec(VLLM_ASCEND_PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def vllm_ascend_entry_names() -> list[str]:
    """Names of vllm-ascend's ``vllm.platform_plugins`` entries (``["ascend"]`` if none is visible)."""
    from importlib.metadata import entry_points

    group = entry_points(group="vllm.platform_plugins")
    names = [ep.name for ep in group if ep.value.startswith(VLLM_ASCEND_PACKAGE)]
    return names or ["ascend"]


def vllm_ascend_claims() -> bool:
    """vllm-ascend is installed and vLLM will load its platform plugin."""
    if not vllm_ascend_installed():
        return False
    allowed = _allowed_plugins()
    return allowed is None or any(name in allowed for name in vllm_ascend_entry_names())


def ascend_platform_plugin() -> str | None:
    from deepinfer_vllm import envs

    from . import device as npu

    mode = envs.platform_mode()
    if mode == "off" or os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return None
    if vllm_ascend_claims():
        _say(
            logging.WARNING if mode == "ascend" else logging.INFO,
            "vllm-ascend is installed and its platform plugin runs this host; DeepInfer's Ascend "
            "platform stands aside (vLLM activates one out-of-tree platform). To run DeepInfer's "
            "instead set VLLM_PLUGINS=deepinfer_vllm,%s (leaving out vllm-ascend's %s) or "
            "uninstall vllm-ascend.",
            ENTRY_NAME,
            ",".join(vllm_ascend_entry_names()),
        )
        return None
    if envs.simulated_npu():
        _say(
            logging.WARNING,
            "DEEPINFER_SIMULATED_NPU=1: DeepInfer's Ascend platform runs on %s "
            "(CPU tensors, device layer stubbed). For tests only.",
            npu.SIMULATED_SOC,
        )
        return ASCEND_PLATFORM
    if not npu.torch_npu_installed():
        if mode == "ascend":
            _say(logging.WARNING, "DEEPINFER_PLATFORM=ascend but torch-npu is not installed: "
                 "DeepInfer's Ascend platform is off (pip install 'deepinfer-vllm[ascend]').")
        return None
    layer = npu.get()
    if layer.device_count() <= 0:
        if mode == "ascend":
            _say(logging.WARNING, "DEEPINFER_PLATFORM=ascend but torch-npu sees no NPU: "
                 "DeepInfer's Ascend platform is off.")
        return None
    soc = layer.soc_name(0)
    if soc is None:
        _say(
            logging.WARNING if mode == "ascend" else logging.INFO,
            "torch-npu sees %d NPU(s) but gives their SoC name only after opening a device, which "
            "DeepInfer's Ascend platform does not do before a worker selects its NPU; %s",
            layer.device_count(),
            "running it as asked (DEEPINFER_PLATFORM=ascend)." if mode == "ascend" else
            "it stands aside. Install the torch-npu the 'ascend' extra pins, or set DEEPINFER_PLATFORM=ascend.",
        )
        return ASCEND_PLATFORM if mode == "ascend" else None
    if npu.is_ascend_950(soc):
        _say(logging.INFO, "DeepInfer's Ascend platform runs this host (%s).", soc)
        return ASCEND_PLATFORM
    if mode == "ascend":
        _say(
            logging.WARNING,
            "DEEPINFER_PLATFORM=ascend: DeepInfer's Ascend platform runs on %s, which is not an "
            "Ascend 950 (the SoC DeepInfer targets; untested here).",
            soc,
        )
        return ASCEND_PLATFORM
    _say(
        logging.INFO,
        "Ascend SoC %s is not an Ascend 950: DeepInfer's Ascend platform stands aside (vllm-ascend "
        "serves it if installed). Set DEEPINFER_PLATFORM=ascend to run DeepInfer's on it.",
        soc,
    )
    return None
