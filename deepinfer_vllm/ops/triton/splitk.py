"""Pieces the weight GEMM kernels share: the output store (fp32, bf16 rounded on the bits, fp16), the fixed-order
split-K reduction, the split of K into whole tiles and the SM count. Imports no other kernel module (the Triton and
Gluon GEMMs all import this one).

Split K without a second launch (``split_fixup``): each program stores its fp32 partial tile in the workspace
``[SPLIT, rows, N]`` and counts itself in the tile's arrival counter (one atomic with release/acquire order at GPU
scope, after a barrier of the program's threads); the program that arrives last adds the ``SPLIT`` partials in split
order, exactly as ``splitk_reduce`` does (so the bits do not depend on which program is last), stores the rounded
tile and resets the counter for the next launch. The counters (``split_counters``) are one zeroed int32 buffer per
device, left zero by every launch; GEMMs using them run one at a time on the device (one stream), as the model's do.
Measured on the H200 (one Flash-shaped layer step): at 1 row this saves the reduction launches; at 64 rows a tile's
partials (up to 8 x 64 x 128 fp32) are too many for one program and the separate ``splitk_reduce``, spread over the
device, is faster (dense FP8 GEMMs 159 -> 279 us per step with the fixup). So tiles of up to ``FIXUP_ROWS`` rows use
the fixup, larger ones ``splitk_reduce``, as do the grouped expert GEMMs (whose reduction also zeroes the rows past
the last expert)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args

__all__ = [
    "FIXUP_ROWS",
    "OUT_KINDS",
    "sm_count",
    "split_counters",
    "split_fixup",
    "split_k",
    "splitk_reduce",
    "store_out",
]

OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FIXUP_ROWS = 16  # split tiles of at most this many rows are added by their last program (module docstring)


@triton.jit
def store_out(ptr, v, mask, OUT_KIND: tl.constexpr):
    """Store fp32 ``v`` as fp32 (0), bf16 bits rounded to nearest even (1) or fp16 (2)."""
    if OUT_KIND == 1:
        bits = v.to(tl.int32, bitcast=True)
        tl.store(ptr, ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16), mask=mask)
    elif OUT_KIND == 2:
        tl.store(ptr, v.to(tl.float16), mask=mask)
    else:
        tl.store(ptr, v, mask=mask)


@triton.jit
def split_fixup(
    part_ptr, out_ptr, counter_ptr, tile, acc, offs_m, offs_n, omask, pid_k, rows, N, stride_om,
    SPLIT: tl.constexpr, OUT_KIND: tl.constexpr,
):
    """A ``[BN, BM]`` (column, row) tile's partial ``acc`` of split ``pid_k``; the last of the tile's ``SPLIT``
    programs to arrive adds the partials in split order and stores the tile into ``out`` (module docstring)."""
    part = part_ptr + offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(part + pid_k.to(tl.int64) * rows * N, acc, mask=omask)
    tl.debug_barrier()  # every thread's partial is written before the arrival is counted
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT - 1:
        total = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT):
            total += tl.load(part + s * rows * N, mask=omask, other=0.0, cache_modifier=".cg")
        out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        store_out(out, total, omask, OUT_KIND)
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed arrival counters, at least ``tiles`` of them (``split_fixup``)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counters


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,
    out_ptr,
    limit_ptr,
    M,
    N,
    stride_om,
    SPLIT: tl.constexpr,
    HAS_LIMIT: tl.constexpr,  # rows >= *limit_ptr are written as zeros (grouped GEMM)
    BLOCK: tl.constexpr,
    OUT_KIND: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[m, n] = sum_s part[s, m, n]``, s in order 0..SPLIT-1 (deterministic)."""
    grid_wait(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    total = M * N
    mask = i < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * total + i, mask=mask, other=0.0)
    row = i // N
    if HAS_LIMIT:
        acc = tl.where(row < tl.load(limit_ptr).to(tl.int64), acc, 0.0)
    store_out(out_ptr + row * stride_om + (i - row * N), acc, mask, OUT_KIND)


def splitk_reduce(part: torch.Tensor, out: torch.Tensor, limit: torch.Tensor | None = None) -> None:
    split, m, n = part.shape
    block = 1024
    kind = OUT_KINDS[out.dtype]
    _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
        part,
        out.view(torch.int16) if kind == 1 else out,
        limit if limit is not None else part,
        m,
        n,
        out.stride(0),
        SPLIT=split,
        HAS_LIMIT=limit is not None,
        BLOCK=block,
        OUT_KIND=kind,
        num_warps=4,
        **pdl_args(part.device),
    )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_k(cfg: dict, k: int) -> tuple[dict, int, int]:
    """A launch config without its ``SPLIT`` entry, the number of K splits it gives and the
    K columns per split (whole ``BK`` tiles; fewer splits than asked when K is short)."""
    split = cfg.pop("SPLIT", 1)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["BK"]), split) * cfg["BK"]
    return cfg, triton.cdiv(k, k_per_split), k_per_split
