"""DSpark's draft layers inside the vLLM model (docs/architecture.md, "DSpark"; docs/design-notes.md,
"Context keys" and "Draft step").

The stages ``mtp.0 .. mtp.{n-1}`` are V4.1 blocks with window-only attention. Each owns a
window cache that vLLM pages like the target's (``mtp.{k}.attn.window_cache``), holding the
*context keys* the target writes after every forward: ``MXFP8(RoPE(kv_norm(main_t wkv^T), t))``
with ``main_t = RMSNorm(f_t main_proj^T)`` and ``f_t`` the target features
(``ops.dspark.target_features``). Verify rows of drafts that get rejected write slots past the
accepted position; the next draft never reads them and the next verify step overwrites them.

A draft step runs every drafting request's block ``[a, N, .., N]`` at ``p+1 .. p+k``: the
queries see the ``W`` context keys ending at ``p`` and all ``k`` block keys (MXFP8-rounded,
never stored). Module names equal the checkpoint names (``mtp.0.main_proj``,
``mtp.{last}.markov_head.embed`` ...), so the model's loader needs no mapping.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ReplicatedLinear

from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.configs.checkpoint import dspark_prefix
from deepinfer_vllm.model_executor.layers.linear import linear
from deepinfer_vllm.model_executor.layers.norm import V41Norm
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
from deepinfer_vllm.model_executor.layers.params import held
from deepinfer_vllm.model_executor.layers.step_state import PagedView, StepState
from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention
from deepinfer_vllm.model_executor.layers.v41_mhc import HyperConnection, collapse_norm
from deepinfer_vllm.model_executor.layers.v41_moe import V41MoE
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.dspark import context_window
from deepinfer_vllm.ops.sparse_attention import sparse_attention

__all__ = ["DSparkStage", "build_stages"]


class DSparkAttention(V41Attention):
    """A stage's attention: the backbone's projections, context keys + block keys."""

    def write_context(self, main: torch.Tensor, state: StepState) -> None:
        """Context keys of the target rows ``main`` (positions and requests from ``state``)."""
        kv = self._rope(self.kv_norm(linear(self.wkv, main)), state.positions)
        PagedView(self.window_cache, state).write(state.token_req, state.positions, kv)

    def draft(
        self, x: torch.Tensor, pos: torch.Tensor, req: torch.Tensor, anchor: torch.Tensor, k: int, state: StepState
    ) -> torch.Tensor:
        """Attention of ``R`` blocks of ``k`` rows (request rows ``req``, anchors ``anchor``)."""
        a = self.arch
        T = x.shape[0]
        R = T // k
        c_q, kv = self._latents(x)
        q = self._rope(self.wq_b(c_q).view(T, self.num_local_heads, a.head_dim), pos)
        own = quant.mxfp8_qdq(self._rope(kv, pos)).view(R, k, a.head_dim)
        ctx_pos, ctx_valid = context_window(anchor, a.sliding_window)
        ctx = PagedView(self.window_cache, state).read(
            req.unsqueeze(1).expand_as(ctx_pos), ctx_pos.clamp_min(0), x.dtype
        )
        keys = torch.cat([ctx.masked_fill(~ctx_valid.unsqueeze(-1), 0.0), own], dim=1)
        valid = torch.cat([ctx_valid, torch.ones(R, k, dtype=torch.bool, device=x.device)], dim=1)
        o = sparse_attention(
            q, keys.repeat_interleave(k, dim=0), valid.repeat_interleave(k, dim=0), self.attn_sink, a.head_dim**-0.5
        )
        o = self._rope(o, pos, inverse=True)
        return self.wo_b(self._grouped_wo_a(o.reshape(T, self.num_local_groups, -1)))


class MarkovHead(nn.Module):
    """Rank-``r`` transition bias ``embed[prev] @ head^T`` (bf16 in the release)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = held(vocab, rank, dtype=torch.bfloat16)
        self.head = nn.Module()
        self.head.weight = held(vocab, rank, dtype=torch.bfloat16)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = held(1, dim, dtype=torch.float32)


class DSparkStage(nn.Module):
    """One DSpark stage (block ``mtp.{k}``); the first also owns ``main_proj``/``main_norm``,
    the last ``norm``, ``markov_head`` and (if configured) ``confidence_head``."""

    def __init__(
        self,
        arch: V41Arch,
        index: int,
        role: LayerRole,
        rope_cache: torch.Tensor,
        cache_layers: dict[str, V41CacheLayer],
        quant_config,
        layout: ParallelLayout,
    ):
        super().__init__()
        prefix = dspark_prefix(index)
        d = arch.hidden_size
        self.arch = arch
        self.attn_norm = V41Norm(d, arch.rms_norm_eps)
        self.ffn_norm = V41Norm(d, arch.rms_norm_eps)
        self.hc_attn = HyperConnection(arch)
        self.hc_ffn = HyperConnection(arch)
        self.attn = DSparkAttention(arch, role, rope_cache, f"{prefix}.attn", cache_layers, quant_config, layout)
        self.ffn = V41MoE.from_arch(
            arch, arch.dspark_n_routed_experts, arch.dspark_top_k, quant_config, layout, f"{prefix}.ffn"
        )
        if index == 0:
            n_targets = len(arch.dspark_target_layer_ids)
            self.main_proj = ReplicatedLinear(
                n_targets * d, d, bias=False, quant_config=quant_config, prefix=f"{prefix}.main_proj",
                return_bias=False,
            )
            self.main_norm = V41Norm(d, arch.rms_norm_eps)
        if index == arch.num_dspark_layers - 1:
            self.norm = V41Norm(d, arch.rms_norm_eps)
            self.markov_head = MarkovHead(arch.vocab_size, arch.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + arch.dspark_markov_rank) if arch.enable_confidence_head else None

    def forward(self, streams, pre_in, ids, pos, req, anchor, k: int, state: StepState):
        pre_a, post_a, comb_a = self.hc_attn.mix(streams)
        x = collapse_norm(streams, pre_in, self.attn_norm)
        streams = self.hc_attn.expand(self.attn.draft(x, pos, req, anchor, k, state), streams, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.mix(streams)
        x = collapse_norm(streams, pre_a, self.ffn_norm)
        streams = self.hc_ffn.expand(self.ffn(x, ids), streams, post_f, comb_f)
        return streams, pre_f

    def dummy_forward(self, num_tokens: int, dtype: torch.dtype, device) -> None:
        """This stage's part of a draft step that drafts nothing: its MoE over ``num_tokens``
        zero rows, output discarded.

        The MoE is the stage's only collective across data-parallel ranks (its tokens go
        through the expert group, ``TokenExchange``); attention and the rest are local to
        the rank (tensor-parallel collectives stay within it). A rank with no draft rows
        runs this while the others draft, so every rank's draft step meets the others'."""
        x = torch.zeros(num_tokens, self.arch.hidden_size, dtype=dtype, device=device)
        self.ffn(x, torch.zeros(num_tokens, dtype=torch.int64, device=device))


def build_stages(arch: V41Arch, rope_cache, cache_layers, quant_config, layout) -> nn.ModuleList:
    return nn.ModuleList(
        DSparkStage(arch, k, role, rope_cache, cache_layers, quant_config, layout)
        for k, role in enumerate(arch.dspark_roles)
    )
