"""DeepSeek-V4.1-Flash for vLLM, DeepInfer's implementation (CPU path).

Structure follows spec §4: embedding broadcast to ``hc_mult`` residual streams,
40 blocks with single-pass mHC (the input of a sublayer is collapsed with the
pre-mix of the previous site), CSA2 attention, MoE, Engram at its layers, and a
final collapse with the last FFN site's pre-mix. The causal encoder/decoder
split matters only to prefill truncation (``DEEPINFER_YOCO_*``).

Weights arrive in the released format (FP8 blocks, packed FP4 experts, FP8
Engram rows) and are dequantised once while loading; the checkpoint header is
validated against the format before any tensor is read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context

from deepinfer_vllm import envs
from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token, model_caches
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs.deepseek_v41 import LayerRole, V41Arch
from deepinfer_vllm.model_executor import checkpoint
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention
from deepinfer_vllm.model_executor.layers.v41_engram import EngramTables, TokenHistory, V41Engram
from deepinfer_vllm.model_executor.layers.v41_moe import V41MoE
from deepinfer_vllm.model_executor.layers.weights import dense, vector
from deepinfer_vllm.ops.mhc import hc_collapse, hc_expand, hc_mix, identity_pre
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.numerics import acc_dtype, gemm
from deepinfer_vllm.ops.rope import build_rope_cache

logger = logging.getLogger(__name__)


class HyperConnection(nn.Module):
    """The mHC parameters of one sublayer site (fp32 in the checkpoint)."""

    def __init__(self, arch: V41Arch):
        super().__init__()
        hc = arch.hc_mult
        self.fn = dense(hc * (hc + 2), hc * arch.hidden_size)
        self.base = vector(hc * (hc + 2))
        self.scale = vector(3)
        self.arch = arch

    def mix(self, streams: torch.Tensor):
        a = self.arch
        return hc_mix(streams, self.fn, self.base, self.scale, a.rms_norm_eps, a.hc_eps, a.hc_sinkhorn_iters)


class DeepseekV41Block(nn.Module):
    """One backbone layer: [Engram] -> attention site -> FFN site (spec §4)."""

    def __init__(
        self,
        arch: V41Arch,
        role: LayerRole,
        rope_cache: torch.Tensor,
        prefix: str,
        cache_layers: dict[str, V41CacheLayer],
    ):
        super().__init__()
        self.arch = arch
        self.role = role
        self.attn_norm = vector(arch.hidden_size)
        self.ffn_norm = vector(arch.hidden_size)
        self.hc_attn = HyperConnection(arch)
        self.hc_ffn = HyperConnection(arch)
        self.attn = V41Attention(arch, role, rope_cache, f"{prefix}.attn", cache_layers)
        self.ffn = V41MoE(
            arch.hidden_size,
            arch.moe_intermediate_size,
            arch.n_routed_experts,
            arch.top_k,
            arch.routed_scaling_factor,
            arch.norm_topk_prob,
            arch.swiglu_limit,
            arch.image_token_id,
        )
        self.engram = None
        if role.has_engram:
            idx = list(arch.engram_layer_ids).index(role.layer_id)
            self.engram = V41Engram(arch, role.layer_id, arch.engram_num_embeddings[idx])

    def forward(self, streams, pre_in, input_ids, state: StepState, engram_inputs, keep_rows=None):
        """One block; with ``keep_rows`` (compact truncation boundary) the
        compressor still sees every row, everything after it only those rows."""
        eps = self.arch.rms_norm_eps
        if self.engram is not None:
            ngram_ids, tables, is_image = engram_inputs
            streams = self.engram(streams, ngram_ids, tables, is_image)
        pre_a, post_a, comb_a = self.hc_attn.mix(streams)
        x = rms_norm(hc_collapse(streams, pre_in), self.attn_norm, eps)
        write_compressed = True
        if keep_rows is not None:
            self.attn.write_compressed(x, state)
            write_compressed = False
            streams, pre_a, post_a, comb_a = streams[keep_rows], pre_a[keep_rows], post_a[keep_rows], comb_a[keep_rows]
            x, input_ids, state = x[keep_rows], input_ids[keep_rows], state.subset(keep_rows)
        streams = hc_expand(self.attn(x, state, write_compressed), streams, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.mix(streams)
        x = rms_norm(hc_collapse(streams, pre_a), self.ffn_norm, eps)
        streams = hc_expand(self.ffn(x, input_ids), streams, post_f, comb_f)
        return streams, pre_f, input_ids, state


class DeepseekV41ForCausalLM(nn.Module):
    """vLLM entry class; overrides vLLM's in-tree GPU-only V4.1 class."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.arch = arch = V41Arch.from_config(model_config.hf_config)
        self.dtype = model_config.dtype
        self.model_dir = Path(model_config.model)
        self.yoco_mode, self.yoco_keep = envs.yoco_settings(arch.sliding_window)
        if self.yoco_mode == "compact" and any(i >= arch.first_decoder_layer for i in arch.engram_layer_ids):
            raise ValueError("compact prefill truncation needs every Engram layer before the decoder half")

        main_rope = build_rope_cache(arch.rope_dim, arch.max_position_embeddings, arch.rope_theta, None)
        comp_rope = build_rope_cache(
            arch.rope_dim, arch.max_position_embeddings, arch.compress_rope_theta, arch.rope_scaling
        )
        self.cache_layers: dict[str, V41CacheLayer] = {}
        self.embed = dense(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV41Block(
                arch,
                role,
                main_rope if role.ratio == 0 else comp_rope,
                f"layers.{role.layer_id}",
                self.cache_layers,
            )
            for role in arch.roles
        )
        for block in self.layers:
            role = block.role
            if role.ratio > 0:
                block.attn.bind_kv_source(self.layers[role.kv_source].attn)
        self.norm = vector(arch.hidden_size)
        self.head = dense(arch.vocab_size, arch.hidden_size)

        self.engram_tables: EngramTables | None = None
        self.token_history: TokenHistory | None = None
        if arch.engram_layer_ids:
            history = next(d for d in model_caches(arch) if d.kind == "tokens")
            self.token_history = TokenHistory(history, self.cache_layers)
            self.engram_tables = EngramTables(arch, _engram_vocab_map(model_config, arch))

        # Weights that load now and run in later work (vision tower, DSpark):
        # kept as raw checkpoint tensors, validated with the rest.
        self.deferred = nn.Module()

        block_size = vllm_config.cache_config.block_size
        per_token = bytes_per_token([c.decl for c in self.cache_layers.values()], block_size)
        logger.info(
            "DeepInfer V4.1 caches: %s bytes/token (block %d)",
            {k: round(v, 1) for k, v in per_token.items()},
            block_size,
        )

    # --------------------------------------------------------------- forward
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids].to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        arch = self.arch
        attn_metadata = get_forward_context().attn_metadata
        if not attn_metadata:
            # Profiling / dummy run without caches: nothing to attend to.
            return torch.zeros(positions.shape[0], arch.hidden_size, dtype=self.dtype, device=positions.device)
        state = StepState.from_metadata(attn_metadata, next(iter(self.cache_layers)))
        T = state.num_tokens
        input_ids = input_ids[:T]
        x = inputs_embeds[:T] if inputs_embeds is not None else self.embed_input_ids(input_ids)
        streams = x.unsqueeze(1).expand(T, arch.hc_mult, arch.hidden_size).contiguous()
        pre = identity_pre(T, arch.hc_mult)
        is_image = input_ids == arch.image_token_id
        engram_inputs = None
        if self.token_history is not None:
            raw = self.token_history.record_and_read(input_ids, state, arch.engram_max_ngram_size)
            history_image = raw == arch.image_token_id
            ngram_ids = self.engram_tables.ngram_ids(raw, history_image)
            engram_inputs = (ngram_ids, self.engram_tables, is_image)
        rows = torch.arange(T)
        compact_rows = self._apply_yoco(state)
        for block in self.layers:
            keep = compact_rows if block.role.layer_id == arch.first_decoder_layer else None
            streams, pre, input_ids, state = block(streams, pre, input_ids, state, engram_inputs, keep)
            if keep is not None:
                rows = rows[keep]
        h = rms_norm(hc_collapse(streams, pre), self.norm, arch.rms_norm_eps)
        # Rows a compact prefill dropped are never sampled (their request's
        # last row is always kept); they come out as zeros.
        out = torch.zeros(positions.shape[0], arch.hidden_size, dtype=h.dtype, device=h.device)
        out[rows] = h
        return out

    def _apply_yoco(self, state: StepState) -> torch.Tensor | None:
        """DeepInfer's prefill truncation of the decoder half (design §3).

        Decoder layers keep window KV only for the last ``keep`` prompt
        positions and clip every window there; ``compact`` additionally
        computes them only for those rows (plus each request's last row, so a
        chunk before the kept rectangle still has a row to sample).
        Returns the kept row indices for ``compact``, else None.
        """
        if self.yoco_mode == "off":
            return None
        prompt_lens = state.prompt_lens
        if prompt_lens is None:
            raise RuntimeError(
                "prefill truncation needs prompt lengths in the step metadata; "
                "run V4.1 with DeepInfer's CPU worker (selected by its platform)"
            )
        start = (prompt_lens - self.yoco_keep).clamp_min(0)
        state.decoder_window_start = start[state.token_req]
        if self.yoco_mode != "compact":
            return None
        keep = state.positions >= state.decoder_window_start
        last_rows = (state.token_req[1:] != state.token_req[:-1]).nonzero(as_tuple=True)[0]
        keep[last_rows] = True
        keep[-1] = True
        return keep.nonzero(as_tuple=True)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The head is bf16 in the release; logits are fp32 (DeepInfer).
        return gemm(hidden_states, self.head, torch.float32)

    # --------------------------------------------------------------- loading
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        arch = self.arch
        found = checkpoint.read_safetensors_index(self.model_dir)
        checkpoint.validate_checkpoint_index(arch, found)
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in checkpoint.iter_dequantized(arch, weights, torch.float32):
            target = self._target_name(name)
            if target is None:
                self._store_deferred(name, tensor)
                continue
            dest, index = target
            holder = params.get(dest)
            if holder is None:
                holder = buffers[dest]
            slot = holder.data if index is None else holder.data[index]
            if slot.shape != tensor.shape:
                raise checkpoint.CheckpointFormatError(
                    f"tensor {name!r}: shape {tuple(tensor.shape)} does not fit {dest} {tuple(slot.shape)}"
                )
            slot.copy_(tensor.to(slot.dtype))
            loaded.add(dest)
        # Hold weights in the accumulation dtype (values are exact either way).
        acc = acc_dtype(self.dtype)
        for param in params.values():
            if param.is_floating_point():
                param.data = param.data.to(acc)
        missing = set(params) - loaded
        if missing:
            raise checkpoint.CheckpointFormatError(f"parameters not loaded: {sorted(missing)[:8]}")
        return set(params)

    def _target_name(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint name to ``(parameter, expert index)``; None = deferred."""
        parts = name.split(".")
        if parts[0] in ("embed", "head") and parts[1] == "weight":
            return parts[0], None
        if name == "norm.weight":
            return "norm", None
        if parts[0] != "layers":
            return None
        prefix = ".".join(parts[:2])
        rest = ".".join(parts[2:])
        for site in ("attn", "ffn"):
            for field in ("fn", "base", "scale"):
                if rest == f"hc_{site}_{field}":
                    return f"{prefix}.hc_{site}.{field}", None
        if rest in ("attn_norm.weight", "ffn_norm.weight"):
            return f"{prefix}.{rest[:-7]}", None
        if rest == "attn.attn_sink":
            return f"{prefix}.attn.attn_sink", None
        if rest.endswith("_norm.weight") or rest.endswith(".norm.weight"):
            return f"{prefix}.{rest[:-7]}", None
        if rest.startswith("ffn.experts."):
            _, _, expert, proj, _ = rest.split(".")
            return f"{prefix}.ffn.{proj}", int(expert)
        if rest.startswith("ffn.gate."):
            return f"{prefix}.{rest}", None
        if rest == "engram.embed.weight":
            return f"{prefix}.engram.embed_codes", None
        if rest == "engram.embed.scale":
            return f"{prefix}.engram.embed_scale", None
        if rest in ("engram.q_weight", "engram.k_weight"):
            return f"{prefix}.{rest}", None
        if rest.endswith(".weight"):
            return f"{prefix}.{rest[:-7]}", None
        raise checkpoint.CheckpointFormatError(f"unexpected tensor {name!r}")

    def _store_deferred(self, name: str, tensor: torch.Tensor) -> None:
        self.deferred.register_buffer(name.replace(".", "__"), tensor, persistent=False)


def _engram_vocab_map(model_config, arch: V41Arch) -> torch.Tensor:
    """Raw id -> compressed id from the checkpoint's tokenizer (spec §8.1)."""
    from transformers import AutoTokenizer

    from deepinfer_vllm.ops.engram import compressed_vocab_from_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
    )
    old2new, classes = compressed_vocab_from_tokenizer(tokenizer, arch.vocab_size)
    if classes != arch.engram_compressed_vocab_size:
        raise ValueError(
            f"Engram: the tokenizer gives {classes} compressed ids but config.json "
            f"says engram_compressed_vocab_size={arch.engram_compressed_vocab_size}; "
            "the hash multipliers depend on it, so the checkpoint and tokenizer do not match."
        )
    return old2new
