"""``V41Arch``: a frozen, validated record of every dimension the model code needs.

The keys and their Flash values: docs/architecture.md, "Configuration" and "Layer schedule and
roles".

Built from a config object or config.json dict (nested or flat) with the
per-layer role table (``configs.roles``). Invalid values raise ``ConfigError``
naming the key the way config.json spells it (``text_config.compress_ratios``).

This module never imports vLLM: checkpoint tools use it on hosts without it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_vllm.configs.hf_config import MODEL_TYPE, ConfigError, DeepseekV41Config
from deepinfer_vllm.configs.roles import LayerRole, build_roles, dspark_roles

__all__ = ["V41Arch"]

# What ``quantization_config`` must say (docs/architecture.md, "Quantisation config"; DeepInfer
# accepts only this: docs/design-notes.md, "Configuration checks").
_QUANT_METHODS = ("fp8", "deepseek_v4_fp8")
_QUANT_REQUIRED: dict[str, tuple[Any, ...]] = {
    "weight_block_size": ([32, 32],),
    "scale_fmt": ("ue8m0",),
    "expert_dtype": ("fp4",),
}
_QUANT_OPTIONAL: dict[str, tuple[Any, ...]] = {
    "activation_scheme": ("dynamic",),
    "fmt": ("e4m3",),
}
# Keys that only re-quantised (ModelOpt) exports carry; their tensors differ.
_QUANT_FOREIGN = ("moe_quant_algo", "ignore")


@dataclass(frozen=True)
class V41Arch:
    """Every dimension and layer role of one V4.1 checkpoint, validated once."""

    # Token ids
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    # Trunk
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # Attention
    num_heads: int
    head_dim: int
    rope_dim: int
    nope_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_topk_blocks: int
    candidate_block_size: int
    # MoE
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    top_k: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    # Engram
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int | None
    # DSpark
    num_dspark_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_top_k: int
    enable_confidence_head: bool
    # Vision
    vision_n_layers: int
    vision_dim: int
    vision_n_heads: int
    vision_inter_dim: int
    vision_patch_size: int
    vision_rope_theta: float
    vision_downsample_ratio: int
    vision_max_image_tokens: int
    vision_min_pixels: int
    vision_max_wh_ratio: float | None
    # Layer schedule
    compress_ratios: tuple[int, ...]
    roles: tuple[LayerRole, ...]
    dspark_roles: tuple[LayerRole, ...]
    first_decoder_layer: int
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int

    @property
    def hc_mix_dim(self) -> int:
        """Number of mHC mix logits per site: hc pre + hc post + hc*hc comb."""
        return self.hc_mult * (self.hc_mult + 2)

    @property
    def has_vision(self) -> bool:
        return self.vision_n_layers > 0

    @property
    def engram_n_columns(self) -> int:
        """Hash columns per Engram layer: (max_ngram - 1) orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @classmethod
    def from_config(cls, config: DeepseekV41Config | Mapping[str, Any]) -> V41Arch:
        """Read and validate a config object or config.json dict (nested or flat)."""
        return _build_arch(_nested(config))


def _nested(config: Any) -> dict[str, Any]:
    """Normalise any accepted config form to the released nesting."""
    if isinstance(config, DeepseekV41Config):
        return config.to_dict()
    if isinstance(config, Mapping):
        if isinstance(config.get("text_config"), Mapping):
            return dict(config)
        return DeepseekV41Config(**copy.deepcopy(dict(config))).to_dict()
    if hasattr(config, "to_dict"):  # another PretrainedConfig (e.g. vLLM's flat class)
        return _nested(config.to_dict())
    raise TypeError(f"expected a DeepseekV41Config or a config dict, got {type(config).__name__}")


_REQUIRED = object()


class _Section:
    """Typed reads from one config section; errors name ``<prefix><key>``."""

    def __init__(self, prefix: str, values: Mapping[str, Any]) -> None:
        self.prefix = prefix
        self.values = values

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(f"{self.prefix}{key}", message)

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.values and self.values[key] is not None:
            return self.values[key]
        if default is _REQUIRED:
            raise self.error(key, "missing")
        return default

    def int(self, key: str, default: Any = _REQUIRED, minimum: int | None = 0) -> int:
        value = self.raw(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self.raw(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.error(key, f"expected a number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"expected true/false, got {value!r}")
        return value

    def ints(self, key: str, default: Any = _REQUIRED) -> tuple[int, ...]:
        value = self.raw(key, default)
        if not isinstance(value, (list, tuple)) or any(
            not isinstance(v, int) or isinstance(v, bool) for v in value
        ):
            raise self.error(key, f"expected a list of integers, got {value!r}")
        return tuple(value)

    def layer_ids(self, key: str, n_layers: int, default: Any = _REQUIRED) -> tuple[int, ...]:
        ids = self.ints(key, default)
        if len(set(ids)) != len(ids):
            raise self.error(key, f"duplicate layer ids in {list(ids)}")
        bad = [i for i in ids if not 0 <= i < n_layers]
        if bad:
            raise self.error(key, f"layer ids {bad} outside [0, {n_layers})")
        return tuple(sorted(ids))

    def expect(self, key: str, allowed: tuple[Any, ...], default: Any = _REQUIRED) -> Any:
        value = self.raw(key, default)
        if value not in allowed:
            options = " or ".join(repr(a) for a in allowed)
            raise self.error(key, f"unsupported value {value!r}; V4.1 needs {options}")
        return value


def _check_multiple(section: _Section, key: str, value: int, of: int, why: str) -> None:
    if value % of:
        raise section.error(key, f"{value} is not a multiple of {of} ({why})")


def _check_quantization(quant: Mapping[str, Any]) -> None:
    q = _Section("quantization_config.", quant)
    if not quant:
        raise ConfigError("quantization_config", "missing; V4.1 checkpoints are FP8/FP4 quantised")
    q.expect("quant_method", _QUANT_METHODS)
    for key, allowed in _QUANT_REQUIRED.items():
        value = q.raw(key)
        if isinstance(value, tuple):
            value = list(value)
        if value not in allowed:
            raise q.error(key, f"unsupported value {value!r}; V4.1 needs {allowed[0]!r}")
    for key, allowed in _QUANT_OPTIONAL.items():
        if key in quant:
            q.expect(key, allowed)
    for key in _QUANT_FOREIGN:
        if key in quant:
            raise q.error(key, "re-quantised exports are not the released V4.1 format")


def _compress_rope_scaling(t: _Section) -> dict[str, Any] | None:
    """The YaRN dict of the compressed layers, from the flat or ``{main, compress}`` form."""
    scaling = t.raw("rope_scaling", None)
    key = "rope_scaling"
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise t.error(key, f"expected a dict, got {scaling!r}")
    if "main" in scaling or "compress" in scaling:
        key = "rope_scaling.compress"
        scaling = scaling.get("compress")
        if not isinstance(scaling, Mapping):
            raise t.error(key, "the nested form needs a 'compress' dict")
    s = _Section(f"{t.prefix}{key}.", scaling)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in ("default", None):
        return None
    if rope_type != "yarn":
        raise s.error("rope_type", f"unsupported {rope_type!r}; V4.1 uses 'yarn' or no scaling")
    factor = s.float("factor")
    if factor < 1.0:
        raise s.error("factor", f"must be >= 1, got {factor}")
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": s.int("original_max_position_embeddings", minimum=1),
        "beta_fast": s.float("beta_fast", 32.0),
        "beta_slow": s.float("beta_slow", 1.0),
    }


def _build_arch(cfg: Mapping[str, Any]) -> V41Arch:
    top = _Section("", cfg)
    if cfg.get("model_type", MODEL_TYPE) != MODEL_TYPE:
        raise top.error("model_type", f"expected {MODEL_TYPE!r}, got {cfg.get('model_type')!r}")
    text_values = cfg.get("text_config")
    if not isinstance(text_values, Mapping):
        raise ConfigError("text_config", "missing")
    t = _Section("text_config.", text_values)
    _check_quantization(cfg.get("quantization_config") or {})

    # Fixed choices of the architecture (docs/design-notes.md, "Configuration checks").
    t.expect("hidden_act", ("silu",), "silu")
    t.expect("num_key_value_heads", (1,), 1)
    t.expect("attention_bias", (False,), False)
    if t.float("attention_dropout", 0.0) != 0.0:
        raise t.error("attention_dropout", "must be 0")
    t.expect("scoring_func", ("sqrtsoftplus",), "sqrtsoftplus")
    t.expect("topk_method", ("noaux_tc",), "noaux_tc")
    t.expect("n_group", (1,), 1)
    t.expect("hc_shifted", (True,), True)  # single-pass mHC, no hc_head ("Forward pass")

    vocab = t.int("vocab_size", minimum=1)
    hidden = t.int("hidden_size", minimum=1)
    n_layers = t.int("num_hidden_layers", minimum=1)
    heads = t.int("num_attention_heads", minimum=1)
    head_dim = t.int("head_dim", minimum=1)
    rope_dim = t.int("qk_rope_head_dim", minimum=2)
    if rope_dim % 2 or rope_dim >= head_dim:
        raise t.error("qk_rope_head_dim", f"{rope_dim} must be even and below head_dim {head_dim}")
    nope_dim = head_dim - rope_dim
    given_nope = t.int("qk_nope_head_dim", nope_dim)
    if given_nope != nope_dim:
        raise t.error(
            "qk_nope_head_dim", f"{given_nope} + qk_rope_head_dim {rope_dim} != head_dim {head_dim}"
        )
    q_lora = t.int("q_lora_rank", minimum=1)
    o_lora = t.int("o_lora_rank", minimum=1)
    o_groups = t.int("o_groups", minimum=1)
    if heads % o_groups:
        raise t.error("o_groups", f"{o_groups} does not divide num_attention_heads {heads}")
    moe_inter = t.int("moe_intermediate_size", minimum=1)
    index_heads = t.int("index_n_heads", minimum=1)
    index_head_dim = t.int("index_head_dim", minimum=2)
    if index_head_dim < rope_dim:
        raise t.error("index_head_dim", f"{index_head_dim} is smaller than qk_rope_head_dim {rope_dim}")
    # FP8 tiles are 32x32 and FP4/Engram scales cover 32 columns of a row: the
    # dimensions that are split into those blocks must be multiples of 32.
    for key, value, why in (
        ("hidden_size", hidden, "K of every FP8/FP4 weight"),
        ("moe_intermediate_size", moe_inter, "FP4 expert scales per 32 columns"),
        ("q_lora_rank", q_lora, "32x32 FP8 tiles"),
        ("o_lora_rank", o_lora, "32x32 FP8 tiles of the grouped wo_a"),
        ("head_dim", head_dim, "MXFP8 window KV per 32 dims"),
        ("index_head_dim", index_head_dim, "MXFP4 index keys per 32 dims"),
    ):
        _check_multiple(t, key, value, 32, why)

    n_experts = t.int("n_routed_experts", minimum=1)
    top_k = t.int("num_experts_per_tok", minimum=1)
    if top_k > n_experts:
        raise t.error("num_experts_per_tok", f"{top_k} exceeds n_routed_experts {n_experts}")
    n_shared = t.int("n_shared_experts", 1)
    if n_shared != 1:
        raise t.error("n_shared_experts", f"V4.1 has exactly one shared expert, got {n_shared}")

    hc_mult = t.int("hc_mult", 4, minimum=1)
    max_pos = t.int("max_position_embeddings", minimum=1)
    window = t.int("sliding_window", minimum=1)

    # Layer schedule.
    num_dspark = t.int("num_nextn_predict_layers", t.raw("n_dspark_layers", 0))
    ratios_all = t.ints("compress_ratios")
    if len(ratios_all) not in (n_layers, n_layers + num_dspark):
        raise t.error(
            "compress_ratios",
            f"has {len(ratios_all)} entries; expected num_hidden_layers ({n_layers}) or "
            f"num_hidden_layers + num_nextn_predict_layers ({n_layers + num_dspark})",
        )
    bad = sorted({r for r in ratios_all if r not in (0, 1, 2)})
    if bad:
        raise t.error("compress_ratios", f"ratios {bad} are not supported; V4.1 uses 0, 1 and 2")
    if any(ratios_all[n_layers:]):
        raise t.error("compress_ratios", "DSpark entries must be 0 (SWA-only)")
    ratios = ratios_all[:n_layers]
    kv_ids = t.layer_ids("kv_source_layer_ids", n_layers, [])
    index_ids = t.layer_ids("index_source_layer_ids", n_layers, [])
    index_k_given = t.raw("index_k_source_layer_ids", None) is not None
    if index_k_given and t.layer_ids("index_k_source_layer_ids", n_layers) != kv_ids:
        raise t.error("index_k_source_layer_ids", "index keys are owned by the KV sources in V4.1")
    candidate = t.int("candidate_source_layer_id", -1, minimum=-1)
    if candidate >= 0 and candidate not in kv_ids:
        raise t.error("candidate_source_layer_id", f"layer {candidate} is not a KV source {list(kv_ids)}")
    index_topk = t.int("index_topk", 0)
    if any(ratios) and index_topk < 1:
        raise t.error("index_topk", "compressed layers need index_topk >= 1")
    cand_blocks = t.int("candidate_topk_blocks", 0)
    cand_block_size = t.int("candidate_block_size", 0)
    if candidate >= 0:
        if cand_blocks < 1:
            raise t.error("candidate_topk_blocks", "must be >= 1 when a candidate source is set")
        if cand_block_size < 1:
            raise t.error("candidate_block_size", "must be >= 1 when a candidate source is set")

    engram_ids = tuple(t.ints("engram_layer_ids", []))
    roles, first_decoder = build_roles(t, ratios, kv_ids, index_ids, candidate, engram_ids)
    if any(r.uses_candidates for r in roles) and cand_blocks * cand_block_size < index_topk:
        raise t.error(
            "candidate_topk_blocks",
            f"{cand_blocks} blocks x {cand_block_size} = {cand_blocks * cand_block_size} candidate "
            f"positions cannot hold index_topk={index_topk}",
        )

    # Engram (docs/architecture.md, "Engram").
    engram_rows = t.ints("engram_num_embeddings", [])
    engram_max_ngram = t.int("engram_max_ngram_size", 0)
    engram_heads = t.int("engram_n_heads", 0)
    engram_head_dim = t.int("engram_head_dim", 0)
    if engram_ids:
        if len(set(engram_ids)) != len(engram_ids):
            raise t.error("engram_layer_ids", f"duplicate layer ids in {list(engram_ids)}")
        outside = [i for i in engram_ids if not 0 <= i < n_layers]
        if outside:
            raise t.error("engram_layer_ids", f"layer ids {outside} outside [0, {n_layers})")
        if 0 in engram_ids:
            raise t.error("engram_layer_ids", "layer 0 cannot host Engram (vLLM's first-layer path skips it)")
        if len(engram_rows) != len(engram_ids) or any(r < 1 for r in engram_rows):
            raise t.error(
                "engram_num_embeddings",
                f"need one positive row count per Engram layer, got {list(engram_rows)}",
            )
        if engram_max_ngram < 2:
            raise t.error("engram_max_ngram_size", f"must be >= 2, got {engram_max_ngram}")
        if engram_heads < 1:
            raise t.error("engram_n_heads", f"must be >= 1, got {engram_heads}")
        if engram_head_dim < 32:
            raise t.error("engram_head_dim", f"must be >= 32, got {engram_head_dim}")
        _check_multiple(t, "engram_head_dim", engram_head_dim, 32, "Engram row scales per 32 values")

    # DSpark (docs/architecture.md, "DSpark").
    targets = t.ints("dspark_target_layer_ids", [])
    if num_dspark:
        if not targets:
            raise t.error("dspark_target_layer_ids", "DSpark layers need at least one target layer")
        outside = [i for i in targets if not 0 <= i < n_layers]
        if outside:
            raise t.error("dspark_target_layer_ids", f"layer ids {outside} outside [0, {n_layers})")
    d_experts = t.int("dspark_n_routed_experts", n_experts, minimum=1)
    d_top_k = t.int("dspark_num_experts_per_tok", top_k, minimum=1)
    if d_top_k > d_experts:
        raise t.error("dspark_num_experts_per_tok", f"{d_top_k} exceeds dspark_n_routed_experts {d_experts}")
    noise = t.int("dspark_noise_token_id", 128799)
    if num_dspark and noise >= vocab:
        raise t.error("dspark_noise_token_id", f"{noise} is outside the vocabulary ({vocab})")

    # Token ids live at the top level; fall back to text_config, then to Flash.
    ids = {}
    for key, default in (("bos_token_id", 0), ("eos_token_id", 1), ("pad_token_id", 2)):
        section = top if key in cfg else t
        ids[key] = section.int(key, default)
        if ids[key] >= vocab:
            raise section.error(key, f"{ids[key]} is outside the vocabulary ({vocab})")
    image_token_id = top.int("image_token_id", 129264)

    # Vision (docs/architecture.md, "Vision config"); an absent tower has 0 layers.
    v = _Section("vision_config.", cfg.get("vision_config") or {})
    vision_layers = v.int("num_hidden_layers", 0)
    vision_dim = v.int("hidden_size", 1024, minimum=1)
    vision_heads = v.int("num_attention_heads", 16, minimum=1)
    if vision_layers:
        if vision_dim % vision_heads or (vision_dim // vision_heads) % 4:
            raise v.error(
                "num_attention_heads",
                f"hidden_size {vision_dim} / {vision_heads} heads must be a multiple of 4 (2D RoPE)",
            )
        if image_token_id >= vocab:
            raise top.error("image_token_id", f"{image_token_id} is outside the vocabulary ({vocab})")
    max_wh = v.raw("max_wh_ratio", None)

    return V41Arch(
        vocab_size=vocab,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        image_token_id=image_token_id,
        hidden_size=hidden,
        num_layers=n_layers,
        rms_norm_eps=t.float("rms_norm_eps"),
        hc_mult=hc_mult,
        hc_sinkhorn_iters=t.int("hc_sinkhorn_iters", 20, minimum=1),
        hc_eps=t.float("hc_eps", 1e-6),
        num_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        nope_dim=nope_dim,
        q_lora_rank=q_lora,
        o_lora_rank=o_lora,
        o_groups=o_groups,
        sliding_window=window,
        rope_theta=t.float("rope_theta", 10000.0),
        compress_rope_theta=t.float("compress_rope_theta", 160000.0),
        rope_scaling=_compress_rope_scaling(t),
        max_position_embeddings=max_pos,
        index_n_heads=index_heads,
        index_head_dim=index_head_dim,
        index_topk=index_topk,
        candidate_topk_blocks=cand_blocks,
        candidate_block_size=cand_block_size,
        moe_intermediate_size=moe_inter,
        n_routed_experts=n_experts,
        n_shared_experts=n_shared,
        top_k=top_k,
        routed_scaling_factor=t.float("routed_scaling_factor", 1.5),
        norm_topk_prob=t.bool("norm_topk_prob", True),
        swiglu_limit=t.float("swiglu_limit", 10.0),
        engram_layer_ids=engram_ids,
        engram_num_embeddings=tuple(engram_rows) if engram_ids else (),
        engram_max_ngram_size=engram_max_ngram,
        engram_vocab_size=t.int("engram_vocab_size", 0),
        engram_n_heads=engram_heads,
        engram_head_dim=engram_head_dim,
        engram_pad_token_id=t.int("engram_pad_token_id", ids["pad_token_id"]),
        engram_compressed_vocab_size=t.int("engram_compressed_vocab_size", None, minimum=1)
        if t.raw("engram_compressed_vocab_size", None) is not None
        else None,
        num_dspark_layers=num_dspark,
        dspark_block_size=t.int("dspark_block_size", 5, minimum=1),
        dspark_noise_token_id=noise,
        dspark_target_layer_ids=targets,
        dspark_markov_rank=t.int("dspark_markov_rank", 256, minimum=1),
        dspark_n_routed_experts=d_experts,
        dspark_top_k=d_top_k,
        enable_confidence_head=t.bool("enable_confidence_head", True),
        vision_n_layers=vision_layers,
        vision_dim=vision_dim,
        vision_n_heads=vision_heads,
        vision_inter_dim=v.int("intermediate_size", 2816, minimum=1),
        vision_patch_size=v.int("patch_size", 14, minimum=1),
        vision_rope_theta=v.float("rope_theta", 10000.0),
        vision_downsample_ratio=v.int("downsample_ratio", 3, minimum=1),
        vision_max_image_tokens=v.int("max_image_tokens", 1024, minimum=1),
        vision_min_pixels=v.int("min_pixels", 295936),
        vision_max_wh_ratio=None if max_wh is None else v.float("max_wh_ratio"),
        compress_ratios=ratios,
        roles=roles,
        dspark_roles=dspark_roles(n_layers, num_dspark),
        first_decoder_layer=first_decoder,
        kv_source_layers=kv_ids,
        index_source_layers=index_ids,
        candidate_source_layer=candidate,
    )
