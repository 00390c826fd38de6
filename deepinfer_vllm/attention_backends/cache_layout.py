"""Which paged caches a V4.1 model keeps, and the vLLM KV cache spec of each.

One declaration per cache, derived from the layer roles alone, so the model
builds its cache layers from it and tools can size the caches of any config
(e.g. the real Flash one) without building the model.

SWA bounded replay (vLLM's ``cache_config.swa_bounded_replay``, on by default;
docs/design-notes.md, "Window KV out of the prefix cache"): the window caches
(backbone and DSpark) are then vLLM's ``SlidingWindowMLASpec(bounded_replay=True)``,
kept out of prefix caching with a replay window of ``sliding_window`` tokens, so
window memory is held by running requests only and a prefix hit recomputes the
hit's last window. The Engram token history then keeps every id, as a
full-attention cache (4 B per token): the replayed rows find their look-back in
the prefix's cached blocks, and a hit may end at any block boundary (vLLM keeps a
sliding-window group's blocks only where a hit is expected: prompt ends, shared
prefixes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.configs.checkpoint import dspark_prefix
from deepinfer_vllm.ops.paged_records import RecordFormat

WINDOW_FORMAT = "mxfp8"
COMPRESSED_FORMAT = "nvfp4"
INDEX_FORMAT = "mxfp4"

# Rows kept per request in the ratio-2 compressor ring without speculation. A
# pair is pooled when its second token arrives; the first may have come one
# step earlier, so two rows suffice; four leave room for one rejected draft.
COMPRESSOR_RING_ROWS = 4


def compressor_ring_rows(num_speculative_tokens: int = 0) -> int:
    """Ring rows per request: a verify step of ``1 + k`` tokens whose drafts are all
    rejected resumes one position after its first row, which may be the open pair's
    first token, ``k + 1`` rows back from the step's end. A power of two, so it divides
    the other caches' block size (vLLM's prefix caching hashes blocks of a common size)."""
    need = max(COMPRESSOR_RING_ROWS, num_speculative_tokens + 1)
    return 1 << (need - 1).bit_length()


TOKEN_HISTORY = "layers.0.token_history"


def swa_bounded_replay(vllm_config) -> bool:
    """Whether the window caches leave prefix caching and replay a hit's last window:
    vLLM's ``cache_config.swa_bounded_replay`` (``--swa-bounded-replay``, default on), where a
    DeepInfer worker runs the model (CPU, Ascend). Its runner hands the model each request's replay
    start and prompt length; vLLM's own runners (the plugin's model on CUDA) hand it neither, so
    there the switch stays off: window KV cached with the prefix, no prefill truncation."""
    worker = vllm_config.parallel_config.worker_cls
    worker = worker if isinstance(worker, str) else f"{worker.__module__}.{worker.__qualname__}"
    return bool(getattr(vllm_config.cache_config, "swa_bounded_replay", False)) and worker.startswith(
        "deepinfer_vllm."
    )


@dataclass(frozen=True)
class CacheDecl:
    """One paged cache: ``kind`` is window | compressed | index | ring | tokens."""

    name: str
    kind: str
    record: RecordFormat | None = None
    ratio: int = 1
    sliding_window: int | None = None
    ring_row_floats: int = 0
    ring_rows: int = COMPRESSOR_RING_ROWS

    def spec(self, block_size: int, page_size_padded: int | None = None, bounded_replay: bool = False):
        """The vLLM ``KVCacheSpec`` of this cache (pages optionally padded).

        ``bounded_replay``: window caches are not prefix-cacheable and declare a replay of
        ``sliding_window`` tokens (``SlidingWindowMLASpec``); the token history keeps every id
        (``FullAttentionSpec``), so the replayed rows find their look-back in the cache.
        """
        from vllm.v1.kv_cache_interface import (
            CircularBufferSpec,
            FullAttentionSpec,
            MLAAttentionSpec,
            SlidingWindowMLASpec,
            SlidingWindowSpec,
        )

        if self.kind == "ring":
            return CircularBufferSpec(
                block_size=self.ring_rows,
                num_kv_heads=1,
                head_size=self.ring_row_floats,
                head_size_v=0,
                dtype=torch.float32,
                page_size_padded=page_size_padded,
            )
        if self.kind == "tokens":
            ids = {
                "block_size": block_size,
                "num_kv_heads": 1,
                "head_size": 1,
                "head_size_v": 0,
                "dtype": torch.int32,
                "page_size_padded": page_size_padded,
            }
            if bounded_replay:
                return FullAttentionSpec(**ids)
            return SlidingWindowSpec(sliding_window=self.sliding_window, **ids)
        common = {
            "block_size": block_size,
            "num_kv_heads": 1,
            "head_size": self.record.dim,
            "head_size_v": 0,
            "dtype": torch.uint8,
            "state_content_bytes": self.record.record_bytes,
            "page_size_padded": page_size_padded,
        }
        if self.kind == "window":
            return SlidingWindowMLASpec(
                sliding_window=self.sliding_window, bounded_replay=bounded_replay, **common
            )
        return MLAAttentionSpec(tokens_per_state=self.ratio, **common)


def layer_caches(
    arch: V41Arch, role: LayerRole, prefix: str | None = None, num_speculative_tokens: int = 0
) -> list[CacheDecl]:
    """Caches owned by one layer (KV sources own compressed + index); ``prefix`` is the
    attention module's name (default: the backbone's ``layers.{id}.attn``)."""
    prefix = prefix or f"layers.{role.layer_id}.attn"
    decls = [
        CacheDecl(
            f"{prefix}.window_cache",
            "window",
            RecordFormat(WINDOW_FORMAT, arch.head_dim),
            sliding_window=arch.sliding_window,
        )
    ]
    if role.is_kv_source:
        decls.append(
            CacheDecl(
                f"{prefix}.compressed_cache",
                "compressed",
                RecordFormat(COMPRESSED_FORMAT, arch.head_dim),
                role.ratio,
            )
        )
        decls.append(
            CacheDecl(
                f"{prefix}.index_cache", "index", RecordFormat(INDEX_FORMAT, arch.index_head_dim), role.ratio
            )
        )
        if role.ratio == 2:
            decls.append(
                CacheDecl(
                    f"{prefix}.ring_cache",
                    "ring",
                    ring_row_floats=2 * arch.head_dim,
                    ring_rows=compressor_ring_rows(num_speculative_tokens),
                )
            )
    return decls


def model_caches(arch: V41Arch, dspark: bool = False) -> list[CacheDecl]:
    """Every paged cache of the model; ``dspark`` adds the draft layers' window caches
    (they exist only while DSpark speculative decoding is on)."""
    decls = [d for role in arch.roles for d in layer_caches(arch, role)]
    if dspark:
        for k, role in enumerate(arch.dspark_roles):
            decls += layer_caches(arch, role, f"{dspark_prefix(k)}.attn")
    if arch.engram_layer_ids:
        decls.append(CacheDecl(TOKEN_HISTORY, "tokens", sliding_window=arch.engram_max_ngram_size))
    return decls


def bytes_per_token(decls: list[CacheDecl], block_size: int = 64) -> dict[str, float]:
    """Unpadded bytes per token by kind, from the specs (the ring is per request).

    ``global`` = compressed KV + index keys, the part that grows with context
    (docs/architecture.md, "Bytes per token": 890 B/token for Flash); ``window`` is bounded by the window.
    """
    totals: dict[str, float] = {}
    for decl in decls:
        if decl.kind == "ring":
            continue
        page = decl.spec(block_size).page_size_bytes
        totals[decl.kind] = totals.get(decl.kind, 0.0) + page / block_size
    totals["global"] = totals.get("compressed", 0.0) + totals.get("index", 0.0)
    return totals
