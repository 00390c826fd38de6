"""Sparse MQA attention core with attention sink: each query attends its own set of gathered keys.

One latent per key is both key and value for every head. Logits and softmax are fp32; the
per-head sink logit enters the softmax denominator only (it is not multiplied by the scale and
has no value vector).
"""

from __future__ import annotations

import torch
from .numerics import acc_dtype

__all__ = ["sparse_attention", "window_indices"]


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    valid: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``q [Tq, H, D]`` attends its own gathered keys ``kv [Tq, K, D]`` (keys = values) where
    ``valid [Tq, K]`` -> ``[Tq, H, D]`` in ``q.dtype``.

    ``s[t,h,k] = scale * (q[t,h] . kv[t,k])`` (fp32); ``P = exp(s) / (sum_valid exp(s) + exp(sink_h))``;
    ``out = sum_k P * kv[t,k]`` in fp32, rounded once to ``q.dtype``. Invalid keys get ``P = 0``.
    A query with no valid key returns zeros (only the sink is in the denominator). ``sink=None``
    means no sink term (a row without valid keys then also returns zeros).
    """
    Tq, H, D = q.shape
    acc = acc_dtype(q.dtype)
    qf = q.to(acc)
    kf = kv.to(acc)
    logits = torch.einsum("thd,tkd->thk", qf, kf) * scale
    mask = valid.bool().view(Tq, 1, -1)
    logits = logits.masked_fill(~mask, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True)  # -inf when no key is valid
    if sink is not None:
        sink_f = sink.to(acc).view(1, H, 1).expand(Tq, H, 1)
        ref = torch.maximum(row_max, sink_f)
    else:
        ref = row_max
    ref = torch.where(torch.isfinite(ref), ref, torch.zeros_like(ref))
    p = torch.exp(logits - ref)  # exp(-inf) = 0 for invalid keys
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink_f - ref)
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    probs = p / denom
    out = torch.einsum("thk,tkd->thd", probs, kf)
    return out.to(q.dtype)


def window_indices(
    positions: torch.Tensor,
    window: int,
    lo_clamp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window key positions for each query -> ``(idx int64 [Tq, window], valid bool)``.

    Column ``c`` holds position ``p - window + 1 + c`` (ascending; the last column is ``p``).
    A column is valid iff its position is ``>= max(0, lo_clamp[t])`` (``lo_clamp`` = the lowest
    position the window may reach, e.g. a replay start; ``None`` = 0). Invalid columns hold ``-1``
    (clamp before gathering and mask with ``valid``).
    """
    pos = positions.long().view(-1, 1)
    idx = pos - (window - 1) + torch.arange(window, device=pos.device).view(1, -1)
    lo = torch.zeros_like(pos) if lo_clamp is None else lo_clamp.long().view(-1, 1).clamp_min(0)
    valid = idx >= lo
    idx = torch.where(valid, idx, torch.full_like(idx, -1))
    return idx, valid
