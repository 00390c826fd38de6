"""The mHC sites (spec §5), shared by backbone and DSpark blocks: parameters, and the three
operations of a site on the reference or on the Triton kernels (``fused_kernels``)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.layers.weights import V41Norm, fused_kernels, held
from deepinfer_vllm.ops import mhc
from deepinfer_vllm.ops.norm import rms_norm


def _kernels(x: torch.Tensor):
    """``ops.triton.mhc`` where the fused kernels run for ``x``, else None."""
    if fused_kernels(x) != "triton":
        return None
    from deepinfer_vllm.ops.triton import mhc as kernels

    return kernels


class HyperConnection(nn.Module):
    """``hc_{site}_{fn,base,scale}`` of one site (fp32 in the checkpoint)."""

    def __init__(self, arch: V41Arch):
        super().__init__()
        self.fn = held(arch.hc_mix_dim, arch.hc_mult * arch.hidden_size, dtype=torch.float32)
        self.base = held(arch.hc_mix_dim, dtype=torch.float32)
        self.scale = held(3, dtype=torch.float32)
        self.arch = arch

    def mix(self, streams: torch.Tensor):
        """fp32 ``(pre, post, comb)`` of this site for ``streams [T, hc, D]``."""
        a = self.arch
        impl = _kernels(streams) or mhc
        return impl.hc_mix(
            streams, self.fn, self.base, self.scale, a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters
        )


def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, norm: V41Norm) -> torch.Tensor:
    """``norm(hc_collapse(streams, pre))``: a sublayer's (or the head's) normalised input."""
    kernels = _kernels(streams)
    if kernels is not None:
        return kernels.hc_collapse_norm(streams, pre, norm.weight, norm.eps)
    return rms_norm(mhc.hc_collapse(streams, pre), norm.weight, norm.eps)


def expand(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``hc_expand``: the site's new streams from the sublayer output ``y``."""
    kernels = _kernels(streams)
    return (kernels or mhc).hc_expand(y, streams, post, comb)
