"""Routed-expert FP4 GEMM for decode (1-4 rows per expert): a weight-streaming GEMV.

Drop-in for ``moe_gemm.grouped_fp4_gemm`` (same arguments, same output contract, numbers within
the same bounds; the summation order differs, so not bit-equal to it): rows
``offsets[e]:offsets[e+1]`` of ``x [R, K]`` times expert ``e``'s decoded ``W_e.T`` (packed E2M1
``[E, N, K/2]`` with UE8M0 per 1x32), fp32 accumulation, one rounding, zeros past
``offsets[-1]``. No host synchronisation; sizes from shapes only; CUDA-graph capturable.

Structure (unlike ``grouped_fp4_gemm``, which tiles rows and runs one ``tl.dot`` per K tile):

* Work items are (active expert, N tile of ``BN`` weight rows, K split). The grid is a fixed
  ``G = min(min(E, R) * items_per_expert, PPS * SMs)`` persistent programs; each reads the
  ``E + 1`` offsets once, counts the experts with rows (``tl.cumsum``) and walks items
  ``pid, pid + G, ...`` of the active experts only (experts without rows cost nothing, a
  program with no item exits at once). The K split comes from shapes (``gemv_config``): one
  expert alone (T=1) gives ~2 programs per SM in one wave; more experts give >= ~4 items per
  program so the uneven last item costs little.
* Per item the weight rows are streamed once per pass over the expert's rows, ``NB`` scale
  blocks (``16 * NB`` packed bytes per weight row) per step as ``[BN, NV, VEC]`` tensors (a
  thread holds ``VEC`` contiguous packed bytes: one vectorised load, half or all of a 32-code
  scale block), software-pipelined with ``tl.range(..., num_stages=STAGES)`` (Triton pipelines a
  loop without ``tl.dot`` only when the loop carries ``num_stages``; the loads become cp.async
  into shared memory) so ``STAGES - 1`` steps are in flight per program.
* CUDA-core FMA path (``DOT=False``, the default up to 4 rows per expert): the codes are widened
  with the integer PTX block of ``moe_gemm`` (8 codes in 10 instructions to e4m3 bytes equal to
  code * 2^-6), then e4m3 -> fp32; ``x`` is read as int32 pairs (bf16 ``x[2j]`` in the low half,
  ``x[2j+1]`` in the high half: the same index as packed byte ``j``) and split to fp32 with one
  shift / one mask, so the low nibbles multiply the even columns and the high nibbles the odd
  ones: no interleave. Each row does one FMA per code (a sequential chain over a thread's
  vector: ``tl.sum`` would reduce it as a tree, a multiply and an add per pair), and each
  vector's sum is multiplied by its block's scale (``2^(s-127+6)``, exact) once; fp32
  throughout. Rows per expert are taken in passes of ``ROWS`` (1, 2 or 4) with exact tails
  (1, 2, or 4 with one masked) so FMAs on padding are rare; a further pass re-reads the item's weight
  rows (L1/L2). Why CUDA cores: with 1-2 rows per expert (decode up to T=64 on an EP=8 rank)
  the FMAs are 1-2 per code against ~3 for the decode, while the tensor-core path pays the full
  bf16 decode (scale multiply and two more conversions, ~4.5 per code) for 16 padded rows
  whatever the row count, and needs the fp32 weight tile in registers. ``DOT=True`` keeps the
  same grid and streaming but decodes to bf16 and runs ``tl.dot`` on 16 rows per pass (chosen
  above 4 rows per expert; the benchmark times both at every T).
* Split-K is deterministic: every item writes its fp32 partial sums to a workspace
  ``[SPLITS, R, N]`` (no atomics) and ``fp8_gemm.splitk_reduce`` adds the splits in order
  0..SPLITS-1, zeros the rows past ``offsets[-1]`` and rounds once (bf16 round to nearest even
  on the bits). Each partial is written by one program with fixed arithmetic whatever the grid,
  so graph replay equals eager bit for bit.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.fp8_gemm import (
    gemm_activations,
    gemm_output,
    mma_bf16,
    scale_blocks,
    sm_count,
    splitk_reduce,
    ue8m0,
    weight_bytes,
)
from deepinfer_vllm.ops.triton.moe_gemm import _E2M1_E4M3_PTX, check_grouped_args, e2m1_e4m3_x64

__all__ = ["gemv_config", "grouped_fp4_gemv"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _codes_f32(p, ASM: tl.constexpr):
    """Packed codes (uint8, any shape) -> fp32 values * 2^-6 of the low and of the high nibbles."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_E4M3_PTX, "=r,=r,r", [p], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4
        )
    else:
        c = p & 15
        lo = ((c & 7) << 2) | ((c & 8) << 4)
        c = p >> 4
        hi = ((c & 7) << 2) | ((c & 8) << 4)
    lo = lo.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    hi = hi.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _chain(w, x, s, A: tl.constexpr, B: tl.constexpr, W: tl.constexpr):
    """``s + sum_j w[:, :, j] * x[:, :, j]`` over the ``W`` in-thread elements (``w [A, B, W]``,
    ``x [1, B, W]``), one FMA after another: ``tl.sum`` reduces a thread's elements as a tree,
    which costs a multiply and an add per pair instead of one FMA."""
    if W == 1:
        return s + tl.reshape(w, [A, B]) * tl.reshape(x, [1, B])
    else:
        w0, w1 = tl.split(tl.reshape(w, [A, B, W // 2, 2]))
        x0, x1 = tl.split(tl.reshape(x, [1, B, W // 2, 2]))
        s = _chain(w0, x0, s, A, B, W // 2)
        return _chain(w1, x1, s, A, B, W // 2)


@triton.jit
def _row_fma(acc, lo, hi, sc, xrow, bj, bmask, BN: tl.constexpr, NV: tl.constexpr, VEC: tl.constexpr):
    """``acc [BN, NV] += scale * sum over each vector of codes * x`` for one row of x
    (``xrow``: its int32 pairs; ``bj [NV, VEC]``: pair index = packed byte index)."""
    xw = tl.load(xrow + bj, mask=bmask[:, None], other=0)
    xe = (xw << 16).to(tl.float32, bitcast=True)[None, :, :]
    xo = (xw & -65536).to(tl.float32, bitcast=True)[None, :, :]
    zero = tl.zeros([BN, NV], tl.float32)
    part = _chain(lo, xe, zero, BN, NV, VEC) + _chain(hi, xo, zero, BN, NV, VEC)
    return acc + part * sc


@triton.jit
def _store_row(part_base, row, N, acc, offs_n, mask):
    tl.store(part_base + tl.cast(row, tl.int64) * N + offs_n, tl.sum(acc, axis=1), mask=mask)


@triton.jit
def _pass_fma(
    xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, nr, offs_n, n_mask, k_lo, k_hi,
    ROWS: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, VEC: tl.constexpr,
    STAGES: tl.constexpr, ASM: tl.constexpr,
):
    """Rows ``r0 .. r0 + nr - 1`` (``nr <= ROWS``, ROWS in 1, 2, 4) of one expert against the
    item's weight rows, K in ``[k_lo, k_hi)``; fp32 partials to ``part_base``."""
    NV: tl.constexpr = NB * 16 // VEC  # vectors of VEC packed bytes (2 * VEC codes) per step
    jv = tl.arange(0, NV)
    j = tl.arange(0, VEC)
    x0 = xi_ptr + tl.cast(r0, tl.int64) * stride_xi
    acc0 = tl.zeros([BN, NV], tl.float32)
    acc1 = tl.zeros([BN, NV], tl.float32)
    acc2 = tl.zeros([BN, NV], tl.float32)
    acc3 = tl.zeros([BN, NV], tl.float32)
    for k0 in tl.range(k_lo, k_hi, NB * 32, num_stages=STAGES):
        v = k0 // (2 * VEC) + jv
        b = v * VEC // 16  # the vector's 32-column scale block
        bm = b * 32 < k_hi
        bj = v[:, None] * VEC + j[None, :]
        wm = n_mask[:, None] & bm[None, :]
        p = tl.load(w_rows[:, None, None] + bj[None, :, :], mask=wm[:, :, None], other=0)
        sc = ue8m0(tl.load(s_rows[:, None] + b[None, :], mask=wm, other=0), 6)
        lo, hi = _codes_f32(p, ASM)
        acc0 = _row_fma(acc0, lo, hi, sc, x0, bj, bm, BN, NV, VEC)
        if ROWS > 1:
            acc1 = _row_fma(acc1, lo, hi, sc, x0 + stride_xi, bj, bm & (nr > 1), BN, NV, VEC)
        if ROWS > 2:
            acc2 = _row_fma(acc2, lo, hi, sc, x0 + 2 * stride_xi, bj, bm & (nr > 2), BN, NV, VEC)
            acc3 = _row_fma(acc3, lo, hi, sc, x0 + 3 * stride_xi, bj, bm & (nr > 3), BN, NV, VEC)
    _store_row(part_base, r0, N, acc0, offs_n, n_mask)
    if ROWS > 1:
        _store_row(part_base, r0 + 1, N, acc1, offs_n, n_mask & (nr > 1))
    if ROWS > 2:
        _store_row(part_base, r0 + 2, N, acc2, offs_n, n_mask & (nr > 2))
        _store_row(part_base, r0 + 3, N, acc3, offs_n, n_mask & (nr > 3))


@triton.jit
def _pass_dot(
    xb_ptr, stride_xb, w_rows, s_rows, part_base, N, r0, nr, offs_n, n_mask, k_lo, k_hi,
    BN: tl.constexpr, NB: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """Up to 16 rows ``r0 ..`` of one expert with one bf16 ``tl.dot`` per ``32 * NB`` columns."""
    BK: tl.constexpr = NB * 32
    offs_m = tl.arange(0, 16)
    m_mask = offs_m < nr
    x_rows = xb_ptr + tl.cast(r0 + offs_m, tl.int64)[:, None] * stride_xb
    acc = tl.zeros([BN, 16], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
        kh = k0 // 2 + tl.arange(0, BK // 2)
        kc = k0 // 32 + tl.arange(0, NB)
        p = tl.load(w_rows[:, None] + kh[None, :], mask=n_mask[:, None] & (kh * 2 < k_hi)[None, :], other=0)
        sw = ue8m0(tl.load(s_rows[:, None] + kc[None, :], mask=n_mask[:, None] & (kc * 32 < k_hi)[None, :], other=0), 6)
        w = scale_blocks(e2m1_e4m3_x64(p, BN, BK // 2, ASM).to(tl.float32), sw, BN, BK)
        kk = k0 + tl.arange(0, BK)
        xv = tl.load(x_rows + kk[None, :], mask=m_mask[:, None] & (kk < k_hi)[None, :], other=0.0)
        acc = mma_bf16(w, tl.trans(xv), acc, F32_DOT)
    ptr = part_base + tl.cast(r0 + offs_m, tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(ptr, acc, mask=n_mask[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["R", "E", "k_per_split", "SPLITS"])
def _moe_gemv_kernel(
    xi_ptr,  # x as int32 pairs [R, K/2]
    xb_ptr,  # x as bf16 [R, K] (the same memory; DOT path)
    w_ptr,
    s_ptr,
    off_ptr,
    part_ptr,  # fp32 [SPLITS, R, N]
    R,
    N,
    K,
    E,
    stride_xi,
    stride_xb,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    k_per_split,
    SPLITS,
    EP: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
    VEC: tl.constexpr,  # packed bytes per thread vector in the FMA path (8 or 16)
    ROWS: tl.constexpr,
    DOT: tl.constexpr,
    STAGES: tl.constexpr,
    ASM: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    eidx = tl.arange(0, EP)
    emask = eidx < E
    lo = tl.minimum(tl.load(off_ptr + eidx, mask=emask, other=0).to(tl.int32), R)
    hi = tl.minimum(tl.load(off_ptr + eidx + 1, mask=emask, other=0).to(tl.int32), R)
    active = (emask & (hi > lo)).to(tl.int32)
    cum = tl.cumsum(active, 0)
    n_active = tl.sum(active, 0)
    n_tiles = tl.cdiv(N, BN)
    tiles = n_tiles * SPLITS
    for i in range(pid, n_active * tiles, G):
        slot = i // tiles
        t = i - slot * tiles
        pid_n = t // SPLITS
        pid_k = t - pid_n * SPLITS
        e = tl.sum((cum <= slot).to(tl.int32), 0)  # the slot-th expert with rows
        sel = eidx == e
        r_lo = tl.sum(tl.where(sel, lo, 0), 0)
        r_hi = tl.sum(tl.where(sel, hi, 0), 0)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn
        part_base = part_ptr + tl.cast(pid_k, tl.int64) * R * N
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        if DOT:
            for r0 in range(r_lo, r_hi, 16):
                _pass_dot(xb_ptr, stride_xb, w_rows, s_rows, part_base, N, r0, r_hi - r0, offs_n,
                          n_mask, k_lo, k_hi, BN, NB, STAGES, ASM, F32_DOT)
        else:
            for r0 in range(r_lo, r_hi - (ROWS - 1), ROWS):
                _pass_fma(xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, ROWS, offs_n,
                          n_mask, k_lo, k_hi, ROWS, BN, NB, VEC, STAGES, ASM)
            rem = (r_hi - r_lo) % ROWS
            r0 = r_hi - rem
            if ROWS == 2:  # noqa: SIM102 - a constexpr branch around a runtime one
                if rem == 1:
                    _pass_fma(xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, 1, offs_n,
                              n_mask, k_lo, k_hi, 1, BN, NB, VEC, STAGES, ASM)
            if ROWS == 4:
                if rem == 1:
                    _pass_fma(xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, 1, offs_n,
                              n_mask, k_lo, k_hi, 1, BN, NB, VEC, STAGES, ASM)
                elif rem == 2:
                    _pass_fma(xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, 2, offs_n,
                              n_mask, k_lo, k_hi, 2, BN, NB, VEC, STAGES, ASM)
                elif rem == 3:
                    _pass_fma(xi_ptr, stride_xi, w_rows, s_rows, part_base, N, r0, 3, offs_n,
                              n_mask, k_lo, k_hi, 4, BN, NB, VEC, STAGES, ASM)


def _split_for(r: int, e_count: int, n: int, k: int, sms: int, bn: int, nb: int, pps: int) -> int:
    """K splits: for one expert (T=1) as many as keep its items within ``pps * sms`` (it covers
    the device by itself, in one wave); for more, enough that ``min(E, R)`` experts give >= ~4
    items per program (the items do not divide evenly over the programs)."""
    active = max(1, min(e_count, r))
    chunks = triton.cdiv(k, 32 * nb)
    target, n_tiles = pps * sms, triton.cdiv(n, bn)
    if active == 1:
        split = target // n_tiles
    else:
        split = triton.cdiv(4 * target, active * n_tiles)
    return max(1, min(chunks, split))


def gemv_config(r: int, e_count: int, n: int, k: int, sms: int = 132) -> dict:
    """Launch parameters from shapes only. ``PPS``: persistent programs per SM; on the GPU the
    wrapper replaces it by the CTAs that fit on an SM for the compiled kernel (registers, shared
    memory) unless a config gives it, and recomputes ``SPLIT`` (``_split_for``) with it: more
    persistent programs than fit would run as a second wave. ``ROWS``: rows per FMA pass: 1 for
    a single row (fewest registers: 3 CTAs per SM), 2 while the mean rows per expert is <= 2,
    else 4; ``DOT`` (tensor cores) above 4 rows per expert. ``STAGES``: 6 for a single row (one
    item per program: the bytes in flight are all there is), else 4."""
    active = max(1, min(e_count, r))
    mean_rows = triton.cdiv(r, active)
    rows = 1 if r == 1 else 2 if mean_rows <= 2 else 4
    cfg = dict(
        BN=32,
        NB=8,
        VEC=16 if rows == 2 else 8,  # the fewer registers on sm90 (ptxas of Triton 3.9: 151 / 168 / 239)
        ROWS=rows,
        DOT=mean_rows > 4,
        STAGES=6 if r == 1 else 4,
        PPS=3,
        num_warps=4,
    )
    cfg["SPLIT"] = _split_for(r, e_count, n, k, sms, cfg["BN"], cfg["NB"], cfg["PPS"])
    return cfg


_RESIDENT: dict = {}


def _ctas_per_sm(kernel, num_warps: int) -> int | None:
    """CTAs of ``kernel`` (a compiled Triton kernel) that fit on one SM (sm90 limits), or None."""
    try:
        kernel._init_handles()
        regs = max(int(kernel.n_regs), 1)
        smem = int(kernel.metadata.shared)
    except Exception:  # noqa: BLE001 - an older/newer Triton without these fields
        return None
    by_regs = 65536 // (triton.cdiv(regs, 8) * 8 * 32 * num_warps)
    by_smem = (228 << 10) // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // (32 * num_warps), 32))


def grouped_fp4_gemv(
    x: torch.Tensor,
    expert_offsets: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    act: str = "bf16",
    out_dtype: torch.dtype | None = None,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as ``moe_gemm.grouped_fp4_gemm``. ``config`` keys (tests, benchmarks):
    ``BN`` (weight rows per item, power of two >= 16), ``NB`` (32-column blocks per streamed
    step, power of two), ``VEC`` (8 or 16 packed bytes per thread vector, FMA path), ``ROWS``
    (1, 2 or 4: rows per FMA pass), ``DOT`` (tensor-core passes of 16 rows), ``STAGES``,
    ``PPS`` (programs per SM; default: the CTAs that fit), ``GRID`` (programs, overrides PPS),
    ``SPLIT`` (K splits), ``num_warps``, ``maxnreg``; missing keys come from ``gemv_config``."""
    check_grouped_args(x, expert_offsets, weight, scale, act)
    e_count, n, _ = weight.shape
    r, k = x.shape
    out = gemm_output(x, r, n, out_dtype)
    if r == 0:
        return out
    w, s = weight_bytes(weight, scale)
    xb = gemm_activations(x, act)
    if xb.stride(0) % 2 or xb.storage_offset() % 2:
        xb = xb.contiguous()
    xi = xb.view(torch.int32)  # [R, K/2]: pairs of bf16 (even column in the low half)
    sms = sm_count(x.device)
    user = dict(config or {})
    cfg = {**gemv_config(r, e_count, n, k, sms), **user}
    bn, nb = cfg.pop("BN"), cfg.pop("NB")
    if cfg["ROWS"] not in (1, 2, 4):
        raise ValueError(f"ROWS must be 1, 2 or 4, got {cfg['ROWS']}")
    grid_fixed, pps, split = cfg.pop("GRID", None), cfg.pop("PPS"), cfg.pop("SPLIT")
    offs = expert_offsets if expert_offsets.is_contiguous() else expert_offsets.contiguous()
    ep = triton.next_power_of_2(e_count)

    def launch(grid, part, splits, k_per_split, warmup=False):
        args = (xi, xb, w, s, offs, part, r, n, k, e_count, xi.stride(0), xb.stride(0), w.stride(0),
                w.stride(1), s.stride(0), s.stride(1), k_per_split, splits)
        kw = dict(EP=ep, BN=bn, NB=nb, ASM=not _INTERPRET, F32_DOT=_INTERPRET, **cfg)
        if warmup:  # compile only
            return _moe_gemv_kernel.warmup(*args, grid=(1,), **kw)
        return _moe_gemv_kernel[(grid,)](*args, **kw)

    if not _INTERPRET and "PPS" not in user and grid_fixed is None:
        # persistent programs: as many CTAs as fit (registers, shared memory) on each SM
        key = (x.device, ep, bn, nb, tuple(sorted(cfg.items())))
        if key not in _RESIDENT:
            probe = torch.empty(1, dtype=torch.float32, device=x.device)
            try:
                kernel = launch(1, probe, 1, k, warmup=True)
            except Exception:  # noqa: BLE001 - no warmup in this Triton: keep PPS
                kernel = None
            _RESIDENT[key] = kernel and _ctas_per_sm(kernel, cfg.get("num_warps", 4))
        if _RESIDENT[key]:
            pps = _RESIDENT[key]
            if "SPLIT" not in user:
                split = _split_for(r, e_count, n, k, sms, bn, nb, pps)
    chunks = triton.cdiv(k, 32 * nb)
    k_per_split = triton.cdiv(chunks, max(1, min(split, chunks))) * 32 * nb
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, r, n, dtype=torch.float32, device=x.device)
    items = min(e_count, r) * triton.cdiv(n, bn) * splits
    launch(max(1, min(items, grid_fixed or pps * sms)), part, splits, k_per_split)
    splitk_reduce(part, out, offs[e_count:])
    return out
