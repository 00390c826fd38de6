"""Sparse MLA decode on Hopper in Gluon, warp-specialised and persistent (sm90 only).

Same semantics and reference as ``sparse_mla_decode.sparse_mla_decode`` (window MXFP8 keys, top-k NVFP4
keys, sink in the denominator, keys = values), for bf16 q, D = 512, 64 heads per work item. The tiles
equal the Triton kernel's (e2m1 times its e4m3 scale and e4m3 times 2^k are exact in bf16); logits,
softmax and accumulation are fp32. Why: the Triton kernel runs the dequantisation and both matmuls in one
instruction stream; here three warpgroups of one CTA overlap them, handing 64-key tiles over two
shared-memory buffers: the producer (4 warps) gathers and dequantises a tile (the compressed tiles'
entries -> block ids -> records loads kept a tile apart) and copies later items' Q; the softmax warpgroup
computes S, the online softmax, P and ``O[:, :256]``; a second PV warpgroup computes ``O[:, 256:]`` (a
``[64, 256]`` fp32 half takes 128 registers per thread; FlashMLA's decode splits the same way).
Persistent CTAs (one per SM) take (token, split, head block) items in turn, so the producer runs into the
next item; ``num_splits`` > 1 (small batches) uses the Triton kernel's combine step. No partition may
convert layouts through shared memory (Triton 3.6 puts that scratch where partitions read their captured
arguments and corrupts them; the softmax's conversions are checked ``assert_trivial``).
Design notes, measurements and rejected variants: benchmarks/README.md.
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.triton.pdl import gluon_grid_wait, pdl_args

try:  # Gluon ships with Triton >= 3.5; this file targets the Hopper API of 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                   warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = ["GLUON_AVAILABLE", "gluon_decode", "gluon_decode_supported"]

GLUON_AVAILABLE = gluon is not None

_LOG2E = 1.4426950408889634


def gluon_decode_supported(q: torch.Tensor, caches: list[torch.Tensor]) -> bool:
    """sm90, bf16, D = 512, caches whose pages start 16-byte aligned (records are read as
    32-bit words, 16 bytes at a time)."""
    if not (GLUON_AVAILABLE and q.is_cuda and q.dtype == torch.bfloat16 and q.shape[-1] == 512):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(c.data_ptr() % 16 == 0 and c.stride(0) % 16 == 0 for c in caches)


# Inline PTX of the producer's decode (plain strings: ``tests/ops/test_decode_ptx.py`` runs them
# through a PTX-subset interpreter on the CPU, bit for bit against ``ops/quant.py``).

# e2m1 codes -> bf16 by byte-permute tables, then times the block's bf16 scale (exact: the
# product has <= 6 significant bits and lies in [2^-10, 2688]). ``prmt`` with the codes as
# selectors looks up the low and high bytes of bf16(|code|) (magnitude bits only). The sign:
# one more ``prmt`` picks, for each code, the byte whose top bit is the code's sign bit (bit
# 3 of an even code is the top bit of its byte in ``x << 4``, of an odd code in ``x``); that
# bit, masked, goes into the high byte. Two more ``prmt`` interleave low and high bytes.
# In: $8 = 4 bytes (8 codes, dim 2b in byte b's low nibble), $9 = bf16x2 scale.
# Out: 8 bf16, dims 0..7. 21 instructions per 8 values (ptxas fuses each and/or pair).
def _fp4_quad_ptx(mag: str, sign_sel: str, out: int) -> str:
    """PTX for 4 codes: magnitude selectors ``mag``, sign selector ``sign_sel`` (into ``xs``
    = ``x << 4`` and ``x``) -> $out..$out+3."""
    return f"""prmt.b32 pl, 0xC0800000, 0xC0804000, {mag};
prmt.b32 ph, 0x3F3F3F00, 0x40404040, {mag};
prmt.b32 sg, xs, $8, {sign_sel};
and.b32 sg, sg, 0x80808080;
or.b32 ph, ph, sg;
prmt.b32 r, pl, ph, 0x5140;
mul.rn.bf16x2 r, r, $9;
mov.b32 {{${out}, ${out + 1}}}, r;
prmt.b32 r, pl, ph, 0x7362;
mul.rn.bf16x2 r, r, $9;
mov.b32 {{${out + 2}, ${out + 3}}}, r;
"""

# signs of codes 0..3: bytes 0 of xs, 0 of x, 1 of xs, 1 of x; of codes 4..7: bytes 2 and 3
FP4_WORD_PTX = ("""{
.reg .b32 m, mh, xs, pl, ph, sg, r;
and.b32 m, $8, 0x77777777;
shr.b32 mh, m, 16;
shl.b32 xs, $8, 4;
""" + _fp4_quad_ptx("m", "0x5140", 0) + _fp4_quad_ptx("mh", "0x7362", 4) + "}")

# e4m3 scale byte -> bf16x2 (the scale in both halves), exactly.
FP4_SCALE_PTX = """{
.reg .b32 t;
.reg .b16 lo, hi;
.reg .f32 v;
prmt.b32 t, $1, 0, 0x4400;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 t, lo;
mov.b32 {lo, hi}, t;
cvt.f32.f16 v, lo;
cvt.rn.bf16x2.f32 $0, v, v;
}"""

# 4 e4m3 bytes times 2^k (fp32 $5) -> 4 bf16 (exact unless the product leaves bf16's range).
FP8_WORD_PTX = """{
.reg .b32 f0, f1;
.reg .b16 q0, q1, g0, g1;
.reg .f32 v0, v1, v2, v3;
mov.b32 {q0, q1}, $4;
cvt.rn.f16x2.e4m3x2 f0, q0;
cvt.rn.f16x2.e4m3x2 f1, q1;
mov.b32 {g0, g1}, f0;
cvt.f32.f16 v0, g0;
cvt.f32.f16 v1, g1;
mov.b32 {g0, g1}, f1;
cvt.f32.f16 v2, g0;
cvt.f32.f16 v3, g1;
mul.rn.f32 v0, v0, $5;
mul.rn.f32 v1, v1, $5;
mul.rn.f32 v2, v2, $5;
mul.rn.f32 v3, v3, $5;
cvt.rn.bf16.f32 $0, v0;
cvt.rn.bf16.f32 $1, v1;
cvt.rn.bf16.f32 $2, v2;
cvt.rn.bf16.f32 $3, v3;
}"""


# Output rows leave as 16-byte stores: in a wgmma accumulator a thread holds 2 adjacent
# columns of every 8, so the 4 threads of a quad swap words (a 4 x 4 transpose over two
# butterfly shuffles) until each holds 8 adjacent columns. Direct 4-byte stores cost 4x
# the memory requests and held the epilogue up for ~5500 cycles.
# In: $1..$4 = this thread's words for column groups 4 k + 0..3 (2 columns each), $5 =
# the address of its 16 bytes after the exchange, $6 = store or not.
STORE16_PTX = """{
.reg .b32 lq, s0, s1, r0, r1, c0, c1, c2, c3;
.reg .pred b0, b1, pm;
mov.u32 lq, %laneid;
and.b32 s0, lq, 1;
setp.ne.u32 b0, s0, 0;
and.b32 s0, lq, 2;
setp.ne.u32 b1, s0, 0;
selp.b32 s0, $1, $2, b0;
selp.b32 s1, $3, $4, b0;
shfl.sync.bfly.b32 r0, s0, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 r1, s1, 1, 0x1f, 0xffffffff;
selp.b32 c0, r0, $1, b0;
selp.b32 c1, $2, r0, b0;
selp.b32 c2, r1, $3, b0;
selp.b32 c3, $4, r1, b0;
selp.b32 s0, c0, c2, b1;
selp.b32 s1, c1, c3, b1;
shfl.sync.bfly.b32 r0, s0, 2, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 r1, s1, 2, 0x1f, 0xffffffff;
selp.b32 s0, r0, c0, b1;
selp.b32 s1, r1, c1, b1;
selp.b32 c0, c2, r0, b1;
selp.b32 c1, c3, r1, b1;
setp.ne.s32 pm, $6, 0;
@pm st.global.v4.b32 [$5], {s0, s1, c0, c1};
mov.b32 $0, 0;
}"""

# Split (partial) outputs are fp32: a thread's 2 adjacent columns of a group are 8 bytes, so
# lane pairs (l, l ^ 1) swap one pair of two groups A, B: the even lane then holds 4 adjacent
# columns of A, the odd lane 4 of B, one 16-byte store each (was two 8-byte ones).
# In: $1, $2 = columns 2 q, 2 q + 1 of group A; $3, $4 = the same of group B (q = lane % 4);
# $5 = the address of its 16 bytes (columns 2 q of A if q is even, 2 q - 2 of B if odd);
# $6 = store or not.
STORE16_F32_PTX = """{
.reg .b32 lq, s0, s1, r0, r1, w0, w1, w2, w3;
.reg .pred odd, pm;
mov.u32 lq, %laneid;
and.b32 lq, lq, 1;
setp.ne.u32 odd, lq, 0;
selp.b32 s0, $1, $3, odd;
selp.b32 s1, $2, $4, odd;
shfl.sync.bfly.b32 r0, s0, 1, 0x1f, 0xffffffff;
shfl.sync.bfly.b32 r1, s1, 1, 0x1f, 0xffffffff;
selp.b32 w0, r0, $1, odd;
selp.b32 w1, r1, $2, odd;
selp.b32 w2, $3, r0, odd;
selp.b32 w3, $4, r1, odd;
setp.ne.s32 pm, $6, 0;
@pm st.global.v4.b32 [$5], {w0, w1, w2, w3};
mov.b32 $0, 0;
}"""

if GLUON_AVAILABLE:
    _FP4_WORD_PTX = gl.constexpr(FP4_WORD_PTX)
    _FP4_SCALE_PTX = gl.constexpr(FP4_SCALE_PTX)
    _FP8_WORD_PTX = gl.constexpr(FP8_WORD_PTX)
    _STORE16_PTX = gl.constexpr(STORE16_PTX)
    _STORE16_F32_PTX = gl.constexpr(STORE16_F32_PTX)

    @gluon.jit
    def _stamp(dbg_ptr, ev, it, item, NT: gl.constexpr, GLOBAL: gl.constexpr = False):
        """Debug timing: the SM clock (``GLOBAL``: the global nanosecond timer) at event ``ev`` of
        tile ``it`` of work item ``item`` (one row of 16 events per item)."""
        if NT > 0:
            if GLOBAL:
                c = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [it], dtype=gl.int64,
                                              is_pure=False, pack=1)
            else:
                c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [it], dtype=gl.int64,
                                              is_pure=False, pack=1)
            gl.store(dbg_ptr + (item.to(gl.int64) * 16 + ev) * NT + it, c)

    @gluon.jit
    def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
        """8 tensors -> one with a trailing [2, 2, 2] (index e + 2 f + 4 g = output e+2f+4g)."""
        return gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))

    # ------------------------------------------------------------------ producer
    # Producer layouts: 128 dims (a "chunk") of the 64 keys of a tile at a time; thread (warp w,
    # lane l) takes key 16 w + l // 2, dims 64 (l % 2) .. + 63 of the chunk.
    # FP4: words [key, h, block b, i] of 8 codes; FP8: words [key, h, b, w] of 4 values.
    _W4 = gl.constexpr(gl.BlockedLayout([1, 1, 4, 2], [16, 2, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0]))
    _W8 = gl.constexpr(gl.BlockedLayout([1, 1, 2, 8], [16, 2, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0]))

    @gluon.jit
    def _words_offsets(c, NB: gl.constexpr, NI: gl.constexpr, WL: gl.constexpr):
        """Word offsets ``c + (NB * NI) h + NI b + i`` as a [1, 2, NB, NI] tensor of layout WL."""
        L3: gl.constexpr = gl.SliceLayout(0, WL)
        hh = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
        bb = gl.arange(0, NB, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
        ii = gl.arange(0, NI, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        off = (c + NB * NI * hh)[:, None, None] + (NI * bb)[None, :, None] + ii[None, None, :]
        return off[None, :, :, :]

    # The same words as one run of 8 per thread (two 16-byte loads instead of four 8-byte ones)
    _W4V = gl.constexpr(gl.BlockedLayout([1, 1, 8], [16, 2, 1], [4, 1, 1], [2, 1, 0]))

    @gluon.jit
    def _fp4_chunk_load(vals, scales, ok, c):
        """Raw bytes of dims 128 c .. 128 c + 127 of each thread's key (``vals`` / ``scales``:
        the record's value and scale bases, ``ok``: read it): 8 words and 1 scale word."""
        KV: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _W4V))
        wp = gl.convert_layout(vals.to(gl.pointer_type(gl.int32)), KV, assert_trivial=True)
        okv = gl.convert_layout(ok, KV, assert_trivial=True)
        hh = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(0, _W4V)))
        ww = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, _W4V)))
        off = (16 * c + 8 * hh)[:, None] + ww[None, :]
        run = gl.load(wp[:, None, None] + off[None, :, :], mask=okv[:, None, None], other=0)
        words = gl.convert_layout(gl.reshape(run, [64, 2, 4, 2]), _W4, assert_trivial=True)
        hs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, _W4))))
        sp = scales.to(gl.pointer_type(gl.int32))
        scl = gl.load(sp[:, None] + (2 * c + hs)[None, :], mask=ok[:, None], other=0)
        return words, scl

    @gluon.jit
    def _fp4_tile_load(vals, scales, ok):
        w0, s0 = _fp4_chunk_load(vals, scales, ok, 0)
        w1, s1 = _fp4_chunk_load(vals, scales, ok, 1)
        w2, s2 = _fp4_chunk_load(vals, scales, ok, 2)
        w3, s3 = _fp4_chunk_load(vals, scales, ok, 3)
        return w0, w1, w2, w3, s0, s1, s2, s3

    @gluon.jit
    def _fp4_chunk_store(words, scl, dst):
        """Decode one chunk (``_fp4_chunk_load``) and store it as bf16 into ``dst`` [64, 128]."""
        bs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _W4))))
        sb = (scl[:, :, None] >> (8 * bs)[None, None, :]) & 255
        f = gl.inline_asm_elementwise(_FP4_SCALE_PTX, "=r,r", [sb], dtype=gl.int32, is_pure=True, pack=1)
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _FP4_WORD_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, gl.expand_dims(f, 3)],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
        x = _join8(o0, o1, o2, o3, o4, o5, o6, o7)  # [64, h, b, i, e, f, g]
        x = gl.permute(x, [0, 1, 2, 3, 6, 5, 4])
        dst.store(gl.reshape(x, [64, 128]))  # dim 64 h + 16 b + 8 i + 4 g + 2 f + e

    @gluon.jit
    def _fp8_chunk_load(vals, scales, ok, c):
        """Raw bytes of dims 128 c .. + 127: 16 words (4 values each) and 2 UE8M0 bytes."""
        wp = vals.to(gl.pointer_type(gl.int32))
        words = gl.load(wp[:, None, None, None] + _words_offsets(32 * c, 2, 8, _W8),
                        mask=ok[:, None, None, None], other=0)
        SL: gl.constexpr = gl.SliceLayout(3, _W8)
        hs = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(0, SL)))
        bs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, SL)))
        soff = (4 * c + 2 * hs)[:, None] + bs[None, :]
        scl = gl.load(scales[:, None, None] + soff[None, :, :], mask=ok[:, None, None], other=127)
        return words, scl

    @gluon.jit
    def _fp8_chunk_store(words, scl, dst):
        si = scl.to(gl.int32)
        bits = gl.where(si == 0, 0x400000, si << 23)
        bits = gl.where(si == 255, 0x7FC00000, bits)
        f = gl.expand_dims(bits.to(gl.float32, bitcast=True), 3)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _FP8_WORD_PTX, "=h,=h,=h,=h,r,f", [words, f], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1)
        x = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [64, h, b, w, e, f]
        x = gl.permute(x, [0, 1, 2, 3, 5, 4])
        dst.store(gl.reshape(x, [64, 128]))  # dim 64 h + 32 b + 4 w + 2 f + e

    @gluon.jit
    def _window_valid(i, pos, lo, n, W: gl.constexpr):
        """Positions and validity of window tile ``i``'s keys ``n``: positions ``pos - W + 1 +
        64 i + n`` that are visible (from ``lo``); invalid keys are never read."""
        j = i * 64 + n
        kp = pos - (W - 1) + j
        ok = (j < W) & (kp >= lo)
        return gl.where(ok, kp, 0), ok

    @gluon.jit
    def _window_blocks(i, pos, lo, req, n, w_bt_ptr, w_bt_stride, W: gl.constexpr, W_BS: gl.constexpr):
        """Block ids of the pages holding window tile ``i``'s keys."""
        kp, ok = _window_valid(i, pos, lo, n, W)
        return gl.load(w_bt_ptr + req * w_bt_stride + kp // W_BS, mask=ok, other=0)

    @gluon.jit
    def _window_records(i, pos, lo, blk, n, w_cache_ptr, w_block_stride, W: gl.constexpr, W_BS: gl.constexpr,
                        D: gl.constexpr):
        """Value and scale bases of window tile ``i``'s keys in blocks ``blk``, and their validity."""
        kp, ok = _window_valid(i, pos, lo, n, W)
        base = w_cache_ptr + blk.to(gl.int64) * w_block_stride
        slot = kp % W_BS
        return base + slot * D, base + W_BS * D + slot * (D // 32), ok

    # A compressed tile's keys take three dependent loads: its top-k entries, then their
    # pages' block ids, then the records. The producer keeps each stage one tile apart and
    # carries the raw loaded values across iterations, so no load is waited for in the
    # iteration that issued it.
    @gluon.jit
    def _comp_entries(i, live, t, n, topk_ptr, topk_stride, K: gl.constexpr, NW: gl.constexpr):
        """Entries ``topk[t, 64 (i - NW) + n]`` of compressed tile ``i`` (-1: none; none read
        unless ``live``)."""
        j = (i - NW) * 64 + n
        return gl.load(topk_ptr + t.to(gl.int64) * topk_stride + j, mask=(j < K) & live, other=-1).to(gl.int32)

    @gluon.jit
    def _comp_blocks(e, req, c_bt_ptr, c_bt_stride, C_BS: gl.constexpr, RATIO: gl.constexpr):
        """Block ids of the pages holding entries ``e``."""
        ok = e >= 0
        return gl.load(c_bt_ptr + req * c_bt_stride + (gl.where(ok, e, 0) * RATIO) // C_BS, mask=ok, other=0)

    @gluon.jit
    def _comp_records(e, blk, c_cache_ptr, c_block_stride, C_BS: gl.constexpr, RATIO: gl.constexpr,
                      D: gl.constexpr):
        """Value and scale bases of entries ``e`` in blocks ``blk``, and their validity."""
        ok = e >= 0
        base = c_cache_ptr + blk.to(gl.int64) * c_block_stride
        slot = ((gl.where(ok, e, 0) * RATIO) % C_BS) // RATIO
        return base + slot * (D // 2), base + (C_BS // RATIO) * (D // 2) + slot * (D // 16), ok

    @gluon.jit
    def _item_info(item, pos_ptr, lo_ptr, req_ptr, num_splits, HB: gl.constexpr, W: gl.constexpr,
                   NW: gl.constexpr, NT: gl.constexpr, PARTIAL: gl.constexpr):
        """Work item -> (token, split, first head, position, lowest visible position, request,
        first tile, tile count). Items are (token, split, head block), head block fastest."""
        h0 = (item % HB) * 64
        split = (item // HB) % num_splits
        t = item // (HB * num_splits)
        pos = gl.load(pos_ptr + t).to(gl.int32)
        lo = gl.maximum(gl.load(lo_ptr + t).to(gl.int32), 0)
        req = gl.load(req_ptr + t).to(gl.int64)
        if PARTIAL:
            t0 = (split * NT) // num_splits
            t1 = ((split + 1) * NT) // num_splits
        else:
            t0 = 0
            t1 = NT
        # window tiles before the first visible position hold no key: skip them
        w_first = gl.maximum(lo - (pos - (W - 1)), 0) // 64
        i0 = gl.maximum(t0, gl.minimum(w_first, NW))
        return t, split, h0, pos, lo, req, i0, gl.maximum(t1 - i0, 0)

    @gluon.jit
    def _publish(ok_s, k_ready, b, ok, it, item, dbg_ptr, DBG_NT: gl.constexpr):
        """Tile ``it`` is in buffer ``b``: its keys' validity, then the hand-over (the fence
        orders the generic-proxy stores before the consumers' wgmma reads)."""
        ok_s.index(b).store(ok.to(gl.int32))
        _stamp(dbg_ptr, 1, it, item, DBG_NT)
        fence_async_shared()
        mbarrier.arrive(k_ready.index(b), count=1)

    # Q copies: thread (warp w, lane l) copies 16-byte pieces of rows 16 w + 8 (l // 16) .. + 7
    _QL = gl.constexpr(gl.BlockedLayout([8, 8], [2, 16], [4, 1], [1, 0]))

    @gluon.jit
    def _load_q_now(q_s, item, num_splits, q_ptr, stride_qt, stride_qh, H, HB: gl.constexpr):
        """``item``'s Q into ``q_s`` through registers (all loads first, then the stores)."""
        QL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        h0 = (item % HB) * 64
        t = item // (HB * num_splits)
        hq = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, QL))
        dq = gl.arange(0, 128, layout=gl.SliceLayout(0, QL))
        q_row = q_ptr + t.to(gl.int64) * stride_qt + hq[:, None] * stride_qh
        ok = (hq < H)[:, None]
        x0 = gl.load(q_row + dq[None, :], mask=ok, other=0.0)
        x1 = gl.load(q_row + (128 + dq)[None, :], mask=ok, other=0.0)
        x2 = gl.load(q_row + (256 + dq)[None, :], mask=ok, other=0.0)
        x3 = gl.load(q_row + (384 + dq)[None, :], mask=ok, other=0.0)
        q_s.slice(0, 128, dim=1).store(x0)
        q_s.slice(128, 128, dim=1).store(x1)
        q_s.slice(256, 128, dim=1).store(x2)
        q_s.slice(384, 128, dim=1).store(x3)
        fence_async_shared()

    @gluon.jit
    def _load_q(q_s, q_ready, item, num_splits, q_ptr, stride_qt, stride_qh, H, HB: gl.constexpr):
        """cp.async of item ``item``'s Q ``[64 heads, 512]`` into ``q_s``; every thread's copies
        arrive on ``q_ready`` (128 arrivals) when they land."""
        h0 = (item % HB) * 64
        t = item // (HB * num_splits)
        hq = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, _QL))
        dq = gl.arange(0, 128, layout=gl.SliceLayout(0, _QL))
        q_row = q_ptr + t.to(gl.int64) * stride_qt + hq[:, None] * stride_qh
        for c in gl.static_range(4):
            async_copy.async_copy_global_to_shared(q_s.slice(128 * c, 128, dim=1), q_row + (128 * c + dq)[None, :],
                                                   mask=(hq < H)[:, None] & (dq >= 0)[None, :])
        async_copy.mbarrier_arrive(q_ready, increment_count=False)

    @gluon.jit
    def _producer_q(q_s, q_ready, k_free, g0, item, num_splits, q_ptr, stride_qt, stride_qh, H, q_desc,
                    HB: gl.constexpr, Q_TMA: gl.constexpr, dbg_ptr, DBG_NT: gl.constexpr):
        """Q of ``item`` into ``q_s`` once the last tile before the item (``g0 - 1``) is freed:
        its S, the last read of the previous Q, is done by then. ``Q_TMA``: eight 64 x 64 TMA
        boxes of the ``[T * H, 512]`` view (one thread issues them; they do not queue behind
        the record gathers), else per-thread cp.async."""
        if g0 > 0:
            mbarrier.wait(k_free.index((g0 - 1) % 2), ((g0 - 1) // 2) & 1)
        _stamp(dbg_ptr, 3, 1, item, DBG_NT)
        if Q_TMA:
            row = (item // (HB * num_splits)) * H + (item % HB) * 64
            mbarrier.expect(q_ready, 64 * 512 * 2)
            for c in gl.static_range(8):
                tma.async_copy_global_to_shared(q_desc, [row, 64 * c], q_ready, q_s.slice(64 * c, 64, dim=1))
        else:
            _load_q(q_s, q_ready, item, num_splits, q_ptr, stride_qt, stride_qh, H, HB)
        _stamp(dbg_ptr, 3, 2, item, DBG_NT)

    @gluon.jit
    def _producer(q_s, k_s, ok_s, q_ready, k_ready, k_free, pid, num_programs, num_items, num_splits,
                  q_ptr, stride_qt, stride_qh, H, q_desc, Q_TMA: gl.constexpr,
                  pos_ptr, lo_ptr, req_ptr, topk_ptr, topk_stride,
                  w_cache_ptr, w_block_stride, w_bt_ptr, w_bt_stride,
                  c_cache_ptr, c_block_stride, c_bt_ptr, c_bt_stride,
                  W: gl.constexpr, W_BS: gl.constexpr, K: gl.constexpr, C_BS: gl.constexpr,
                  RATIO: gl.constexpr, NW: gl.constexpr, NT: gl.constexpr, HB: gl.constexpr,
                  PARTIAL: gl.constexpr, D: gl.constexpr, dbg_ptr, DBG_NT: gl.constexpr):
        """Worker: copies each item's Q in and fills the two tile buffers in turn, item after
        item (up to two tiles ahead of the consumers, into the next item while they finish
        one). The compressed tiles' loads are pipelined: while tile j is decoded, tile j + 1's
        record bytes, tile j + 2's block ids and tile j + 3's entries are in flight (the
        window tiles, at most two, are not pipelined)."""
        # (no convert_layout in this partition: Triton 3.6 puts its scratch buffer where the
        # partitions' captured arguments live, and another partition may not have read them yet)
        n4 = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _W4))))
        n8 = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _W8))))
        g = 0  # tiles produced so far: buffer g % 2, its (g // 2)-th use
        for item in range(pid, num_items, num_programs):
            _stamp(dbg_ptr, 3, 0, item, DBG_NT)
            t, split, h0, pos, lo, req, i0, n_tiles = _item_info(item, pos_ptr, lo_ptr, req_ptr, num_splits,
                                                                 HB, W, NW, NT, PARTIAL)
            n_w = gl.minimum(gl.maximum(NW - i0, 0), n_tiles)
            n_c = n_tiles - n_w
            c0 = i0 + n_w
            # the first compressed tiles' entries go out now, behind the window tiles
            e0 = _comp_entries(c0, n_c > 0, t, n4, topk_ptr, topk_stride, K, NW)
            e1 = _comp_entries(c0 + 1, n_c > 1, t, n4, topk_ptr, topk_stride, K, NW)
            e2 = _comp_entries(c0 + 2, n_c > 2, t, n4, topk_ptr, topk_stride, K, NW)
            g0 = g
            if (n_tiles > 0) & (item != pid):  # this item's Q, once the last one is read
                _producer_q(q_s, q_ready, k_free, g0, item, num_splits, q_ptr, stride_qt, stride_qh, H, q_desc,
                            HB, Q_TMA, dbg_ptr, DBG_NT)
            wblk = _window_blocks(i0, pos, lo, req, n8, w_bt_ptr, w_bt_stride, W, W_BS)
            for it in range(n_w):
                _stamp(dbg_ptr, 0, it, item, DBG_NT)
                b = g % 2
                vals, scales, ok = _window_records(i0 + it, pos, lo, wblk, n8, w_cache_ptr, w_block_stride, W,
                                                   W_BS, D)
                # the next window tile's block ids: a tile ahead, like the compressed chain
                wblk = _window_blocks(i0 + it + 1, pos, lo, req, n8, w_bt_ptr, w_bt_stride, W, W_BS)
                dst = k_s.index(b)
                # all four chunks' loads go out before the wait for the buffer
                w0, s0 = _fp8_chunk_load(vals, scales, ok, 0)
                w1, s1 = _fp8_chunk_load(vals, scales, ok, 1)
                w2, s2 = _fp8_chunk_load(vals, scales, ok, 2)
                w3, s3 = _fp8_chunk_load(vals, scales, ok, 3)
                mbarrier.wait(k_free.index(b), ((g // 2) & 1) ^ 1)
                _stamp(dbg_ptr, 2, it, item, DBG_NT)
                _fp8_chunk_store(w0, s0, dst.slice(0, 128, dim=1))
                _fp8_chunk_store(w1, s1, dst.slice(128, 128, dim=1))
                _fp8_chunk_store(w2, s2, dst.slice(256, 128, dim=1))
                _fp8_chunk_store(w3, s3, dst.slice(384, 128, dim=1))
                _publish(ok_s, k_ready, b, ok, it, item, dbg_ptr, DBG_NT)
                g += 1

            blk0 = _comp_blocks(e0, req, c_bt_ptr, c_bt_stride, C_BS, RATIO)
            blk1 = _comp_blocks(e1, req, c_bt_ptr, c_bt_stride, C_BS, RATIO)
            v, sc, ok = _comp_records(e0, blk0, c_cache_ptr, c_block_stride, C_BS, RATIO, D)
            w0, w1, w2, w3, s0, s1, s2, s3 = _fp4_tile_load(v, sc, ok)
            for jt in range(n_c):
                it = n_w + jt
                _stamp(dbg_ptr, 0, it, item, DBG_NT)
                b = g % 2
                v, sc, ok_n = _comp_records(e1, blk1, c_cache_ptr, c_block_stride, C_BS, RATIO, D)
                x0, x1, x2, x3, y0, y1, y2, y3 = _fp4_tile_load(v, sc, ok_n)
                blk2 = _comp_blocks(e2, req, c_bt_ptr, c_bt_stride, C_BS, RATIO)
                e3 = _comp_entries(c0 + jt + 3, jt + 3 < n_c, t, n4, topk_ptr, topk_stride, K, NW)
                dst = k_s.index(b)
                mbarrier.wait(k_free.index(b), ((g // 2) & 1) ^ 1)
                _stamp(dbg_ptr, 2, it, item, DBG_NT)
                _fp4_chunk_store(w0, s0, dst.slice(0, 128, dim=1))
                _fp4_chunk_store(w1, s1, dst.slice(128, 128, dim=1))
                _fp4_chunk_store(w2, s2, dst.slice(256, 128, dim=1))
                _fp4_chunk_store(w3, s3, dst.slice(384, 128, dim=1))
                _publish(ok_s, k_ready, b, ok, it, item, dbg_ptr, DBG_NT)
                w0, w1, w2, w3, s0, s1, s2, s3 = x0, x1, x2, x3, y0, y1, y2, y3
                ok = ok_n
                e1 = e2
                blk1 = blk2
                e2 = e3
                g += 1

    # ------------------------------------------------------------------ consumers
    # wgmma accumulator layouts: S [64 heads, 64 keys] and one output half [64, 256]
    _MS = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 16]))
    _MO = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 16]))
    @gluon.jit
    def _softmax_step(s, it, g, item, m_i, l_i, acc, k_s, ok_s, p_s, a_s, k_free, p_ready, p_free,
                      qk_scale, dbg_ptr, DBG_NT: gl.constexpr):
        """The softmax warpgroup's work on tile ``it`` (the ``g``-th tile of this program) once
        its logits ``s`` are in registers: online softmax, P and alpha to shared memory,
        ``O[:, :256] += P K[:, :256]``."""
        MS: gl.constexpr = _MS
        MO: gl.constexpr = _MO
        PA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MO, k_width=2)
        RO: gl.constexpr = gl.SliceLayout(1, MO)
        b = g % 2
        okv = ok_s.index(b).load(gl.SliceLayout(0, MS))
        s = gl.where((okv != 0)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        pb = p.to(gl.bfloat16)
        _stamp(dbg_ptr, 6, it, item, DBG_NT)
        mbarrier.wait(p_free, (g & 1) ^ 1)  # the other warpgroup is done with the last P
        _stamp(dbg_ptr, 7, it, item, DBG_NT)
        p_s.store(pb)
        a_s.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
        acc = acc * gl.convert_layout(alpha, RO, assert_trivial=True)[:, None]
        tok = warpgroup_mma(gl.convert_layout(pb, PA, assert_trivial=True), k_s.index(b).slice(0, 256, dim=1),
                            acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[tok])
        _stamp(dbg_ptr, 8, it, item, DBG_NT)
        mbarrier.arrive(k_free.index(b), count=1)
        return m_new, l_i, acc

    @gluon.jit
    def _softmax_pv0(q_s, k_s, ok_s, p_s, a_s, l_s, q_ready, k_ready, k_free, p_ready, p_free, fin, l_free,
                     pid, num_programs, num_items, num_splits, pos_ptr, lo_ptr, req_ptr,
                     q_ptr, stride_qt, stride_qh, sink_ptr, qk_scale, H, T,
                     out_ptr, stride_ot, stride_oh, part_acc_ptr, part_m_ptr, part_l_ptr,
                     W: gl.constexpr, NW: gl.constexpr, NT: gl.constexpr, HB: gl.constexpr,
                     HAS_SINK: gl.constexpr, H_PAD: gl.constexpr, PARTIAL: gl.constexpr,
                     dbg_ptr, DBG_NT: gl.constexpr):
        """Default partition, item after item: S, the online softmax, P and alpha for the other
        warpgroup, and the first half of the output."""
        MS: gl.constexpr = _MS
        MO: gl.constexpr = _MO
        RS: gl.constexpr = gl.SliceLayout(1, MS)
        RO: gl.constexpr = gl.SliceLayout(1, MO)
        # the first item's Q: loaded here while the producer starts on its tiles (later items'
        # come in by TMA or cp.async from the producer, behind the item before). Not for an item
        # without tiles: the producer may then copy the next item's Q in at once.
        n_first = _item_info(pid, pos_ptr, lo_ptr, req_ptr, num_splits, HB, W, NW, NT, PARTIAL)[7]
        if n_first > 0:
            _load_q_now(q_s, pid, num_splits, q_ptr, stride_qt, stride_qh, H, HB)
        s0 = gl.zeros([64, 64], gl.float32, MS)
        g = 0  # tiles consumed so far
        n_done = 0  # items finished so far
        n_q = 0  # Qs used so far (items with tiles)
        for item in range(pid, num_items, num_programs):
            _stamp(dbg_ptr, 12, 0, item, DBG_NT)
            _stamp(dbg_ptr, 14, 0, item, DBG_NT, True)
            t, split, h0, pos, lo, req, i0, n_tiles = _item_info(item, pos_ptr, lo_ptr, req_ptr, num_splits,
                                                                 HB, W, NW, NT, PARTIAL)
            hr = h0 + gl.arange(0, 64, layout=RS)
            if HAS_SINK:
                sink = gl.load(sink_ptr + hr, mask=hr < H, other=0.0).to(gl.float32) * 1.4426950408889634
                m_i = gl.where(split == 0, sink, -1.0e30)
                l_i = gl.where(split == 0, 1.0, 0.0) + gl.zeros([64], gl.float32, RS)
            else:
                m_i = gl.full([64], -1.0e30, gl.float32, RS)
                l_i = gl.zeros([64], gl.float32, RS)
            acc = gl.zeros([64, 256], gl.float32, MO)
            if (n_tiles > 0) & (item != pid):  # the producer copied this item's Q in
                mbarrier.wait(q_ready, n_q & 1)
                fence_async_shared()  # the copies (generic proxy) before the wgmma reads (async proxy)
                n_q += 1
            _stamp(dbg_ptr, 9, 0, item, DBG_NT)
            for it in range(n_tiles):
                mbarrier.wait(k_ready.index(g % 2), (g // 2) & 1)
                _stamp(dbg_ptr, 4, it, item, DBG_NT)
                s = warpgroup_mma(q_s, k_s.index(g % 2).permute((1, 0)), s0, use_acc=False)
                _stamp(dbg_ptr, 5, it, item, DBG_NT)
                m_i, l_i, acc = _softmax_step(s, it, g, item, m_i, l_i, acc, k_s, ok_s, p_s, a_s, k_free,
                                              p_ready, p_free, qk_scale, dbg_ptr, DBG_NT)
                g += 1
            if PARTIAL:
                prow = (split.to(gl.int64) * T + t) * H_PAD + hr
                gl.store(part_m_ptr + prow, m_i)
                gl.store(part_l_ptr + prow, l_i)
                _store_partial_half(acc, part_acc_ptr, (split.to(gl.int64) * T + t) * H_PAD + h0, 0)
            else:
                mbarrier.wait(l_free, (n_done & 1) ^ 1)  # the other warpgroup read the last l
                l_s.store(l_i)
                mbarrier.arrive(fin, count=1)
                inv_l = gl.convert_layout(gl.where(l_i > 0, 1.0 / l_i, 1.0), RO, assert_trivial=True)
                _store_half((acc * inv_l[:, None]).to(gl.bfloat16), out_ptr, t, stride_ot, stride_oh, h0, H, 0)
            _stamp(dbg_ptr, 13, 0, item, DBG_NT)
            _stamp(dbg_ptr, 15, 0, item, DBG_NT, True)
            n_done += 1

    @gluon.jit
    def _pv1(k_s, p_s, a_s, l_s, k_ready, k_free, p_ready, p_free, fin, l_free,
             pid, num_programs, num_items, num_splits, pos_ptr, lo_ptr, req_ptr, H, T,
             out_ptr, stride_ot, stride_oh, part_acc_ptr,
             W: gl.constexpr, NW: gl.constexpr, NT: gl.constexpr, HB: gl.constexpr,
             H_PAD: gl.constexpr, PARTIAL: gl.constexpr, dbg_ptr, DBG_NT: gl.constexpr):
        """Worker: the second half of the output, from the P and alpha in shared memory."""
        MO: gl.constexpr = _MO
        RO: gl.constexpr = gl.SliceLayout(1, MO)
        g = 0
        n_done = 0
        for item in range(pid, num_items, num_programs):
            t, split, h0, pos, lo, req, i0, n_tiles = _item_info(item, pos_ptr, lo_ptr, req_ptr, num_splits,
                                                                 HB, W, NW, NT, PARTIAL)
            acc = gl.zeros([64, 256], gl.float32, MO)
            for it in range(n_tiles):
                b = g % 2
                mbarrier.wait(k_ready.index(b), (g // 2) & 1)
                mbarrier.wait(p_ready, g & 1)
                _stamp(dbg_ptr, 10, it, item, DBG_NT)
                alpha = a_s.load(RO)
                acc = acc * alpha[:, None]
                acc = warpgroup_mma(p_s, k_s.index(b).slice(256, 256, dim=1), acc)
                _stamp(dbg_ptr, 11, it, item, DBG_NT)
                mbarrier.arrive(p_free, count=1)
                mbarrier.arrive(k_free.index(b), count=1)
                g += 1
            if PARTIAL:
                _store_partial_half(acc, part_acc_ptr, (split.to(gl.int64) * T + t) * H_PAD + h0, 256)
            else:
                mbarrier.wait(fin, n_done & 1)
                l_i = l_s.load(RO)
                mbarrier.arrive(l_free, count=1)
                o = (acc * gl.where(l_i > 0, 1.0 / l_i, 1.0)[:, None]).to(gl.bfloat16)
                _store_half(o, out_ptr, t, stride_ot, stride_oh, h0, H, 256)
            n_done += 1

    @gluon.jit
    def _store_half(o, out_ptr, t, stride_ot, stride_oh, h0, H, COL0: gl.constexpr):
        """``o`` (bf16 ``[64, 256]``, wgmma accumulator layout) -> output rows ``h0 ..`` (those
        below ``H``), columns ``COL0 .. COL0 + 255``, 16 bytes per store."""
        lo, hi = gl.split(gl.reshape(o, [64, 128, 2]))
        w = gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32,
                                      is_pure=True, pack=1)  # [row, 4 k + q]: columns 8 k + 2 q, + 1
        w = gl.permute(gl.reshape(w, [64, 8, 4, 4]), [0, 1, 3, 2])  # [row, k // 4, q, k % 4]
        wa, wb = gl.split(gl.reshape(w, [64, 8, 4, 2, 2]))
        w0, w2 = gl.split(wa)
        w1, w3 = gl.split(wb)
        L: gl.constexpr = w0.type.layout
        r = h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        kh = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        # after the exchange, thread q of a quad holds columns 8 (4 (k // 4) + q) .. + 7
        col = COL0 + 8 * (4 * kh[None, :, None] + q[None, None, :])
        row_ptr = out_ptr + t.to(gl.int64) * stride_ot + r.to(gl.int64) * stride_oh
        addr = (row_ptr[:, None, None] + col).to(gl.int64, bitcast=True)
        ok = gl.where(r < H, 1, 0)[:, None, None] + gl.zeros([64, 8, 4], gl.int32, L)
        gl.inline_asm_elementwise(_STORE16_PTX, "=r,r,r,r,r,l,r", [w0, w1, w2, w3, addr, ok], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _store_partial_half(acc, part_acc_ptr, arow0, COL0: gl.constexpr):
        """``acc`` (fp32 ``[64, 256]``, wgmma accumulator layout) -> rows ``arow0 ..`` + 63 of
        the partial accumulator ``[*, 512]``, columns ``COL0 .. COL0 + 255``, 16 bytes per store."""
        x = gl.reshape(acc.to(gl.int32, bitcast=True), [64, 16, 2, 4, 2])  # column 16 m + 8 ab + 2 q + e
        x0, x1 = gl.split(gl.permute(x, [0, 1, 3, 2, 4]))  # [row, m, q, ab] for e = 0, 1
        a0, b0 = gl.split(x0)
        a1, b1 = gl.split(x1)
        L: gl.constexpr = a0.type.layout
        r = gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, L)))
        m = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, L)))
        q = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))
        # after the swap: even lanes columns 2 q .. + 3 of group 2 m, odd lanes 2 q - 2 .. of 2 m + 1
        col = COL0 + 16 * m[None, :, None] + 2 * q[None, None, :] + 6 * (q[None, None, :] & 1)
        row_ptr = part_acc_ptr + (arow0 + r.to(gl.int64)) * 512
        addr = (row_ptr[:, None, None] + col).to(gl.int64, bitcast=True)
        ok = gl.full([64, 16, 4], 1, gl.int32, L)
        gl.inline_asm_elementwise(_STORE16_F32_PTX, "=r,r,r,r,r,l,r", [a0, a1, b0, b1, addr, ok],
                                  dtype=gl.int32, is_pure=False, pack=1)

    # ------------------------------------------------------------------ kernel
    @gluon.jit
    def _decode_kernel(
        q_ptr, stride_qt, stride_qh, q_desc,
        out_ptr, stride_ot, stride_oh,
        part_acc_ptr, part_m_ptr, part_l_ptr,
        sink_ptr, pos_ptr, lo_ptr, req_ptr,
        w_cache_ptr, w_block_stride, w_bt_ptr, w_bt_stride,
        c_cache_ptr, c_block_stride, c_bt_ptr, c_bt_stride,
        topk_ptr, topk_stride,
        T, H, qk_scale, num_splits, num_items,
        D: gl.constexpr, W: gl.constexpr, W_BS: gl.constexpr,
        K: gl.constexpr, C_BS: gl.constexpr, RATIO: gl.constexpr,
        NW: gl.constexpr, NT: gl.constexpr, HB: gl.constexpr, HAS_SINK: gl.constexpr,
        H_PAD: gl.constexpr, PARTIAL: gl.constexpr, Q_TMA: gl.constexpr,
        PV1_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        dbg_ptr, DBG_NT: gl.constexpr,
        PDL: gl.constexpr,
    ):
        gluon_grid_wait(PDL)
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        QSL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
        PSL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
        VL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], QSL)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], QSL)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], PSL)
        ok_s = gl.allocate_shared_memory(gl.int32, [2, 64], VL)
        a_s = gl.allocate_shared_memory(gl.float32, [64], VL)
        l_s = gl.allocate_shared_memory(gl.float32, [64], VL)
        # (separate allocations: slicing one barrier allocation crashes Triton 3.6's lowering)
        BL: gl.constexpr = mbarrier.MBarrierLayout()
        k_ready = gl.allocate_shared_memory(gl.int64, [2, 1], BL)
        k_free = gl.allocate_shared_memory(gl.int64, [2, 1], BL)
        bars = gl.allocate_shared_memory(gl.int64, [6, 1], BL)
        q_ready = bars.index(0)
        p_ready = bars.index(1)
        p_free = bars.index(2)
        fin = bars.index(3)
        l_free = bars.index(4)
        mbarrier.init(k_ready.index(0), count=1)
        mbarrier.init(k_ready.index(1), count=1)
        mbarrier.init(k_free.index(0), count=2)
        mbarrier.init(k_free.index(1), count=2)
        mbarrier.init(q_ready, count=1 if Q_TMA else 128)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(p_free, count=1)
        mbarrier.init(fin, count=1)
        mbarrier.init(l_free, count=1)

        gl.warp_specialize([
            (_softmax_pv0, (q_s, k_s, ok_s, p_s, a_s, l_s, q_ready, k_ready, k_free, p_ready, p_free, fin, l_free,
                            pid, num_programs, num_items, num_splits, pos_ptr, lo_ptr, req_ptr,
                            q_ptr, stride_qt, stride_qh, sink_ptr, qk_scale, H, T,
                            out_ptr, stride_ot, stride_oh, part_acc_ptr, part_m_ptr, part_l_ptr,
                            W, NW, NT, HB, HAS_SINK, H_PAD, PARTIAL, dbg_ptr, DBG_NT)),
            (_pv1, (k_s, p_s, a_s, l_s, k_ready, k_free, p_ready, p_free, fin, l_free,
                    pid, num_programs, num_items, num_splits, pos_ptr, lo_ptr, req_ptr, H, T,
                    out_ptr, stride_ot, stride_oh, part_acc_ptr, W, NW, NT, HB, H_PAD, PARTIAL,
                    dbg_ptr, DBG_NT)),
            (_producer, (q_s, k_s, ok_s, q_ready, k_ready, k_free, pid, num_programs, num_items, num_splits,
                         q_ptr, stride_qt, stride_qh, H, q_desc, Q_TMA, pos_ptr, lo_ptr, req_ptr, topk_ptr, topk_stride,
                         w_cache_ptr, w_block_stride, w_bt_ptr, w_bt_stride,
                         c_cache_ptr, c_block_stride, c_bt_ptr, c_bt_stride,
                         W, W_BS, K, C_BS, RATIO, NW, NT, HB, PARTIAL, D, dbg_ptr, DBG_NT)),
        ], [4, 4], [PV1_REGS, PRODUCER_REGS])


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_Q_BOX_LAYOUT = None
_DUMMY_Q: dict = {}


def _q_descriptor(q: torch.Tensor):
    """A TMA descriptor of ``q`` as ``[T * H, 512]`` (64 x 64 boxes) when its tokens' rows are
    contiguous; else one over a dummy tensor, with the kernel told to copy Q by cp.async."""
    global _Q_BOX_LAYOUT
    if _Q_BOX_LAYOUT is None:
        _Q_BOX_LAYOUT = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    T, H, D = q.shape
    if q.stride(2) == 1 and q.stride(0) == H * q.stride(1) and q.stride(1) % 8 == 0 and q.data_ptr() % 16 == 0:
        rows = q.as_strided((T * H, D), (q.stride(1), 1))
        return TensorDescriptor.from_tensor(rows, [64, 64], _Q_BOX_LAYOUT), True
    if q.device not in _DUMMY_Q:
        _DUMMY_Q[q.device] = torch.zeros(64, 64, dtype=torch.bfloat16, device=q.device)
    return TensorDescriptor.from_tensor(_DUMMY_Q[q.device], [64, 64], _Q_BOX_LAYOUT), False


def gluon_decode(o, splits: int, part_acc, part_m, part_l, h_pad: int,
                 pv1_regs: int = 160, producer_regs: int = 128, maxnreg: int = 168,
                 programs: int | None = None, timing: torch.Tensor | None = None) -> None:
    """Launch on checked operands (``sparse_mla_decode._Operands``), 64 heads per item.

    ``programs`` persistent CTAs (default one per SM, at most one per item) take every ``programs``-th
    (token, split, 64-head block) item. Registers per thread: second PV warpgroup ``pv1_regs``, producer
    ``producer_regs``, softmax warpgroup the rest of ``3 * maxnreg`` (216; 384 threads allow ``maxnreg``
    <= 170). ``timing`` (debug; int64 ``[items, 16, tiles]``) receives ``%clock64`` stamps, by slot:
    producer tile start 0 / stored 1 / buffer free 2, item start / Q copy issued / Q copies out 3 (in the
    tile 0 / 1 / 2 slots); softmax warpgroup after the tile's ready wait 4, after S 5, before / after
    waiting for the P buffer 6 / 7, after its PV 8, item start / Q landed / item end 12 / 9 / 13 (tile 0;
    14 / 15: the same as global-timer nanoseconds); second PV warpgroup after the P wait 10, after its PV 11.
    """
    q, out = o.q, o.out
    T, H, D = q.shape
    window_tiles = -(-o.window // 64)
    num_tiles = window_tiles + (-(-o.K // 64) if o.has_comp else 0)
    num_items = T * splits * (h_pad // 64)
    if programs is None:
        programs = _sm_count(q.device)
    programs = max(1, min(programs, num_items))
    q_desc, q_tma = _q_descriptor(q)
    _decode_kernel[(programs,)](
        q, q.stride(0), q.stride(1), q_desc,
        out, out.stride(0), out.stride(1),
        part_acc, part_m, part_l,
        o.sink if o.sink is not None else q, o.positions, o.window_lo, o.token_req,
        o.window_cache, o.w_stride, o.window_block_table, o.window_block_table.stride(0),
        o.comp_cache, o.c_stride, o.comp_block_table, o.comp_block_table.stride(0),
        o.topk, o.topk.stride(0),
        T, H, o.scale * _LOG2E, splits, num_items,
        D=D, W=o.window, W_BS=o.window_block_size,
        K=o.K, C_BS=o.comp_block_size, RATIO=o.comp_ratio,
        NW=window_tiles, NT=num_tiles, HB=h_pad // 64, HAS_SINK=o.sink is not None,
        H_PAD=h_pad, PARTIAL=splits > 1, Q_TMA=q_tma,
        PV1_REGS=pv1_regs, PRODUCER_REGS=producer_regs,
        dbg_ptr=timing if timing is not None else part_m,
        DBG_NT=timing.shape[-1] if timing is not None else 0,
        num_warps=4, maxnreg=maxnreg,
        **pdl_args(q.device),
    )
