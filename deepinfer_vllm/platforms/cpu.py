"""DeepInfer's CPU platform: stock vLLM CPU behaviour, fixed for V4.1.

Stock vLLM 0.32 treats a V4.1 checkpoint on CPU like any MLA model: it forces
block size 16, switches prefix caching and chunked prefill off, and its
sparse-attention selector raises. DeepInfer's V4.1 runs its own paged caches
through its own backend, so for V4.1 models this platform restores what the
user asked for (or vLLM's defaults) and routes attention selection to our
backend. Every other model sees exactly the stock ``CpuPlatform``, with one
fix any model's speculative sampling needs: vLLM 0.32's C++ fallback of the
rejection sampler's ``expand_kernel`` casts its float output to int64, so the
per-token temperatures (and top-p) of random requests are never written and
verification samples from garbage (NaN) distributions; ours keeps the dtype
(``patch.rejection_sampler``).
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform

from deepinfer_vllm.platforms import plugin_serves_v41
from deepinfer_vllm.platforms.v41_config import V41_BACKEND, configure_v41

logger = logging.getLogger(__name__)

V41_WORKER = "deepinfer_vllm.platforms.cpu_worker.DeepInferCPUWorker"
STOCK_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker")


class DeepInferCpuPlatform(CpuPlatform):
    """``CpuPlatform`` that knows how to run DeepInfer's V4.1."""

    _explained = False  # the note on vLLM's stock CPU log lines, once per process

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        if getattr(attn_selector_config, "use_sparse", False):
            # Only V4.1 reaches the sparse selector with this plugin; its
            # layers name our backend themselves, this keeps vLLM's probes happy.
            return V41_BACKEND
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        super().register_triton_kernel_overrides()
        from deepinfer_vllm.patch import rejection_sampler

        rejection_sampler.apply()

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if not plugin_serves_v41(model_config):
            super().check_and_update_config(vllm_config)
            return
        settings = configure_v41(
            vllm_config, lambda: super(DeepInferCpuPlatform, cls).check_and_update_config(vllm_config),
            V41_WORKER, STOCK_WORKERS,
        )
        logger.info("DeepInfer V4.1 on CPU: %s", settings.summary(vllm_config.parallel_config))
        if vllm_config.cache_config.kv_cache_memory_bytes is None:
            choose_kv_cache_bytes(vllm_config)
        if not cls._explained:
            cls._explained = True
            # vLLM's CPU platform turns both off for MLA models unless the host has AMX
            # tiles (``amx_mla_or_dsv4_enabled`` in vllm/platforms/cpu.py): that part of the
            # note only where it did.
            restored = (
                "vLLM's CPU platform logs that it forces chunked prefill and prefix caching off for "
                "MLA models; DeepInfer's V4.1 backend pages its own caches and supports both, so they "
                "are restored as listed above. "
                if settings.restored
                else ""
            )
            logger.info(
                "DeepInfer V4.1 on CPU: %sLines about DeepGEMM/UE8M0, Triton and CUDA graphs do not "
                "apply: this path runs PyTorch on the CPU. The workers' 'expand_kernel is already "
                "registered. Overwriting.' is this platform's fix of vLLM's rejection-sampler fallback "
                "(see deepinfer_vllm/patch/rejection_sampler.py).",
                restored,
            )


GIB = 1 << 30
# Per CPU worker, beside its weights: the Python process, torch and vLLM (about 1.5 GiB
# resident here) and a step's activations.
CPU_WORKER_RESERVE = 2 * GIB
MIN_KV_CACHE = GIB // 4


def choose_kv_cache_bytes(vllm_config, available: int | None = None) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` unset and no ``kv_cache_memory_bytes``: size each
    worker's KV cache from the free memory of the workers' memory node instead of vLLM's
    CPU default, which asks for ``gpu_memory_utilization`` of the node's *total* memory and
    stops when that is more than is free ("decrease --gpu-memory-utilization"). Each worker gets
    ``(free x gpu_memory_utilization - checkpoint bytes) / workers - 2 GiB``; the choice
    is logged, capped at what every running sequence at full length could fill
    (``max_num_seqs x max_model_len`` tokens of every cache: more would never be used but
    by the prefix cache). Too little room is a ``ValueError`` naming the settings to change."""
    cache_config = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    if available is None:
        available = _free_node_memory()
    workers = (
        parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        * max(1, parallel.data_parallel_size_local)
    )
    weights = _checkpoint_bytes(vllm_config.model_config)
    budget = int(available * cache_config.gpu_memory_utilization)
    per_worker = (budget - weights) // workers - CPU_WORKER_RESERVE
    if per_worker < MIN_KV_CACHE:
        raise ValueError(
            f"Not enough free host memory for V4.1's KV cache: {available / GIB:.1f} GiB free x "
            f"gpu_memory_utilization {cache_config.gpu_memory_utilization} = {budget / GIB:.1f} GiB, "
            f"less {weights / GIB:.1f} GiB of weights, shared by {workers} worker(s) with a "
            f"{CPU_WORKER_RESERVE / GIB:.0f} GiB reserve each, leaves {per_worker / GIB:.2f} GiB "
            f"(at least {MIN_KV_CACHE / GIB:.2f} GiB needed). Free memory, or set "
            "VLLM_CPU_KVCACHE_SPACE (GiB per worker) or --kv-cache-memory-bytes."
        )
    full = _full_occupancy_bytes(vllm_config)
    chosen = min(per_worker, full)
    cache_config.kv_cache_memory_bytes = chosen
    logger.info(
        "DeepInfer V4.1 on CPU: VLLM_CPU_KVCACHE_SPACE is unset, so each of %d worker(s) gets a "
        "%.2f GiB KV cache: the smaller of %.2f GiB (%.1f GiB free x gpu_memory_utilization %.2f, less "
        "%.2f GiB of weights and a %.0f GiB reserve per worker) and %.2f GiB (max_num_seqs %d x "
        "max_model_len %d tokens); set VLLM_CPU_KVCACHE_SPACE (GiB) to choose.",
        workers, chosen / GIB, per_worker / GIB, available / GIB, cache_config.gpu_memory_utilization,
        weights / GIB, CPU_WORKER_RESERVE / GIB, full / GIB,
        vllm_config.scheduler_config.max_num_seqs, vllm_config.model_config.max_model_len,
    )
    return chosen


def _free_node_memory() -> int:
    """Free memory of the NUMA node the workers will allocate on, as vLLM's CPU worker
    measures it when it checks the KV cache size (``get_memory_node_info``: node meminfo,
    clamped by a cgroup limit)."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    return int(get_memory_node_info(get_allowed_cpu_list()[0].numa_node).available_memory)


def _full_occupancy_bytes(vllm_config) -> int:
    """Bytes of every paged cache for ``max_num_seqs`` sequences of ``max_model_len`` tokens."""
    from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token, model_caches
    from deepinfer_vllm.configs import V41Arch

    arch = V41Arch.from_config(vllm_config.model_config.hf_config)
    decls = model_caches(arch, dspark=vllm_config.speculative_config is not None)
    per_kind = bytes_per_token(decls, vllm_config.cache_config.block_size)
    per_token = sum(v for kind, v in per_kind.items() if kind != "global")  # global = compressed + index
    tokens = vllm_config.scheduler_config.max_num_seqs * vllm_config.model_config.max_model_len
    return max(int(per_token * tokens), MIN_KV_CACHE)


def _checkpoint_bytes(model_config) -> int:
    """Bytes of a local checkpoint's safetensors files (0 for a hub id: not known here)."""
    from pathlib import Path

    model_dir = Path(model_config.model)
    if not model_dir.is_dir():
        return 0
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))

