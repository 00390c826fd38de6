"""Rotary position embedding references.

* Pairing is GPT-J / interleaved: the rotary part of a vector is its LAST ``rotary_dim``
  entries, taken as adjacent pairs ``(x[2i], x[2i+1])`` of that tail, rotated by
  ``theta_i * pos``: ``(a, b) -> (a cos - b sin, a sin + b cos)``. Leading (NoPE) entries
  pass through untouched.
* The cache is fp32 ``[max_positions, rotary_dim]`` laid out ``[cos_0..cos_{r/2-1} |
  sin_0..sin_{r/2-1}]``.
* YaRN is "frequency only": the inverse frequencies are blended between the base and the
  interpolated (``/factor``) values with a linear ramp over the pair index, and there is
  no amplitude (mscale) factor (DeepInfer builds YaRN with ``mscale=False``, which gives a
  multiplier of exactly 1.0; vLLM's and NeMo's V4 implementations apply none either).

``RopeTail`` is the rotation operator the model calls: ``apply_rope_tail``, or one fused kernel
(``ops.triton.rope.rope_tail``, ``ops.npu.rope_tail``) where the shapes allow it.
"""

from __future__ import annotations

import math

import torch

from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.dispatch import KernelOp

__all__ = [
    "RopeTail",
    "yarn_correction_range",
    "rope_inv_freq",
    "build_rope_cache",
    "apply_rope_tail",
]


def _yarn_dim_for_rotations(n_rot: float, rotary_dim: int, base: float, orig_max: int) -> float:
    # The pair dimension whose wavelength completes ``n_rot`` turns over ``orig_max`` positions.
    return rotary_dim * math.log(orig_max / (n_rot * 2.0 * math.pi)) / (2.0 * math.log(base))


def yarn_correction_range(
    rotary_dim: int,
    base: float,
    beta_fast: float,
    beta_slow: float,
    original_max_position_embeddings: int,
) -> tuple[int, int]:
    """YaRN ramp bounds ``(low, high)``: floor/ceil of the correction dims, clamped to
    ``[0, rotary_dim - 1]``. Flash compress RoPE (64, 160000, 32, 1, 65536) -> (15, 25);
    the tiny config (original 1024) -> (4, 14)."""
    low = math.floor(_yarn_dim_for_rotations(beta_fast, rotary_dim, base, original_max_position_embeddings))
    high = math.ceil(_yarn_dim_for_rotations(beta_slow, rotary_dim, base, original_max_position_embeddings))
    return max(low, 0), min(high, rotary_dim - 1)


def _scaling_type(scaling: dict | None) -> str | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default", "none"):
        return None
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    return "yarn"


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """fp32 inverse frequencies ``[rotary_dim // 2]`` (computed in fp32 like the reference).

    Without scaling: ``base^(-2i/rotary_dim)``. With YaRN: ``inv*(1-ramp) + (inv/factor)*ramp``,
    ``ramp_i = clamp((i - low)/(high - low), 0, 1)``; any mscale / attn_factor keys are
    ignored on purpose (frequency-only YaRN: V4.1 applies no amplitude factor).
    """
    if rotary_dim % 2:
        raise ValueError("rotary_dim must be even")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
    pos_freqs = torch.pow(torch.tensor(float(base), dtype=torch.float32), exponent)
    inv_base = 1.0 / pos_freqs
    if _scaling_type(scaling) is None:
        return inv_base
    factor = float(scaling["factor"])
    low, high = yarn_correction_range(
        rotary_dim,
        float(base),
        float(scaling.get("beta_fast", 32)),
        float(scaling.get("beta_slow", 1)),
        int(scaling["original_max_position_embeddings"]),
    )
    span = float(high - low) if high != low else 0.001  # same guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / span).clamp(0.0, 1.0)
    inv_interp = 1.0 / (factor * pos_freqs)
    keep = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    return inv_interp * (1.0 - keep) + inv_base * keep


def build_rope_cache(
    rotary_dim: int,
    max_positions: int,
    base: float,
    scaling: dict | None = None,
) -> torch.Tensor:
    """fp32 cos/sin table ``[max_positions, rotary_dim]`` = ``[cos | sin]`` per position.

    Angles ``pos * inv_freq`` are formed in fp32 (positions as an fp32 arange, exact below
    2^24) and cos/sin evaluated in fp32, matching the reference cache construction.
    """
    inv_freq = rope_inv_freq(rotary_dim, base, scaling)
    t = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def apply_rope_tail(
    x: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate the last ``cache.shape[-1]`` entries of ``x`` (GPT-J pairs); returns ``x.dtype``.

    Broadcasting of ``positions`` (integer tensor, entries in ``[0, cache.shape[0])``):
      * ``positions.shape == x.shape[:-1]``: one position per row (e.g. x ``[T, D]``,
        positions ``[T]``; or x ``[T, H, D]`` with positions ``[T, H]``);
      * ``positions.shape == x.shape[:-2]``: one position per token shared by all heads
        (x ``[T, H, D]``, positions ``[T]``).
    ``inverse=True`` rotates by the negative angle (sin -> -sin), undoing a forward rotation
    at the same position.

    Numerics: rotary entries upcast to fp32, rotated in fp32, rounded once to ``x.dtype``;
    the leading entries are copied bit-exactly.
    """
    rotary_dim = cache.shape[-1]
    half = rotary_dim // 2
    if x.shape[-1] < rotary_dim:
        raise ValueError(f"last dim {x.shape[-1]} smaller than rotary_dim {rotary_dim}")
    pos = positions.long()
    if pos.dim() == x.dim() - 2:
        pos = pos.unsqueeze(-1)  # shared by every head: broadcast over the head axis
    elif pos.dim() != x.dim() - 1:
        raise ValueError(f"positions shape {tuple(positions.shape)} does not match x shape {tuple(x.shape)}")
    cs = cache[pos]  # [..., rotary_dim] fp32
    cos = cs[..., :half]
    sin = cs[..., half:]
    if inverse:
        sin = -sin
    tail = x[..., x.shape[-1] - rotary_dim:].float()
    a = tail[..., 0::2]
    b = tail[..., 1::2]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rotated = torch.stack([ra, rb], dim=-1).flatten(-2).to(x.dtype)
    if x.shape[-1] == rotary_dim:
        return rotated
    return torch.cat([x[..., : x.shape[-1] - rotary_dim], rotated], dim=-1)


def _fused_shape(x: torch.Tensor, positions: torch.Tensor) -> bool:
    """The shapes the fused kernels take: ``x [T, D]`` or ``[T, H, D]``, one position per token."""
    return positions.shape == x.shape[:1] and x.dim() in (2, 3)


def _fused_round_trip(x: torch.Tensor, cache: torch.Tensor, qdq: str | None) -> bool:
    """Whether the Triton kernel can apply ``qdq`` itself: whole MXFP4 blocks in the leading entries
    and the rotated tail, a bf16 or fp32 ``x`` (other cases run the reference)."""
    if qdq is None:
        return True
    whole_blocks = x.shape[-1] % quant.MX_BLOCK == 0 and cache.shape[-1] % quant.MX_BLOCK == 0
    return whole_blocks and x.dtype in (torch.bfloat16, torch.float32)


class RopeTail(KernelOp):
    """``apply_rope_tail(x, positions, cache, inverse)`` as one operator of the ``fused``
    family: the reference, or one kernel per call on Triton / ``torch_npu`` where ``x`` is
    ``[T, D]`` or ``[T, H, D]`` with one position per token (other shapes run the reference).
    ``qdq="mxfp4"``: the rotated rows' MXFP4 round trip follows (``quant.mxfp4_qdq``; the
    indexer query), in the same kernel on Triton. ``in_place=True``: the result is written into
    ``x`` and ``x`` returned (the Triton kernel then moves only the rotated tail, unless ``qdq``
    rewrites every entry; for a caller that owns ``x``: at prefill the copy of the leading entries
    was most of the operator's traffic)."""

    name = "rope_tail"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.rope", "npu": "deepinfer_vllm.ops.npu"}

    def forward_native(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        inverse: bool = False,
        qdq: str | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        return _written(x, _round_trip(apply_rope_tail(x, positions, cache, inverse=inverse), qdq), in_place)

    def forward_triton(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        inverse: bool = False,
        qdq: str | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        if not (_fused_shape(x, positions) and _fused_round_trip(x, cache, qdq)):
            return self.forward_native(x, positions, cache, inverse, qdq, in_place)
        return self.kernels.rope_tail(x, positions, cache, inverse, qdq, in_place=in_place)

    def forward_npu(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        inverse: bool = False,
        qdq: str | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        if not _fused_shape(x, positions):
            return self.forward_native(x, positions, cache, inverse, qdq, in_place)
        return _written(x, _round_trip(self.kernels.rope_tail(x, positions, cache, inverse), qdq), in_place)


def _written(x: torch.Tensor, result: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``result``, or with ``in_place`` copied into ``x`` and ``x`` returned."""
    return x.copy_(result) if in_place else result


def _round_trip(x: torch.Tensor, qdq: str | None) -> torch.Tensor:
    """``x`` after the named quantise-dequantise round trip (None: unchanged)."""
    if qdq is None:
        return x
    if qdq != "mxfp4":
        raise ValueError(f"qdq must be None or 'mxfp4', got {qdq!r}")
    return quant.mxfp4_qdq(x)
