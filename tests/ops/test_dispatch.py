"""Which kernels run where (``ops.dispatch``): the choice per family, device and dtype, logged
once; operators (``KernelOp``) choose when built and never look again."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from deepinfer_vllm.ops import dispatch
from deepinfer_vllm.ops.dispatch import KernelOp, choose


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_defaults_to_the_reference_and_logs_once(monkeypatch, log_lines):
    monkeypatch.delenv("DEEPINFER_ATTENTION_KERNELS", raising=False)
    with log_lines(dispatch.__name__) as logged:
        assert choose("attention", torch.device("cpu"), torch.bfloat16) == "torch"
        assert choose("attention", torch.device("cpu"), torch.float32) == "torch"
    lines = [m for m in logged if "attention kernels" in m]
    assert lines == ["DeepInfer V4.1 attention kernels: torch (cpu device)"]
    assert dispatch.chosen() == [("attention", "torch", "cpu")]


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        choose("attention", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose("attention", torch.device("cpu"), torch.bfloat16) == "triton"


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DEEPINFER_ATTENTION_KERNELS"):
        choose("attention", torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="unknown kernel family"):
        choose("rope", torch.device("cpu"), torch.bfloat16)


def test_vendor_libraries_are_only_reported_when_importable(monkeypatch):
    found = {"deep_select"}
    monkeypatch.setattr(
        dispatch.importlib.util, "find_spec", lambda name: object() if name in found else None
    )
    assert dispatch.vendor_libraries() == ["deep_select"]


def test_gemm_kernels_follow_device_dtype_and_batch_invariance(monkeypatch, log_lines):
    for name in ("DEEPINFER_GEMM_KERNELS", "DEEPINFER_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    with log_lines(dispatch.__name__) as logged:
        assert choose("gemm", torch.device("cpu"), torch.bfloat16) == "torch"
    assert [m for m in logged if "GEMM" in m] == ["DeepInfer V4.1 GEMM kernels: torch (cpu device, bfloat16)"]
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        choose("gemm", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert choose("gemm", torch.device("cpu"), torch.bfloat16) == "triton"
    with pytest.raises(RuntimeError, match="needs a bfloat16 model"):
        choose("gemm", torch.device("cpu"), torch.float32)
    # auto on a CUDA device: Triton for bf16, the reference for fp32 and in batch-invariant mode
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "auto")
    monkeypatch.setattr(dispatch.torch.cuda, "get_device_name", lambda device=None: "GPU")
    cuda = torch.device("cuda")
    assert choose("gemm", cuda, torch.bfloat16) == "triton"
    assert choose("gemm", cuda, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert choose("gemm", cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_GEMM_KERNELS"):
        choose("gemm", cuda, torch.bfloat16)


def test_fused_kernels_follow_device_and_dtype(monkeypatch, log_lines):
    monkeypatch.delenv("DEEPINFER_FUSED_KERNELS", raising=False)
    with log_lines(dispatch.__name__) as logged:
        assert choose("fused", torch.device("cpu"), torch.bfloat16) == "torch"
    assert [m for m in logged if "fused" in m] == [
        "DeepInfer V4.1 fused kernels: torch (cpu device, bfloat16)"
    ]
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        choose("fused", torch.device("cpu"), torch.bfloat16)
    # auto on a CUDA device: Triton for bf16 models, the reference for fp32 ones
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "auto")
    monkeypatch.setattr(dispatch.torch.cuda, "get_device_name", lambda device=None: "GPU")
    cuda = torch.device("cuda")
    assert choose("fused", cuda, torch.bfloat16) == "triton"
    assert choose("fused", cuda, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "torch")
    assert choose("fused", cuda, torch.bfloat16) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_FUSED_KERNELS"):
        choose("fused", cuda, torch.bfloat16)


def test_fused_kernels_on_npu_devices(monkeypatch):
    """``auto`` on an NPU: ``torch_npu``'s fused RMSNorm/RoPE for bf16 models, the reference for
    fp32 ones; ``npu`` forced needs ``torch_npu`` and says so."""
    from fake_torch_npu import make

    monkeypatch.delenv("DEEPINFER_FUSED_KERNELS", raising=False)
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs the real torch_npu
    assert choose("fused", npu, torch.bfloat16) == "npu"
    assert choose("fused", npu, torch.float32) == "torch"
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(RuntimeError, match=r"DEEPINFER_FUSED_KERNELS=npu needs torch_npu"):
        choose("fused", torch.device("cpu"), torch.bfloat16)
    monkeypatch.setitem(sys.modules, "torch_npu", make())
    assert choose("fused", torch.device("cpu"), torch.float32) == "npu"


class _Double(KernelOp):
    name = "test_double"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton"}

    def forward_native(self, x):
        return 2 * x

    def forward_triton(self, x):
        assert self.kernels is sys.modules["deepinfer_vllm.ops.triton"]
        return 2 * x + 1


def test_an_operator_chooses_once_when_built(monkeypatch):
    """The choice is made in ``__init__`` (the kernel module imported then); calls neither read
    the environment nor ask for the device again."""
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fast = _Double("cpu", torch.bfloat16)
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "torch")
    plain = _Double("cpu", torch.bfloat16)
    assert (fast.backend, plain.backend) == ("triton", "torch") and plain.kernels is None

    def no_reads(*args, **kwargs):
        raise AssertionError("read on a call")

    monkeypatch.setattr(dispatch, "choose", no_reads)
    monkeypatch.setattr(dispatch.envs, "fused_kernels", no_reads)
    x = torch.ones(2)
    assert torch.equal(fast(x), torch.full((2,), 3.0)) and torch.equal(plain(x), torch.full((2,), 2.0))
    assert repr(fast) == "_Double(backend='triton', dtype=bfloat16)"


def test_a_backend_without_an_implementation_runs_the_reference(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    op = _Double("cpu", torch.bfloat16)
    assert op.backend == "npu" and torch.equal(op(torch.ones(1)), torch.full((1,), 2.0))


def test_a_platform_registers_its_own_implementation(monkeypatch):
    monkeypatch.setattr(KernelOp, "_oot", {})
    monkeypatch.delenv("DEEPINFER_FUSED_KERNELS", raising=False)

    @KernelOp.register_oot()
    class _PlatformDouble(_Double):
        def forward_native(self, x):
            return x + x + 10

    op = _Double("cpu", torch.float32)
    assert type(op) is _PlatformDouble and torch.equal(op(torch.ones(1)), torch.full((1,), 12.0))
    with pytest.raises(ValueError, match="no operator name"):
        KernelOp.register_oot()(type("Nameless", (KernelOp,), {}))


def test_layers_choose_for_the_device_and_dtype_they_are_built_under(monkeypatch):
    """vLLM builds the model under the target device and the model dtype as torch's defaults;
    a layer's operators are chosen for those (``layers.params.built_for``)."""
    from deepinfer_vllm.model_executor.layers.norm import V41Norm

    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cpu"):
            norm = V41Norm(64, 1e-6)
    finally:
        torch.set_default_dtype(previous)
    for op in (norm.norm, norm.collapse_norm):
        assert (op.backend, op.dtype) == ("triton", torch.bfloat16)
    assert ("fused", "triton", "cpu") in dispatch.chosen()
