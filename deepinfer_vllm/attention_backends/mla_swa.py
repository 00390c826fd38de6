"""DeepInfer's MLA/SWA attention backend for DeepSeek-V4.1 on vLLM.

V4.1 keeps four kinds of per-layer state, each paged by vLLM's KV cache manager
with its own spec (so prefix caching, chunked prefill and preemption come from
vLLM itself):

* window KV of every layer: MXFP8 records, a sliding-window spec (pages that
  fall out of the window are freed, prefix hits keep the last window);
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

from deepinfer_vllm.attention_backends.cache_layout import CacheDecl

BACKEND_NAME = "DEEPINFER_V41_MLA_SWA"


@dataclass
class V41StepMetadata:
    """Per-step metadata of one KV cache group (host tensors on CPU)."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int64
    seq_lens: torch.Tensor  # [num_reqs] int64, tokens in the request after this step
    context_lens: torch.Tensor  # [num_reqs] int64, tokens already in the cache
    positions: torch.Tensor  # [num_actual_tokens] int64
    token_req: torch.Tensor  # [num_actual_tokens] int64, request row of each token
    block_table: torch.Tensor  # [num_reqs, max_blocks] int64
    block_size: int  # tokens covered by one block of this group
    # [num_reqs] prompt length of each request; filled by DeepInfer's runner
    # (vLLM's common metadata does not carry it), None elsewhere.
    prompt_lens: torch.Tensor | None = None


class V41MetadataBuilder(AttentionMetadataBuilder[V41StepMetadata]):
    """Turns vLLM's common metadata into :class:`V41StepMetadata`."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> V41StepMetadata:
        cm = common_attn_metadata
        num_reqs = cm.num_reqs
        num_tokens = cm.num_actual_tokens
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].to(torch.int64)
        seq_lens = cm.seq_lens[:num_reqs].to("cpu", torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        positions = cm.positions
        assert positions is not None, "V4.1 needs token positions in the metadata"
        token_req = torch.repeat_interleave(
            torch.arange(num_reqs, dtype=torch.int64), query_lens
        )
        return V41StepMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            context_lens=seq_lens - query_lens,
            positions=positions[:num_tokens].to(torch.int64),
            token_req=token_req,
            block_table=cm.block_table_tensor[:num_reqs].to(torch.int64),
            block_size=self.kv_cache_spec.block_size,
        )


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
        return self.decl.spec(vllm_config.cache_config.block_size)
