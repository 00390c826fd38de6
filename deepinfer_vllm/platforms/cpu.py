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
verification samples from garbage (NaN) distributions; ours keeps the dtype.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from vllm.platforms.cpu import CpuPlatform

logger = logging.getLogger(__name__)

V41_DEFAULT_BLOCK_SIZE = 64
V41_BACKEND = "deepinfer_vllm.attention_backends.mla_swa.DeepInferV41Backend"
V41_WORKER = "deepinfer_vllm.platforms.cpu_worker.DeepInferCPUWorker"
STOCK_WORKERS = ("auto", "vllm.v1.worker.cpu_worker.CPUWorker")


def is_v41(model_config) -> bool:
    """A V4.1 checkpoint that this plugin's class serves (``DEEPINFER_MODEL``)."""
    from deepinfer_vllm import serving_class
    from deepinfer_vllm.configs import is_v41_config

    if model_config is None or serving_class() != "deepinfer":
        return False
    return is_v41_config(model_config.hf_config)


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
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({"vllm.v1.sample.rejection_sampler.expand_kernel": expand_batch_values})

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        model_config = vllm_config.model_config
        if not is_v41(model_config):
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
                "(see deepinfer_vllm/platforms/cpu.py).",
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


class V41Settings(NamedTuple):
    """What ``configure_v41`` decided, for the platform's log line."""

    block_size: int
    chunked_prefill: bool
    prefix_caching: bool
    dspark: Any  # spec_decode.config.DSparkSettings, or None
    restored: tuple[str, ...] = ()  # what the device's own update had turned off, restored

    def summary(self, parallel_config) -> str:
        dspark = "off" if self.dspark is None else (
            f"k={self.dspark.num_speculative_tokens} adaptive={self.dspark.adaptive}"
        )
        return (
            f"block_size={self.block_size}, chunked_prefill={self.chunked_prefill}, "
            f"prefix_caching={self.prefix_caching}, tensor_parallel={parallel_config.tensor_parallel_size}, "
            f"data_parallel={parallel_config.data_parallel_size}, "
            f"expert_parallel={parallel_config.enable_expert_parallel}, dspark={dspark}"
        )


def configure_v41(vllm_config, device_update, worker: str, stock_workers: tuple[str, ...]) -> V41Settings:
    """The V4.1 decisions every DeepInfer platform makes, around its device's own update
    (``device_update``, e.g. the stock platform's ``check_and_update_config``): parallel and
    checkpoint checks in the user's process, 64-token blocks (or the user's even size),
    chunked prefill, prefix caching and the batch budget as the user asked (the device
    update may have changed them), ``worker`` where vLLM's stock one was chosen, DSpark.
    Returns the decisions as ``V41Settings``."""
    from deepinfer_vllm.configs import V41Arch

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    scheduler_config = vllm_config.scheduler_config
    parallel_config = vllm_config.parallel_config
    worker_cls = parallel_config.worker_cls
    user_block_size = cache_config.block_size if cache_config.user_specified_block_size else None
    chunked = scheduler_config.enable_chunked_prefill
    prefix = cache_config.enable_prefix_caching
    max_batched = scheduler_config.max_num_batched_tokens
    arch = V41Arch.from_config(model_config.hf_config)
    _check_parallel(arch, parallel_config)
    checkpoint_names = _validate_checkpoint(arch, model_config)
    device_update()
    block_size = user_block_size or V41_DEFAULT_BLOCK_SIZE
    if block_size % 2:
        raise ValueError(f"V4.1 needs an even --block-size (ratio-2 caches); got {block_size}")
    restored = tuple(
        name
        for name, asked, now in (
            ("chunked prefill", chunked, scheduler_config.enable_chunked_prefill),
            ("prefix caching", prefix, cache_config.enable_prefix_caching),
        )
        if asked and not now
    )
    cache_config.block_size = block_size
    parallel_config.worker_cls = worker if worker_cls in stock_workers else worker_cls
    scheduler_config.enable_chunked_prefill = chunked
    cache_config.enable_prefix_caching = prefix
    scheduler_config.max_num_batched_tokens = max_batched
    dspark = None
    if vllm_config.speculative_config is not None:
        dspark = _configure_dspark(vllm_config, arch, checkpoint_names)
    return V41Settings(block_size, chunked, prefix, dspark, restored)


def expand_batch_values(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """``expand_kernel`` of vLLM's rejection sampler in torch, any dtype: request ``i``'s
    value (``replace_from`` mapped to ``replace_to``) repeated over its tokens."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1).to(torch.int64))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


def _check_parallel(arch, parallel_config) -> None:
    """Refuse parallel settings V4.1 cannot be split by, in the user's process."""
    from deepinfer_vllm.model_executor.layers.parallel import check_vllm_parallel

    check_vllm_parallel(arch, parallel_config)


def _validate_checkpoint(arch, model_config) -> set[str] | None:
    """Check a local checkpoint's safetensors headers against the V4.1 format here, in the
    user's process, so a bad tensor is named before any engine process starts (the loader
    checks again in the worker, and is the only check for hub ids). Returns the tensor names
    (None when the model is not a local folder of safetensors)."""
    from pathlib import Path

    from deepinfer_vllm.model_executor.checkpoint import read_safetensors_index, validate_checkpoint_index

    model_dir = Path(model_config.model)
    if not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
        return None
    found = read_safetensors_index(model_dir)
    validate_checkpoint_index(arch, found)
    return set(found)


def _configure_dspark(vllm_config, arch, checkpoint_names: set[str] | None):
    """Validate DSpark for V4.1 and hand vLLM's V1 runner DeepInfer's proposer (``spec_decode.config``)."""
    from deepinfer_vllm.spec_decode.config import configure_dspark

    return configure_dspark(vllm_config, arch, checkpoint_names)
