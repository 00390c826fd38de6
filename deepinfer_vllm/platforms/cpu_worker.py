"""DeepInfer's CPU worker and model runner: vLLM's CPU worker and runner with
V4.1's runner additions (``v41_runner.V41RunnerMixin``)."""

from __future__ import annotations

import vllm.v1.worker.cpu_worker as stock_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin, V41WorkerMixin


class DeepInferCPUModelRunner(V41RunnerMixin, CPUModelRunner):
    pass


class DeepInferCPUWorker(V41WorkerMixin, CPUWorker):
    def init_device(self):
        # The stock worker names its runner class directly; swap it in for
        # the duration of the call (this process only runs this worker).
        stock_runner = stock_worker.CPUModelRunner
        stock_worker.CPUModelRunner = DeepInferCPUModelRunner
        try:
            super().init_device()
        finally:
            stock_worker.CPUModelRunner = stock_runner
