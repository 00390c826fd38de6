"""CSA2 attention of one V4.1 layer, over vLLM-paged caches.

Order inside a step (prefill chunk or decode, mixed in one batch):
window KV of every token is quantised and written first, then (KV sources)
the compressed KV and index keys of every group the step completes, then
(index sources) the indexer scores over the cached keys; attention finally
reads everything back from the caches. Every key a query sees therefore went
through its cache format exactly once, which is what the full-sequence
reference does with quantise-dequantise at the same points.

The step is one path over five operators with shared signatures (``ops.dispatch.KernelOp``),
each built once in ``__init__`` for the device and dtype the model is built with:
``StoreRecords`` (quantise-and-store into a paged cache), ``PoolPairs`` (the ratio-2
compressor's gated pooling), ``IndexerTopK`` (indexer scores and top-k over the paged index
keys), ``PagedSparseAttention`` (attention read from the paged records) and ``RopeTail``.
Their PyTorch references run everywhere and give the reference's bits; their Triton
implementations (CUDA) take sizes from host values only, so a decode step never waits for the
host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear

from deepinfer_vllm.attention_backends.cache_layout import layer_caches
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.model_executor.layers.linear import V41RowParallelLinear, linear
from deepinfer_vllm.model_executor.layers.norm import V41Norm
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
from deepinfer_vllm.model_executor.layers.params import built_for, held
from deepinfer_vllm.model_executor.layers.step_state import PagedView, RingView, StepState
from deepinfer_vllm.ops.attention_ops import IndexerTopK, PagedSparseAttention, PoolPairs, StoreRecords
from deepinfer_vllm.ops.rope import RopeTail
from deepinfer_vllm.ops.shared_input import shared_inputs
from deepinfer_vllm.ops.sparse_attention import sparse_attention


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
    """One V4.1 attention layer: MQA over the last ``sliding_window`` tokens' keys plus, on
    compressed layers, the ``index_topk`` compressed entries its indexer selects; keys are
    values, and a learned per-head sink logit joins the softmax denominator.

    Under tensor parallelism each rank computes ``num_heads / tp`` query heads
    and ``o_groups / tp`` output groups; the latent KV head, its caches, the
    compressor and the indexer are the same on every rank, and ``wo_b`` sums
    the ranks' partial outputs.

    ``attention_backend`` is the implementation the attention operators run
    (``"torch"``, ``"triton"``; ``DEEPINFER_ATTENTION_KERNELS``), chosen once here.
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

        # The operators, chosen once for the device and dtype the model is built with.
        device, dtype = built_for()
        self.rope_tail = RopeTail(device, dtype)
        self.store_records = StoreRecords(device, dtype)
        self.paged_attention = PagedSparseAttention(device, dtype)
        self.pool_pairs = PoolPairs(device, dtype) if role.is_kv_source and role.ratio == 2 else None
        self.indexer_topk = IndexerTopK(device, dtype) if role.is_index_source else None
        self.attention_backend = self.paged_attention.backend

    def _load_sink(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[self.head_start : self.head_start + self.num_local_heads])

    def bind_kv_source(self, source: V41Attention) -> None:
        self._kv_source[:] = [source]

    @property
    def kv_source(self) -> V41Attention:
        return self._kv_source[0]

    # ------------------------------------------------------------------ helpers
    def _rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inverse: bool = False,
        qdq: str | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        return self.rope_tail(x, positions, self.rope_cache, inverse, qdq, in_place)

    def _store(
        self,
        view: PagedView,
        req: torch.Tensor,
        entry: torch.Tensor,
        rows: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> None:
        """Quantise ``rows`` and store them as entries ``entry`` of request rows ``req``; rows
        where ``keep`` is False are skipped."""
        if entry.numel() == 0:
            return
        layer = view.layer
        self.store_records(layer.kv_cache, layer.record, view.meta.block_table, req, entry, rows, keep)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, state: StepState, write_compressed: bool = True) -> torch.Tensor:
        a = self.arch
        T = x.shape[0]
        pos = state.positions

        c_q, kv = self._latents(x)
        # wq_b and the indexer's wq_b (in _select) multiply c_q: a GEMM kernel's preparation of it
        # (the Gluon GEMMs' rewrite, the MXFP8 round trip) is made once.
        with shared_inputs(c_q):
            q = self.wq_b(c_q).view(T, self.num_local_heads, a.head_dim)
            q = self._rope(q, pos, in_place=True)  # q, kv, o and the index query are this layer's own
            kv = self._rope(kv, pos, in_place=True)

            if state.has_caches:
                o = self._attend(x, c_q, q, kv, state, write_compressed)
            else:
                # Profiling / dummy run: each token attends to its own key only.
                ones = torch.ones(T, 1, dtype=torch.bool, device=x.device)
                o = sparse_attention(q, kv.unsqueeze(1), ones, self.attn_sink, a.head_dim**-0.5)
        o = self._rope(o, pos, inverse=True, in_place=True)
        return self.wo_b(self._grouped_wo_a(o.reshape(T, self.num_local_groups, -1)))

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed query latent ``c_q`` and the normed (unrotated) KV row of ``x``; ``wq_a`` and
        ``wkv`` share a GEMM kernel's preparation of ``x`` (``ops.shared_input``)."""
        with shared_inputs(x):
            return self.q_norm(self.wq_a(x)), self.kv_norm(self.wkv(x))

    def _grouped_wo_a(self, group_in: torch.Tensor) -> torch.Tensor:
        """Output group ``g`` of this rank reads its own heads: ``z_g = x_g @ W_g.T`` with
        ``W_g`` rows ``g * o_lora_rank ...`` of ``wo_a`` (one block-diagonal GEMM)."""
        T = group_in.shape[0]
        return self.wo_a.quant_method.apply_grouped(self.wo_a, group_in).reshape(T, -1)

    def _attend(self, x, c_q, q, kv, state: StepState, write_compressed: bool) -> torch.Tensor:
        """Cache writes, selection and attention over the paged records."""
        a = self.arch
        pos = state.positions
        req = state.token_req
        window = PagedView(self.window_cache, state)
        bound = self._window_lower_bound(state)
        self._store(window, req, pos, kv, keep=None if bound is None else pos >= bound)
        window_lo = state.no_window_floor() if bound is None else bound
        if self.role.is_kv_source and write_compressed:
            self.write_compressed(x, state)
        comp = {}
        if self.role.ratio > 0:
            if self.role.is_index_source:
                topk = self._select(x, c_q, state)
                state.topk[self.role.layer_id] = topk
            else:
                topk = state.topk[self.role.index_source]
            compressed = PagedView(self.kv_source.compressed_cache, state)
            comp = {
                "comp_cache": compressed.layer.kv_cache,
                "comp_block_table": compressed.meta.block_table,
                "comp_block_size": compressed.meta.block_size,
                "comp_ratio": compressed.layer.ratio,
                "topk": topk,
            }
        return self.paged_attention(
            q,
            window.layer.kv_cache,
            window.meta.block_table,
            window.meta.block_size,
            pos,
            window_lo,
            req,
            a.sliding_window,
            self.attn_sink,
            a.head_dim**-0.5,
            **comp,
        )

    def _window_lower_bound(self, state: StepState) -> torch.Tensor | None:
        """Lowest position whose window KV this layer keeps, per token (None: no bound): a
        replayed prefix hit's replay start in every layer (no window KV exists below it), and
        in decoder layers also prefill truncation's kept range."""
        lo = state.window_start
        if state.decoder_window_start is not None and self.role.is_decoder:
            dec = state.decoder_window_start
            lo = dec if lo is None else torch.maximum(lo, dec)
        return lo

    # ------------------------------------------------------------- compressor
    def write_compressed(self, x: torch.Tensor, state: StepState) -> None:
        """Compressed KV + index key of every group completed in this step.

        Ratio 2 pools the two rows of each pair a token closes (``PoolPairs``, which also keeps
        the compressor ring of rows whose pair closes in a later step): the reference pools the
        closed pairs only, the Triton kernel pools a candidate for every token and stores only
        the closed ones, so its sizes never depend on device values (no host synchronisation,
        capturable in a CUDA graph).
        """
        r = self.role.ratio
        comp = self.compressor
        pos = state.positions
        req = state.token_req
        keep = None
        if r == 1:
            lat = linear(comp.wkv, x)
            entry_req, entry = req, pos
        else:
            u = linear(comp.wkv, x, torch.float32)
            g = linear(comp.wgate, x, torch.float32)
            ring = RingView(self.ring_cache, state)
            lat, entry_req, entry, keep = self.pool_pairs(
                u, g, ring.rows, ring.meta.block_table, req, pos, state.context_lens, state.seq_lens, x.dtype
            )
            if lat.shape[0] == 0:
                return
        if state.replay_start is not None:
            keep = self._not_replayed(state, entry_req, entry, keep)
        lat = comp.norm(lat)
        first_pos = entry * r
        idx = self.indexer
        k = idx.k_norm(linear(idx.wk, lat))
        for cache, rows_out in ((self.compressed_cache, lat), (self.index_cache, k)):
            self._store(PagedView(cache, state), entry_req, entry, self._rope(rows_out, first_pos), keep)

    def _not_replayed(
        self, state: StepState, entry_req: torch.Tensor, entry: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """``keep`` without the entries a prefix hit's replay completes: those closed at
        positions ``[replay_start, replay_start + W)`` stay in the cache as first computed
        (docs/design-notes.md, "Window KV out of the prefix cache")."""
        start = state.replay_start[entry_req]
        close = entry * self.role.ratio + (self.role.ratio - 1)
        replayed = (start > 0) & (close >= start) & (close < start + self.arch.sliding_window)
        return ~replayed if keep is None else keep & ~replayed

    # ---------------------------------------------------------------- indexer
    def _select(self, x: torch.Tensor, c_q: torch.Tensor, state: StepState) -> torch.Tensor:
        """Top-k compressed entries of every token (-1 = none): the lightning indexer's
        ``sum_h w_h relu(q_h . k_j)`` over the KV source's cached index keys ``k_j`` that the
        token sees; the candidate source also publishes its kept candidate blocks, to which
        the reindex layers of its KV segment restrict their selection."""
        a = self.arch
        r = self.role.ratio
        T = x.shape[0]
        idx = self.indexer
        pos = state.positions
        qi = linear(idx.wq_b, c_q).view(T, a.index_n_heads, a.index_head_dim)
        qi = self._rope(qi, pos, qdq="mxfp4", in_place=True)  # rotated, then its MXFP4 round trip
        # DeepInfer drops the 1/sqrt(dk * heads) weight scale: it is 2^-6 for
        # Flash's shapes, so dropping it cannot change any comparison.
        w = linear(idx.weights_proj, x)
        keys = PagedView(self.kv_source.index_cache, state)
        topk, kept = self.indexer_topk(
            qi,
            w,
            keys.layer.kv_cache,
            keys.meta.block_table,
            state.token_req,
            state.entries_closed(r),
            ratio=keys.layer.ratio,
            block_size=keys.meta.block_size,
            topk=a.index_topk,
            candidates=state.kept_blocks if self.role.uses_candidates else None,
            candidate_source=self.role.is_candidate_source,
            candidate_block_size=a.candidate_block_size,
            candidate_topk_blocks=a.candidate_topk_blocks,
            out_dtype=x.dtype,
            # A host bound on every token's visible entries: sizes without a sync.
            max_visible=state.max_seq_len // r if state.max_seq_len else None,
        )
        if kept is not None:
            state.kept_blocks = kept
        return topk
