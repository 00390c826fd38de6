"""The MoE's grouped path (experts grouped on the device, one grouped GEMM per projection)
computes what the expert-by-expert reference path computes, bit for bit, on every expert
split: whole experts (expert parallelism, pairs of other ranks' experts present) and
intermediate slices (partials summed over ranks, then ``combine``d)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.moe import route_sqrtsoftplus

HIDDEN, INTER, EXPERTS, TOP_K = 64, 128, 8, 3


def _experts(layout: ParallelLayout, seed: int) -> RoutedExperts:
    g = torch.Generator().manual_seed(seed)
    mod = RoutedExperts(EXPERTS, HIDDEN, INTER, layout)
    for name in ("w13", "w2"):
        w = getattr(mod, name)
        full = torch.randn(w.shape[0], w.shape[1], 2 * w.shape[2], generator=g) * 0.2
        packed, scale = quant.quant_fp4_rows(full)
        w.data.copy_(packed.view(torch.int8))
        getattr(mod, f"{name}_scale").data.copy_(scale)
    return mod


def _routing(dtype, seed: int, tokens: int = 11):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate = torch.randn(EXPERTS, HIDDEN, generator=g).to(torch.bfloat16)
    weights, ids = route_sqrtsoftplus(x, gate, None, TOP_K, 1.5)
    ids[3, 1] = -1  # a padding slot (as gathered rows of idle data-parallel ranks carry)
    return x, weights, ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activations", ["bf16", "mxfp8"])
@pytest.mark.parametrize(
    "layout",
    [
        ParallelLayout(),
        ParallelLayout(tp_size=2, tp_rank=1, expert_parallel=True),  # experts 4..7 here
        ParallelLayout(dp_size=2, dp_rank=0),  # half of every expert's intermediate slice
    ],
    ids=["one-rank", "expert-parallel", "split"],
)
def test_grouped_equals_expert_by_expert(layout, dtype, activations, monkeypatch):
    monkeypatch.setenv("DEEPINFER_GEMM_ACTIVATIONS", activations)  # read when the layer is built
    mod = _experts(layout, seed=1)
    x, weights, ids = _routing(dtype, seed=2)
    loop = mod.partial(x, weights, ids, limit=2.0, grouped=False)
    grouped = mod.partial(x, weights, ids, limit=2.0, grouped=True)
    assert grouped.dtype == loop.dtype and grouped.shape == loop.shape
    assert torch.equal(grouped, loop)
    if mod.split:
        assert torch.equal(mod.combine(grouped, ids, dtype), mod.combine(loop, ids, dtype))
    assert grouped.abs().sum() > 0


def test_mxfp8_activations_change_the_result(monkeypatch):
    """The setting is honoured (a GEMM input of MXFP8 values differs from bf16 ones); it is
    read when the layer is built, so a layer built before a change keeps its setting."""
    x, weights, ids = _routing(torch.bfloat16, seed=4)
    monkeypatch.setenv("DEEPINFER_GEMM_ACTIVATIONS", "bf16")
    mod = _experts(ParallelLayout(), seed=3)
    plain = mod.partial(x, weights, ids, limit=2.0, grouped=True)
    monkeypatch.setenv("DEEPINFER_GEMM_ACTIVATIONS", "mxfp8")
    assert torch.equal(plain, mod.partial(x, weights, ids, limit=2.0, grouped=True))
    mx = _experts(ParallelLayout(), seed=3)
    assert not torch.equal(plain, mx.partial(x, weights, ids, limit=2.0, grouped=True))


@pytest.mark.parametrize("activations", ["bf16", "mxfp8"])
@pytest.mark.parametrize(
    "layout",
    [ParallelLayout(), ParallelLayout(tp_size=2, tp_rank=1, expert_parallel=True)],
    ids=["one-rank", "expert-parallel"],
)
def test_activation_in_tile_order_is_the_same_sum(layout, activations, monkeypatch):
    """Where the down projection's kernel stages its input in the GPU GEMMs' tile order (on the H200), the
    layer has the SwiGLU write it so and tells the GEMM (``act_tile_order``, chosen when built: off on the
    CPU). Forced on here, through the operators the CPU runs: the same bits as without it."""
    monkeypatch.setenv("DEEPINFER_GEMM_ACTIVATIONS", activations)
    mod = _experts(layout, seed=5)
    assert mod.act_tile_order is False
    x, weights, ids = _routing(torch.bfloat16, seed=6)
    plain = mod.partial(x, weights, ids, limit=2.0, grouped=True)
    mod.act_tile_order = True
    assert torch.equal(mod.partial(x, weights, ids, limit=2.0, grouped=True), plain)
