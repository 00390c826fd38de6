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

from deepinfer_vllm.ops.compressor import pool_ratio2, ring_write_reference, step_pair_rows
from deepinfer_vllm.ops.dispatch import KernelOp
from deepinfer_vllm.ops.numerics import acc_dtype
from deepinfer_vllm.ops.paged_attention import paged_sparse_attention
from deepinfer_vllm.ops.paged_indexer import indexer_topk
from deepinfer_vllm.ops.paged_records import RecordFormat, store_paged

__all__ = ["IndexerTopK", "PagedSparseAttention", "PoolPairs", "StoreRecords"]


class StoreRecords(KernelOp):
    """Quantise rows and store them as entries of requests' paged records:
    ``op(cache, fmt, block_table, req, entry, x, keep)``, the arguments of ``store_paged``
    (rows where ``keep`` is False are skipped; the kernel addresses the pages itself)."""

    name = "store_records"
    family = "attention"

    def forward_native(
        self,
        cache: torch.Tensor,
        fmt: RecordFormat | str,
        block_table: torch.Tensor,
        req: torch.Tensor,
        entry: torch.Tensor,
        x: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> None:
        store_paged(cache, fmt, block_table, req, entry, x, keep)

    def forward_triton(
        self,
        cache: torch.Tensor,
        fmt: RecordFormat | str,
        block_table: torch.Tensor,
        req: torch.Tensor,
        entry: torch.Tensor,
        x: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> None:
        from deepinfer_vllm.ops.triton.cache_store import store_records

        store_records(cache, fmt, block_table, req, entry, x.contiguous(), keep)


class PoolPairs(KernelOp):
    """The ratio-2 latents of the pairs a step's tokens close, and the compressor ring kept:
    ``op(u, g, ring, block_table, req, pos, context_lens, seq_lens, out_dtype) -> (latents, req,
    entry, keep)``.

    ``u``, ``g [T, D]`` are the step's fp32 compressor rows, ``ring [num_blocks, capacity, 2 * D]``
    the earlier steps' rows ``[u | g]`` (request ``r``'s in block ``block_table[r, 0]``, at
    ``position % capacity``); a token at an odd position closes the pair ``(pos - 1, pos)``, whose
    first row is the step's previous row or the ring's (``compressor.step_pair_rows``). Each latent is
    ``pool_ratio2`` of its pair rounded to ``out_dtype``; the caller stores row ``i`` as entry
    ``entry[i]`` of request row ``req[i]`` unless ``keep[i]`` is False. Then each request's rows
    of its last ``capacity`` positions go into the ring (read before overwritten).

    * reference: pools the closing tokens' pairs only (``keep`` is None), so every row after
      it (norm, projections, rotation) is computed for the stored latents alone;
    * Triton: two kernels (pool every token's pair, then the ring write); ``keep`` marks the
      closing tokens: sizes never depend on device values (no host synchronisation).
    """

    name = "pool_pairs"
    family = "attention"

    def forward_native(
        self,
        u: torch.Tensor,
        g: torch.Tensor,
        ring: torch.Tensor,
        block_table: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        context_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        first = step_pair_rows(u, g, ring, block_table, req, pos, context_lens)
        closes = (pos % 2) == 1
        d = u.shape[-1]
        pair_u = torch.stack([first[closes, :d], u[closes]], dim=1)
        pair_g = torch.stack([first[closes, d:], g[closes]], dim=1)
        lat = pool_ratio2(pair_u.flatten(0, 1), pair_g.flatten(0, 1), acc_dtype(out_dtype)).to(out_dtype)
        ring_write_reference(ring, block_table, req, pos, seq_lens, u, g)
        return lat, req[closes], pos[closes] // 2, None

    def forward_triton(
        self,
        u: torch.Tensor,
        g: torch.Tensor,
        ring: torch.Tensor,
        block_table: torch.Tensor,
        req: torch.Tensor,
        pos: torch.Tensor,
        context_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        from deepinfer_vllm.ops.triton.cache_store import pool_pairs, ring_write

        lat, entry, closes = pool_pairs(u, g, ring, block_table, req, pos, context_lens, out_dtype)
        ring_write(ring, block_table, req, pos, seq_lens, u, g)
        return lat, req, entry, closes


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
