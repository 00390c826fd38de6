"""Platform plugin activation and the V4.1-only behaviour of our CPU platform."""

from __future__ import annotations

import os

import pytest

from deepinfer_vllm import platforms


def test_plugin_activates_on_cpu_only_host(monkeypatch):
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.delenv("DEEPINFER_PLATFORM", raising=False)
    assert platforms.cpu_platform_plugin() == platforms.CPU_PLATFORM


def test_plugin_bypasses(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLATFORM", "off")
    assert platforms.cpu_platform_plugin() is None
    monkeypatch.setenv("DEEPINFER_PLATFORM", "auto")
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    assert platforms.cpu_platform_plugin() is None
    monkeypatch.delenv("VLLM_TARGET_DEVICE")
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: p == "/dev/nvidia0" or real_exists(p))
    assert platforms.cpu_platform_plugin() is None


def test_bad_platform_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PLATFORM", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_PLATFORM"):
        platforms.cpu_platform_plugin()


def test_current_platform_is_ours():
    from vllm.platforms import current_platform

    assert type(current_platform).__name__ == "DeepInferCpuPlatform"


def test_sparse_selector_routes_v41_to_our_backend():
    from types import SimpleNamespace

    from vllm.platforms.cpu import CpuPlatform

    from deepinfer_vllm.platforms.cpu import V41_BACKEND, DeepInferCpuPlatform

    sparse = SimpleNamespace(use_sparse=True, use_mla=True)
    with pytest.raises(NotImplementedError):
        CpuPlatform.get_attn_backend_cls(None, sparse)  # what stock vLLM does for V4.1
    assert DeepInferCpuPlatform.get_attn_backend_cls(None, sparse) == V41_BACKEND


@pytest.mark.parametrize(
    "settings, names",
    [
        (dict(tensor_parallel_size=3), "tensor parallel size \\(3\\)"),  # vLLM's own head check
        (dict(pipeline_parallel_size=2), "Pipeline parallelism is not supported"),
        (
            dict(data_parallel_size=3, enable_expert_parallel=True),
            "data_parallel_size=3 .* n_routed_experts=8",
        ),
        (
            dict(tensor_parallel_size=2, data_parallel_size=2),
            "moe_intermediate_size=64 .* enable_expert_parallel",
        ),
    ],
)
def test_parallel_settings_v41_cannot_split_are_refused_by_name(tiny_checkpoint, settings, names):
    """Refused while the config is built, in the user's process, naming the setting."""
    from vllm.engine.arg_utils import EngineArgs

    import deepinfer_vllm

    deepinfer_vllm.register()
    with pytest.raises(Exception, match=names):
        EngineArgs(model=tiny_checkpoint, **settings).create_engine_config()


def test_parallel_rules():
    from deepinfer_vllm.configs import V41Arch
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout, check_parallel
    from deepinfer_vllm.tools.presets import flash_config

    flash = V41Arch.from_config(flash_config())
    for tp, dp, ep in ((8, 1, False), (1, 8, True), (8, 1, True), (2, 4, True), (4, 2, False)):
        check_parallel(flash, tp, dp, 1, ep)
    with pytest.raises(ValueError, match="o_groups=8"):
        check_parallel(flash, 16, 1, 1, True)  # 64 heads split, but not 8 output groups
    with pytest.raises(ValueError, match="moe_intermediate_size=2304"):
        check_parallel(flash, 1, 16, 1, False)  # 2304 / 16 = 144 columns: not whole FP4 scale blocks
    # Whole experts, contiguous ids, by vLLM's EP rank (dp_rank * tp + tp_rank).
    lay = ParallelLayout(tp_size=2, tp_rank=1, dp_size=4, dp_rank=2, expert_parallel=True)
    assert lay.moe_rank == 5 and lay.local_experts(384) == range(240, 288)
    assert lay.expert_inter(2304) == (0, 2304)
    lay = ParallelLayout(tp_size=8, tp_rank=3)
    assert lay.local_experts(384) == range(384) and lay.expert_inter(2304) == (864, 288)
    # Engram rows: ceil(rows / ranks) each, the remainder last.
    assert [ParallelLayout(tp_size=4, tp_rank=r).engram_rows(10) for r in range(4)] == [
        (0, 3),
        (3, 3),
        (6, 3),
        (9, 1),
    ]


def _v41_config(tiny_checkpoint, monkeypatch, **settings):
    from vllm.engine.arg_utils import EngineArgs

    import deepinfer_vllm

    deepinfer_vllm.register()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    return EngineArgs(model=tiny_checkpoint, max_model_len=1024, **settings).create_engine_config()


def test_kv_cache_without_vllm_cpu_kvcache_space_fits_free_memory(tiny_checkpoint, monkeypatch, log_lines):
    """vLLM's CPU default asks for gpu_memory_utilization of the host's total memory and stops
    when less is free; for V4.1 the platform sizes each worker's cache from free memory."""
    from pathlib import Path

    from deepinfer_vllm.platforms.cpu import (
        CPU_WORKER_RESERVE,
        GIB,
        _full_occupancy_bytes,
        choose_kv_cache_bytes,
    )

    with log_lines("deepinfer_vllm.platforms.cpu") as log:
        cfg = _v41_config(tiny_checkpoint, monkeypatch)
    chosen = cfg.cache_config.kv_cache_memory_bytes
    assert chosen is not None and chosen > 0
    assert any("VLLM_CPU_KVCACHE_SPACE is unset, so each of 1 worker(s) gets a" in line for line in log), log
    # The cap: every sequence at full length. On tiny that is below the free-memory share.
    full = _full_occupancy_bytes(cfg)
    assert chosen == full == pytest.approx(128 * 1024 * _tiny_bytes_per_token(cfg), rel=1e-6)
    # The free-memory share: (free x utilisation - weights) / workers - reserve.
    weights = sum(f.stat().st_size for f in Path(tiny_checkpoint).glob("*.safetensors"))
    small_host = int((0.8 * full + CPU_WORKER_RESERVE + weights) / cfg.cache_config.gpu_memory_utilization)
    share = int(small_host * cfg.cache_config.gpu_memory_utilization) - weights - CPU_WORKER_RESERVE
    assert share < full
    assert choose_kv_cache_bytes(cfg, available=small_host) == cfg.cache_config.kv_cache_memory_bytes == share
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        choose_kv_cache_bytes(cfg, available=2 * GIB)


def _tiny_bytes_per_token(cfg) -> float:
    from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token, model_caches
    from deepinfer_vllm.configs import V41Arch

    per = bytes_per_token(model_caches(V41Arch.from_config(cfg.model_config.hf_config)), 64)
    return per["window"] + per["compressed"] + per["index"] + per.get("tokens", 0.0)


def test_kv_cache_space_set_is_left_to_vllm(tiny_checkpoint, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    cfg = EngineArgs(model=tiny_checkpoint, max_model_len=1024).create_engine_config()
    assert cfg.cache_config.kv_cache_memory_bytes == 3 << 30


def test_restored_settings_are_explained_only_where_vllm_turned_them_off(tiny_checkpoint, monkeypatch, log_lines):
    """vLLM's CPU platform forces chunked prefill and prefix caching off for MLA models except on
    hosts with AMX tiles; the platform's note on that line follows what vLLM did on this host,
    and its note on vLLM's kernel-override warning is there on both."""
    import torch
    from vllm.platforms.cpu import CpuPlatform

    from deepinfer_vllm.platforms.cpu import DeepInferCpuPlatform

    for amx in (False, True):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(
            CpuPlatform,
            "get_cpu_architecture",
            classmethod(
                lambda cls: __import__("vllm.platforms.interface", fromlist=["CpuArchEnum"]).CpuArchEnum.X86
            ),
        )
        monkeypatch.setattr(DeepInferCpuPlatform, "_explained", False)
        with log_lines("deepinfer_vllm.platforms.cpu") as log:
            cfg = _v41_config(tiny_checkpoint, monkeypatch)
        assert cfg.scheduler_config.enable_chunked_prefill and cfg.cache_config.enable_prefix_caching
        assert any("DeepInfer V4.1 on CPU: block_size=64" in line for line in log), log
        assert any("supports both, so they are restored" in line for line in log) is (not amx), (amx, log)
        # vLLM's workers warn "expand_kernel is already registered" on every host: always explained.
        assert any("is this platform's fix of vLLM's rejection-sampler fallback" in line for line in log), log
