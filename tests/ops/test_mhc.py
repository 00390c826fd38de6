import math

import pytest
import torch

from deepinfer_vllm.ops.numerics import acc_dtype

from deepinfer_vllm.ops.mhc import (
    broadcast_streams,
    hc_collapse,
    hc_expand,
    hc_fn_broadcast,
    hc_mix,
    hc_mix_logits,
    hc_mix_logits_broadcast,
    identity_pre,
    sinkhorn,
)

HC, D = 4, 8


def _sig(v):
    return 1.0 / (1.0 + math.exp(-v))


def _naive_mix(streams, fn, base, scale, rms_eps, hc_eps, iters, post_mult):
    """Straightforward per-token implementation of docs/architecture.md, "mHC coefficients", in
    Python floats."""
    fn_l, base_l, sc = fn.double().tolist(), base.double().tolist(), scale.double().tolist()
    pres, posts, combs = [], [], []
    for tok in streams.double().tolist():
        x = [v for stream in tok for v in stream]
        r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + rms_eps)
        m = [sum(a * b for a, b in zip(row, x)) * r for row in fn_l]
        pres.append([_sig(sc[0] * m[i] + base_l[i]) + hc_eps for i in range(HC)])
        posts.append([post_mult * _sig(sc[1] * m[HC + i] + base_l[HC + i]) for i in range(HC)])
        c = [[sc[2] * m[2 * HC + HC * j + k] + base_l[2 * HC + HC * j + k] for k in range(HC)] for j in range(HC)]
        for j in range(HC):  # softmax over k, + eps
            mx = max(c[j])
            e = [math.exp(v - mx) for v in c[j]]
            c[j] = [v / sum(e) + hc_eps for v in e]

        def cols(c):
            s = [sum(c[j][k] for j in range(HC)) + hc_eps for k in range(HC)]
            return [[c[j][k] / s[k] for k in range(HC)] for j in range(HC)]

        def rows(c):
            return [[v / (sum(row) + hc_eps) for v in row] for row in c]

        c = cols(c)
        for _ in range(iters - 1):
            c = cols(rows(c))
        combs.append(c)
    return (torch.tensor(pres, dtype=torch.float64), torch.tensor(posts, dtype=torch.float64),
            torch.tensor(combs, dtype=torch.float64))


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(HC * (HC + 2), HC * D, generator=g) * 0.3
    base = torch.randn(HC * (HC + 2), generator=g) * 0.1
    scale = torch.tensor([0.7, 0.4, 1.3])
    return g, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mix_matches_per_token_loop(dtype):
    g, fn, base, scale = _params(0)
    streams = torch.randn(3, HC, D, generator=g).to(dtype)
    pre, post, comb = hc_mix(streams, fn, base, scale, 1e-20, 1e-6, 20)
    assert pre.dtype == post.dtype == comb.dtype == acc_dtype(dtype)
    assert pre.shape == (3, HC) and post.shape == (3, HC) and comb.shape == (3, HC, HC)
    rp, rq, rc = _naive_mix(streams, fn, base, scale, 1e-20, 1e-6, 20, 2.0)
    torch.testing.assert_close(pre.double(), rp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(post.double(), rq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb.double(), rc, rtol=1e-5, atol=1e-6)


def test_sinkhorn_is_doubly_stochastic():
    g = torch.Generator().manual_seed(3)
    c = sinkhorn(torch.randn(50, HC, HC, generator=g), 20, 1e-6)
    col = c.sum(dim=-2)
    row = c.sum(dim=-1)
    # last step is a column normalisation: col sum = S / (S + eps), within eps of 1
    assert ((col - 1).abs() <= 2e-6).all()
    assert ((row - 1).abs() <= 1e-3).all()  # rows only approximately (20 iterations)
    assert (c > 0).all()
    # one iteration = softmax + eps followed by exactly one column normalisation
    one = sinkhorn(torch.zeros(1, HC, HC), 1, 0.0)
    torch.testing.assert_close(one, torch.full((1, HC, HC), 0.25))


def test_broadcast_identity_first_layer():
    g, fn, base, scale = _params(1)
    e = torch.randn(5, D, generator=g).to(torch.bfloat16)
    streams = broadcast_streams(e, HC)
    assert streams.shape == (5, HC, D) and streams.stride() == (D, 0, 1)  # a view: no copy
    assert all(torch.equal(streams[:, i], e) for i in range(HC))
    full = hc_mix_logits(streams, fn, 1e-20)
    summed = hc_mix_logits_broadcast(e, hc_fn_broadcast(fn, HC), 1e-20)
    torch.testing.assert_close(full, summed, rtol=1e-5, atol=1e-5)
    # collapse with the identity pre-mix returns stream 0 exactly
    assert torch.equal(hc_collapse(streams, identity_pre(5, HC)), e)
    pre = identity_pre(2, HC)
    assert pre.dtype == torch.float32 and torch.equal(pre, torch.tensor([[1.0, 0, 0, 0]] * 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_expand_against_loops(dtype):
    g = torch.Generator().manual_seed(2)
    T = 3
    streams = torch.randn(T, HC, D, generator=g).to(dtype)
    y = torch.randn(T, D, generator=g).to(dtype)
    pre = torch.rand(T, HC, generator=g)
    post = torch.rand(T, HC, generator=g) * 2
    comb = torch.rand(T, HC, HC, generator=g)  # deliberately not symmetric
    col = hc_collapse(streams, pre)
    out = hc_expand(y, streams, post, comb)
    assert col.dtype == dtype and out.dtype == dtype
    R = streams.double()
    for t in range(T):
        want_c = sum(pre[t, i].item() * R[t, i] for i in range(HC))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(col[t].double(), want_c, rtol=tol, atol=tol)
        for k in range(HC):
            want = post[t, k].item() * y[t].double() + sum(comb[t, j, k].item() * R[t, j] for j in range(HC))
            torch.testing.assert_close(out[t, k].double(), want, rtol=tol, atol=tol)
    # transposition matters: swapping comb's axes gives a different answer
    assert not torch.allclose(hc_expand(y, streams, post, comb.transpose(1, 2)).float(), out.float())
