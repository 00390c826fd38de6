import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer_vllm.ops.moe import (
    expert_choices,
    expert_groups,
    expert_mlp,
    moe_forward,
    route_sqrtsoftplus,
    sum_in_expert_order,
    swiglu_clamped,
)


def _sqsp(v):
    return math.sqrt(math.log1p(math.exp(v)))


def test_tie_break_lower_index_first():
    D = 4
    gate = torch.zeros(6, D)
    gate[[1, 3, 4]] = torch.tensor([1.0, 0.5, 0.0, 0.0])  # experts 1, 3, 4 tie for the top
    x = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    w, ids = route_sqrtsoftplus(x, gate, torch.zeros(6), 2, 1.5)
    assert ids.tolist() == [[1, 3]]
    # weights come in the accumulation dtype (fp64 for fp32 activations, see ops.numerics)
    assert ids.dtype == torch.int64 and w.dtype == torch.float64
    torch.testing.assert_close(w, torch.tensor([[0.75, 0.75]], dtype=torch.float64))


def test_bias_steers_selection_but_not_weights():
    g = torch.Generator().manual_seed(0)
    T, D, E = 4, 16, 8
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    gate = (torch.randn(E, D, generator=g) * 0.5).to(torch.bfloat16)
    bias = torch.zeros(E)
    bias[6] = 100.0  # forces expert 6 into every selection
    w, ids = route_sqrtsoftplus(x, gate, bias, 3, 1.5)
    logits = x.double() @ gate.double().t()
    for t in range(T):
        s = [_sqsp(v) for v in logits[t].tolist()]
        assert ids[t, 0].item() == 6
        rest = sorted(range(E), key=lambda e: (-(s[e]), e))
        rest = [e for e in rest if e != 6][:2]
        assert ids[t, 1:].tolist() == rest
        chosen = [s[e] for e in ids[t].tolist()]
        want = [1.5 * v / sum(chosen) for v in chosen]  # unbiased scores, renormalised
        torch.testing.assert_close(
            w[t].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
    # no renormalisation: weights are the raw unbiased scores times the factor
    w2, _ = route_sqrtsoftplus(x, gate, bias, 3, 1.5, norm_topk_prob=False)
    torch.testing.assert_close(w2, 1.5 * F.softplus(x.float() @ gate.float().t()).sqrt().gather(1, ids))


def test_image_rows_use_bias_vl():
    D, E = 4, 5
    gate = torch.zeros(E, D)
    x = torch.ones(2, D)
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])
    bias_vl = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    _, ids = route_sqrtsoftplus(x, gate, bias, 1, 1.0, bias_vl=bias_vl, is_image=torch.tensor([False, True]))
    assert ids.view(-1).tolist() == [3, 1]


def test_swiglu_clamp_limits():
    gate = torch.tensor([20.0, -20.0, 3.0, 10.0])
    up = torch.tensor([20.0, -20.0, -30.0, 0.5])
    out = swiglu_clamped(gate, up, 10.0)
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    want = [silu(10.0) * 10.0, silu(-20.0) * -10.0, silu(3.0) * -10.0, silu(10.0) * 0.5]
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert out.dtype == torch.float64
    # gate is only clamped from above: a very negative gate is NOT raised to -limit
    assert swiglu_clamped(torch.tensor([-20.0]), torch.tensor([1.0]), 10.0).item() == pytest.approx(
        silu(-20.0)
    )


def _naive_moe(x, tw, tid, w1, w3, w2, limit, shared):
    out = []
    for t in range(x.shape[0]):
        xt = x[t].double()
        acc = torch.zeros(w2.shape[1], dtype=torch.float64)

        def ex(a, b, c):
            h = (a.double() @ xt).clamp(max=limit)
            u = (b.double() @ xt).clamp(-limit, limit)
            return c.double() @ (h * torch.sigmoid(h) * u)

        for j in range(tid.shape[1]):
            e = tid[t, j].item()
            if e >= 0:
                acc += tw[t, j].item() * ex(w1[e], w3[e], w2[e])
        if shared is not None:
            acc += ex(*shared)
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_against_loop(dtype):
    g = torch.Generator().manual_seed(4)
    T, K, N, E = 7, 16, 12, 5
    x = (torch.randn(T, K, generator=g) * 2).to(dtype)
    w1 = (torch.randn(E, N, K, generator=g) * 0.5).to(dtype)
    w3 = (torch.randn(E, N, K, generator=g) * 0.5).to(dtype)
    w2 = (torch.randn(E, K, N, generator=g) * 0.3).to(dtype)
    shared = tuple((torch.randn(*s, generator=g) * 0.3).to(dtype) for s in [(N, K), (N, K), (K, N)])
    gate = torch.randn(E, K, generator=g)
    tw, tid = route_sqrtsoftplus(x, gate, torch.zeros(E), 2, 1.5)
    tid[0, 1] = -1  # a dropped slot is skipped
    y = moe_forward(x, tw, tid, w1, w3, w2, 2.0, shared=shared)  # small limit so the clamp is active
    assert y.dtype == dtype and y.shape == (T, K)
    ref = _naive_moe(x, tw, tid, w1, w3, w2, 2.0, shared)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    # the routed part alone equals a weighted sum of expert_mlp calls
    y0 = moe_forward(x[:1], tw[:1], tid[:1], w1, w3, w2, 2.0)
    e = tid[0, 0].item()
    torch.testing.assert_close(y0, expert_mlp(x[:1], w1[e], w3[e], w2[e], 2.0, row_weight=tw[:1, 0]))


def test_expert_groups_match_expert_choices():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 12, (9, 3), generator=g)
    ids[2, 1] = -1  # a padding slot belongs to no expert
    experts = range(4, 10)  # this rank's experts; the others' pairs go last
    order, offsets = expert_groups(ids, experts)
    assert order.dtype == offsets.dtype == torch.int64 and offsets.shape == (len(experts) + 1,)
    want = list(expert_choices(ids, experts))
    flat = ids.reshape(-1)
    for i, e in enumerate(experts):
        got = order[offsets[i] : offsets[i + 1]]
        match = [sel for ee, sel, _ in want if ee == e]
        assert got.tolist() == (match[0].tolist() if match else [])
    assert sorted(order.tolist()) == list(range(ids.numel()))  # a permutation
    rest = order[offsets[-1] :]
    assert all(not (4 <= v < 10) for v in flat[rest].tolist())
    assert rest.tolist() == sorted(rest.tolist())  # stable: ascending pair index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_in_expert_order_is_the_reference_order(dtype):
    g = torch.Generator().manual_seed(8)
    T, k, D = 6, 4, 5
    ids = torch.stack([torch.randperm(9, generator=g)[:k] for _ in range(T)])
    acc = torch.float64 if dtype == torch.float32 else torch.float32
    y = (torch.randn(T, k, D, generator=g, dtype=torch.float64) * 1e3).to(acc)
    got = sum_in_expert_order(y, ids, dtype)
    want = torch.zeros(T, D, dtype=acc)  # the reference: index_add_ per expert, ascending
    flat = y.reshape(T * k, D)
    for e, sel, rows in expert_choices(ids, range(9)):
        want.index_add_(0, rows, flat[sel].to(dtype).to(acc))
    assert torch.equal(got, want)
