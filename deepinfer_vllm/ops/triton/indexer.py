"""Lightning-indexer scores over the paged MXFP4 index cache, and the end-to-end selection.

``I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])`` for ``j < visible[t]`` (else -inf); ``k[j]`` is the MXFP4
record (64 packed bytes + 4 UE8M0 scales) of entry ``j`` of request ``token_req[t]`` (page ``j // N``, slot
``j % N``, ``N = block_size // ratio``; a page holds its N records' value bytes, then their scale bytes).
``q`` must hold MXFP4-dequantised values (``mxfp4_qdq``); scores are fp32 sums rounded once to the model
dtype, returned as fp32. PyTorch reference: ``ops.paged_indexer``. Keys are decoded in registers and
scored as ``S^T = K Q^T`` (M = keys); the kernel is bound by instruction issue, much of it that decode, so
the decodes (``mode``) differ in how cheaply they decode:
* 5 (default on sm90 with Gluon, for every launch: scores never depend on batching): fp8 wgmma on exact
  e4m3 operands (``indexer_gluon``; blocks over 14 binades below a key's largest round). Its sums keep ~13
  bits: error up to ~2^-14 of ``sum_h |w_h| sum_k |q_hk k_jk|`` (1-2 % of bf16 scores one step off the
  fp32-exact sums; top-512 selections agree on >= 99.99 % of indices). If the Gluon kernel fails to
  compile, the launch falls back to mode 3 (recorded once per process).
* 3 (default for bf16/fp16 q off sm90): fp16 wgmma on exactly converted operands (``e2m1.py``; exact down
  to 30 binades below a key's largest block, smaller ones are below fp32 rounding), fp32-exact sums;
  ``i16``: int16 reads.
* 2 (default for fp32 q, the interpreter's path): keys decoded to fp32, two K = 64 IEEE dots.
``prefetch``: 1 (default) loads block ids two tiles ahead and prefetches the next tile into L2 (GPU only),
2 carries the next tile in registers, 0 is the plain loop. Mode 2 decodes a UE8M0 byte of 0 (never written
by the encoder) as garbage and flushes 0.5 * 2^-126 (scale byte 1): both far below a score's rounding.
Design notes and measurements: benchmarks/README.md.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.paged_indexer import check_index_cache
from deepinfer_vllm.ops.triton.e2m1 import e2m1_pairs_f16, e2m1_quads_f16, e2m1_scaled
from deepinfer_vllm.ops.triton.indexer_gluon import gluon_index_scores, gluon_supported
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.topk import candidate_blocks, topk_indices

__all__ = [
    "index_scores_paged",
    "index_scores_paged_sparse",
    "indexer_topk",
]

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Default decode for bf16/fp16 queries off sm90 and default software pipelining (see the
# module docstring).
DEFAULT_MODE = 3
DEFAULT_PREFETCH = 1
# Ring depth of the Gluon kernel on candidate (reindex) tiles: 3 stages ran 2-4 % faster than 4
# there on the H200; dense rows keep 4.
SPARSE_STAGES = 3
# Options that failed to compile on this Triton (recorded once, then skipped): mode 5 (-> 3),
# the register cap, the L2 prefetch PTX.
_FAILED: dict[int | str, bool] = {}


def default_mode(q: torch.Tensor, index_cache: torch.Tensor, page_n: int) -> int:
    """The decode a launch gets without ``mode``: 5 wherever the Gluon kernel runs, for every
    batch size, row length and candidate list alike (so a token's scores never depend on what
    it is batched with; it is also the fastest there), 2 for fp32 queries, 3 elsewhere."""
    if q.dtype == torch.float32:
        return 2
    return 5 if gluon_supported(q, index_cache, page_n) else DEFAULT_MODE


@triton.jit
def _pow2_f16_bits(r):
    """fp16 bits of 2^(6 - r) for r >= 0 (subnormal from r = 21, 0 past r = 30)."""
    sub = 1 << tl.minimum(tl.maximum(30 - r, 0), 30)
    return tl.where(r <= 20, (21 - r) << 10, tl.where(r <= 30, sub, 0))


@triton.jit
def _round_bf16(x):
    """fp32 -> nearest bf16 (ties to even), kept in fp32; integer arithmetic, so it is exact
    everywhere (Triton's interpreter truncates in ``.to(tl.bfloat16)``). NaN stays NaN: the GPU's
    NaN is 0x7FFFFFFF, whose rounding increment would carry into the sign bit (-0.0)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _tile_entries(c, c_end, t, vis, n_cols, cand_ptr, stride_cand, CB: tl.constexpr, SPARSE: tl.constexpr,
                  LIMIT: tl.constexpr):
    """Entry index and visibility of columns ``c`` (sparse: issues the candidate-id load).
    With ``LIMIT``, columns past this program's range (``c >= c_end``) are invisible: never read."""
    if SPARSE:
        cm = c < n_cols
        if LIMIT:
            cm = cm & (c < c_end)
        bid = tl.load(cand_ptr + t * stride_cand + c // CB, mask=cm, other=-1).to(tl.int32)
        j = bid * CB + c % CB
        valid = (bid >= 0) & (j < vis)
    else:
        j = c
        valid = j < vis
        if LIMIT:
            valid = valid & (c < c_end)
    return j, valid


@triton.jit
def _tile_blocks(j, valid, bt_row, PAGE_N: tl.constexpr):
    """Cache block ids of entries ``j`` (issues the block-table load)."""
    return tl.load(bt_row + j // PAGE_N, mask=valid, other=0).to(tl.int64)


@triton.jit
def _tile_load(cache_ptr, stride_blk, blk, j, valid, PAGE_N: tl.constexpr, D: tl.constexpr,
               MODE: tl.constexpr, I16: tl.constexpr):
    """Issue the loads of the records of entries ``j``: packed values ``[BLOCK_N, D / 2]`` and
    scale bytes (``[BLOCK_N, D / 32]`` for mode 3, one per value byte for mode 2)."""
    VB: tl.constexpr = D // 2
    SB: tl.constexpr = D // 32
    vv = tl.arange(0, VB)
    page = cache_ptr + blk * stride_blk
    slot = j % PAGE_N
    vptr = page + slot * VB
    sptr = page + PAGE_N * VB + slot * SB
    if I16:  # int16 words (4 codes each): a thread's wgmma A pair is then 4 contiguous bytes
        ww = tl.arange(0, D // 4)
        vals = tl.load(vptr.to(tl.pointer_type(tl.int16))[:, None] + ww[None, :], mask=valid[:, None], other=0)
    else:
        vals = tl.load(vptr[:, None] + vv[None, :], mask=valid[:, None], other=0)
    if MODE == 3:
        scl = tl.load(sptr[:, None] + tl.arange(0, SB)[None, :], mask=valid[:, None], other=127)
    else:
        scl = tl.load(sptr[:, None] + (vv // 16)[None, :], mask=valid[:, None], other=127)
    return vals, scl


@triton.jit
def _l2_prefetch(cache_ptr, stride_blk, blk, j, valid, PAGE_N: tl.constexpr, D: tl.constexpr):
    """Ask L2 for the value row and scale row of each valid entry (GPU only: inline PTX)."""
    page = cache_ptr + blk * stride_blk
    slot = j % PAGE_N
    vptr = tl.where(valid, page + slot * (D // 2), page)
    sptr = tl.where(valid, page + PAGE_N * (D // 2) + slot * (D // 32), page)
    tl.inline_asm_elementwise(
        "{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p prefetch.global.L2 [$1];\n@p prefetch.global.L2 [$2];\nmov.u32 $0, 0;\n}",
        "=r,l,l,r", [vptr, sptr, valid.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _tile_scores(vals, scl, qe, qo, w, BLOCK_N: tl.constexpr, D: tl.constexpr,
                 MODE: tl.constexpr, ASM: tl.constexpr, I16: tl.constexpr):
    """``sum_h w_h relu(q_h . k)`` of one tile of keys, fp32 ``[BLOCK_N]``."""
    if MODE == 2:
        lo = e2m1_scaled(vals & 15, scl, tl.float32)
        hi = e2m1_scaled(vals >> 4, scl, tl.float32)
        acc = tl.dot(lo, qe, input_precision="ieee") + tl.dot(hi, qo, input_precision="ieee")
    else:
        # Each key relative to its largest block scale: k = 2^(emax - 127) * k', with k' =
        # e2m1 * 2^-(emax - e_b) exact in fp16; that power of two leaves after the head sum.
        e = scl.to(tl.int32)
        emax = tl.max(e, 1)
        fb = _pow2_f16_bits(emax[:, None] - e).to(tl.int16).to(tl.float16, bitcast=True)
        if I16:  # code n of word m is dim 4 m + n; Q^T planes qe = (n = 0, 1), qo = (n = 2, 3)
            f = tl.reshape(tl.broadcast_to(fb[:, :, None], (BLOCK_N, D // 32, 8)), (BLOCK_N, D // 4))
            c0, c1, c2, c3 = e2m1_quads_f16(vals, f, ASM)
            acc = tl.dot(c0, qe[0])
            acc = tl.dot(c1, qe[1], acc)
            acc = tl.dot(c2, qo[0], acc)
            acc = tl.dot(c3, qo[1], acc)
        else:
            f = tl.reshape(tl.broadcast_to(fb[:, :, None], (BLOCK_N, D // 32, 16)), (BLOCK_N, D // 2))
            lo, hi = e2m1_pairs_f16(vals, f, ASM)
            acc = tl.dot(lo, qe)
            acc = tl.dot(hi, qo, acc)
        rowscale = tl.where(emax > 0, emax << 23, 1 << 22).to(tl.float32, bitcast=True)
        return tl.sum(tl.maximum(acc, 0.0) * w[None, :], 1) * rowscale
    return tl.sum(tl.maximum(acc, 0.0) * w[None, :], 1)


@triton.jit
def _store_scores(out_row, c, score, valid, n_cols, ROUND: tl.constexpr):
    if ROUND == 1:
        score = _round_bf16(score)
    elif ROUND == 2:
        score = score.to(tl.float16).to(tl.float32)
    score = tl.where(valid, score, float("-inf"))
    tl.store(out_row + c, score, mask=c < n_cols)


@triton.jit
def _index_scores_kernel(
    q_ptr, stride_qt, stride_qh,
    w_ptr, stride_wt,
    cache_ptr, stride_blk,
    bt_ptr, stride_bt,
    req_ptr, vis_ptr,
    cand_ptr, stride_cand,
    out_ptr, stride_out, n_cols,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, PAGE_N: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, CB: tl.constexpr,
    SPARSE: tl.constexpr, ROUND: tl.constexpr, MODE: tl.constexpr,
    PREFETCH: tl.constexpr, L2PF: tl.constexpr, ASM: tl.constexpr, I16: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    VB: tl.constexpr = D // 2  # packed value bytes per record
    pid = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    vis = tl.load(vis_ptr + t).to(tl.int32)
    out_row = out_ptr + t * stride_out
    c_first = pid * (TILES * BLOCK_N)
    c_end = c_first + TILES * BLOCK_N
    ar = tl.arange(0, BLOCK_N)
    if SPARSE:
        idle = c_first >= n_cols
    else:
        idle = c_first >= vis
    if idle:  # every column of this program is invisible
        for it in range(TILES):
            c = c_first + it * BLOCK_N + ar
            tl.store(out_row + c, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=c < n_cols)
    else:
        req = tl.load(req_ptr + t).to(tl.int64)
        hh = tl.arange(0, HP)
        hmask = hh < H
        w = tl.load(w_ptr + t * stride_wt + hh, mask=hmask, other=0.0).to(tl.float32)
        q_row = q_ptr + t * stride_qt
        if MODE == 3:
            # Q^T in fp16, each head divided by the power of two p_h <= its largest |q| (exact:
            # MXFP4 values carry 2 significant bits), p_h folded into the head weight.
            if I16:
                jj = tl.arange(0, D // 4)
                qb = q_row + hh[None, :] * stride_qh + 4 * jj[:, None]  # [D / 4, HP]: dims 4 m + n
                q0 = tl.load(qb, mask=hmask[None, :], other=0.0).to(tl.float32)
                q1 = tl.load(qb + 1, mask=hmask[None, :], other=0.0).to(tl.float32)
                q2 = tl.load(qb + 2, mask=hmask[None, :], other=0.0).to(tl.float32)
                q3 = tl.load(qb + 3, mask=hmask[None, :], other=0.0).to(tl.float32)
                amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), 0), tl.max(tl.abs(q1), 0)),
                                  tl.maximum(tl.max(tl.abs(q2), 0), tl.max(tl.abs(q3), 0)))
            else:
                vv = tl.arange(0, VB)
                qe_ptrs = q_row + hh[None, :] * stride_qh + 2 * vv[:, None]  # [D / 2, HP]: even dims
                qe = tl.load(qe_ptrs, mask=hmask[None, :], other=0.0).to(tl.float32)
                qo = tl.load(qe_ptrs + 1, mask=hmask[None, :], other=0.0).to(tl.float32)
                amax = tl.maximum(tl.max(tl.abs(qe), 0), tl.max(tl.abs(qo), 0))
            pbits = tl.where(amax >= 1.1754943508222875e-38,
                             tl.minimum(amax.to(tl.int32, bitcast=True) & 0x7F800000, 253 << 23), 127 << 23)
            inv = ((254 << 23) - pbits).to(tl.float32, bitcast=True)
            if I16:
                qe = ((q0 * inv[None, :]).to(tl.float16), (q1 * inv[None, :]).to(tl.float16))
                qo = ((q2 * inv[None, :]).to(tl.float16), (q3 * inv[None, :]).to(tl.float16))
            else:
                qe = (qe * inv[None, :]).to(tl.float16)
                qo = (qo * inv[None, :]).to(tl.float16)
            w = w * pbits.to(tl.float32, bitcast=True)
        else:
            vv = tl.arange(0, VB)
            qe_ptrs = q_row + hh[None, :] * stride_qh + 2 * vv[:, None]  # [D / 2, HP]: even dims
            qe = tl.load(qe_ptrs, mask=hmask[None, :], other=0.0).to(tl.float32)
            qo = tl.load(qe_ptrs + 1, mask=hmask[None, :], other=0.0).to(tl.float32)
        bt_row = bt_ptr + req * stride_bt
        if PREFETCH == 2:
            # Software pipeline in registers (loads are asynchronous until first use): while
            # tile `it` is decoded and multiplied, the records of tile it+1, the block ids of
            # tile it+2 and (sparse) the candidate ids of tile it+3 are in flight.
            j0, v0 = _tile_entries(c_first + ar, c_end, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE, True)
            j1, v1 = _tile_entries(c_first + BLOCK_N + ar, c_end, t, vis, n_cols, cand_ptr, stride_cand,
                                   CB, SPARSE, True)
            j2, v2 = _tile_entries(c_first + 2 * BLOCK_N + ar, c_end, t, vis, n_cols, cand_ptr, stride_cand,
                                   CB, SPARSE, True)
            b0 = _tile_blocks(j0, v0, bt_row, PAGE_N)
            b1 = _tile_blocks(j1, v1, bt_row, PAGE_N)
            vals, scl = _tile_load(cache_ptr, stride_blk, b0, j0, v0, PAGE_N, D, MODE, I16)
            for it in range(TILES):
                c = c_first + it * BLOCK_N + ar
                vals_n, scl_n = _tile_load(cache_ptr, stride_blk, b1, j1, v1, PAGE_N, D, MODE, I16)
                b2 = _tile_blocks(j2, v2, bt_row, PAGE_N)
                j3, v3 = _tile_entries(c + 3 * BLOCK_N, c_end, t, vis, n_cols, cand_ptr, stride_cand,
                                       CB, SPARSE, True)
                score = _tile_scores(vals, scl, qe, qo, w, BLOCK_N, D, MODE, ASM, I16)
                _store_scores(out_row, c, score, v0, n_cols, ROUND)
                vals, scl, v0 = vals_n, scl_n, v1
                j1, v1, b1 = j2, v2, b2
                j2, v2 = j3, v3
        elif PREFETCH == 1:
            # Pipeline through L2: tile it+1's records are prefetched into L2 (GPU: one
            # prefetch.global.L2 per record row and scale row; skipped under the interpreter)
            # and tile it+2's block ids are loaded while tile `it` is loaded from L2 and computed.
            j0, v0 = _tile_entries(c_first + ar, c_end, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE, True)
            j1, v1 = _tile_entries(c_first + BLOCK_N + ar, c_end, t, vis, n_cols, cand_ptr, stride_cand,
                                   CB, SPARSE, True)
            b0 = _tile_blocks(j0, v0, bt_row, PAGE_N)
            b1 = _tile_blocks(j1, v1, bt_row, PAGE_N)
            for it in range(TILES):
                c = c_first + it * BLOCK_N + ar
                if L2PF:
                    _l2_prefetch(cache_ptr, stride_blk, b1, j1, v1, PAGE_N, D)
                j2, v2 = _tile_entries(c + 2 * BLOCK_N, c_end, t, vis, n_cols, cand_ptr, stride_cand,
                                       CB, SPARSE, True)
                b2 = _tile_blocks(j2, v2, bt_row, PAGE_N)
                if not SPARSE:  # in range: the same validity without the range test (fewer registers)
                    j0, v0 = _tile_entries(c, c_end, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE, False)
                vals, scl = _tile_load(cache_ptr, stride_blk, b0, j0, v0, PAGE_N, D, MODE, I16)
                score = _tile_scores(vals, scl, qe, qo, w, BLOCK_N, D, MODE, ASM, I16)
                _store_scores(out_row, c, score, v0, n_cols, ROUND)
                j0, v0, b0 = j1, v1, b1
                j1, v1, b1 = j2, v2, b2
        else:
            for it in range(TILES):
                c = c_first + it * BLOCK_N + ar
                j, valid = _tile_entries(c, c_end, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE, False)
                blk = _tile_blocks(j, valid, bt_row, PAGE_N)
                vals, scl = _tile_load(cache_ptr, stride_blk, blk, j, valid, PAGE_N, D, MODE, I16)
                score = _tile_scores(vals, scl, qe, qo, w, BLOCK_N, D, MODE, ASM, I16)
                _store_scores(out_row, c, score, valid, n_cols, ROUND)


# ----------------------------------------------------------------------------- wrappers


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_SMS: dict[int, int] = {}


def _check_inputs(q, w, index_cache, block_table, token_req, visible, ratio, block_size) -> int:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, D], got {tuple(q.shape)}")
    T, H, D = q.shape
    if q.dtype not in _ROUND:
        raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")
    if D < 64 or D & (D - 1):
        raise ValueError(f"index head dim must be a power of two >= 64, got {D}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous in its last dim")
    if w.shape != (T, H) or not w.dtype.is_floating_point or (H > 1 and w.stride(1) != 1):
        raise ValueError(f"w must be a float [T, H] = [{T}, {H}] with stride(1) == 1, got {tuple(w.shape)}")
    page_n = check_index_cache(index_cache, D, ratio, block_size)
    if index_cache.stride(-1) != 1 or index_cache.stride(-2) != index_cache.shape[-1]:
        raise ValueError("index cache pages must be contiguous inside (only the block stride may be padded)")
    ints = (torch.int32, torch.int64)
    if block_table.dim() != 2 or block_table.dtype not in ints or block_table.stride(1) != 1:
        raise ValueError(f"block_table must be row-contiguous int32/int64 [R, n], not {block_table.dtype}")
    for name, v in (("token_req", token_req), ("visible", visible)):
        if v.shape != (T,) or v.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [{T}], got {tuple(v.shape)} {v.dtype}")
    for name, v in (("w", w), ("index_cache", index_cache), ("block_table", block_table),
                    ("token_req", token_req), ("visible", visible)):
        if v.device != q.device:
            raise ValueError(f"{name} is on {v.device}, q on {q.device}")
    if T > 65535:
        raise ValueError(f"at most 65535 query tokens per call, got {T}")
    return page_n


def _launch(q, w, index_cache, block_table, token_req, visible, page_n, cand, cand_block, n_cols,
            out_dtype, mode, block_n, tiles, num_warps, prefetch, maxnreg, out, i16=None, stages=None):
    T, H, D = q.shape
    if out is None:
        out = torch.empty(T, n_cols, dtype=torch.float32, device=q.device)
    elif out.shape != (T, n_cols) or out.dtype != torch.float32 or out.device != q.device or (
        n_cols > 1 and out.stride(1) != 1
    ):
        raise ValueError(f"out must be a row-contiguous float32 [{T}, {n_cols}] on {q.device}")
    if T == 0 or n_cols == 0:
        return out
    out_dtype = q.dtype if out_dtype is None else out_dtype
    if out_dtype not in _ROUND:
        raise TypeError(f"out_dtype must be fp32/bf16/fp16, got {out_dtype}")
    gluon_ok = gluon_supported(q, index_cache, page_n)
    asked = mode
    if mode is None:
        mode = default_mode(q, index_cache, page_n)
    if mode not in (2, 3, 5):
        raise ValueError(f"mode must be 2 (fp32), 3 (fp16) or 5 (Gluon, fp8), got {mode}")
    if mode == 5 and not gluon_ok:
        raise ValueError("mode 5 (Gluon) needs an sm90 GPU, Gluon, bf16/fp16 q with D = 128 and "
                         "16-byte aligned pages of a power-of-two number of records")
    if mode == 5 and _FAILED.get(5) and q.is_cuda:
        mode = 3
    if mode == 5:
        try:
            return gluon_index_scores(q, w, index_cache, block_table, token_req, visible, page_n, cand,
                                      cand_block, n_cols, _ROUND[out_dtype], out, tiles=tiles,
                                      stages=stages or (SPARSE_STAGES if cand is not None else 4),
                                      num_sms=_num_sms(q.device), maxnreg=maxnreg)
        except Exception as exc:  # pragma: no cover - a Triton whose Gluon cannot lower the kernel
            if asked == 5:
                raise
            _FAILED[mode] = True
            warnings.warn(f"indexer scores: the Gluon kernel failed to compile ({type(exc).__name__}: {exc}); "
                          "falling back to mode 3")
            mode = 3
    prefetch = DEFAULT_PREFETCH if prefetch is None else int(prefetch)
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0 (none), 1 (L2) or 2 (registers), got {prefetch}")
    block_n = block_n or (32 if mode == 2 else 128)  # fp32 FMA dots spill beyond 32 keys
    if tiles is None:  # up to 2048 keys per program (Q^T and w loaded once), >= 4 programs per SM
        n_tiles = T * triton.cdiv(n_cols, block_n)
        tiles = max(1, min(2048 // block_n, n_tiles // (4 * _num_sms(q.device))))
    num_warps = num_warps or 4
    if maxnreg is None:  # mode 3: 4 CTAs of 4 warps per SM (163 -> 128 registers)
        maxnreg = 128 if mode == 3 and (prefetch, block_n, num_warps) == (1, 128, 4) else 0
    grid = (triton.cdiv(n_cols, block_n * tiles), T)
    sparse = cand is not None
    # mode 3 reads int16 words when every record starts on an even address
    even = index_cache.data_ptr() % 2 == 0 and index_cache.stride(0) % 2 == 0
    i16 = (mode == 3 and even) if i16 is None else bool(i16)
    if i16 and (mode != 3 or not even):
        raise ValueError("i16 needs mode 3 and an index cache with even base address and block stride")
    if sparse and block_n % cand_block:
        raise ValueError(f"block_n {block_n} must be a multiple of the candidate block {cand_block}")
    cptr = cand if sparse else block_table
    kwargs = dict(
        H=H, HP=max(16, triton.next_power_of_2(H)), D=D, PAGE_N=page_n,
        BLOCK_N=block_n, TILES=tiles, CB=cand_block if sparse else 1,
        SPARSE=sparse, ROUND=_ROUND[out_dtype], PREFETCH=prefetch, num_warps=num_warps,
        I16=i16,
    )
    args = (
        q, q.stride(0), q.stride(1), w, w.stride(0),
        index_cache, index_cache.stride(0), block_table, block_table.stride(0),
        token_req, visible, cptr, cptr.stride(0), out, out.stride(0), n_cols,
    )
    l2pf = q.is_cuda and not _FAILED.get("l2pf")
    maxnreg = maxnreg if q.is_cuda and not _FAILED.get("maxnreg") else 0
    while True:
        extra = {"maxnreg": maxnreg} if maxnreg else {}
        try:
            _index_scores_kernel[grid](
                *args, MODE=mode, L2PF=l2pf, ASM=q.is_cuda, **kwargs, **extra, **pdl_args(q.device)
            )
            return out
        except Exception as exc:  # pragma: no cover - a Triton that cannot lower an option
            if not q.is_cuda:
                raise
            # drop the optional extras (register cap, L2 prefetch PTX)
            if maxnreg:
                what, maxnreg = "maxnreg", 0
            elif l2pf and prefetch == 1:
                what, l2pf = "l2pf", False
            else:
                raise
            _FAILED[what] = True
            warnings.warn(f"indexer scores: {what!r} failed to compile ({type(exc).__name__}: {exc}); "
                          "retrying without it")


def index_scores_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    block_size: int,
    out_dtype: torch.dtype | None = None,
    max_visible: int | None = None,
    *,
    mode: int | None = None,
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    prefetch: int | None = None,
    maxnreg: int | None = None,
    i16: bool | None = None,
    stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of every token over its request's paged index keys -> fp32 ``[T, n_cols]``.

    ``n_cols = max_visible`` (pass it to avoid a host sync; default ``visible.max()``);
    columns ``j >= visible[t]`` are ``-inf`` and their pages are never read. Scores are
    rounded once to ``out_dtype`` (default ``q.dtype``). ``mode``/``block_n``/``tiles``/
    ``num_warps``/``prefetch``/``maxnreg``/``i16``/``stages`` are tuning knobs (see the module
    docstrings; ``tiles`` counts 64-key tiles in mode 5); ``None`` picks the measured default.
    """
    page_n = _check_inputs(q, w, index_cache, block_table, token_req, visible, ratio, block_size)
    if max_visible is None:
        max_visible = int(visible.max()) if visible.numel() else 0
    return _launch(q, w, index_cache, block_table, token_req, visible, page_n, None, 1, int(max_visible),
                   out_dtype, mode, block_n, tiles, num_warps, prefetch, maxnreg, out, i16, stages)


def index_scores_paged_sparse(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    block_size: int,
    cand_blocks: torch.Tensor,
    cand_block_size: int = 8,
    out_dtype: torch.dtype | None = None,
    *,
    mode: int | None = None,
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    prefetch: int | None = None,
    maxnreg: int | None = None,
    i16: bool | None = None,
    stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores of the kept candidate blocks' entries only -> compact fp32 ``[T, nb * B]``.

    Column ``c`` is entry ``cand_blocks[t, c // B] * B + c % B`` (``-inf`` for a -1 block or
    an entry ``>= visible[t]``). Same per-key arithmetic as ``index_scores_paged``.
    """
    page_n = _check_inputs(q, w, index_cache, block_table, token_req, visible, ratio, block_size)
    T = q.shape[0]
    ints = (torch.int32, torch.int64)
    if cand_blocks.dim() != 2 or cand_blocks.shape[0] != T or cand_blocks.dtype not in ints:
        raise ValueError(f"cand_blocks must be int32/int64 [{T}, nb], got {tuple(cand_blocks.shape)}")
    if cand_blocks.shape[1] > 1 and cand_blocks.stride(1) != 1:
        raise ValueError("cand_blocks rows must be contiguous")
    if cand_block_size < 1 or cand_block_size & (cand_block_size - 1):
        raise ValueError(f"cand_block_size must be a power of two, got {cand_block_size}")
    n_cols = cand_blocks.shape[1] * cand_block_size
    return _launch(q, w, index_cache, block_table, token_req, visible, page_n, cand_blocks, cand_block_size,
                   n_cols, out_dtype, mode, block_n, tiles, num_warps, prefetch, maxnreg, out, i16, stages)


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    *,
    ratio: int,
    block_size: int,
    topk: int,
    candidates: torch.Tensor | None = None,
    candidate_source: bool = False,
    candidate_block_size: int = 8,
    candidate_topk_blocks: int = 2048,
    out_dtype: torch.dtype | None = None,
    max_visible: int | None = None,
    index_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One index-source layer's top-k (the model's ``_select`` once ``q``/``w`` exist).

    Inputs mirror ``_select``: ``q = mxfp4_qdq(rope(q_b(c_q)))`` ``[T, H, 128]``, ``w =
    weights_proj(x)`` ``[T, H]``, the KV source's index cache, its block table (of the
    cache's own KV-cache group), ``token_req``, ``visible = (positions + 1) // ratio``.

    * ``candidates`` (kept block ids of the candidate source, ``[T, nb]``): reindex layer;
      only those blocks' entries are scored -> ``(topk [T, topk], None)``;
    * else all visible entries; with ``candidate_source`` the kept block ids
      ``[T, candidate_topk_blocks]`` are returned too, for the reindex layers.

    Same selections as ``ops.paged_indexer.indexer_topk`` given the same scores (the reference
    scores a reindex layer's every entry and masks; here only the kept blocks' entries are
    scored, in a compact buffer, and the chosen columns mapped back). With ``max_visible``
    given, every size is a host value (no host synchronisation: capturable in a CUDA graph).
    """
    if candidates is not None:
        compact = index_scores_paged_sparse(
            q, w, index_cache, block_table, token_req, visible, ratio, block_size,
            candidates, candidate_block_size, out_dtype,
        )
        idx = topk_indices(compact, topk, index_map=candidates, map_block=candidate_block_size,
                           index_dtype=index_dtype)
        return idx, None
    scores = index_scores_paged(
        q, w, index_cache, block_table, token_req, visible, ratio, block_size, out_dtype, max_visible
    )
    idx = topk_indices(scores, topk, lengths=visible, index_dtype=index_dtype)
    kept = None
    if candidate_source:
        kept = candidate_blocks(scores, visible, candidate_block_size, candidate_topk_blocks, index_dtype)
    return idx, kept
