"""PyTorch reference of sparse MLA attention read straight from the paged caches.

The decode kernel (``ops/triton/sparse_mla_decode.py``) reads the window keys
from the layer's MXFP8 window cache and the top-k keys from the KV source's
NVFP4 compressed cache, page by page, without materialising them. This module
is the same operator written by composition: gather the records with
``paged_records.read_records`` at the addresses the model uses
(``PagedView._slot``), then ``sparse_attention``. It materialises the gathered
keys, so it is the baseline and the test oracle, not a fast path. Any device;
no vLLM.

``PagedSparseAttention`` is the operator the attention layer calls: this
reference, or ``sparse_mla_decode`` on the Triton backend (same arguments).
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.paged_records import RecordFormat, read_records, record_address
from deepinfer_vllm.ops.sparse_attention import sparse_attention

__all__ = [
    "WINDOW_FORMAT",
    "COMPRESSED_FORMAT",
    "paged_sparse_attention",
    "paged_window_keys",
    "paged_compressed_keys",
]

WINDOW_FORMAT = "mxfp8"
COMPRESSED_FORMAT = "nvfp4"


def paged_window_keys(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    positions: torch.Tensor,
    window_lo: torch.Tensor,
    token_req: torch.Tensor,
    window: int,
    dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window keys ``[T, window, dim]`` (positions ``p-window+1 .. p``) and their validity.

    A key is valid iff its position is ``>= max(window_lo, 0)``; invalid keys are zeros
    (their cache slots may hold any bytes).
    """
    pos = positions.long().view(-1, 1)
    key_pos = pos - (window - 1) + torch.arange(window, device=pos.device).view(1, -1)
    lo = window_lo.long().view(-1, 1).clamp_min(0)
    valid = key_pos >= lo
    safe = torch.where(valid, key_pos, torch.zeros_like(key_pos))
    blocks, offsets = record_address(block_table, token_req.view(-1, 1), safe, 1, block_size)
    fmt = RecordFormat(WINDOW_FORMAT, dim)
    keys = read_records(cache, fmt, blocks, offsets, dtype)
    return keys.masked_fill(~valid.unsqueeze(-1), 0.0), valid


def paged_compressed_keys(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    ratio: int,
    topk: torch.Tensor,
    token_req: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed keys ``[T, K, dim]`` of the entries ``topk [T, K]`` (-1 = none) and validity."""
    if block_size % ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of the ratio {ratio}")
    valid = topk >= 0
    entry = torch.where(valid, topk.long(), torch.zeros_like(topk, dtype=torch.long))
    blocks, offsets = record_address(block_table, token_req.view(-1, 1), entry, ratio, block_size)
    fmt = RecordFormat(COMPRESSED_FORMAT, dim)
    keys = read_records(cache, fmt, blocks, offsets, dtype)
    return keys.masked_fill(~valid.unsqueeze(-1), 0.0), valid


def paged_sparse_attention(
    q: torch.Tensor,
    window_cache: torch.Tensor,
    window_block_table: torch.Tensor,
    window_block_size: int,
    positions: torch.Tensor,
    window_lo: torch.Tensor,
    token_req: torch.Tensor,
    window: int,
    sink: torch.Tensor | None,
    scale: float,
    comp_cache: torch.Tensor | None = None,
    comp_block_table: torch.Tensor | None = None,
    comp_block_size: int | None = None,
    comp_ratio: int | None = None,
    topk: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]`` attends its window keys (+ its top-k compressed keys) -> ``[T, H, D]``.

    Token ``t`` belongs to request row ``token_req[t]`` (block tables are per request).
    Semantics are ``sparse_attention``'s (keys = values, fp32 logits, sink in the denominator).
    """
    T, H, D = q.shape
    keys, valid = paged_window_keys(
        window_cache, window_block_table, window_block_size, positions, window_lo, token_req,
        window, D, q.dtype,
    )
    if topk is not None:
        if comp_cache is None or comp_block_table is None or comp_block_size is None or comp_ratio is None:
            raise ValueError("topk needs comp_cache, comp_block_table, comp_block_size and comp_ratio")
        ckeys, cvalid = paged_compressed_keys(
            comp_cache, comp_block_table, comp_block_size, comp_ratio, topk, token_req, D, q.dtype
        )
        keys = torch.cat([keys, ckeys], dim=1)
        valid = torch.cat([valid, cvalid], dim=1)
    return sparse_attention(q, keys, valid, sink, scale)
