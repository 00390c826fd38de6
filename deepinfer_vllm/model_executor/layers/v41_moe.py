"""V4.1 mixture of experts on the CPU path (spec §7)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.model_executor.layers.weights import dense, stacked, vector
from deepinfer_vllm.ops.moe import moe_forward, route_sqrtsoftplus


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = dense(inter, hidden)
        self.w3 = dense(inter, hidden)
        self.w2 = dense(hidden, inter)


class Gate(nn.Module):
    def __init__(self, n_experts: int, hidden: int):
        super().__init__()
        self.weight = dense(n_experts, hidden)
        self.bias = vector(n_experts)
        self.bias_vl = vector(n_experts)


class V41MoE(nn.Module):
    """Sqrt-softplus routing with bias-steered top-k, clamped SwiGLU experts.

    Routed experts are stacked ``[E, N, K]``; the loader scatters the
    checkpoint's per-expert tensors into them.
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        n_experts: int,
        top_k: int,
        routed_scaling_factor: float,
        norm_topk_prob: bool,
        swiglu_limit: float,
        image_token_id: int | None,
    ):
        super().__init__()
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.swiglu_limit = swiglu_limit
        self.image_token_id = image_token_id
        self.gate = Gate(n_experts, hidden)
        self.w1 = stacked(n_experts, inter, hidden)
        self.w3 = stacked(n_experts, inter, hidden)
        self.w2 = stacked(n_experts, hidden, inter)
        self.shared_experts = SharedExpert(hidden, inter)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        is_image = None
        if self.image_token_id is not None:
            is_image = input_ids == self.image_token_id
        weights, ids = route_sqrtsoftplus(
            x,
            self.gate.weight,
            self.gate.bias,
            self.top_k,
            self.routed_scaling_factor,
            self.norm_topk_prob,
            bias_vl=self.gate.bias_vl,
            is_image=is_image,
        )
        shared = (self.shared_experts.w1, self.shared_experts.w3, self.shared_experts.w2)
        return moe_forward(x, weights, ids, self.w1, self.w3, self.w2, self.swiglu_limit, shared=shared)
