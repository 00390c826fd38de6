"""The V4.1 decisions every DeepInfer platform makes on vLLM's config (CPU and Ascend):
parallel and checkpoint checks in the user's process, the block size, chunked prefill and
prefix caching as the user asked, the worker class, DSpark, expert load balancing. Each platform calls
``configure_v41`` around its device's own update."""

from __future__ import annotations

from typing import Any, NamedTuple

V41_DEFAULT_BLOCK_SIZE = 64
V41_BACKEND = "deepinfer_vllm.attention_backends.mla_swa.DeepInferV41Backend"


class V41Settings(NamedTuple):
    """What ``configure_v41`` decided, for the platform's log line."""

    block_size: int
    chunked_prefill: bool
    prefix_caching: bool
    dspark: Any  # configs.dspark.DSparkSettings, or None
    restored: tuple[str, ...] = ()  # what the device's own update had turned off, restored
    eplb: Any = None  # model_executor.eplb.EplbSettings, or None

    def summary(self, parallel_config) -> str:
        dspark = "off" if self.dspark is None else (
            f"k={self.dspark.num_speculative_tokens} adaptive={self.dspark.adaptive}"
        )
        return (
            f"block_size={self.block_size}, chunked_prefill={self.chunked_prefill}, "
            f"prefix_caching={self.prefix_caching}, tensor_parallel={parallel_config.tensor_parallel_size}, "
            f"data_parallel={parallel_config.data_parallel_size}, "
            f"expert_parallel={parallel_config.enable_expert_parallel}, dspark={dspark}, "
            f"eplb={'off' if self.eplb is None else self.eplb.summary()}"
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
    return V41Settings(block_size, chunked, prefix, dspark, restored, _configure_eplb(vllm_config, arch))


def _check_parallel(arch, parallel_config) -> None:
    """Refuse parallel settings V4.1 cannot be split by, in the user's process."""
    from deepinfer_vllm.model_executor.layers.parallel import check_vllm_parallel

    check_vllm_parallel(arch, parallel_config)


def _configure_eplb(vllm_config, arch):
    """Expert load balancing's settings (``additional_config`` on these platforms, see
    ``model_executor.eplb``), checked against the model and the parallel sizes here, in the
    user's process."""
    from deepinfer_vllm.model_executor.eplb import check_eplb, eplb_settings

    settings = eplb_settings(vllm_config)
    if settings is not None:
        check_eplb(settings, arch.n_routed_experts, vllm_config.parallel_config)
    return settings


def _validate_checkpoint(arch, model_config) -> set[str] | None:
    """Check a local checkpoint's safetensors headers against the V4.1 format here, in the
    user's process, so a bad tensor is named before any engine process starts (the loader
    checks again in the worker, and is the only check for hub ids). Returns the tensor names
    (None when the model is not a local folder of safetensors)."""
    from pathlib import Path

    from deepinfer_vllm.configs.checkpoint import read_safetensors_index, validate_checkpoint_index

    model_dir = Path(model_config.model)
    if not model_dir.is_dir() or not any(model_dir.glob("*.safetensors")):
        return None
    found = read_safetensors_index(model_dir)
    validate_checkpoint_index(arch, found)
    return set(found)


def _configure_dspark(vllm_config, arch, checkpoint_names: set[str] | None):
    """Validate DSpark for V4.1 and hand vLLM's V1 runner DeepInfer's proposer (``configs.dspark``)."""
    from deepinfer_vllm.configs.dspark import configure_dspark

    return configure_dspark(vllm_config, arch, checkpoint_names)
