"""DeepInfer's NPU worker and model runner.

The runner is vLLM's device runner (``GPUModelRunner``: host staging buffers,
device-resident inputs, copies between them) with V4.1's additions
(``v41_runner.V41RunnerMixin``, shared with the CPU runner: prompt lengths in
the step metadata, seeded sampling across prefill chunks, DSpark drafting and
adaptive verification). The worker is vLLM's GPU worker with its device calls
replaced by the device layer's (``device.get()``): device selection (vLLM's
mapping of data-parallel ranks to devices, ported: ``device_index``),
distributed set-up on the platform's backend (HCCL), memory profiling
(``kv_cache_bytes``: vLLM's start-up check and peak-based budget), and an eager
warm-up before serving. While the worker lives, its process's ``torch.cuda``
stream and event calls and ``torch.accelerator`` synchronisation are the device
layer's (``TorchNPU.torch_api``, ``patch.torch_device_calls``), which is how vLLM's
runner code runs unchanged.

On the simulated NPU (``DEEPINFER_SIMULATED_NPU=1``) these same classes run
with host tensors: each staging buffer and its "device" twin are separate
tensors, so a copy the runner failed to make would show as wrong tokens.
Never run on an NPU: see the README's "What runs where".
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from dataclasses import dataclass

import torch
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group
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

# Executors that place each worker on its device themselves (vLLM's rule).
SELF_PLACING_BACKENDS = ("ray", "external_launcher")

LOAD_OOM_MESSAGE = (
    "Failed to load the model: not enough NPU memory. Lower --gpu-memory-utilization (it also "
    "bounds the weights), raise --tensor-parallel-size, or serve on more NPUs."
)


def _gib(b: float) -> str:
    return f"{b / GIB:.2f}"


# ---------------------------------------------------------------- device mapping
def device_index(parallel, local_rank: int, device_count: int, platform) -> tuple[int, int]:
    """``(local_rank, visible device index)`` of a worker, as vLLM 0.32's GPU worker maps them.

    Data-parallel engines started by vLLM's own processes on one node share its devices,
    each after the ``TP x PCP x PP`` devices of the engines before it (``local_rank`` is
    shifted by ``dp_local_rank * tp * pcp * pp``); not where the executor places workers
    itself (Ray, an external launcher) or a data-parallel rank spans several nodes. The
    logical id then indexes ``assigned_physical_gpu_ids`` when vLLM gave the engine device
    ids (published for vLLM's topology queries, and bounded by their number), else the
    visible devices (bounded by ``device_count``), and ``ASCEND_RT_VISIBLE_DEVICES`` maps it
    to the index torch_npu takes. Out-of-range ranks raise ``ValueError`` naming the numbers.

    One difference from the GPU worker, as in vllm-ascend's: no shift where device ids are
    assigned. On a platform that is neither CUDA-like nor XPU, vLLM's engine launcher gives
    each data-parallel engine its own shard of the devices (``--device-ids``, or the visible
    ones: ``set_assigned_physical_gpu_ids_for_dp_rank``), whose first device is that engine's
    local rank 0; shifting as well would index past the shard."""
    backend = parallel.distributed_executor_backend
    if (
        backend not in SELF_PLACING_BACKENDS
        and parallel.data_parallel_backend != "ray"
        and parallel.nnodes_within_dp == 1
        and parallel.assigned_physical_gpu_ids is None
    ):
        dp_local_rank = parallel.data_parallel_rank_local
        if dp_local_rank is None:
            dp_local_rank = parallel.data_parallel_index
        per_engine = (
            parallel.pipeline_parallel_size
            * parallel.prefill_context_parallel_size
            * parallel.tensor_parallel_size
        )
        local_rank += dp_local_rank * per_engine
    assigned = parallel.assigned_physical_gpu_ids
    if assigned is not None:
        from vllm.platforms.interface import set_assigned_physical_gpu_ids

        set_assigned_physical_gpu_ids(assigned)
        if local_rank >= len(assigned):
            raise ValueError(
                f"local rank {local_rank} has no device: assigned device ids {assigned} "
                f"({len(assigned)} devices)"
            )
        if backend not in SELF_PLACING_BACKENDS and parallel.local_world_size > len(assigned):
            raise ValueError(
                f"{parallel.local_world_size} ranks on this node but {len(assigned)} assigned "
                f"device ids ({assigned})"
            )
    elif local_rank >= device_count:
        raise ValueError(
            f"local rank {local_rank} (after the data-parallel offset) has no device: "
            f"{device_count} NPU(s) visible"
        )
    return local_rank, platform.logical_device_id_to_visible_device_id(local_rank)


# ---------------------------------------------------------------- memory
@dataclass(frozen=True)
class MemoryFigures:
    """What the worker measured on its device, in bytes.

    ``init_free``: free at start-up (after the communicators, before the weights);
    ``free_after``: free after the profiling step (caches emptied); ``peak``: the
    allocator's peak during that step; ``allocated_after``: allocated after it."""

    total: int
    init_free: int
    free_after: int
    peak: int
    allocated_after: int


def requested_bytes(total: int, init_free: int, utilization: float) -> int:
    """The device budget ``ceil(utilization x total)``, which must be free at start-up
    (vLLM's rule: what other processes hold is not this instance's to count)."""
    requested = math.ceil(total * utilization)
    if init_free < requested:
        raise ValueError(
            f"Free NPU memory at start-up ({_gib(init_free)}/{_gib(total)} GiB) is less than "
            f"--gpu-memory-utilization={utilization} asks ({_gib(requested)} GiB). Lower it, or "
            f"stop the other processes using this NPU."
        )
    return requested


def kv_cache_bytes(fig: MemoryFigures, utilization: float) -> tuple[int, dict[str, int]]:
    """Bytes for the KV caches and the terms (vLLM's ``memory_profiling``):
    ``requested - consumed - transient``, where ``consumed = init_free - free_after`` is
    everything this instance holds after the profiling step (weights, communicators,
    workspaces, whatever else it allocated) and ``transient = peak - allocated_after`` the
    step's activations above that, which the KV caches must leave room for."""
    requested = requested_bytes(fig.total, fig.init_free, utilization)
    if fig.free_after > fig.init_free:
        raise RuntimeError(
            f"NPU memory profiling: {_gib(fig.free_after)} GiB free after the profiling step, "
            f"{_gib(fig.init_free)} GiB at start-up; another process released device memory "
            "meanwhile. Give this instance NPUs of its own."
        )
    terms = {
        "requested": requested,
        "consumed": fig.init_free - fig.free_after,
        "transient": max(fig.peak - fig.allocated_after, 0),
    }
    kv = requested - terms["consumed"] - terms["transient"]
    if kv <= 0:
        raise ValueError(
            f"No NPU memory left for the KV caches: budget {_gib(requested)} GiB "
            f"(--gpu-memory-utilization={utilization} of {_gib(fig.total)} GiB), held after "
            f"profiling {_gib(terms['consumed'])} GiB, step peak above that "
            f"{_gib(terms['transient'])} GiB. Raise --gpu-memory-utilization or add NPUs."
        )
    return kv, terms


# ---------------------------------------------------------------- warm-up
def warm_up_sizes(max_num_tokens: int, max_num_reqs: int, num_spec_tokens: int) -> list[int]:
    """Step sizes (tokens) the warm-up runs, largest first: a full prefill chunk, a full
    decode batch with its drafts verified, a full decode batch, one token."""
    decode = min(max_num_reqs, max_num_tokens)
    sizes = {max_num_tokens, min(decode * (1 + num_spec_tokens), max_num_tokens), decode, 1}
    return sorted(sizes, reverse=True)


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

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's loading; an NPU allocation failure ends in the same clear error vLLM gives
        for CUDA's (its handler catches ``torch.OutOfMemoryError`` only; older torch_npu
        releases and ACL's own allocations raise ``RuntimeError``)."""
        try:
            super().load_model(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise  # vLLM's handler logged its message already
        except RuntimeError as e:
            if not npu.get().is_out_of_memory(e):
                raise
            logger.error("%s (original error: %s)", LOAD_OOM_MESSAGE, e)
            raise torch.OutOfMemoryError(f"{LOAD_OOM_MESSAGE} (original error: {e})") from e

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
    init_free: int | None = None
    total_memory: int | None = None
    requested_memory: int | None = None

    def init_device(self):
        layer = npu.get()
        self._torch_api = contextlib.ExitStack()
        self._torch_api.enter_context(layer.torch_api())
        if layer.simulated:
            self.device = layer.torch_device(self.local_rank)  # host tensors: one "device"
        else:
            # Nothing before this touches a device: detection and the platform ask the
            # driver only, so this is the first device context of the process.
            self.local_rank, index = device_index(
                self.parallel_config, self.local_rank, layer.device_count(), current_platform
            )
            self.device = layer.torch_device(index)
        layer.set_device(self.device)
        logger.info("Worker rank %d on %s (%s)", self.rank, self.device, layer.soc_name(self.device.index or 0))
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        # Communicators first, so their buffers count as used before any profiling.
        init_worker_distributed_environment(
            self.vllm_config, self.rank, self.distributed_init_method, self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        layer.empty_cache()
        self.init_free, self.total_memory = layer.mem_get_info(self.device)
        if not layer.simulated:
            # The simulated NPU's memory is the host's, shared with everything else on it;
            # its KV space is the CPU platform's rule (VLLM_CPU_KVCACHE_SPACE).
            self.requested_memory = requested_bytes(
                self.total_memory, self.init_free, self.cache_config.gpu_memory_utilization
            )
        self._init_workspace_and_model_runner()

    def _make_model_runner(self):
        return DeepInferNPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str):
        return contextlib.nullcontext()  # no sleep-mode allocator on the NPU

    def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep mode is not supported on DeepInfer's Ascend platform")

    def wake_up(self, tags=None) -> None:
        raise ValueError("sleep mode is not supported on DeepInfer's Ascend platform")

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes for the KV caches: ``kv_cache_memory_bytes`` when set (after the profiling
        step all the same: it is also the first run of every operator), else
        ``kv_cache_bytes`` of what this step measured."""
        layer = npu.get()
        gc.collect()
        layer.empty_cache()
        layer.reset_peak_memory_stats(self.device)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.profile_run()
        layer.synchronize(self.device)
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            logger.info("KV caches: %s GiB as set by kv_cache_memory_bytes", _gib(explicit))
            return int(explicit)
        peak = layer.max_memory_allocated(self.device)
        gc.collect()
        layer.empty_cache()
        free_after, total = layer.mem_get_info(self.device)
        fig = MemoryFigures(
            total=total,
            init_free=self.init_free,
            free_after=free_after,
            peak=peak,
            allocated_after=layer.memory_allocated(self.device),
        )
        kv, terms = kv_cache_bytes(fig, self.cache_config.gpu_memory_utilization)
        logger.info(
            "KV caches: %s GiB (budget %s GiB; held after profiling %s GiB, weights %s GiB of it; "
            "step transient %s GiB)",
            _gib(kv), _gib(terms["requested"]), _gib(terms["consumed"]),
            _gib(getattr(self.model_runner, "model_memory_usage", 0)), _gib(terms["transient"]),
        )
        return kv

    @torch.inference_mode()
    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Eager on the NPU: nothing is compiled or captured, but every operator's first
        call loads its kernel and tiles its shape, and a communicator connects on its first
        collective. One step of each size the runner serves (``warm_up_sizes``), with the
        attention metadata and KV caches of a real step, and the sampler's first run (on the
        last pipeline rank, as vLLM's worker does), so no rank pays that on a first request
        while its peers wait in a collective."""
        runner = self.model_runner
        num_spec = runner.uniform_decode_query_len - 1
        with runner.unmeasured_steps():  # cold steps stay out of DSpark's cost table
            for size in warm_up_sizes(runner.max_num_tokens, runner.max_num_reqs, num_spec):
                runner._dummy_run(size, cudagraph_runtime_mode=CUDAGraphMode.NONE, force_attention=True,
                                  skip_eplb=True)
            if get_pp_group().is_last_rank:
                reqs = min(runner.max_num_reqs, runner.max_num_tokens)
                _, last_hidden = runner._dummy_run(reqs, cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                                   skip_eplb=True)
                runner._dummy_sampler_run(hidden_states=last_hidden)
        npu.get().synchronize(self.device)
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def deepinfer_runner_info(self) -> dict:
        """The runner's class, device and buffer residency, and where the model keeps its Engram
        rows (``collective_rpc``)."""
        runner = self.model_runner
        engram = getattr(runner.get_model(), "engram_runtime", None)
        return {
            "runner": type(runner).__name__,
            "device": str(runner.device),
            **runner.buffer_residency(),
            "engram": engram.report() if engram is not None else None,
        }

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._torch_api is not None:
                self._torch_api.close()
                self._torch_api = None
