"""DeepInfer's MLA/SWA attention backend for DeepSeek-V4.1 on vLLM.

V4.1 keeps four kinds of per-layer state, each paged by vLLM's KV cache manager
with its own spec (so prefix caching, chunked prefill and preemption come from
vLLM itself):

* window KV of every layer: MXFP8 records, a sliding-window spec (pages that
  fall out of the window are freed); with vLLM's SWA bounded replay (default)
  kept out of prefix caching, a prefix hit recomputing the hit's last window,
  otherwise cached with the prefix (a hit keeps the last window);
* compressed KV of KV-source layers: NVFP4 records, one per ``ratio`` tokens;
* index keys of KV-source layers: MXFP4 records, one per ``ratio`` tokens;
* the ratio-2 compressor ring: one fp32 ``[u | g]`` row per recent token, so a
  pair split across two steps can still be pooled.

The model's attention code reads and writes these records itself (see
``paged_records``); the backend only declares the specs and builds the
per-step metadata every layer shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheSpec

from deepinfer_vllm.attention_backends.cache_layout import CacheDecl, swa_bounded_replay

BACKEND_NAME = "DEEPINFER_V41_MLA_SWA"


@dataclass
class V41StepMetadata:
    """Per-step metadata of one KV cache group.

    Tensors live where vLLM's common metadata keeps its device tensors (the
    model's device), so a device step reads them without host copies; the
    ints are host values vLLM already has (no synchronisation to get them).
    """

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64, tokens in the request after this step
    context_lens: torch.Tensor  # [num_reqs] int64, tokens already in the cache
    positions: torch.Tensor  # [num_actual_tokens] int64
    token_req: torch.Tensor  # [num_actual_tokens] int64, request row of each token
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    block_size: int  # tokens covered by one block of this group
    max_seq_len: int  # host upper bound of ``seq_lens`` (static sizes without a sync)
    max_query_len: int  # host upper bound of any request's tokens in this step
    # Filled by DeepInfer's runner (vLLM's common metadata does not carry them), None elsewhere:
    # [num_reqs] prompt length of each request (prefill truncation's ``data_len``);
    prompt_lens: torch.Tensor | None = None
    # [num_reqs] bool, requests whose every prompt row is computed (prompt logprobs): no truncation;
    full_prefill: torch.Tensor | None = None
    # [num_reqs] first position each request holds window KV from (SWA bounded replay: a
    # prefix hit's replay start, 0 for the others); None when no request of the step replays.
    replay_start: torch.Tensor | None = None
    # Host: whether any token of the step lies below its request's prompt length (False: prefill
    # truncation has nothing to clip in this step). True where no runner says otherwise.
    prompt_rows: bool = True
    # Host int64 [num_actual_tokens, max_ngram]: raw ids at ``p - s`` (-1 before the start), from
    # which the host hashes Engram rows it keeps in host memory (``model_executor.engram_host``).
    engram_windows: torch.Tensor | None = None


class V41MetadataBuilder(AttentionMetadataBuilder[V41StepMetadata]):
    """Turns vLLM's common metadata into :class:`V41StepMetadata` with device ops only.

    Its tensors are views of buffers the builder keeps for its lifetime (the
    runner's own inputs are persistent buffers too), so a step captured in a
    CUDA graph reads each later step's values from the same addresses.
    Uniform single-token decode batches may be captured: a captured step's
    sizes use ``max_seq_len = max_model_len``, a bound for every replay.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        sched = vllm_config.scheduler_config
        self.max_model_len = vllm_config.model_config.max_model_len
        reqs, tokens = sched.max_num_seqs, sched.max_num_batched_tokens
        i64 = {"dtype": torch.int64, "device": device}
        self._qsl = torch.zeros(reqs + 1, **i64)
        self._seq_lens = torch.zeros(reqs, **i64)
        self._context_lens = torch.zeros(reqs, **i64)
        self._token_req = torch.zeros(tokens, **i64)
        self._arange = torch.arange(tokens, **i64)
        self._block_table: torch.Tensor | None = None  # sized by the runner's table on first use

    def _buffer(self, name: str, n: int, src_rows: int) -> torch.Tensor:
        buf = getattr(self, name)
        if n > buf.shape[0]:
            raise ValueError(
                f"{BACKEND_NAME}: a step of {src_rows} requests/tokens exceeds the builder's buffers "
                f"({buf.shape[0]}; max_num_seqs / max_num_batched_tokens)"
            )
        return buf[:n]

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> V41StepMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        num_tokens = cm.num_actual_tokens
        qsl = self._buffer("_qsl", num_reqs + 1, num_reqs)
        qsl.copy_(cm.query_start_loc[: num_reqs + 1])
        seq_lens = self._buffer("_seq_lens", num_reqs, num_reqs)
        seq_lens.copy_(cm.seq_lens[:num_reqs])
        context_lens = self._buffer("_context_lens", num_reqs, num_reqs)
        torch.sub(seq_lens, qsl[1:] - qsl[:-1], out=context_lens)
        # Request row of each token: how many requests end at or before it. Tokens past the
        # last request's (a padded CUDA-graph batch) go to the last row, a padding request
        # whose block-table row is vLLM's null block: their writes land there.
        self._check_padding(cm)
        token_req = self._buffer("_token_req", num_tokens, num_tokens)
        torch.searchsorted(qsl[1:], self._arange[:num_tokens], right=True, out=token_req)
        token_req.clamp_(max=max(num_reqs - 1, 0))
        positions = cm.positions
        assert positions is not None, "V4.1 needs token positions in the metadata"
        table = cm.block_table_tensor
        if self._block_table is None or self._block_table.shape[1] < table.shape[1]:
            rows = max(table.shape[0], self._seq_lens.shape[0])
            self._block_table = torch.zeros(rows, table.shape[1], dtype=torch.int64, device=table.device)
        block_table = self._buffer("_block_table", num_reqs, num_reqs)[:, : table.shape[1]]
        block_table.copy_(table[:num_reqs])
        return V41StepMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=context_lens,
            positions=positions[:num_tokens].to(torch.int64),
            token_req=token_req,
            block_table=block_table,
            block_size=self.kv_cache_spec.block_size,
            max_seq_len=int(cm.max_seq_len),
            max_query_len=int(cm.max_query_len),
        )

    @staticmethod
    def _check_padding(cm: CommonAttentionMetadata) -> None:
        """Padding tokens must belong to a padding request (vLLM pads uniform decode batches
        so); otherwise they would write into a real request's pages. Host values only."""
        real = int(cm.query_start_loc_cpu[cm.num_reqs])
        if cm.num_actual_tokens <= real:
            return
        bound = cm.seq_lens_cpu_upper_bound
        if bound is None or int(bound[cm.num_reqs - 1]) != 0:
            raise NotImplementedError(
                f"{BACKEND_NAME}: a batch padded to {cm.num_actual_tokens} tokens ({real} scheduled) "
                "without a padding request; V4.1 supports CUDA graphs of uniform decode batches only"
            )

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> V41StepMetadata:
        meta = self.build(0, common_attn_metadata)
        meta.max_seq_len = self.max_model_len  # every replay's sequences fit
        return meta


class DeepInferV41Backend(AttentionBackend):
    """Backend of every V4.1 cache layer; attention math lives in the model."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            "V4.1 attention runs inside the model's attention module; "
            "this backend has no separate impl class."
        )

    @staticmethod
    def get_builder_cls() -> type[V41MetadataBuilder]:
        return V41MetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Block-outermost: vLLM packs the pages of all V4.1 caches of a block
        # side by side (block stride = sum of their pages), so records of
        # different sizes need no padding to a common page size.
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.BLNHC,)

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True


class V41CacheLayer(nn.Module, AttentionLayerBase):
    """One paged cache of a V4.1 model (see ``cache_layout``), registered with vLLM.

    Pages keep their real record sizes: the backend asks for a block-outermost
    layout, in which vLLM packs the different pages of a block side by side.
    """

    def __init__(self, decl: CacheDecl):
        super().__init__()
        self.decl = decl
        self.prefix = decl.name
        self.kind = decl.kind
        self.record = decl.record
        self.ratio = decl.ratio
        self.kv_cache = torch.tensor([])
        ctx = get_current_vllm_config().compilation_config.static_forward_context
        if self.prefix in ctx:
            raise ValueError(f"Duplicate layer name: {self.prefix}")
        ctx[self.prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return DeepInferV41Backend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return self.decl.spec(
            vllm_config.cache_config.block_size, bounded_replay=swa_bounded_replay(vllm_config)
        )
