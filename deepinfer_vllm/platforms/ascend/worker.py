"""DeepInfer's NPU worker and model runner.

The runner is DeepInfer's CPU runner (``platforms/cpu_worker.py``): its V4.1
logic (prompt lengths in the step metadata, seeded sampling across prefill
chunks, DSpark drafting and adaptive verification) is device-independent and
is inherited unchanged; DSpark is driven exactly as on CPU. Only the device
calls differ, and they go through the device layer (``device.get()``):
synchronisation, the device of the worker, seeding.

Status: the simulated NPU (``DEEPINFER_SIMULATED_NPU=1``) runs the whole
engine on host tensors through these classes. A real NPU needs the runner's
host-tensor base (vLLM's ``CPUModelRunner``, which maps every device buffer
onto its host copy) replaced by a device base with NPU streams; until then
the worker refuses a real NPU by name instead of running it wrongly.
"""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as stock_worker
from vllm.v1.worker.cpu_worker import CPUWorker

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms.cpu_worker import DeepInferCPUModelRunner, DeepInferCPUWorker

REAL_NPU_PENDING = (
    "DeepInfer's Ascend worker runs only on the simulated NPU so far (DEEPINFER_SIMULATED_NPU=1): "
    "the device-resident runner for a real NPU is not written yet. Use vllm-ascend on this host "
    "(DEEPINFER_PLATFORM=off)."
)


class DeepInferNPUModelRunner(DeepInferCPUModelRunner):
    """DeepInfer's V4.1 runner with its device calls routed through the device layer."""

    def _sync_device(self) -> None:
        npu.get().synchronize()


class DeepInferNPUWorker(DeepInferCPUWorker):
    def __init__(self, *args, **kwargs):
        if not npu.get().simulated:
            raise NotImplementedError(REAL_NPU_PENDING)
        super().__init__(*args, **kwargs)

    def init_device(self):
        layer = npu.get()
        # The stock worker names its runner class directly; swap ours in for
        # the duration of the call (this process only runs this worker).
        stock_runner = stock_worker.CPUModelRunner
        stock_worker.CPUModelRunner = DeepInferNPUModelRunner
        try:
            CPUWorker.init_device(self)
        finally:
            stock_worker.CPUModelRunner = stock_runner
        layer.set_device(self.device)
