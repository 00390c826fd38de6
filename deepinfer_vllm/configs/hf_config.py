"""``DeepseekV41Config``: the Transformers config class of DeepSeek-V4.1.

The keys: docs/architecture.md, "Configuration".

The release nests the language model under ``text_config``; vLLM reads flat
attributes, so every text key is also exposed at the top level. ``to_dict``
restores the nesting, so ``save_pretrained`` writes the released layout.

This module never imports vLLM: checkpoint tools use it on hosts without it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

__all__ = [
    "ARCHITECTURE",
    "DSPARK_DRAFT_ARCHITECTURE",
    "MODEL_TYPE",
    "TEXT_MODEL_TYPE",
    "ConfigError",
    "DeepseekV41Config",
    "is_v41_config",
    "register_with_transformers",
]

ARCHITECTURE = "DeepseekV41ForCausalLM"
# vLLM's architecture for V4.1's DSpark draft when it builds the draft's config itself
# (``SpeculativeConfig`` rewrites ``model_type`` to ``deepseek_mtp``).
DSPARK_DRAFT_ARCHITECTURE = "DSparkV41DraftModel"
MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"


def is_v41_config(hf_config: Any) -> bool:
    """A V4.1 checkpoint's config, whichever class serves it: by ``model_type``, or by
    architecture when a loader rewrote the type (vLLM's view of the DSpark draft has
    ``model_type="deepseek_mtp"`` and the checkpoint's or the draft's architecture). The
    one V4.1 check of the package."""
    if getattr(hf_config, "model_type", None) == MODEL_TYPE:
        return True
    archs = getattr(hf_config, "architectures", None) or []
    return ARCHITECTURE in archs or DSPARK_DRAFT_ARCHITECTURE in archs

# Keys of ``text_config`` (docs/architecture.md, "Text config", with the optional keys vLLM reads). Only
# used to recognise an already-flat dict; nested input keeps whatever it has.
_TEXT_KEY_NAMES = """
vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
qk_rope_head_dim qk_nope_head_dim q_lora_rank o_lora_rank o_groups hidden_act swiglu_limit
rms_norm_eps max_position_embeddings rope_theta compress_rope_theta rope_scaling
n_routed_experts n_shared_experts num_experts_per_tok moe_intermediate_size scoring_func
topk_method norm_topk_prob routed_scaling_factor sliding_window compress_ratios
kv_source_layer_ids index_source_layer_ids index_k_source_layer_ids index_n_heads
index_head_dim index_topk candidate_source_layer_id candidate_topk_blocks candidate_block_size
hc_mult hc_sinkhorn_iters hc_eps hc_shifted engram_layer_ids engram_num_embeddings
engram_max_ngram_size engram_vocab_size engram_n_heads engram_head_dim engram_pad_token_id
engram_compressed_vocab_size num_nextn_predict_layers n_dspark_layers dspark_block_size
dspark_noise_token_id dspark_target_layer_ids dspark_markov_rank dspark_n_routed_experts
dspark_num_experts_per_tok dspark_target_attn_input attention_bias attention_dropout
initializer_range use_cache num_hash_layers n_group topk_group draft_vocab_size
enable_confidence_head sample_from_anchor use_fp4_sparse_kv
"""
_TEXT_KEYS = frozenset(_TEXT_KEY_NAMES.split())

# Keys the release repeats at the top level and inside text_config.
_SHARED_KEYS = ("tie_word_embeddings",)

# vision_config key -> (flat attribute vLLM reads, vLLM's default): docs/architecture.md, "Config nesting".
_VISION_ATTRS: tuple[tuple[str, str, Any], ...] = (
    ("num_hidden_layers", "vision_n_layers", 0),
    ("hidden_size", "vision_dim", 1024),
    ("num_attention_heads", "vision_n_heads", 16),
    ("intermediate_size", "vision_inter_dim", 2816),
    ("patch_size", "vision_patch_size", 14),
    ("rope_theta", "vision_rope_theta", 10000.0),
    ("downsample_ratio", "vision_downsample_ratio", 3),
    ("max_image_tokens", "vision_max_n_token", 1024),
    ("min_pixels", "vision_min_pixels", 295936),
    ("max_wh_ratio", "vision_max_wh_ratio", None),
)
_VISION_FLAT = frozenset(flat for _, flat, _ in _VISION_ATTRS)

# Top-level keys ``to_dict`` keeps even when text_config repeats them
# (the tiny config.json repeats tie_word_embeddings there).
_TOPLEVEL_KEEP = frozenset(
    {
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "image_token_id",
        "tie_word_embeddings",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
    }
)

# Attributes derived in ``__init__``; ``to_dict`` drops them again.
_DERIVED = frozenset({"rope_parameters", "expert_dtype"}) | _VISION_FLAT


class ConfigError(ValueError):
    """A config.json value the V4.1 model cannot run with.

    ``key`` is the dotted path as config.json spells it, e.g.
    ``text_config.compress_ratios``.
    """

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class DeepseekV41Config(PretrainedConfig):
    """HF config for ``DeepseekV41ForCausalLM`` that accepts nested or flat input.

    Nested input is the released layout (``text_config``/``vision_config``/
    ``quantization_config`` plus top-level token ids). A flat dict (every text
    key at the top level, as vLLM's in-tree class exposes it) is folded back
    into ``text_config`` first, so both forms behave the same.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        text_config: Mapping[str, Any] | None = None,
        vision_config: Mapping[str, Any] | None = None,
        quantization_config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        text = copy.deepcopy(dict(text_config or {}))
        vision = copy.deepcopy(dict(vision_config or {}))
        kwargs.pop("model_type", None)
        if text_config is None:
            # Flat input: the keys both levels carry go to both (``tie_word_embeddings``).
            for key in _SHARED_KEYS:
                if key in kwargs:
                    text[key] = kwargs[key]
            if any(k in _TEXT_KEYS for k in kwargs):
                text.setdefault("model_type", TEXT_MODEL_TYPE)
        for key in [k for k in kwargs if k in _TEXT_KEYS]:
            text[key] = kwargs.pop(key)  # an explicit flat value overrides the nested one
        flat_rope = kwargs.pop("rope_parameters", None)
        if flat_rope is not None and "rope_scaling" not in text:
            text["rope_scaling"] = copy.deepcopy(flat_rope)
        for hf_key, flat_key, _ in _VISION_ATTRS:
            if flat_key in kwargs:
                value = kwargs.pop(flat_key)
                if vision_config is None:
                    vision[hf_key] = value
        kwargs.pop("expert_dtype", None)
        kwargs.setdefault("architectures", [ARCHITECTURE])

        self.text_config = text
        self.vision_config = vision
        self.quantization_config = copy.deepcopy(dict(quantization_config or {}))
        for key, value in text.items():
            if key in ("model_type", "rope_scaling"):
                continue
            # Transformers properties (e.g. rope_scaling) must not be clobbered.
            if isinstance(getattr(type(self), key, None), property):
                continue
            setattr(self, key, copy.deepcopy(value))

        super().__init__(**kwargs)

        # vLLM derives max_model_len from ``rope_parameters``; expose the
        # (flat) compressed-layer dict. Set after super().__init__ so
        # Transformers does not re-standardise it with the main rope_theta.
        self.rope_parameters = _flat_rope_parameters(text)
        self.expert_dtype = self.quantization_config.get("expert_dtype", "fp4")
        for hf_key, flat_key, default in _VISION_ATTRS:
            setattr(self, flat_key, vision.get(hf_key, default))

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> DeepseekV41Config:
        """The flat attributes are the text config; ``text_config`` is a plain dict."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Serialise in the released nesting (flat text attributes folded back)."""
        out = super().to_dict()
        text = copy.deepcopy(self.text_config)
        for key in list(text):
            if key in ("model_type", "rope_scaling"):
                continue
            if key in self.__dict__:
                text[key] = copy.deepcopy(self.__dict__[key])
        for key in list(out):
            if key in _TOPLEVEL_KEEP:
                continue
            if key in text or key in _DERIVED or key.startswith("_"):
                out.pop(key)
        out["text_config"] = text
        out["vision_config"] = copy.deepcopy(self.vision_config)
        out["quantization_config"] = copy.deepcopy(self.quantization_config)
        out["model_type"] = MODEL_TYPE
        # Transformers 5 (and DeepInfer's loader) read ``dtype``; the legacy
        # ``torch_dtype`` input is folded into it by PretrainedConfig.
        out.pop("torch_dtype", None)
        return out


def _flat_rope_parameters(text: Mapping[str, Any]) -> dict[str, Any]:
    """The compressed layers' RoPE dict in the flat form vLLM's max-len logic expects."""
    scaling = text.get("rope_scaling")
    if isinstance(scaling, Mapping) and isinstance(scaling.get("compress"), Mapping):
        scaling = scaling["compress"]
    params = copy.deepcopy(dict(scaling)) if isinstance(scaling, Mapping) else {}
    params.setdefault("rope_type", params.get("type", "default"))
    params["rope_theta"] = text.get("compress_rope_theta", text.get("rope_theta", 10000.0))
    return params


def register_with_transformers() -> None:
    """Make ``AutoConfig`` resolve ``model_type: deepseek_v41`` to our class (idempotent)."""
    from transformers import AutoConfig

    try:
        AutoConfig.register(MODEL_TYPE, DeepseekV41Config, exist_ok=True)
    except ValueError as exc:  # a Transformers release that ships its own class
        if "already" not in str(exc):
            raise
