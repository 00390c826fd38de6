"""KV compressor references: a compressed layer keeps one latent per ``r`` tokens.

Group ``j`` of ratio ``r`` covers positions ``r*j .. r*j + r - 1`` (non-overlapping, aligned to
absolute positions, no positional bias). A latent exists only for complete groups. Latents are
returned pre-RoPE; the caller rotates them at the group's first position ``r*j``.

Rounding points:
  * ratio 2: ``u = h.Wkv^T`` and ``g = h.Wgate^T`` in fp32 (fp32 upcast of both operands);
    per-channel softmax over the pair and the weighted sum in fp32; the pooled vector is
    rounded to the model dtype BEFORE the RMSNorm (DeepInfer's pooling kernel emits bf16 and
    its norm reads that; NeMo/vLLM feed the fp32 pooled vector to the norm - we follow
    DeepInfer); RMSNorm (fp32 inside) rounds to the model dtype.
  * ratio 1: ``u = h.Wkv^T`` computed in fp32 and rounded to the activation dtype (the reference
    projects in the activation dtype), then RMSNorm -> model dtype.

``PoolPairs`` is the pooling operator the attention layer calls over paged steps (the PyTorch
reference: ``step_pair_rows``, ``pool_ratio2`` and ``ring_write_reference``; on the Triton
backend ``ops.triton.cache_store.pool_pairs`` and ``ring_write``).
"""

from __future__ import annotations

import torch

from .norm import rms_norm
from .numerics import acc_dtype, gemm

__all__ = [
    "compressor_project",
    "pool_ratio2",
    "ring_write_reference",
    "step_pair_rows",
    "compressor_finalize",
    "compressor_latents",
]


def compressor_project(
    h: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw per-token projections in fp32: ``u = h.wkv^T [T, 512]`` and ``g = h.wgate^T`` (or
    ``None`` without a gate). These are the rows a serving path keeps in its ratio-2 ring so it
    can pool a pair whose first token arrived in an earlier chunk."""
    u = gemm(h, wkv, torch.float32)
    g = None if wgate is None else gemm(h, wgate, torch.float32)
    return u, g


def pool_ratio2(u: torch.Tensor, g: torch.Tensor, acc: torch.dtype = torch.float32) -> torch.Tensor:
    """Pool consecutive row pairs ``(2j, 2j+1)``: per channel ``softmax over the pair of g`` weights
    applied to ``u``. fp32 rows in; computed and returned in ``acc`` (``acc_dtype`` of the model
    dtype) ``[T // 2, D]``; a trailing odd row is ignored.

    Written out op by op, ``m = max(g0, g1); e_i = exp(g_i - m); (e0*u0 + e1*u1) / (e0 + e1)``,
    each op rounding once in ``acc`` (correctly rounded division), so that the Triton kernel
    ``ops.triton.cache_store.pool_pairs`` can mirror it bit for bit (``torch.softmax`` leaves
    its internal order to the backend)."""
    n = u.shape[0] // 2
    d = u.shape[-1]
    uf = u[: 2 * n].to(acc).reshape(n, 2, d)
    gf = g[: 2 * n].to(acc).reshape(n, 2, d)
    u0, u1 = uf[:, 0], uf[:, 1]
    g0, g1 = gf[:, 0], gf[:, 1]
    m = torch.maximum(g0, g1)
    e0 = torch.exp(g0 - m)
    e1 = torch.exp(g1 - m)
    return (e0 * u0 + e1 * u1) / (e0 + e1)


def step_pair_rows(
    u: torch.Tensor,
    g: torch.Tensor,
    ring: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """Each token's pair's first row ``[T, 2 * D]`` laid out ``[u | g]``: the step's previous row
    when position ``pos - 1`` is in this step (``>= context_lens[req]``; a request's tokens are
    consecutive), else row ``(pos - 1) % capacity`` of the ring ``[num_blocks, capacity, 2 * D]``
    block ``block_table[req, 0]`` (rows of earlier steps, kept by ``ring_write_reference``)."""
    rows = torch.cat([u, g], dim=-1)
    prev = (torch.arange(rows.shape[0], device=rows.device) - 1).clamp_min(0)
    in_step = (pos - 1) >= context_lens[req]
    back = (pos - 1).clamp_min(0) % ring.shape[1]
    from_ring = ring[block_table[req, 0].long(), back.long()]
    return torch.where(in_step.unsqueeze(1), rows[prev], from_ring)


def ring_write_reference(
    ring: torch.Tensor,
    block_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    seq_lens: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
) -> None:
    """Keep each request's rows ``[u | g]`` of its last ``capacity`` positions in its ring at
    ``pos % capacity`` (older rows of a long chunk would collide there)."""
    cap = ring.shape[1]
    recent = pos >= seq_lens[req] - cap
    rows = torch.cat([u[recent], g[recent]], dim=-1)
    req, pos = req[recent], pos[recent]
    ring[block_table[req, 0].long(), (pos % cap).long()] = rows.to(ring.dtype)


def compressor_finalize(v: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Round the pooled (ratio 2) or projected (ratio 1) vector to ``dtype``, then RMSNorm with
    the compressor norm (fp32 inside, result in ``dtype``)."""
    return rms_norm(v.to(dtype), norm_weight, eps)


def compressor_latents(
    h: torch.Tensor,
    wkv: torch.Tensor,
    wgate: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    ratio: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Latents ``[floor(T / ratio), 512]`` in ``dtype`` (default ``h.dtype``) for a sequence whose
    first row is position 0 (``h`` = the normalised layer input, one row per position)."""
    dtype = h.dtype if dtype is None else dtype
    if ratio == 1:
        u, _ = compressor_project(h, wkv, None)
        return compressor_finalize(u.to(h.dtype), norm_weight, eps, dtype)
    if ratio == 2:
        if wgate is None:
            raise ValueError("ratio-2 compressor needs wgate")
        n = h.shape[0] // 2
        u, g = compressor_project(h[: 2 * n], wkv, wgate)
        return compressor_finalize(pool_ratio2(u, g, acc_dtype(dtype)), norm_weight, eps, dtype)
    raise ValueError(f"unsupported compress ratio {ratio}")
