"""Manifold-constrained hyper-connections (mHC): the references, single-pass variant, and
the three operators of a site (mix, collapse + RMSNorm, expand) a layer builds.

The residual stream is ``hc`` parallel streams. At each sublayer site, per token, mix
coefficients are computed from all streams (``hc_mix``): ``pre`` weights collapse the
streams into the sublayer's input, ``post`` weights spread its output back over them, and
a doubly stochastic ``comb`` (Sinkhorn-normalised) mixes the streams into each other.
"Single-pass": one projection of the flattened streams gives all three.

Layout conventions:
  * streams ``[T, hc, D]`` in the model dtype; flattened stream-major for the mix
    projection (``x[i*D + d] = streams[i, d]``);
  * the ``hc*(hc+2)`` mix logits are ordered ``[pre (hc) | post (hc) | comb (hc*hc, row-major)]``;
  * ``comb[t, j, k]``: ``j`` = input stream, ``k`` = output stream, so the expand step applies
    the stored matrix transposed: ``out[k] = post[k]*y + sum_j comb[j, k] * streams[j]``.
All coefficients are fp32 and stay fp32 (they are carried across sublayers in fp32).
"""

from __future__ import annotations

import torch

from .dispatch import KernelOp
from .norm import rms_norm
from .numerics import acc_dtype, matmul, pointwise

__all__ = [
    "HcCollapseNorm",
    "HcExpand",
    "HcMix",
    "hc_mix_logits",
    "hc_fn_broadcast",
    "hc_mix_logits_broadcast",
    "hc_split_mixes",
    "sinkhorn",
    "hc_mix",
    "hc_collapse",
    "hc_expand",
    "identity_pre",
    "broadcast_streams",
]


def hc_mix_logits(streams: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``m = (fn . x) * rsqrt(mean(x^2) + rms_eps)`` per token, fp32 ``[T, hc*(hc+2)]``.

    ``x`` is the fp32 upcast of the flattened streams; the mean is over all ``hc*D`` entries;
    the projection is an fp32 GEMM (the GPU reference uses TF32, which only changes rounding).
    """
    T = streams.shape[0]
    x = streams.reshape(T, -1).to(acc_dtype(streams.dtype))
    if fn.shape[-1] != x.shape[-1]:
        raise ValueError(f"fn width {fn.shape[-1]} != hc*D {x.shape[-1]}")
    proj = matmul(x, fn.to(x.dtype))
    rstd = torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + rms_eps)
    return proj * rstd


def hc_fn_broadcast(fn: torch.Tensor, hc: int) -> torch.Tensor:
    """Sum of the ``hc`` column blocks of ``fn`` -> fp32 ``[hc*(hc+2), D]``: the projection of
    ``hc`` identical streams (as at the first layer, where every stream is the embedding).

    When all streams equal ``e``, ``fn . x == hc_fn_broadcast(fn) . e`` and the RMS over
    ``hc*D`` entries equals the RMS over the ``D`` entries of ``e``.
    """
    rows, width = fn.shape
    return fn.float().view(rows, hc, width // hc).sum(dim=1)


def hc_mix_logits_broadcast(e: torch.Tensor, fn_broadcast: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """Mix logits for ``hc`` identical copies of ``e [T, D]`` using the summed projection."""
    ef = e.to(acc_dtype(e.dtype))
    rstd = torch.rsqrt(ef.square().mean(dim=-1, keepdim=True) + rms_eps)
    return matmul(ef, fn_broadcast.to(ef.dtype)) * rstd


def sinkhorn(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn normalisation of ``[..., hc, hc]`` fp32 logits into the (nearly) doubly
    stochastic ``comb``.

    softmax over the last axis (k) then ``+eps``; divide by column sums (sum over j) ``+eps``;
    then ``iters-1`` times: rows (sum over k) ``+eps``, then columns ``+eps``. The last operation
    is always a column normalisation. A loop over the iterations (20), not over tokens.
    """
    if iters < 1:
        raise ValueError("sinkhorn needs at least one iteration")
    c = torch.softmax(c0, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def hc_split_mixes(
    m: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc: int,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn fp32 mix logits ``m [T, hc*(hc+2)]`` into ``(pre, post, comb)`` (all fp32).

    pre = sigmoid(scale0*m + base) + hc_eps; post = post_mult * sigmoid(scale1*m + base);
    comb = sinkhorn(scale2*m + base) as ``[T, hc, hc]`` (row-major: [input j, output k]).
    """
    scale = scale.to(m.dtype)
    base = base.to(m.dtype)
    T = m.shape[0]
    z_pre = m[:, :hc] * scale[0] + base[:hc]
    z_post = m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc]
    z_comb = m[:, 2 * hc :] * scale[2] + base[2 * hc :]
    pre = pointwise(torch.sigmoid, z_pre) + hc_eps
    post = pointwise(torch.sigmoid, z_post) * post_mult
    comb = sinkhorn(z_comb.view(T, hc, hc), sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients of one sublayer site: logits from the RMS-scaled projection of the
    flattened streams, then sigmoids for ``pre``/``post`` and Sinkhorn for ``comb``.

    Returns fp32 ``pre [T, hc]``, ``post [T, hc]``, ``comb [T, hc, hc]``. Everything after the
    upcast of ``streams`` is fp32; nothing is rounded.
    """
    hc = streams.shape[1]
    m = hc_mix_logits(streams, fn, rms_eps)
    return hc_split_mixes(m, base, scale, hc, hc_eps, sinkhorn_iters, post_mult)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[:, i] * streams[:, i]`` -> ``[T, D]``: a sublayer's input from the streams.

    fp32 products and sum, rounded once to ``streams.dtype`` (the following RMSNorm sees the
    rounded value). ``pre`` is used as given (not normalised).
    """
    acc = acc_dtype(streams.dtype)
    y = (streams.to(acc) * pre.to(acc).unsqueeze(-1)).sum(dim=1)
    return y.to(streams.dtype)


def hc_expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``out[k] = post[k]*y + sum_j comb[j, k]*streams[j]`` from the sublayer
    output ``y``.

    fp32 math (``y`` and ``streams`` upcast), rounded once to ``streams.dtype``.
    """
    acc = acc_dtype(streams.dtype)
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(acc), streams.to(acc))
    out = post.to(acc).unsqueeze(-1) * y.to(acc).unsqueeze(1) + mixed
    return out.to(streams.dtype)


def broadcast_streams(x: torch.Tensor, hc: int) -> torch.Tensor:
    """``[T, hc, D]``: every residual stream starts as ``x [T, D]``, as a view (stream stride 0):
    the site's operators read it as they read any streams, and the first expand writes the first
    streams of their own (no copy: 186 us at 8192 Flash tokens on the H200 as a concatenation).
    Nothing writes streams in place."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], hc, x.shape[-1])


def identity_pre(T: int, hc: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 ``[T, hc]`` one-hot on stream 0: the pre-mix entering layer 0 (all streams start
    as the embedding, so collapsing them with it gives the embedding back)."""
    pre = torch.zeros(T, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


class HcMix(KernelOp):
    """``hc_mix``: the reference, or the Triton kernels (``ops/triton/mhc.py``: a split-K
    projection and one kernel for the scaling, sigmoids and the whole Sinkhorn loop)."""

    name = "mhc_mix"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.mhc"}

    def forward_native(self, streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters):
        return hc_mix(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)

    def forward_triton(self, streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters):
        return self.kernels.hc_mix(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)


class HcCollapseNorm(KernelOp):
    """``rms_norm(hc_collapse(streams, pre), weight, eps)``: a sublayer's (or the head's)
    normalised input; the reference, or one Triton kernel per call. (On NPUs the reference:
    ``torch_npu`` has no collapse.)"""

    name = "mhc_collapse_norm"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.mhc"}

    def forward_native(self, streams, pre, weight, eps):
        return rms_norm(hc_collapse(streams, pre), weight, eps)

    def forward_triton(self, streams, pre, weight, eps):
        return self.kernels.hc_collapse_norm(streams, pre, weight, eps)


class HcExpand(KernelOp):
    """``hc_expand``: the reference, or one Triton kernel per call."""

    name = "mhc_expand"
    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.mhc"}

    def forward_native(self, y, streams, post, comb):
        return hc_expand(y, streams, post, comb)

    def forward_triton(self, y, streams, post, comb):
        return self.kernels.hc_expand(y, streams, post, comb)
