"""Dense FP8 block-scaled GEMM for decode on Hopper, in Gluon: weights decoded into the wgmma A fragment.

Same arguments and numbers as ``fp8_gemm.fp8_block_gemm`` (and its reference ``ops.quant_gemm.fp8_block_gemm``):
``x [M, groups * K] @ W.T`` for ``W [N, K]`` e4m3 with one UE8M0 scale per 32x32 tile, fp32 accumulation, one
rounding, the same split-K reduction (fixed order: added by each tile's last program, ``splitk.split_fixup``, up to
16 rows, else by ``splitk_reduce``; no host synchronisation).

The design is the expert GEMM's (``moe_gemm_gluon``), for one byte per value: the weights are the wgmma's A operand
(64 weight rows per warpgroup instruction, the batch's few rows on its narrow N side) and each thread decodes exactly
the values of its own A fragment, so no decoded value goes through shared memory:

* K is reordered inside every 128-column tile, for the weights and ``x`` alike (a sum does not care): lane
  ``q = lane % 4`` owns the tile's bytes ``32q .. 32q + 31`` of each of its two rows (rows ``r`` and ``r + 8`` of
  its warp's 16), which are exactly one 32x32 scale block, so a lane needs one scale byte per K tile. Byte
  ``b = 4s + 2h + j`` of that run is logical column ``16s + 8h + 2q + j``: the column the A fragment gives the lane
  in k-step ``s``. ``x``'s logical column pair ``P = 8s + 4h + q`` is therefore read from physical pair
  ``16q + 2s + h`` when it is gathered (below 32 batch rows; ``X_TILED`` pairs the columns otherwise, below).
* A lane's 32 bytes per row arrive by two 16-byte ``cp.async`` into a shared-memory ring that only that lane reads
  back (no barrier for the weights; the ring's 16-byte chunks are XOR-swizzled by row so a warp's reads do not
  collide in banks).
* ``E4M3_PTX`` turns each 32-bit word (4 values) into two bf16x2 registers: ``prmt`` puts bytes 0, 1 (then 2, 3) in
  the high bytes of the two halves, a shift by 4 and two masks move ``eeee mmm`` to bf16 bits 10..4 and keep the
  sign at bit 15, which is the value times 2^-120 exactly (e = 0 gives a bf16 subnormal); one bf16x2 multiply by
  ``2^(s - 7)`` applies the block's scale (exact for scale bytes ``<= MAX_SCALE_BYTE``, where 2^(s - 7) is still a
  bf16 number). 5 instructions per two values. The registers already are the A fragment: Gluon checks at compile
  time that the layout conversion is trivial.
* ``x`` tiles (4-byte ``cp.async`` gathers in the reordered K) go through NVMMA-swizzled shared memory; one barrier
  per tile hands them to the wgmma. Scale words are read one tile ahead into registers.
* From 32 batch rows (``X_TILED``) ``x`` is first rewritten in the expert kernel's staging order
  (``moe_gemm_gluon.x_tile_order``, one pass; ``tile_order_columns`` gives it) and its tiles are copied 16
  bytes at a time. That order pairs columns ``c`` and ``c + 4`` (``x``'s natural pairs cannot be kept: the
  expert kernel's decode is four instructions shorter per word with these pairs), so the weights are paired
  the same way: ``E4M3_TILED_PTX`` takes words ``2t`` and ``2t + 1`` of a lane's run and pairs byte ``i`` of
  one with byte ``i`` of the other (columns ``8t + i`` and ``8t + i + 4``), at the same 5 instructions per two
  values. Other K order, so other bits than the gathered staging (both within the reference's bound). GEMMs
  sharing ``x`` (``wq_a`` and ``wkv``, ``w1`` and ``w3``, the two ``wq_b``, and the shared expert's
  ``w1``/``w3`` with the routed experts' ``w13``) share one rewrite (``ops.shared_input``).
* Above 16 batch rows two warpgroups (128 weight rows) share each ``x`` tile, which otherwise costs as many
  shared-memory bytes as the weights; up to 32 rows the wgmma is issued asynchronously and the next tile's decode
  runs under it (``ASYNC``; at 64 rows the extra barrier this needs costs more than it hides).

* Up to 8 batch rows (``WS_MAX_ROWS``) the loop runs warp-specialised (``_fp8_decode_ws_kernel``,
  ``WARP_SPECIALIZED``; the routed-expert GEMM's step of the thirteenth session): one producer warp issues the
  weight bytes' TMA (a ``[64, 128]`` box, 128-byte swizzled, which spreads each quarter warp's 16-byte reads over
  all banks) and ``x``'s 4-byte gathers into an mbarrier ring; the warpgroup only waits, decodes and multiplies
  (a synchronous wgmma), then frees the stage. Measured on the H200 (benchmarks/README.md, fourteenth session)
  against the kernel whose threads copy their own bytes, same run: 2-8% less time at 1-8 rows on the Flash
  shapes (5120 x 8192 at one row 19.7 -> 18.8 us, 53% of copy; at 8 rows 21.1 -> 19.5).

Only for K (per group) a multiple of 128, N (per group) a multiple of 64, up to 64 rows (decode); larger batches
stay on the Triton kernel. sm90 only.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_vllm.ops.shared_input import input_form
from deepinfer_vllm.ops.triton.moe_gemm_gluon import GLUON_AVAILABLE, x_tile_order
from deepinfer_vllm.ops.triton.pdl import gluon_grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import sm_count, split_counters, split_k, splitk_reduce

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from deepinfer_vllm.ops.triton.moe_gemm_gluon import issue_tile, place_fragment, wait_tile, ws_ring

__all__ = [
    "E4M3_PTX",
    "E4M3_TILED_PTX",
    "MAX_SCALE_BYTE",
    "X_TILED_ROWS",
    "gluon_fp8_block_gemm",
    "gluon_fp8_config",
    "gluon_fp8_supported",
]

# 2^(s - 7) must be a normal bf16 number: s - 7 + 127 <= 254.
MAX_SCALE_BYTE = 134


def _e4m3_pair_ptx(o: int, a: str, b: str, sel: int, mult: str) -> str:
    """The bytes ``sel`` picks of ``a`` and ``b`` (``prmt``) -> ``($2o, $2o+1)``: the two picked into the high bytes
    of the halves become bf16 values times 2^-120 (what lands in the low bytes is masked off), then scaled by
    ``mult``."""
    return f"""prmt.b32 d, {a}, {b}, 0x{sel:04X};
shr.b32 t, d, 4;
and.b32 t, t, 0x07F007F0;
and.b32 d, d, 0x80008000;
or.b32 t, t, d;
mul.rn.bf16x2 t, t, {mult};
mov.b32 {{${2 * o}, ${2 * o + 1}}}, t;
"""


# $4: one 32-bit word, e4m3 bytes b0..b3; $5: the bf16x2 multiplier 2^(s - 7) in both halves. Out: $0..$3 bf16 =
# b0..b3, each value * 2^(s - 127). ``prmt`` selector 0x1404 gives (0, b0, 0, b1) low byte first; 0x3424 (0, b2,
# 0, b3). 10 instructions for 4 values (12 with the two moves, which the register allocator removes).
E4M3_PTX = "{\n.reg .b32 d, t;\n" + _e4m3_pair_ptx(0, "$4", "0", 0x1404, "$5") + _e4m3_pair_ptx(
    1, "$4", "0", 0x3424, "$5"
) + "}"

# For ``x`` in ``x_tile_order``'s order (``X_TILED``): $8, $9: words 2t and 2t + 1 of a lane's run, e4m3 bytes
# a0..a3 and b0..b3; $10: the multiplier. Out: $0..$7 bf16 = (a0, b0, a1, b1, a2, b2, a3, b3), each value *
# 2^(s - 127): register i pairs columns 8t + i and 8t + i + 4 of the run, as the expert kernel pairs its codes.
# Selector (a_i, a_i, b_i, b_i).
E4M3_TILED_PTX = "{\n.reg .b32 d, t;\n" + "".join(
    _e4m3_pair_ptx(i, "$8", "$9", i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12), "$10") for i in range(4)
) + "}"

BM = 64  # weight rows per tile: one warpgroup wgmma (M = 64)
BK = 128  # K per tile: 32 bytes = one scale block per lane and row
X_TILED_ROWS = 32  # from this batch tile on, x is rewritten in the tile order first (module docstring)
# Batch tiles of up to ``WS_MAX_ROWS`` rows run warp-specialised (``_fp8_decode_ws_kernel``); False: the kernel whose
# threads copy their own bytes (``gpu_model.py --ws-baseline``). 16-row tiles stay on that kernel: with the 4-deep ring
# the warp-specialised one was slower on the smallest shape (1792 x 5120: 11.9 against 9.8 us, H200; a 3-deep ring
# measured 9.6 there but ran in no test yet).
WARP_SPECIALIZED = True
WS_MAX_ROWS = 8


def operands_fit(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int, n_tile: int,
                 x_align: int) -> bool:
    """sm90 with Gluon; N / groups a multiple of ``n_tile``, K a positive multiple of 128 (the kernels' K loops run
    at least once); 16-byte aligned weight rows, 4-byte aligned scale rows, ``x`` rows aligned to ``x_align`` bytes
    (its copies' width)."""
    if not (GLUON_AVAILABLE and x.is_cuda) or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    n, k = weight.shape
    return (
        (n // groups) % n_tile == 0
        and k % BK == 0
        and k > 0
        and weight.stride(0) % 16 == 0
        and weight.data_ptr() % 16 == 0
        and scale.stride(0) % 4 == 0
        and scale.data_ptr() % 4 == 0
        and (x.stride(0) * x.element_size()) % x_align == 0
        and x.data_ptr() % x_align == 0
    )


def gluon_fp8_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int) -> bool:
    """Decode-sized M (up to 64 rows) with ``operands_fit`` (``x`` gathered 4 bytes at a time)."""
    return x.shape[0] <= 64 and operands_fit(x, weight, scale, groups, BM, 4)


if GLUON_AVAILABLE:
    _BK = gl.constexpr(BK)

    def _word_layout(wg: int):
        """Words ``[64 wg, 32]``: lane q = lane % 4 holds words 8q..8q+7 (registers s) of rows 16 warp + lane // 4
        and + 8, the rows and K columns of its wgmma A fragment; warps 4..7 take rows 64..127."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
            lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]] + ([[64, 0]] if wg == 2 else []),
            block_bases=[],
            shape=[64 * wg, 32],
        )
    _PTX = gl.constexpr(E4M3_PTX)

    @gluon.jit
    def e8m0_multipliers(sw, shift):
        """Scale words ``sw [rows]`` (int32, four UE8M0 bytes) and ``shift [cols]`` (8 x the byte a column uses)
        -> ``[rows, cols]`` int32: the bf16x2 multiplier 2^(s - 7) of ``E4M3_PTX``'s ``$5`` in both halves, the
        byte ``s`` added into each half's exponent field (bit 7) of 2^-7 (bf16 0x3C00)."""
        sb = (sw[:, None] >> shift[None, :]) & 0xFF
        return sb * 0x00800080 + 0x3C003C00

    @gluon.jit
    def _decode_tile(words, f, BW: gl.constexpr, DOT_A: gl.constexpr):
        """``words [BW, 32]`` int32 (lane q's eight words per row are its 32 bytes) and the per-word bf16x2
        multiplier ``f`` -> the ``[BW, 128]`` bf16 A fragment in the reordered K."""
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _PTX, "=h,=h,=h,=h,r,r", [words, f], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1
        )
        v = gl.join(gl.join(o0, o1), gl.join(o2, o3))  # [BW, 32 (w = 8q + s), 2 (j), 2 (h)]
        v = gl.reshape(v, [BW, 4, 8, 2, 2])  # [row, q, s, j, h]
        v = gl.permute(v, (0, 2, 4, 1, 3))  # [row, s, h, q, j]: column 16s + 8h + 2q + j
        v = gl.reshape(v, [BW, 128])
        return gl.convert_layout(v, DOT_A, assert_trivial=True)

    _TILED_PTX = gl.constexpr(E4M3_TILED_PTX)

    @gluon.jit
    def _decode_tile_tiled(words, f, BW: gl.constexpr, DOT_A: gl.constexpr):
        """As ``_decode_tile`` for ``x`` in the tile order: words ``2t`` and ``2t + 1`` of a lane's run give
        the registers of k-steps ``2t`` and ``2t + 1`` (``E4M3_TILED_PTX``)."""
        w_even, w_odd = gl.split(gl.reshape(words, [BW, 16, 2]))
        f_even, _ = gl.split(gl.reshape(f, [BW, 16, 2]))  # a word pair shares its block row's scale
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            _TILED_PTX,
            "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
            [w_even, w_odd, f_even],
            dtype=(gl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )
        # register i = 2 i1 + i0 of word 4q + t is k-step 2t + i1, half i0: the expert decode's places
        return place_fragment(o0, o1, o2, o3, o4, o5, o6, o7, BW, DOT_A)

    @gluon.jit
    def operand_pointers(x_ptr, w_ptr, ws_ptr, n0, m0, group, kt_lo, M, K, stride_xm, stride_wn, stride_wsn,
                         w_r, w_c, x_r, x_c, x_cols):
        """The first K tile's pointers of a CTA (tile ``kt`` adds ``kt`` tiles): weight rows ``n0 + w_r``, words
        ``w_c``; ``x`` rows ``m0 + x_r`` (masked past ``M``), word ``x_cols`` (``x_c``'s place) of the group's
        columns; the scale words of the weight rows' 32-row blocks (four scale bytes a K tile)."""
        w_row_ptr = w_ptr + (n0 + w_r).to(gl.int64)[:, None] * stride_wn + (kt_lo * (_BK // 4) + w_c)[None, :]
        tok = m0 + x_r
        x_mask = (tok < M)[:, None] & (x_c < 64)[None, :]
        x_pair_ptr = (
            x_ptr
            + tok.to(gl.int64)[:, None] * stride_xm
            + (group * (K // 2) + kt_lo * (_BK // 2) + x_cols)[None, :]
        )
        s_row_ptr = ws_ptr + ((n0 + w_r) // 32).to(gl.int64) * stride_wsn + kt_lo
        return w_row_ptr, x_pair_ptr, x_mask, s_row_ptr

    @gluon.jit
    def _store_rows(acc, a_r, a_c, out_ptr, part_ptr, counter_ptr, M, N, stride_om, n0, m0, pid_m, pid_n, pid_k,
                    BW: gl.constexpr, BT: gl.constexpr, ACC: gl.constexpr, SPLIT: gl.constexpr,
                    OUT_BF16: gl.constexpr, FIXUP: gl.constexpr):
        """``acc [BW weight rows, BT batch rows]`` of a CTA: the output, or its split's partials (``FIXUP``: the
        tile's last program adds them, ``splitk.split_fixup`` in this kernel's layouts; else into the workspace at
        ``out_ptr`` for ``splitk_reduce``); ``a_r`` / ``a_c`` the accumulator's row and column indices."""
        omask = (m0 + a_c < M)[None, :] & (a_r < BW)[:, None]
        optr = out_ptr + (m0 + a_c).to(gl.int64)[None, :] * stride_om + (n0 + a_r)[:, None]
        if SPLIT > 1 and not FIXUP:  # partials into the workspace at out_ptr (``splitk_reduce`` adds them)
            gl.store(out_ptr + pid_k.to(gl.int64) * M * N + (m0 + a_c).to(gl.int64)[None, :] * N + (n0 + a_r)[:, None],
                     acc, mask=omask)
        elif SPLIT > 1:
            part = part_ptr + (m0 + a_c).to(gl.int64)[None, :] * N + (n0 + a_r)[:, None]
            gl.store(part + pid_k.to(gl.int64) * M * N, acc, mask=omask)
            gl.thread_barrier()
            tile = pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = gl.zeros([BW, BT], gl.float32, ACC)
                for s in gl.static_range(SPLIT):
                    total += gl.load(part + s * M * N, mask=omask, other=0.0, cache_modifier=".cg")
                if OUT_BF16:
                    gl.store(optr, total.to(gl.bfloat16), mask=omask)
                else:
                    gl.store(optr, total, mask=omask)
                gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
        else:
            if OUT_BF16:
                gl.store(optr, acc.to(gl.bfloat16), mask=omask)
            else:
                gl.store(optr, acc, mask=omask)

    @gluon.jit
    def _fp8_gemm_gluon_kernel(
        x_ptr,  # int32 view of bf16 x [M, groups * K]: column pairs
        w_ptr,  # int32 view of e4m3 weights [N, K / 4 words]
        ws_ptr,  # int32 view of scales [N / 32, K / 128 words]
        out_ptr,
        part_ptr,  # SPLIT > 1: fp32 partials [SPLIT, M, N], added by each tile's last program
        counter_ptr,  # SPLIT > 1: the tiles' arrival counters (``splitk.split_fixup``)
        M,
        N,
        K,
        stride_xm,  # in int32 words
        stride_wn,  # in int32 words
        stride_wsn,  # in int32 words
        stride_om,
        kt_per_split,  # K tiles per split
        group_n,  # output columns per group (N when not grouped)
        WL: gl.constexpr,  # the weight words' register layout (``_word_layout``)
        WG: gl.constexpr,  # warpgroups, each 64 weight rows sharing the x tile
        BT: gl.constexpr,  # batch rows per tile (wgmma N)
        NS: gl.constexpr,  # ring stages
        SPLIT: gl.constexpr,
        OUT_BF16: gl.constexpr,
        ASYNC: gl.constexpr,
        FIXUP: gl.constexpr,  # SPLIT > 1: the tile's last program adds the partials (else ``splitk_reduce``)
        X_TILED: gl.constexpr,  # x is ``x_tile_order``'s rewrite: its tiles are copied 16 bytes at a time
        PDL: gl.constexpr,
    ):
        gluon_grid_wait(PDL)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        BW: gl.constexpr = 64 * WG
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4 * WG, 1], instr_shape=[16, BT, 16]
        )
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        if X_TILED:  # four consecutive pairs a thread: 16-byte copies
            XL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4 * WG, 1], [1, 0])
        else:
            XL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16] if BT >= 16 else [1, 32], [4 * WG, 1], [1, 0])
        # 16-byte chunks XOR-swizzled by row: a warp's 128-bit reads of eight rows hit distinct banks.
        WS: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        XS32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

        w_s = gl.allocate_shared_memory(gl.int32, [NS, BW, 32], WS)
        x_s = gl.allocate_shared_memory(gl.int32, [NS, BT, 64], XS32)

        n0 = pid_n * BW
        group = n0 // group_n
        m0 = pid_m * BT
        kt_lo = pid_k * kt_per_split
        n_kt = gl.minimum(kt_per_split, K // _BK - kt_lo)

        w_r = gl.arange(0, BW, layout=gl.SliceLayout(1, WL))
        w_c = gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
        x_r = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
        x_c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        # gathered: logical pair P = 8s + 4h + q is physical pair 16q + 2s + h of the tile (X_TILED: x is
        # already in the tile order, whose pairs the tiled decode matches)
        if X_TILED:
            x_phys = x_c
        else:
            x_phys = 16 * (x_c % 4) + 2 * (x_c // 8) + (x_c // 4) % 2
        shift = 8 * (w_c // 8)  # lane q's scale byte in the block row's tile word
        a_r = gl.arange(0, BW, layout=gl.SliceLayout(1, ACC))
        a_c = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))

        w_row_ptr, x_pair_ptr, x_mask, s_row_ptr = operand_pointers(
            x_ptr, w_ptr, ws_ptr, n0, m0, group, kt_lo, M, K, stride_xm, stride_wn, stride_wsn, w_r, w_c, x_r, x_c,
            x_phys,
        )

        for i in gl.static_range(NS - 1):
            issue_tile(w_s, x_s, i, n_kt, NS, w_row_ptr, _BK // 4, x_pair_ptr, x_mask)
        acc = gl.zeros([BW, BT], gl.float32, ACC)
        a_prev = gl.zeros([BW, 128], gl.bfloat16, DOT_A)
        sw_next = gl.load(s_row_ptr)
        for kt in range(gl.maximum(n_kt, 1)):  # one trip at least: see the wide kernel (C7515)
            stage = kt % NS
            wait_tile(NS)
            nxt = kt + NS - 1
            if not ASYNC:
                issue_tile(w_s, x_s, nxt, n_kt, NS, w_row_ptr, _BK // 4, x_pair_ptr, x_mask)
            sw = sw_next
            sw_next = gl.load(s_row_ptr + gl.minimum(kt + 1, n_kt - 1))
            words = w_s.index(stage).load(WL)
            f = e8m0_multipliers(sw, shift)
            if X_TILED:
                a = _decode_tile_tiled(words, f, BW, DOT_A)
            else:
                a = _decode_tile(words, f, BW, DOT_A)
            xb = x_s.index(stage)._reinterpret(gl.bfloat16, [BT, 128], XS)
            if ASYNC:
                # the previous tile's MMA (which read stage nxt % NS) is done in both warpgroups
                acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])
                gl.thread_barrier()
                issue_tile(w_s, x_s, nxt, n_kt, NS, w_row_ptr, _BK // 4, x_pair_ptr, x_mask)
                acc = warpgroup_mma(a, xb.permute((1, 0)), acc, is_async=True)
                acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a])  # in flight while the next tile decodes
            else:
                acc = warpgroup_mma(a, xb.permute((1, 0)), acc)
        if ASYNC:
            acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])
        async_copy.wait_group(0)
        _store_rows(acc, a_r, a_c, out_ptr, part_ptr, counter_ptr, M, N, stride_om, n0, m0, pid_m, pid_n, pid_k, BW,
                    BT, ACC, SPLIT, OUT_BF16, FIXUP)


    # ------------------------------------------------------------------------------------------------
    # The warp-specialised form (``config["WS"]``, up to 16 batch rows): one producer warp copies (the weight bytes
    # by TMA, ``x``'s pairs by 4-byte cp.async gathers), the warpgroup decodes and multiplies.

    @gluon.jit
    def _decode_ws_load(w_s, x_s, ready, empty, w_desc, x_ptr, n0, m0, group, kt_lo, n_kt, M, K, stride_xm,
                        BT: gl.constexpr, NS: gl.constexpr):
        """Producer warp: K tile ``kt`` into ring stage ``kt % NS`` once it is free: the 64 weight rows' 128 bytes
        by one TMA (``ready`` expects them) and the batch rows' ``x`` pairs in the tile's K order by 4-byte
        cp.async gathers (each lane arrives when its copies land)."""
        XL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 1], [1, 0])
        x_r = gl.arange(0, BT, layout=gl.SliceLayout(1, XL))
        x_c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        # logical pair P = 8s + 4h + q of the tile is physical pair 16q + 2s + h (module docstring)
        x_phys = 16 * (x_c % 4) + 2 * (x_c // 8) + (x_c // 4) % 2
        tok = m0 + x_r
        x_mask = (tok < M)[:, None] & (x_c < 64)[None, :]
        # int32 word offsets (decode batches: M * row stride is far below 2^31), 64-bit pointers made per tile: the
        # warp's 40-64 registers cannot hold 2 * BT pointers
        x_off = tok[:, None] * stride_xm + (group * (K // 2) + kt_lo * (_BK // 2) + x_phys)[None, :]
        for kt in range(n_kt):
            stage = kt % NS
            mbarrier.wait(empty.index(stage), ((kt // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), 64 * _BK)
            tma.async_copy_global_to_shared(w_desc, [n0, (kt_lo + kt) * _BK], ready.index(stage), w_s.index(stage))
            async_copy.async_copy_global_to_shared(x_s.index(stage), x_ptr + (x_off + kt * (_BK // 2)), mask=x_mask)
            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)

    @gluon.jit
    def _decode_ws_math(w_s, x_s, ready, empty, ws_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_wsn, stride_om,
                        n0, m0, kt_lo, n_kt, pid_m, pid_n, pid_k, WL: gl.constexpr, BT: gl.constexpr,
                        NS: gl.constexpr, SPLIT: gl.constexpr, OUT_BF16: gl.constexpr, FIXUP: gl.constexpr):
        """The warpgroup: per K tile, wait for its stage, read the lane's 32 bytes of each of its two rows, decode
        them into the A fragment (``E4M3_PTX``), one synchronous wgmma with the stage's ``x``, free the stage."""
        ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        DOT_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        W32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        w_r = gl.arange(0, 64, layout=gl.SliceLayout(1, WL))
        w_c = gl.arange(0, 32, layout=gl.SliceLayout(0, WL))
        shift = 8 * (w_c // 8)  # lane q's scale byte in the block row's tile word
        a_r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
        a_c = gl.arange(0, BT, layout=gl.SliceLayout(0, ACC))
        s_row_ptr = ws_ptr + ((n0 + w_r) // 32).to(gl.int64) * stride_wsn + kt_lo
        acc = gl.zeros([64, BT], gl.float32, ACC)
        sw_next = gl.load(s_row_ptr)
        for kt in range(n_kt):
            stage = kt % NS
            sw = sw_next
            sw_next = gl.load(s_row_ptr + gl.minimum(kt + 1, n_kt - 1))
            mbarrier.wait(ready.index(stage), (kt // NS) & 1)
            fence_async_shared()  # the producer's cp.async writes of x, before the wgmma reads them
            words = w_s.index(stage)._reinterpret(gl.int32, [64, 32], W32).load(WL)
            a = _decode_tile(words, e8m0_multipliers(sw, shift), 64, DOT_A)
            xb = x_s.index(stage)._reinterpret(gl.bfloat16, [BT, 128], XS)
            acc = warpgroup_mma(a, xb.permute((1, 0)), acc)
            mbarrier.arrive(empty.index(stage), count=1)
        _store_rows(acc, a_r, a_c, out_ptr, part_ptr, counter_ptr, M, N, stride_om, n0, m0, pid_m, pid_n, pid_k, 64,
                    BT, ACC, SPLIT, OUT_BF16, FIXUP)

    @gluon.jit
    def _fp8_decode_ws_kernel(
        w_desc,  # TMA descriptor of the e4m3 weights [N, K] as bytes, [64, 128] boxes
        x_ptr,
        ws_ptr,
        out_ptr,
        part_ptr,
        counter_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_wsn,
        stride_om,
        kt_per_split,
        group_n,
        WL: gl.constexpr,
        BT: gl.constexpr,
        NS: gl.constexpr,
        SPLIT: gl.constexpr,
        OUT_BF16: gl.constexpr,
        FIXUP: gl.constexpr,
        LOAD_REGS: gl.constexpr,
        PDL: gl.constexpr,
    ):
        """``_fp8_gemm_gluon_kernel``'s arguments and numbers at one warpgroup with ``x`` gathered, warp-specialised:
        ``_decode_ws_load`` (one warp) fills an ``NS``-stage ring, ``_decode_ws_math`` empties it."""
        gluon_grid_wait(PDL)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        n0 = pid_n * 64
        m0 = pid_m * BT
        kt_lo = pid_k * kt_per_split
        n_kt = gl.minimum(kt_per_split, K // _BK - kt_lo)
        W_BOX: gl.constexpr = w_desc.layout
        w_s, x_s, ready, empty = ws_ring(_BK, W_BOX, BT, NS)
        gl.warp_specialize(
            [
                (_decode_ws_math, (w_s, x_s, ready, empty, ws_ptr, out_ptr, part_ptr, counter_ptr, M, N, stride_wsn,
                                   stride_om, n0, m0, kt_lo, n_kt, pid_m, pid_n, pid_k, WL, BT, NS, SPLIT, OUT_BF16,
                                   FIXUP)),
                (_decode_ws_load, (w_s, x_s, ready, empty, w_desc, x_ptr, n0, m0, n0 // group_n, kt_lo, n_kt, M, K,
                                   stride_xm, BT, NS)),
            ],
            [1],
            [LOAD_REGS],
        )

    _W_BOX = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def gluon_fp8_config(m: int, n: int, k: int, sms: int = 132, groups: int = 1) -> dict:
    """Batch tile (the wgmma's N: 8, 16, 32 or 64) from M; two warpgroups (128 weight rows sharing one ``x``
    tile) above 16 rows, where staging ``x`` would otherwise cost as much as the weights; K split while fewer
    than two programs per SM would have work (at most 8 splits, at least two K tiles each)."""
    bt = 8 if m <= 8 else 16 if m <= 16 else (32 if m <= 32 else 64)
    wg = 2 if m > 16 and (n // groups) % 128 == 0 else 1
    # Up to 32 rows a tile's decode overlaps the previous tile's MMA (async wgmma: 3-10% faster); at 64 rows with
    # two warpgroups the extra barrier this needs costs more than it hides (measured, benchmarks/README.md).
    cfg = {"BT": bt, "WG": wg, "NS": 3 if bt * wg >= 128 else 4, "ASYNC": bt < 64}
    tiles = triton.cdiv(m, bt) * (n // (64 * wg))
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(8, (k // BK) // 2):
        split *= 2
    # Split K: up to 16 rows the tile's last program adds the partials (one launch); above, the partials of a tile
    # (up to 8 x 64 x 128 fp32) are too many for one program: a second kernel adds them over the whole device
    # (measured on the H200 at 1 and 64 rows, benchmarks/README.md).
    cfg["FIXUP"] = bt <= 16
    cfg["SPLIT"] = split
    if WARP_SPECIALIZED and bt <= WS_MAX_ROWS and wg == 1:
        # 64 registers a thread at launch (4 + 4 warps: four CTAs an SM), 40 for the producer, 88 for the math
        cfg.update(WS=True, NS=4, MAXNREG=64, LOAD_REGS=40, ASYNC=False)  # (its wgmma is synchronous)
    return cfg


def gluon_fp8_block_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    *,
    groups: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """``out [M, N]`` (fp32 or bf16) of the block GEMM; ``x`` bf16 [M, groups * K] (the activations
    ``fp8_gemm.gemm_activations`` gives), ``w`` uint8 [N, K], ``s`` uint8 [N/32, K/32] (the checked arguments of
    ``fp8_gemm.fp8_block_gemm``)."""
    n, k = w.shape
    m = x.shape[0]
    cfg = dict(config) if config else gluon_fp8_config(m, n, k, sm_count(x.device), groups)
    bt, ns, wg = cfg["BT"], cfg.get("NS", 4), cfg.get("WG", 1)
    if (n // groups) % (64 * wg):
        raise ValueError(f"WG={wg} needs N / groups = {n // groups} to be a multiple of {64 * wg}")
    _, split, k_per_split = split_k({"BK": BK, "SPLIT": cfg.get("SPLIT", 1)}, k)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    fixup = split > 1 and cfg.get("FIXUP", bt <= 16)
    x_tiled = cfg.get("X_TILED", bt >= X_TILED_ROWS)
    xi = input_form(x, "tile_order", x_tile_order) if x_tiled else x.view(torch.int32)
    wi = w.view(torch.int32)
    si = s.view(torch.int32)
    grid = (n // (64 * wg), triton.cdiv(m, bt), split)
    target = part if split > 1 and not fixup else out
    counters = split_counters(x.device, grid[0] * grid[1]) if fixup else part
    if cfg.get("WS"):
        if wg != 1 or x_tiled:
            raise ValueError("the warp-specialised decode kernel takes one warpgroup and x gathered (X_TILED off)")
        w_desc = TensorDescriptor.from_tensor(w, [64, BK], _W_BOX)
        _fp8_decode_ws_kernel[grid](
            w_desc, xi, si, target, part, counters, m, n, k, xi.stride(0), si.stride(0), out.stride(0),
            k_per_split // BK, n // groups, WL=_word_layout(1), BT=bt, NS=ns, SPLIT=split,
            OUT_BF16=out.dtype == torch.bfloat16, FIXUP=fixup, LOAD_REGS=cfg.get("LOAD_REGS", 40), num_warps=4,
            maxnreg=cfg.get("MAXNREG"), **pdl_args(xi.device),
        )
    else:
        _fp8_gemm_gluon_kernel[grid](
            xi,
            wi,
            si,
            target,
            part,
            counters,
            m,
            n,
            k,
            xi.stride(0),
            wi.stride(0),
            si.stride(0),
            out.stride(0),
            k_per_split // BK,
            n // groups,
            WL=_word_layout(wg),
            WG=wg,
            BT=bt,
            NS=ns,
            SPLIT=split,
            OUT_BF16=out.dtype == torch.bfloat16,
            ASYNC=cfg.get("ASYNC", False),
            FIXUP=fixup,
            X_TILED=x_tiled,
            num_warps=4 * wg,
            maxnreg=cfg.get("MAXNREG"),
            **pdl_args(xi.device),
        )
    if split > 1 and not fixup:
        splitk_reduce(part, out)
    return out
