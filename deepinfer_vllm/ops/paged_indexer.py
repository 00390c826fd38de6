"""Lightning-indexer operators over the PAGED MXFP4 index cache (PyTorch reference).

These are the ground truth of the Triton kernels in ``ops/triton/indexer.py`` and
``ops/triton/topk.py`` and have the same signatures; they run on any device. Each is
composed from ``ops/indexer.py`` (scores, selection, candidate blocks) and
``ops/paged_records.read_records`` (the page layout), so the only new thing here is the
addressing: entry ``e`` of request row ``req`` lives at
``block_table[req, e * ratio // block_size]``, record ``(e * ratio % block_size) // ratio``
of that page (``paged_records.record_address``), i.e. page ``e // N``, slot ``e % N`` with
``N = block_size // ratio`` records per page.

Candidate blocks are passed between layers as kept block ids ``[T, nb]`` (ascending, -1
fill) instead of a boolean mask. ``index_scores_paged_sparse`` scores only those
``nb * block`` entries in a compact buffer (column ``c`` = entry
``ids[c // block] * block + c % block``), as the Triton kernel does; the map is monotone, so
ascending order and lower-index ties survive. The reference selection ``indexer_topk``
instead scores every visible entry and masks the others with the mask rebuilt from the ids
(``candidate_mask_from_blocks``), so a reindex layer's scores come from the same GEMMs as
every other index source's (the compact per-token GEMMs may sum in another order on a CPU).

``IndexerTopK`` is the operator the attention layer calls: ``indexer_topk`` here, or
``ops.triton.indexer.indexer_topk`` on the Triton backend (same arguments).
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.indexer import index_scores, select_topk
from deepinfer_vllm.ops.paged_records import RecordFormat, read_records, record_address

__all__ = [
    "index_record",
    "check_index_cache",
    "index_scores_paged",
    "index_scores_paged_sparse",
    "topk_indices",
    "block_scores",
    "candidate_blocks",
    "candidate_mask_from_blocks",
    "restore_candidate_indices",
    "indexer_topk",
]

NEG_INF = float("-inf")


def index_record(dim: int) -> RecordFormat:
    """The MXFP4 record of one index key (``dim`` = 128 for Flash: 64 + 4 = 68 bytes)."""
    return RecordFormat("mxfp4", dim)


def check_index_cache(index_cache: torch.Tensor, dim: int, ratio: int, block_size: int) -> int:
    """Validate ``[num_blocks, (1,) N, record_bytes]`` uint8 pages; returns ``N``."""
    if index_cache.dtype != torch.uint8:
        raise TypeError(f"index cache must be uint8, got {index_cache.dtype}")
    if index_cache.dim() not in (3, 4) or (index_cache.dim() == 4 and index_cache.shape[1] != 1):
        raise ValueError(f"index cache must be [blocks, (1,) N, R], got {tuple(index_cache.shape)}")
    if ratio < 1 or block_size % ratio:
        raise ValueError(f"block_size {block_size} is not a multiple of ratio {ratio}")
    n = block_size // ratio
    rec = index_record(dim).record_bytes
    if index_cache.shape[-2] != n or index_cache.shape[-1] != rec:
        raise ValueError(
            f"index cache pages {tuple(index_cache.shape[-2:])} do not hold {n} records of {rec} bytes "
            f"(block_size {block_size}, ratio {ratio}, dim {dim})"
        )
    return n


def _n_cols(visible: torch.Tensor, max_visible: int | None) -> int:
    if max_visible is not None:
        return int(max_visible)
    return int(visible.max()) if visible.numel() else 0


def index_scores_paged(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    block_size: int,
    out_dtype: torch.dtype | None = None,
    max_visible: int | None = None,
) -> torch.Tensor:
    """``ops.indexer.index_scores`` of every token over its request's paged keys -> fp32 ``[T, n_cols]``.

    ``n_cols = max_visible`` (default ``visible.max()``); columns ``j >= visible[t]`` are
    ``-inf`` and their pages are never read. Tokens of one request share one key gather.
    """
    T, H, D = q.shape
    check_index_cache(index_cache, D, ratio, block_size)
    n_cols = _n_cols(visible, max_visible)
    out = torch.full((T, n_cols), NEG_INF, dtype=torch.float32, device=q.device)
    rec = index_record(D)
    vis = visible.long().clamp(max=n_cols)
    for r in torch.unique(token_req).tolist():
        tok = (token_req == r).nonzero(as_tuple=True)[0]
        n = int(vis[tok].max())
        if n == 0:
            continue
        entries = torch.arange(n, device=q.device)
        blocks, offsets = record_address(block_table, torch.full_like(entries, r), entries, ratio, block_size)
        keys = read_records(index_cache, rec, blocks, offsets, q.dtype)
        out[tok, :n] = index_scores(q[tok], w[tok], keys, vis[tok], out_dtype)
    return out


def index_scores_paged_sparse(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    ratio: int,
    block_size: int,
    cand_blocks: torch.Tensor,
    cand_block_size: int = 8,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scores of the candidate entries only -> compact fp32 ``[T, nb * cand_block_size]``.

    Column ``c`` holds entry ``cand_blocks[t, c // B] * B + c % B``; it is ``-inf`` where the
    block id is negative or the entry is not visible. The per-key arithmetic is that of
    ``index_scores_paged`` (equal up to the GEMM's summation order on the host).
    """
    T, H, D = q.shape
    check_index_cache(index_cache, D, ratio, block_size)
    nb = cand_blocks.shape[1]
    bsz = cand_block_size
    cols = torch.arange(nb * bsz, device=q.device)
    ids = cand_blocks.long()[:, cols // bsz]
    entries = ids * bsz + cols % bsz
    valid = (ids >= 0) & (entries < visible.long().view(-1, 1))
    out = torch.full((T, nb * bsz), NEG_INF, dtype=torch.float32, device=q.device)
    rec = index_record(D)
    for t in range(T):
        sel = valid[t].nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            continue
        e = entries[t, sel]
        blocks, offsets = record_address(block_table, token_req[t].expand_as(e), e, ratio, block_size)
        keys = read_records(index_cache, rec, blocks, offsets, q.dtype)
        n = torch.tensor([sel.numel()], device=q.device)
        out[t, sel] = index_scores(q[t : t + 1], w[t : t + 1], keys, n, out_dtype)[0]
    return out


def topk_indices(
    scores: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    index_map: torch.Tensor | None = None,
    map_block: int = 8,
    index_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """``select_topk`` with entries ``j >= lengths[t]`` treated as ``-inf`` -> ``[T, k]``.

    With ``index_map`` (kept block ids ``[T, nb]``) the chosen compact columns ``c`` are
    returned as entries ``index_map[t, c // map_block] * map_block + c % map_block``.
    """
    s = scores.float()
    if lengths is not None:
        cols = torch.arange(s.shape[1], device=s.device)
        s = s.masked_fill(cols.unsqueeze(0) >= lengths.long().view(-1, 1), NEG_INF)
    idx = select_topk(s, k)
    if index_map is not None:
        return restore_candidate_indices(idx, index_map, map_block).to(index_dtype)
    return idx.to(index_dtype)


def block_scores(scores: torch.Tensor, visible: torch.Tensor, block_size: int = 8) -> torch.Tensor:
    """Candidate block scores fp32 ``[T, ceil(N / block_size)]`` (``candidate_block_mask``'s
    rule): max over visible entries, NaN -> -inf, +inf capped at the largest finite fp32, the
    block of the newest visible entry set to +inf."""
    T, N = scores.shape
    vis = visible.long().view(-1, 1)
    cols = torch.arange(N, device=scores.device)
    s = scores.float().masked_fill(cols.unsqueeze(0) >= vis, NEG_INF)
    s = torch.nan_to_num(s, nan=NEG_INF, posinf=torch.finfo(torch.float32).max, neginf=NEG_INF)
    nb = (N + block_size - 1) // block_size
    pad = nb * block_size - N
    if pad:
        s = torch.cat([s, s.new_full((T, pad), NEG_INF)], dim=1)
    block = s.view(T, nb, block_size).amax(dim=-1)
    newest = ((vis - 1).clamp_min(0) // block_size).view(-1)
    has_any = (visible.long() > 0) & (newest < nb)
    rows = torch.arange(T, device=scores.device)
    block[rows[has_any], newest[has_any]] = float("inf")
    return block


def candidate_blocks(
    scores: torch.Tensor,
    visible: torch.Tensor,
    block_size: int = 8,
    topk_blocks: int = 2048,
    index_dtype: torch.dtype = torch.int64,
) -> torch.Tensor:
    """Kept candidate block ids ``[T, topk_blocks]``, ascending, -1 fill.

    The same set as ``candidate_block_mask`` (which marks their visible entries).
    """
    return select_topk(block_scores(scores, visible, block_size), topk_blocks).to(index_dtype)


def candidate_mask_from_blocks(
    kept: torch.Tensor, visible: torch.Tensor, n: int, block_size: int = 8
) -> torch.Tensor:
    """The boolean ``[T, n]`` mask ``candidate_block_mask`` returns, rebuilt from kept block ids."""
    T = kept.shape[0]
    nb = (n + block_size - 1) // block_size
    keep = torch.zeros(T, nb + 1, dtype=torch.bool, device=kept.device)
    ids = torch.where(kept >= 0, kept.long(), torch.full_like(kept.long(), nb))
    keep.scatter_(1, ids, True)
    cols = torch.arange(n, device=kept.device)
    return keep[:, cols // block_size] & (cols.unsqueeze(0) < visible.long().view(-1, 1))


def restore_candidate_indices(
    compact: torch.Tensor, cand_blocks: torch.Tensor, block_size: int = 8
) -> torch.Tensor:
    """Compact columns (``-1`` = none) -> entry indices through the kept block ids."""
    c = compact.long()
    ok = c >= 0
    safe = torch.where(ok, c, torch.zeros_like(c))
    ids = cand_blocks.long().gather(1, safe // block_size)
    entry = ids * block_size + safe % block_size
    return torch.where(ok, entry, torch.full_like(entry, -1))


def indexer_topk(
    q: torch.Tensor,
    w: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_req: torch.Tensor,
    visible: torch.Tensor,
    *,
    ratio: int,
    block_size: int,
    topk: int,
    candidates: torch.Tensor | None = None,
    candidate_source: bool = False,
    candidate_block_size: int = 8,
    candidate_topk_blocks: int = 2048,
    out_dtype: torch.dtype | None = None,
    max_visible: int | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One index-source layer's selection once ``q = mxfp4_qdq(rope(q_b(c_q)))`` ``[T, H, D]``
    and ``w = weights_proj(x)`` ``[T, H]`` exist, over the KV source's paged index keys
    (``visible = (positions + 1) // ratio``):

    * ``candidates`` given (kept block ids ``[T, nb]`` of the candidate source; reindex
      layer): every visible entry is scored, those outside the kept blocks are masked
      (``candidate_mask_from_blocks``), then selected -> ``(topk [T, topk], None)``;
    * otherwise score every visible entry and select; with ``candidate_source`` also return
      the kept block ids ``[T, candidate_topk_blocks]`` for the reindex layers.
    """
    scores = index_scores_paged(
        q, w, index_cache, block_table, token_req, visible, ratio, block_size, out_dtype, max_visible
    )
    if candidates is not None:
        mask = candidate_mask_from_blocks(candidates, visible, scores.shape[1], candidate_block_size)
        scores = scores.masked_fill(~mask, NEG_INF)
        return topk_indices(scores, topk, lengths=visible, index_dtype=index_dtype), None
    idx = topk_indices(scores, topk, lengths=visible, index_dtype=index_dtype)
    kept = None
    if candidate_source:
        kept = candidate_blocks(scores, visible, candidate_block_size, candidate_topk_blocks, index_dtype)
    return idx, kept
