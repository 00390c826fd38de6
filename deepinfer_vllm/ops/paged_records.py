"""Quantised KV records stored in vLLM-managed pages.

vLLM hands every cache layer a ``[num_blocks, 1, states_per_block, record_bytes]``
uint8 view. A page keeps the values of all its records first and their scales
after them ("values region, then scales region"), so that a kernel can stream
the value bytes of a whole page without stepping over scale bytes. This module
is the one place that knows that layout; it imports no vLLM so the GPU host and
the reference tests can use it.

``StoreRecords`` is the quantise-and-store operator the attention layer calls:
``store_paged`` here, ``ops.triton.cache_store.store_records`` on the Triton backend
(same arguments, same bytes; the kernel reads the block table itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_vllm.ops import quant


@dataclass(frozen=True)
class RecordFormat:
    """One cache record: ``dim`` values encoded as ``fmt``."""

    fmt: str  # "mxfp8" | "nvfp4" | "mxfp4"
    dim: int

    @property
    def value_bytes(self) -> int:
        return quant.record_bytes(self.fmt, self.dim)[0]

    @property
    def scale_bytes(self) -> int:
        return quant.record_bytes(self.fmt, self.dim)[1]

    @property
    def record_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes


def split_page_regions(
    cache: torch.Tensor, fmt: RecordFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(values [B, N, value_bytes], scales [B, N, scale_bytes])``.

    ``cache`` is the per-layer view vLLM binds (``[B, 1, N, record_bytes]`` or
    ``[B, N, record_bytes]``); pages may be padded, so the block stride is kept.
    """
    if cache.dim() == 4:
        cache = cache.squeeze(1)
    num_blocks, num_states, record = cache.shape
    assert record == fmt.record_bytes, (record, fmt)
    flat = cache.flatten(1)
    split = num_states * fmt.value_bytes
    values = flat[:, :split].unflatten(1, (num_states, fmt.value_bytes))
    scales = flat[:, split:].unflatten(1, (num_states, fmt.scale_bytes))
    return values, scales


def record_address(
    block_table: torch.Tensor, req: torch.Tensor, entry: torch.Tensor, ratio: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of entry ``entry`` of request row ``req`` (any shapes that
    broadcast; clamp invalid entries first) in a cache with one record per ``ratio`` tokens:
    its first token ``entry * ratio`` lies in column ``first // block_size`` of the block
    table, at record ``(first % block_size) // ratio`` of that page. The one place the
    reference path addresses pages (the kernels do the same arithmetic on the device)."""
    first = entry.long() * ratio
    blocks = block_table[req.long(), first // block_size].long()
    return blocks, (first % block_size) // ratio


def write_records(
    cache: torch.Tensor,
    fmt: RecordFormat,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    x: torch.Tensor,
) -> None:
    """Quantise ``x [n, dim]`` and store record i at ``(blocks[i], offsets[i])``."""
    if x.shape[0] == 0:
        return
    values, scales = split_page_regions(cache, fmt)
    q_values, q_scales = quant.quantize(fmt.fmt, x)
    values[blocks, offsets] = q_values
    scales[blocks, offsets] = q_scales


def store_paged(
    cache: torch.Tensor,
    fmt: RecordFormat | str,
    block_table: torch.Tensor,
    req: torch.Tensor,
    entry: torch.Tensor,
    x: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> None:
    """Quantise ``x [n, dim]`` and store row ``i`` as entry ``entry[i]`` of request row ``req[i]``
    (``block_table [R, W]``), skipping rows where ``keep [n]`` is False.

    A page holds ``N = cache.shape[-2]`` records: entry ``e`` sits in page column ``e // N`` at
    record ``e % N`` (``record_address`` with ``block_size = N * ratio``, the same place). The
    reference of ``ops.triton.cache_store.store_records``, which takes the same arguments. A
    format name means records of ``x.shape[-1]`` dims."""
    if isinstance(fmt, str):
        fmt = RecordFormat(fmt, x.shape[-1])
    if keep is not None:
        req, entry, x = req[keep], entry[keep], x[keep]
    num_states = cache.shape[-2]
    blocks, offsets = record_address(block_table, req, entry, 1, num_states)
    write_records(cache, fmt, blocks, offsets, x)


def read_records(
    cache: torch.Tensor,
    fmt: RecordFormat,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantise the records at ``(blocks, offsets)`` (any index shape)."""
    values, scales = split_page_regions(cache, fmt)
    return quant.dequantize(fmt.fmt, values[blocks, offsets], scales[blocks, offsets], dtype)
