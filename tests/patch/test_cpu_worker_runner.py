"""``patch.cpu_worker_runner``: vLLM's CPU worker builds its runner by class name; the patch
names DeepInfer's for the duration of ``init_device``."""

from __future__ import annotations

import inspect

import pytest
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from deepinfer_vllm.patch import cpu_worker_runner


def test_vllms_cpu_worker_still_builds_its_runner_by_module_name():
    """When this fails, vLLM's CPU worker chose its runner another way (e.g. through the GPU
    worker's ``_make_model_runner``, which it inherits but does not call): use that instead."""
    source = inspect.getsource(cpu_worker.CPUWorker.init_device)
    assert "self.model_runner = CPUModelRunner(self.vllm_config" in source
    assert "_make_model_runner" not in source and "_init_workspace_and_model_runner" not in source
    assert cpu_worker.CPUModelRunner is CPUModelRunner  # a global of the worker's module


def test_apply_names_the_runner_class_and_restores_vllms():
    class Runner(CPUModelRunner):
        pass

    class Other(CPUModelRunner):
        pass

    with cpu_worker_runner.apply(Runner):
        assert cpu_worker.CPUModelRunner is Runner
        with cpu_worker_runner.apply(Other):
            assert cpu_worker.CPUModelRunner is Other
        assert cpu_worker.CPUModelRunner is Runner
    assert cpu_worker.CPUModelRunner is CPUModelRunner
    with pytest.raises(RuntimeError), cpu_worker_runner.apply(Runner):
        raise RuntimeError("init_device failed")
    assert cpu_worker.CPUModelRunner is CPUModelRunner


def test_deepinfer_cpu_worker_builds_its_runner(monkeypatch):
    """``DeepInferCPUWorker.init_device`` runs vLLM's with DeepInfer's runner class named."""
    from deepinfer_vllm.platforms.cpu_worker import DeepInferCPUModelRunner, DeepInferCPUWorker

    seen = []

    def init_device(self):
        seen.append(cpu_worker.CPUModelRunner)

    monkeypatch.setattr(cpu_worker.CPUWorker, "init_device", init_device)
    object.__new__(DeepInferCPUWorker).init_device()
    assert seen == [DeepInferCPUModelRunner] and cpu_worker.CPUModelRunner is CPUModelRunner
