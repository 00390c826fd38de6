"""Routed-expert grouped FP4 GEMM for decode on Hopper, in Gluon: weights decoded into the wgmma A fragment.

Same arguments and numbers as ``moe_gemm.grouped_fp4_gemm`` (and its reference
``ops.quant_gemm.grouped_fp4_gemm``): rows ``offsets[e]:offsets[e+1]`` of ``x`` times expert ``e``'s
decoded weight, fp32 accumulation, one rounding, zeros past ``offsets[-1]``; the same persistent walk
over row tiles (no host synchronisation, capturable) and the same split-K reduction.

Why a second kernel: the Triton kernel decodes E2M1 in registers, but Triton then moves the decoded
bf16 tile through shared memory (``ldmatrix``) into the MMA's register operand: about ten bytes of
shared-memory traffic per weight byte, which bounds it (benchmarks/README.md). Here the weights are
the MMA's A operand (64 weight rows per warpgroup instruction, the few token rows of an expert on its
narrow N side) and each thread decodes exactly the values its A fragment holds:

* K is reordered inside every 128-column tile, for the weights and ``x`` alike (a sum does not care):
  thread lane ``q = lane % 4`` owns the tile's 16 packed bytes ``16q .. 16q + 15`` of each of its two
  rows, which are exactly one 32-code scale block. Its word ``t`` (bytes ``4t .. 4t + 3``) holds the
  codes of columns ``32q + 8t + i`` in nibble ``i`` (low nibble first); register ``j`` of the word takes
  nibbles ``j`` and ``j + 4``, columns ``c, c + 4`` with ``c = 32q + 8t + j``, as the bf16 pair that the
  wgmma A fragment gives the lane in k-step ``s = 2t + j // 2``, half ``h = j % 2``: logical pair
  ``P = 8s + 4h + q``. ``x`` is staged in the same order, so it is rewritten once first
  (``x_tile_order``: one pass, 16-byte loads and stores, the permutation in registers; GEMMs that
  share ``x`` share the rewrite where the model declares it, ``ops.shared_input``) and its tiles are
  copied 16 bytes at a time.
* A lane's bytes arrive by one 16-byte ``cp.async`` per row and tile into a shared-memory ring that
  only that lane reads back (no barrier for the weights), 1 byte of shared traffic each way.
* The decode (``E2M1_PAIR_PTX``) turns each word into four bf16x2 registers, 17 instructions for 8
  codes: nibbles ``j`` and ``j + 4`` sit 16 bits apart, so one mask (of the word, or of the word
  shifted by 8) isolates a register's two codes, one IMAD places each as ``s 00000 e1 e0 m 000000``
  (the value times 2^-126), a mask drops the rest and one bf16x2 multiply by 2^(s - 1) scales both
  (exact for scale bytes <= ``moe_gemm.MAX_SCALE_BYTE``). The registers are already the A fragment: the
  layout conversion is checked trivial at compile time. (Design 3 paired the two nibbles of a byte,
  which kept ``x``'s natural column pairs for 4-byte gathers but needed a ``prmt`` and a shift more
  per register: 21 instructions for 8 codes; benchmarks/README.md.)
* ``x`` tiles and the CTA's scale words go through shared memory (the scale words one tile ahead in
  registers); one barrier per tile hands the ``x`` tile to the wgmma (the compiler adds a second before the
  weights are read back: it cannot tell the ring's stages apart; ``wait_tile``). (The dense kernel's asynchronous
  wgmma under the next tile's decode was measured here at 0-6% and gave wrong sums at 8-row tiles with a
  4-deep ring and split K on the H200: not kept; benchmarks/README.md, tenth session.)
* Two forms of that loop. Token tiles of up to ``WS_MAX_ROWS`` (decode) run it warp-specialised
  (``_moe_gemm_ws_kernel``): one producer warp fills the ring (the 64 weight rows' bytes of a K tile by one TMA,
  the ``x`` rows by 16-byte cp.async gathers) and the warpgroup only waits on the stage's mbarrier, reads its
  bytes, decodes and multiplies, then frees the stage; its instruction count per K tile falls only ~6% (the decode
  is most of it), but its warps no longer stall on their own copies: 13-21% less time at 1-256 tokens for w13,
  5-16% for w2 (H100; benchmarks/README.md, thirteenth session). Larger tiles (prefill) stay on
  ``_moe_gemm_gluon_kernel``, where every thread copies its own bytes (the warp-specialised form measured 3-4x
  slower at 64-row tiles).

Only for K a multiple of 128, N a multiple of 64. sm90 only. Row tiles of up to 64 token rows (the
wgmma's N); prefill walks several per expert, each decoding the expert's weights again (at 8192
tokens, ~128 rows per local expert: 8% faster than the Triton kernel's 128-row tiles, H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.quant_gemm import tile_order_columns
from deepinfer_vllm.ops.shared_input import input_form
from deepinfer_vllm.ops.triton.pdl import gluon_grid_wait, grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import sm_count, split_k, splitk_reduce

try:  # Gluon ships with Triton >= 3.5; this file targets the Hopper API of 3.6
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - depends on the installed Triton
    gluon = None

__all__ = [
    "E2M1_PAIR_PTX",
    "GLUON_AVAILABLE",
    "gluon_grouped_fp4_gemm",
    "gluon_moe_supported",
    "gluon_weight_supported",
    "tile_order_columns",
    "x_tile_order",
]

GLUON_AVAILABLE = gluon is not None


def _pair_ptx(j: int) -> str:
    """Register ``j`` of ``$8``: nibbles ``j`` and ``j + 4`` (16 bits apart: of the word for ``j`` < 2, of
    ``v``, the word shifted right by 8, for ``j`` >= 2) -> ``($2j, $2j+1)``. The mask keeps the two codes;
    one IMAD places each as ``s 00000 e1 e0 m 000000`` (a code at bit 0 times 2^6 + 2^12, at bit 4 times
    2^2 + 2^8: the two shifted copies do not overlap, so no carries); the mask drops the rest; one bf16x2
    multiply by ``$9`` scales both."""
    src, mask, mult = ("$8", "v")[j // 2], ("0x000F000F", "0x00F000F0")[j % 2], ("0x1040", "0x104")[j % 2]
    return f"""and.b32 t, {src}, {mask};
mul.lo.u32 t, t, {mult};
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 t, t, $9;
mov.b32 {{${2 * j}, ${2 * j + 1}}}, t;
"""


# $8: one 32-bit word, 8 codes in nibbles n0..n7 (n0 = low nibble of byte 0); $9: the bf16x2 multiplier
# 2^(s - 1) in both halves. Out: $0..$7 bf16 = (n0, n4, n1, n5, n2, n6, n3, n7), each code * 2^(s - 127) (a
# code placed as ``s 00000 e1 e0 m 000000`` is its value times 2^-126). 17 instructions for 8 codes.
E2M1_PAIR_PTX = "{\n.reg .b32 v, t;\nshr.b32 v, $8, 8;\n" + "".join(_pair_ptx(j) for j in range(4)) + "}"

BM = 64  # weight rows per tile: one warpgroup wgmma (M = 64)
BK = 128  # K per tile: 16 packed bytes = one scale block per lane and row
_PROGRAMS_PER_SM = 16
# Token tiles of up to this many rows run the warp-specialised kernel (``_moe_gemm_ws_kernel``), larger ones the
# cp.async kernel (``_moe_gemm_gluon_kernel``); 0: the cp.async kernel everywhere (``gpu_model.py --ws-baseline``).
WS_MAX_ROWS = 32
# (row, 128-column tile) items per program of x_tile_order: 8 KB in, 8 KB out (H200, 8192 tokens: 147 us for the
# experts' two rewrites against 231 with one 2 KB program per row and 8 tiles; at 64 rows 2.6 us a call against 1.6).
_ORDER_ITEMS = 32


@triton.jit
def _x_tile_order_kernel(
    x_ptr, out_ptr, M, n_tiles, stride_x, stride_o, ITEMS: tl.constexpr, PDL: tl.constexpr
):
    """Items ``pid * ITEMS ...`` of the ``M * n_tiles`` (row, tile) items, row-major (consecutive items of a
    contiguous ``x`` are consecutive bytes): in each tile of 128 values, ``out[16s + 8h + 2q + e]`` is
    ``x[32q + 8t + j + 4e]`` with ``t = s // 2``, ``j = 2 (s % 2) + h`` (the module docstring's order)."""
    grid_wait(PDL)
    item = tl.program_id(0).to(tl.int64) * ITEMS + tl.arange(0, ITEMS)
    row = item // n_tiles
    col = (item % n_tiles)[:, None] * 128 + tl.arange(0, 128)[None, :]
    mask = (row < M)[:, None]
    v = tl.load(x_ptr + row[:, None] * stride_x + col, mask=mask, other=0)
    v = tl.reshape(v, [ITEMS, 4, 4, 2, 2, 2])  # [item, q, t, e, j1, j0]: column 32q + 8t + 4e + 2j1 + j0
    v = tl.reshape(tl.permute(v, (0, 2, 4, 5, 1, 3)), [ITEMS, 128])  # [item, t, j1, j0, q, e]
    tl.store(out_ptr + row[:, None] * stride_o + col, v, mask=mask)


def x_tile_order(x: torch.Tensor) -> torch.Tensor:
    """bf16 ``x [M, C]`` (``C`` a multiple of 128, unit column stride) -> int32 ``[M, C / 2]``: each
    128-column tile's values in the Gluon kernels' staging order (``tile_order_columns``; module docstring),
    two a word."""
    m, c = x.shape
    if c % BK or x.stride(1) != 1 or x.dtype != torch.bfloat16:
        raise ValueError(
            f"x_tile_order takes bf16 [M, C] rows with C a multiple of {BK}, got {x.dtype} {tuple(x.shape)}"
        )
    xs = x.view(torch.int16)
    out = torch.empty(m, c, dtype=torch.int16, device=x.device)
    if m:
        n_tiles = c // BK
        _x_tile_order_kernel[(triton.cdiv(m * n_tiles, _ORDER_ITEMS),)](
            xs, out, m, n_tiles, xs.stride(0), out.stride(0), ITEMS=_ORDER_ITEMS, num_warps=4,
            **pdl_args(x.device),
        )
    return out.view(torch.int32)


def gluon_weight_supported(weight: torch.Tensor) -> bool:
    """The kernel takes this packed weight ``[E, N, K/2]``: sm90 with Gluon, N a multiple of 64, K of 128,
    16-byte aligned rows."""
    if not (GLUON_AVAILABLE and weight.is_cuda):
        return False
    if torch.cuda.get_device_capability(weight.device) != (9, 0):
        return False
    _, n, kh = weight.shape
    return n % BM == 0 and (2 * kh) % BK == 0 and weight.stride(1) % 16 == 0 and weight.data_ptr() % 16 == 0


def gluon_moe_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``gluon_weight_supported`` and ``x`` with unit column stride."""
    return x.stride(-1) == 1 and gluon_weight_supported(weight)


if GLUON_AVAILABLE:
    _BM = gl.constexpr(BM)
    _BK = gl.constexpr(BK)
    _PAIR_PTX = gl.constexpr(E2M1_PAIR_PTX)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _decode_tile(words, f, DOT_A: gl.constexpr):
        """``words [64, 16]`` int32 (lane q's four words per row are its 16 bytes) and the per-word bf16x2
        multiplier ``f`` -> the ``[64, 128]`` bf16 A fragment in the reordered K."""
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _PAIR_PTX,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
            [words, f],
            dtype=(gl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )
        return place_fragment(o0, o1, o2, o3, o4, o5, o6, o7, 64, DOT_A)

    # Shared with the dense FP8 kernel (``fp8_gemm_gluon``), whose tiled decode fills the same places.

    @gluon.jit
    def place_fragment(o0, o1, o2, o3, o4, o5, o6, o7, R: gl.constexpr, DOT_A: gl.constexpr):
        """A decode's eight bf16 outputs, each ``[R, 16]`` (word ``w = 4q + t`` of lane ``q``'s run), output
        ``4 i1 + 2 i0 + e`` the values of k-step ``2t + i1``, half ``i0``, element ``e`` -> the ``[R, 128]``
        wgmma A fragment (the layout conversion checked trivial)."""
        v = gl.join(gl.join(gl.join(o0, o1), gl.join(o2, o3)), gl.join(gl.join(o4, o5), gl.join(o6, o7)))
        v = gl.reshape(v, [R, 4, 4, 2, 2, 2])  # [row, q, t, e, i0, i1]
        v = gl.permute(v, (0, 2, 5, 4, 1, 3))  # [row, t, i1, i0, q, e]: column 32t + 16i1 + 8i0 + 2q + e
        v = gl.reshape(v, [R, 128])
        return gl.convert_layout(v, DOT_A, assert_trivial=True)

    @gluon.jit
    def issue_tile(w_s, x_s, kt, n_kt, NS: gl.constexpr, w_row_ptr, W_STEP: gl.constexpr, x_pair_ptr, x_mask):
        """cp.async of K tile ``kt`` (this CTA's numbering; ``W_STEP`` weight words a row and tile) into ring
        stage ``kt % NS``, one commit group; past the last tile an empty group, so every wait counts alike."""
        if kt < n_kt:
            async_copy.async_copy_global_to_shared(w_s.index(kt % NS), w_row_ptr + kt * W_STEP)
            async_copy.async_copy_global_to_shared(x_s.index(kt % NS), x_pair_ptr + kt * (_BK // 2), mask=x_mask)
        async_copy.commit_group()

    @gluon.jit
    def wait_tile(NS: gl.constexpr):
        """The ring's oldest tile has landed and is visible to every warp and to the wgmma: each thread's copies
        done, one barrier, then the generic-to-async proxy fence (the order Triton's own pipelines emit). Barrier
        before fence because the compiler's shared-memory barrier pass puts a barrier after every copy wait
        anyway: with the fence first it added one more (three a K tile, now two; 1-3% of the expert GEMM's time,
        benchmarks/README.md, twelfth session)."""
        async_copy.wait_group(NS - 2)
        gl.thread_barrier()
        fence_async_shared()

    @gluon.jit
    def _walk(off_ptr, E, R, ROW_TILES, EP: gl.constexpr, BT: gl.constexpr, SPLIT: gl.constexpr,
              ZERO_REST: gl.constexpr, EL: gl.constexpr):
        """Each expert's row tiles, from the offsets (no host read): per expert (``EL``, ``[EP]``) its rows
        ``lo .. hi``, its tiles ``nblk`` and their running sum ``cum``; the tiles with work (``total``) and the
        tiles to visit (``end``: with the zero tiles past ``offsets[E]``)."""
        eidx = gl.arange(0, EP, layout=EL)
        emask = eidx < E
        lo = gl.load(off_ptr + eidx, mask=emask, other=0).to(gl.int32)
        hi = gl.load(off_ptr + eidx + 1, mask=emask, other=0).to(gl.int32)
        nblk = gl.where(emask, (gl.maximum(hi - lo, 0) + BT - 1) // BT, 0)
        cum = gl.associative_scan(nblk, 0, _add)
        total = gl.sum(nblk, 0)
        if SPLIT == 1 and ZERO_REST:
            end = total + (gl.maximum(R - gl.load(off_ptr + E).to(gl.int32), 0) + BT - 1) // BT
        else:
            end = total
        return eidx, lo, hi, nblk, cum, total, gl.minimum(end, ROW_TILES)

    @gluon.jit
    def _walk_tile(t, eidx, lo, hi, nblk, cum, BT: gl.constexpr):
        """Row tile ``t`` (< total): its expert, first grouped row and the expert's end."""
        e = gl.sum((cum <= t).to(gl.int32), 0)
        sel = eidx == e
        row0 = gl.sum(gl.where(sel, lo, 0), 0) + (t - gl.sum(gl.where(sel, cum - nblk, 0), 0)) * BT
        return e, row0, gl.sum(gl.where(sel, hi, 0), 0)

    # Words [64, 16]: lane q = lane % 4 holds words 4q..4q+3 (registers t) of rows 16 warp + lane // 4 and + 8, the
    # rows and K columns of its wgmma A fragment.
    _WL = gl.constexpr(
        gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 16],
        )
    )

    @gluon.jit
    def _tile_mma(words, sw, shift, x_tile, acc, BT: gl.constexpr, XS: gl.constexpr, DOT_A: gl.constexpr):
        """One K tile: the lanes' weight words (``_WL``) decoded with their rows' scale words ``sw`` (lane ``q``
        takes byte ``q``: ``shift``) into the A fragment, times the stage's ``x`` words (``[BT, 64]`` int32)."""
        sb = (sw[:, None] >> shift[None, :]) & 0xFF
        f = sb * 0x00800080 + 0x3F003F00
        a = _decode_tile(words, f, DOT_A)
        xb = x_tile._reinterpret(gl.bfloat16, [BT, 128], XS)
        return warpgroup_mma(a, xb.permute((1, 0)), acc)

    @gluon.jit
    def _program_tiles(pid_n, pid_k, kt_per_split, K):
        """The program's first weight row, its split's first K tile and its number of K tiles."""
        kt_lo = pid_k * kt_per_split
        return pid_n * _BM, kt_lo, gl.minimum(kt_per_split, K // _BK - kt_lo)

    @gluon.jit
    def _x_rows(row0, row_end, x_r, x_c, x_ptr, rows_ptr, stride_xm, kt_lo, GATHER: gl.constexpr):
        """A row tile's ``x`` words of its split's first K tile (``[BT, 64]``, the layout of ``x_r`` / ``x_c``) and
        the mask of its rows (``GATHER``: grouped row ``i`` reads row ``rows[i]`` of ``x``)."""
        tok = row0 + x_r
        if GATHER:
            tok_x = gl.load(rows_ptr + tok, mask=tok < row_end, other=0)
        else:
            tok_x = tok
        x_mask = (tok < row_end)[:, None] & (x_c < 64)[None, :]
        return x_ptr + tok_x.to(gl.int64)[:, None] * stride_xm + (kt_lo * (_BK // 2) + x_c)[None, :], x_mask

    @gluon.jit
    def _store_tile(acc, row0, row_end, n0, a_r, a_c, pid_k, out_ptr, R, N, stride_om, SPLIT: gl.constexpr,
                    OUT_BF16: gl.constexpr):
        """A row tile's ``acc [64 weight rows, BT tokens]``: its split's fp32 partials, or the output rows."""
        omask = (row0 + a_c < row_end)[None, :] & (a_r < 64)[:, None]
        if SPLIT > 1:
            optr = (
                out_ptr
                + pid_k.to(gl.int64) * R * N
                + (row0 + a_c).to(gl.int64)[None, :] * N
                + (n0 + a_r)[:, None]
            )
            gl.store(optr, acc, mask=omask)
        else:
            optr = out_ptr + (row0 + a_c).to(gl.int64)[None, :] * stride_om + (n0 + a_r)[:, None]
            if OUT_BF16:
                gl.store(optr, acc.to(gl.bfloat16), mask=omask)
            else:
                gl.store(optr, acc, mask=omask)

    @gluon.jit
    def _zero_tile(t, total, n0, a_r, a_c, off_ptr, E, out_ptr, R, stride_om, BT: gl.constexpr,
                   OUT_BF16: gl.constexpr, ACC: gl.constexpr):
        """Tile ``t`` past the last expert tile: zero its rows after ``offsets[E]``."""
        zr = gl.load(off_ptr + E).to(gl.int32) + (t - total) * BT + a_c
        optr = out_ptr + zr.to(gl.int64)[None, :] * stride_om + (n0 + a_r)[:, None]
        zmask = (zr < R)[None, :] & (a_r < 64)[:, None]
        z = gl.zeros([64, BT], gl.float32, ACC)
        if OUT_BF16:
            gl.store(optr, z.to(gl.bfloat16), mask=zmask)
        else:
            gl.store(optr, z, mask=zmask)

    @gluon.jit
    def _moe_gemm_gluon_kernel(
        x_ptr,  # int32 view of bf16 x [R, K] (or [T, K] read through rows_ptr): column pairs
        rows_ptr,  # GATHER: the row of x each grouped row reads
        w_ptr,  # int32 view of packed weights [E, N, K/8 words]
        ws_ptr,  # int32 view of scales [E, N, K/128 words]
        off_ptr,
        out_ptr,
        R,
        N,
        K,
        E,
        stride_xm,  # in int32 words
        stride_we,
        stride_wn,  # in int32 words
        stride_wse,
        stride_wsn,  # in int32 words
        stride_om,
        kt_per_split,  # K tiles per split
        ROW_TILES,
        EP: gl.constexpr,
        BT: gl.constexpr,  # token rows per tile (wgmma N)
        NS: gl.constexpr,  # ring stages
        SPLIT: gl.constexpr,
        OUT_BF16: gl.constexpr,
        GATHER: gl.constexpr,
        ZERO_REST: gl.constexpr,  # False: rows past offsets[E] are left unwritten (SPLIT == 1)
        PDL: gl.constexpr,
    ):
        gluon_grid_wait(PDL)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        grid_m = gl.num_programs(1)
        pid_k = gl.program_id(2)

        WL: gl.constexpr = _WL
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16]
        )
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        # x words [BT, 64] (``x_tile_order``'s rewrite, two values a word): 16 bytes, four words, a copy
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        EL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        XS32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

        w_s = gl.allocate_shared_memory(gl.int32, [NS, 64, 16], PLAIN2)
        x_s = gl.allocate_shared_memory(gl.int32, [NS, BT, 64], XS32)

        eidx, lo, hi, nblk, cum, total, end = _walk(off_ptr, E, R, ROW_TILES, EP, BT, SPLIT, ZERO_REST, EL)

        n0, kt_lo, n_kt = _program_tiles(pid_n, pid_k, kt_per_split, K)

        # Per-thread index tensors.
        w_r = gl.arange(0, 64, layout=gl.SliceLayout(1, WL))
        w_c = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
        x_r = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
        x_c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        shift = 8 * (w_c // 4)  # lane q's scale byte in the row's tile word
        a_r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        a_c = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))

        for t in range(pid_m, end, grid_m):
            if t < total:
                e, row0, row_end = _walk_tile(t, eidx, lo, hi, nblk, cum, BT)
                w_row_ptr = (
                    w_ptr
                    + e.to(gl.int64) * stride_we
                    + (n0 + w_r).to(gl.int64)[:, None] * stride_wn
                    + (kt_lo * (_BK // 8) + w_c)[None, :]
                )
                x_pair_ptr, x_mask = _x_rows(row0, row_end, x_r, x_c, x_ptr, rows_ptr, stride_xm, kt_lo, GATHER)
                # each row's scale word of a K tile (lane q takes byte q), one tile ahead in registers
                s_row_ptr = (
                    ws_ptr + e.to(gl.int64) * stride_wse + (n0 + w_r).to(gl.int64) * stride_wsn + kt_lo
                )
                gl.thread_barrier()  # the previous tile's readers are done with every buffer
                for i in gl.static_range(NS - 1):
                    issue_tile(w_s, x_s, i, n_kt, NS, w_row_ptr, _BK // 8, x_pair_ptr, x_mask)
                acc = gl.zeros([64, BT], gl.float32, ACC)
                sw_next = gl.load(s_row_ptr)
                for kt in range(n_kt):
                    stage = kt % NS
                    wait_tile(NS)
                    nxt = kt + NS - 1
                    issue_tile(w_s, x_s, nxt, n_kt, NS, w_row_ptr, _BK // 8, x_pair_ptr, x_mask)
                    sw = sw_next
                    sw_next = gl.load(s_row_ptr + gl.minimum(kt + 1, n_kt - 1))
                    acc = _tile_mma(w_s.index(stage).load(WL), sw, shift, x_s.index(stage), acc, BT, XS, DOT_A)
                _store_tile(acc, row0, row_end, n0, a_r, a_c, pid_k, out_ptr, R, N, stride_om, SPLIT, OUT_BF16)
            elif SPLIT == 1:
                _zero_tile(t, total, n0, a_r, a_c, off_ptr, E, out_ptr, R, stride_om, BT, OUT_BF16, ACC)
        async_copy.wait_group(0)


    # ------------------------------------------------------------------------------------------------
    # The warp-specialised form (``config["WS"]``): one producer warp copies, the warpgroup decodes and multiplies.

    @gluon.jit
    def _ws_load(w_s, x_s, ready, empty, w_desc, x_ptr, rows_ptr, off_ptr, R, N, K, E, stride_xm, kt_per_split,
                 ROW_TILES, pid_n, pid_m, grid_m, pid_k, EP: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr,
                 SPLIT: gl.constexpr, GATHER: gl.constexpr, ZERO_REST: gl.constexpr, EL: gl.constexpr):
        """Producer warp: for every K tile of every row tile, in the consumers' order, once ring stage
        ``c % NS`` is free: the 64 weight rows' 64 bytes by one TMA (``ready`` expects its bytes) and the
        token rows' ``x`` words by 16-byte cp.async gathers (each lane's arrive when they land)."""
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [1, 1], [1, 0])
        eidx, lo, hi, nblk, cum, total, end = _walk(off_ptr, E, R, ROW_TILES, EP, BT, SPLIT, ZERO_REST, EL)
        n0, kt_lo, n_kt = _program_tiles(pid_n, pid_k, kt_per_split, K)
        x_r = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
        x_c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        c = 0
        for t in range(pid_m, end, grid_m):
            if t < total:
                e, row0, row_end = _walk_tile(t, eidx, lo, hi, nblk, cum, BT)
                x_pair_ptr, x_mask = _x_rows(row0, row_end, x_r, x_c, x_ptr, rows_ptr, stride_xm, kt_lo, GATHER)
                w_row = e * N + n0
                for kt in range(n_kt):
                    stage = c % NS
                    mbarrier.wait(empty.index(stage), ((c // NS) & 1) ^ 1)
                    mbarrier.expect(ready.index(stage), _BM * (_BK // 2))
                    tma.async_copy_global_to_shared(w_desc, [w_row, (kt_lo + kt) * (_BK // 2)], ready.index(stage),
                                                    w_s.index(stage))
                    async_copy.async_copy_global_to_shared(x_s.index(stage), x_pair_ptr + kt * (_BK // 2),
                                                           mask=x_mask)
                    async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
                    c += 1

    @gluon.jit
    def _ws_math(w_s, x_s, ready, empty, ws_ptr, off_ptr, out_ptr, R, N, K, E, stride_wse, stride_wsn, stride_om,
                 kt_per_split, ROW_TILES, pid_n, pid_m, grid_m, pid_k, EP: gl.constexpr, BT: gl.constexpr,
                 NS: gl.constexpr, SPLIT: gl.constexpr, OUT_BF16: gl.constexpr, ZERO_REST: gl.constexpr,
                 EL: gl.constexpr):
        """The warpgroup: per K tile, wait for its stage, read the lane's weight bytes (``LDS.128`` a row),
        decode them into the A fragment, one synchronous wgmma with the stage's ``x``, free the stage (one
        arrival: the wgmma has taken every warp's fragment, so every warp's read of the stage is done)."""
        WL: gl.constexpr = _WL
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        eidx, lo, hi, nblk, cum, total, end = _walk(off_ptr, E, R, ROW_TILES, EP, BT, SPLIT, ZERO_REST, EL)
        n0, kt_lo, n_kt = _program_tiles(pid_n, pid_k, kt_per_split, K)
        w_r = gl.arange(0, 64, layout=gl.SliceLayout(1, WL))
        w_c = gl.arange(0, 16, layout=gl.SliceLayout(0, WL))
        shift = 8 * (w_c // 4)  # lane q's scale byte in the row's tile word
        a_r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        a_c = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
        c = 0
        for t in range(pid_m, end, grid_m):
            if t < total:
                e, row0, row_end = _walk_tile(t, eidx, lo, hi, nblk, cum, BT)
                s_row_ptr = ws_ptr + e.to(gl.int64) * stride_wse + (n0 + w_r).to(gl.int64) * stride_wsn + kt_lo
                acc = gl.zeros([64, BT], gl.float32, ACC)
                sw_next = gl.load(s_row_ptr)
                for kt in range(n_kt):
                    stage = c % NS
                    sw = sw_next
                    sw_next = gl.load(s_row_ptr + gl.minimum(kt + 1, n_kt - 1))
                    mbarrier.wait(ready.index(stage), (c // NS) & 1)
                    fence_async_shared()  # the lanes' cp.async writes of x, before the wgmma reads them
                    words = w_s.index(stage)._reinterpret(gl.int32, [64, 16], PLAIN2).load(WL)
                    acc = _tile_mma(words, sw, shift, x_s.index(stage), acc, BT, XS, DOT_A)
                    mbarrier.arrive(empty.index(stage), count=1)
                    c += 1
                _store_tile(acc, row0, row_end, n0, a_r, a_c, pid_k, out_ptr, R, N, stride_om, SPLIT, OUT_BF16)
            elif SPLIT == 1:
                _zero_tile(t, total, n0, a_r, a_c, off_ptr, E, out_ptr, R, stride_om, BT, OUT_BF16, ACC)

    @gluon.jit
    def ws_ring(W_BYTES: gl.constexpr, W_LAYOUT: gl.constexpr, BT: gl.constexpr, NS: gl.constexpr):
        """The warp-specialised decode kernels' ring (shared with ``fp8_gemm_gluon``): ``NS`` stages of 64 weight
        rows x ``W_BYTES`` (a TMA box) and ``BT`` rows of ``x`` words (cp.async gathers), a ``ready`` barrier per
        stage (the TMA's expect and the producer warp's 32 lanes) and an ``empty`` one (the warpgroup)."""
        XS32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        w_s = gl.allocate_shared_memory(gl.uint8, [NS, 64, W_BYTES], W_LAYOUT)
        x_s = gl.allocate_shared_memory(gl.int32, [NS, BT, 64], XS32)
        BL: gl.constexpr = mbarrier.MBarrierLayout()
        ready = gl.allocate_shared_memory(gl.int64, [NS, 1], BL)
        empty = gl.allocate_shared_memory(gl.int64, [NS, 1], BL)
        for i in gl.static_range(NS):
            mbarrier.init(ready.index(i), count=33)
            mbarrier.init(empty.index(i), count=1)
        return w_s, x_s, ready, empty

    @gluon.jit
    def _moe_gemm_ws_kernel(
        w_desc,  # TMA descriptor of the packed weights as uint8 [E * N, K / 2], 64 x 64 boxes
        x_ptr,
        rows_ptr,
        ws_ptr,
        off_ptr,
        out_ptr,
        R,
        N,
        K,
        E,
        stride_xm,
        stride_wse,
        stride_wsn,
        stride_om,
        kt_per_split,
        ROW_TILES,
        EP: gl.constexpr,
        BT: gl.constexpr,
        NS: gl.constexpr,
        SPLIT: gl.constexpr,
        OUT_BF16: gl.constexpr,
        GATHER: gl.constexpr,
        ZERO_REST: gl.constexpr,
        EL_MATH: gl.constexpr,
        EL_LOAD: gl.constexpr,
        LOAD_REGS: gl.constexpr,
        PDL: gl.constexpr,
    ):
        """``_moe_gemm_gluon_kernel``'s arguments and numbers, warp-specialised: ``_ws_load`` (one warp) fills an
        ``NS``-stage ring, ``_ws_math`` (the kernel's four warps) empties it; stage hand-overs on mbarriers."""
        gluon_grid_wait(PDL)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        grid_m = gl.num_programs(1)
        pid_k = gl.program_id(2)
        W_BOX: gl.constexpr = w_desc.layout
        w_s, x_s, ready, empty = ws_ring(_BK // 2, W_BOX, BT, NS)
        gl.warp_specialize(
            [
                (_ws_math, (w_s, x_s, ready, empty, ws_ptr, off_ptr, out_ptr, R, N, K, E, stride_wse, stride_wsn,
                            stride_om, kt_per_split, ROW_TILES, pid_n, pid_m, grid_m, pid_k, EP, BT, NS, SPLIT,
                            OUT_BF16, ZERO_REST, EL_MATH)),
                (_ws_load, (w_s, x_s, ready, empty, w_desc, x_ptr, rows_ptr, off_ptr, R, N, K, E, stride_xm,
                            kt_per_split, ROW_TILES, pid_n, pid_m, grid_m, pid_k, EP, BT, NS, SPLIT, GATHER,
                            ZERO_REST, EL_LOAD)),
            ],
            [1],
            [LOAD_REGS],
        )

    _W_BOX = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)

    def _walk_layout(ep: int, warps: int):
        """``[ep]`` held whole by each warp (``ep / 32`` a lane), the partition's other warps copies of the
        first: the walk's scan and sums then stay inside a warp (no shared-memory scratch, which a
        warp-specialised partition may not take)."""
        return gl.BlockedLayout([max(1, ep // 32)], [32], [warps], [0])


def gluon_config(r: int, e_count: int, n: int, k: int, sms: int = 132) -> dict:
    """Token tile from the mean rows per expert (the wgmma's N: 8, 16, 32 or 64); K split while fewer
    than two programs per SM would have work. Tiles of up to ``WS_MAX_ROWS`` rows: the warp-specialised
    kernel, 64 registers a thread at launch (four CTAs of 4 + 4 warps an SM), of which the producer warpgroup
    keeps 40 and the math warpgroup gets 88 (8-16 rows: a 4-deep ring; 32 rows: 80 at launch, 120 for the math,
    a 3-deep ring; each the best of the variants timed on an H100, thirteenth session). Larger tiles, the cp.async
    kernel: above 64 rows (prefill) a 168-register cap (four CTAs an SM) measured 8% faster than none at 8192
    tokens (w13 1716 -> 1608 us, w2 907 -> 806 us, H200); with ``WS_MAX_ROWS`` = 0, 96 registers up to 16 rows
    (five CTAs an SM: its stalls are latency, and a fifth CTA's loads hide more of it)."""
    mean_rows = triton.cdiv(r, e_count)
    bt = 8 if mean_rows <= 4 else 16 if mean_rows <= 16 else (32 if mean_rows <= 32 else 64)
    if bt > WS_MAX_ROWS:
        cfg = {"BT": bt, "NS": 3, "MAXNREG": 96 if bt <= 16 else (168 if mean_rows > 64 else None)}
    elif bt <= 16:
        cfg = {"BT": bt, "NS": 4, "WS": True, "MAXNREG": 64, "LOAD_REGS": 40}
    else:
        cfg = {"BT": bt, "NS": 3, "WS": True, "MAXNREG": 80, "LOAD_REGS": 40}
    tiles = min(r, e_count) * triton.cdiv(mean_rows, bt) * (n // BM)
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(8, (k // BK) // 2):
        split *= 2
    cfg["SPLIT"] = split
    return cfg


def gluon_grouped_fp4_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    zero_rest: bool = True,
    x_tile_ordered: bool = False,
    local_rows: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``out [R, N]`` (fp32 or bf16) of the grouped GEMM; ``x`` bf16 [R, K] (or [T, K] with ``rows [R]``, the row
    each grouped row reads), ``w`` uint8 [E, N, K/2], ``s`` uint8 [E, N, K/32] (the checked
    arguments of ``moe_gemm.grouped_fp4_gemm``, ``local_rows`` as it clamps it to 1..R: the rows the tiles are
    picked for, default R). ``x_tile_ordered``: ``x`` is already in the staging order (written so by its
    producer: no rewrite)."""
    e_count, n, _ = w.shape
    r, k = out.shape[0], x.shape[1]
    sms = sm_count(x.device)
    cfg = dict(config) if config else gluon_config(local_rows or r, e_count, n, k, sms)
    bt, ns = cfg["BT"], cfg.get("NS", 3)
    _, split, k_per_split = split_k({"BK": BK, "SPLIT": cfg.get("SPLIT", 1)}, k)
    kt_per_split = k_per_split // BK
    target = torch.empty(split, r, n, dtype=torch.float32, device=x.device) if split > 1 else out
    n_tiles = n // BM
    row_tiles = min(r, triton.cdiv(r, bt) + e_count + 1)
    grid_m = cfg.get("GRID_M") or max(1, min(row_tiles, _PROGRAMS_PER_SM * sms // (n_tiles * split)))
    if x_tile_ordered:
        if x.stride(0) % 8 or x.stride(1) != 1 or x.data_ptr() % 16:
            raise ValueError("tile-ordered x needs 16-byte aligned rows")
        xi = x.view(torch.int32)
    else:
        xi = input_form(x, "tile_order", x_tile_order)
    si = s.view(torch.int32)
    if cfg.get("WS"):
        ep = triton.next_power_of_2(e_count)
        if w.stride(0) != n * w.stride(1):
            raise ValueError("the warp-specialised expert GEMM reads the experts' weights as one [E * N, K / 2] matrix")
        w2d = w.view(torch.uint8).as_strided((e_count * n, w.shape[2]), (w.stride(1), 1))
        w_desc = TensorDescriptor.from_tensor(w2d, [BM, BK // 2], _W_BOX)
        _moe_gemm_ws_kernel[(n_tiles, grid_m, split)](
            w_desc, xi, xi if rows is None else rows, si, expert_offsets, target, r, n, k, e_count,
            xi.stride(0), si.stride(0), si.stride(1), out.stride(0), kt_per_split, row_tiles,
            EP=ep, BT=bt, NS=ns, SPLIT=split, OUT_BF16=out.dtype == torch.bfloat16, GATHER=rows is not None,
            ZERO_REST=zero_rest, EL_MATH=_walk_layout(ep, 4), EL_LOAD=_walk_layout(ep, 1),
            LOAD_REGS=cfg.get("LOAD_REGS", 56), num_warps=4, maxnreg=cfg.get("MAXNREG"), **pdl_args(xi.device),
        )
        if split > 1:
            splitk_reduce(target, out, expert_offsets[e_count:])
        return out
    wi = w.view(torch.int32)
    _moe_gemm_gluon_kernel[(n_tiles, grid_m, split)](
        xi,
        xi if rows is None else rows,
        wi,
        si,
        expert_offsets,
        target,
        r,
        n,
        k,
        e_count,
        xi.stride(0),
        wi.stride(0),
        wi.stride(1),
        si.stride(0),
        si.stride(1),
        out.stride(0),
        kt_per_split,
        row_tiles,
        EP=triton.next_power_of_2(e_count),
        BT=bt,
        NS=ns,
        SPLIT=split,
        OUT_BF16=out.dtype == torch.bfloat16,
        GATHER=rows is not None,
        ZERO_REST=zero_rest,
        num_warps=4,
        maxnreg=cfg.get("MAXNREG"),
        **pdl_args(xi.device),
    )
    if split > 1:
        splitk_reduce(target, out, expert_offsets[e_count:])
    return out
