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
  graph capture yet), spawned workers, the process variables of design §8;
* simulated (``DEEPINFER_SIMULATED_NPU=1``, tests only): the same class,
  worker and runner with the device layer stubbed; tensors live on the host,
  so the host-execution parts of vLLM's CPU platform (kernels, communicator,
  KV space, executor settings) stand in for the device's, the execution
  settings (eager, no asynchronous scheduling) are the NPU's, and vLLM's log
  names this platform.

Every device call goes through ``device.get()``.
"""

from __future__ import annotations

import inspect
import logging
import os

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from deepinfer_vllm.platforms.ascend import device as npu
from deepinfer_vllm.platforms.cpu import (
    STOCK_WORKERS,
    V41_BACKEND,
    DeepInferCpuPlatform,
    configure_v41,
    is_v41,
)

logger = logging.getLogger(__name__)

V41_NPU_WORKER = "deepinfer_vllm.platforms.ascend.worker.DeepInferNPUWorker"
STOCK_NPU_WORKERS = STOCK_WORKERS + ("vllm.v1.worker.gpu_worker.Worker",)

_LAYER = npu.get()

# Host-execution behaviour the simulated NPU takes from DeepInfer's CPU
# platform (tensors live on the host there); on an NPU these are this class's own.
HOST_METHODS = (
    "supported_dtypes",
    "check_runner_kv_caches_multi_layer",
    "get_mla_prefill_backend_cls",
    "update_block_size_for_backend",
    "is_pin_memory_available",
    "get_punica_wrapper",
    "get_device_communicator_cls",
    "import_kernels",
    "register_triton_kernel_overrides",
    "get_current_memory_usage",
    "num_compute_units",
    "opaque_attention_op",
    "supports_structured_output",
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
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return npu.get().soc_name(device_id) or "Ascend"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return npu.get().total_memory(device_id)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        npu.get().set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        npu.get().manual_seed_all(seed)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"DeepInfer's Ascend platform runs bfloat16, float16 or float32 models, not {dtype}"
            )

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

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

    @classmethod
    def import_kernels(cls) -> None:
        npu.get().load()

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
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if model_config is not None and not is_v41(model_config):
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
