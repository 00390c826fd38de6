"""DeepSeek-V4.1-Flash for vLLM, DeepInfer's implementation.

Structure follows docs/architecture.md, "Forward pass": embedding broadcast to ``hc_mult`` residual streams,
blocks with single-pass mHC (the input of a sublayer is collapsed with the
pre-mix of the previous site), CSA2 attention, MoE, Engram at its layers, and a
final collapse with the last FFN site's pre-mix. The causal encoder/decoder
split matters only to prefill truncation (``DEEPINFER_PREFILL_TRUNCATION_*``).

Weights stay in the released formats (``ops.weight_gemm``): vLLM's parallel
linear, embedding and head layers with ``DeepInferV41QuantConfig``, routed
experts as packed E2M1, Engram rows as E4M3. Tensor, data and expert
parallelism come from vLLM's flags and groups (``layers.parallel``). The
checkpoint stream vLLM hands over is validated tensor by tensor against the
format (``configs.checkpoint``), and every problem is reported at once.

With DSpark speculative decoding on, the draft stages ``mtp.*`` are built and
held too (``models.dspark_draft``): every forward writes their context keys
from the target layers' entry streams, and ``draft_block`` runs the parallel
draft forward for DeepInfer's proposer.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import MixtureOfExperts
from vllm.model_executor.models.utils import make_layers

from deepinfer_vllm import envs
from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token, model_caches, swa_bounded_replay
from deepinfer_vllm.attention_backends.mla_swa import V41CacheLayer
from deepinfer_vllm.configs import LayerRole, V41Arch
from deepinfer_vllm.configs import checkpoint
from deepinfer_vllm.model_executor.eplb import check_eplb, eplb_settings
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout, check_vllm_parallel
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention
from deepinfer_vllm.model_executor.engram_host import engram_placement
from deepinfer_vllm.model_executor.layers.v41_engram import (
    EngramRuntime,
    EngramTables,
    TokenHistory,
    V41Engram,
)
from deepinfer_vllm.model_executor.layers.v41_mhc import HyperConnection, collapse_norm
from deepinfer_vllm.model_executor.layers.v41_moe import V41MoE
from deepinfer_vllm.model_executor.layers.linear import linear
from deepinfer_vllm.model_executor.layers.norm import V41Norm
from deepinfer_vllm.model_executor.quantization import DeepInferV41QuantConfig
from deepinfer_vllm.ops.dspark import draft_inputs, target_features
from deepinfer_vllm.ops.mhc import broadcast_streams, hc_collapse, identity_pre
from deepinfer_vllm.ops.rope import build_rope_cache
from deepinfer_vllm.configs.dspark import dspark_settings
from deepinfer_vllm.model_executor.models.dspark_draft import build_stages

logger = logging.getLogger(__name__)

# Checkpoint names -> parameters where the two differ (everything else is the same name).
_HC = re.compile(r"^((?:layers|mtp)\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
# Groups the model validates but does not hold until a feature runs them
# (the DSpark stages are held while DSpark speculative decoding is on).
NOT_HELD = (checkpoint.DSPARK_PREFIX, *checkpoint.VISION_PREFIXES)


class DeepseekV41Block(nn.Module):
    """One backbone layer: [Engram] -> attention site -> FFN site."""

    def __init__(
        self,
        arch: V41Arch,
        role: LayerRole,
        rope_cache: torch.Tensor,
        prefix: str,
        cache_layers: dict[str, V41CacheLayer],
        quant_config,
        layout: ParallelLayout,
        redundant: int | None = None,
        engram_placement=None,
    ):
        super().__init__()
        self.arch = arch
        self.role = role
        self.attn_norm = V41Norm(arch.hidden_size, arch.rms_norm_eps)
        self.ffn_norm = V41Norm(arch.hidden_size, arch.rms_norm_eps)
        self.hc_attn = HyperConnection(arch)
        self.hc_ffn = HyperConnection(arch)
        self.attn = V41Attention(arch, role, rope_cache, f"{prefix}.attn", cache_layers, quant_config, layout)
        self.ffn = V41MoE.from_arch(
            arch, arch.n_routed_experts, arch.top_k, quant_config, layout, f"{prefix}.ffn", redundant
        )
        self.engram = None
        if role.has_engram:
            idx = list(arch.engram_layer_ids).index(role.layer_id)
            self.engram = V41Engram(
                arch,
                role.layer_id,
                arch.engram_num_embeddings[idx],
                quant_config,
                layout,
                f"{prefix}.engram",
                engram_placement,
            )

    def forward(self, streams, pre_in, input_ids, state: StepState, engram_inputs, keep_rows=None):
        """One block; with ``keep_rows`` (compact truncation boundary) the
        compressor still sees every row, everything after it only those rows."""
        if self.engram is not None:
            streams = self.engram(streams, engram_inputs)
        pre_a, post_a, comb_a = self.hc_attn.mix(streams)
        x = collapse_norm(streams, pre_in, self.attn_norm)
        write_compressed = True
        if keep_rows is not None:
            self.attn.write_compressed(x, state)
            write_compressed = False
            streams, pre_a, post_a, comb_a = (t[keep_rows] for t in (streams, pre_a, post_a, comb_a))
            x, input_ids, state = x[keep_rows], input_ids[keep_rows], state.subset(keep_rows)
        streams = self.hc_attn.expand(self.attn(x, state, write_compressed), streams, post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn.mix(streams)
        x = collapse_norm(streams, pre_a, self.ffn_norm)
        streams = self.hc_ffn.expand(self.ffn(x, input_ids), streams, post_f, comb_f)
        return streams, pre_f, input_ids, state


class DeepseekV41ForCausalLM(nn.Module, MixtureOfExperts):
    """vLLM entry class of DeepSeek-V4.1 (registered by ``deepinfer_vllm.register``).

    Implements vLLM's ``MixtureOfExperts`` for expert load balancing (``model_executor.eplb``): the
    backbone's routed experts are ``moe_layers``; vLLM's ``EplbState`` (where vLLM accepts
    ``enable_eplb``) or the plugin's ``ExpertBalancer`` hands them maps and load counters through
    ``set_eplb_state`` and moves ``expert_weights``. DSpark's draft stages keep one replica per expert."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        self.model_config = model_config
        self.arch = arch = V41Arch.from_config(model_config.hf_config)
        check_vllm_parallel(arch, vllm_config.parallel_config)
        self.layout = layout = ParallelLayout.from_vllm(vllm_config)
        self.dtype = model_config.dtype
        # vLLM's SWA bounded replay turns DeepInfer's compact truncation of the decoder half on
        # (docs/design-notes.md, "Prefill truncation"); the variable overrides it.
        engram_in_decoder = any(i >= arch.first_decoder_layer for i in arch.engram_layer_ids)
        default_mode = "off"
        if swa_bounded_replay(vllm_config):
            default_mode = "mask" if engram_in_decoder else "compact"
        self.truncation_mode, self.truncation_keep = envs.prefill_truncation_settings(
            arch.sliding_window, default_mode
        )
        if self.truncation_mode == "compact" and engram_in_decoder:
            raise ValueError("compact prefill truncation needs every Engram layer before the decoder half")
        quant_config = vllm_config.quant_config
        if not isinstance(quant_config, DeepInferV41QuantConfig):
            released = getattr(model_config.hf_config, "quantization_config", None) or {}
            quant_config = DeepInferV41QuantConfig(dict(released))
        quant_config.bind_format(arch)

        # Rope tables cover the positions this engine can reach.
        self.rope_len = int(model_config.max_model_len)
        main_rope = build_rope_cache(arch.rope_dim, self.rope_len, arch.rope_theta, None)
        comp_rope = build_rope_cache(
            arch.rope_dim, self.rope_len, arch.compress_rope_theta, arch.rope_scaling
        )
        self.cache_layers: dict[str, V41CacheLayer] = {}
        self.embed = VocabParallelEmbedding(
            arch.vocab_size, arch.hidden_size, quant_config=quant_config, prefix="embed"
        )

        # Engram rows in device or host memory (vLLM's engram_config, ``model_executor.engram_host``).
        self.engram_placement = engram_placement(vllm_config, arch, layout)
        self.eplb = eplb_settings(vllm_config)
        redundant = None
        if self.eplb is not None:
            check_eplb(self.eplb, arch.n_routed_experts, vllm_config.parallel_config)
            redundant = self.eplb.num_redundant_experts

        def block(prefix: str) -> DeepseekV41Block:
            role = arch.roles[int(prefix.rsplit(".", 1)[1])]
            rope = main_rope if role.ratio == 0 else comp_rope
            return DeepseekV41Block(
                arch,
                role,
                rope,
                prefix,
                self.cache_layers,
                quant_config,
                layout,
                redundant,
                self.engram_placement,
            )

        _, _, self.layers = make_layers(arch.num_layers, block, prefix="layers")
        for layer in self.layers:
            role = layer.role
            if role.ratio > 0:
                layer.attn.bind_kv_source(self.layers[role.kv_source].attn)
        self._set_moe_parameters(arch, layout, redundant)
        self.norm = V41Norm(arch.hidden_size, arch.rms_norm_eps)
        self.head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, quant_config=quant_config, prefix="head"
        )
        self.logits_processor = LogitsProcessor(arch.vocab_size)

        # DSpark stages (``mtp.*``), built only while DSpark speculative decoding is on.
        self.dspark = dspark_settings(vllm_config)
        self.mtp = None
        if self.dspark is not None:
            self.mtp = build_stages(arch, main_rope, self.cache_layers, quant_config, layout)
        self.not_held = tuple(
            p for p in NOT_HELD if not (self.mtp is not None and p == checkpoint.DSPARK_PREFIX)
        )

        self.engram_tables: EngramTables | None = None
        self.token_history: TokenHistory | None = None
        self.engram_runtime: EngramRuntime | None = None
        if arch.engram_layer_ids:
            history = next(d for d in model_caches(arch) if d.kind == "tokens")
            self.token_history = TokenHistory(history, self.cache_layers)
            self.engram_tables = EngramTables(arch)
            tables = {b.role.layer_id: b.engram.embed for b in self.layers if b.engram is not None}
            self.engram_runtime = EngramRuntime(
                self.engram_tables, self.token_history, tables, self.engram_placement, layout
            )
        # Element size of the checkpoint tensor each parameter was loaded from
        # (``tools.weight_bytes`` compares resident bytes with checkpoint bytes).
        self.checkpoint_element_size: dict[str, int] = {}

        block_size = vllm_config.cache_config.block_size
        per_token = bytes_per_token([c.decl for c in self.cache_layers.values()], block_size)
        logger.info(
            "DeepInfer V4.1 caches: %s bytes/token (block %d)",
            {k: round(v, 1) for k, v in per_token.items()},
            block_size,
        )

    # ------------------------------------------------ MixtureOfExperts (EPLB)
    def _set_moe_parameters(self, arch: V41Arch, layout: ParallelLayout, redundant: int | None) -> None:
        """vLLM's ``MixtureOfExperts`` fields; ``num_moe_layers`` is 0 without load balancing, so vLLM
        sees a MoE model only when it balances one."""
        experts = [layer.ffn.experts for layer in self.layers]
        self.moe_layers = experts if redundant is not None else []
        self.num_moe_layers = len(self.moe_layers)
        self.num_expert_groups = 1  # V4.1 routes without expert groups (n_group = 1)
        self.num_logical_experts = arch.n_routed_experts
        self.num_routed_experts = arch.n_routed_experts
        self.num_redundant_experts = redundant or 0
        self.num_physical_experts = arch.n_routed_experts + self.num_redundant_experts
        self.num_local_physical_experts = len(experts[0].local)
        self.num_shared_experts = 1
        self.expert_weights = []
        # Set by the plugin's balancer (``model_executor.eplb.ExpertBalancer.run_pending``).
        self.eplb_before_forward = None

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int):
        """Elastic expert parallelism (a changing slot count) is not supported."""
        if (num_physical_experts, num_local_physical_experts) != (
            self.num_physical_experts,
            self.num_local_physical_experts,
        ):
            raise NotImplementedError(
                "DeepInfer's V4.1 keeps its physical expert slots fixed (no elastic expert parallelism)"
            )

    # --------------------------------------------------------------- forward
    @property
    def engram_host_window_depth(self) -> int:
        """Columns of the n-gram windows a runner puts in the step metadata (``engram_windows``)
        when the host hashes the Engram rows it keeps (``copy`` transfer); 0: none needed."""
        return self.engram_runtime.window_depth if self.engram_runtime is not None else 0

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        arch = self.arch
        if self.eplb_before_forward is not None:
            self.eplb_before_forward()  # a due rebalance, before this step's first collective
        attn_metadata = get_forward_context().attn_metadata
        if attn_metadata:
            state = StepState.from_metadata(attn_metadata, next(iter(self.cache_layers)))
        else:
            # vLLM's profiling and data-parallel dummy runs: the whole model
            # runs (real activations, every collective), nothing is cached.
            state = StepState.without_caches(positions.clamp(max=self.rope_len - 1))
        T = state.num_tokens
        input_ids = input_ids[:T]
        x = inputs_embeds[:T] if inputs_embeds is not None else self.embed_input_ids(input_ids)
        streams = broadcast_streams(x, arch.hc_mult)
        pre = identity_pre(T, arch.hc_mult, device=x.device)
        is_image = input_ids == arch.image_token_id
        engram_inputs = None
        if self.engram_runtime is not None:
            # Every Engram layer's rows, hashed now; rows in host memory start moving to the device.
            engram_inputs = self.engram_runtime.start(input_ids, state, is_image)
        rows = None  # the step's rows still computed (None: all T)
        compact_rows = self._apply_prefill_truncation(state) if state.has_caches else None
        targets = arch.dspark_target_layer_ids if self.mtp is not None and state.has_caches else ()
        entries: list[tuple[torch.Tensor, bool]] = []  # (entry streams, every row at the time)
        for block in self.layers:
            if block.role.layer_id in targets:
                entries.append((streams, rows is None))
            keep = compact_rows if block.role.layer_id == arch.first_decoder_layer else None
            streams, pre, input_ids, state = block(streams, pre, input_ids, state, engram_inputs, keep)
            if keep is not None:
                rows = keep if rows is None else rows[keep]
        if entries:
            # Targets before a compact boundary saw every row; keep the rows computed last.
            feats = target_features([s[rows] if every and rows is not None else s for s, every in entries])
            self.write_dspark_context(feats, state)
        h = collapse_norm(streams, pre, self.norm)
        if rows is None and T == positions.shape[0]:
            return h
        if rows is None:
            rows = torch.arange(T, device=h.device)
        # Rows a compact prefill dropped are never sampled (their request's
        # last row is always kept), nor are padding rows; they come out as zeros.
        out = torch.zeros(positions.shape[0], arch.hidden_size, dtype=h.dtype, device=h.device)
        out[rows] = h
        return out

    def write_dspark_context(self, features: torch.Tensor, state: StepState) -> None:
        """Every DSpark stage's context keys for the rows of this step ("Context keys")."""
        first = self.mtp[0]
        main = first.main_norm(linear(first.main_proj, features))
        for stage in self.mtp:
            stage.attn.write_context(main, state)

    def draft_block(
        self, bonus: torch.Tensor, anchor: torch.Tensor, req: torch.Tensor, k: int, state: StepState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's parallel draft forward of ``R`` requests (request rows ``req`` of the
        step ``state``): ``hh [R*k, D]`` (pre-norm) and fp32 base logits ``[R*k, V]``."""
        arch = self.arch
        ids, pos = draft_inputs(bonus, anchor, k, arch.dspark_noise_token_id)
        x = self.embed_input_ids(ids)
        streams = broadcast_streams(x, arch.hc_mult)
        pre = identity_pre(x.shape[0], arch.hc_mult, device=x.device)
        for stage in self.mtp:
            streams, pre = stage(streams, pre, ids, pos, req, anchor, k, state)
        hh = hc_collapse(streams, pre)
        base = self.logits_processor(self.head, self.mtp[-1].norm(hh))
        return hh, base

    def _apply_prefill_truncation(self, state: StepState) -> torch.Tensor | None:
        """DeepInfer's prefill truncation of the decoder half (docs/design-notes.md, "Prefill truncation").

        Decoder layers keep window KV only for the last ``keep`` prompt
        positions and clip every window there; ``compact`` additionally
        computes them only for those rows (plus each request's last row, so a
        chunk before the kept rectangle still has a row to sample). Requests
        asking for prompt logprobs keep every row. A step without prompt rows
        has nothing to clip. Returns the kept row indices for ``compact``, else None.
        """
        if self.truncation_mode == "off" or not state.prompt_rows:
            return None
        prompt_lens = state.prompt_lens
        if prompt_lens is None:
            raise RuntimeError(
                "prefill truncation needs prompt lengths in the step metadata; "
                "run V4.1 with a DeepInfer worker (its platforms select one)"
            )
        start = (prompt_lens - self.truncation_keep).clamp_min(0)
        if state.full_prefill is not None:
            start = start.masked_fill(state.full_prefill, 0)
        state.decoder_window_start = start[state.token_req]
        if self.truncation_mode != "compact":
            return None
        keep = state.positions >= state.decoder_window_start
        last_rows = (state.token_req[1:] != state.token_req[:-1]).nonzero(as_tuple=True)[0]
        keep[last_rows] = True
        keep[-1] = True
        return keep.nonzero(as_tuple=True)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The head is bf16 in the release; logits are fp32 (DeepInfer).
        return self.logits_processor(self.head, hidden_states)

    # --------------------------------------------------------------- loading
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint stream vLLM resolved (hub id, folder or cache alike).

        Every tensor is checked against the format as it arrives; DSpark and
        vision tensors are validated and dropped (not held until a feature
        runs them); once the stream ends, every missing, unknown, mis-shaped
        or mis-typed tensor is reported in one ``CheckpointFormatError``.
        """
        specs = checkpoint.expected_tensors(self.arch)
        params = dict(self.named_parameters())
        experts = {name: module for name, module in self.named_modules() if name.endswith(".ffn.experts")}
        found: dict[str, tuple[tuple[int, ...], str]] = {}
        loaded: set[str] = set()
        for raw_name, tensor in weights:
            name = checkpoint.canonical_name(raw_name)
            found[raw_name] = (tuple(tensor.shape), checkpoint.safetensors_dtype(tensor.dtype))
            spec = specs.get(name)
            if spec is None or tuple(tensor.shape) != spec.shape or not spec.accepts(found[raw_name][1]):
                continue  # reported by the validation below
            if name.startswith(self.not_held):
                continue
            m = _EXPERT.match(name)
            if m:
                module, index, proj, kind = m.groups()
                if experts[module].load_expert(proj, kind, int(index), tensor):
                    target = f"{module}.{experts[module].param_name(proj, kind)}"
                    loaded.add(target)
                    self.checkpoint_element_size[target] = tensor.element_size()
                continue
            hc = _HC.match(name)
            target = f"{hc[1]}.hc_{hc[2]}.{hc[3]}" if hc else name
            param = params.get(target)
            if param is None:
                raise checkpoint.CheckpointFormatError(f"tensor {raw_name!r} has no parameter {target!r}")
            self._load_param(param, tensor)
            loaded.add(target)
            self.checkpoint_element_size[target] = tensor.element_size()
        checkpoint.validate_checkpoint_index(self.arch, found)
        missing = set(params) - loaded
        if missing:
            raise checkpoint.CheckpointFormatError(
                f"parameters not loaded: {sorted(missing)[:8]}",
                [f"parameter {m!r} not loaded" for m in sorted(missing)],
            )
        if self.engram_tables is not None:
            self.engram_tables.set_vocab(_engram_vocab_map(self.model_config, self.arch))
            self.engram_runtime.loaded()
        self._log_resident_bytes()
        return loaded

    def _log_resident_bytes(self) -> None:
        from deepinfer_vllm.model_executor.resident_bytes import weight_bytes

        rows = weight_bytes(self)
        lay = self.layout
        logger.info(
            "DeepInfer V4.1 weights resident on tp %d/%d dp %d/%d (expert group rank %d/%d, %s): %s",
            lay.tp_rank,
            lay.tp_size,
            lay.dp_rank,
            lay.dp_size,
            lay.moe_rank,
            lay.moe_size,
            self._expert_split(),
            ", ".join(
                f"{c} {r['resident']} B (checkpoint {r['checkpoint']} B)"
                for c, r in rows.items()
                if r["resident"]
            ),
        )

    def _expert_split(self) -> str:
        if not self.layout.expert_parallel:
            return "expert slices"
        if self.num_moe_layers:
            return f"whole experts, {self.num_local_physical_experts} of {self.num_physical_experts} slots"
        return "whole experts"

    @staticmethod
    def _load_param(param: nn.Parameter, tensor: torch.Tensor) -> None:
        """Copy through the parameter's loader; one-byte formats are reinterpreted
        (never converted), an accepted alternative float dtype is adopted as stored."""
        if tensor.element_size() == 1 and param.element_size() == 1:
            tensor = tensor.view(param.dtype)
        elif tensor.dtype != param.dtype:
            param.data = torch.empty_like(param.data, dtype=tensor.dtype)
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor)


def _engram_vocab_map(model_config, arch: V41Arch) -> torch.Tensor:
    """Raw id -> compressed id from the checkpoint's tokenizer ("Token-id compression")."""
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
