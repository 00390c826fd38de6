"""Lightning-indexer references: which compressed entries each query attends to.

An index-source layer scores every compressed entry a query sees with
``sum_h w_h relu(q_h . k_j)`` (``index_scores``) and keeps the ``index_topk`` best
(``select_topk``); the candidate source first keeps whole blocks of entries
(``candidate_block_mask``) and the reindex layers of its KV segment select only inside them.

Conventions: compressed entry ``j`` of a ratio-``r`` source is visible to a query at position
``p`` iff ``j < floor((p + 1) / r)`` (``visible_compressed``). Every selection is a stable
descending sort, so equal scores resolve to the LOWER index.
"""

from __future__ import annotations

import torch

from deepinfer_vllm import envs

from .numerics import acc_dtype, matmul

__all__ = [
    "visible_compressed",
    "index_scores",
    "candidate_block_mask",
    "select_topk",
]

_CHUNK_ELEMS = 1 << 24  # bound the [Tq_chunk, H, N] fp32 intermediate of index_scores


def visible_compressed(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Number of compressed entries visible at each position: ``floor((p + 1) / ratio)`` (int64)."""
    return torch.div(positions.long() + 1, ratio, rounding_mode="floor")


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``I[t, j] = sum_h weights[t, h] * relu(q[t, h] . keys[j])`` -> fp32 ``[Tq, N]``, ``-inf`` for
    ``j >= visible[t]``.

    ``q [Tq, H, Dk]`` and ``keys [N, Dk]`` are already quantise-dequantised by the caller;
    ``weights [Tq, H]`` are used as given (DeepInfer omits the positive ``128^-0.5 * 32^-0.5``
    factor; it is a power of two, so including it or not changes no rounding and no top-k).
    Numerics: dot products, ReLU, weighting and the head sum in fp32, then the score is rounded
    once to ``out_dtype`` (default ``q.dtype``, i.e. the model dtype; DeepInfer's logits kernel
    emits bf16) and returned as fp32 holding those rounded values. Rounding can create ties;
    they are broken by index downstream.
    """
    Tq, H, Dk = q.shape
    N = keys.shape[0]
    out_dtype = q.dtype if out_dtype is None else out_dtype
    acc = acc_dtype(q.dtype)
    kf = keys.to(acc)
    out = torch.empty(Tq, N, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, H * N))
    for a in range(0, Tq, step):  # query chunks bound memory; each chunk is fully vectorised
        b = min(Tq, a + step)
        if envs.batch_invariant():
            s = _row_invariant_scores(q[a:b].to(acc), kf, weights[a:b].to(acc))
        else:
            logits = torch.einsum("thd,nd->thn", q[a:b].to(acc), kf).clamp_min_(0.0)
            s = torch.einsum("thn,th->tn", logits, weights[a:b].to(acc))
        out[a:b] = s.to(out_dtype).float()
    cols = torch.arange(N, device=q.device)
    hidden = cols.unsqueeze(0) >= visible.long().view(-1, 1)
    return out.masked_fill(hidden, float("-inf"))


def _row_invariant_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``index_scores``' sum in batch-invariant mode: the dot products by
    ``numerics.matmul`` with row and column tiles (a query's step rows and the
    number of keys vary), the head sum as one multiply and one add per head in
    head order (separate correctly rounded ops, the same for every element)."""
    Tq, H, _ = q.shape
    logits = matmul(q, keys, col_tile=True).clamp_min_(0.0)
    s = logits[:, 0] * weights[:, 0:1]
    for h in range(1, H):
        s = s + logits[:, h] * weights[:, h : h + 1]
    return s


def _stable_desc_order(values: torch.Tensor) -> torch.Tensor:
    return torch.sort(values, dim=-1, descending=True, stable=True).indices


def candidate_block_mask(
    scores: torch.Tensor,
    visible: torch.Tensor,
    block_size: int,
    topk_blocks: int,
) -> torch.Tensor:
    """Hierarchical candidate mask ``bool [Tq, N]`` (DeepInfer's candidate blocks).

    * entries ``j >= visible`` are ignored (treated as ``-inf``);
    * block score = max over the block's entries, capped at the largest finite fp32;
    * the block holding the newest visible entry, ``(visible - 1) // block_size``, gets ``+inf``
      (always kept when ``visible > 0``);
    * blocks whose score is ``-inf`` (no finite visible entry) are never kept;
    * the ``topk_blocks`` best blocks are kept, ties -> lower block index;
    * the mask marks the visible entries (``j < visible``) of the kept blocks.
    """
    Tq, N = scores.shape
    vis = visible.long().view(-1, 1)
    cols = torch.arange(N, device=scores.device)
    s = scores.float().masked_fill(cols.unsqueeze(0) >= vis, float("-inf"))
    s = torch.nan_to_num(s, nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf"))
    nb = (N + block_size - 1) // block_size
    pad = nb * block_size - N
    if pad:
        s = torch.cat([s, s.new_full((Tq, pad), float("-inf"))], dim=1)
    block = s.view(Tq, nb, block_size).amax(dim=-1)
    newest = ((vis - 1).clamp_min(0) // block_size).view(-1)
    has_any = visible.long().view(-1) > 0
    rows = torch.arange(Tq, device=scores.device)
    block[rows[has_any], newest[has_any]] = float("inf")
    order = _stable_desc_order(block)[:, : min(topk_blocks, nb)]
    take = block.gather(1, order) > float("-inf")
    keep_block = torch.zeros(Tq, nb, dtype=torch.bool, device=scores.device)
    keep_block.scatter_(1, order, take)
    mask = keep_block.repeat_interleave(block_size, dim=1)[:, :N]
    return mask & (cols.unsqueeze(0) < vis)


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest selectable scores per row -> int64 ``[Tq, k]``.

    Selectable = not ``-inf`` and not NaN (``+inf`` counts). Ties -> lower index. The chosen
    indices are returned sorted ASCENDING, followed by ``-1`` fill when a row has fewer than
    ``k`` selectable entries (so gathers downstream are deterministic).
    """
    Tq, N = scores.shape
    s = torch.nan_to_num(scores.float(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    kk = min(k, N)
    order = _stable_desc_order(s)[:, :kk]
    ok = s.gather(1, order) > float("-inf")
    ranked = torch.where(ok, order, torch.full_like(order, N))  # N sorts after every real index
    ranked = torch.sort(ranked, dim=-1).values
    ranked = torch.where(ranked == N, torch.full_like(ranked, -1), ranked)
    if kk < k:
        ranked = torch.cat([ranked, ranked.new_full((Tq, k - kk), -1)], dim=1)
    return ranked
