"""The mHC sites, shared by backbone and DSpark blocks: each site's parameters and its mix
and expand operators (the collapse + RMSNorm is the site norm's, ``V41Norm.collapse``).

The residual stream is ``hc_mult`` parallel streams; a site computes per-token mixing
coefficients from them (``pre``, ``post``, ``comb``), feeds its sublayer the ``pre``-weighted
collapse of the streams and writes the sublayer's output back with ``post`` and ``comb``
(``ops.mhc``)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.layers.norm import V41Norm
from deepinfer_vllm.model_executor.layers.params import built_for, held
from deepinfer_vllm.ops.mhc import HcExpand, HcMix

__all__ = ["HyperConnection", "collapse_norm"]


class HyperConnection(nn.Module):
    """``hc_{site}_{fn,base,scale}`` of one site (fp32 in the checkpoint), and the site's
    mix and expand operators."""

    def __init__(self, arch: V41Arch):
        super().__init__()
        self.fn = held(arch.hc_mix_dim, arch.hc_mult * arch.hidden_size, dtype=torch.float32)
        self.base = held(arch.hc_mix_dim, dtype=torch.float32)
        self.scale = held(3, dtype=torch.float32)
        self.arch = arch
        device, dtype = built_for()
        self._mix = HcMix(device, dtype)
        self._expand = HcExpand(device, dtype)

    def mix(self, streams: torch.Tensor):
        """fp32 ``(pre, post, comb)`` of this site for ``streams [T, hc, D]``."""
        a = self.arch
        return self._mix(
            streams, self.fn, self.base, self.scale, a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters
        )

    def expand(self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
        """``hc_expand``: the site's new streams from the sublayer output ``y``."""
        return self._expand(y, streams, post, comb)


def collapse_norm(streams: torch.Tensor, pre: torch.Tensor, norm: V41Norm) -> torch.Tensor:
    """``norm(hc_collapse(streams, pre))``: a sublayer's (or the head's) normalised input."""
    return norm.collapse(streams, pre)
