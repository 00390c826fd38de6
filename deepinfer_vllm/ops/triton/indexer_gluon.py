"""Lightning-indexer scores on Hopper in Gluon (Triton's explicit-layout dialect), sm90 only.

Mode 5 of ``indexer.index_scores_paged`` (same contract; PyTorch reference ``ops.paged_indexer``): fp8
wgmma; record bytes become e4m3 by a table lookup (``e2m1.E4M3_LOOKUP_PTX``), ``Q^T`` is stored as e4m3
``[H, 128]``; numerics as in ``indexer.py``.
Why Gluon: control over where every byte goes. The next ``STAGES - 1`` tiles of 64 keys are in flight as
16-byte ``cp.async`` copies into a shared-memory ring while one is decoded, and each thread reads exactly
its wgmma A fragment (16 record bytes: thread ``c = lane % 4`` of a key row gets scale block ``c``, with
``Q^T``'s K order permuted to match, ``_q_perm_dims_fp8``), so the decode reaches the tensor cores by
register renaming only. Keys past the visible entries (pages of >= 16
records) and -1 or invisible candidate blocks read block 0 unmasked (masked in the epilogue); tiles past
a token's visible entries are written -inf unread. ``TILES`` (runtime) comes from ``program_tiles``.
Only ``D = 128``, up to 256 heads, pages of a power-of-two number (>= 4) of records, 16-byte aligned.
Design notes and measurements: benchmarks/README.md.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_vllm.ops.triton.e2m1 import E4M3_LOOKUP_PTX, E4M3_TABLE_SHIFTS, e4m3_lookup_tables
from deepinfer_vllm.ops.triton.pdl import gluon_grid_wait, pdl_args

try:  # Gluon ships with Triton >= 3.5; its Hopper API is what this file targets (3.6)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = ["GLUON_AVAILABLE", "gluon_index_scores", "gluon_supported"]

GLUON_AVAILABLE = gluon is not None


def gluon_supported(q: torch.Tensor, index_cache: torch.Tensor, page_n: int) -> bool:
    """This kernel's shapes and device: sm90, D = 128, H <= 256, 16-byte aligned pages of a
    power-of-two number (>= 4) of records."""
    if not (GLUON_AVAILABLE and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    T, H, D = q.shape
    return (D == 128 and H <= 256 and page_n >= 4 and page_n & (page_n - 1) == 0
            and index_cache.data_ptr() % 16 == 0 and index_cache.stride(0) % 16 == 0)


if GLUON_AVAILABLE:
    # Gluon kernels cannot call ``tl`` functions: the few small helpers of ``indexer.py`` that
    # this kernel needs (bf16 rounding, entry lookup) are restated here.

    @gluon.jit
    def _decode_e4m3(byts, tlo, thi):
        """Codes 0-3 / 4-7 of every 4 record bytes as e4m3 bytes (``E4M3_LOOKUP_PTX``)."""
        return gl.inline_asm_elementwise(
            E4M3_LOOKUP_PTX, "=r,=r,r,r,r,r,r,r,r,r,r", [byts, tlo, thi],
            dtype=(gl.float8e4nv, gl.float8e4nv), is_pure=True, pack=4,
        )

    @gluon.jit
    def _round_out(x, ROUND: gl.constexpr):
        if ROUND == 1:  # nearest bf16, ties to even (cvt.rn.bf16.f32)
            x = x.to(gl.bfloat16).to(gl.float32)
        elif ROUND == 2:
            x = x.to(gl.float16).to(gl.float32)
        return x

    @gluon.jit
    def _entries(c, t, vis, n_cols, cand_ptr, stride_cand, CB: gl.constexpr, SPARSE: gl.constexpr):
        """Entry index and visibility of columns ``c`` (sparse: through the candidate ids)."""
        if SPARSE:
            cm = c < n_cols
            cu = c.to(gl.uint32)  # columns are >= 0: unsigned shifts, no sign fix-ups
            bid = gl.load(cand_ptr + t * stride_cand + cu // CB, mask=cm, other=-1).to(gl.int32)
            j = bid * CB + (cu % CB).to(gl.int32)
            valid = (bid >= 0) & (j < vis)
        else:
            j = c
            valid = j < vis
        return j, valid

    @gluon.jit
    def _page_base(cache_ptr, stride_blk, blk, off):
        """``cache + blk * stride + off`` (all >= 0) with one 32 x 32 -> 64-bit multiply-add."""
        return cache_ptr + (blk.to(gl.uint32).to(gl.uint64) * stride_blk.to(gl.uint32).to(gl.uint64)
                            + off.to(gl.uint64))

    @gluon.jit
    def _tile_pages(c0, live, t, vis, n_cols, bt_row, cand_ptr, stride_cand, m_v, m_s,
                    LOG2_PAGE: gl.constexpr, CB: gl.constexpr, SPARSE: gl.constexpr):
        """Slots, validity and block ids of one tile's copies: value copies of keys ``m_v``,
        scale copies of keys ``m_s`` (the first of ``SROWS`` keys in one page). Dense tiles:
        keys past the visible entries, and every key of a tile that is not ``live``, get
        block 0 (a real block: its reads are harmless, hit L2, and the epilogue masks them),
        so the copies need no masks."""
        if SPARSE:
            jv, okv = _entries(c0 + m_v, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE)
            js, oks = _entries(c0 + m_s, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE)
        else:
            jv = c0 + m_v
            okv = jv < vis
            js = c0 + m_s
            oks = js < vis
        slot_mask: gl.constexpr = (1 << LOG2_PAGE) - 1
        if not SPARSE:
            lim = gl.where(live, vis - c0, 0)
            okv = m_v < lim
            oks = m_s < lim
        if not SPARSE and slot_mask < 64:
            # dense tiles start on a page boundary: key m of the tile is slot m % PAGE_N of the
            # tile's page m // PAGE_N, so only the first page and the limit change per tile
            jv = m_v.to(gl.uint32)
            js = m_s.to(gl.uint32)
            page_row = bt_row + (c0 >> LOG2_PAGE)
        else:
            jv = jv.to(gl.uint32)  # entries are >= 0: unsigned shifts and masks, no sign fix-ups
            js = js.to(gl.uint32)
            page_row = bt_row
        bv = gl.load(page_row + (jv >> LOG2_PAGE), mask=okv, other=0)
        bs = gl.load(page_row + (js >> LOG2_PAGE), mask=oks, other=0)
        return jv & slot_mask, okv, bv, js & slot_mask, oks, bs

    @gluon.jit
    def _issue_tile(vals_s, scl_s, stage, cache_ptr, stride_blk, sv, okv, bv, ss, oks, bs, voff, kk,
                    PAGE_N: gl.constexpr, SROWS: gl.constexpr, SPARSE: gl.constexpr, PAIRS: gl.constexpr):
        """cp.async one tile's records into ring slot ``stage``: 16 value bytes per copy (``PAIRS``
        > 0: keys k and k + PAIRS of one page per thread, one block id and address), and the
        scale words of ``SROWS`` consecutive keys per copy. Only candidate tiles with per-key
        copies need masks (see ``_tile_pages``)."""
        vrow = _page_base(cache_ptr, stride_blk, bv, sv * 64).to(gl.pointer_type(gl.int16))
        if PAIRS > 0:  # vrow: [key group, key] of the pairs' first keys; voff: [g, half, i, block, word]
            async_copy.async_copy_global_to_shared(vals_s.index(stage).reshape([32 // PAIRS, 2, PAIRS, 4, 8]),
                                                   vrow[:, None, :, None, None] + voff)
        elif SPARSE:
            async_copy.async_copy_global_to_shared(vals_s.index(stage), vrow[:, None, None] + voff,
                                                   mask=okv[:, None, None])
        else:
            async_copy.async_copy_global_to_shared(vals_s.index(stage), vrow[:, None, None] + voff)
        # slots are multiples of SROWS: the scale words of SROWS keys are one 4 * SROWS-byte copy
        srow = _page_base(cache_ptr, stride_blk, bs, PAGE_N * 64 + (ss // SROWS) * (SROWS * 4))
        srow = srow.to(gl.pointer_type(gl.int32))
        if SPARSE and PAIRS == 0:
            async_copy.async_copy_global_to_shared(scl_s.index(stage), srow[:, None] + kk[None, :],
                                                   mask=oks[:, None])
        else:
            async_copy.async_copy_global_to_shared(scl_s.index(stage), srow[:, None] + kk[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _timeline_stamp(dbg_ptr, prog, ev, TIMELINE: gl.constexpr):
        """Debug timeline: the global nanosecond timer at event ``ev`` of program ``prog`` (0 start,
        1 first tile landed, 2 end; slot 3 holds the SM id)."""
        if TIMELINE:
            ns = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [prog], dtype=gl.int64,
                                           is_pure=False, pack=1)
            gl.store(dbg_ptr + prog.to(gl.int64) * 4 + ev, ns)
            if ev == 0:
                sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [prog], dtype=gl.int32,
                                               is_pure=False, pack=1)
                gl.store(dbg_ptr + prog.to(gl.int64) * 4 + 3, sm.to(gl.int64))

    @gluon.jit
    def _index_scores_gluon_kernel(
        q_ptr, stride_qt, stride_qh,
        w_ptr, stride_wt,
        cache_ptr, stride_blk,
        bt_ptr, stride_bt,
        req_ptr, vis_ptr,
        cand_ptr, stride_cand,
        out_ptr, stride_out, n_cols, tab_ptr, TILES, dbg_ptr,
        H: gl.constexpr, HP: gl.constexpr, PAGE_N: gl.constexpr,
        STAGES: gl.constexpr, CB: gl.constexpr,
        SPARSE: gl.constexpr, ROUND: gl.constexpr, SROWS: gl.constexpr,
        TIMELINE: gl.constexpr = False,
        PDL: gl.constexpr = False,
    ):
        gluon_grid_wait(PDL)
        BM: gl.constexpr = 64  # keys per tile: one wgmma M block of the 4 warps
        LOG2_PAGE: gl.constexpr = PAGE_N.bit_length() - 1
        # Register layouts. WL: the int16 words of a tile as [key, block c, word r]; thread
        # (warp w, lane l) holds keys 16 w + l // 4 (+ 8), block c = l % 4, all 8 words.
        WL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BM, 4, 8])
        FL: gl.constexpr = gl.SliceLayout(2, WL)  # [key, block]: one factor per thread and key
        RL: gl.constexpr = gl.SliceLayout(1, FL)  # [key]: per key, replicated over the quad
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, HP, 32])  # K step 32 (fp8)
        AL8: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
        # BL: the record bytes of a tile as [key, block c, byte j]; thread (warp w, lane l)
        # holds keys 16 w + l // 4 (+ 8), block c = l % 4, its 16 bytes (one LDS.128)
        BL: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[BM, 4, 16])
        SR: gl.constexpr = gl.SliceLayout(1, MMA)  # one score per key
        # PAIRS: the gap between the two keys of one page that a thread copies (0: one key per
        # copy). Dense pages of >= 16 keys: k and k + 8. Candidate blocks of >= 8 keys in pages
        # of >= 8: k and k + 4 of one block (its 8 keys share a page); a block that is -1 or
        # past the visible entries reads block 0 unmasked, like a dense tile's keys past the
        # visible ones, and the epilogue masks it.
        PAIRS: gl.constexpr = (4 if CB >= 8 and PAGE_N >= 8 else 0) if SPARSE else (8 if PAGE_N >= 16 else 0)
        if PAIRS == 8:  # [key group of 16, key pair half, key, block, word]: each copy instruction
            # 512 contiguous bytes; warp w copies the scale words of keys 16 w .. 16 w + 15, its own
            # value keys
            CL: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 8], [1, 1, 8, 4, 1], [4, 1, 1, 1, 1],
                                                [4, 3, 2, 1, 0])
            SCP: gl.constexpr = gl.BlockedLayout([1, SROWS], [4, 8], [4, 1], [1, 0])
        elif PAIRS == 4:  # [block of 8 keys, pair half, key, block, word]: a warp's lanes take two
            # candidate blocks, each copy instruction two runs of 256 contiguous bytes
            CL: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 8], [2, 1, 4, 4, 1], [4, 1, 1, 1, 1],
                                                [4, 3, 2, 1, 0])
            SCP: gl.constexpr = gl.BlockedLayout([1, SROWS], [4, 8], [4, 1], [1, 0])
        else:  # value copies [key, block, word]; scale-word copies [key // SROWS, SROWS]
            CL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [4, 1, 1], [2, 1, 0])
            SCP: gl.constexpr = gl.BlockedLayout([1, SROWS], [32, 1], [4, 1], [1, 0])
        VSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0])
        SSL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

        pid = gl.program_id(0)
        prog = pid + gl.program_id(1) * gl.num_programs(0)
        _timeline_stamp(dbg_ptr, prog, 0, TIMELINE)
        t = gl.program_id(1).to(gl.int64)
        vis = gl.load(vis_ptr + t).to(gl.int32)
        out_row = out_ptr + t * stride_out
        c_first = pid * (TILES * BM)
        ar_s = gl.arange(0, BM, layout=SR)
        if SPARSE:
            n_live = TILES
        else:  # tiles past the visible entries are only written (-inf), never read or computed
            n_live = gl.minimum(gl.maximum(vis - c_first + BM - 1, 0) // BM, TILES)
        for it in range(n_live, TILES):
            c = c_first + it * BM + ar_s
            gl.store(out_row + c, gl.full([BM], float("-inf"), gl.float32, SR), mask=c < n_cols)
        if n_live > 0:
            req = gl.load(req_ptr + t).to(gl.int64)
            bt_row = bt_ptr + req * stride_bt
            # Q^T with its rows in the decode's K order, each head divided by the power of two
            # p_h <= max |q_h| (exact: MXFP4 values carry 2 significant bits), p_h into w.
            # Q^T as e4m3 [HP, 128] (K-major, as fp8 wgmma wants), times 2^6 more
            QBL8: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
            QSL8: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 128], gl.float8e4nv)
            kap8 = gl.arange(0, 128, layout=gl.SliceLayout(0, QBL8))
            hh8 = gl.arange(0, HP, layout=gl.SliceLayout(1, QBL8))
            qv8 = gl.load(q_ptr + t * stride_qt + hh8[:, None] * stride_qh + _q_perm_dims_fp8(kap8)[None, :],
                          mask=(hh8 < H)[:, None], other=0.0).to(gl.float32)
            pbits = _pow2_floor_bits(gl.max(gl.abs(qv8), 1))
            inv8 = ((254 << 23) - pbits).to(gl.float32, bitcast=True) * 64.0
            q8_s = gl.allocate_shared_memory(gl.float8e4nv, [HP, 128], QSL8,
                                             (qv8 * inv8[:, None]).to(gl.float8e4nv))
            w_boost = 1.0 / 4096  # the 2^6 of the keys' tables and the 2^6 of Q
            hw = gl.arange(0, HP, layout=gl.SliceLayout(0, MMA))
            w = gl.load(w_ptr + t * stride_wt + hw, mask=hw < H, other=0.0).to(gl.float32) * 0.5
            w = w * gl.convert_layout(pbits, gl.SliceLayout(0, MMA)).to(gl.float32, bitcast=True) * w_boost
            fence_async_shared()

            vals_s = gl.allocate_shared_memory(gl.int16, [STAGES, BM, 4, 8], VSL)
            scl_s = gl.allocate_shared_memory(gl.int32, [STAGES, BM // SROWS, SROWS], SSL)
            if PAIRS > 0:  # m_v: the first key of each pair, k = 2 PAIRS g + i (its pair: k + PAIRS)
                PL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, CL)))  # [g, i]
                m_v = (gl.arange(0, 32 // PAIRS, layout=gl.SliceLayout(1, PL)) * (2 * PAIRS))[:, None] + \
                    gl.arange(0, PAIRS, layout=gl.SliceLayout(0, PL))[None, :]
                jj = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, CL)))))
                cq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, CL)))))
                rr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, CL)))))
                voff = (jj * (32 * PAIRS))[None, :, None, None, None] + (cq * 8)[None, None, None, :, None] + \
                    rr[None, None, None, None, :]
            else:
                m_v = gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL)))
                cq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
                rr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
                voff = (cq * 8)[None, :, None] + rr[None, None, :]
            m_s = gl.arange(0, BM // SROWS, layout=gl.SliceLayout(1, SCP)) * SROWS
            kk = gl.arange(0, SROWS, layout=gl.SliceLayout(0, SCP))
            # prologue: tiles 0 .. STAGES - 2 in flight, block ids of tile STAGES - 1 loaded
            for s in gl.static_range(STAGES - 1):
                sv, okv, bv, ss, oks, bs = _tile_pages(c_first + s * BM, s < n_live, t, vis, n_cols, bt_row,
                                                       cand_ptr, stride_cand, m_v, m_s, LOG2_PAGE, CB, SPARSE)
                _issue_tile(vals_s, scl_s, s, cache_ptr, stride_blk, sv, okv & (s < n_live), bv, ss,
                            oks & (s < n_live), bs, voff, kk, PAGE_N, SROWS, SPARSE, PAIRS)
            sv, okv, bv, ss, oks, bs = _tile_pages(c_first + (STAGES - 1) * BM, STAGES - 1 < n_live, t, vis,
                                                   n_cols, bt_row, cand_ptr, stride_cand, m_v, m_s, LOG2_PAGE,
                                                   CB, SPARSE)
            cidx = gl.arange(0, 4, layout=gl.SliceLayout(0, FL))
            acc0 = gl.zeros([BM, HP], gl.float32, MMA)
            for it in range(n_live):
                stage = it % STAGES
                async_copy.wait_group(STAGES - 2)  # tile `it` has landed (this thread's copies)
                gl.thread_barrier()  # ... and everyone's; slot (it - 1) % STAGES is free again
                if TIMELINE:
                    if it == 0:
                        _timeline_stamp(dbg_ptr, prog, 1, TIMELINE)
                nxt = it + STAGES - 1
                _issue_tile(vals_s, scl_s, nxt % STAGES, cache_ptr, stride_blk, sv, okv & (nxt < n_live), bv, ss,
                            oks & (nxt < n_live), bs, voff, kk, PAGE_N, SROWS, SPARSE, PAIRS)
                # block ids of tile it + STAGES: their latency hides behind this tile's math
                sv, okv, bv, ss, oks, bs = _tile_pages(c_first + (it + STAGES) * BM, it + STAGES < n_live, t, vis,
                                                       n_cols, bt_row, cand_ptr, stride_cand, m_v, m_s, LOG2_PAGE,
                                                       CB, SPARSE)

                # scales: thread (key, c) takes byte c of the key's word; emax over the quad
                sw = scl_s.index(stage).reshape([BM]).load(RL)
                e = (sw[:, None] >> (cidx * 8)[None, :]) & 255
                emax = gl.max(e, 1)
                # the block's table: its 8 magnitudes times 2^(6 - (emax - e)), as e4m3
                dsh = gl.convert_layout(gl.minimum(emax[:, None] - e, E4M3_TABLE_SHIFTS - 1),
                                        gl.SliceLayout(2, BL))
                tab = gl.load(tab_ptr.to(gl.pointer_type(gl.int64)) + dsh)  # both words at once
                tlo = gl.expand_dims(tab.to(gl.int32), 2)
                thi = gl.expand_dims((tab >> 32).to(gl.int32), 2)
                byts = vals_s.index(stage)._reinterpret(gl.uint8, [BM, 4, 16], VSL).load(BL)
                ea, eb = _decode_e4m3(byts, tlo, thi)
                # code 8 m + 4 t + b of block c (byte j = 4 m + b) is K index
                # 64 m1 + 32 m0 + 16 t + 4 c + b with m = 2 m1 + m0 (see _q_perm_dims_fp8)
                a8 = gl.join(ea, eb)  # [BM, c, j, t]
                a8 = gl.reshape(a8, [BM, 4, 2, 2, 4, 2])  # [BM, c, m1, m0, b, t]
                a8 = gl.permute(a8, [0, 2, 3, 5, 1, 4])
                # the same registers in the A fragment's order (a renaming, no data moves)
                a8 = gl.convert_layout(gl.reshape(a8, [BM, 128]), AL8)
                acc = warpgroup_mma(a8, q8_s.permute([1, 0]), acc0, use_acc=False)
                # relu(x) w as (x + |x|) (w / 2): x + |x| is exactly 2 relu(x) and |x| is an operand
                # modifier of the add, so the ReLU leaves the integer ALU pipe, which the decode
                # keeps busy (FMNMX there); bit-identical, 0-2 % faster
                score = gl.sum((acc + gl.abs(acc)) * w[None, :], 1)
                em = gl.convert_layout(emax, SR)
                score = score * gl.where(em > 0, em << 23, 1 << 22).to(gl.float32, bitcast=True)
                c0 = c_first + it * BM
                if SPARSE:
                    js, vs = _entries(c0 + ar_s, t, vis, n_cols, cand_ptr, stride_cand, CB, SPARSE)
                else:  # against scalar limits: 32-bit compares, one pointer step per tile
                    vs = ar_s < vis - c0
                score = gl.where(vs, _round_out(score, ROUND), float("-inf"))
                gl.store(out_row + c0 + ar_s, score, mask=ar_s < n_cols - c0)
            async_copy.wait_group(0)
        _timeline_stamp(dbg_ptr, prog, 2, TIMELINE)

    @gluon.jit
    def _q_perm_dims_fp8(kap):
        """Record dim behind K index ``kap`` of the fp8 tile: ``kap = 64 m1 + 32 m0 + 16 t +
        4 c + b`` is code ``8 m + 4 t + b`` (``m = 2 m1 + m0``) of block ``c``."""
        b = kap & 3
        c = (kap >> 2) & 3
        t = (kap >> 4) & 1
        m = (kap >> 5) & 3
        return 32 * c + 8 * m + 4 * t + b

    @gluon.jit
    def _pow2_floor_bits(amax):
        """fp32 bits of the power of two p <= amax (1 for amax = 0; at most 2^126)."""
        return gl.where(amax >= 1.1754943508222875e-38,
                        gl.minimum(amax.to(gl.int32, bitcast=True) & 0x7F800000, 253 << 23), 127 << 23)



_TABLES: dict = {}


def _e4m3_tables(device: torch.device) -> torch.Tensor:
    """The kernel's e4m3 lookup tables, built once per device (by device ops: no host sync)."""
    if device not in _TABLES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # inside a capture the table would only be filled when the graph replays
            raise RuntimeError("indexer mode 5 builds its lookup tables on its first call: make one "
                               "call outside CUDA-graph capture first (vLLM's warm-up does)")
        _TABLES[device] = e4m3_lookup_tables(device)
    return _TABLES[device]


_CTAS_PER_SM: dict = {}  # kernel variant -> CTAs resident per SM (from its registers and shared memory)


def _resident_ctas(kernel) -> int:
    """CTAs of 4 warps one SM holds, from a compiled kernel's registers (64K per SM, allocated
    per warp in units of 256) and shared memory (228 KiB per SM, 1 KiB reserved per CTA)."""
    try:
        regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
        by_regs = 65536 // (regs_per_warp * 4)
        by_smem = (228 << 10) // (kernel.metadata.shared + 1024)
        return max(1, min(by_regs, by_smem, 16))
    except Exception:  # pragma: no cover - a launcher that returns no compiled kernel
        return 7


def program_tiles(tokens: int, row_tiles: int, slots: int) -> int:
    """64-key tiles per program: about five waves of programs over the GPU's ``slots``
    (SMs x resident CTAs), so that the programs still running at the end are short, but no
    program shorter than 16 tiles (each pays for its query set-up and ring fill) unless that
    would fill less than half a wave; at most 256. Rounded so that a token's programs are
    equally long."""
    work = tokens * row_tiles
    tiles = max(-(-work // (5 * slots)), min(16, -(-2 * work // slots)))
    tiles = max(1, min(256, tiles, row_tiles))
    per_token = -(-row_tiles // tiles)
    return -(-row_tiles // per_token)


def gluon_index_scores(q, w, index_cache, block_table, token_req, visible, page_n, cand, cand_block, n_cols,
                       round_code, out, tiles=None, stages=4, num_sms=132, maxnreg=None, timeline=None):
    """Launch the kernel; inputs already checked by ``indexer._check_inputs`` and
    ``gluon_supported``. ``round_code``: 0 fp32, 1 bf16, 2 fp16 scores. ``timeline``: an int64
    ``[programs, 4]`` tensor that gets each program's start, first-tile and end times (global
    ns timer) and its SM (``benchmarks/gpu/indexer.py --timeline``); a debug build."""
    T, H, D = q.shape
    BM = 64
    sparse = cand is not None
    # scale words are copied 4 keys (16 bytes) at a time where 4 columns are 4 slots of one page
    srows = 4 if not sparse or (cand_block % 4 == 0 and page_n % cand_block == 0) else 1
    hp = max(16, triton.next_power_of_2(H))
    variant = (q.device, hp, page_n, stages, sparse, round_code, srows, maxnreg)
    if tiles is None:
        tiles = program_tiles(T, triton.cdiv(n_cols, BM), num_sms * _CTAS_PER_SM.get(variant, 7))
    cptr = cand if sparse else block_table
    grid = (triton.cdiv(n_cols, BM * tiles), T)
    kernel = _index_scores_gluon_kernel[grid](
        q, q.stride(0), q.stride(1), w, w.stride(0),
        index_cache, index_cache.stride(0), block_table, block_table.stride(0),
        token_req, visible, cptr, cptr.stride(0), out, out.stride(0), n_cols,
        _e4m3_tables(q.device), tiles, out if timeline is None else timeline,
        H=H, HP=hp, PAGE_N=page_n, STAGES=stages,
        CB=cand_block if sparse else 1, SPARSE=sparse, ROUND=round_code, SROWS=srows, num_warps=4,
        TIMELINE=timeline is not None, **({"maxnreg": maxnreg} if maxnreg else {}),
        **pdl_args(q.device),
    )
    if variant not in _CTAS_PER_SM:
        _CTAS_PER_SM[variant] = _resident_ctas(kernel)
    return out
