"""Which attention kernels run where, and that the choice is logged once per device."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer_vllm.attention_backends import kernel_select


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(kernel_select, "_logged", set())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_cpu_defaults_to_the_reference_and_logs_once(monkeypatch, caplog):
    monkeypatch.delenv("DEEPINFER_ATTENTION_KERNELS", raising=False)
    with caplog.at_level(logging.INFO, logger=kernel_select.__name__):
        assert kernel_select.choose_attention_kernels(torch.device("cpu")) == "torch"
        assert kernel_select.choose_attention_kernels(torch.device("cpu")) == "torch"
    lines = [r.getMessage() for r in caplog.records if "attention kernels" in r.getMessage()]
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
