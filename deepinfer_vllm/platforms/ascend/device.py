"""The Ascend device layer: every call DeepInfer makes to an NPU, in one module.

Everything else of the Ascend platform (config decisions, worker, runner,
DSpark) is shared with the paths that run here; only this module touches
``torch_npu``. Two implementations share one interface:

* :class:`TorchNPU`: the real device, through ``torch_npu`` (imported on first
  use, so detection on a host without it costs one ``find_spec``);
* :class:`SimulatedNPU`: a stand-in for tests (``DEEPINFER_SIMULATED_NPU=1``):
  it reports one Ascend 950, keeps tensors on the host (device type ``cpu``,
  gloo for collectives), measures host memory, and makes streams, events and
  synchronisation no-ops. Never on by default.

:func:`get` returns the implementation of this process. Tests inject a stub
``torch_npu`` module into ``sys.modules`` to drive :class:`TorchNPU`.

Covered: SoC name, device count, set_device, synchronize, streams and events,
memory queries (free/total, peak, empty_cache), the distributed backend name
(HCCL) and process-group creation, the environment an Ascend process needs
before it first touches the device (visible devices, allocator settings, HCCL
timeouts), the dtype UE8M0 scales are held in, what counts as an out-of-memory
error, and :meth:`TorchNPU.torch_api`, which points the stream, event and
synchronisation calls of vLLM's GPU runner at this device
(``patch.torch_device_calls``). Graph capture is not used yet (V4.1 runs eager
on Ascend).

No device before ``set_device``. vLLM resolves the platform, and asks it for the
device's name and memory, in every process: the API server, the engine core and
each worker before it selects its NPU. ``torch_npu`` initialises ACL on its first
call that needs it (``torch_npu.npu._lazy_init``: ``get_device_properties``,
``mem_get_info``, ``current_device``, ``synchronize``, ...), and that opens a
context on NPU 0, which holds device memory for the life of the process; rank
0's KV budget would shrink by every such context (vLLM takes the smallest budget
over the ranks). So before this process's :meth:`TorchNPU.set_device` the layer
answers only what the driver gives without a context: the device count and the
SoC name. The total memory is refused until then (vLLM's callers before the
worker's ``set_device`` catch the refusal and fall back to defaults), as
vllm-ascend refuses it always (its ``get_device_total_memory`` raises, and its
``register()`` decides without touching a device).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from functools import lru_cache

from deepinfer_vllm.patch import torch_device_calls

logger = logging.getLogger(__name__)

# SoC names of the chips DeepInfer targets (``torch_npu.npu.get_device_name``
# returns e.g. "Ascend910B3", "Ascend950PR"); compared by prefix.
ASCEND_950_PREFIX = "Ascend950"
SIMULATED_SOC = "Ascend950PR (simulated)"


def is_ascend_950(soc_name: str | None) -> bool:
    return bool(soc_name) and soc_name.replace(" ", "").startswith(ASCEND_950_PREFIX)


def torch_npu_installed() -> bool:
    """``torch_npu`` importable (a module in ``sys.modules`` counts: tests stub it)."""
    import sys

    if "torch_npu" in sys.modules:
        return sys.modules["torch_npu"] is not None
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


class NullStream:
    """A stream whose work is already done (host execution): the simulated NPU's
    ``torch.cuda.Stream``. A class, as the real one is: vLLM's compiled code and
    dynamo test values with ``isinstance`` against the names they patch."""

    def __init__(self, *args, **kwargs) -> None:
        self.device = None

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else NullEvent()


class NullEvent:
    """An event that has always happened: the simulated NPU's ``torch.cuda.Event`` and
    ``torch.Event`` (torch's CPU backend has no events: ``torch.Event().record()`` raises)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class TorchNPU:
    """The real NPU through ``torch_npu`` (CANN). Never exercised on this project's CI."""

    simulated = False
    device_type = "npu"
    dispatch_key = "PrivateUse1"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    # The NPU this process selected (``set_device``); None before: no device is touched.
    selected: int | None = None

    @property
    def _torch_npu(self):
        import torch_npu  # registers torch.npu and the PrivateUse1 backend

        return torch_npu

    @property
    def _npu(self):
        return self._torch_npu.npu

    def load(self) -> None:
        """Import ``torch_npu`` (registers the ``npu`` device and its ops with torch)."""
        self._npu  # noqa: B018

    # ------------------------------------------------------------ queries
    def is_available(self) -> bool:
        try:
            return bool(self._npu.is_available())
        except Exception:  # driver missing, CANN not sourced
            logger.debug("torch_npu.npu.is_available() failed", exc_info=True)
            return False

    def device_count(self) -> int:
        """Visible NPUs, without a device context: ``torch_npu.npu.device_count`` asks the
        driver (``drvGetDevNum`` through libascend_hal, with ``ASCEND_RT_VISIBLE_DEVICES``
        applied; ``aclrtGetDeviceCount`` where that library is missing) and never calls
        ``_lazy_init``."""
        try:
            return int(self._npu.device_count())
        except Exception:
            logger.debug("torch_npu.npu.device_count() failed", exc_info=True)
            return 0

    def soc_name(self, device_id: int = 0) -> str | None:
        """The SoC name (e.g. ``Ascend950PR``), without a device context where torch_npu
        allows it: ``torch_npu._C._npu_getDeviceName`` is ``aclrtGetSocName``, the query
        torch_npu's own ``get_device_name`` makes without ``_lazy_init`` in the releases
        this extra pins (older ones initialised the device first). Without that binding
        the name is read only once this process selected its NPU; before, None (the
        caller says so). One SoC per host: the name is the runtime's, any device."""
        try:
            query = getattr(self._torch_npu._C, "_npu_getDeviceName", None)
            if query is not None:
                return str(query()) or None
            if self.selected is not None:
                return str(self._npu.get_device_name(device_id)) or None
        except Exception:
            logger.debug("reading the NPU's SoC name failed", exc_info=True)
        return None

    def total_memory(self, device_id: int = 0) -> int:
        """Bytes of device ``device_id``; only once this process selected its NPU (reading
        it needs a device context: see the module docstring)."""
        if self.selected is None:
            raise NotImplementedError(
                "DeepInfer's Ascend platform reads an NPU's memory only in a worker after it "
                "selected its device (the query opens a device context)"
            )
        return int(self._npu.get_device_properties(device_id).total_memory)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        free, total = self._npu.mem_get_info(device)
        return int(free), int(total)

    def memory_allocated(self, device=None) -> int:
        return int(self._npu.memory_allocated(device))

    def max_memory_allocated(self, device=None) -> int:
        return int(self._npu.max_memory_allocated(device))

    def reset_peak_memory_stats(self, device=None) -> None:
        self._npu.reset_peak_memory_stats(device)

    def empty_cache(self) -> None:
        self._npu.empty_cache()

    # ------------------------------------------------------------ control
    def torch_device(self, local_rank: int):
        import torch

        return torch.device(self.device_type, local_rank)

    def set_device(self, device) -> None:
        self._npu.set_device(device)
        self.selected = _device_index(device)

    def synchronize(self, device=None) -> None:
        self._npu.synchronize(device)

    def manual_seed_all(self, seed: int) -> None:
        self._npu.manual_seed_all(seed)

    @property
    def Stream(self) -> type:
        """This device's stream class (``torch_npu.npu.Stream``)."""
        return self._npu.Stream

    @property
    def Event(self) -> type:
        """This device's event class (``torch_npu.npu.Event``)."""
        return self._npu.Event

    def current_stream(self, device=None):
        return self._npu.current_stream(device)

    def stream(self, stream):
        return self._npu.stream(stream)

    def torch_patches(self) -> dict:
        """``(owner, name) -> replacement`` for the device calls vLLM's GPU runner makes by
        name: ``torch.cuda``'s ``Stream``, ``Event``, ``current_stream`` and ``stream``, and
        ``torch.accelerator``'s ``synchronize`` and ``empty_cache``. ``Stream`` and
        ``Event`` are replaced by classes, never by functions: code that dynamo compiles
        (vLLM's sampler) tests values with ``isinstance`` against these names, and a
        function there kills the step (``isinstance() arg 2 must be a type``).
        ``torch.Event`` stays torch's own: it is device-generic and, with ``torch_npu``
        loaded, records on the NPU."""
        import torch

        return {
            (torch.cuda, "Stream"): self.Stream,
            (torch.cuda, "Event"): self.Event,
            (torch.cuda, "current_stream"): self.current_stream,
            (torch.cuda, "stream"): self.stream,
            (torch.accelerator, "synchronize"): self.synchronize,
            (torch.accelerator, "empty_cache"): self.empty_cache,
        }

    @contextlib.contextmanager
    def torch_api(self):
        """Inside, the device calls vLLM's GPU runner makes by name are this device's
        (``torch_patches``, through ``patch.torch_device_calls``). The NPU worker holds it
        for its process's lifetime."""
        with torch_device_calls.apply(self.torch_patches()):
            yield self

    def new_group(self, ranks, **kwargs):
        """A process group over ``ranks`` on HCCL."""
        import torch.distributed as dist

        return dist.new_group(ranks, backend=self.dist_backend, **kwargs)

    def process_env(self) -> dict[str, str]:
        """Variables an Ascend process sets before touching the device,
        each only where the user left it unset.

        ``HCCL_BUFFSIZE`` and ``HCCL_EXEC_TIMEOUT`` keep HCCL's defaults (200 MB per
        direction and communicator, the size vllm-ascend gives its groups too; 1836 s): a
        smaller buffer splits every collective larger than it into rounds, and a short
        execution timeout fails a rank whose peer is still loading operators on its first
        steps. ``HCCL_CONNECT_TIMEOUT`` is raised from HCCL's 120 s: ranks can reach the
        collective where their links are set up minutes apart (weight loading differs)."""
        return {
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            "HCCL_CONNECT_TIMEOUT": "240",
        }

    @property
    def ue8m0_dtype(self):
        """The dtype UE8M0 scale parameters are held in on this device: their bytes as
        ``uint8``. torch_npu releases have exposed no e8m0 dtype, or one of their own
        (``torch_npu.float8_e8m0fnu``, which vllm-ascend's ``mxfp_compat`` looks up before
        torch's and passes to the operators that need it), so ``torch.float8_e8m0fnu``
        tensors are not known to work on an NPU; one-byte integers are. Every reader of
        the scales (``ops.quant``) takes either dtype as the same bytes."""
        import torch

        return torch.uint8

    def is_out_of_memory(self, exc: BaseException) -> bool:
        """An allocation failure on the NPU: ``torch.OutOfMemoryError`` (torch_npu's caching
        allocator, recent releases), a ``RuntimeError`` saying "NPU out of memory" (older
        ones), or ACL's memory-allocation error (207001) from a direct runtime call."""
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
        text = str(exc)
        return isinstance(exc, RuntimeError) and ("NPU out of memory" in text or "207001" in text)


class SimulatedNPU(TorchNPU):
    """Test stand-in for ``torch_npu``: one Ascend 950 whose memory is the host's.

    Tensors stay on the CPU; collectives run on gloo; streams, events and
    synchronisation are no-ops (host execution is synchronous)."""

    simulated = True
    device_type = "cpu"
    dispatch_key = "CPU"
    dist_backend = "gloo"

    def load(self) -> None:
        pass

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def soc_name(self, device_id: int = 0) -> str:
        return SIMULATED_SOC

    def total_memory(self, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    def mem_get_info(self, device=None) -> tuple[int, int]:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    def memory_allocated(self, device=None) -> int:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)

    def max_memory_allocated(self, device=None) -> int:
        return self.memory_allocated(device)

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def torch_device(self, local_rank: int):
        import torch

        return torch.device("cpu")

    def set_device(self, device) -> None:
        self.selected = 0

    def synchronize(self, device=None) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass  # torch.manual_seed covers the host generator

    Stream = NullStream
    Event = NullEvent

    def current_stream(self, device=None):
        return NullStream()

    def torch_patches(self) -> dict:
        """The real device's patches, plus ``torch.Event``: host tensors have no events."""
        import torch

        return {**super().torch_patches(), (torch, "Event"): NullEvent}

    def stream(self, stream):
        return contextlib.nullcontext(stream)

    def process_env(self) -> dict[str, str]:
        return {}


def _device_index(device) -> int:
    """The index of ``device`` (an int, ``"npu:3"`` or a ``torch.device``; no index: 0)."""
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None and isinstance(device, str) and ":" in device:
        index = int(device.rsplit(":", 1)[1])
    return int(index or 0)


@lru_cache(maxsize=1)
def _get(simulated: bool) -> TorchNPU:
    return SimulatedNPU() if simulated else TorchNPU()


def get() -> TorchNPU:
    """This process's device layer (:class:`SimulatedNPU` under ``DEEPINFER_SIMULATED_NPU=1``)."""
    from deepinfer_vllm import envs

    return _get(envs.simulated_npu())


def apply_process_env() -> None:
    """Set the device layer's process variables the user left unset."""
    for key, value in get().process_env().items():
        os.environ.setdefault(key, value)
