"""Full-sequence reference forward of DeepSeek-V4.1 (docs/architecture.md, docs/design-notes.md).

This is the oracle the vLLM model class is compared against token for token. It runs ONE
sequence at positions ``0..T-1`` through the whole backbone with no KV cache: every layer
sees every row of the sequence at once, and causality comes only from the masks (window,
complete compressor groups, visible index entries). It never imports vLLM and builds only on
the operator references in ``deepinfer_vllm.ops``.

Numerics (what the vLLM model reproduces)
  * Weights are dequantised once (exact for FP8/FP4/bf16 storage) and held in the
    accumulation dtype (``ops.numerics.acc_dtype``: fp32 for bf16 models, fp64 for fp32
    models, which makes results independent of batching). Every projection is
    ``ops.numerics.gemm(x, W)``; activations live in the model ``dtype`` (bf16 or fp32).
    The logits are ``gemm(h, head, float32)``.
  * Embedding rows are cast to ``dtype`` and broadcast to ``hc_mult`` identical streams; the
    pre-mix entering layer 0 is the identity (one-hot on stream 0).
  * Block L, single-pass mHC ("Forward pass", "Hyper-connections (mHC)"): [Engram] -> mix(attn site)
    -> attention on ``rms_norm(collapse(streams, pre_in))`` -> expand -> mix(ffn site) -> MoE on
    ``rms_norm(collapse(streams, pre_attn))`` -> expand; the FFN site's pre-mix is the next
    block's ``pre_in``. End of stack: ``rms_norm(collapse(streams, pre_ffn_last), norm)``.
  * Attention CSA2 ("Attention (CSA2)"): q from ``wq_a -> q_norm -> wq_b -> RoPE``; window KV
    ``wkv -> kv_norm -> RoPE -> MXFP8``; compressor latents of complete groups (fp32 ratio-2
    pooling, rounded before the norm), compressed key ``NVFP4(RoPE(lat, r*j))``, index key
    ``MXFP4(RoPE(k_norm(wk lat), r*j))``; index query ``MXFP4(RoPE(wq_b_idx c_q))``, index
    weights ``weights_proj x`` WITHOUT the ``128^-0.5 * 32^-0.5`` factor (DeepInfer omits it;
    a positive power-of-two scale changes neither rounding nor top-k); candidate blocks at
    the candidate source, masking at later index sources of its segment; sparse attention
    over ``[window keys | comp[top-k]]`` with sink and scale ``head_dim^-0.5``; inverse RoPE;
    grouped ``wo_a`` (fp32 einsum, rounded); ``wo_b``.
  * MoE: sqrt-softplus routing with ``gate.bias`` (``gate.bias_vl`` for image tokens), clamped
    SwiGLU experts plus the shared expert (``ops.moe``).
  * Engram ("Engram"): compressed ids from the checkpoint's tokenizer, n-gram windows with
    pre-start slots, XOR-rolling hash, FP8 row lookup dequantised to ``dtype``, ``wkv`` and
    the signed-sqrt gate, applied to the streams entering the layer.

Prefill truncation of the decoder half (docs/design-notes.md, "Prefill truncation")
  ``truncation_mode="off"``: every layer on every row (training / NeMo semantics).
  ``truncation_mode="mask"`` with ``keep_tokens=K`` (``K >= sliding_window``) and ``data_len = T``:
  in every decoder layer (``role.is_decoder``; the first decoder layer included) the window
  of every row is clipped to ``[max(p - W + 1, data_len - K), p]``. Rows with
  ``p < data_len - K`` see an empty window (only their compressed top-k and the sink). The
  compressed KV and index keys of the first decoder layer (the decoder's only KV source) are
  still computed from every row, so the global path is untouched.
  ``truncation_mode="compact"``: the same visibility, but from the first decoder layer's attention
  site on, only the kept rows ``p >= data_len - K`` are computed; that layer's mHC boundary
  (Engram, attention-site mix, attention norm) runs on all rows, and its compressor / index
  keys are built from all rows' attention inputs. Dropped rows' logits are returned as NaN.

  Contract: ``mask`` and ``compact`` are the same function on the kept rows and must agree
  bit for bit there (DeepInfer: one visibility function serves both modes, and its kernels
  are batch invariant).
  ``data_len`` (default ``T``) is the prompt length the engine truncates by: rows past it
  (generated tokens) are always kept, and their decoder windows reach back to ``data_len - K``.

SWA bounded replay after prefix hits (docs/design-notes.md, "Window KV out of the prefix cache")
  ``replay_hits=(h_1 < h_2 < ...)``: the sequence was computed in segments. Segment 0 computes
  rows ``0 .. h_1-1``; segment ``i`` was admitted with a prefix-cache hit of ``h_i`` tokens
  (``h_i > W``; a shorter hit is recomputed whole) and recomputes rows ``h_i - W ..`` (the
  replay) up to the next hit or ``T``. In segment ``i`` every layer's window is clipped to
  positions ``>= h_i - W`` (no window KV exists below the replay), the compressed entries and
  index keys completed before ``h_i`` are those of the earlier segments (the cached ones,
  "as first computed"), and the entries completed from ``h_i`` on are the segment's own. A
  row's outputs (logits, hidden state) are those of the segment that computed it past its
  hit; the replayed rows' recomputed window keys are what the later rows read. The result is
  a deterministic function of the tokens and the hits (and of ``data_len``, ``K``).

Batch invariance (read before comparing two forwards)
  The torch CPU operators this reference composes are not batch invariant: the MoE reference
  groups rows per expert, MKL takes other GEMM kernels for small row counts, and vectorised
  exp / sigmoid / softplus round the scalar tail of a loop differently from its vector body.
  So the same row computed in two forwards whose row sets differ (``compact`` vs ``mask``, a
  prefix vs the whole prompt, one decode row vs a prefill, or the same length with different
  later tokens, which regroups the experts) can differ in its last bit. The model's MXFP8 /
  NVFP4 / MXFP4 boundaries and its top-k choices occasionally turn one such ulp into a whole
  quantisation step that then spreads through windows and selections: on the tiny random
  model roughly one 60-token prompt in ten shows a 1e-3 .. 1 logit change that way. Forwards
  over the same rows are deterministic. Comparisons across row sets therefore either accept
  rare divergences or replace the three quantisers by the identity (what the tests do for
  causality checks; with them off, the differences stay below 1e-5).

Not modelled here: images (the embedding merge and in-image windows; image ids still switch
the routing bias and kill Engram n-grams), DSpark drafting, chunked prefill / decode caches.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer_vllm.configs import LayerRole, V41Arch, register_with_transformers
from deepinfer_vllm.configs.checkpoint import (
    DSPARK_PREFIX,
    VISION_PREFIXES,
    iter_dequantized,
    read_safetensors_index,
    validate_checkpoint_index,
)
from deepinfer_vllm.ops.compressor import compressor_latents
from deepinfer_vllm.ops.engram import (
    compress_token_ids,
    compressed_vocab_from_tokenizer,
    engram_gate_update,
    engram_hash,
    engram_multipliers,
    engram_ngram_ids,
    engram_offsets,
    engram_primes,
)
from deepinfer_vllm.ops.indexer import candidate_block_mask, index_scores, select_topk, visible_compressed
from deepinfer_vllm.ops.mhc import hc_collapse, hc_expand, hc_mix, identity_pre
from deepinfer_vllm.ops.moe import moe_forward, route_sqrtsoftplus
from deepinfer_vllm.ops.norm import rms_norm
from deepinfer_vllm.ops.numerics import acc_dtype, gemm
from deepinfer_vllm.ops.quant import dequant_fp8_rows, mxfp4_qdq, mxfp8_qdq, nvfp4_qdq
from deepinfer_vllm.ops.rope import apply_rope_tail, build_rope_cache
from deepinfer_vllm.ops.sparse_attention import sparse_attention, window_indices

__all__ = ["TRUNCATION_MODES", "ForwardTrace", "ReferenceV41"]

TRUNCATION_MODES = ("off", "mask", "compact")

# Checkpoint groups the text backbone never reads (DSpark stages, vision tower).
_UNUSED_PREFIXES = (DSPARK_PREFIX, *VISION_PREFIXES)


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The one GEMM rule of the reference: fp32 operands, fp32 product, one rounding to x.dtype."""
    return gemm(x, w)


@dataclass
class ForwardTrace:
    """Optional record of one forward (pass an instance to ``hidden_states``/``forward``).

    ``entry_streams[L]``: the ``[R, hc, D]`` residual streams entering block ``L`` (after block
    ``L-1``'s FFN expand, before Engram and the attention-site mix; "Drafter features"), for the rows
    that block computes; ``entry_positions[L]``: those rows' positions. ``final_hidden``: the
    normalised final hidden state of the computed rows; ``kept_positions``: their positions.
    """

    entry_streams: dict[int, torch.Tensor] = field(default_factory=dict)
    entry_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    final_hidden: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None


@dataclass
class _KVSource:
    """What a KV source publishes for the later layers of its ratio."""

    ratio: int
    comp: torch.Tensor  # [N, head_dim] NVFP4-dequantised compressed keys (= values)
    index_keys: torch.Tensor  # [N, index_head_dim] MXFP4-dequantised index keys


@dataclass
class _Segment:
    """One segment of a forward with replay hits: rows from ``start``, admitted with a hit of
    ``hit`` tokens (0 for the first); ``stored``: every KV source's entries so far."""

    start: int
    hit: int
    stored: dict[int, _KVSource]


def _merge_trace(trace: ForwardTrace, segment: ForwardTrace, T: int) -> None:
    """Fold one segment's trace into ``trace``: each position keeps the latest segment's row
    (what the engine's caches hold after a replay rewrote it)."""
    for L, rows in segment.entry_streams.items():
        pos = segment.entry_positions[L]
        have = trace.entry_positions.get(L)
        if have is None:
            trace.entry_streams[L], trace.entry_positions[L] = rows, pos
            continue
        older = ~torch.isin(have, pos)
        merged_pos = torch.cat([have[older], pos])
        order = torch.argsort(merged_pos)
        trace.entry_positions[L] = merged_pos[order]
        trace.entry_streams[L] = torch.cat([trace.entry_streams[L][older], rows])[order]
    segment.entry_streams.clear()
    segment.entry_positions.clear()


@dataclass
class _Shared:
    """Per-forward blackboard flowing down the stack (docs/architecture.md, "Per-forward state")."""

    kv: dict[int, _KVSource] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> [R, index_topk]
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate source -> [R, N]


class ReferenceV41:
    """DeepSeek-V4.1 text backbone, full-sequence reference (see the module docstring).

    Build with ``from_pretrained``; weights are held as a dict of dense fp32 tensors under
    their raw checkpoint names (routed experts stacked per layer), Engram tables stay encoded.
    """

    def __init__(
        self,
        arch: V41Arch,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        engram_old2new: torch.Tensor | None = None,
        num_threads: int | None = None,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        self.arch = arch
        self.dtype = dtype
        # torch intra-op threads during a forward (None: leave torch's setting alone). The tiny
        # model's ops are far too small to gain from threads, and on a busy host the thread
        # barriers can make a forward 100x slower; 1 is the sensible choice there.
        self.num_threads = num_threads
        acc = acc_dtype(dtype)
        self.w = {k: (v.to(acc) if v.is_floating_point() else v) for k, v in weights.items()}
        # routed experts are moved out of self.w below
        a = arch
        self._rope_main = build_rope_cache(a.rope_dim, a.max_position_embeddings, a.rope_theta, None)
        self._rope_comp = build_rope_cache(
            a.rope_dim, a.max_position_embeddings, a.compress_rope_theta, a.rope_scaling
        )
        # Routed experts stacked as [E, N, K] per layer (moe_forward's layout).
        self._experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for role in a.roles:
            p = f"layers.{role.layer_id}.ffn.experts"
            stacks = []
            for proj in ("w1", "w3", "w2"):
                names = [f"{p}.{e}.{proj}.weight" for e in range(a.n_routed_experts)]
                stacks.append(torch.stack([self.w.pop(n) for n in names]))
            self._experts[role.layer_id] = (stacks[0], stacks[1], stacks[2])
        self._init_engram(engram_old2new)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        tokenizer=None,
        num_threads: int | None = None,
    ) -> ReferenceV41:
        """Load a released-format checkpoint directory (config.json + safetensors + tokenizer).

        The safetensors headers are validated against the format the config implies before any
        data is read; tensors go through ``iter_dequantized`` to dense fp32 (Engram tables stay
        encoded). With Engram layers, the compressed vocabulary is built from the directory's
        tokenizer (``transformers.AutoTokenizer``, or ``tokenizer`` if given) and its class count
        must equal ``engram_compressed_vocab_size``. ``num_threads``: see ``__init__``.
        """
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        arch = V41Arch.from_config(config)
        found = read_safetensors_index(model_dir)
        validate_checkpoint_index(arch, found)

        # The Engram id map first: a tokenizer that does not match the config fails fast.
        old2new = None
        if arch.engram_layer_ids:
            if tokenizer is None:
                from transformers import AutoTokenizer

                register_with_transformers()  # lets AutoTokenizer read this config.json quietly
                tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            old2new, n_classes = compressed_vocab_from_tokenizer(tokenizer, vocab_size=arch.vocab_size)
            expected = arch.engram_compressed_vocab_size
            if expected is not None and n_classes != expected:
                raise ValueError(
                    f"the tokenizer in {model_dir} gives {n_classes} Engram classes, but "
                    f"engram_compressed_vocab_size is {expected}"
                )

        def raw_tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for path in sorted(model_dir.glob("*.safetensors")):
                yield from load_file(str(path)).items()

        weights: dict[str, torch.Tensor] = {}
        for name, tensor in iter_dequantized(arch, raw_tensors(), torch.float32):
            if not name.startswith(_UNUSED_PREFIXES):
                weights[name] = tensor
        return cls(arch, weights, dtype=dtype, engram_old2new=old2new, num_threads=num_threads)

    def _init_engram(self, old2new: torch.Tensor | None) -> None:
        a = self.arch
        self._engram: dict[int, tuple[list[int], list[list[int]], list[int]]] = {}
        self._old2new = old2new
        self._engram_pad = 0
        if not a.engram_layer_ids:
            return
        if old2new is None:
            raise ValueError("a model with Engram layers needs the tokenizer-derived id map")
        classes = a.engram_compressed_vocab_size
        if classes is None:
            classes = int(old2new.max()) + 1
        pad = int(old2new[a.engram_pad_token_id])
        if pad < 0:
            raise ValueError(f"engram_pad_token_id {a.engram_pad_token_id} has no compressed id")
        self._engram_pad = pad
        primes = engram_primes(
            a.engram_layer_ids, a.engram_max_ngram_size, a.engram_n_heads, a.engram_vocab_size
        )
        for layer, rows in zip(a.engram_layer_ids, a.engram_num_embeddings):
            layer_primes = primes[layer]
            if sum(sum(p) for p in layer_primes) != rows:
                raise ValueError(
                    f"engram_num_embeddings for layer {layer} is {rows}, but its primes sum to "
                    f"{sum(sum(p) for p in layer_primes)}"
                )
            mults = engram_multipliers(layer, a.engram_max_ngram_size, classes)
            self._engram[layer] = (mults, layer_primes, engram_offsets(layer_primes))

    # ------------------------------------------------------------------ public API

    def forward(
        self,
        input_ids: torch.Tensor | Sequence[int],
        truncation_mode: str = "off",
        keep_tokens: int = 0,
        trace: ForwardTrace | None = None,
        data_len: int | None = None,
        replay_hits: Sequence[int] = (),
    ) -> torch.Tensor:
        """fp32 logits ``[T, vocab]`` for one sequence at positions ``0..T-1``.

        In ``compact`` mode the rows the decoder did not compute are NaN. ``data_len`` and
        ``replay_hits``: see the module docstring.
        """
        h = self.hidden_states(
            input_ids,
            truncation_mode=truncation_mode,
            keep_tokens=keep_tokens,
            trace=trace,
            data_len=data_len,
            replay_hits=replay_hits,
        )
        with torch.no_grad(), self._threads():
            return gemm(h, self.w["head.weight"], torch.float32)

    __call__ = forward

    def hidden_states(
        self,
        input_ids: torch.Tensor | Sequence[int],
        truncation_mode: str = "off",
        keep_tokens: int = 0,
        trace: ForwardTrace | None = None,
        data_len: int | None = None,
        replay_hits: Sequence[int] = (),
    ) -> torch.Tensor:
        """Final normalised hidden states ``[T, hidden]`` in the model dtype (NaN for rows a
        ``compact`` forward dropped)."""
        ids = self._as_ids(input_ids)
        T = ids.numel()
        h_rows, rows = self._run(ids, truncation_mode, keep_tokens, trace, data_len, tuple(replay_hits))
        if rows.numel() == T:
            return h_rows
        out = torch.full((T, h_rows.shape[-1]), float("nan"), dtype=h_rows.dtype)
        out[rows] = h_rows
        return out

    @torch.no_grad()
    def greedy_generate(
        self,
        prompt_ids: torch.Tensor | Sequence[int],
        max_new_tokens: int,
        truncation_mode: str = "off",
        keep_tokens: int = 0,
        stop_at_eos: bool = False,
        admissions: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Greedy continuation: re-runs the full stack over prompt + generated tokens for
        every new token and appends the argmax (lowest id on ties) of the last row's logits
        (the head is applied to that row alone: its logits are ``forward``'s last row, the
        same fp64-accumulated product rounded once).

        Returns only the new tokens. Prefill truncation applies as an engine applies it: with
        ``data_len`` = the prompt's length, generated tokens computed in full.

        ``admissions``: ``(hit, length)`` for each time the request was (re)admitted after its
        first admission (a preemption) or, for the first one, with a prefix-cache hit: it then
        held ``length`` tokens and found ``hit`` of them cached (0: recomputed whole; a hit of
        at most ``W`` tokens counts as 0). Every token sampled from then on comes from a
        forward whose replay hits are those of this admission (see ``replay_chain``).
        """
        seq = self._as_ids(prompt_ids).tolist()
        data_len = len(seq)
        out: list[int] = []
        for _ in range(max_new_tokens):
            hits = self.replay_chain(admissions, len(seq))
            h = self.hidden_states(
                seq,
                truncation_mode=truncation_mode,
                keep_tokens=keep_tokens,
                data_len=data_len,
                replay_hits=hits,
            )
            with self._threads():
                logits = gemm(h[-1:], self.w["head.weight"], torch.float32)
            tok = int(torch.argmax(logits[-1]).item())
            out.append(tok)
            seq.append(tok)
            if stop_at_eos and tok == self.arch.eos_token_id:
                break
        return out

    def replay_chain(self, admissions: Sequence[tuple[int, int]], length: int) -> tuple[int, ...]:
        """The replay hits behind the rows computed while the request holds ``length`` tokens,
        from its ``(hit, length at admission)`` admissions in order: each admission with a
        hit keeps the earlier chain's hits below it and adds its own; one without a hit (or
        with a hit of at most ``W`` tokens, which the scheduler recomputes whole) starts over.
        Assumes the cached blocks a hit finds are the ones this request computed."""
        W = self.arch.sliding_window
        chain: list[int] = []
        for hit, at in admissions:
            if at > length:
                break
            if hit >= at:
                raise ValueError(f"a hit of {hit} tokens on a request of {at}: at most {at - 1} are cached")
            chain = [h for h in chain if h < hit] + [hit] if hit > W else []
        return tuple(chain)

    # ------------------------------------------------------------------ forward internals

    def _as_ids(self, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        T = ids.numel()
        if T == 0:
            raise ValueError("empty sequence")
        if T > self.arch.max_position_embeddings:
            raise ValueError(f"sequence of {T} tokens exceeds max_position_embeddings")
        if int(ids.min()) < 0 or int(ids.max()) >= self.arch.vocab_size:
            raise ValueError("token id outside the vocabulary")
        return ids

    def _check_hits(self, hits: tuple[int, ...], T: int) -> None:
        W = self.arch.sliding_window
        if list(hits) != sorted(set(hits)):
            raise ValueError(f"replay_hits must increase strictly, got {hits}")
        for h in hits:
            if not W < h < T:
                raise ValueError(
                    f"replay hit {h}: must be longer than the window ({W}; shorter hits are recomputed "
                    f"whole) and shorter than the sequence ({T})"
                )

    def _truncation_lo(self, T: int, truncation_mode: str, keep_tokens: int) -> int:
        """Lowest window position of decoder layers (0 = no clipping)."""
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}")
        if truncation_mode == "off":
            return 0
        late = [r.layer_id for r in self.arch.roles if r.is_decoder and r.is_kv_source]
        if late and late != [self.arch.first_decoder_layer]:
            raise ValueError(
                f"decoder truncation needs the first decoder layer to be the decoder's only KV "
                f"source; KV sources in the decoder: {late}"
            )
        if keep_tokens < self.arch.sliding_window:
            raise ValueError(
                f"keep_tokens={keep_tokens} must be >= sliding_window ({self.arch.sliding_window})"
            )
        return max(0, T - keep_tokens)

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        if self.num_threads is None:
            yield
            return
        previous = torch.get_num_threads()
        torch.set_num_threads(self.num_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)

    def _run(
        self,
        ids: torch.Tensor,
        truncation_mode: str,
        keep_tokens: int,
        trace: ForwardTrace | None,
        data_len: int | None = None,
        replay_hits: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the stack; returns the final hidden rows and their positions."""
        with torch.no_grad(), self._threads():
            return self._run_stack(ids, truncation_mode, keep_tokens, trace, data_len, replay_hits)

    def _run_stack(
        self,
        ids: torch.Tensor,
        truncation_mode: str,
        keep_tokens: int,
        trace: ForwardTrace | None,
        data_len: int | None = None,
        replay_hits: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every segment of the sequence in turn (one without replay hits); each row's outputs
        come from the segment that computed it past its hit."""
        a = self.arch
        T = ids.numel()
        self._check_hits(replay_hits, T)
        lo = self._truncation_lo(T if data_len is None else data_len, truncation_mode, keep_tokens)
        bounds = [0, *replay_hits, T]
        stored: dict[int, _KVSource] = {}
        seg_trace = ForwardTrace() if trace is not None else None
        hs, positions = [], []
        for i in range(len(bounds) - 1):
            hit, end = bounds[i], bounds[i + 1]
            start = hit - a.sliding_window if i else 0
            h, pos = self._run_segment(ids[:end], start, hit, lo, truncation_mode, stored, seg_trace)
            mine = pos >= hit
            hs.append(h[mine])
            positions.append(pos[mine])
            if trace is not None:
                _merge_trace(trace, seg_trace, T)
        h, pos = torch.cat(hs), torch.cat(positions)
        if trace is not None:
            trace.final_hidden = h.clone()
            trace.kept_positions = pos.clone()
        return h, pos

    def _run_segment(
        self,
        ids: torch.Tensor,
        start: int,
        hit: int,
        lo: int,
        truncation_mode: str,
        stored: dict[int, _KVSource],
        trace: ForwardTrace | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``start .. len(ids)-1``: every window clipped at ``start`` (decoder windows also at
        ``lo``), KV sources' entries completed before ``hit`` taken from ``stored``, which gets
        this segment's own entries. Returns the final hidden rows and their positions."""
        a = self.arch
        T = ids.numel()
        compact = truncation_mode == "compact" and lo > 0

        pos = torch.arange(start, T, dtype=torch.long)
        is_image = ids == a.image_token_id
        # N-grams look back before the segment: the engine's token history holds those ids.
        ngram = self._ngram_ids(ids, torch.arange(T, dtype=torch.long), is_image)[start:]
        ids, is_image = ids[start:], is_image[start:]
        R = T - start

        e = self.w["embed.weight"][ids].to(self.dtype)
        streams = e.unsqueeze(1).expand(R, a.hc_mult, e.shape[-1]).contiguous()
        pre_in = identity_pre(R, a.hc_mult)
        shared = _Shared()
        segment = _Segment(start=start, hit=hit, stored=stored)

        for role in a.roles:
            L = role.layer_id
            p = f"layers.{L}"
            if trace is not None:
                trace.entry_streams[L] = streams.clone()
                trace.entry_positions[L] = pos.clone()
            if role.has_engram:
                streams = self._engram_update(L, streams, ngram, is_image)
            pre_a, post_a, comb_a = self._mix(p, "attn", streams)
            x = rms_norm(hc_collapse(streams, pre_in), self.w[f"{p}.attn_norm.weight"], a.rms_norm_eps)
            x_kv = x  # rows the compressor sees: every row of the segment
            if compact and L == a.first_decoder_layer:
                # Decoder truncation boundary: this layer's compressor and index keys read x_kv
                # (all rows); everything else from here on runs on the kept rows only.
                keep = pos >= lo
                if not bool(keep.any()):
                    # No row of the segment is kept: only the KV source's entries remain to compute.
                    self._publish_kv(role, x_kv, segment, shared)
                    return streams[:0, 0], pos[:0]
                streams, post_a, comb_a, pre_a = streams[keep], post_a[keep], comb_a[keep], pre_a[keep]
                x, pos, ids, is_image, ngram = x[keep], pos[keep], ids[keep], is_image[keep], ngram[keep]
                for table in (shared.topk, shared.candidates):
                    for k in list(table):
                        table[k] = table[k][keep]
            window_lo = max(start, lo) if (role.is_decoder and lo > 0) else start
            attn = self._attention(role, x, x_kv, pos, T, window_lo, shared, segment)
            streams = hc_expand(attn, streams, post_a, comb_a)

            pre_f, post_f, comb_f = self._mix(p, "ffn", streams)
            xf = rms_norm(hc_collapse(streams, pre_a), self.w[f"{p}.ffn_norm.weight"], a.rms_norm_eps)
            streams = hc_expand(self._moe(L, xf, ids, is_image), streams, post_f, comb_f)
            pre_in = pre_f

        h = rms_norm(hc_collapse(streams, pre_in), self.w["norm.weight"], a.rms_norm_eps)
        return h, pos

    def _mix(self, prefix: str, site: str, streams: torch.Tensor):
        """mHC coefficients of one sublayer site (``site`` = attn | ffn)."""
        a = self.arch
        w = self.w
        return hc_mix(
            streams,
            w[f"{prefix}.hc_{site}_fn"],
            w[f"{prefix}.hc_{site}_base"],
            w[f"{prefix}.hc_{site}_scale"],
            a.rms_norm_eps,
            a.hc_eps,
            a.hc_sinkhorn_iters,
        )

    # ------------------------------------------------------------------ attention

    def _rope(self, role: LayerRole) -> torch.Tensor:
        return self._rope_main if role.ratio == 0 else self._rope_comp

    def _attention(
        self,
        role: LayerRole,
        x: torch.Tensor,
        x_kv: torch.Tensor,
        pos: torch.Tensor,
        seq_len: int,
        window_lo: int,
        shared: _Shared,
        segment: _Segment,
    ) -> torch.Tensor:
        """CSA2 attention of one layer for the rows ``x`` at positions ``pos``.

        ``x_kv`` is the attention input of EVERY position of the segment
        ``segment.start..seq_len-1`` (the same tensor as ``x`` unless a compact forward dropped
        rows at this layer); only a KV source's compressor reads it.
        """
        a = self.arch
        p = f"layers.{role.layer_id}.attn"
        w = self.w
        cache = self._rope(role)
        R = x.shape[0]
        H, Dh = a.num_heads, a.head_dim

        c_q = rms_norm(_linear(x, w[f"{p}.wq_a.weight"]), w[f"{p}.q_norm.weight"], a.rms_norm_eps)
        q = apply_rope_tail(_linear(c_q, w[f"{p}.wq_b.weight"]).view(R, H, Dh), pos, cache)
        kv = rms_norm(_linear(x, w[f"{p}.wkv.weight"]), w[f"{p}.kv_norm.weight"], a.rms_norm_eps)
        kv = mxfp8_qdq(apply_rope_tail(kv, pos, cache))

        # Window keys: positions max(p - W + 1, window_lo) .. p, gathered by position.
        by_pos = kv.new_zeros(seq_len, Dh)
        by_pos[pos] = kv
        idx, valid = window_indices(pos, a.sliding_window, torch.full_like(pos, window_lo))
        keys = by_pos[idx.clamp_min(0)].masked_fill(~valid.unsqueeze(-1), 0.0)

        if role.ratio > 0:
            if role.is_kv_source:
                if x_kv.shape[0] != seq_len - segment.start:
                    raise AssertionError("a KV source must see every row of the segment")
                self._publish_kv(role, x_kv, segment, shared)
            src = shared.kv[role.kv_source]
            if src.ratio != role.ratio:
                raise AssertionError(f"layer {role.layer_id}: KV source ratio mismatch")
            if role.is_index_source:
                shared.topk[role.layer_id] = self._index(role, x, c_q, pos, src, shared)
            topk = shared.topk[role.index_source]
            sel = topk >= 0
            N = src.comp.shape[0]
            if N > 0:
                comp_keys = src.comp[topk.clamp(0, N - 1)].masked_fill(~sel.unsqueeze(-1), 0.0)
            else:
                comp_keys = kv.new_zeros(R, topk.shape[1], Dh)
            keys = torch.cat([keys, comp_keys], dim=1)
            valid = torch.cat([valid, sel], dim=1)

        o = sparse_attention(q, keys, valid, w[f"{p}.attn_sink"], Dh**-0.5)
        o = apply_rope_tail(o, pos, cache, inverse=True)
        wo_a = w[f"{p}.wo_a.weight"]
        G = a.o_groups
        z = torch.einsum(
            "tgi,goi->tgo", o.reshape(R, G, -1).to(wo_a.dtype), wo_a.view(G, a.o_lora_rank, -1)
        ).to(x.dtype)
        return _linear(z.reshape(R, -1), w[f"{p}.wo_b.weight"])

    def _publish_kv(self, role: LayerRole, x_seg: torch.Tensor, segment: _Segment, shared: _Shared) -> None:
        """A KV source's entries for the segment: those completed before the hit as stored by
        the earlier segments (as first computed), the later ones from the segment's rows
        ``x_seg`` (positions ``segment.start ..``); stored back for the segments after."""
        r = role.ratio
        start = segment.start
        first_group = -(-start // r)  # groups the segment's rows hold whole
        own = self._compress(role, x_seg[first_group * r - start :], first_group)
        n_old = segment.hit // r  # entries closed before the hit
        old = segment.stored.get(role.layer_id)
        if n_old:
            if old is None or old.comp.shape[0] < n_old:
                raise AssertionError(f"layer {role.layer_id}: the earlier segments stored too few entries")
            skip = n_old - first_group
            own = _KVSource(
                ratio=r,
                comp=torch.cat([old.comp[:n_old], own.comp[skip:]]),
                index_keys=torch.cat([old.index_keys[:n_old], own.index_keys[skip:]]),
            )
        shared.kv[role.layer_id] = own
        segment.stored[role.layer_id] = own

    def _compress(self, role: LayerRole, x_all: torch.Tensor, first_group: int = 0) -> _KVSource:
        """Compressed keys and index keys of every complete group (docs/architecture.md,
        "Compressor") of the rows ``x_all``, whose first row opens group ``first_group``."""
        a = self.arch
        p = f"layers.{role.layer_id}.attn"
        w = self.w
        cache = self._rope(role)
        r = role.ratio
        lat = compressor_latents(
            x_all,
            w[f"{p}.compressor.wkv.weight"],
            w.get(f"{p}.compressor.wgate.weight") if r != 1 else None,
            w[f"{p}.compressor.norm.weight"],
            a.rms_norm_eps,
            r,
            self.dtype,
        )
        # Each group's first position.
        first = (torch.arange(lat.shape[0], dtype=torch.long) + first_group) * r
        comp = nvfp4_qdq(apply_rope_tail(lat, first, cache))
        k = rms_norm(
            _linear(lat, w[f"{p}.indexer.wk.weight"]), w[f"{p}.indexer.k_norm.weight"], a.rms_norm_eps
        )
        index_keys = mxfp4_qdq(apply_rope_tail(k, first, cache))
        return _KVSource(ratio=r, comp=comp, index_keys=index_keys)

    def _index(
        self,
        role: LayerRole,
        x: torch.Tensor,
        c_q: torch.Tensor,
        pos: torch.Tensor,
        src: _KVSource,
        shared: _Shared,
    ) -> torch.Tensor:
        """Lightning indexer + hierarchical candidates -> top-k entries ``[R, index_topk]``
        (ascending, ``-1`` filled; docs/architecture.md, "Lightning indexer")."""
        a = self.arch
        p = f"layers.{role.layer_id}.attn.indexer"
        w = self.w
        R = x.shape[0]
        N = src.index_keys.shape[0]
        visible = visible_compressed(pos, role.ratio)
        if N == 0:
            if role.is_candidate_source:
                shared.candidates[role.layer_id] = torch.zeros(R, 0, dtype=torch.bool)
            return torch.full((R, a.index_topk), -1, dtype=torch.long)
        qi = _linear(c_q, w[f"{p}.wq_b.weight"]).view(R, a.index_n_heads, a.index_head_dim)
        qi = mxfp4_qdq(apply_rope_tail(qi, pos, self._rope(role)))
        weights = _linear(x, w[f"{p}.weights_proj.weight"])  # no 128^-0.5 * 32^-0.5 (DeepInfer)
        scores = index_scores(qi, weights, src.index_keys, visible)
        if role.is_candidate_source:
            shared.candidates[role.layer_id] = candidate_block_mask(
                scores, visible, a.candidate_block_size, a.candidate_topk_blocks
            )
        if role.uses_candidates:
            scores = scores.masked_fill(~shared.candidates[a.candidate_source_layer], float("-inf"))
        return select_topk(scores, a.index_topk)

    # ------------------------------------------------------------------ MoE and Engram

    def _moe(self, layer: int, x: torch.Tensor, ids: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        a = self.arch
        p = f"layers.{layer}.ffn"
        w = self.w
        weights, experts = route_sqrtsoftplus(
            x,
            w[f"{p}.gate.weight"],
            w[f"{p}.gate.bias"],
            a.top_k,
            a.routed_scaling_factor,
            a.norm_topk_prob,
            bias_vl=w.get(f"{p}.gate.bias_vl"),
            is_image=is_image,
        )
        w1, w3, w2 = self._experts[layer]
        shared = (
            w[f"{p}.shared_experts.w1.weight"],
            w[f"{p}.shared_experts.w3.weight"],
            w[f"{p}.shared_experts.w2.weight"],
        )
        return moe_forward(x, weights, experts, w1, w3, w2, a.swiglu_limit, shared=shared)

    def _ngram_ids(self, ids: torch.Tensor, pos: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        """Compressed ids at ``p, p-1, ...`` for every row (``ENGRAM_BEFORE_START`` before 0)."""
        a = self.arch
        if not a.engram_layer_ids:
            return torch.zeros(ids.numel(), 1, dtype=torch.long)
        comp = compress_token_ids(ids, self._old2new, is_image)
        return engram_ngram_ids(comp, pos, None, a.engram_max_ngram_size)

    def _engram_update(
        self, layer: int, streams: torch.Tensor, ngram: torch.Tensor, is_image: torch.Tensor
    ) -> torch.Tensor:
        a = self.arch
        p = f"layers.{layer}.engram"
        w = self.w
        mults, primes, offsets = self._engram[layer]
        rows = engram_hash(ngram, self._engram_pad, mults, primes, offsets)  # [R, columns]
        emb = dequant_fp8_rows(w[f"{p}.embed.weight"][rows], w[f"{p}.embed.scale"][rows], self.dtype)
        kv = _linear(emb.flatten(1), w[f"{p}.wkv.weight"])
        return engram_gate_update(
            streams, kv, w[f"{p}.q_weight"], w[f"{p}.k_weight"], a.rms_norm_eps, is_image
        )
