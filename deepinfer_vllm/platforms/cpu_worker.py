"""DeepInfer's CPU worker and model runner: vLLM's CPU worker and runner with
V4.1's runner additions (``v41_runner.V41RunnerMixin``)."""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from deepinfer_vllm.patch import cpu_worker_runner
from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin, V41WorkerMixin


class DeepInferCPUModelRunner(V41RunnerMixin, CPUModelRunner):
    pass


class DeepInferCPUWorker(V41WorkerMixin, CPUWorker):
    def init_device(self):
        # vLLM's CPU worker builds its runner by class name (``patch.cpu_worker_runner``).
        with cpu_worker_runner.apply(DeepInferCPUModelRunner):
            super().init_device()
