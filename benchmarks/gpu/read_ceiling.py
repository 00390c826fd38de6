"""What a plain reader gets out of the indexer's access patterns: the ceiling its kernels are
compared with in ``benchmarks/HISTORY.md``, run 11. ``python benchmarks/gpu/indexer.py
--read-ceiling`` prints, per shape, the indexer's time and that of a Triton kernel that only
reads the same bytes (whole pages of the block tables for dense rows, the kept blocks' 512 value
and 32 scale bytes for the candidate path) and writes one word per page or block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _read_pages(words, pages, out, stride_w, n, PAGE_W: tl.constexpr, W: tl.constexpr, G: tl.constexpr):
    """XOR of each of ``G`` pages' first ``PAGE_W`` words (their records) per program."""
    i = tl.program_id(0) * G + tl.arange(0, G)
    m = i < n
    base = tl.load(pages + i, mask=m, other=0).to(tl.int64) * stride_w
    v = tl.arange(0, W)
    x = tl.load(words + base[:, None] + v[None, :], mask=m[:, None] & (v < PAGE_W)[None, :], other=0)
    tl.store(out + i, tl.xor_sum(x, 1), mask=m)


@triton.jit
def _read_blocks(words, pages, groups, out, stride_w, n, PAGE_N: tl.constexpr, G: tl.constexpr):
    """XOR of the 8 records (128 value words, 8 scale words) of each of ``G`` blocks per program."""
    i = tl.program_id(0) * G + tl.arange(0, G)
    m = i < n
    base = tl.load(pages + i, mask=m, other=0).to(tl.int64) * stride_w
    grp = tl.load(groups + i, mask=m, other=0)
    v = tl.arange(0, 128)
    x = tl.load(words + base[:, None] + grp[:, None] * 128 + v[None, :], mask=m[:, None], other=0)
    s = tl.arange(0, 8)
    y = tl.load(words + base[:, None] + PAGE_N * 16 + grp[:, None] * 8 + s[None, :], mask=m[:, None], other=0)
    tl.store(out + i, tl.xor_sum(x, 1) ^ tl.xor_sum(y, 1), mask=m)


def _cache_words(cache: torch.Tensor) -> torch.Tensor:
    """The whole cache buffer as int32 words (the benchmark's pages are 16-byte aligned)."""
    return torch.as_strided(cache, (cache.shape[0] * cache.stride(0),), (1,)).view(torch.int32)


def read_pages(cache: torch.Tensor, block_table: torch.Tensor, page_n: int, rec: int):
    """A launcher reading every page of ``block_table``'s rows (``page_n`` records of ``rec``
    bytes each)."""
    words, pages = _cache_words(cache), block_table.reshape(-1).contiguous()
    n, page_w = pages.numel(), page_n * rec // 4
    out = torch.empty(n, dtype=torch.int32, device=cache.device)
    G = 4
    return lambda: _read_pages[(triton.cdiv(n, G),)](words, pages, out, cache.stride(0) // 4, n, PAGE_W=page_w,
                                                     W=triton.next_power_of_2(page_w), G=G, num_warps=4)


def read_blocks(cache: torch.Tensor, block_table: torch.Tensor, token_req: torch.Tensor, kept: torch.Tensor,
                page_n: int):
    """A launcher reading the records of every kept block of 8 entries (``kept``: ``[T, nb]``)."""
    entry = kept.long() * 8
    pages = block_table.long()[token_req.long()[:, None], entry // page_n].reshape(-1).to(torch.int32)
    groups = ((entry % page_n) // 8).reshape(-1).to(torch.int32)
    words, n = _cache_words(cache), pages.numel()
    out = torch.empty(n, dtype=torch.int32, device=cache.device)
    G = 8
    return lambda: _read_blocks[(triton.cdiv(n, G),)](words, pages, groups, out, cache.stride(0) // 4, n,
                                                      PAGE_N=page_n, G=G, num_warps=2)
