"""ops/triton/routing.py against the references (``ops.moe``) on the Flash shapes.

Given the same logits the router is bit-exact on the GPU: ids and weights equal the reference's
(libdevice ``expf``/``log1pf`` and IEEE ``sqrt``/division as torch's CUDA kernels, torch's
summation order for the k chosen scores). Grouping and expert sums are integer work and exact
copies/adds: bit-exact. Through the logits GEMM (``router_logits``) the logits may differ from
the reference's in summation order: there ids are compared where the reference's top k + 1 keys
are at least 1e-4 apart, and weights to 1e-5. Under the interpreter (CPU, small shapes) the
scores' last ulps differ (no libdevice): ids on rows without near-ties, weights to 1e-6.
Everything is captured in a CUDA graph and replayed to the eager bits.
"""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET, shapes

from deepinfer_vllm.ops import moe
from deepinfer_vllm.ops.triton import routing

HIDDEN, E, K = 5120, 384, 6
TOKENS = shapes([1, 7], [1, 64, 256])
IMAGE = 129264


def _inputs(T: int, device, seed: int = 0, E: int = E, hidden: int = HIDDEN):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g).bfloat16()
    w = (torch.randn(E, hidden, generator=g) * hidden**-0.5 * 2).bfloat16()
    bias = (torch.rand(E, generator=g) - 0.5) * 0.1
    bias_vl = (torch.rand(E, generator=g) - 0.5) * 0.1
    tokens = torch.randint(0, 1000, (T,), generator=g)
    tokens[::3] = IMAGE
    return [t.to(device) for t in (x, w, bias, bias_vl, tokens)]


def _top_gap(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: the smallest gap between consecutive keys among its top k + 1."""
    s = keys.sort(dim=-1, descending=True).values[:, : k + 1]
    return (s[:, :-1] - s[:, 1:]).min(dim=-1).values


def _keys(logits, bias, bias_vl, is_image):
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    return scores + torch.where(is_image[:, None], bias_vl, bias)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("E,k", [(E, K), (128, 3)])  # the backbone's router, a DSpark stage's
def test_route_from_logits_bit_exact(T, E, k, device):
    x, w, bias, bias_vl, tokens = _inputs(T, device, seed=T, E=E)
    logits = routing.router_logits(x, w)
    got_w, got = routing.route_from_logits(logits, bias, k, 1.5, True, bias_vl, tokens, IMAGE)
    want_w, want = moe.sqrtsoftplus_select(logits, bias, k, 1.5, True, bias_vl, tokens == IMAGE)
    if not INTERPRET:
        assert torch.equal(got, want)
        assert torch.equal(got_w, want_w)
        return
    clear = _top_gap(_keys(logits, bias, bias_vl, tokens == IMAGE), k) > 1e-5
    assert torch.equal(got[clear], want[clear])
    torch.testing.assert_close(got_w[clear], want_w[clear], rtol=1e-6, atol=0)


def test_route_ties_bit_exact(device):
    T = 64 if not INTERPRET else 5
    g = torch.Generator().manual_seed(1)
    logits = (torch.randint(-8, 8, (T, E), generator=g).float() / 4).to(device)  # many equal scores
    logits[0] = 0.5
    bias = torch.zeros(E, device=device)
    got_w, got = routing.route_from_logits(logits, bias, K, 1.5, True)
    want_w, want = moe.sqrtsoftplus_select(logits, bias, K, 1.5, True)
    assert torch.equal(got, want)
    assert got[0].tolist() == list(range(K))
    if not INTERPRET:
        assert torch.equal(got_w, want_w)


@pytest.mark.parametrize("T", TOKENS)
def test_route_through_the_gemm(T, device):
    x, w, bias, bias_vl, tokens = _inputs(T, device, seed=100 + T)
    got_w, got = routing.route_sqrtsoftplus(x, w, bias, K, 1.5, True, bias_vl, tokens, IMAGE)
    want_w, want = moe.route_sqrtsoftplus(x, w, bias, K, 1.5, True, bias_vl, tokens == IMAGE)
    logits = moe.matmul(x.float(), w.float())
    clear = _top_gap(_keys(logits, bias, bias_vl, tokens == IMAGE), K) > 1e-4
    assert clear.float().mean() > 0.5
    assert torch.equal(got[clear], want[clear])
    torch.testing.assert_close(got_w[clear], want_w[clear], rtol=1e-5, atol=0)


# 682 x 6: MAX_PAIRS's last whole tokens; 684 and 8192 (prefill) tokens: the two-launch path above it
@pytest.mark.parametrize("T", TOKENS + shapes([], [682, 684, 8192]))
@pytest.mark.parametrize("experts", [range(0, E), range(96, 144)], ids=["all", "ep8-rank2"])
def test_expert_groups_bit_exact(T, experts, device):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 2] = -1  # a padding slot
    ids, weights = ids.to(device), torch.rand(T, K, generator=g).to(device)
    order, offsets, rows, pw, position = routing.expert_groups(ids, experts, weights)
    want_order, want_offsets = moe.expert_groups(ids, experts)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
    assert torch.equal(rows, want_order // K) and torch.equal(pw, weights.reshape(-1)[want_order])
    inverse = torch.empty_like(want_order).index_copy_(0, want_order, torch.arange(T * K, device=device))
    assert torch.equal(position.long(), inverse)


@pytest.mark.parametrize("T", TOKENS)
def test_expert_sum_bit_exact(T, device):
    D = HIDDEN if not INTERPRET else 96
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0, 1] = ids[0, 4] = -1
    ids = ids.to(device)
    order, _, _, _, position = routing.expert_groups(ids, range(0, E), torch.ones(T, K, device=device))
    down = (torch.randn(T * K, D, generator=g) * 10).bfloat16().to(device)
    per_pair = torch.empty_like(down).index_copy_(0, order, down)
    want = moe.sum_in_expert_order(per_pair.view(T, K, D).float(), ids, torch.bfloat16)
    assert torch.equal(routing.expert_sum(down, ids, torch.bfloat16, position), want)
    # other ranks' pairs (experts E/2..E-1 here) past offsets[-1]: read as zero, never loaded
    ones = torch.ones(T, K, device=device)
    order, offsets, _, _, position = routing.expert_groups(ids, range(0, E // 2), ones)
    live = int(offsets[-1])
    down[live:] = 0
    per_pair = torch.empty_like(down).index_copy_(0, order, down)
    want_live = moe.sum_in_expert_order(per_pair.view(T, K, D).float(), ids, torch.bfloat16)
    down[live:] = float("nan")
    assert torch.equal(routing.expert_sum(down, ids, torch.bfloat16, position, offsets[-1:]), want_live)
    summed = (torch.randn(T * K, D, generator=g) * 10).to(device)  # the split path's fp32 partials
    want = moe.sum_in_expert_order(summed.view(T, K, D), ids, torch.bfloat16)
    assert torch.equal(routing.expert_sum(summed, ids, torch.bfloat16), want)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("T", [1, 64, 256])
def test_cuda_graph_equals_eager(T, device):
    x, w, bias, bias_vl, tokens = _inputs(T, device, seed=7)
    D = HIDDEN
    experts = range(96, 144)

    def step():
        weights, ids = routing.route_sqrtsoftplus(x, w, bias, K, 1.5, True, bias_vl, tokens, IMAGE)
        order, offsets, rows, pw, position = routing.expert_groups(ids, experts, weights)
        down = x[rows] * pw.unsqueeze(-1).bfloat16()  # stands in for the expert GEMMs
        return weights, ids, order, offsets, routing.expert_sum(down[:, :D], ids, torch.bfloat16, position)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new = _inputs(T, device, seed=8)
    for dst, src in zip((x, w, bias, bias_vl, tokens), new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, step()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("T", shapes([1, 7], [1, 64, 8192]))
def test_add_shared_bit_exact(T, device):
    """The MoE's last step against CUDA's own ``torch.add(routed, shared).to(bf16)`` at Flash's
    width, with sums half-way between bf16 values and signed zeros (NaN: both give NaN)."""
    g = torch.Generator(device=device).manual_seed(T)
    routed = torch.randn(T, 5120, generator=g, device=device) * 64
    shared = (torch.randn(T, 5120, generator=g, device=device) * 64).bfloat16()
    flat, sh = routed.view(-1), shared.view(-1)
    base = torch.tensor([1.0, 1.0078125, -3.0, 3.015625], device=device)
    flat[:4] = base + base.abs() * 2.0**-9 - sh[:4].float()
    flat[4:8] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")], device=device)
    sh[4:8] = torch.tensor([-0.0, -0.0, -1.0, 2.0], dtype=torch.bfloat16, device=device)
    want = torch.add(routed, shared).to(torch.bfloat16)
    got = routing.add_shared(routed, shared)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
