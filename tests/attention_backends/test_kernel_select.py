"""Which attention kernels run where, and that the choice is logged once per device."""

from __future__ import annotations

import sys

import pytest
import torch

from deepinfer_vllm.attention_backends import kernel_select


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(kernel_select, "_logged", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_defaults_to_the_reference_and_logs_once(monkeypatch, log_lines):
    monkeypatch.delenv("DEEPINFER_ATTENTION_KERNELS", raising=False)
    with log_lines(kernel_select.__name__) as logged:
        assert kernel_select.choose_attention_kernels(torch.device("cpu")) == "torch"
        assert kernel_select.choose_attention_kernels(torch.device("cpu")) == "torch"
    lines = [m for m in logged if "attention kernels" in m]
    assert lines == ["DeepInfer V4.1 attention kernels: torch (cpu device)"]


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel_select.choose_attention_kernels(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_select.choose_attention_kernels(torch.device("cpu")) == "triton"


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_ATTENTION_KERNELS"):
        kernel_select.choose_attention_kernels(torch.device("cpu"))


def test_vendor_libraries_are_only_reported_when_importable(monkeypatch):
    found = {"deep_select"}
    monkeypatch.setattr(kernel_select.importlib.util, "find_spec", lambda name: object() if name in found else None)
    assert kernel_select.vendor_libraries() == ["deep_select"]


def test_gemm_kernels_follow_device_dtype_and_batch_invariance(monkeypatch, log_lines):
    for name in ("DEEPINFER_GEMM_KERNELS", "DEEPINFER_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    with log_lines(kernel_select.__name__) as logged:
        assert kernel_select.choose_gemm_kernels(torch.device("cpu"), torch.bfloat16) == "torch"
    assert [m for m in logged if "GEMM" in m] == [
        "DeepInfer V4.1 GEMM kernels: torch (cpu device, bfloat16)"
    ]
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel_select.choose_gemm_kernels(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_select.choose_gemm_kernels(torch.device("cpu"), torch.bfloat16) == "triton"
    with pytest.raises(RuntimeError, match="needs a bfloat16 model"):
        kernel_select.choose_gemm_kernels(torch.device("cpu"), torch.float32)
    # auto on a CUDA device: Triton for bf16, the reference for fp32 and in batch-invariant mode
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "auto")
    monkeypatch.setattr(kernel_select.torch.cuda, "get_device_name", lambda device=None: "GPU")
    cuda = torch.device("cuda")
    assert kernel_select.choose_gemm_kernels(cuda, torch.bfloat16) == "triton"
    assert kernel_select.choose_gemm_kernels(cuda, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert kernel_select.choose_gemm_kernels(cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_GEMM_KERNELS"):
        kernel_select.choose_gemm_kernels(cuda, torch.bfloat16)


def test_fused_kernels_follow_device_and_dtype(monkeypatch, log_lines):
    monkeypatch.delenv("DEEPINFER_FUSED_KERNELS", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with log_lines(kernel_select.__name__) as logged:
        assert kernel_select.choose_fused_kernels(torch.device("cpu"), torch.bfloat16) == "torch"
    assert [m for m in logged if "fused" in m] == [
        "DeepInfer V4.1 fused kernels: torch (cpu device, bfloat16)"
    ]
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        kernel_select.choose_fused_kernels(torch.device("cpu"), torch.bfloat16)
    # auto on a CUDA device: Triton for bf16 models, the reference for fp32 ones
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "auto")
    monkeypatch.setattr(kernel_select.torch.cuda, "get_device_name", lambda device=None: "GPU")
    cuda = torch.device("cuda")
    assert kernel_select.choose_fused_kernels(cuda, torch.bfloat16) == "triton"
    assert kernel_select.choose_fused_kernels(cuda, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "torch")
    assert kernel_select.choose_fused_kernels(cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_FUSED_KERNELS"):
        kernel_select.choose_fused_kernels(cuda, torch.bfloat16)


def test_fused_kernels_on_npu_devices(monkeypatch):
    """``auto`` on an NPU: ``torch_npu``'s fused RMSNorm/RoPE for bf16 models, the reference for
    fp32 ones; ``npu`` forced needs ``torch_npu`` and says so."""
    import types

    from fake_torch_npu import make

    monkeypatch.delenv("DEEPINFER_FUSED_KERNELS", raising=False)
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs the real torch_npu
    assert kernel_select.choose_fused_kernels(npu, torch.bfloat16) == "npu"
    assert kernel_select.choose_fused_kernels(npu, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match=r"DEEPINFER_FUSED_KERNELS=npu needs torch_npu"):
        kernel_select.choose_fused_kernels(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setitem(sys.modules, "torch_npu", make())
    assert kernel_select.choose_fused_kernels(torch.device("cpu"), torch.float32) == "npu"
