"""V4.1 attention steps on the Triton kernels (the CUDA path of the backend).

Mirrors ``V41Attention``'s reference path step for step; only the three hot
operators change: records are quantised and stored by ``store_records``
(bit-exact), the indexer scores the paged MXFP4 keys and selects on the
device (``indexer_topk``), and attention reads the MXFP8 / NVFP4 records
straight from the pages (``sparse_mla_decode``). The step metadata is on the
activations' device already; sizes come from host bounds, never from a
device value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deepinfer_vllm.model_executor.layers.step_state import PagedView, StepState
from deepinfer_vllm.model_executor.layers.weights import linear
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.triton.cache_store import pool_pairs, store_records  # noqa: F401 (pool_pairs: used by V41Attention)
from deepinfer_vllm.ops.triton.indexer import indexer_topk
from deepinfer_vllm.ops.triton.sparse_mla_decode import sparse_mla_decode

if TYPE_CHECKING:
    from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention

# Blackboard key of the candidate source's kept block ids [T, blocks] (per token).
KEPT_BLOCKS = "kept_blocks"


def store(view: PagedView, req: torch.Tensor, entry: torch.Tensor, x: torch.Tensor, keep=None) -> None:
    """Quantise-and-store rows of ``x``; rows where ``keep`` is False are skipped (slot -1)."""
    if entry.numel() == 0:
        return
    s = view.slots(req, entry)
    if keep is not None:
        s = torch.where(keep, s, torch.full_like(s, -1))
    store_records(view.layer.kv_cache, view.layer.record, s, x.contiguous())


def max_visible(state: StepState, ratio: int) -> int | None:
    """Host upper bound of ``(positions + 1) // ratio`` over the step (None: unknown)."""
    return state.max_seq_len // ratio if state.max_seq_len else None


def select(attn: "V41Attention", x: torch.Tensor, c_q: torch.Tensor, state: StepState) -> torch.Tensor:
    """Top-k compressed entries of every token (-1 = none) from the paged index keys."""
    a = attn.arch
    r = attn.role.ratio
    T = x.shape[0]
    idx = attn.indexer
    pos = state.positions
    qi = linear(idx.wq_b, c_q).view(T, a.index_n_heads, a.index_head_dim)
    qi = quant.mxfp4_qdq(attn._rope(qi, pos))
    w = linear(idx.weights_proj, x)
    keys = PagedView(attn.kv_source.index_cache, state)
    candidates = state.candidates.get(KEPT_BLOCKS) if attn.role.uses_candidates else None
    topk, kept = indexer_topk(
        qi.contiguous(),
        w.contiguous(),
        keys.layer.kv_cache,
        keys.meta.block_table,
        state.token_req,
        (pos + 1) // r,
        ratio=r,
        block_size=keys.meta.block_size,
        topk=a.index_topk,
        candidates=candidates,
        candidate_source=attn.role.is_candidate_source,
        candidate_block_size=a.candidate_block_size,
        candidate_topk_blocks=a.candidate_topk_blocks,
        out_dtype=x.dtype,
        # A host bound on every token's visible entries: sizes without a sync.
        max_visible=max_visible(state, r),
    )
    if kept is not None:
        state.candidates[KEPT_BLOCKS] = kept
    return topk


def attend(
    attn: "V41Attention",
    q: torch.Tensor,
    state: StepState,
    window: PagedView,
    window_lo: torch.Tensor,
    topk: torch.Tensor | None,
) -> torch.Tensor:
    """Sparse attention over the window records and the selected compressed records."""
    a = attn.arch
    comp = dict()
    if topk is not None:
        source = attn.kv_source
        comp_view = PagedView(source.compressed_cache, state)
        comp = dict(
            comp_cache=comp_view.layer.kv_cache,
            comp_block_table=comp_view.meta.block_table,
            comp_block_size=comp_view.meta.block_size,
            comp_ratio=source.role.ratio,
            topk=topk,
        )
    return sparse_mla_decode(
        q.contiguous(),
        window.layer.kv_cache,
        window.meta.block_table,
        window.meta.block_size,
        state.positions,
        window_lo,
        state.token_req,
        a.sliding_window,
        attn.attn_sink.float(),
        a.head_dim**-0.5,
        **comp,
    )
