import math

import pytest
import torch

from deepinfer_vllm.ops.sparse_attention import sparse_attention, window_indices


def _naive(q, kv, valid, sink, scale):
    Tq, H, D = q.shape
    out = torch.zeros(Tq, H, D, dtype=torch.float64)
    for t in range(Tq):
        for h in range(H):
            logits = [(q[t, h].double() @ kv[t, k].double()).item() * scale for k in range(kv.shape[1]) if valid[t, k]]
            keys = [kv[t, k].double() for k in range(kv.shape[1]) if valid[t, k]]
            den = sum(math.exp(s) for s in logits) + (math.exp(sink[h].item()) if sink is not None else 0.0)
            for s, key in zip(logits, keys):
                out[t, h] += math.exp(s) / den * key
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_against_loop(dtype):
    g = torch.Generator().manual_seed(0)
    Tq, H, K, D = 4, 3, 6, 16
    q = torch.randn(Tq, H, D, generator=g).to(dtype)
    kv = torch.randn(Tq, K, D, generator=g).to(dtype)
    valid = torch.rand(Tq, K, generator=g) > 0.3
    valid[2] = False  # a query without any valid key
    sink = torch.randn(H, generator=g)
    scale = D ** -0.5
    out = sparse_attention(q, kv, valid, sink, scale)
    assert out.dtype == dtype and out.shape == (Tq, H, D)
    ref = _naive(q, kv, valid, sink, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    assert torch.equal(out[2], torch.zeros(H, D, dtype=dtype))
    # invalid keys have no influence at all
    kv2 = kv.clone()
    kv2[~valid] = 1000
    assert torch.equal(sparse_attention(q, kv2, valid, sink, scale), out)


def test_sink_only_in_denominator():
    q = torch.zeros(1, 2, 4)
    kv = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    # zero query: both logits 0 regardless of scale; sink 0 -> weights 1/3 each (sink NOT scaled)
    out = sparse_attention(q, kv, valid, torch.tensor([0.0, math.log(2.0)]), scale=123.0)
    torch.testing.assert_close(out[0, 0], (kv[0, 0] + kv[0, 1]) / 3)
    torch.testing.assert_close(out[0, 1], (kv[0, 0] + kv[0, 1]) / 4)
    no_sink = sparse_attention(q, kv, valid, None, scale=1.0)
    torch.testing.assert_close(no_sink[0, 0], (kv[0, 0] + kv[0, 1]) / 2)


def test_window_indices():
    idx, valid = window_indices(torch.tensor([0, 2, 9]), 4)
    assert idx.tolist() == [[-1, -1, -1, 0], [-1, 0, 1, 2], [6, 7, 8, 9]]
    assert valid.tolist() == [[False, False, False, True], [False, True, True, True], [True] * 4]
    idx, valid = window_indices(torch.tensor([9, 9]), 4, lo_clamp=torch.tensor([8, 0]))
    assert idx.tolist() == [[-1, -1, 8, 9], [6, 7, 8, 9]]
    assert valid.tolist() == [[False, False, True, True], [True] * 4]


def test_window_attention_is_causal():
    g = torch.Generator().manual_seed(1)
    T, H, D, W = 6, 2, 8, 3
    keys = torch.randn(T, D, generator=g)
    q = torch.randn(T, H, D, generator=g)
    pos = torch.arange(T)
    idx, valid = window_indices(pos, W)
    out = sparse_attention(q, keys[idx.clamp_min(0)], valid, torch.zeros(H), D ** -0.5)
    keys2 = keys.clone()
    keys2[4:] += 5  # future keys change: rows 0..3 unaffected
    out2 = sparse_attention(q, keys2[idx.clamp_min(0)], valid, torch.zeros(H), D ** -0.5)
    assert torch.equal(out[:4], out2[:4]) and not torch.equal(out[4:], out2[4:])
