"""config.json presets: ``tiny`` and ``small`` for random-weight checkpoints, ``flash`` the release.

``tiny`` is the test configuration of docs/architecture.md, "Tiny config", except that
``engram_compressed_vocab_size`` is left for the maker: it must equal the class
count of whatever tokenizer is written next to the weights. ``small`` changes
every dimension that tiny keeps at a coincidental value (heads per group,
ranks, window, three n-gram orders, one DSpark stage owning both the first- and
last-stage heads, a wider vision tower), so shape mix-ups show up.
``flash`` is the released configuration ("Text config"), used without weights.
"""

from __future__ import annotations

import copy
from typing import Any

from deepinfer_vllm.configs import ARCHITECTURE, MODEL_TYPE

__all__ = ["PRESETS", "TRAINED_DRAFT_PRESETS", "WEIGHT_PRESETS", "flash_config", "get_preset"]

# The released quantisation (docs/architecture.md, "Quantisation config"), identical for every preset.
_QUANTIZATION = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [32, 32],
    "expert_dtype": "fp4",
}

_TOP_LEVEL = {
    "architectures": [ARCHITECTURE],
    "model_type": MODEL_TYPE,
    "torch_dtype": "bfloat16",
    # DeepInfer's loader reads ``dtype``, Transformers 4 ``torch_dtype``.
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "tie_word_embeddings": False,
}

# Keys with the same value in both presets.
_COMMON_TEXT = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "index_head_dim": 128,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": None,  # filled in by make_checkpoint
    "dspark_noise_token_id": 128799,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "tie_word_embeddings": False,
}

_TINY_TEXT = {
    **_COMMON_TEXT,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "q_lora_rank": 64,
    "o_lora_rank": 64,
    "o_groups": 2,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 1024,
    },
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 4],
    "index_n_heads": 4,
    "index_topk": 4,
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "engram_layer_ids": [1],
    "engram_num_embeddings": [290],  # primes 67, 71 | 73, 79 ("Tiny layer map")
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 64,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "num_nextn_predict_layers": 2,
    "dspark_block_size": 3,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_markov_rank": 16,
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 3,
}

_TINY_VISION = {
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 32,
    "min_pixels": 1764,
    "max_wh_ratio": None,
}

_SMALL_TEXT = {
    **_COMMON_TEXT,
    "hidden_size": 256,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 4,
    "max_position_embeddings": 4096,
    # The nested ``rope_scaling`` form newer checkpoints may ship ("Text config").
    "rope_scaling": {
        "main": {"rope_type": "default"},
        "compress": {
            "rope_type": "yarn",
            "factor": 8,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 512,
        },
    },
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0],
    "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 5, 7],
    "index_n_heads": 8,
    "index_topk": 8,
    "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 2,
    "engram_layer_ids": [1],
    "engram_num_embeddings": [660],  # primes 101, 103 | 107, 109 | 113, 127
    "engram_max_ngram_size": 4,
    "engram_vocab_size": 100,
    "engram_n_heads": 2,
    "engram_head_dim": 64,
    "num_nextn_predict_layers": 1,
    "dspark_block_size": 4,
    "dspark_target_layer_ids": [5, 6, 7],
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 8,
    "dspark_num_experts_per_tok": 2,
}

_SMALL_VISION = {
    **_TINY_VISION,
    "num_hidden_layers": 2,
    "hidden_size": 96,
    "num_attention_heads": 3,
    "intermediate_size": 192,
    "max_image_tokens": 64,
}

# The released Flash config.json (docs/architecture.md, "Configuration"), at its real
# size: for sizing, validation and memory plans (``deepinfer-memory-plan``);
# ``make_checkpoint`` writes its config only (the weights are ~0.75 TB).
_FLASH = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "image_token_id": 129264,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
            "expert_dtype": "fp4",
        },
        "text_config": {
            "vocab_size": 129280,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "qk_rope_head_dim": 64,
            "q_lora_rank": 1280,
            "o_lora_rank": 1024,
            "o_groups": 8,
            "hidden_act": "silu",
            "swiglu_limit": 10.0,
            "rms_norm_eps": 1e-20,
            "max_position_embeddings": 1048576,
            "rope_theta": 10000,
            "compress_rope_theta": 160000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 16,
                "beta_fast": 32,
                "beta_slow": 1,
                "original_max_position_embeddings": 65536,
            },
            "n_routed_experts": 384,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "moe_intermediate_size": 2304,
            "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.5,
            "sliding_window": 128,
            "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
            "kv_source_layer_ids": [2, 8, 14, 20],
            "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
            "index_n_heads": 32,
            "index_head_dim": 128,
            "index_topk": 512,
            "candidate_source_layer_id": 20,
            "candidate_topk_blocks": 2048,
            "candidate_block_size": 8,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "engram_layer_ids": [1, 14],
            "engram_num_embeddings": [384006168, 384016682],
            "engram_max_ngram_size": 4,
            "engram_vocab_size": 16000000,
            "engram_n_heads": 8,
            "engram_head_dim": 256,
            "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092,
            "num_nextn_predict_layers": 3,
            "dspark_block_size": 5,
            "dspark_noise_token_id": 128799,
            "dspark_target_layer_ids": [37, 38, 39],
            "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128,
            "dspark_num_experts_per_tok": 3,
            "attention_bias": False,
            "attention_dropout": 0.0,
        },
        "vision_config": {
            "num_hidden_layers": 32,
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "intermediate_size": 2816,
            "patch_size": 14,
            "rope_theta": 10000,
            "downsample_ratio": 3,
            "max_image_tokens": 1024,
            "min_pixels": 295936,
            "max_wh_ratio": None,
        },
    }

# ``tiny`` with a five-token DSpark block; ``make_checkpoint`` trains its draft
# stages on the target's own greedy continuations (``tools.train_dspark``).
_TINY_DSPARK_TEXT = {**_TINY_TEXT, "dspark_block_size": 5}

# Presets whose weights ``make_checkpoint`` writes (random; ``tiny-dspark``'s draft trained).
WEIGHT_PRESETS = ("tiny", "small", "tiny-dspark")
# Presets whose DSpark draft ``make_checkpoint`` trains after writing the target.
TRAINED_DRAFT_PRESETS = ("tiny-dspark",)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        **_TOP_LEVEL,
        "quantization_config": _QUANTIZATION,
        "text_config": _TINY_TEXT,
        "vision_config": _TINY_VISION,
    },
    "tiny-dspark": {
        **_TOP_LEVEL,
        "quantization_config": _QUANTIZATION,
        "text_config": _TINY_DSPARK_TEXT,
        "vision_config": _TINY_VISION,
    },
    "small": {
        **_TOP_LEVEL,
        "quantization_config": _QUANTIZATION,
        "text_config": _SMALL_TEXT,
        "vision_config": _SMALL_VISION,
    },
    "flash": _FLASH,
}


def get_preset(name: str) -> dict[str, Any]:
    """A deep copy of preset ``name`` (callers may edit it freely)."""
    try:
        return copy.deepcopy(PRESETS[name])
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None


def flash_config() -> dict:
    """The released Flash config.json (a deep copy of preset ``flash``)."""
    return get_preset("flash")
