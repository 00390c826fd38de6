"""CSA2 attention of one V4.1 layer, over vLLM-paged caches.

Order inside a step (prefill chunk or decode, mixed in one batch):
window KV of every token is quantised and written first, then (KV sources)
the compressed KV and index keys of every group the step completes, then
(index sources) the indexer scores over the cached keys; attention finally
reads everything back from the caches. Every key a query sees therefore went
through its cache format exactly once, which is what the full-sequence
reference does with quantise-dequantise at the same points.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear

from deepinfer_vllm.attention_backends.cache_layout import layer_caches
from deepinfer_vllm.attention_backends.kernel_select import choose_attention_kernels
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
from deepinfer_vllm.model_executor.layers.step_state import PagedView, RingView, StepState
from deepinfer_vllm.model_executor.layers.weights import (
    V41Norm,
    V41RowParallelLinear,
    fused_kernels,
    held,
    linear,
)
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.compressor import pool_ratio2
from deepinfer_vllm.ops.indexer import candidate_block_mask, index_scores, select_topk
from deepinfer_vllm.ops.numerics import acc_dtype
from deepinfer_vllm.ops.rope import apply_rope_tail
from deepinfer_vllm.ops.sparse_attention import sparse_attention


def _kernel_path():
    """The Triton path's module, imported on first use (Triton is a CUDA-only dependency)."""
    from deepinfer_vllm.model_executor.layers import v41_kernel_path

    return v41_kernel_path


def _replicated(in_f: int, out_f: int, quant_config, prefix: str) -> ReplicatedLinear:
    return ReplicatedLinear(
        in_f, out_f, bias=False, quant_config=quant_config, prefix=prefix, return_bias=False
    )


class Compressor(nn.Module):
    """A KV source's compressor (ratio 2 has the gate); replicated on every TP rank."""

    def __init__(self, arch: V41Arch, ratio: int, quant_config, prefix: str):
        super().__init__()
        self.wkv = _replicated(arch.hidden_size, arch.head_dim, quant_config, f"{prefix}.wkv")
        self.wgate = None
        if ratio == 2:
            self.wgate = _replicated(arch.hidden_size, arch.head_dim, quant_config, f"{prefix}.wgate")
        self.norm = V41Norm(arch.head_dim, arch.rms_norm_eps)


class Indexer(nn.Module):
    """Indexer projections, replicated on every TP rank; ``wk``/``k_norm`` only on KV sources."""

    def __init__(self, arch: V41Arch, owns_keys: bool, quant_config, prefix: str):
        super().__init__()
        a, qc = arch, quant_config
        self.wq_b = _replicated(a.q_lora_rank, a.index_n_heads * a.index_head_dim, qc, f"{prefix}.wq_b")
        self.weights_proj = _replicated(a.hidden_size, a.index_n_heads, qc, f"{prefix}.weights_proj")
        self.wk = _replicated(a.head_dim, a.index_head_dim, qc, f"{prefix}.wk") if owns_keys else None
        self.k_norm = V41Norm(a.index_head_dim, a.rms_norm_eps) if owns_keys else None


class V41Attention(nn.Module):
    """Window + compressed sparse attention with sinks (spec §6).

    Under tensor parallelism each rank computes ``num_heads / tp`` query heads
    and ``o_groups / tp`` output groups; the latent KV head, its caches, the
    compressor and the indexer are the same on every rank, and ``wo_b`` sums
    the ranks' partial outputs.
    """

    def __init__(
        self,
        arch: V41Arch,
        role: LayerRole,
        rope_cache: torch.Tensor,
        prefix: str,
        cache_layers: dict[str, V41CacheLayer],
        quant_config,
        layout: ParallelLayout,
    ):
        super().__init__()
        self.arch = arch
        self.role = role
        self.prefix = prefix
        self.register_buffer("rope_cache", rope_cache, persistent=False)
        a = arch
        tp = layout.tp_size
        self.num_local_heads = a.num_heads // tp
        self.num_local_groups = a.o_groups // tp
        self.head_start = layout.tp_rank * self.num_local_heads
        self.wq_a = _replicated(a.hidden_size, a.q_lora_rank, quant_config, f"{prefix}.wq_a")
        self.q_norm = V41Norm(a.q_lora_rank, a.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(
            a.q_lora_rank,
            a.num_heads * a.head_dim,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wq_b",
            return_bias=False,
        )
        self.wkv = _replicated(a.hidden_size, a.head_dim, quant_config, f"{prefix}.wkv")
        self.kv_norm = V41Norm(a.head_dim, a.rms_norm_eps)
        # Grouped output projection: each output group reads its own heads.
        self.wo_a = ColumnParallelLinear(
            a.num_heads * a.head_dim // a.o_groups,
            a.o_groups * a.o_lora_rank,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.wo_a",
            return_bias=False,
        )
        self.wo_b = V41RowParallelLinear(
            a.o_groups * a.o_lora_rank, a.hidden_size, quant_config=quant_config, prefix=f"{prefix}.wo_b"
        )
        self.attn_sink = held(self.num_local_heads, dtype=torch.float32)
        self.attn_sink.weight_loader = self._load_sink
        self.compressor = (
            Compressor(a, role.ratio, quant_config, f"{prefix}.compressor") if role.is_kv_source else None
        )
        self.indexer = (
            Indexer(a, role.is_kv_source, quant_config, f"{prefix}.indexer") if role.is_index_source else None
        )

        # Caches: this layer's own window; KV sources own the compressed and
        # index caches (+ the ratio-2 ring); other layers read their source's.
        self.compressed_cache: V41CacheLayer | None = None
        self.index_cache: V41CacheLayer | None = None
        self.ring_cache: V41CacheLayer | None = None
        spec_tokens = get_current_vllm_config().num_speculative_tokens
        for decl in layer_caches(arch, role, prefix, spec_tokens):
            layer = V41CacheLayer(decl)
            cache_layers[decl.name] = layer
            setattr(self, f"{decl.kind}_cache", layer)
        # The KV source's attention (possibly this layer), bound by the model
        # after construction; kept out of the module tree (it is not a child).
        self._kv_source: list[V41Attention] = []
        # "torch" (the reference path) or "triton"; chosen on the first forward.
        self._kernels: str | None = None

    def _load_sink(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[self.head_start : self.head_start + self.num_local_heads])

    def bind_kv_source(self, source: "V41Attention") -> None:
        self._kv_source[:] = [source]

    @property
    def kv_source(self) -> "V41Attention":
        return self._kv_source[0]

    # ------------------------------------------------------------------ helpers
    def _rope(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        where = fused_kernels(x)
        if where != "torch" and positions.shape == x.shape[:1] and x.dim() in (2, 3):
            if where == "npu":
                from deepinfer_vllm.ops.npu import rope_tail
            else:
                from deepinfer_vllm.ops.triton.rope import rope_tail

            return rope_tail(x, positions, self.rope_cache, inverse)
        return apply_rope_tail(x, positions, self.rope_cache, inverse=inverse)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: StepState, write_compressed: bool = True) -> torch.Tensor:
        a = self.arch
        T = x.shape[0]
        pos = state.positions

        c_q = self.q_norm(self.wq_a(x))
        q = self.wq_b(c_q).view(T, self.num_local_heads, a.head_dim)
        q = self._rope(q, pos)
        kv = self.kv_norm(self.wkv(x))
        kv = self._rope(kv, pos)

        if not state.has_caches:
            # Profiling / dummy run: each token attends to its own key only.
            ones = torch.ones(T, 1, dtype=torch.bool, device=x.device)
            o = sparse_attention(q, kv.unsqueeze(1), ones, self.attn_sink, a.head_dim**-0.5)
        elif self._use_kernels(x):
            o = self._attend_with_kernels(x, c_q, q, kv, state, write_compressed)
        else:
            o = self._attend_reference(x, c_q, q, kv, state, write_compressed)
        o = self._rope(o, pos, inverse=True)
        return self.wo_b(self._grouped_wo_a(o.reshape(T, self.num_local_groups, -1)))

    def _grouped_wo_a(self, group_in: torch.Tensor) -> torch.Tensor:
        """Output group ``g`` of this rank reads its own heads: ``z_g = x_g @ W_g.T`` with
        ``W_g`` rows ``g * o_lora_rank ...`` of ``wo_a`` (one block-diagonal GEMM)."""
        T = group_in.shape[0]
        return self.wo_a.quant_method.apply_grouped(self.wo_a, group_in).reshape(T, -1)

    def _attend_reference(self, x, c_q, q, kv, state: StepState, write_compressed: bool) -> torch.Tensor:
        """Cache writes, selection and attention with the PyTorch reference operators."""
        a = self.arch
        dtype = x.dtype
        pos = state.positions
        req = state.token_req
        window = PagedView(self.window_cache, state)
        window_lo = self._window_lower_bound(state)
        write_mask = pos >= window_lo
        window.write(req[write_mask], pos[write_mask], kv[write_mask])

        if self.role.is_kv_source and write_compressed:
            self.write_compressed(x, state)
        topk = None
        if self.role.ratio > 0:
            if self.role.is_index_source:
                topk = self._select(x, c_q, state)
                state.topk[self.role.layer_id] = topk
            else:
                topk = state.topk[self.role.index_source]

        keys, valid = self._gather_keys(state, window, window_lo, topk, dtype)
        return sparse_attention(q, keys, valid, self.attn_sink, a.head_dim**-0.5)

    def _attend_with_kernels(self, x, c_q, q, kv, state: StepState, write_compressed: bool) -> torch.Tensor:
        """The same step on the Triton kernels (CUDA path): quantise-and-store,
        indexer scores + top-k over the paged index keys, sparse attention
        straight from the paged records."""
        fast = _kernel_path()
        pos = state.positions
        req = state.token_req
        window = PagedView(self.window_cache, state)
        window_lo = self._window_lower_bound(state)
        fast.store(window, req, pos, kv, keep=pos >= window_lo)
        if self.role.is_kv_source and write_compressed:
            self.write_compressed(x, state)
        topk = None
        if self.role.ratio > 0:
            if self.role.is_index_source:
                topk = fast.select(self, x, c_q, state)
                state.topk[self.role.layer_id] = topk
            else:
                topk = state.topk[self.role.index_source]
        return fast.attend(self, q, state, window, window_lo, topk)

    def _window_lower_bound(self, state: StepState) -> torch.Tensor:
        """Lowest position whose window KV this layer keeps, per token."""
        if state.decoder_window_start is not None and self.role.is_decoder:
            return state.decoder_window_start
        return torch.zeros_like(state.positions)

    # ------------------------------------------------------------- compressor
    def _use_kernels(self, x: torch.Tensor) -> bool:
        if self._kernels is None:
            self._kernels = choose_attention_kernels(x.device)
        return self._kernels == "triton"

    def write_compressed(self, x: torch.Tensor, state: StepState) -> None:
        """Compressed KV + index key of every group completed in this step.

        The reference path computes the groups the step closes; the kernel path
        computes a candidate group for every token and stores only the closed
        ones (slot -1 for the others), so its sizes never depend on device
        values (no host synchronisation, capturable in a CUDA graph).
        """
        a = self.arch
        r = self.role.ratio
        comp = self.compressor
        kernels = self._use_kernels(x)
        dev = x.device
        pos = state.positions
        req = state.token_req
        keep = None
        if r == 1:
            lat = linear(comp.wkv, x)
            entry_req, entry = req, pos
        else:
            u = linear(comp.wkv, x, torch.float32)
            g = linear(comp.wgate, x, torch.float32)
            rows = torch.cat([u, g], dim=-1)
            ring = RingView(self.ring_cache, state)
            # A pair's first token is in this step's rows, or (pair split
            # across steps) in the ring, read before this step overwrites it.
            prev = torch.arange(pos.shape[0], device=dev) - 1
            in_step = (pos - 1) >= state.context_lens[req]
            first_rows = torch.where(
                in_step.unsqueeze(1), rows[prev.clamp_min(0)], ring.read(req, (pos - 1).clamp_min(0))
            )
            if 0 < state.max_query_len <= ring.capacity:
                ring.write(req, pos, rows)  # no request has more rows than the ring
            else:
                # Keep only each request's last rows: ring slots are position
                # modulo its capacity, so older rows of a long chunk would collide.
                recent = pos >= state.seq_lens[req] - ring.capacity
                ring.write(req[recent], pos[recent], rows[recent])
            closes = (pos % 2) == 1
            if kernels:
                lat = _kernel_path().pool_pairs(first_rows.contiguous(), rows.contiguous(), x.dtype)
                entry_req, entry, keep = req, pos // 2, closes
            else:
                entry_req = req[closes]
                if entry_req.numel() == 0:
                    return
                pair_u = torch.stack([first_rows[closes, : a.head_dim], u[closes]], dim=1)
                pair_g = torch.stack([first_rows[closes, a.head_dim :], g[closes]], dim=1)
                lat = pool_ratio2(pair_u.flatten(0, 1), pair_g.flatten(0, 1), acc_dtype(x.dtype)).to(x.dtype)
                entry = pos[closes] // 2
        lat = comp.norm(lat)
        first_pos = entry * r
        idx = self.indexer
        k = idx.k_norm(linear(idx.wk, lat))
        for cache, rows_out in ((self.compressed_cache, lat), (self.index_cache, k)):
            view = PagedView(cache, state)
            rotated = self._rope(rows_out, first_pos)
            if kernels:
                _kernel_path().store(view, entry_req, entry, rotated, keep=keep)
            else:
                view.write(entry_req, entry, rotated)

    # ---------------------------------------------------------------- indexer
    def _select(self, x: torch.Tensor, c_q: torch.Tensor, state: StepState) -> torch.Tensor:
        """Top-k compressed entries of every token (-1 = none), spec §6.6."""
        a = self.arch
        r = self.role.ratio
        T = x.shape[0]
        idx = self.indexer
        qi = linear(idx.wq_b, c_q).view(T, a.index_n_heads, a.index_head_dim)
        qi = quant.mxfp4_qdq(self._rope(qi, state.positions))
        # DeepInfer drops the 1/sqrt(dk * heads) weight scale: it is 2^-6 for
        # Flash's shapes, so dropping it cannot change any comparison.
        w = linear(idx.weights_proj, x)
        visible = (state.positions + 1) // r
        source = self.kv_source
        keys_view = PagedView(source.index_cache, state)
        topk = torch.full((T, a.index_topk), -1, dtype=torch.int64, device=x.device)
        is_candidate_source = self.role.is_candidate_source
        use_candidates = self.role.uses_candidates
        for row in range(state.num_reqs):
            tok = (state.token_req == row).nonzero(as_tuple=True)[0]
            if tok.numel() == 0:
                continue
            n = int(visible[tok].max())
            if n == 0:
                continue
            entries = torch.arange(n, device=x.device)
            keys = keys_view.read(torch.full_like(entries, row), entries, x.dtype)
            scores = index_scores(qi[tok], w[tok], keys, visible[tok])
            if is_candidate_source:
                state.candidates[row] = candidate_block_mask(
                    scores, visible[tok], a.candidate_block_size, a.candidate_topk_blocks
                )
            elif use_candidates:
                scores = scores.masked_fill(~state.candidates[row], float("-inf"))
            topk[tok] = select_topk(scores, a.index_topk)
        return topk

    # -------------------------------------------------------------- attention
    def _gather_keys(
        self,
        state: StepState,
        window: PagedView,
        window_lo: torch.Tensor,
        topk: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (= values) each token attends to and their validity mask."""
        W = self.arch.sliding_window
        pos = state.positions
        req = state.token_req
        offs = torch.arange(W, dtype=torch.int64, device=pos.device)
        key_pos = pos.unsqueeze(1) - (W - 1) + offs
        valid = key_pos >= window_lo.unsqueeze(1)
        safe_pos = torch.where(valid, key_pos, pos.unsqueeze(1))
        keys = window.read(req.unsqueeze(1).expand_as(safe_pos), safe_pos, dtype)
        # Slots that were never written may hold any bytes (even NaN codes);
        # a masked key must contribute exactly nothing.
        keys = keys.masked_fill(~valid.unsqueeze(-1), 0.0)
        if topk is None:
            return keys, valid
        source = self.kv_source
        comp_valid = topk >= 0
        safe_entry = torch.where(comp_valid, topk, torch.zeros_like(topk))
        comp = PagedView(source.compressed_cache, state).read(
            req.unsqueeze(1).expand_as(safe_entry), safe_entry, dtype
        )
        comp = comp.masked_fill(~comp_valid.unsqueeze(-1), 0.0)
        return torch.cat([keys, comp], dim=1), torch.cat([valid, comp_valid], dim=1)
