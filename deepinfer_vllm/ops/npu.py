"""RMSNorm and RoPE on ``torch_npu``'s fused operators (Ascend), beside their references.

* :func:`rms_norm`: ``torch_npu.npu_rms_norm`` (CANN RmsNorm); reference
  ``ops.norm.rms_norm``. The weight is cast to the input's dtype (the op
  takes one dtype; the release's bf16 weight is exact in fp32).
* :func:`rope_tail`: ``torch_npu.npu_rotary_mul`` in ``interleave`` mode
  (GPT-J pairs, ``out = r1 * x + r2 * rotate(x)``); reference
  ``ops.rope.apply_rope_tail``. The rotary tail goes in as fp32 with fp32
  ``[cos, cos]`` / ``[sin, sin]`` interleaved per pair and the result is
  rounded once, which is the reference's arithmetic term for term. Layout:
  ``x [T, H, 1, D]`` with ``cos``/``sin`` ``[T, 1, 1, D]``, tokens on the first
  axis (see :func:`rope_tail`).

They are the ``forward_npu`` of the operators ``ops.norm.RMSNorm`` and
``ops.rope.RopeTail``, chosen when a layer is built (``ops.dispatch``,
``DEEPINFER_FUSED_KERNELS``).
Checked here only against an emulation of the operators' documented
formulas (``tests/ops/test_npu_ops.py``); ``tests/npu/`` checks them on an
NPU and has never run (no hardware).
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "rope_tail"]


def _torch_npu():
    import torch_npu

    return torch_npu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``ops.norm.rms_norm(x, weight, eps)`` as one CANN RmsNorm."""
    y, _rstd = _torch_npu().npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)
    return y


# Documented limits of ``npu_rotary_mul`` in interleave mode that bind this layout:
# ``B * N < 1000`` (Atlas A2/A3; here B * N is the number of heads) and an even D below 896
# (A2/A3; the 950's limit is 1024).
MAX_HEADS = 999
MAX_ROTARY_DIM = 894


def rope_tail(
    x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """``ops.rope.apply_rope_tail`` for ``x [T, D]`` or ``[T, H, D]`` with ``positions [T]``
    (one position per token), as one ``npu_rotary_mul``.

    The operator takes 4-D tensors whose layout it reads from the shapes. ``x`` goes in as
    ``[T, H, 1, D]`` and ``cos``/``sin`` as ``[T, 1, 1, D]``: SBND with S = tokens, B = heads,
    N = 1, and S11D tables, the pairing its interleave mode documents for A2/A3 (``B * N < 1000``:
    the heads, whatever the number of tokens), and the arrangement vllm-ascend's DeepSeek-V4
    path runs on the 950 (whose operator only asks that the tables broadcast to ``x`` and
    ``D <= 1024``). Tokens on the leading axis keep every token's table row next to its
    heads, and no prefill length reaches the 1000 bound."""
    if x.dim() not in (2, 3) or positions.shape != x.shape[:1]:
        raise ValueError(
            f"rope_tail on the NPU takes x [T, D] or [T, H, D] and positions [T]; got x {tuple(x.shape)}, "
            f"positions {tuple(positions.shape)}"
        )
    rotary_dim = cache.shape[-1]
    if x.shape[-1] < rotary_dim:
        raise ValueError(f"last dim {x.shape[-1]} smaller than rotary_dim {rotary_dim}")
    heads = x.shape[1] if x.dim() == 3 else 1
    if heads > MAX_HEADS or rotary_dim % 2 or rotary_dim > MAX_ROTARY_DIM:
        raise ValueError(
            f"npu_rotary_mul (interleave) takes fewer than 1000 heads and an even rotary_dim below "
            f"896; got {heads} heads, rotary_dim {rotary_dim}"
        )
    half = rotary_dim // 2
    cs = cache[positions.long()]  # [T, rotary_dim] fp32: cos | sin
    cos = cs[:, :half].repeat_interleave(2, dim=-1)
    sin = cs[:, half:].repeat_interleave(2, dim=-1)
    if inverse:
        sin = -sin
    split = x.shape[-1] - rotary_dim
    tail = x[..., split:].float()
    T = x.shape[0]
    tail4 = tail.reshape(T, heads, 1, rotary_dim)
    r1 = cos.view(T, 1, 1, rotary_dim)
    r2 = sin.view(T, 1, 1, rotary_dim)
    rotated = _torch_npu().npu_rotary_mul(tail4, r1, r2, rotary_mode="interleave")
    rotated = rotated.reshape(tail.shape).to(x.dtype)
    if split == 0:
        return rotated
    return torch.cat([x[..., :split], rotated], dim=-1)
