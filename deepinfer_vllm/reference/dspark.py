"""DSpark drafter, full-sequence PyTorch reference (docs/architecture.md, "DSpark";
docs/design-notes.md, "DSpark").

Given a sequence ``x_0 .. x_p`` that the target has verified and the bonus token ``a`` it
sampled for position ``p+1``, the reference:

1. runs the target over ``x_0 .. x_p`` (``ReferenceV41`` with a trace) and forms the target
   features ``f_t`` (mean over streams of each target layer's entry) and
   ``main_t = RMSNorm(f_t main_proj^T; main_norm)``;
2. gives every draft layer its context keys ``MXFP8(RoPE(kv_norm(main_t wkv^T), t))`` at the
   last ``W`` positions ``p+1-W .. p``;
3. runs the draft blocks over ``[a, N, .., N]`` at ``p+1 .. p+k``: each query sees the context
   keys and all ``k`` block keys (bidirectional inside the block), main RoPE, attention sink;
4. ``hh`` = the last block's streams collapsed with its FFN-site pre-mix; base logits
   ``head(RMSNorm(hh; norm))``;
5. the sequential Markov head and confidence head pick ``d_0 .. d_{k-1}``.

Weights are dense tensors under their checkpoint names (``mtp.*``; routed experts stacked).
Every function also accepts weights that require grad (the training tool differentiates
through ``block_outputs``); ``qdq`` replaces the MXFP8 cast there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.configs.checkpoint import DSPARK_PREFIX, iter_dequantized
from deepinfer_vllm.ops.dspark import confidence, context_window, draft_inputs, markov_logits, target_features
from deepinfer_vllm.ops.mhc import hc_collapse, hc_expand, hc_mix, identity_pre
from deepinfer_vllm.ops.moe import moe_forward, route_sqrtsoftplus
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.numerics import gemm
from deepinfer_vllm.ops.quant import mxfp8_qdq
from deepinfer_vllm.ops.rope import apply_rope_tail
from deepinfer_vllm.ops.sparse_attention import sparse_attention

from .model import ForwardTrace, ReferenceV41

__all__ = ["DraftResult", "ReferenceDSpark", "load_dspark_weights"]

Weights = dict[str, torch.Tensor]


@dataclass
class DraftResult:
    tokens: list[int]  # d_0 .. d_{k-1}
    logits: torch.Tensor  # [k, V] fp32 Markov-corrected logits
    confidences: torch.Tensor  # [k] fp32
    hh: torch.Tensor  # [k, D] head hidden (pre-norm)
    base: torch.Tensor  # [k, V] fp32 base logits


def load_dspark_weights(arch: V41Arch, model_dir: str | Path) -> Weights:
    """The ``mtp.*`` tensors of a checkpoint, dequantised to fp32 (experts stacked ``[E, N, K]``)."""
    from safetensors.torch import load_file

    def raw():
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            yield from ((n, t) for n, t in load_file(str(path)).items() if n.startswith(DSPARK_PREFIX))

    w = {n: t for n, t in iter_dequantized(arch, raw(), torch.float32)}
    if not w:
        raise ValueError(f"{model_dir} has no DSpark (mtp.*) tensors")
    return stack_experts(arch, w)


def stack_experts(arch: V41Arch, w: Weights) -> Weights:
    """Move ``mtp.{k}.ffn.experts.{e}.w{1,2,3}.weight`` into ``mtp.{k}.ffn.experts.w{1,2,3}`` stacks."""
    out = dict(w)
    for k in range(arch.num_dspark_layers):
        p = f"mtp.{k}.ffn.experts"
        for proj in ("w1", "w2", "w3"):
            names = [f"{p}.{e}.{proj}.weight" for e in range(arch.dspark_n_routed_experts)]
            out[f"{p}.{proj}"] = torch.stack([out.pop(n) for n in names])
    return out


class ReferenceDSpark:
    """The drafter on top of a ``ReferenceV41`` target (shares its embedding, head and RoPE)."""

    def __init__(self, target: ReferenceV41, weights: Weights):
        self.target = target
        self.arch = target.arch
        acc = torch.float64 if target.dtype == torch.float32 else torch.float32
        self.w = {k: (v.to(acc) if v.is_floating_point() else v) for k, v in weights.items()}

    @classmethod
    def from_pretrained(cls, target: ReferenceV41, model_dir: str | Path) -> ReferenceDSpark:
        return cls(target, load_dspark_weights(target.arch, model_dir))

    # ------------------------------------------------------------------ pieces
    def features(self, prefix_ids) -> torch.Tensor:
        """``f_t`` ``[p+1, n_targets * D]`` of the verified sequence (target forward with a trace)."""
        trace = ForwardTrace()
        self.target.hidden_states(prefix_ids, trace=trace)
        return target_features([trace.entry_streams[L] for L in self.arch.dspark_target_layer_ids])

    def main(self, f: torch.Tensor, w: Weights | None = None) -> torch.Tensor:
        w = self.w if w is None else w
        a = self.arch
        return rms_norm(gemm(f, w["mtp.0.main_proj.weight"]), w["mtp.0.main_norm.weight"], a.rms_norm_eps)

    def context_keys(
        self, layer: int, main: torch.Tensor, pos: torch.Tensor, w: Weights | None = None, qdq: Callable = mxfp8_qdq
    ) -> torch.Tensor:
        """Draft layer ``layer``'s context keys for rows ``main`` at positions ``pos``."""
        w = self.w if w is None else w
        a = self.arch
        p = f"mtp.{layer}.attn"
        kv = rms_norm(gemm(main, w[f"{p}.wkv.weight"]), w[f"{p}.kv_norm.weight"], a.rms_norm_eps)
        return qdq(apply_rope_tail(kv, pos, self.target._rope_main))

    def block_outputs(
        self,
        main: torch.Tensor,
        bonus: torch.Tensor,
        anchor: torch.Tensor,
        k: int,
        w: Weights | None = None,
        qdq: Callable = mxfp8_qdq,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Parallel draft forward of ``R`` blocks -> ``hh [R*k, D]`` and fp32 base logits ``[R*k, V]``.

        ``main``: ``[R, W, D]`` main rows of each request's context window (rows of invalid
        positions are ignored), ``bonus``/``anchor``: ``[R]``.
        """
        w = self.w if w is None else w
        a = self.arch
        dtype = self.target.dtype
        R = bonus.shape[0]
        ids, pos = draft_inputs(bonus, anchor, k, a.dspark_noise_token_id)
        ctx_pos, ctx_valid = context_window(anchor, a.sliding_window)
        e = self.target.w["embed.weight"][ids].to(dtype)
        streams = e.unsqueeze(1).expand(R * k, a.hc_mult, e.shape[-1]).contiguous()
        pre = identity_pre(R * k, a.hc_mult)
        is_image = ids == a.image_token_id
        for layer in range(a.num_dspark_layers):
            p = f"mtp.{layer}"
            pre_a, post_a, comb_a = self._mix(w, p, "attn", streams)
            x = rms_norm(hc_collapse(streams, pre), w[f"{p}.attn_norm.weight"], a.rms_norm_eps)
            ctx = self.context_keys(layer, main.reshape(R * a.sliding_window, -1), ctx_pos.clamp_min(0).reshape(-1), w, qdq)
            ctx = ctx.view(R, a.sliding_window, -1)
            streams = hc_expand(self._attention(w, layer, x, pos, ctx, ctx_valid, k, qdq), streams, post_a, comb_a)
            pre_f, post_f, comb_f = self._mix(w, p, "ffn", streams)
            xf = rms_norm(hc_collapse(streams, pre_a), w[f"{p}.ffn_norm.weight"], a.rms_norm_eps)
            streams = hc_expand(self._moe(w, layer, xf, is_image), streams, post_f, comb_f)
            pre = pre_f
        hh = hc_collapse(streams, pre)
        last = f"mtp.{a.num_dspark_layers - 1}"
        h = rms_norm(hh, w[f"{last}.norm.weight"], a.rms_norm_eps)
        base = gemm(h, self.target.w["head.weight"], torch.float32)
        return hh, base

    def _mix(self, w: Weights, prefix: str, site: str, streams: torch.Tensor):
        a = self.arch
        return hc_mix(
            streams, w[f"{prefix}.hc_{site}_fn"], w[f"{prefix}.hc_{site}_base"], w[f"{prefix}.hc_{site}_scale"],
            a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters,
        )

    def _attention(self, w, layer, x, pos, ctx, ctx_valid, k, qdq) -> torch.Tensor:
        """Window attention of the draft rows: context keys + the block's own keys (all of them)."""
        a = self.arch
        p = f"mtp.{layer}.attn"
        T = x.shape[0]
        R = T // k
        H, Dh = a.num_heads, a.head_dim
        rope = self.target._rope_main
        c_q = rms_norm(gemm(x, w[f"{p}.wq_a.weight"]), w[f"{p}.q_norm.weight"], a.rms_norm_eps)
        q = apply_rope_tail(gemm(c_q, w[f"{p}.wq_b.weight"]).view(T, H, Dh), pos, rope)
        kv = rms_norm(gemm(x, w[f"{p}.wkv.weight"]), w[f"{p}.kv_norm.weight"], a.rms_norm_eps)
        kv = qdq(apply_rope_tail(kv, pos, rope)).view(R, k, Dh)
        keys = torch.cat([ctx.masked_fill(~ctx_valid.unsqueeze(-1), 0.0), kv], dim=1)
        valid = torch.cat([ctx_valid, torch.ones(R, k, dtype=torch.bool)], dim=1)
        keys = keys.repeat_interleave(k, dim=0)
        valid = valid.repeat_interleave(k, dim=0)
        o = sparse_attention(q, keys, valid, w[f"{p}.attn_sink"], Dh**-0.5)
        o = apply_rope_tail(o, pos, rope, inverse=True)
        G = a.o_groups
        wo_a = w[f"{p}.wo_a.weight"]
        acc = wo_a.dtype
        z = torch.einsum("tgi,goi->tgo", o.reshape(T, G, -1).to(acc), wo_a.view(G, a.o_lora_rank, -1)).to(x.dtype)
        return gemm(z.reshape(T, -1), w[f"{p}.wo_b.weight"])

    def _moe(self, w, layer, x, is_image) -> torch.Tensor:
        a = self.arch
        p = f"mtp.{layer}.ffn"
        weights, experts = route_sqrtsoftplus(
            x, w[f"{p}.gate.weight"], w[f"{p}.gate.bias"], a.dspark_top_k, a.routed_scaling_factor,
            a.norm_topk_prob, bias_vl=w.get(f"{p}.gate.bias_vl"), is_image=is_image,
        )
        shared = (w[f"{p}.shared_experts.w1.weight"], w[f"{p}.shared_experts.w3.weight"], w[f"{p}.shared_experts.w2.weight"])
        return moe_forward(
            x, weights, experts, w[f"{p}.experts.w1"], w[f"{p}.experts.w3"], w[f"{p}.experts.w2"], a.swiglu_limit,
            shared=shared,
        )

    # ------------------------------------------------------------------ whole draft
    @torch.no_grad()
    def draft_greedy(self, prefix_ids, bonus: int, k: int) -> DraftResult:
        """Greedy drafts (lowest id on ties) after the verified ``prefix_ids`` and bonus ``bonus``."""
        a = self.arch
        f = self.features(prefix_ids)
        p = len(prefix_ids) - 1
        anchor = torch.tensor([p])
        ctx_pos, _ = context_window(anchor, a.sliding_window)
        main = self.main(f)[ctx_pos.clamp_min(0)]  # [1, W, D]
        hh, base = self.block_outputs(main, torch.tensor([bonus]), anchor, k)
        last = f"mtp.{a.num_dspark_layers - 1}"
        embed, head = self.w[f"{last}.markov_head.embed.weight"], self.w[f"{last}.markov_head.head.weight"]
        proj = self.w.get(f"{last}.confidence_head.proj.weight")
        prev = torch.tensor([bonus])
        tokens, logits, confs = [], [], []
        for i in range(k):
            l_i, e_i = markov_logits(base[i : i + 1], prev, embed, head)
            c_i = confidence(proj, hh[i : i + 1], e_i) if proj is not None else torch.full((1,), float("nan"))
            d = int(torch.argmax(l_i[0]))
            tokens.append(d)
            logits.append(l_i[0])
            confs.append(c_i[0])
            prev = torch.tensor([d])
        return DraftResult(tokens, torch.stack(logits), torch.stack(confs), hh, base)
