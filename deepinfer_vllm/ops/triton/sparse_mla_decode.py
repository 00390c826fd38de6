"""Sparse MLA decode attention straight from the paged quantised caches.

Each query token attends the ``W`` window keys of its position (MXFP8 records of the layer's window cache)
and, on compressed layers, its top-k entries of the KV source's NVFP4 compressed cache; keys are values
and every head attends the same keys (MQA). Softmax is online, fp32, base 2; the sink starts the running
max/denominator (``m = sink, l = 1``), so it is in the denominator, never in the values, and a token with
no valid key returns exactly zero. Invalid keys (window positions below ``max(window_lo, 0)``, top-k
``-1``) are never read (loads masked to zero bytes, so no NaN from garbage slots; logits ``-inf``).
Dequantisation is exact in bf16. Reference: ``deepinfer_vllm.ops.paged_attention.paged_sparse_attention``.
Why: one program owns one token and up to 64 heads, so the query tile ``[64, D]`` is one wgmma M and each
gathered key tile, dequantised in registers, is used twice (``S = Q K^T``, ``acc += P K``). Small batches
split a token's tiles over ``num_splits`` programs (flash-decoding; a second kernel merges the fp32
partials). On sm90 with bf16 q and D = 512 the wrapper runs the faster Gluon kernel of
``sparse_mla_decode_gluon`` (same operator) unless ``DecodeConfig(gluon=False)``; this kernel covers fp32,
other head dims, other GPUs and the interpreter. ``DecodeConfig`` switches (on by default; ``prefetch``
1): ``split_s`` splits S's key columns over the warpgroups, ``lazy_rescale`` rescales the accumulator
only when a running max grows by over 2^8, ``fast_fp4`` decodes NVFP4 in PTX, ``prefetch`` issues the
compressed tiles' gather chain a tile ahead. Design notes and measurements: benchmarks/README.md.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.e2m1 import e2m1_pairs_f16
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.sparse_mla_decode_gluon import gluon_decode, gluon_decode_supported

__all__ = ["DecodeConfig", "auto_splits", "default_config", "sparse_mla_decode"]

logger = logging.getLogger(__name__)

_LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (no inf - inf)


# --------------------------------------------------------------------------- helpers
@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    """``acc + a @ b``; fp32 operands use IEEE products (the fp32 model and the
    interpreter, whose bf16 dot is not usable: it multiplies the raw bits)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _ue8m0_to_f32(s):
    """UE8M0 bytes -> ``2**(s - 127)`` (byte 0 is the subnormal 2**-127, 255 NaN)."""
    si = s.to(tl.int32)
    bits = tl.where(si == 0, 0x400000, si << 23)
    bits = tl.where(si == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_as_e4m3(c):
    """E2M1 nibble -> the e4m3 byte of ``value / 64`` (exact: the 3 magnitude bits land
    on e4m3's exponent/mantissa boundary; code 1 becomes the e4m3 subnormal 2**-7)."""
    return ((c & 7) << 2) | ((c & 8) << 4)


@triton.jit
def _mxfp8_load(page, off, ok, D: tl.constexpr, N: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Raw bytes of ``BLOCK_N`` MXFP8 records (``page`` = each key's page pointer,
    ``off`` its record index, ``ok`` = read it): values [BLOCK_N, BLOCK_D] (unread 0)
    and UE8M0 scales [BLOCK_N, BLOCK_D / 32] (unread 127 = 1.0)."""
    d = tl.arange(0, BLOCK_D)
    v = tl.load(page[:, None] + (off * D)[:, None] + d[None, :],
                mask=ok[:, None] & (d < D)[None, :], other=0)
    G: tl.constexpr = BLOCK_D // 32
    g = tl.arange(0, G)
    s = tl.load(page[:, None] + N * D + (off * (D // 32))[:, None] + g[None, :],
                mask=ok[:, None] & (g < D // 32)[None, :], other=127)
    return v, s


@triton.jit
def _mxfp8_dequant(v, s, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE_DTYPE: tl.constexpr):
    """MXFP8 bytes from ``_mxfp8_load`` -> ``[BLOCK_N, BLOCK_D]`` (exact in bf16)."""
    G: tl.constexpr = BLOCK_D // 32
    x = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    x = tl.reshape(x, (BLOCK_N, G, 32)) * _ue8m0_to_f32(s)[:, :, None]
    return tl.reshape(x, (BLOCK_N, BLOCK_D)).to(TILE_DTYPE)


@triton.jit
def _mxfp8_tile(page, off, ok, D: tl.constexpr, N: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE_DTYPE: tl.constexpr):
    """Dequantised ``BLOCK_N`` MXFP8 records -> ``[BLOCK_N, BLOCK_D]``; unread = 0."""
    v, s = _mxfp8_load(page, off, ok, D, N, BLOCK_N, BLOCK_D)
    return _mxfp8_dequant(v, s, BLOCK_N, BLOCK_D, TILE_DTYPE)


@triton.jit
def _nvfp4_load(page, off, ok, D: tl.constexpr, N: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Raw bytes of ``BLOCK_N`` NVFP4 records: packed values [BLOCK_N, BLOCK_D / 2]
    and e4m3 scales [BLOCK_N, BLOCK_D / 16]; unread = 0."""
    G: tl.constexpr = BLOCK_D // 16
    j = tl.arange(0, BLOCK_D // 2)
    b = tl.load(page[:, None] + (off * (D // 2))[:, None] + j[None, :],
                mask=ok[:, None] & (j < D // 2)[None, :], other=0)
    g = tl.arange(0, G)
    s = tl.load(page[:, None] + N * (D // 2) + (off * (D // 16))[:, None] + g[None, :],
                mask=ok[:, None] & (g < D // 16)[None, :], other=0)
    return b, s


@triton.jit
def _nvfp4_dequant(b, s, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE_DTYPE: tl.constexpr,
                   FAST_FP4: tl.constexpr):
    """NVFP4 bytes from ``_nvfp4_load`` (even element in the low nibble, one e4m3
    scale per 16 values) -> ``[BLOCK_N, BLOCK_D]``.

    FAST_FP4 (bf16 tiles on the GPU) decodes with the shared PTX of ``ops/triton/e2m1.py``;
    the portable path serves the interpreter and fp32 tiles.
    """
    G: tl.constexpr = BLOCK_D // 16
    if FAST_FP4:
        sc = s.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
        sc = tl.broadcast_to(sc[:, :, None], (BLOCK_N, G, 8))
        # fp16 e2m1 * scale is exact (<= 5 significant bits, in fp16's normal range), and so
        # is its cast to bf16
        lo, hi = e2m1_pairs_f16(tl.reshape(b, (BLOCK_N, G, 8)), sc, True)
        return tl.reshape(tl.join(lo.to(tl.bfloat16), hi.to(tl.bfloat16)), (BLOCK_N, BLOCK_D))
    else:
        lo = _e2m1_as_e4m3(b & 0xF)
        hi = _e2m1_as_e4m3(b >> 4)
        codes = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_D))
        x = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0
        x = tl.reshape(x, (BLOCK_N, G, 16)) * sc[:, :, None]
        return tl.reshape(x, (BLOCK_N, BLOCK_D)).to(TILE_DTYPE)


@triton.jit
def _nvfp4_tile(page, off, ok, D: tl.constexpr, N: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILE_DTYPE: tl.constexpr,
                FAST_FP4: tl.constexpr):
    """Dequantised ``BLOCK_N`` NVFP4 records -> ``[BLOCK_N, BLOCK_D]``; unread = 0."""
    b, s = _nvfp4_load(page, off, ok, D, N, BLOCK_N, BLOCK_D)
    return _nvfp4_dequant(b, s, BLOCK_N, BLOCK_D, TILE_DTYPE, FAST_FP4)


@triton.jit
def _attend(q, k, ok, m_i, l_i, acc, qk_scale, one, DOT_F32: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_S: tl.constexpr,
            LAZY_RESCALE: tl.constexpr):
    """One key tile of the online softmax (base 2; ``qk_scale`` includes log2 e).

    LAZY_RESCALE keeps the running max ``m_i`` until some head's logits exceed it by
    more than 8 (so every ``p <= 2**8``, harmless in fp32 and for a bf16 P), which
    skips rescaling the [BLOCK_H, D] accumulator on almost every tile. ``acc / l``
    is the same quotient either way.
    """
    s = tl.zeros((BLOCK_H, BLOCK_N), tl.float32)
    if SPLIT_S:
        # Behind an (always taken) runtime branch the compiler does not see that S
        # feeds the PV dot, so it splits S's key columns over the warpgroups
        # instead of having every warpgroup compute all of S.
        if one > 0:
            s = _mma(q, tl.trans(k), s, DOT_F32)
    else:
        s = _mma(q, tl.trans(k), s, DOT_F32)
    s = s * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY_RESCALE:
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
    else:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = _mma(p.to(k.dtype), k, acc, DOT_F32)
    return m_i, l_i, acc


# Prefetch helpers: what crosses loop iterations is int32 vectors (block numbers,
# top-k entries) and raw record bytes; page pointers are recomputed where used.
@triton.jit
def _window_keys(i, i_end, base, lo, n, W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Window tile ``i``: key positions (0 where unread) and which are read (none for
    tiles >= ``i_end``)."""
    j = i * BLOCK_N + n
    kp = base + j
    ok = (j < W) & (kp >= lo) & (j < i_end * BLOCK_N)  # the last clause: i < i_end
    return tl.where(ok, kp, 0), ok


@triton.jit
def _topk_tile(topk_row_ptr, i, i_end, NW: tl.constexpr, n, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Top-k entries of key tile ``i`` (after the NW window tiles); -1 past the list / tile end."""
    j = (i - NW) * BLOCK_N + n
    ok = (j < K) & (j < (i_end - NW) * BLOCK_N)  # the last clause: i < i_end
    return tl.load(topk_row_ptr + j, mask=ok, other=-1).to(tl.int32)


@triton.jit
def _comp_blocks(e, c_bt_row_ptr, RATIO: tl.constexpr, C_BS: tl.constexpr):
    ok = e >= 0
    return tl.load(c_bt_row_ptr + (tl.where(ok, e, 0) * RATIO) // C_BS, mask=ok, other=0)


@triton.jit
def _comp_load(e, blk, c_cache_ptr, c_block_stride, D: tl.constexpr, RATIO: tl.constexpr,
               C_BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    ok = e >= 0
    off = ((tl.where(ok, e, 0) * RATIO) % C_BS) // RATIO
    page = c_cache_ptr + blk.to(tl.int64) * c_block_stride
    return _nvfp4_load(page, off, ok, D, C_BS // RATIO, BLOCK_N, BLOCK_D)


# --------------------------------------------------------------------------- kernels
# ``one`` (always 1) must stay a runtime value: Triton turns integer arguments equal
# to 1 into constants, which would fold the branch that SPLIT_S relies on.
@triton.jit(do_not_specialize=["one", "T", "num_splits"])
def _sparse_mla_decode_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, stride_ot, stride_oh,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    sink_ptr, pos_ptr, lo_ptr, req_ptr,
    w_cache_ptr, w_block_stride, w_bt_ptr, w_bt_stride,
    c_cache_ptr, c_block_stride, c_bt_ptr, c_bt_stride,
    topk_ptr, topk_stride,
    T, H, qk_scale, sink_scale, one, num_splits,
    D: tl.constexpr, W: tl.constexpr, W_BS: tl.constexpr,
    K: tl.constexpr, C_BS: tl.constexpr, RATIO: tl.constexpr,
    NW: tl.constexpr, NT: tl.constexpr,
    HAS_COMP: tl.constexpr, HAS_SINK: tl.constexpr,
    BLOCK_H: tl.constexpr, H_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr, TILE_DTYPE: tl.constexpr, DOT_F32: tl.constexpr,
    SPLIT_S: tl.constexpr, LAZY_RESCALE: tl.constexpr, FAST_FP4: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    t = tl.program_id(0)
    split = tl.program_id(1)

    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < H
    dmask = d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(TILE_DTYPE)

    # Running max / denominator; split 0 starts from the sink (denominator only).
    first = split == 0
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32) * sink_scale
        m_i = tl.where(first, sink, NEG_BIG)
        l_i = tl.where(first, tl.full((BLOCK_H,), 1.0, tl.float32), 0.0)
    else:
        m_i = tl.full((BLOCK_H,), NEG_BIG, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)

    pos = tl.load(pos_ptr + t).to(tl.int32)
    lo = tl.maximum(tl.load(lo_ptr + t).to(tl.int32), 0)
    req = tl.load(req_ptr + t).to(tl.int64)

    # Key tiles: NW window tiles, then the top-k tiles (NT in all); a split takes a slice.
    if PARTIAL:
        t0 = (split * NT) // num_splits
        t1 = ((split + 1) * NT) // num_splits
    else:
        t0 = 0
        t1 = NT
    n = tl.arange(0, BLOCK_N)

    # ---- window keys: positions pos-W+1+j, valid iff >= lo
    base = pos - (W - 1)
    w_first = tl.maximum(lo - base, 0) // BLOCK_N  # tiles before this hold no valid key
    w_bt_row = w_bt_ptr + req * w_bt_stride
    c_bt_row = c_bt_ptr + req * c_bt_stride
    topk_row = topk_ptr + t.to(tl.int64) * topk_stride
    c0 = tl.maximum(t0, NW)
    i0 = tl.maximum(t0, w_first)
    i1 = tl.minimum(t1, NW)
    # PREFETCH (software pipeline in registers, see DecodeConfig.prefetch): before
    # compressed tile i's dots go out the loads of tile i+1's block-table words and
    # tile i+2's top-k entries (1), and tile i+1's record bytes (2), so the links of
    # the dependent gather chain hide behind a tile of math instead of stalling it.
    # 3 also issues the first compressed tiles' index loads before the window tiles.
    if HAS_COMP and PREFETCH >= 3:
        e_b = _topk_tile(topk_row, c0, t1, NW, n, K, BLOCK_N)
        e_c = _topk_tile(topk_row, c0 + 1, t1, NW, n, K, BLOCK_N)
        e_d = _topk_tile(topk_row, c0 + 2, t1, NW, n, K, BLOCK_N)
        cblk_b = _comp_blocks(e_b, c_bt_row, RATIO, C_BS)
        cblk_c = _comp_blocks(e_c, c_bt_row, RATIO, C_BS)
    for i in range(i0, i1):
        kp, ok = _window_keys(i, i1, base, lo, n, W, BLOCK_N)
        blk = tl.load(w_bt_row + kp // W_BS, mask=ok, other=0)
        page = w_cache_ptr + blk.to(tl.int64) * w_block_stride
        k = _mxfp8_tile(page, kp % W_BS, ok, D, W_BS, BLOCK_N, BLOCK_D, TILE_DTYPE)
        m_i, l_i, acc = _attend(q, k, ok, m_i, l_i, acc, qk_scale, one,
                                DOT_F32, BLOCK_H, BLOCK_N, SPLIT_S, LAZY_RESCALE)

    # ---- compressed keys: entries topk[t, j] (-1 = none)
    if HAS_COMP:
        if PREFETCH == 1:
            e_b = _topk_tile(topk_row, c0, t1, NW, n, K, BLOCK_N)
            e_c = _topk_tile(topk_row, c0 + 1, t1, NW, n, K, BLOCK_N)
            cblk_b = _comp_blocks(e_b, c_bt_row, RATIO, C_BS)
            for i in range(c0, t1):
                cb, cs = _comp_load(e_b, cblk_b, c_cache_ptr, c_block_stride, D, RATIO, C_BS,
                                    BLOCK_N, BLOCK_D)
                ok = e_b >= 0
                e_b = e_c
                cblk_b = _comp_blocks(e_c, c_bt_row, RATIO, C_BS)
                e_c = _topk_tile(topk_row, i + 2, t1, NW, n, K, BLOCK_N)
                k = _nvfp4_dequant(cb, cs, BLOCK_N, BLOCK_D, TILE_DTYPE, FAST_FP4)
                m_i, l_i, acc = _attend(q, k, ok, m_i, l_i, acc, qk_scale, one,
                                        DOT_F32, BLOCK_H, BLOCK_N, SPLIT_S, LAZY_RESCALE)
        elif PREFETCH >= 2:
            if PREFETCH == 2:
                e_b = _topk_tile(topk_row, c0, t1, NW, n, K, BLOCK_N)
                e_c = _topk_tile(topk_row, c0 + 1, t1, NW, n, K, BLOCK_N)
                e_d = _topk_tile(topk_row, c0 + 2, t1, NW, n, K, BLOCK_N)
                cblk_b = _comp_blocks(e_b, c_bt_row, RATIO, C_BS)
                cblk_c = _comp_blocks(e_c, c_bt_row, RATIO, C_BS)
            cb, cs = _comp_load(e_b, cblk_b, c_cache_ptr, c_block_stride, D, RATIO, C_BS,
                                BLOCK_N, BLOCK_D)
            for i in range(c0, t1):
                # the key mask is re-read (an L1/L2 hit) rather than carried: carried,
                # the compiler keeps copies in the S and P register layouts too
                ok = _topk_tile(topk_row, i, t1, NW, n, K, BLOCK_N) >= 0
                k = _nvfp4_dequant(cb, cs, BLOCK_N, BLOCK_D, TILE_DTYPE, FAST_FP4)
                cb, cs = _comp_load(e_c, cblk_c, c_cache_ptr, c_block_stride, D, RATIO, C_BS,
                                    BLOCK_N, BLOCK_D)
                e_c = e_d
                cblk_c = _comp_blocks(e_d, c_bt_row, RATIO, C_BS)
                e_d = _topk_tile(topk_row, i + 3, t1, NW, n, K, BLOCK_N)
                m_i, l_i, acc = _attend(q, k, ok, m_i, l_i, acc, qk_scale, one,
                                        DOT_F32, BLOCK_H, BLOCK_N, SPLIT_S, LAZY_RESCALE)
        else:
            for i in range(c0, t1):
                e = _topk_tile(topk_row, i, t1, NW, n, K, BLOCK_N)
                ok = e >= 0
                first_pos = tl.where(ok, e, 0) * RATIO
                blk = tl.load(c_bt_row + first_pos // C_BS, mask=ok, other=0)
                page = c_cache_ptr + blk.to(tl.int64) * c_block_stride
                off = (first_pos % C_BS) // RATIO
                k = _nvfp4_tile(page, off, ok, D, C_BS // RATIO, BLOCK_N, BLOCK_D, TILE_DTYPE, FAST_FP4)
                m_i, l_i, acc = _attend(q, k, ok, m_i, l_i, acc, qk_scale, one,
                                        DOT_F32, BLOCK_H, BLOCK_N, SPLIT_S, LAZY_RESCALE)

    if not PARTIAL:
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])
    else:
        row = (split.to(tl.int64) * T + t) * H_PAD + h
        tl.store(part_m_ptr + row, m_i)
        tl.store(part_l_ptr + row, l_i)
        tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit(do_not_specialize=["T"])
def _combine_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr,
    out_ptr, stride_ot, stride_oh,
    T, H,
    SPLITS: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr,
    H_PAD: tl.constexpr, CHUNK_H: tl.constexpr, CHUNK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge the ``SPLITS`` partial (m, l, acc) of one token's ``CHUNK_H x CHUNK_D`` piece.

    The split loop is unrolled (``SPLITS`` is a compile-time constant), so every split's
    loads are in flight together: the merge is one memory round trip, not one per split. One
    compiled variant per split count (``auto_splits`` gives a handful)."""
    grid_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1) * CHUNK_H + tl.arange(0, CHUNK_H)
    d = tl.program_id(2) * CHUNK_D + tl.arange(0, CHUNK_D)
    h_ok = h < H
    mask = h_ok[:, None] & (d < D)[None, :]
    m = tl.full((CHUNK_H,), NEG_BIG, tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + (s * T + t).to(tl.int64) * H_PAD + h, mask=h_ok,
                                  other=NEG_BIG))
    lsum = tl.zeros((CHUNK_H,), tl.float32)
    acc = tl.zeros((CHUNK_H, CHUNK_D), tl.float32)
    for s in tl.static_range(SPLITS):
        row = (s * T + t).to(tl.int64) * H_PAD + h
        w = tl.exp2(tl.load(part_m_ptr + row, mask=h_ok, other=NEG_BIG) - m)
        lsum += w * tl.load(part_l_ptr + row, mask=h_ok, other=0.0)
        acc += w[:, None] * tl.load(part_acc_ptr + row[:, None] * ROW + d[None, :], mask=mask, other=0.0)
    lsum = tl.where(lsum > 0, lsum, 1.0)
    o = acc / lsum[:, None]
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- wrapper
@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters (tuned on the GPU by ``benchmarks/gpu/sparse_mla_decode.py``).

    ``block_n`` keys per tile, ``block_h`` most heads per program (64 fill a wgmma's M);
    ``num_stages`` > 1 lets Triton stage record bytes through shared memory with
    cp.async (it issues them only one iteration ahead, after the dots, so most of
    the gather latency stays exposed; 3 measured best on the H200);
    ``num_splits`` 0 = pick from the batch size (``auto_splits``);
    ``split_s`` / ``lazy_rescale`` / ``fast_fp4``: see ``_attend`` and ``_nvfp4_dequant``
    (switches kept so the benchmark can measure each of them);
    ``prefetch`` pipelines the compressed keys' gather chain (top-k entry -> block
    table -> record bytes) in registers, a tile ahead: 0 off, 1 the index loads only,
    2 also the record bytes, 3 as 2 with the first tiles' index loads issued before
    the window tiles. Costs registers (sm90 offline: spills ~0.5 KB -> 0.7-0.9 KB).
    ``gluon``: the warp-specialised sm90 kernel of ``sparse_mla_decode_gluon`` (bf16, D = 512;
    64-key tiles, 64 heads per work item; of the rest only ``num_splits`` applies to it). None
    = use it where supported, True = require it, False = never. ``programs``: its persistent
    CTAs (0 = one per SM; fewer make each take more work items, which the tests use).
    Measured on the H200 (Triton 3.6): prefetch 1 is fastest at 64-256 tokens
    (T=256: 123 us vs 129 us without); 2 and 3 lose to their extra spills.
    """

    block_n: int = 64
    block_h: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_splits: int = 0
    split_s: bool = True
    lazy_rescale: bool = True
    fast_fp4: bool = True
    prefetch: int = 1
    gluon: bool | None = None
    programs: int = 0


# fp32 queries take the FMA path (IEEE products, operands in registers): small head and
# key tiles keep it compilable in seconds (64 x 64 tiles spill tens of KB and overflow SMEM).
_FP32_CONFIG = DecodeConfig(block_n=16, block_h=16, num_warps=8, num_stages=1)


def default_config(dtype: torch.dtype) -> DecodeConfig:
    return _FP32_CONFIG if dtype == torch.float32 else DecodeConfig()


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_splits(num_tokens: int, num_tiles: int, device: torch.device) -> int:
    """One program per token once the batch fills the GPU; below that, split each
    token's key tiles so that about one wave of programs runs."""
    return max(1, min(num_tiles, _num_sms(device) // max(num_tokens, 1)))


def _check_cache(name: str, cache: torch.Tensor, record: int, device: torch.device) -> tuple[int, int]:
    """-> (records per page, block stride in bytes) of a ``[B, 1, N, R]`` / ``[B, N, R]`` cache."""
    if cache.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8, got {cache.dtype}")
    if cache.device != device:
        raise ValueError(f"{name} is on {cache.device}, q on {device}")
    if cache.dim() == 4:
        if cache.shape[1] != 1:
            raise ValueError(f"{name} [B, 1, N, R] needs dim 1 == 1, got {tuple(cache.shape)}")
        cache = cache[:, 0]
    if cache.dim() != 3:
        raise ValueError(f"{name} must be [B, 1, N, R] or [B, N, R], got {tuple(cache.shape)}")
    if cache.shape[-1] != record:
        raise ValueError(f"{name} records are {cache.shape[-1]} bytes, expected {record}")
    if cache.stride(-1) != 1 or cache.stride(-2) != record:
        raise ValueError(f"{name} pages must be contiguous inside (strides {cache.stride()})")
    return int(cache.shape[1]), int(cache.stride(0))


def _check_index(name: str, x: torch.Tensor, dims: int, device: torch.device) -> None:
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {x.dtype}")
    if x.dim() != dims or x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {dims}-d with a unit last stride, got {tuple(x.shape)} {x.stride()}"
        )
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, q on {device}")


def sparse_mla_decode(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_block_table: torch.Tensor,
    window_block_size: int,
    positions: torch.Tensor,
    window_lo: torch.Tensor,
    token_req: torch.Tensor,
    window: int,
    sink: torch.Tensor | None,
    scale: float,
    comp_cache: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    comp_ratio: int | None = None,
    topk: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]`` attends its window (+ top-k compressed) keys read from the paged
    caches -> ``[T, H, D]`` in ``q.dtype`` (bf16 or fp32).

    ``window_cache``: the layer's MXFP8 window cache ``[B, 1, block_size, D + D/32]``;
    ``window_block_table [R, *]`` per request row; token ``t`` is request ``token_req[t]`` at
    ``positions[t]``, sees positions ``>= max(window_lo[t], 0)`` of its last ``window``.
    ``comp_cache``: the KV source's NVFP4 cache ``[B, 1, block_size / ratio, D/2 + D/16]``,
    ``topk [T, K]`` its entries (-1 = none). ``sink [H]`` fp32 logits (denominator only).
    Semantics: ``paged_sparse_attention``. ``out`` (optional, ``[T, H, D]`` of q's dtype,
    unit last stride) receives the result; ``config`` overrides the launch parameters.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"q must be bfloat16 or float32, got {q.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a unit stride on its last dim")
    T, H, D = q.shape
    if D % 64 or D <= 0:
        raise ValueError(f"head dim {D} must be a positive multiple of 64")
    dev = q.device
    w_n, w_stride = _check_cache("window_cache", window_cache, D + D // 32, dev)
    if w_n != window_block_size:
        raise ValueError(f"window_cache holds {w_n} records per page, block size is {window_block_size}")
    _check_index("window_block_table", window_block_table, 2, dev)
    for name, x in (("positions", positions), ("window_lo", window_lo), ("token_req", token_req)):
        _check_index(name, x, 1, dev)
        if x.shape[0] != T:
            raise ValueError(f"{name} has {x.shape[0]} entries for {T} tokens")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if sink is not None:
        if sink.shape != (H,) or sink.dtype != torch.float32 or sink.device != dev:
            raise ValueError(f"sink must be float32 [{H}] on {dev}, got {sink.dtype} {tuple(sink.shape)}")
        sink = sink.contiguous()

    has_comp = topk is not None
    if has_comp:
        if comp_cache is None or comp_block_table is None or comp_block_size is None or comp_ratio is None:
            raise ValueError("topk needs comp_cache, comp_block_table, comp_block_size and comp_ratio")
        if comp_ratio < 1 or comp_block_size % comp_ratio:
            raise ValueError(
                f"comp_block_size {comp_block_size} must be a multiple of comp_ratio {comp_ratio}"
            )
        c_n, c_stride = _check_cache("comp_cache", comp_cache, D // 2 + D // 16, dev)
        if c_n != comp_block_size // comp_ratio:
            raise ValueError(
                f"comp_cache holds {c_n} records per page, expected {comp_block_size} / {comp_ratio}"
            )
        _check_index("comp_block_table", comp_block_table, 2, dev)
        _check_index("topk", topk, 2, dev)
        if topk.shape[0] != T:
            raise ValueError(f"topk has {topk.shape[0]} rows for {T} tokens")
        K = int(topk.shape[1])
    else:
        comp_cache, comp_block_table, topk = window_cache, window_block_table, positions
        c_stride, comp_block_size, comp_ratio, K = 0, 1, 1, 0

    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != dev or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {dev} with a unit last stride, "
            f"got {tuple(out.shape)} {out.dtype} {out.device} {out.stride()}"
        )
    if T == 0:
        return out

    cfg = config or default_config(q.dtype)
    ops = _Operands(q, out, sink, positions, window_lo, token_req, window_cache, w_stride, window_block_table,
                    window_block_size, window, comp_cache, c_stride, comp_block_table, comp_block_size,
                    comp_ratio, topk, K, has_comp, float(scale))
    # A config the GPU cannot hold (shared memory) falls back to smaller ones, once.
    for attempt in _fallbacks(cfg):
        key = (attempt, q.dtype, D, min(H, attempt.block_h), has_comp, dev.index)
        if key in _TOO_BIG:
            continue
        try:
            _launch(ops, attempt)
            return out
        except triton.runtime.errors.OutOfResources:
            _TOO_BIG.add(key)
    raise RuntimeError(f"no launch config of sparse_mla_decode fits this GPU (tried from {cfg})")


_TOO_BIG: set = set()


def _fallbacks(cfg: DecodeConfig) -> list[DecodeConfig]:
    out = [cfg]
    if cfg.num_stages > 1:
        out.append(replace(cfg, num_stages=1))
    if cfg.block_n > 32:
        out.append(replace(cfg, num_stages=1, block_n=32))
    return out


@dataclass
class _Operands:
    q: torch.Tensor
    out: torch.Tensor
    sink: torch.Tensor | None
    positions: torch.Tensor
    window_lo: torch.Tensor
    token_req: torch.Tensor
    window_cache: torch.Tensor
    w_stride: int
    window_block_table: torch.Tensor
    window_block_size: int
    window: int
    comp_cache: torch.Tensor
    c_stride: int
    comp_block_table: torch.Tensor
    comp_block_size: int
    comp_ratio: int
    topk: torch.Tensor
    K: int
    has_comp: bool
    scale: float


def _launch(o: _Operands, cfg: DecodeConfig) -> None:
    q, out = o.q, o.out
    T, H, D = q.shape
    dev = q.device
    if _use_gluon(o, cfg):
        try:
            _launch_gluon(o, cfg)
            return
        except Exception as exc:  # a Triton without a working Gluon for this device
            if cfg.gluon:
                raise
            _GLUON_BROKEN.add(dev.index)
            logger.warning("sparse_mla_decode: the Gluon kernel failed (%s); using the Triton kernel", exc)
    # one program per (token, split, block of heads); 16 rows are tl.dot's minimum
    block_h = min(max(16, cfg.block_h), max(16, triton.next_power_of_2(H)))
    head_blocks = triton.cdiv(H, block_h)
    h_pad = head_blocks * block_h
    block_d = triton.next_power_of_2(D)
    window_tiles = triton.cdiv(o.window, cfg.block_n)
    num_tiles = window_tiles + (triton.cdiv(o.K, cfg.block_n) if o.has_comp else 0)
    splits = cfg.num_splits or auto_splits(T, num_tiles, dev)
    splits = max(1, min(splits, num_tiles))

    if splits > 1:
        part_acc = torch.empty(splits, T, h_pad, block_d, dtype=torch.float32, device=dev)
        part_m = torch.empty(splits, T, h_pad, dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    interpret = dev.type != "cuda"
    tile_dtype = tl.float32 if q.dtype == torch.float32 else tl.bfloat16
    _sparse_mla_decode_kernel[(T, splits, head_blocks)](
        q, q.stride(0), q.stride(1),
        out, out.stride(0), out.stride(1),
        part_acc, part_m, part_l,
        o.sink if o.sink is not None else q, o.positions, o.window_lo, o.token_req,
        o.window_cache, o.w_stride, o.window_block_table, o.window_block_table.stride(0),
        o.comp_cache, o.c_stride, o.comp_block_table, o.comp_block_table.stride(0),
        o.topk, o.topk.stride(0),
        T, H, o.scale * _LOG2E, _LOG2E, 1, splits,
        D=D, W=o.window, W_BS=o.window_block_size,
        K=o.K, C_BS=o.comp_block_size, RATIO=o.comp_ratio,
        NW=window_tiles, NT=num_tiles,
        HAS_COMP=o.has_comp, HAS_SINK=o.sink is not None,
        BLOCK_H=block_h, H_PAD=h_pad, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        PARTIAL=splits > 1, TILE_DTYPE=tile_dtype, DOT_F32=(q.dtype == torch.float32 or interpret),
        SPLIT_S=cfg.split_s, LAZY_RESCALE=cfg.lazy_rescale,
        FAST_FP4=cfg.fast_fp4 and not interpret and q.dtype == torch.bfloat16,
        PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(q.device),
    )
    if splits > 1:
        _combine(part_acc, part_m, part_l, out, splits, h_pad, block_d)


def _combine(part_acc, part_m, part_l, out, splits: int, h_pad: int, block_d: int) -> None:
    """Merge the flash-decoding partials (m, l, acc per split; rows ``block_d`` floats apart)
    into ``out``. Split launches are the small batches, so the merge is cut into pieces of
    256-2048 outputs, aiming at ~512 programs: at T=1 a few large programs would each wait on
    ``splits`` round trips (the whole T=1 decode: 24.5 -> 12-13 us on the H200)."""
    T, H, D = out.shape
    chunk_d = min(128, triton.next_power_of_2(D))
    total = T * h_pad * chunk_d * triton.cdiv(D, chunk_d)
    piece = max(256, min(2048, _prev_power_of_2(total // 512)))
    chunk_h = max(1, min(16, piece // chunk_d))
    _combine_kernel[(T, h_pad // chunk_h, triton.cdiv(D, chunk_d))](
        part_acc, part_m, part_l,
        out, out.stride(0), out.stride(1),
        T, H,
        SPLITS=splits, D=D, ROW=block_d, H_PAD=h_pad, CHUNK_H=chunk_h, CHUNK_D=chunk_d,
        num_warps=max(1, min(8, chunk_h * chunk_d // 256)),
        **pdl_args(part_acc.device),
    )


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


_GLUON_BROKEN: set = set()


def _use_gluon(o: _Operands, cfg: DecodeConfig) -> bool:
    if cfg.gluon is False or (cfg.gluon is None and o.q.device.index in _GLUON_BROKEN):
        return False
    caches = [o.window_cache] + ([o.comp_cache] if o.has_comp else [])
    ok = gluon_decode_supported(o.q, caches)
    if cfg.gluon and not ok:
        raise ValueError("DecodeConfig(gluon=True) needs sm90, bf16 q, D = 512, 16-byte aligned "
                         "pages and Triton's Gluon")
    return ok


def _launch_gluon(o: _Operands, cfg: DecodeConfig) -> None:
    """The warp-specialised kernel (64-key tiles, 64 heads per program) + the same combine."""
    q = o.q
    T, H, D = q.shape
    h_pad = triton.cdiv(H, 64) * 64
    num_tiles = triton.cdiv(o.window, 64) + (triton.cdiv(o.K, 64) if o.has_comp else 0)
    splits = cfg.num_splits or auto_splits(T * (h_pad // 64), num_tiles, q.device)
    splits = max(1, min(splits, num_tiles))
    if splits > 1:
        part_acc = torch.empty(splits, T, h_pad, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(splits, T, h_pad, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = o.out  # unused
    gluon_decode(o, splits, part_acc, part_m, part_l, h_pad, programs=cfg.programs or None)
    if splits > 1:
        _combine(part_acc, part_m, part_l, o.out, splits, h_pad, D)
