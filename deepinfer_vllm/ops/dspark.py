"""DSpark drafting operators (docs/architecture.md, "DSpark"; docs/design-notes.md, "DSpark"): one PyTorch reference each.

The reference model (``reference.dspark``), the paged draft layers of the vLLM
model and the training tool all call these, so they agree by construction on
every rounding point.
"""

from __future__ import annotations

import torch

from deepinfer_vllm.ops.numerics import acc_dtype

__all__ = [
    "CONFIDENCE_CLAMP",
    "confidence",
    "context_window",
    "draft_inputs",
    "markov_logits",
    "target_features",
]

# Confidence logits are clamped before the sigmoid (docs/design-notes.md, "Draft sampling and verification").
CONFIDENCE_CLAMP = 60.0


def target_features(entry_streams: list[torch.Tensor]) -> torch.Tensor:
    """``f_t``: the mean over the mHC streams of each target layer's entry, concatenated.

    ``entry_streams``: ``[T, hc, D]`` per target layer, in order. The mean is taken in the
    accumulation dtype and rounded once to the streams' dtype (docs/architecture.md, "Target features and context keys").
    """
    dtype = entry_streams[0].dtype
    acc = acc_dtype(dtype)
    return torch.cat([s.to(acc).mean(dim=1).to(dtype) for s in entry_streams], dim=-1)


def draft_inputs(bonus: torch.Tensor, anchor: torch.Tensor, k: int, noise_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[a, N, ..., N]`` and positions ``p+1 .. p+k`` of every request's block,
    flattened request-major (``bonus``/``anchor`` are ``[R]``: the bonus token and ``p``)."""
    R = bonus.shape[0]
    ids = torch.full((R, k), noise_id, dtype=torch.int64, device=bonus.device)
    ids[:, 0] = bonus
    pos = anchor.to(torch.int64).unsqueeze(1) + 1 + torch.arange(k, device=anchor.device)
    return ids.reshape(-1), pos.reshape(-1)


def context_window(anchor: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Context-key positions ``[p+1-W, p]`` of each request and their validity (``>= 0``)."""
    pos = anchor.to(torch.int64).unsqueeze(1) - (window - 1) + torch.arange(window, device=anchor.device)
    return pos, pos >= 0


def markov_logits(base: torch.Tensor, prev: torch.Tensor, embed: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Markov step: ``l = base + embed[prev] @ head.T`` in fp32 (docs/architecture.md, "Draft step").

    ``base`` ``[R, V]`` fp32 logits of one slot, ``prev`` ``[R]`` previous tokens; returns the
    logits and the rank-``r`` embeddings ``e`` (the confidence head reads them).
    """
    e = embed[prev].float()
    return base.float() + e @ head.float().t(), e


def confidence(
    proj: torch.Tensor, hh: torch.Tensor, e: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``sigmoid(clamp(proj . [hh ; e] / T, +-60))`` in fp32: the acceptance probability of a draft."""
    z = torch.cat([hh.float(), e.float()], dim=-1) @ proj.float().reshape(-1)
    return torch.sigmoid((z / max(temperature, 1e-5)).clamp(-CONFIDENCE_CLAMP, CONFIDENCE_CLAMP))
