"""mHC (hyper-connection) kernels: the reference's chains of small ops in four launches per site.

References: ``ops.mhc.hc_mix``, ``ops.norm.rms_norm(ops.mhc.hc_collapse(...))`` and
``ops.mhc.hc_expand``. Eagerly, the reference issues about 150 kernels per sublayer site
(the Sinkhorn loop alone is 20 x 2 normalisations), each a few microseconds on a few
kilobytes; in a decode step they cost more than the site's GEMMs. Here:

* ``hc_mix``: a split-K projection of the flattened streams onto ``fn`` that also sums the
  squares (fixed splits of ``MIX_CHUNK`` columns, so a row's bits do not depend on the batch),
  then one kernel that adds the splits in a fixed order, scales by the RMS and forms ``pre``,
  ``post`` and the Sinkhorn-normalised ``comb`` in registers;
* ``hc_collapse_norm``: the weighted sum of the streams, rounded to the streams' dtype,
  RMS-normalised, one program per token (``rms_norm``: the same kernel on one stream);
* ``hc_expand``: ``post * y + comb^T streams`` per token and column block.

All arithmetic is fp32 as in the reference; only summation order and the exponential's
last bits differ (``tests/gpu/test_mhc.py`` states the tolerances). For bf16 streams the
projection runs on the tensor cores and stays exact: ``fn``'s fp32 entries are split into
three bf16 numbers (``stored_gemm.bf16x3``: exact for ``|fn| >= 2^-110``), each product of a
bf16 stream value with a part is exact in fp32, and three bf16 dots with fp32 accumulation
sum the reference's products (fp32 streams keep the ``ieee`` fp32 dot).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.indexer import _round_bf16
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.stored_gemm import bf16x3, dot_bf16, widen_bf16

__all__ = ["MIX_CHUNK", "hc_collapse_norm", "hc_expand", "hc_mix", "mix_tile", "rms_norm"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Columns of the flattened streams per split of the mix projection: a constant, so a row's
# bits do not depend on the batch; 256 gives one token 80 programs at hc * D = 20480.
MIX_CHUNK = 256
_MIX_BK = 64  # K per dot: with the chunk, it sets every partial sum's order (keep it fixed)
# Tokens per program of the projection and its warps, by the step's token count. The row tile
# only batches rows into one MMA: each row's K order (BK-wide dots in chunk order) is the same,
# so a row's bits do not depend on the tile (``tests/gpu/test_mhc.py`` checks it across the
# switches). At 8192 tokens 16 rows per program ran at 15% of copy (541 us, each program
# re-reading and re-splitting its 32 KB ``fn`` chunk for 8 KB of streams), 64 rows at 44% (179),
# 128 rows on 8 warps at 52% (153); at one token the 16-row tile is 0.7 us faster (H200).


def mix_tile(T: int) -> tuple[int, int]:
    """``(rows per program, warps)`` of the mix projection for a step of ``T`` tokens."""
    if T < 64:
        return 16, 4
    if T < 1024:
        return 64, 4
    return 128, 8


# The split sum: one token per program on one warp, all splits in one tree (Flash: 80 splits). At
# one token 4 tokens on 4 warps with 16 splits per step took 11.3 us, this 6.2 us; 20 Sinkhorn
# iterations are ~2 us of it (H200).
_SPLIT_ROWS = 1
_SPLIT_SUM = 128  # splits added per step (a tree); more splits add their blocks in order
_SPLIT_WARPS = 1


@triton.jit
def _hc_mix_partial_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    sq_ptr,
    T,
    K,
    N,
    D,
    x_stride,
    stride_i,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    NP: tl.constexpr,
    BF16_X: tl.constexpr,  # bf16 streams: fn split into three bf16 parts on the tensor cores
    F32_DOT: tl.constexpr,  # interpreter: the bf16 dots widened to fp32 (same products)
    PDL: tl.constexpr,
):
    """Split ``pid(1)``'s columns: ``part[s, t, n] = sum_k x[t, k] fn[n, k]``, ``sq[s, t] = sum_k x^2``.

    Column ``k`` of a row is stream ``k // D``'s entry ``k % D``, at ``(k // D) * stride_i + k % D``
    (a ``BK`` step stays in one stream unless ``stride_i == D``)."""
    grid_wait(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    s = tl.program_id(1)
    n = tl.arange(0, NP)
    kk = tl.arange(0, BK)
    acc = tl.zeros((ROWS, NP), dtype=tl.float32)
    sq = tl.zeros((ROWS,), dtype=tl.float32)
    t64 = t.to(tl.int64)
    for k0 in range(s * CHUNK, s * CHUNK + CHUNK, BK):
        k = k0 + kk
        i = k0 // D
        x_col = i * stride_i + (k0 - i * D) + kk
        x_mask = (t < T)[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + t64[:, None] * x_stride + x_col[None, :], mask=x_mask, other=0.0)
        w = tl.load(fn_ptr + n[None, :] * K + k[:, None], mask=(n < N)[None, :] & (k < K)[:, None], other=0.0)
        if BF16_X:
            hi, mid, lo = bf16x3(w)
            acc = dot_bf16(x, hi, acc, F32_DOT)
            acc = dot_bf16(x, mid, acc, F32_DOT)
            acc = dot_bf16(x, lo, acc, F32_DOT)
            x = widen_bf16(x)
        else:
            x = x.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision="ieee")
        sq += tl.sum(x * x, axis=1)
    T_pad = tl.num_programs(0) * ROWS
    tl.store(part_ptr + (s * T_pad + t)[:, None] * NP + n[None, :], acc)
    tl.store(sq_ptr + s * T_pad + t, sq)


@triton.jit
def _narrow(v, OUT_BF16: tl.constexpr):
    """fp32 ``v`` rounded to the output dtype's values (bf16: nearest even, by bits, exact in
    Triton's interpreter too, whose ``.to(tl.bfloat16)`` truncates)."""
    if OUT_BF16:
        return _round_bf16(v)
    return v


@triton.jit
def _sigmoid(z):
    return tl.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _hc_mix_split_kernel(
    part_ptr,
    sq_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    T_pad,
    K,
    rms_eps,
    hc_eps,
    post_mult,
    ITERS: tl.constexpr,
    HC: tl.constexpr,
    NP: tl.constexpr,
    ROWS: tl.constexpr,
    SC: tl.constexpr,
    SPLITS: tl.constexpr,  # a constant: the loop over blocks of SC splits unrolls
    PDL: tl.constexpr,
):
    """Sum the splits, scale by ``rsqrt(mean(x^2) + eps)`` and form ``pre``, ``post``, ``comb``.

    The splits are added ``SC`` at a time (a tree over one block of loads, then the blocks in
    order): a fixed order set by ``K`` alone, so a row's bits do not depend on the batch, and
    ``SPLITS / SC`` dependent steps instead of ``SPLITS`` (80 sequential loads per token were
    the kernel's whole time at decode: 62 -> 20 us per layer step at B=64 on the H200; one
    token per one-warp program with all 80 in one tree: 17 -> 11 us).
    Finishing in the projection's last program instead (one launch) measured slower: 16 rows
    per program there against 4 here (41 against 29 us at B=1)."""
    grid_wait(PDL)
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = t < T
    i = tl.arange(0, HC)
    jk = i[:, None] * HC + i[None, :]  # comb's [j, k] column, row-major
    c4 = tl.arange(0, SC)
    pre = tl.zeros((ROWS, HC), dtype=tl.float32)
    post = tl.zeros((ROWS, HC), dtype=tl.float32)
    comb = tl.zeros((ROWS, HC, HC), dtype=tl.float32)
    sq = tl.zeros((ROWS,), dtype=tl.float32)
    for s0 in tl.static_range(0, SPLITS, SC):
        s = s0 + c4
        on = s < SPLITS
        row = (s[:, None] * T_pad + t[None, :]) * NP  # [SC, ROWS]; t < T_pad always
        m2 = on[:, None, None] & (i >= 0)[None, None, :]
        pre += tl.sum(tl.load(part_ptr + row[:, :, None] + i[None, None, :], mask=m2, other=0.0), axis=0)
        p_ptr = part_ptr + row[:, :, None] + HC + i[None, None, :]
        post += tl.sum(tl.load(p_ptr, mask=m2, other=0.0), axis=0)
        c_ptr = part_ptr + row[:, :, None, None] + 2 * HC + jk[None, None, :, :]
        c_mask = on[:, None, None, None] & (jk >= 0)[None, None, :, :]
        comb += tl.sum(tl.load(c_ptr, mask=c_mask, other=0.0), axis=0)
        sq_ptr_s = sq_ptr + s[:, None] * T_pad + t[None, :]
        sq += tl.sum(tl.load(sq_ptr_s, mask=on[:, None] & (t >= 0)[None, :], other=0.0), axis=0)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(sq / K + rms_eps))
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    z_pre = pre * rstd[:, None] * s0 + tl.load(base_ptr + i)[None, :]
    z_post = post * rstd[:, None] * s1 + tl.load(base_ptr + HC + i)[None, :]
    z = comb * rstd[:, None, None] * s2 + tl.load(base_ptr + 2 * HC + jk)[None, :, :]
    pre = _sigmoid(z_pre) + hc_eps
    post = _sigmoid(z_post) * post_mult
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    c = e / tl.sum(e, axis=2)[:, :, None] + hc_eps  # softmax over k, then + eps
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)  # columns (sum over j)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    m2 = live[:, None] & (i >= 0)[None, :]
    tl.store(pre_ptr + t[:, None] * HC + i[None, :], pre, mask=m2)
    tl.store(post_ptr + t[:, None] * HC + i[None, :], post, mask=m2)
    tl.store(
        comb_ptr + t[:, None, None] * (HC * HC) + jk[None, :, :], c, mask=live[:, None, None] & (jk >= 0)
    )


def hc_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.mhc.hc_mix``: fp32 ``pre [T, hc]``, ``post [T, hc]``, ``comb [T, hc, hc]``. ``streams``
    may be a view with any stream stride (e.g. 0: ``broadcast_streams``) where ``D`` is a multiple of
    the projection's K step; other layouts are copied first."""
    T, hc, D = streams.shape
    K = hc * D
    N = hc * (hc + 2)
    if fn.shape != (N, K) or fn.dtype != torch.float32:
        raise ValueError(f"fn must be fp32 [{N}, {K}], got {tuple(fn.shape)} {fn.dtype}")
    if hc & (hc - 1) or sinkhorn_iters < 1:
        raise ValueError(f"hc must be a power of two and sinkhorn_iters >= 1 (got {hc}, {sinkhorn_iters})")
    if streams.stride(2) != 1 or (streams.stride(1) != D and D % _MIX_BK):
        streams = streams.contiguous()
    fn = fn.contiguous()
    dev = streams.device
    NP = max(16, triton.next_power_of_2(N))
    splits = triton.cdiv(K, MIX_CHUNK)
    rows, warps = mix_tile(T)
    t_blocks = triton.cdiv(max(T, 1), rows)
    T_pad = t_blocks * rows
    part = torch.empty(splits, T_pad, NP, dtype=torch.float32, device=dev)
    sq = torch.empty(splits, T_pad, dtype=torch.float32, device=dev)
    pre = torch.empty(T, hc, dtype=torch.float32, device=dev)
    post = torch.empty(T, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(T, hc, hc, dtype=torch.float32, device=dev)
    if T == 0:
        return pre, post, comb
    _hc_mix_partial_kernel[(t_blocks, splits)](
        streams,
        fn,
        part,
        sq,
        T,
        K,
        N,
        D,
        streams.stride(0),
        streams.stride(1),
        CHUNK=MIX_CHUNK,
        ROWS=rows,
        BK=_MIX_BK,
        NP=NP,
        BF16_X=streams.dtype == torch.bfloat16,
        F32_DOT=_INTERPRET,
        num_warps=warps,
        **pdl_args(streams.device),
    )
    _hc_mix_split_kernel[(triton.cdiv(T, _SPLIT_ROWS),)](
        part,
        sq,
        base.float().contiguous(),
        scale.float().contiguous(),
        pre,
        post,
        comb,
        T,
        T_pad,
        K,
        rms_eps,
        hc_eps,
        post_mult,
        ITERS=sinkhorn_iters,
        HC=hc,
        NP=NP,
        ROWS=_SPLIT_ROWS,
        SC=_SPLIT_SUM,
        SPLITS=splits,
        num_warps=_SPLIT_WARPS,
        **pdl_args(part.device),
    )
    return pre, post, comb


@triton.jit
def _hc_collapse_norm_kernel(
    s_ptr,
    pre_ptr,
    w_ptr,
    out_ptr,
    D,
    s_stride_t,
    s_stride_i,
    eps,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PRE: tl.constexpr,  # False: one stream, no weights (a plain RMSNorm of s[t, 0])
    PDL: tl.constexpr,
):
    """``out[t] = rms_norm(round(sum_i pre[t, i] * s[t, i]), w)`` for one token."""
    grid_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = d < D
    if PRE:
        y = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for i in tl.static_range(HC):
            p = tl.load(pre_ptr + t * HC + i)
            y += tl.load(s_ptr + t * s_stride_t + i * s_stride_i + d, mask=m, other=0.0).to(tl.float32) * p
        y = _narrow(y, OUT_BF16)  # the collapse is rounded before the norm
    else:
        y = tl.load(s_ptr + t * s_stride_t + d, mask=m, other=0.0).to(tl.float32)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(y * y, axis=0) / D + eps))
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, _narrow(y * rstd * w, OUT_BF16).to(out_ptr.dtype.element_ty), mask=m)


def _collapse_norm(streams: torch.Tensor, pre: torch.Tensor | None, weight: torch.Tensor, eps: float):
    T, hc, D = streams.shape
    if streams.stride(2) != 1:
        streams = streams.contiguous()
    out = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T:
        block = triton.next_power_of_2(D)
        _hc_collapse_norm_kernel[(T,)](
            streams,
            streams if pre is None else pre.float().contiguous(),
            weight.contiguous(),
            out,
            D,
            streams.stride(0),
            streams.stride(1),
            eps,
            HC=hc,
            BLOCK_D=block,
            OUT_BF16=streams.dtype == torch.bfloat16,
            PRE=pre is not None,
            num_warps=min(16, max(4, block // 512)),
            **pdl_args(streams.device),
        )
    return out


def hc_collapse_norm(
    streams: torch.Tensor, pre: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``rms_norm(hc_collapse(streams, pre), weight, eps)`` -> ``[T, D]`` in ``streams.dtype``."""
    return _collapse_norm(streams, pre, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.norm.rms_norm`` of ``x [..., D]`` with a weight (one program per row)."""
    D = x.shape[-1]
    rows = x.reshape(-1, 1, D)
    return _collapse_norm(rows, None, weight, eps).view(x.shape)


@triton.jit
def _hc_expand_kernel(
    y_ptr,
    s_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    D,
    s_stride_t,
    s_stride_j,
    y_stride_t,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * s[t, j]`` on one column block."""
    grid_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    k = tl.arange(0, HC)
    acc = tl.zeros((HC, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(HC):
        sj = tl.load(s_ptr + t * s_stride_t + j * s_stride_j + d, mask=m, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * HC * HC + j * HC + k)
        acc += cj[:, None] * sj[None, :]
    y = tl.load(y_ptr + t * y_stride_t + d, mask=m, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * HC + k)
    out = post[:, None] * y[None, :] + acc
    mask = (k >= 0)[:, None] & m[None, :]
    o = out_ptr + t * HC * D + k[:, None] * D + d[None, :]
    tl.store(o, _narrow(out, OUT_BF16).to(out_ptr.dtype.element_ty), mask=mask)


def hc_expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``ops.mhc.hc_expand``: new streams ``[T, hc, D]`` (contiguous) in ``streams.dtype``; the old
    ``streams`` are read through their strides (a stream stride of 0 included)."""
    T, hc, D = streams.shape
    if streams.stride(2) != 1:
        streams = streams.contiguous()
    if y.stride(-1) != 1:
        y = y.contiguous()
    out = torch.empty(T, hc, D, dtype=streams.dtype, device=streams.device)
    if T:
        block = 1024
        _hc_expand_kernel[(T, triton.cdiv(D, block))](
            y,
            streams,
            post.float().contiguous(),
            comb.float().contiguous(),
            out,
            D,
            streams.stride(0),
            streams.stride(1),
            y.stride(0),
            HC=hc,
            BLOCK_D=block,
            OUT_BF16=streams.dtype == torch.bfloat16,
            num_warps=4,
            **pdl_args(y.device),
        )
    return out
