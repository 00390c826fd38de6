"""Dense FP8 block-scaled GEMM for large decode batches on Hopper, in Gluon: the batch on the wgmma's wide side.

Same arguments and numbers as ``fp8_gemm.fp8_block_gemm`` (and its reference ``ops.quant_gemm.fp8_block_gemm``):
``x [M, groups * K] @ W.T`` for ``W [N, K]`` e4m3 with one UE8M0 scale per 32x32 tile, fp32 accumulation, one
rounding, split-K partials added in a fixed order by ``splitk_reduce`` (no host synchronisation).

Why a third kernel: the decode kernel (``fp8_gemm_gluon``) puts the weights on the wgmma's M side (the A fragment,
decoded in registers) and the batch on its narrow N side, at most 64 rows a tile: at 256 rows every weight byte is
decoded four times, and its 256-row tiles do not fit the registers. Above 64 rows the step's dense GEMMs went to the
Triton kernel (128 rows) or to cuBLAS on a bf16 copy of the weight (from 256 rows), which writes and reads twice the
weight's bytes again. Here the roles swap:

* The batch rows are the A operand, from shared memory, 64 per warpgroup (``BM = 64 * WGS``, up to 256 rows in one
  CTA), in the natural K order: ``x`` needs no rewrite. The weights are the B operand: each K tile of ``BN`` weight
  rows is decoded once per CTA into shared memory as bf16, and every warpgroup's wgmma reads it. At up to ``BM``
  rows each weight byte is decoded once.
* A thread copies 32 bytes of one weight row per K tile (one 32x32 scale block: one scale byte) by 16-byte
  ``cp.async`` into a ring only it reads back (no barrier for the raw weights), decodes them with the decode
  kernel's ``E4M3_PTX`` (5 instructions per two values) and stores the 32 bf16 values in the NVMMA-swizzled tile.
* ``x`` tiles come by 16-byte ``cp.async`` into NVMMA-swizzled shared memory (the ring is ``NS`` deep); the decoded
  tile is double-buffered. One barrier per K tile: after it every thread's ``x`` copies and decoded values of tile
  ``kt`` are visible and every warpgroup's wgmma of tile ``kt - 1`` is done, so tile ``kt + NS - 1`` is issued into
  the ring stage ``kt - 1`` used, and the wgmma of tile ``kt`` is issued asynchronously: it runs while the threads
  decode tile ``kt + 1`` into the other buffer.

Measured (benchmarks/README.md, "The layer step", tenth and eleventh sessions): the fastest of the dense designs
at 17-128 rows (one warpgroup at up to 64 rows: 10-32% less time than the decode kernel at 32-64 rows, with no
rewrite of ``x``) and on the large shapes at 256, but at ~43% of the bf16 MMA rate at 5120 x 8192 x 256, not near
it, with its wgmmas asynchronous or not (ptxas serialized them until the K loop got its one-trip floor; the H100 run
after it was no faster): each CTA reads all of its rows of ``x`` from L2 per K tile (64 KB against 16 KB of weights
at four warpgroups) through a two-deep ring. ``fp8_gemm.WIDE_ROWS`` sends it the calls where it won.

Only for K (per group) a multiple of 128 and N (per group) a multiple of ``BN``. sm90 only.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_vllm.ops.triton.fp8_gemm_gluon import BK, E4M3_PTX, operands_fit
from deepinfer_vllm.ops.triton.moe_gemm_gluon import GLUON_AVAILABLE
from deepinfer_vllm.ops.triton.pdl import gluon_grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import sm_count, split_k, splitk_reduce

if GLUON_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from deepinfer_vllm.ops.triton.fp8_gemm_gluon import e8m0_multipliers, operand_pointers
    from deepinfer_vllm.ops.triton.moe_gemm_gluon import issue_tile

__all__ = ["gluon_fp8_wide_config", "gluon_fp8_wide_gemm", "gluon_fp8_wide_supported"]

BN = 128  # weight rows (output columns) per tile
# For choosing the K split only (H200, measured: benchmarks/README.md): the bf16 MMA rate and the copy rate.
MMA_FLOPS_PER_S = 790e12
COPY_BYTES_PER_S = 4.2e12


def gluon_fp8_wide_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int) -> bool:
    """``fp8_gemm_gluon.operands_fit`` for ``BN``-row weight tiles and 16-byte copies of ``x``."""
    return operands_fit(x, weight, scale, groups, BN, 16)


if GLUON_AVAILABLE:
    _BK = gl.constexpr(BK)
    _BN = gl.constexpr(BN)
    _PTX = gl.constexpr(E4M3_PTX)

    @gluon.jit
    def _decode_natural(words, f):
        """``words [BN, 32]`` int32 (a thread's eight consecutive words of one row) and the per-word bf16x2
        multiplier -> ``[BN, 128]`` bf16 in the natural K order (byte ``i`` of word ``w`` is column ``4w + i``)."""
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _PTX, "=h,=h,=h,=h,r,r", [words, f], dtype=(gl.bfloat16,) * 4, is_pure=True, pack=1
        )
        # [BN, 32 (w), 2 (i), 2 (p)] holds byte 2i + p of word w
        v = gl.join(gl.join(o0, o2), gl.join(o1, o3))
        return gl.reshape(v, [_BN, 128])

    @gluon.jit
    def _fp8_gemm_wide_kernel(
        x_ptr,  # int32 view of bf16 x [M, groups * K]: column pairs
        w_ptr,  # int32 view of e4m3 weights [N, K / 4 words]
        ws_ptr,  # int32 view of scales [N / 32, K / 128 words]
        out_ptr,  # SPLIT > 1: fp32 partials [SPLIT, M, N] (``splitk_reduce`` adds them)
        M,
        N,
        K,
        stride_xm,  # in int32 words
        stride_wn,  # in int32 words
        stride_wsn,  # in int32 words
        stride_om,
        kt_per_split,  # K tiles per split
        group_n,  # output columns per group (N when not grouped)
        WGS: gl.constexpr,  # warpgroups: 64 batch rows each
        NS: gl.constexpr,  # ring stages (raw weights and x)
        SPLIT: gl.constexpr,
        OUT_BF16: gl.constexpr,
        PDL: gl.constexpr,
    ):
        gluon_grid_wait(PDL)
        BM: gl.constexpr = 64 * WGS
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        ACC: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4 * WGS, 1], instr_shape=[16, _BN, 16]
        )
        # raw weight words [BN, 32]: four threads a row, eight consecutive words (32 bytes, one scale block) each
        RL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4 * WGS, 1], [1, 0])
        # x words [BM, 64]: four consecutive words (16 bytes, one copy) a thread
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4 * WGS, 1], [1, 0])
        # 16-byte chunks XOR-swizzled by row: a warp's 16-byte copies and reads of eight rows hit distinct banks
        WS: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
        TS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        TS32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

        w_s = gl.allocate_shared_memory(gl.int32, [NS, _BN, 32], WS)
        x_s = gl.allocate_shared_memory(gl.int32, [NS, BM, 64], TS32)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [2, _BN, 128], TS)

        n0 = pid_n * _BN
        group = n0 // group_n
        m0 = pid_m * BM
        kt_lo = pid_k * kt_per_split
        n_kt = gl.minimum(kt_per_split, K // _BK - kt_lo)

        w_r = gl.arange(0, _BN, layout=gl.SliceLayout(1, RL))
        w_c = gl.arange(0, 32, layout=gl.SliceLayout(0, RL))
        x_r = gl.arange(0, BM, layout=gl.SliceLayout(1, XL))
        x_c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
        shift = 8 * (w_c // 8)  # the thread's scale byte in the block row's tile word
        a_r = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        a_c = gl.arange(0, _BN, layout=gl.SliceLayout(0, ACC))

        w_row_ptr, x_pair_ptr, x_mask, s_row_ptr = operand_pointers(
            x_ptr, w_ptr, ws_ptr, n0, m0, group, kt_lo, M, K, stride_xm, stride_wn, stride_wsn, w_r, w_c, x_r, x_c,
            x_c,
        )

        for i in gl.static_range(NS - 1):
            issue_tile(w_s, x_s, i, n_kt, NS, w_row_ptr, _BK // 4, x_pair_ptr, x_mask)
        acc = gl.zeros([BM, _BN], gl.float32, ACC)
        sw_next = gl.load(s_row_ptr)
        # (at least one trip: a zero-trip path would re-zero the accumulators between the async wgmmas, and ptxas
        # then serializes every wgmma, C7515; every split has at least one K tile)
        for kt in range(gl.maximum(n_kt, 1)):
            stage = kt % NS
            buf = kt % 2
            async_copy.wait_group(NS - 2)  # this thread's copies of tile kt have landed
            sw = sw_next
            sw_next = gl.load(s_row_ptr + gl.minimum(kt + 1, n_kt - 1))
            words = w_s.index(stage).load(RL)
            b_s.index(buf).store(_decode_natural(words, e8m0_multipliers(sw, shift)))
            fence_async_shared()
            # this warpgroup's wgmma of tile kt - 1 (which read x stage (kt - 1) % NS and the other buffer) is done
            acc = warpgroup_mma_wait(0, deps=[acc])
            gl.thread_barrier()  # ... in every warpgroup; tile kt's x and decoded values are all in
            issue_tile(w_s, x_s, kt + NS - 1, n_kt, NS, w_row_ptr, _BK // 4, x_pair_ptr, x_mask)
            xa = x_s.index(stage)._reinterpret(gl.bfloat16, [BM, 128], TS)
            acc = warpgroup_mma(xa, b_s.index(buf).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])  # left in flight under the next tile's decode
        acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)
        # epilogue: acc[row, n]
        omask = (m0 + a_r < M)[:, None] & (a_c < _BN)[None, :]
        if SPLIT > 1:
            optr = out_ptr + pid_k.to(gl.int64) * M * N + (m0 + a_r).to(gl.int64)[:, None] * N + (n0 + a_c)[None, :]
            gl.store(optr, acc, mask=omask)
        else:
            optr = out_ptr + (m0 + a_r).to(gl.int64)[:, None] * stride_om + (n0 + a_c)[None, :]
            if OUT_BF16:
                gl.store(optr, acc.to(gl.bfloat16), mask=omask)
            else:
                gl.store(optr, acc, mask=omask)


def gluon_fp8_wide_config(m: int, n: int, k: int, sms: int = 132) -> dict:
    """Four warpgroups above 128 rows (one decode per weight byte up to 256 rows), two above 64, else one; the
    deepest ring that fits beside the two decoded tiles (one CTA per SM); the K split with the least predicted time:
    whole waves of CTAs times their K tiles at the bf16 MMA rate, plus the fp32 partials written and added again."""
    wgs = 4 if m > 128 else 2 if m > 64 else 1
    bm = 64 * wgs
    # bytes per ring stage: the x tile (BM x 128 bf16) and the raw weights (BN x 128); decoded: 2 x BN x 256
    stage = bm * 256 + BN * 128
    # (two warpgroups with a ring of 3 or more stages crash ptxas 12.8, Triton 3.6's, with a segmentation fault)
    ns = max(2, min(4, (227 * 1024 - 2 * BN * 256 - 1024) // stage)) if wgs != 2 else 2
    tiles = triton.cdiv(m, bm) * (n // BN)
    k_tiles = k // BK
    tile_us = bm * BN * BK * 2 / (MMA_FLOPS_PER_S / sms) * 1e6
    partials_us_per_split = m * n * 8 / COPY_BYTES_PER_S * 1e6

    def predicted_us(split: int) -> float:
        waves = triton.cdiv(tiles * split, sms)
        return waves * triton.cdiv(k_tiles, split) * tile_us + (split * partials_us_per_split if split > 1 else 0.0)

    split = min(range(1, min(8, max(1, k_tiles // 4)) + 1), key=predicted_us)
    return {"WGS": wgs, "NS": ns, "SPLIT": split}


def gluon_fp8_wide_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    out: torch.Tensor,
    *,
    groups: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """``out [M, N]`` (fp32 or bf16) of the block GEMM; ``x`` bf16 [M, groups * K], ``w`` uint8 [N, K], ``s``
    uint8 [N/32, K/32] (the checked arguments of ``fp8_gemm.fp8_block_gemm``)."""
    n, k = w.shape
    m = x.shape[0]
    cfg = dict(config) if config else gluon_fp8_wide_config(m, n, k, sm_count(x.device))
    wgs, ns = cfg["WGS"], cfg.get("NS", 2)
    if (n // groups) % BN:
        raise ValueError(f"the wide kernel needs N / groups = {n // groups} to be a multiple of {BN}")
    _, split, k_per_split = split_k({"BK": BK, "SPLIT": cfg.get("SPLIT", 1)}, k)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    xi = x.view(torch.int32)
    wi = w.view(torch.int32)
    si = s.view(torch.int32)
    grid = (n // BN, triton.cdiv(m, 64 * wgs), split)
    _fp8_gemm_wide_kernel[grid](
        xi,
        wi,
        si,
        part,
        m,
        n,
        k,
        xi.stride(0),
        wi.stride(0),
        si.stride(0),
        out.stride(0),
        k_per_split // BK,
        n // groups,
        WGS=wgs,
        NS=ns,
        SPLIT=split,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=4 * wgs,
        **pdl_args(xi.device),
    )
    if split > 1:
        splitk_reduce(part, out)
    return out
