"""The model with RMSNorm and RoPE routed to ``torch_npu``'s fused operators
(``DEEPINFER_FUSED_KERNELS=npu``, ``ops/npu.py``), ``torch_npu`` replaced by emulations of its
documented formulas (``tests/fake_torch_npu.py``): the routing reaches every norm and rotation
of a bf16 model and its logits equal the reference path's bit for bit (both operators reproduce
the bf16 reference's arithmetic). No NPU ran this; it checks the wiring."""

from __future__ import annotations

import sys

import torch
from fake_torch_npu import make
from v41_harness import PagedHarness


def _logits(harness, prompt):
    return harness.step([("a", prompt[:20])]), harness.step([("a", prompt[20:21])])


def test_bf16_model_on_npu_fused_ops_equals_reference(tiny_checkpoint, monkeypatch):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 120000, (21,), generator=g).tolist()
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "torch")
    ref = _logits(PagedHarness(tiny_checkpoint, dtype="bfloat16"), prompt)
    fake = make()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", "npu")
    got = _logits(PagedHarness(tiny_checkpoint, dtype="bfloat16"), prompt)
    assert fake.calls.count("npu_rms_norm") > 0 and fake.calls.count("npu_rotary_mul") > 0
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
