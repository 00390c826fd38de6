"""DeepInfer's NPU worker and model runner.

The runner is vLLM's device runner (``GPUModelRunner``: host staging buffers,
device-resident inputs, copies between them) with V4.1's additions
(``v41_runner.V41RunnerMixin``, shared with the CPU runner: prompt lengths in
the step metadata, seeded sampling across prefill chunks, DSpark drafting and
adaptive verification). The worker is vLLM's GPU worker with its device calls
replaced by the device layer's (``device.get()``): device selection,
distributed set-up on the platform's backend (HCCL), memory profiling, eager
warm-up. While the worker lives, its process's ``torch.cuda`` stream and event
calls and ``torch.accelerator`` synchronisation are the device layer's
(``TorchNPU.torch_api``), which is how vLLM's runner code runs unchanged.

On the simulated NPU (``DEEPINFER_SIMULATED_NPU=1``) these same classes run
with host tensors: each staging buffer and its "device" twin are separate
tensors, so a copy the runner failed to make would show as wrong tokens.
Never run on an NPU: see the README's "What runs where".
"""

from __future__ import annotations

import contextlib
import gc
import logging

from vllm.config import set_current_vllm_config
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms.v41_runner import V41RunnerMixin, V41WorkerMixin

logger = logging.getLogger(__name__)

GIB = 1 << 30


class DeepInferNPUModelRunner(V41RunnerMixin, GPUModelRunner):
    """vLLM's device runner with V4.1's additions; device calls through the device layer."""

    def __init__(self, vllm_config, device):
        with npu.get().torch_api():
            super().__init__(vllm_config, device)

    def _sync_device(self) -> None:
        npu.get().synchronize(self.device)

    def _init_kv_zero_meta(self) -> None:
        pass  # vLLM's block zeroer is a CUDA kernel; _zero_block_ids below is plain torch

    # Zeroes full-attention blocks with tensor ops, any device (V4.1's caches are not
    # full-attention specs, so for V4.1 this is a no-op, as on CPU).
    _zero_block_ids = CPUModelRunner._zero_block_ids

    def buffer_residency(self) -> dict[str, int]:
        """How many of the runner's staging buffers have a separate device twin (all of
        them on an NPU, and on the simulated NPU, where the CPU runner aliases them)."""
        from vllm.v1.utils import CpuGpuBuffer

        buffers = [v for v in vars(self).values() if isinstance(v, CpuGpuBuffer)]
        for table in self.input_batch.block_table.block_tables:
            buffers += [v for v in vars(table).values() if isinstance(v, CpuGpuBuffer)]
        separate = sum(
            b.cpu.untyped_storage().data_ptr() != b.gpu.untyped_storage().data_ptr() for b in buffers
        )
        return {"buffers": len(buffers), "separate": separate}


class DeepInferNPUWorker(V41WorkerMixin, Worker):
    """vLLM's worker with its device calls on the device layer."""

    _torch_api: contextlib.ExitStack | None = None

    def init_device(self):
        layer = npu.get()
        self._torch_api = contextlib.ExitStack()
        self._torch_api.enter_context(layer.torch_api())
        if not layer.simulated:
            self.local_rank += self._dp_local_offset()
        self.device = layer.torch_device(self.local_rank)
        layer.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        # Communicators first, so their buffers count as used before any profiling.
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        layer.empty_cache()
        self._init_workspace_and_model_runner()

    def _dp_local_offset(self) -> int:
        """Data-parallel engines on one host share its NPUs: this engine's first device."""
        parallel = self.parallel_config
        if parallel.distributed_executor_backend in ("ray", "external_launcher"):
            return 0
        if parallel.data_parallel_backend == "ray":
            return 0
        dp_local_rank = parallel.data_parallel_rank_local
        if dp_local_rank is None:
            dp_local_rank = parallel.data_parallel_index
        return dp_local_rank * parallel.pipeline_parallel_size * parallel.tensor_parallel_size

    def _make_model_runner(self):
        return DeepInferNPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        return contextlib.nullcontext()  # no sleep-mode allocator on the NPU

    def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode is not supported on DeepInfer's Ascend platform")

    def wake_up(self, tags=None) -> None:
        raise ValueError("sleep mode is not supported on DeepInfer's Ascend platform")

    def determine_available_memory(self) -> int:
        """Bytes for the KV caches: ``kv_cache_memory_bytes`` when set, else the device
        budget (``gpu_memory_utilization`` of its memory) less what is in use after one
        profiling step and that step's transient peak."""
        layer = npu.get()
        layer.empty_cache()
        layer.reset_peak_memory_stats(self.device)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        layer.synchronize(self.device)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            logger.info("KV caches: %.2f GiB as set by kv_cache_memory_bytes", explicit / GIB)
            return int(explicit)
        return self._kv_budget(layer)

    def _kv_budget(self, layer) -> int:
        peak = layer.max_memory_allocated(self.device)
        layer.empty_cache()
        allocated = layer.memory_allocated(self.device)
        free, total = layer.mem_get_info(self.device)
        budget = int(total * self.cache_config.gpu_memory_utilization)
        in_use = total - free
        transient = max(peak - allocated, 0)
        kv = budget - in_use - transient
        if kv <= 0:
            raise ValueError(
                f"No device memory left for the KV caches: budget {budget / GIB:.2f} GiB "
                f"(gpu_memory_utilization={self.cache_config.gpu_memory_utilization} of "
                f"{total / GIB:.2f} GiB), in use {in_use / GIB:.2f} GiB, step peak above that "
                f"{transient / GIB:.2f} GiB. Raise --gpu-memory-utilization or add devices."
            )
        logger.info(
            "KV caches: %.2f GiB (budget %.2f GiB, in use %.2f GiB, step transient %.2f GiB)",
            kv / GIB, budget / GIB, in_use / GIB, transient / GIB,
        )
        return kv

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager on the NPU: nothing to compile or capture.
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def deepinfer_runner_info(self) -> dict:
        """The runner's class, device and buffer residency (``collective_rpc``)."""
        runner = self.model_runner
        return {"runner": type(runner).__name__, "device": str(runner.device), **runner.buffer_residency()}

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._torch_api is not None:
                self._torch_api.close()
                self._torch_api = None
