"""State one V4.1 forward step shares across its layers.

vLLM passes each cache layer its own metadata (block tables differ per KV cache
group); the token layout (positions, request of every token, sequence lengths)
is the same for all of them and is read once here. Source layers publish what
later layers reuse (the top-k of every index source, the candidate source's kept
blocks), which DeepInfer calls the cross-layer blackboard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer, V41StepMetadata
from deepinfer_vllm.ops.paged_records import read_records, record_address, write_records


@dataclass
class StepState:
    """Token layout of the step plus the cross-layer blackboard.

    ``topk[layer_id]``: the selected compressed entries ``[T, index_topk]`` (-1 = none) of
    index source ``layer_id``, read by the layers that reuse its selection.
    ``kept_blocks``: the candidate source's kept candidate blocks per token,
    ``[T, candidate_topk_blocks]`` block ids (ascending, -1 fill; block ``b`` holds entries
    ``b * candidate_block_size ..``), read by the reindex layers of its KV segment; None
    until the candidate source has run.
    """

    attn_metadata: dict[str, V41StepMetadata]
    positions: torch.Tensor  # [T] int64
    token_req: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [R] int64
    context_lens: torch.Tensor  # [R] int64
    num_reqs: int
    max_seq_len: int = 0  # host upper bound of ``seq_lens`` (0: unknown)
    max_query_len: int = 0  # host upper bound of any request's tokens in the step (0: unknown)
    # SWA bounded replay: [R] first position each request holds window KV from (a prefix
    # hit's replay start, else 0), and the same per token [T]; None when no request replays.
    replay_start: torch.Tensor | None = None
    window_start: torch.Tensor | None = None
    # Prefill truncation: first position whose decoder-layer window KV exists
    # (per token), or None when truncation is off.
    decoder_window_start: torch.Tensor | None = None
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    kept_blocks: torch.Tensor | None = None
    # False in vLLM's profiling and dummy runs (no metadata, no caches bound):
    # every token then attends to its own key only and nothing is stored.
    has_caches: bool = True
    # Per-token tensors every layer derives alike, made once per step (``derived``).
    _derived: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_metadata(cls, attn_metadata: dict, any_layer: str) -> StepState:
        meta = attn_metadata[any_layer]
        replay = meta.replay_start
        return cls(
            attn_metadata=attn_metadata,
            positions=meta.positions,
            token_req=meta.token_req,
            seq_lens=meta.seq_lens,
            context_lens=meta.context_lens,
            num_reqs=meta.num_reqs,
            max_seq_len=meta.max_seq_len,
            max_query_len=meta.max_query_len,
            replay_start=replay,
            window_start=None if replay is None else replay[meta.token_req],
        )

    @classmethod
    def without_caches(cls, positions: torch.Tensor) -> StepState:
        """The step of a profiling or dummy run: each token alone, nothing cached."""
        T = positions.shape[0]
        rows = torch.arange(T, dtype=torch.int64, device=positions.device)
        return cls(
            attn_metadata={},
            positions=positions.to(torch.int64),
            token_req=rows,
            seq_lens=positions.to(torch.int64) + 1,
            context_lens=positions.to(torch.int64),
            num_reqs=T,
            has_caches=False,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def no_window_floor(self) -> torch.Tensor:
        """``[T]`` zeros: the window lower bound of a layer without one (made once per step)."""
        if "zeros" not in self._derived:
            self._derived["zeros"] = torch.zeros_like(self.positions)
        return self._derived["zeros"]

    def entries_closed(self, ratio: int) -> torch.Tensor:
        """``[T]`` compressed entries of ratio ``ratio`` complete at each token, ``(pos + 1) // ratio``
        (made once per step and ratio)."""
        key = ("closed", ratio)
        if key not in self._derived:
            self._derived[key] = (self.positions + 1) // ratio
        return self._derived[key]

    @property
    def _any_metadata(self) -> V41StepMetadata | None:
        return next(iter(self.attn_metadata.values()), None)

    @property
    def prompt_lens(self) -> torch.Tensor | None:
        meta = self._any_metadata
        return None if meta is None else meta.prompt_lens

    @property
    def full_prefill(self) -> torch.Tensor | None:
        """[R] bool, requests that keep every prompt row (prompt logprobs), or None."""
        meta = self._any_metadata
        return None if meta is None else meta.full_prefill

    @property
    def prompt_rows(self) -> bool:
        """Host: whether some token of the step lies below its request's prompt length."""
        meta = self._any_metadata
        return meta is not None and meta.prompt_rows

    def subset(self, rows: torch.Tensor) -> StepState:
        """The same step restricted to ``rows`` (compact prefill truncation).

        Per-token state (positions, top-k, kept blocks) is sliced; per-request state
        (lengths, block tables) is unchanged.
        """
        return StepState(
            attn_metadata=self.attn_metadata,
            positions=self.positions[rows],
            token_req=self.token_req[rows],
            seq_lens=self.seq_lens,
            context_lens=self.context_lens,
            num_reqs=self.num_reqs,
            max_seq_len=self.max_seq_len,
            max_query_len=self.max_query_len,
            replay_start=self.replay_start,
            window_start=None if self.window_start is None else self.window_start[rows],
            decoder_window_start=(
                None if self.decoder_window_start is None else self.decoder_window_start[rows]
            ),
            topk={k: v[rows] for k, v in self.topk.items()},
            kept_blocks=None if self.kept_blocks is None else self.kept_blocks[rows],
            has_caches=self.has_caches,
        )


class PagedView:
    """Addresses one cache layer's records by (request row, entry index)."""

    def __init__(self, layer: V41CacheLayer, state: StepState):
        self.layer = layer
        self.meta: V41StepMetadata = state.attn_metadata[layer.prefix]

    def _slot(self, req: torch.Tensor, entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return record_address(self.meta.block_table, req, entry, self.layer.ratio, self.meta.block_size)

    def write(self, req: torch.Tensor, entry: torch.Tensor, x: torch.Tensor) -> None:
        if entry.numel() == 0:
            return
        blocks, offsets = self._slot(req, entry)
        write_records(self.layer.kv_cache, self.layer.record, blocks, offsets, x)

    def read(self, req: torch.Tensor, entry: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised records; ``entry`` may be any shape (clamp invalid ones first)."""
        blocks, offsets = self._slot(req, entry)
        return read_records(self.layer.kv_cache, self.layer.record, blocks, offsets, dtype)


class RingView:
    """The ratio-2 compressor ring: fp32 rows ``[num_blocks, capacity, row_floats]``, request
    ``r``'s in block ``block_table[r, 0]`` at ``position % capacity`` (``ops`` ``PoolPairs``
    reads and keeps it)."""

    def __init__(self, layer: V41CacheLayer, state: StepState):
        self.layer = layer
        self.meta: V41StepMetadata = state.attn_metadata[layer.prefix]
        cache = layer.kv_cache
        if cache.dim() == 4:
            cache = cache.squeeze(1)
        self.rows = cache
