"""DeepInfer's Ascend 950 platform (``npu``): vLLM 0.32 serving V4.1 on Huawei NPUs.

The platform serves DeepInfer's V4.1 only (vllm-ascend serves everything
else; see ``ascend_platform_plugin`` for how the two are told apart). Its
V4.1 config decisions are the CPU platform's (``platforms/cpu.py``): paged
caches of 64-token blocks (or the user's even size), chunked prefill and
prefix caching as the user asked, parallel and checkpoint checks in the
user's process, DSpark configured the same way, attention routed to
DeepInfer's backend. What differs is the device profile:

* on an NPU (through ``device.TorchNPU``): device ``npu``, dispatch key
  ``PrivateUse1``, HCCL, ``ASCEND_RT_VISIBLE_DEVICES``, eager execution (no
  graph capture yet), spawned workers, the process variables of docs/design-notes.md, "Ascend process settings",
  PyTorch kernels in place of vLLM's Triton ones (``kernels.py``);
* simulated (``DEEPINFER_SIMULATED_NPU=1``, tests only): the same class,
  worker and runner with the device layer stubbed; tensors live on the host,
  so the host-execution settings of vLLM's CPU platform (KV space, executor,
  host-memory pinning) stand in for the device's, while the kernels (no vLLM
  kernel library, no Triton), the sampler, the communicator (over gloo) and
  the execution settings (eager, no asynchronous scheduling) are the NPU's,
  and vLLM's log names this platform.

Every device call goes through ``device.get()``.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms import plugin_serves_v41
from deepinfer_vllm.platforms.cpu import STOCK_WORKERS, DeepInferCpuPlatform
from deepinfer_vllm.platforms.v41_config import V41_BACKEND, configure_v41

logger = logging.getLogger(__name__)

V41_NPU_WORKER = "deepinfer_vllm.platforms.ascend.worker.DeepInferNPUWorker"
STOCK_NPU_WORKERS = STOCK_WORKERS + ("vllm.v1.worker.gpu_worker.Worker",)

_LAYER = npu.get()

# The only answers the simulated NPU takes from DeepInfer's CPU platform: facts about
# tensors on the host, where the simulation keeps them. Everything else (kernels, Triton
# overrides, communicator, dtypes, block size, memory) is this class's own, simulated or not.
HOST_METHODS = (
    "is_pin_memory_available",  # pinning needs an accelerator runtime; torch on a host has none
)


class DeepInferAscendPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = _LAYER.device_type  # torch device of vLLM's groups: "npu"; "cpu" when simulated
    device_type: str = _LAYER.device_type  # "npu"; "cpu" when simulated
    dispatch_key: str = _LAYER.dispatch_key  # "PrivateUse1"; "CPU" when simulated
    dist_backend: str = _LAYER.dist_backend  # "hccl"; "gloo" when simulated
    ray_device_key: str = "NPU"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    simple_compile_backend: str = "eager"
    simulated: bool = _LAYER.simulated

    _explained = False

    def is_cpu(self) -> bool:
        # vLLM's host-tensor code paths apply exactly when the tensors live on
        # the host: on the simulated NPU, never on a real one.
        return self.simulated

    # ------------------------------------------------------------ device
    # vLLM asks these in every process, the API server included; none may open a device
    # context before the worker selects its NPU (``device.py``'s docstring says why).
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return npu.get().soc_name(device_id) or "Ascend"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """The device's bytes once this process selected its NPU; before that the layer
        refuses (``NotImplementedError``), and vLLM's callers there (default batch sizes in
        the API server) fall back to their defaults, as they do for vllm-ascend."""
        return npu.get().total_memory(device_id)

    @classmethod
    def device_count(cls) -> int:
        """Visible NPUs, from the driver (no device context)."""
        return npu.get().device_count()

    # UE8M0 scale parameters are held in this dtype on the device (uint8 bytes; see
    # ``TorchNPU.ue8m0_dtype``). The model asks the platform through vLLM's
    # ``current_platform`` (``model_executor.layers.params.ue8m0_dtype``); the layer decides.
    ue8m0_storage_dtype: torch.dtype = _LAYER.ue8m0_dtype
    # How a step's Engram rows reach the NPU when vLLM's engram_config keeps them in host memory
    # (``cpu_offload``, vLLM's default): the host hashes the step's n-grams from its own token
    # ids, gathers the rows and copies them to device buffers (``model_executor.engram_host``);
    # no device view of host memory is assumed on an NPU. DeepInfer itself keeps them in HBM on
    # Ascend (``DEEPINFER_ENGRAM_FORCE_GPU_STORAGE``): ``engram_config={"cpu_offload": false}``.
    engram_host_transfer: str = "copy"

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        npu.get().set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        npu.get().manual_seed_all(seed)

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        # First entry: what vLLM's "auto" picks for a float32 checkpoint.
        return [torch.bfloat16, torch.float16] + ([torch.float32] if self.simulated else [])

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        """bfloat16 and float16 everywhere; float32 only on the simulated NPU.

        A float32 model runs DeepInfer's reference numerics, which accumulate their fp32
        islands in float64 (``ops/numerics.py``); the NPU's cube units have no float64
        matmul, so on an NPU those GEMMs would leave the cube units or fail. The simulated
        NPU computes on the host, where the float64 accumulation is the CPU platform's, and
        its engine tests compare float32 tokens with the CPU reference bit for bit: they
        test the worker and runner, which float32 makes exact, not the NPU's arithmetic."""
        if dtype in (torch.bfloat16, torch.float16):
            return
        if dtype == torch.float32:
            if cls.simulated:
                return
            raise ValueError(
                "DeepInfer's Ascend platform does not run float32 models on an NPU: their reference "
                "numerics accumulate in float64, which the NPU's cube units do not have. Serve "
                "bfloat16 (--dtype bfloat16, the released checkpoint's dtype)."
            )
        raise ValueError(f"DeepInfer's Ascend platform runs bfloat16 or float16 models, not {dtype}")

    @classmethod
    def inference_mode(cls):
        # vLLM 0.32 asks no platform for this: its GPU worker and runner, which the NPU worker
        # and runner are, decorate their steps with torch.inference_mode themselves. Anything
        # that does ask gets the same mode (vLLM's CPU platform answers no_grad for its own
        # CPU worker, which is not used here).
        return torch.inference_mode()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def get_current_memory_usage(cls, device=None) -> float:
        layer = npu.get()
        layer.reset_peak_memory_stats(device)
        return float(layer.max_memory_allocated(device))

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return True  # V4.1's compressed and window caches are separate groups

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False  # no graph capture on the NPU yet (eager)

    # ------------------------------------------------------------ kernels, collectives
    @classmethod
    def import_kernels(cls) -> None:
        """``torch_npu`` (the device and its operators); vLLM's own kernel libraries are
        CUDA builds an Ascend host cannot load, so none is imported (nor when simulated)."""
        npu.get().load()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        """The PyTorch kernels of ``kernels.py`` in place of the Triton kernels vLLM's device
        runner and sampler launch (each worker, before its runner exists), whether or not a
        Triton backend is importable."""
        from vllm.triton_utils.dispatcher import register_kernels

        from deepinfer_vllm.platforms.ascend.kernels import KERNEL_OVERRIDES

        register_kernels(KERNEL_OVERRIDES)
        if cls.simulated:
            cls._take_the_npu_sampler_branch()

    @staticmethod
    def _take_the_npu_sampler_branch() -> None:
        """vLLM picks its sampler's kernels by ``is_cpu()``: on the NPU (an out-of-tree
        platform) its PyTorch sampler (``TopKTopPSampler.forward_native``, greedy by
        ``argmax``); on a CPU platform its C++ ops (``_C.fused_gumbel_argmax``,
        ``_C.greedy_argmax``). The simulated NPU answers ``is_cpu()`` True for vLLM's host
        execution settings, but loads no vLLM kernels, as on the NPU (``import_kernels``), so
        its workers take the NPU's branch."""
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
        from vllm.v1.sample.sampler import Sampler

        from deepinfer_vllm.platforms.ascend.kernels import greedy_sample

        TopKTopPSampler.forward_cpu = TopKTopPSampler.forward_native
        Sampler.greedy_sample = staticmethod(greedy_sample)

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        """vLLM's base communicator: every collective through ``torch.distributed`` on the
        groups' device backend (HCCL on the NPU, gloo when simulated). vllm-ascend's
        ``NPUCommunicator`` subclasses it for an all-to-all its MoE dispatch uses and
        graph-capture fields; V4.1's expert exchange is all-gather and all-reduce, and
        nothing is captured here."""
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    # ------------------------------------------------------------ attention
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_sparse", False):
            return V41_BACKEND
        raise NotImplementedError(
            "DeepInfer's Ascend platform serves DeepSeek-V4.1 only (its sparse attention); "
            "other models run on vllm-ascend (DEEPINFER_PLATFORM=off)."
        )

    # ------------------------------------------------------------ config
    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        """Nothing: the block size is V4.1's config decision (``configure_v41``: 64 tokens or
        the user's even size, the unit of its caches), made in ``check_and_update_config``.
        vLLM's default would re-pick it from the attention backend (16 where the user named
        none), and the CPU platform's only aligns hybrid Mamba models; vllm-ascend overrides
        it for the same reason."""

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        """Allowed (vLLM's default refuses): a V4.1 layer has several caches (window,
        compressed, indexer) under one layer index. vLLM's runner keeps every cache in one
        flat list only to copy blocks in all of them and to release them; each cache is
        bound to its own attention module by name."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if model_config is not None and not plugin_serves_v41(model_config):
            from deepinfer_vllm.configs import is_v41_config

            if is_v41_config(model_config.hf_config):
                raise ValueError(
                    "DEEPINFER_MODEL=vllm selects vLLM's in-tree V4.1 class, which runs on CUDA/ROCm "
                    "only; on DeepInfer's Ascend platform V4.1 is served by deepinfer-vllm's class "
                    "(DEEPINFER_MODEL=auto)."
                )
            archs = getattr(model_config.hf_config, "architectures", None) or [model_config.model]
            raise ValueError(
                f"DeepInfer's Ascend platform serves DeepSeek-V4.1 only, not {archs[0]}: run other "
                "models with vllm-ascend (install it; with DEEPINFER_PLATFORM=off DeepInfer's platform "
                "never claims the host)."
            )
        if model_config is None:
            cls._device_profile(vllm_config)
            return
        # In the user's process, before any worker starts (the worker checks again).
        cls.check_if_supports_dtype(model_config.dtype)
        settings = configure_v41(
            vllm_config, lambda: cls._device_profile(vllm_config), V41_NPU_WORKER, STOCK_NPU_WORKERS
        )
        layer = npu.get()
        logger.info(
            "DeepInfer V4.1 on Ascend (%s%s): dist_backend=%s, %s",
            layer.soc_name(0),
            ", simulated on CPU tensors" if layer.simulated else "",
            layer.dist_backend,
            settings.summary(vllm_config.parallel_config),
        )
        if layer.simulated and not cls._explained:
            cls._explained = True
            logger.info(
                "Simulated NPU: the host-execution settings of vLLM's CPU platform apply (its log "
                "lines about block size, chunked prefill and prefix caching for MLA models are "
                "overridden as listed above)."
            )

    @classmethod
    def _device_profile(cls, vllm_config) -> None:
        """Execution settings of the device (not of the model)."""
        from vllm.config import CompilationMode, CUDAGraphMode

        simulated = npu.get().simulated
        if simulated:
            # Host tensors: vLLM's CPU platform settings (KV space from VLLM_CPU_KVCACHE_SPACE,
            # executor, distributed set-up), then the NPU's execution settings below.
            from vllm.platforms.cpu import CpuPlatform

            CpuPlatform.check_and_update_config(vllm_config)
        else:
            npu.apply_process_env()
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        vllm_config.scheduler_config.async_scheduling = False
        parallel_config = vllm_config.parallel_config
        parallel_config.disable_custom_all_reduce = True
        if parallel_config.enable_dbo:
            logger.warning("Dual-Batch Overlap is not supported on DeepInfer's Ascend platform; disabled.")
            parallel_config.enable_dbo = False
        if not simulated:
            # An NPU context does not survive fork.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def _delegate_to_host(name: str):
    """``DeepInferCpuPlatform.name`` as an attribute of the Ascend class (bound to the CPU class,
    so its ``super()`` calls resolve there)."""
    attr = inspect.getattr_static(DeepInferCpuPlatform, name)
    if isinstance(attr, property):
        return property(lambda self: attr.fget(self))

    def call(cls, *args, **kwargs):
        return getattr(DeepInferCpuPlatform, name)(*args, **kwargs)

    call.__name__ = name
    return classmethod(call)


if DeepInferAscendPlatform.simulated:
    for _name in HOST_METHODS:
        setattr(DeepInferAscendPlatform, _name, _delegate_to_host(_name))
