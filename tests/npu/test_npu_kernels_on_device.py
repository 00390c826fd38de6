"""``platforms/ascend/kernels.py`` on ``npu`` tensors equals the same calls on host tensors
(device-only, outside CI like the rest of ``tests/npu``). NEVER RUN: this project has no NPU.
``tests/platforms/ascend/test_npu_kernels.py`` checks the host results against vLLM's own CPU
kernels; this checks that the operators they use (searchsorted, gathers, ``where``, cumsum,
first-argmax on ties) give the same answers on the device."""

from __future__ import annotations

import pytest
import torch

torch_npu = pytest.importorskip("torch_npu")
if not torch.npu.is_available():  # torch.npu exists once torch_npu is imported
    pytest.skip("no NPU visible", allow_module_level=True)

from deepinfer_vllm.platforms.ascend import kernels  # noqa: E402

DEVICE = torch.device("npu", 0)


def _both(fn, *host_args):
    """``fn`` on the host arguments and on their device copies; the (host, device) arguments
    after the call (the kernels write into their output arguments)."""
    dev_args = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in host_args]
    fn(*host_args)
    fn(*dev_args)
    return host_args, dev_args


def test_slot_mapping_on_the_device_equals_the_host():
    g = torch.Generator().manual_seed(0)
    query_start_loc = torch.tensor([0, 5, 5, 37, 40], dtype=torch.int32)
    positions = torch.cat([torch.arange(100, 105), torch.arange(0, 32), torch.arange(63, 66)])
    block_table = torch.randint(0, 1000, (8, 16), generator=g, dtype=torch.int32)
    slots = torch.full((64,), 7, dtype=torch.int64)
    host, dev = _both(
        kernels.compute_slot_mapping_kernel, 40, 64, query_start_loc, positions, block_table, 16, slots,
        64, 1, 0, 1, -1, 1024,
    )
    assert torch.equal(host[6], dev[6].cpu())


def test_expand_and_greedy_argmax_on_the_device_equal_the_host():
    values = torch.tensor([0.5, -1.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    out = torch.zeros(6)
    host, dev = _both(kernels.expand_kernel, out, values, cu, -1.0, 0.0, 4)
    assert torch.equal(host[0], dev[0].cpu())
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])  # first index wins
    assert kernels.greedy_sample(ties.to(DEVICE)).cpu().tolist() == [1, 0]


def test_recovered_tokens_on_the_device_equal_the_host():
    g = torch.Generator().manual_seed(1)
    vocab = 50
    cu = torch.tensor([2, 3], dtype=torch.int32)
    drafts = torch.randint(0, vocab, (3,), generator=g)
    target = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
    draft_probs = torch.softmax(torch.randn(3, vocab, generator=g), dim=-1)
    inv_q = torch.rand(2, vocab, generator=g, dtype=torch.float64).reciprocal()
    out = torch.full((3,), -1, dtype=torch.int64)
    host, dev = _both(
        kernels.sample_recovered_tokens_kernel, out, cu, drafts, draft_probs, target, inv_q, vocab, 1024,
        False, True,
    )
    assert torch.equal(host[0], dev[0].cpu())
