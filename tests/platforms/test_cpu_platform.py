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
        (dict(data_parallel_size=3, enable_expert_parallel=True), "data_parallel_size=3 .* n_routed_experts=8"),
        (dict(tensor_parallel_size=2, data_parallel_size=2), "moe_intermediate_size=64 .* enable_expert_parallel"),
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
    assert [ParallelLayout(tp_size=4, tp_rank=r).engram_rows(10) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]


def test_expand_kernel_fix_keeps_float_values():
    """vLLM 0.32's CPU fallback writes float temperatures through an int64 copy (never back);
    ours repeats each request's value over its tokens in the output's dtype."""
    import torch

    from deepinfer_vllm.platforms.cpu import expand_batch_values

    out = torch.full((6,), float("nan"))
    expand_batch_values(out, torch.tensor([0.7, -1.0, 1.3]), torch.tensor([2, 5, 6]), -1.0, 1.0)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])
    ints = torch.zeros(3, dtype=torch.int64)
    expand_batch_values(ints, torch.tensor([4, 9]), torch.tensor([1, 3]), 0, 0)
    assert ints.tolist() == [4, 9, 9]
