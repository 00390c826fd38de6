"""``torch_npu``'s fused operators as their documentation defines them, on CPU tensors.

No NPU is reachable from this project, so ``ops/npu.py`` is checked against
these emulations of the documented formulas (and its argument checks are
mirrored from the documented constraints). They prove the wrappers' layout,
mode, sign and dtype handling; they prove nothing about CANN's kernels.

* ``npu_rms_norm(x, gamma, epsilon)`` -> ``(y, rstd)``: fp32 statistics,
  ``y = x * rstd * gamma`` rounded once to ``x.dtype``; ``gamma`` of x's dtype.
* ``npu_rotary_mul(x, r1, r2, rotary_mode)``: 4-D ``x``; ``r1``/``r2`` 4-D,
  broadcast to ``x``; ``out = r1 * x + r2 * rotate(x)`` with ``interleave``:
  ``rotate(x)[2i] = -x[2i+1]``, ``rotate(x)[2i+1] = x[2i]``; ``half``:
  ``cat(-x2, x1)``; ``D`` even and below 896.
"""

from __future__ import annotations

import importlib.machinery
import types

import torch


def make(calls: list | None = None) -> types.ModuleType:
    calls = [] if calls is None else calls

    def npu_rms_norm(x, gamma, epsilon=1e-6):
        calls.append("npu_rms_norm")
        assert gamma.dtype == x.dtype, "npu_rms_norm takes gamma in x's dtype"
        assert gamma.shape == x.shape[-gamma.dim():]
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd

    def npu_rotary_mul(x, r1, r2, rotary_mode="half"):
        calls.append("npu_rotary_mul")
        assert x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul takes 4-D tensors"
        assert x.dtype == r1.dtype == r2.dtype
        assert x.shape[-1] % 2 == 0 and x.shape[-1] < 896
        torch.broadcast_shapes(x.shape, r1.shape, r2.shape)
        if rotary_mode == "interleave":
            x1, x2 = x[..., ::2], x[..., 1::2]
            rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
        elif rotary_mode == "half":
            x1, x2 = x.chunk(2, dim=-1)
            rotated = torch.cat((-x2, x1), dim=-1)
        else:
            raise ValueError(rotary_mode)
        return r1 * x + r2 * rotated

    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    module.npu_rms_norm = npu_rms_norm
    module.npu_rotary_mul = npu_rotary_mul
    module.calls = calls
    return module
