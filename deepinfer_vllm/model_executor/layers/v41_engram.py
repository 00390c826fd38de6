"""Engram conditional memory (docs/architecture.md, "Engram"): FP8 row tables split over the expert group."""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.linear import ColumnParallelLinear

from deepinfer_vllm.attention_backends.cache_layout import CacheDecl
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout, TokenExchange
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.model_executor.layers.params import held, ue8m0_dtype
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

    def __init__(self, arch: V41Arch):
        self.old2new: torch.Tensor | None = None
        self.pad_id: int | None = None
        self.max_ngram = arch.engram_max_ngram_size
        self.pad_token_id = arch.engram_pad_token_id
        primes = engram_primes(
            arch.engram_layer_ids, arch.engram_max_ngram_size, arch.engram_n_heads, arch.engram_vocab_size
        )
        self.primes = primes
        self.offsets = {layer: engram_offsets(p) for layer, p in primes.items()}
        self.multipliers: dict[int, list[int]] = {}
        self.compressed_vocab_size = arch.engram_compressed_vocab_size
        self._arch = arch

    def set_vocab(self, old2new: torch.Tensor) -> None:
        """Raw id -> compressed id, derived from the checkpoint's tokenizer at load time
        (the hash multipliers depend on the compressed vocabulary's size)."""
        a = self._arch
        largest = int(old2new.max()) if old2new.numel() else -1
        if largest >= a.engram_compressed_vocab_size:
            raise ValueError(
                f"the tokenizer compresses to id {largest}, outside engram_compressed_vocab_size="
                f"{a.engram_compressed_vocab_size} of the config: tokenizer and config do not match"
            )
        self.old2new = old2new
        self._old2new_on: dict[torch.device, torch.Tensor] = {}
        self.pad_id = int(old2new[self.pad_token_id])
        self.multipliers = {
            layer: engram_multipliers(layer, a.engram_max_ngram_size, a.engram_compressed_vocab_size)
            for layer in a.engram_layer_ids
        }

    def ngram_ids(self, raw_history: torch.Tensor, is_image_history: torch.Tensor) -> torch.Tensor:
        """``raw_history [T, max_ngram]`` raw ids at ``p - s`` (-1 before the start)."""
        before = raw_history < 0
        device = raw_history.device
        if device not in self._old2new_on:  # once per device, not once per step
            self._old2new_on[device] = self.old2new.to(device, torch.int64)
        comp = compress_token_ids(raw_history.clamp_min(0), self._old2new_on[device], is_image_history)
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
        back = pos.unsqueeze(1) - torch.arange(depth, device=pos.device)
        valid = back >= 0
        safe = back.clamp_min(0)
        blocks, offs = self._slots(state, safe, req.unsqueeze(1).expand_as(safe))
        ids = cache[blocks, offs].long()
        return torch.where(valid, ids, torch.full_like(ids, -1))


class EngramTable(nn.Module):
    """One Engram table as released (E4M3 rows, UE8M0 per 1x32), its rows split over
    vLLM's expert group: this rank holds rows ``[row0, row0 + rows)`` and a lookup
    gathers every row from its owner."""

    def __init__(self, num_rows: int, dim: int, layout: ParallelLayout):
        super().__init__()
        self.layout = layout
        self.row0, n = layout.engram_rows(num_rows)
        self.weight = held(n, dim, dtype=torch.float8_e4m3fn)
        self.scale = held(n, dim // 32, dtype=ue8m0_dtype())
        for p in (self.weight, self.scale):
            p.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        src = loaded.narrow(0, self.row0, param.shape[0])
        param.data.copy_(src.view(param.dtype) if src.element_size() == 1 else src)

    def _owned(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows held here, decoded to ``dtype``; zeros for rows held elsewhere."""
        n = self.weight.shape[0]
        if n == 0:
            return torch.zeros(*rows.shape, self.weight.shape[1], dtype=dtype, device=rows.device)
        local = rows - self.row0
        owned = (local >= 0) & (local < n)
        safe = torch.where(owned, local, torch.zeros_like(local))
        emb = quant.dequant_fp8_rows(self.weight[safe], self.scale[safe], dtype)
        return emb.masked_fill_(~owned.unsqueeze(-1), 0.0)

    def lookup(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``rows [T, cols]`` (global row ids) -> decoded rows ``[T, cols, dim]`` in ``dtype``."""
        if self.layout.moe_size == 1:
            return quant.dequant_fp8_rows(self.weight[rows], self.scale[rows], dtype)
        ex = TokenExchange(self.layout, rows.shape[0], rows.device)
        # Every row has one owner, so the sum over ranks is that row, exactly.
        return ex.own(ex.reduce(self._owned(ex.gather(rows, fill=self.row0), dtype)))


class V41Engram(nn.Module):
    """One Engram layer: the FP8 row table, ``wkv`` (column-parallel, gathered) and the
    per-stream gate weights (replicated)."""

    def __init__(
        self, arch: V41Arch, layer_id: int, num_rows: int, quant_config, layout: ParallelLayout, prefix: str
    ):
        super().__init__()
        self.layer_id = layer_id
        self.eps = arch.rms_norm_eps
        n_cols = arch.engram_n_columns
        dim = arch.engram_head_dim
        self.embed = EngramTable(num_rows, dim, layout)
        self.wkv = ColumnParallelLinear(
            n_cols * dim, (arch.hc_mult + 1) * arch.hidden_size, bias=False, gather_output=True,
            quant_config=quant_config, prefix=f"{prefix}.wkv", return_bias=False,
        )
        self.q_weight = held(arch.hc_mult, arch.hidden_size, dtype=torch.bfloat16)
        self.k_weight = held(arch.hc_mult, arch.hidden_size, dtype=torch.bfloat16)

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
            id_bound=tables.compressed_vocab_size,
        )
        emb = self.embed.lookup(rows, streams.dtype)
        kv = self.wkv(emb.flatten(1))
        return engram_gate_update(streams, kv, self.q_weight, self.k_weight, self.eps, is_image)
