"""vLLM's CPU worker with another model runner class.

**vLLM behaviour (0.32).** ``CPUWorker.init_device`` (``vllm/v1/worker/cpu_worker.py``)
does the worker's whole start-up (device, thread binding, distributed set-up, seed) and
ends by building its runner from the module's global name:
``self.model_runner = CPUModelRunner(self.vllm_config, torch.device("cpu"))``. There is
no hook that names the runner class (the GPU worker has ``_make_model_runner``; the CPU
worker does not).

**Why it is insufficient.** DeepInfer's CPU runner is vLLM's ``CPUModelRunner`` with
V4.1's additions (``platforms.cpu_worker.DeepInferCPUModelRunner``). Building it after
``init_device`` would build vLLM's runner first (its buffers and caches), and copying
``init_device`` would fork vLLM's start-up.

**What the patch does.** ``apply(runner_cls)`` is a context manager: inside it,
``vllm.v1.worker.cpu_worker.CPUModelRunner`` is ``runner_cls``; on leaving (also on an
error) vLLM's class is back. Nested uses restore in order.

**Applied** in each CPU worker process, around vLLM's ``CPUWorker.init_device`` in
``DeepInferCPUWorker.init_device``; the worker process runs that one worker, so nothing
else builds a runner meanwhile.

**Removable** when vLLM's CPU worker names its runner class through a method or attribute
a subclass can set (``tests/patch/test_cpu_worker_runner.py`` reads ``init_device``).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def apply(runner_cls: type):
    """Inside, vLLM's CPU worker builds ``runner_cls`` as its model runner."""
    from vllm.v1.worker import cpu_worker

    stock = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = stock
