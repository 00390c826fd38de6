"""The attention step's operators, each with the PyTorch reference and the Triton kernels as two
implementations of one call (``ops.dispatch.KernelOp``, chosen once when the layer is built).

``V41Attention`` runs one path over these: ``StoreRecords`` (quantise-and-store into a paged
cache), ``PoolPairs`` (the ratio-2 compressor's gated pooling), ``IndexerTopK`` (indexer scores
and top-k over the paged index keys) and ``PagedSparseAttention`` (attention read from the paged
records). The references live in ``paged_records``, ``compressor``, ``paged_indexer`` and
``paged_attention``; the kernels in ``ops/triton`` (imported on first use: Triton is a CUDA-only
dependency).
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.compressor import pool_ratio2
from deepinfer_vllm.ops.dispatch import KernelOp
from deepinfer_vllm.ops.numerics import acc_dtype
from deepinfer_vllm.ops.paged_attention import paged_sparse_attention
from deepinfer_vllm.ops.paged_indexer import indexer_topk
from deepinfer_vllm.ops.paged_records import RecordFormat, write_records_at_slots

__all__ = ["IndexerTopK", "PagedSparseAttention", "PoolPairs", "StoreRecords"]


class StoreRecords(KernelOp):
    """Quantise rows and store them at flat record slots (slots < 0 skipped):
    ``op(cache, fmt, slots, x)``, the arguments of ``write_records_at_slots``."""

    name = "store_records"
    family = "attention"

    def forward_native(
        self, cache: torch.Tensor, fmt: RecordFormat | str, slots: torch.Tensor, x: torch.Tensor
    ) -> None:
        write_records_at_slots(cache, fmt, slots, x)

    def forward_triton(
        self, cache: torch.Tensor, fmt: RecordFormat | str, slots: torch.Tensor, x: torch.Tensor
    ) -> None:
        from deepinfer_vllm.ops.triton.cache_store import store_records

        store_records(cache, fmt, slots, x.contiguous())


class PoolPairs(KernelOp):
    """The ratio-2 latents of the pairs a step's tokens close:
    ``op(first, second, closes, req, entry, out_dtype) -> (latents, req, entry, keep)``.

    ``first`` / ``second`` are each token's pair rows ``[T, 2 * D]`` fp32 laid out ``[u | g]``
    (the pair's first row and the token's own), ``closes [T]`` marks the tokens that close a
    pair (odd positions), ``req`` / ``entry`` their request rows and group indices. Each
    latent is ``pool_ratio2`` of its pair rounded to ``out_dtype``; the caller stores row ``i``
    as entry ``entry[i]`` of request row ``req[i]`` unless ``keep[i]`` is False.

    * reference: pools the closing tokens' pairs only (``keep`` is None), so every row after
      it (norm, projections, rotation) is computed for the stored latents alone;
    * Triton: pools every token's pair and returns ``keep = closes``: sizes never depend on
      device values (no host synchronisation).
    """

    name = "pool_pairs"
    family = "attention"

    def forward_native(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        closes: torch.Tensor,
        req: torch.Tensor,
        entry: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        d = first.shape[-1] // 2
        pair_u = torch.stack([first[closes, :d], second[closes, :d]], dim=1)
        pair_g = torch.stack([first[closes, d:], second[closes, d:]], dim=1)
        lat = pool_ratio2(pair_u.flatten(0, 1), pair_g.flatten(0, 1), acc_dtype(out_dtype)).to(out_dtype)
        return lat, req[closes], entry[closes], None

    def forward_triton(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        closes: torch.Tensor,
        req: torch.Tensor,
        entry: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        from deepinfer_vllm.ops.triton.cache_store import pool_pairs

        return pool_pairs(first.contiguous(), second.contiguous(), out_dtype), req, entry, closes


class IndexerTopK(KernelOp):
    """Indexer scores and top-k (and the candidate source's kept blocks) over the paged index
    keys: ``op(q, w, index_cache, ..., max_visible=...)``, the arguments of ``indexer_topk``."""

    name = "indexer_topk"
    family = "attention"

    def forward_native(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return indexer_topk(*args, **kwargs)

    def forward_triton(
        self, q: torch.Tensor, w: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from deepinfer_vllm.ops.triton.indexer import indexer_topk as indexer_topk_triton

        return indexer_topk_triton(q.contiguous(), w.contiguous(), *args, **kwargs)


class PagedSparseAttention(KernelOp):
    """Sparse attention over the paged window records (+ the selected compressed records):
    ``op(q, window_cache, ..., topk=None)``, the arguments of ``paged_sparse_attention``."""

    name = "paged_sparse_attention"
    family = "attention"

    def forward_native(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return paged_sparse_attention(q, *args, **kwargs)

    def forward_triton(self, q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        from deepinfer_vllm.ops.triton.sparse_mla_decode import sparse_mla_decode

        return sparse_mla_decode(q.contiguous(), *args, **kwargs)
