"""The paged reference (``ops/paged_attention.py``) is the model's gather semantics.

The oracle here never touches pages: every request keeps its dense latents per
position (window) and per compressed entry, quantise-dequantised with the cache
formats (``mxfp8_qdq`` / ``nvfp4_qdq``), and keys are gathered by plain indexing
exactly as ``V41Attention._gather_keys`` does (window ``p-W+1..p`` valid iff
``>= window_lo``, then the top-k entries, -1 = none, invalid keys zeroed), then
``sparse_attention``. The paged reference reads the same records back from
shuffled, padded, block-outermost pages whose unused slots hold NaN bytes; the
two must agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.paged_attention import paged_sparse_attention
from deepinfer_vllm.ops.paged_records import RecordFormat, write_records
from deepinfer_vllm.ops.sparse_attention import sparse_attention


def _build(seed, *, tokens_per_req, H, D, W, K, ratio, block_size, dtype):
    g = torch.Generator().manual_seed(seed)
    R = len(tokens_per_req)
    ctx = [n + int(torch.randint(0, 3 * W, (), generator=g)) for n in tokens_per_req]
    positions = torch.cat([torch.arange(L - n, L) for n, L in zip(tokens_per_req, ctx)])
    token_req = torch.cat([torch.full((n,), r) for r, n in enumerate(tokens_per_req)])
    T = positions.numel()
    window_lo = torch.where(
        torch.rand(T, generator=g) < 0.3, (positions - torch.randint(0, W, (T,), generator=g)).clamp_min(0), 0
    )

    w_fmt, c_fmt = RecordFormat("mxfp8", D), RecordFormat("nvfp4", D)
    n_c = block_size // (ratio or 1)
    w_page, c_page = block_size * w_fmt.record_bytes, n_c * c_fmt.record_bytes
    per_req = -(-max(ctx) // block_size)
    num_blocks = 2 * R * per_req + 1
    buf = torch.full((num_blocks, w_page + c_page + 40), 0xFF, dtype=torch.uint8)
    window_cache = buf[:, :w_page].unflatten(1, (1, block_size, w_fmt.record_bytes))
    comp_cache = buf[:, w_page : w_page + c_page].unflatten(1, (1, n_c, c_fmt.record_bytes))
    perm = torch.randperm(num_blocks, generator=g)
    w_bt = perm[: R * per_req].view(R, per_req)
    c_bt = perm[R * per_req : 2 * R * per_req].view(R, per_req)

    dense_w, dense_c = [], []  # per request: qdq latents by position / by entry
    for r, L in enumerate(ctx):
        x = torch.randn(L, D, generator=g).to(dtype)
        pos = torch.arange(L)
        write_records(window_cache, w_fmt, w_bt[r, pos // block_size], pos % block_size, x)
        dense_w.append(quant.mxfp8_qdq(x))
        if ratio:
            c = torch.randn(L // ratio, D, generator=g).to(dtype)
            first = torch.arange(L // ratio) * ratio
            write_records(comp_cache, c_fmt, c_bt[r, first // block_size], (first % block_size) // ratio, c)
            dense_c.append(quant.nvfp4_qdq(c))

    topk = None
    if ratio:
        rows = []
        for p in positions.tolist():
            visible = (p + 1) // ratio
            row = torch.full((K,), -1)
            chosen = torch.randperm(visible, generator=g)[:K].sort().values
            row[: chosen.numel()] = chosen
            row[torch.rand(K, generator=g) < 0.2] = -1
            rows.append(row)
        topk = torch.stack(rows)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sink = torch.randn(H, generator=g)
    args = dict(
        window_cache=window_cache, window_block_table=w_bt, window_block_size=block_size,
        positions=positions, window_lo=window_lo, token_req=token_req, window=W,
        sink=sink, scale=D**-0.5,
    )
    if ratio:
        args.update(comp_cache=comp_cache, comp_block_table=c_bt, comp_block_size=block_size,
                    comp_ratio=ratio, topk=topk)
    return q, args, dense_w, dense_c


def _dense_oracle(q, args, dense_w, dense_c):
    """``_gather_keys`` on dense per-request latents, then ``sparse_attention``."""
    W = args["window"]
    T, H, D = q.shape
    keys, valid = [], []
    for t in range(T):
        r, p, lo = int(args["token_req"][t]), int(args["positions"][t]), int(args["window_lo"][t])
        kp = torch.arange(p - W + 1, p + 1)
        ok = kp >= lo
        k = dense_w[r][kp.clamp_min(0)].masked_fill(~ok[:, None], 0.0)
        if "topk" in args:
            e = args["topk"][t]
            cok = e >= 0
            k = torch.cat([k, dense_c[r][e.clamp_min(0)].masked_fill(~cok[:, None], 0.0)])
            ok = torch.cat([ok, cok])
        keys.append(k)
        valid.append(ok)
    return sparse_attention(q, torch.stack(keys), torch.stack(valid), args["sink"], args["scale"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens_per_req,H,D,W,K,ratio,block_size",
    [
        ([1, 2, 3], 4, 64, 8, 4, 2, 16),
        ([2, 1], 3, 128, 8, 12, 1, 8),
        ([1, 1, 4], 4, 64, 8, 0, None, 8),
        ([3], 2, 64, 16, 40, 2, 32),
    ],
)
def test_paged_reference_equals_dense_gather(dtype, tokens_per_req, H, D, W, K, ratio, block_size):
    q, args, dense_w, dense_c = _build(
        len(tokens_per_req) + D + (ratio or 0), tokens_per_req=tokens_per_req, H=H, D=D, W=W, K=K,
        ratio=ratio, block_size=block_size, dtype=dtype,
    )
    out = paged_sparse_attention(q, **args)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert torch.equal(out, _dense_oracle(q, args, dense_w, dense_c))


def test_no_valid_key_gives_zero():
    q, args, *_ = _build(0, tokens_per_req=[2], H=2, D=64, W=4, K=4, ratio=2, block_size=8,
                         dtype=torch.float32)
    args["window_lo"] = args["positions"] + 1
    args["topk"] = torch.full_like(args["topk"], -1)
    assert torch.equal(paged_sparse_attention(q, **args), torch.zeros_like(q))


def test_topk_needs_its_cache():
    q, args, *_ = _build(0, tokens_per_req=[1], H=2, D=64, W=4, K=4, ratio=2, block_size=8,
                         dtype=torch.float32)
    args["comp_cache"] = None
    with pytest.raises(ValueError, match="topk needs"):
        paged_sparse_attention(q, **args)
