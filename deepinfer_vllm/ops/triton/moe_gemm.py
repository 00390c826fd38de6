"""Grouped GEMM of the routed experts: packed E2M1 ``[E, N, K/2]`` with UE8M0 per 1x32.

Same arguments and numbers as ``ops.quant_gemm.grouped_fp4_gemm``: rows
``offsets[e]:offsets[e+1]`` of ``x`` times expert ``e``'s decoded weight, fp32 accumulation,
one rounding; rows past ``offsets[-1]`` are zero. No host synchronisation: the row tiles are
bounded from shapes only (``min(R, cdiv(R, BM) + E + 1)``) and walked by a persistent loop: the
grid has ``grid_m = max(1, min(bound, 16 * SMs // (N tiles * split)))`` programs along rows (a
config's ``GRID_M`` overrides it: tests, benchmarks); each reads
the ``E + 1`` offsets once, counts each expert's row tiles (``tl.cumsum``) and takes tiles
``pid_m, pid_m + grid_m, ...`` while they have work: expert tiles (it finds the expert and row
tile itself), then tiles zeroing the rows past ``offsets[-1]`` (or the split-K reduction does;
``zero_rest=False`` skips them).
Each output tile is written by one program with the same arithmetic whatever the grid, so the
numbers do not depend on it. Capturable in a CUDA graph.

Weights are decoded straight to bf16 with integer ops and one bf16 multiply, in registers (no
fp32 tile): a code ``s e1 e0 m`` placed as the bf16 bits ``s 00000 e1 e0 m 000000`` is the code's
value times 2^-126 (e = 0 gives a subnormal), and a bf16x2 multiply by 2^(scale - 1) gives the value
times its UE8M0 scale, exact for scale bytes up to ``MAX_SCALE_BYTE`` (2^1). On the GPU one PTX block
does four packed bytes (eight codes) and their block scale in 21 instructions; the interpreter does
the same arithmetic per element. ``x`` is read as int32 pairs and split into its even and odd
columns, which the low and the high nibbles multiply: two bf16 dots per K tile, no interleave.
x is bf16 or its MXFP8 round trip from ``mxfp8_qdq``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.quant_gemm import from_tile_order
from deepinfer_vllm.ops.triton.fp8_gemm import (
    ACT_MODES,
    gemm_activations,
    gemm_output,
    mma_bf16,
    store_tile,
    weight_bytes,
)
from deepinfer_vllm.ops.triton.moe_gemm_gluon import (
    gluon_grouped_fp4_gemm,
    gluon_moe_supported,
    gluon_weight_supported,
)
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.splitk import OUT_KINDS, sm_count, split_k, splitk_reduce, store_out

__all__ = ["check_grouped_args", "check_rows", "grouped_fp4_gemm", "moe_config", "reads_tile_order"]


def _use_gluon(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """On sm90 every size goes to the Gluon kernel (``moe_gemm_gluon``: 1.4-1.8x this kernel in decode,
    1.08x at prefill); other devices, the interpreter and unaligned shapes stay here."""
    return out.dtype in (torch.float32, torch.bfloat16) and gluon_moe_supported(x, w)


def reads_tile_order(weight: torch.Tensor) -> bool:
    """Whether ``grouped_fp4_gemm`` with this weight (bf16 or fp32 output, ``x`` with unit column stride) runs
    the Gluon kernel, which stages ``x`` in ``quant_gemm.tile_order_columns``'s order: a kernel producing
    ``x`` may then write it in that order (``x_tile_ordered=True``) and save the GEMM its rewrite."""
    return gluon_weight_supported(weight.view(torch.uint8))


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Programs along the row tiles: about this many per SM over the whole grid (at least one row
# program per (N tile, split)), each looping over row tiles. 2 per SM would leave fewer programs
# than the ~3 per SM that fit (16-row decode tiles) at T=64-256; 16 keeps <= 2 tiles per program
# on the benchmarked decode/prefill shapes, so only the programs without work go away.
_PROGRAMS_PER_SM = 16

# $4: 4 packed bytes b0..b3 (8 codes) of one 32-code block, $5: that block's UE8M0 scale s.
# Out, bf16x2 each: $0 = (b0 lo, b1 lo), $1 = (b2 lo, b3 lo), $2 = (b0 hi, b1 hi), $3 = (b2 hi, b3 hi),
# every value code * 2^(s - 127). A code ``s e1 e0 m`` placed as the bf16 bits ``s 00000 e1 e0 m 000000``
# (sign to bit 15, e1 e0 m to bits 8..6: one IMAD places both) is exactly code * 2^-126 (e = 0 gives a
# subnormal), and one bf16x2 multiply by 2^(s - 1) scales it, exact for s <= 128. 2^(s - 1) in both
# halves is s * 0x00800080 + 0x3F003F00. 21 instructions for 8 codes.
_E2M1_BF16_PTX = tl.constexpr("""{
.reg .b32 t, u, f;
mad.lo.u32 f, $5, 0x00800080, 0x3F003F00;
prmt.b32 u, $4, 0, 0x4140;
and.b32 t, u, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $0, t, f;
and.b32 t, u, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $2, t, f;
prmt.b32 u, $4, 0, 0x4342;
and.b32 t, u, 0x000F000F;
mul.lo.u32 t, t, 0x1040;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $1, t, f;
and.b32 t, u, 0x00F000F0;
mul.lo.u32 t, t, 0x104;
and.b32 t, t, 0x81C081C0;
mul.rn.bf16x2 $3, t, f;
}""")

# Largest UE8M0 scale byte the bf16 decode takes (2^(s - 1) must be a normal bf16): 2^1.
MAX_SCALE_BYTE = 128


@triton.jit
def e2m1_bf16_scaled(packed, s, ASM: tl.constexpr):
    """Packed codes (uint8, any shape whose last dimension is a multiple of 4) and each byte's block
    scale byte (int32, same shape) -> ``(lo, hi)`` bf16 of the same shape: the low / high nibble's
    value times ``2^(s - 127)``, exact (``s <= MAX_SCALE_BYTE``)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_BF16_PTX,
            "=r,=r,=r,=r,r,r,r,r,r",
            [packed, s],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        # Same values; the multiply in fp32 (the interpreter's bf16 arithmetic is not IEEE).
        f = ((s + 126) << 23).to(tl.float32, bitcast=True)
        c = packed.to(tl.int32)
        lo = (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * f
        c = c >> 4
        hi = (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * f
        lo = lo.to(tl.bfloat16)
        hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _moe_gemm_kernel(
    x_ptr,
    rows_ptr,  # GATHER: the row of x each grouped row reads
    w_ptr,
    ws_ptr,
    off_ptr,
    out_ptr,
    R,
    N,
    K,
    E,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    k_per_split,
    ROW_TILES,  # shape-only bound on the row tiles with work (grid dimension 1 is at most this)
    EP: tl.constexpr,  # next power of two >= E
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ASM: tl.constexpr,
    F32_DOT: tl.constexpr,  # interpreter: bf16 operands multiplied as fp32 (same products)
    GATHER: tl.constexpr,
    ZERO_REST: tl.constexpr,  # False: rows past offsets[E] are left unwritten (SPLIT == 1)
    PDL: tl.constexpr,
):
    grid_wait(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    grid_m = tl.num_programs(1)
    pid_k = tl.program_id(2)
    eidx = tl.arange(0, EP)
    emask = eidx < E
    lo = tl.load(off_ptr + eidx, mask=emask, other=0).to(tl.int32)
    hi = tl.load(off_ptr + eidx + 1, mask=emask, other=0).to(tl.int32)
    nblk = tl.where(emask, (tl.maximum(hi - lo, 0) + BM - 1) // BM, 0)
    cum = tl.cumsum(nblk, 0)
    total = tl.sum(nblk, 0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_mask = offs_n < N
    # Row tiles with something to write: the `total` expert tiles, then (SPLIT == 1; the split-K
    # reduction zeros them otherwise) the tiles of rows past offsets[E]. Capped by the shape-only
    # bound ROW_TILES (valid offsets never reach it); this program takes pid_m, pid_m + grid_m, ...
    if SPLIT == 1 and ZERO_REST:
        end = total + (tl.maximum(R - tl.load(off_ptr + E).to(tl.int32), 0) + BM - 1) // BM
    else:
        end = total
    end = tl.minimum(end, ROW_TILES)
    for t in range(pid_m, end, grid_m):
        _moe_tile(
            x_ptr,
            rows_ptr,
            w_ptr,
            ws_ptr,
            off_ptr,
            out_ptr,
            R,
            N,
            K,
            E,
            stride_xm,
            stride_we,
            stride_wn,
            stride_wse,
            stride_wsn,
            stride_om,
            k_per_split,
            t,
            total,
            eidx,
            lo,
            hi,
            nblk,
            cum,
            offs_n,
            n_mask,
            pid_k,
            BM,
            BN,
            BK,
            SPLIT,
            OUT_KIND,
            ASM,
            F32_DOT,
            GATHER,
        )


@triton.jit
def _moe_tile(
    x_ptr,
    rows_ptr,
    w_ptr,
    ws_ptr,
    off_ptr,
    out_ptr,
    R,
    N,
    K,
    E,
    stride_xm,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_om,
    k_per_split,
    t,
    total,
    eidx,
    lo,
    hi,
    nblk,
    cum,
    offs_n,
    n_mask,
    pid_k,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    OUT_KIND: tl.constexpr,
    ASM: tl.constexpr,
    F32_DOT: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Row tile ``t``: expert tile ``t`` when ``t < total``, else (SPLIT == 1) zeros for row
    tile ``t - total`` past offsets[E]."""
    BKH: tl.constexpr = BK // 2
    NB: tl.constexpr = BK // 32  # scale blocks per K tile: one int8 / int16 / int32 word per row
    if t < total:
        e = tl.sum((cum <= t).to(tl.int32), 0)
        sel = eidx == e
        row0 = tl.sum(tl.where(sel, lo, 0), 0) + (t - tl.sum(tl.where(sel, cum - nblk, 0), 0)) * BM
        row_end = tl.sum(tl.where(sel, hi, 0), 0)
        offs_m = row0 + tl.arange(0, BM)
        m_mask = offs_m < row_end
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        ws_rows = ws_ptr + e.to(tl.int64) * stride_wse + offs_n.to(tl.int64)[:, None] * stride_wsn
        # x as int32 pairs: bf16 x[2j] in the low half, x[2j + 1] in the high half (packed byte j's
        # low and high nibble), so the low nibbles multiply the even columns and the high ones the odd.
        if GATHER:
            src = tl.load(rows_ptr + offs_m, mask=m_mask, other=0)
        else:
            src = offs_m
        x_words = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        x_rows = x_words + src.to(tl.int64)[:, None] * (stride_xm // 2)
        c = tl.arange(0, BKH)
        shift = (8 * (c // 16))[None, :]  # a byte's block scale within the row's NB scale bytes
        if NB == 4:
            word_ty: tl.constexpr = tl.pointer_type(tl.int32)
        elif NB == 2:
            word_ty: tl.constexpr = tl.pointer_type(tl.int16)
        else:
            word_ty: tl.constexpr = tl.pointer_type(tl.int8)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros([BN, BM], tl.float32)
        # K tiles never straddle k_hi: K and k_per_split are multiples of BK (grouped_fp4_gemm).
        for k0 in range(k_lo, k_hi, BK):
            kh = k0 // 2 + c
            p = tl.load(w_rows + kh[None, :], mask=n_mask[:, None], other=0)
            sw = tl.load((ws_rows + k0 // 32).to(word_ty, bitcast=True), mask=n_mask[:, None], other=0)
            sb = (sw.to(tl.int32) >> shift) & 0xFF
            wl, wh = e2m1_bf16_scaled(p, sb, ASM)
            xp = tl.load(x_rows + kh[None, :], mask=m_mask[:, None], other=0)
            xe = (xp & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
            xo = (xp >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
            acc = mma_bf16(wl, tl.trans(xe), acc, F32_DOT)
            acc = mma_bf16(wh, tl.trans(xo), acc, F32_DOT)
        omask = n_mask[:, None] & m_mask[None, :]
        store_tile(out_ptr, acc, offs_m, offs_n, omask, pid_k, R, N, stride_om, SPLIT, OUT_KIND)
    elif SPLIT == 1:
        # Past the last tile: zero the rows after offsets[E], one row tile per program.
        offs_m = tl.load(off_ptr + E).to(tl.int32) + (t - total) * BM + tl.arange(0, BM)
        omask = n_mask[:, None] & (offs_m < R)[None, :]
        store_out(
            out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None],
            tl.zeros([BN, BM], tl.float32),
            omask,
            OUT_KIND,
        )


def moe_config(r: int, e_count: int, n: int, k: int, sms: int = 132) -> dict:
    """Tiles from shapes only: the mean rows per expert picks the row tile; K is split while
    fewer than two programs per SM would have work (at most min(R, E) row tiles do)."""
    mean_rows = triton.cdiv(r, e_count)
    if mean_rows <= 16:
        cfg = {"BM": 16, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    elif mean_rows <= 64:
        cfg = {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4}
    else:
        cfg = {"BM": 128, "BN": 128, "BK": 128, "num_warps": 8, "num_stages": 3}
    cfg["BK"] = tile_k(k, cfg["BK"])
    tiles = min(r, e_count) * triton.cdiv(mean_rows, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    split = 1
    while tiles * split < 2 * sms and split * 2 <= min(8, triton.cdiv(k, cfg["BK"]) // 2):
        split *= 2
    cfg["SPLIT"] = split
    return cfg


def tile_k(k: int, bk: int) -> int:
    """The K tile: ``bk`` capped at 128 (a row's scale bytes of one tile are read as one word of
    at most 32 bits) and halved until it divides ``k`` (a multiple of 32)."""
    bk = min(bk, 128)
    while k % bk:
        bk //= 2
    return bk


def check_grouped_args(
    x: torch.Tensor, expert_offsets: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act: str
) -> None:
    """The arguments of a grouped FP4 GEMM, checked from
    shapes and dtypes only (the offsets' values are not read: that would synchronise)."""
    if act not in ACT_MODES:
        raise ValueError(f"act must be 'bf16' or 'mxfp8', got {act!r}")
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != 2 * weight.shape[2]:
        raise ValueError(
            f"x [R, K] and weight [E, N, K/2] expected, got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    e_count, n, _ = weight.shape
    k = x.shape[1]
    if k % 32 or n % 32:
        raise ValueError(f"N and K must be multiples of 32, got N={n}, K={k}")
    if tuple(scale.shape) != (e_count, n, k // 32):
        raise ValueError(f"scale must be [{e_count}, {n}, {k // 32}], got {tuple(scale.shape)}")
    if tuple(expert_offsets.shape) != (e_count + 1,) or expert_offsets.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"expert_offsets must be int32/int64 [{e_count + 1}], "
            f"got {expert_offsets.dtype} {tuple(expert_offsets.shape)}"
        )


def check_rows(rows: torch.Tensor | None, x: torch.Tensor) -> int:
    """The grouped rows' count: ``rows.shape[0]`` (int32/int64 ``[R]`` on x's device), else x's rows."""
    if rows is None:
        return x.shape[0]
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != x.device:
        got = f"{rows.dtype} {tuple(rows.shape)} {rows.device}"
        raise ValueError(f"rows must be int32/int64 [R] on {x.device}, got {got}")
    if rows.stride(0) != 1:
        raise ValueError("rows must be contiguous")
    return rows.shape[0]


def grouped_fp4_gemm(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    act: str = "bf16",
    out_dtype: torch.dtype | None = None,
    *,
    rows: torch.Tensor | None = None,
    zero_rest: bool = True,
    x_tile_ordered: bool = False,
    local_rows: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``[R, N]``: rows ``expert_offsets[e]:expert_offsets[e+1]`` of ``x [R, K]`` (or, with
    ``rows [R]``, of ``x[rows]``, gathered as the tiles load them) times expert ``e``'s ``W_e.T``
    (``weight [E, N, K/2]`` int8/uint8 packed E2M1, ``scale [E, N, K/32]`` UE8M0); zeros past
    ``expert_offsets[-1]``. ``expert_offsets`` int32/int64 ``[E+1]`` on x's device,
    ``offsets[0] == 0``, nondecreasing, ``offsets[-1] <= R``; ``rows`` inside ``x`` (not checked:
    that would synchronise). ``zero_rest=False``: the rows past ``expert_offsets[-1]`` may be left
    unwritten (for a caller that never reads them: other ranks' pairs, whose zeros cost a full
    write of ``[R - offsets[-1], N]`` at prefill). ``x_tile_ordered``: ``x``'s columns are in the
    staging order (``reads_tile_order``); where this kernel runs instead of the Gluon one, or with
    ``act="mxfp8"``, they are put back first. ``local_rows``: the rows the caller expects before
    ``expert_offsets[-1]`` (default R): the tiles are picked for that many rows (an estimate; any value gives a
    correct result). ``config`` overrides the tile choice (tests, benchmarks)."""
    e_count, n, _ = weight.shape
    k = x.shape[1]
    check_grouped_args(x, expert_offsets, weight, scale, act)
    r = check_rows(rows, x)
    out = gemm_output(x, r, n, out_dtype)
    out_dtype = out.dtype
    if r == 0:
        return out
    local_rows = max(1, min(local_rows or r, r))  # the rows the tiles are picked for (both kernels)
    w, s = weight_bytes(weight, scale)
    if x_tile_ordered and act != "bf16":  # the MXFP8 blocks are columns of x's own order
        x, x_tile_ordered = from_tile_order(x), False
    xv = gemm_activations(x, act)
    if config is not None and "BT" in config or config is None and _use_gluon(xv, w, out):
        return gluon_grouped_fp4_gemm(
            xv, expert_offsets, w, s, out, rows=rows, zero_rest=zero_rest, x_tile_ordered=x_tile_ordered,
            local_rows=local_rows, config=config,
        )
    if x_tile_ordered:
        xv = from_tile_order(xv)
    cfg = dict(config) if config else moe_config(local_rows, e_count, n, k, sm_count(x.device))
    cfg["BK"] = tile_k(k, cfg["BK"])
    cfg, split, k_per_split = split_k(cfg, k)
    kind = OUT_KINDS[out_dtype]
    offs = expert_offsets if expert_offsets.is_contiguous() else expert_offsets.contiguous()
    target = torch.empty(split, r, n, dtype=torch.float32, device=x.device) if split > 1 else out
    n_tiles = triton.cdiv(n, cfg["BN"])
    row_tiles = min(r, triton.cdiv(r, cfg["BM"]) + e_count + 1)  # each tile with work has a row
    grid_m = cfg.pop("GRID_M", None) or max(
        1, min(row_tiles, _PROGRAMS_PER_SM * sm_count(x.device) // (n_tiles * split))
    )
    grid = (n_tiles, grid_m, split)
    _moe_gemm_kernel[grid](
        xv,
        xv if rows is None else rows,
        w,
        s,
        offs,
        target.view(torch.int16) if (split == 1 and kind == 1) else target,
        r,
        n,
        k,
        e_count,
        xv.stride(0),
        w.stride(0),
        w.stride(1),
        s.stride(0),
        s.stride(1),
        out.stride(0),
        k_per_split,
        row_tiles,
        EP=triton.next_power_of_2(e_count),
        SPLIT=split,
        OUT_KIND=kind,
        ASM=not _INTERPRET,
        F32_DOT=_INTERPRET,
        GATHER=rows is not None,
        ZERO_REST=zero_rest,
        **cfg,
        **pdl_args(xv.device),
    )
    if split > 1:
        splitk_reduce(target, out, offs[e_count:])
    return out
