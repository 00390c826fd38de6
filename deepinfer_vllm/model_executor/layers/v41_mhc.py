"""The mHC parameters of one sublayer site (spec §5), shared by backbone and DSpark blocks."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.layers.weights import held
from deepinfer_vllm.ops.mhc import hc_mix


class HyperConnection(nn.Module):
    """``hc_{site}_{fn,base,scale}`` of one site (fp32 in the checkpoint)."""

    def __init__(self, arch: V41Arch):
        super().__init__()
        self.fn = held(arch.hc_mix_dim, arch.hc_mult * arch.hidden_size, dtype=torch.float32)
        self.base = held(arch.hc_mix_dim, dtype=torch.float32)
        self.scale = held(3, dtype=torch.float32)
        self.arch = arch

    def mix(self, streams: torch.Tensor):
        a = self.arch
        return hc_mix(streams, self.fn, self.base, self.scale, a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters)
