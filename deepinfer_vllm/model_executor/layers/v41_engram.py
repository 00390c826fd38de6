"""Engram conditional memory on the CPU path (spec §8)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_vllm.attention_backends.cache_layout import CacheDecl
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs.deepseek_v41 import V41Arch
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.model_executor.layers.weights import dense, linear
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.engram import (
    ENGRAM_BEFORE_START,
    compress_token_ids,
    engram_gate_update,
    engram_hash,
    engram_multipliers,
    engram_offsets,
    engram_primes,
)


class EngramTables:
    """Hash constants shared by all Engram layers, derived once from the config."""

    def __init__(self, arch: V41Arch, old2new: torch.Tensor):
        self.old2new = old2new
        self.max_ngram = arch.engram_max_ngram_size
        primes = engram_primes(
            arch.engram_layer_ids, arch.engram_max_ngram_size, arch.engram_n_heads, arch.engram_vocab_size
        )
        self.primes = primes
        self.offsets = {layer: engram_offsets(p) for layer, p in primes.items()}
        self.multipliers = {
            layer: engram_multipliers(layer, arch.engram_max_ngram_size, arch.engram_compressed_vocab_size)
            for layer in arch.engram_layer_ids
        }
        self.pad_id = int(old2new[arch.engram_pad_token_id])

    def ngram_ids(self, raw_history: torch.Tensor, is_image_history: torch.Tensor) -> torch.Tensor:
        """``raw_history [T, max_ngram]`` raw ids at ``p - s`` (-1 before the start)."""
        before = raw_history < 0
        comp = compress_token_ids(raw_history.clamp_min(0), self.old2new, is_image_history)
        return torch.where(before, torch.full_like(comp, ENGRAM_BEFORE_START), comp)


class TokenHistory(nn.Module):
    """Raw token ids of the last positions, paged by vLLM (Engram look-back)."""

    def __init__(self, decl: CacheDecl, cache_layers: dict[str, V41CacheLayer]):
        super().__init__()
        self.cache = V41CacheLayer(decl)
        cache_layers[decl.name] = self.cache

    def _slots(self, state: StepState, pos: torch.Tensor, req: torch.Tensor):
        meta = state.attn_metadata[self.cache.prefix]
        blocks = meta.block_table[req, pos // meta.block_size]
        return blocks, pos % meta.block_size

    def record_and_read(self, input_ids: torch.Tensor, state: StepState, depth: int) -> torch.Tensor:
        """Store this step's ids, then return ids at ``p - s`` for s < depth (-1 before 0)."""
        cache = self.cache.kv_cache.view(self.cache.kv_cache.shape[0], -1)
        pos, req = state.positions, state.token_req
        blocks, offs = self._slots(state, pos, req)
        cache[blocks, offs] = input_ids.to(torch.int32)
        back = pos.unsqueeze(1) - torch.arange(depth)
        valid = back >= 0
        safe = back.clamp_min(0)
        blocks, offs = self._slots(state, safe, req.unsqueeze(1).expand_as(safe))
        ids = cache[blocks, offs].long()
        return torch.where(valid, ids, torch.full_like(ids, -1))


class V41Engram(nn.Module):
    """One Engram layer: FP8 row table, ``wkv`` projection, per-stream gate."""

    def __init__(self, arch: V41Arch, layer_id: int, num_rows: int):
        super().__init__()
        self.layer_id = layer_id
        self.eps = arch.rms_norm_eps
        n_cols = (arch.engram_max_ngram_size - 1) * arch.engram_n_heads
        dim = arch.engram_head_dim
        # The table stays FP8 (it is the largest tensor of the release);
        # only looked-up rows are dequantised.
        self.register_buffer("embed_codes", torch.empty(num_rows, dim, dtype=torch.uint8), persistent=False)
        self.register_buffer(
            "embed_scale", torch.empty(num_rows, dim // 32, dtype=torch.uint8), persistent=False
        )
        self.wkv = dense((arch.hc_mult + 1) * arch.hidden_size, n_cols * dim)
        self.q_weight = dense(arch.hc_mult, arch.hidden_size)
        self.k_weight = dense(arch.hc_mult, arch.hidden_size)

    def forward(
        self,
        streams: torch.Tensor,
        ngram_ids: torch.Tensor,
        tables: EngramTables,
        is_image: torch.Tensor,
    ) -> torch.Tensor:
        rows = engram_hash(
            ngram_ids,
            tables.pad_id,
            tables.multipliers[self.layer_id],
            tables.primes[self.layer_id],
            tables.offsets[self.layer_id],
        )
        emb = quant.dequant_fp8_rows(self.embed_codes[rows], self.embed_scale[rows], streams.dtype)
        kv = linear(emb.flatten(1), self.wkv)
        return engram_gate_update(streams, kv, self.q_weight, self.k_weight, self.eps, is_image)
