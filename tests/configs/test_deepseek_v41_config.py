"""DeepseekV41Config (nesting, flattening, Transformers round trip) and V41Arch
(role tables of docs/architecture.md, "Tiny layer map" and "Layer schedule and roles", validation
errors naming the config key)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable

import pytest

from deepinfer_vllm.configs import (
    ConfigError,
    DeepseekV41Config,
    V41Arch,
    register_with_transformers,
)
from deepinfer_vllm.tools.presets import PRESETS, flash_config, get_preset


@pytest.fixture()
def tiny() -> dict:
    return get_preset("tiny")


# --------------------------------------------------------------------------- config class


def test_nested_config_exposes_flat_text_attributes(tiny: dict) -> None:
    cfg = DeepseekV41Config(**tiny)
    # What vLLM's ModelConfig reads.
    assert cfg.hidden_size == 128
    assert cfg.num_attention_heads == 4
    assert cfg.num_hidden_layers == 6
    assert cfg.vocab_size == 129280
    assert cfg.max_position_embeddings == 4096
    assert cfg.head_dim == 512
    assert cfg.sliding_window == 8
    assert cfg.compress_ratios == [0, 2, 2, 1, 1, 1, 0, 0]
    assert cfg.tie_word_embeddings is False
    assert cfg.get_text_config() is cfg
    assert cfg.architectures == ["DeepseekV41ForCausalLM"]
    # rope_parameters: the compressed layers' YaRN dict with their own theta.
    assert cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.rope_parameters["factor"] == 4
    assert cfg.rope_parameters["rope_theta"] == 160000.0
    assert cfg.rope_theta == 10000.0
    # Sub-dicts kept, vision keys re-exposed with vLLM's names.
    assert cfg.text_config["hidden_size"] == 128
    assert cfg.vision_config["hidden_size"] == 64
    assert cfg.quantization_config["weight_block_size"] == [32, 32]
    assert (cfg.vision_n_layers, cfg.vision_dim, cfg.vision_n_heads) == (1, 64, 2)
    assert cfg.vision_max_n_token == 32 and cfg.vision_max_wh_ratio is None
    assert cfg.expert_dtype == "fp4"
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.image_token_id) == (0, 1, 2, 129264)


def test_to_dict_round_trips_to_the_released_nesting(tiny: dict) -> None:
    out = DeepseekV41Config(**tiny).to_dict()
    for key in (
        "text_config",
        "vision_config",
        "quantization_config",
        "architectures",
        "model_type",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "image_token_id",
        "tie_word_embeddings",
    ):
        assert out[key] == tiny[key], key
    assert out["dtype"] == "bfloat16"
    # No flattened duplicates at the top level.
    assert "hidden_size" not in out and "rope_parameters" not in out and "vision_dim" not in out
    # And the dict constructs an equal config again.
    assert DeepseekV41Config(**out).to_dict()["text_config"] == tiny["text_config"]


def test_save_pretrained_and_autoconfig(tiny: dict, tmp_path) -> None:
    register_with_transformers()
    register_with_transformers()  # idempotent
    DeepseekV41Config(**tiny).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v41"
    assert saved["text_config"] == tiny["text_config"]
    assert saved["vision_config"] == tiny["vision_config"]
    assert saved["quantization_config"] == tiny["quantization_config"]
    assert "hidden_size" not in saved

    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, DeepseekV41Config)
    assert loaded.hidden_size == 128 and loaded.sliding_window == 8
    assert V41Arch.from_config(loaded) == V41Arch.from_config(tiny)
    assert DeepseekV41Config.from_pretrained(tmp_path).num_hidden_layers == 6


def test_flat_dict_is_accepted(tiny: dict) -> None:
    flat = {k: v for k, v in tiny.items() if k != "text_config"}
    flat.update(copy.deepcopy(tiny["text_config"]))
    cfg = DeepseekV41Config(**flat)
    assert cfg.hidden_size == 128
    assert cfg.to_dict()["text_config"] == tiny["text_config"]
    assert V41Arch.from_config(flat) == V41Arch.from_config(tiny)


def test_vllm_style_flat_dict_is_accepted(tiny: dict) -> None:
    """vLLM's in-tree class exposes rope_parameters and vision_* instead of the sub-dicts."""
    text = copy.deepcopy(tiny["text_config"])
    flat = {"architectures": tiny["architectures"], "quantization_config": tiny["quantization_config"]}
    flat["rope_parameters"] = dict(text.pop("rope_scaling"), rope_theta=10000.0)
    flat.update(text)
    flat.update(
        vision_n_layers=1,
        vision_dim=64,
        vision_n_heads=2,
        vision_inter_dim=128,
        vision_max_n_token=32,
        vision_min_pixels=1764,
    )
    arch, ref = V41Arch.from_config(flat), V41Arch.from_config(tiny)
    assert arch.rope_scaling == ref.rope_scaling
    assert (arch.vision_n_layers, arch.vision_dim, arch.vision_inter_dim) == (1, 64, 128)
    assert arch.roles == ref.roles


# --------------------------------------------------------------------------- role tables


def _role_rows(arch: V41Arch) -> list[tuple]:
    return [
        (
            r.layer_id,
            r.ratio,
            r.kind,
            r.kv_source,
            r.index_source,
            r.is_candidate_source,
            r.uses_candidates,
            r.has_engram,
            r.is_decoder,
            r.rope,
        )
        for r in arch.roles
    ]


def test_tiny_roles_match_spec_18_2(tiny: dict) -> None:
    arch = V41Arch.from_config(tiny)
    # layer, ratio, role, kv src, index src, cand. source, uses cand., engram, decoder, rope
    assert _role_rows(arch) == [
        (0, 0, "swa", None, None, False, False, False, False, "main"),
        (1, 2, "full", 1, 1, False, False, True, False, "compress"),
        (2, 2, "reuse", 1, 1, False, False, False, False, "compress"),
        (3, 1, "full", 3, 3, True, False, False, True, "compress"),
        (4, 1, "reindex", 3, 4, False, True, False, True, "compress"),
        (5, 1, "reuse", 3, 4, False, False, False, True, "compress"),
    ]
    assert [(r.layer_id, r.kind, r.rope, r.is_decoder) for r in arch.dspark_roles] == [
        (6, "swa", "main", False),
        (7, "swa", "main", False),
    ]
    assert arch.first_decoder_layer == 3
    assert arch.kv_source_layers == (1, 3)
    assert arch.index_source_layers == (1, 3, 4)
    assert arch.candidate_source_layer == 3
    assert arch.num_dspark_layers == 2
    assert (arch.dspark_n_routed_experts, arch.dspark_top_k) == (4, 3)
    assert (arch.n_routed_experts, arch.top_k) == (8, 2)
    assert (arch.nope_dim, arch.rope_dim, arch.hc_mix_dim) == (448, 64, 24)
    assert arch.engram_num_embeddings == (290,)
    assert arch.rope_scaling == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }


def test_flash_roles_match_spec_3() -> None:
    arch = V41Arch.from_config(flash_config())
    roles = arch.roles
    assert len(roles) == 40 and len(arch.dspark_roles) == 3
    full = [r.layer_id for r in roles if r.kind == "full"]
    reindex = [r.layer_id for r in roles if r.kind == "reindex"]
    swa = [r.layer_id for r in roles if r.kind == "swa"]
    assert full == [2, 8, 14, 20]
    assert reindex == [24, 28, 32, 36]
    assert swa == [0, 1]
    assert [r.layer_id for r in roles if r.is_candidate_source] == [20]
    assert [r.layer_id for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert [r.layer_id for r in roles if r.has_engram] == [1, 14]
    assert arch.first_decoder_layer == 20
    assert [r.layer_id for r in roles if r.is_decoder] == list(range(20, 40))
    assert all(r.ratio == 2 for r in roles[2:20]) and all(r.ratio == 1 for r in roles[20:])
    assert all(r.rope == "compress" for r in roles[2:]) and roles[1].rope == "main"
    # Reuse layers read the most recent sources ("Layer schedule and roles").
    assert [roles[i].kv_source for i in (3, 7, 9, 13, 15, 19)] == [2, 2, 8, 8, 14, 14]
    assert {roles[i].kv_source for i in range(20, 40)} == {20}
    assert [roles[i].index_source for i in (21, 23, 25, 27, 29, 33, 37, 39)] == [
        20,
        20,
        24,
        24,
        28,
        32,
        36,
        36,
    ]
    assert [r.layer_id for r in arch.dspark_roles] == [40, 41, 42]
    assert (arch.dspark_n_routed_experts, arch.dspark_top_k, arch.dspark_target_layer_ids) == (
        128,
        3,
        (37, 38, 39),
    )
    assert arch.engram_n_columns == 24


def test_both_compress_ratio_lengths_are_accepted(tiny: dict) -> None:
    tiny["text_config"]["compress_ratios"] = tiny["text_config"]["compress_ratios"][:6]
    arch = V41Arch.from_config(tiny)
    assert arch.compress_ratios == (0, 2, 2, 1, 1, 1) and len(arch.dspark_roles) == 2


def test_nested_rope_scaling_form() -> None:
    arch = V41Arch.from_config(PRESETS["small"])
    assert arch.rope_scaling["factor"] == 8.0
    assert arch.rope_scaling["original_max_position_embeddings"] == 512
    cfg = DeepseekV41Config(**get_preset("small"))
    assert cfg.rope_parameters["rope_type"] == "yarn"  # flat for vLLM's max-len logic


# --------------------------------------------------------------------------- validation


def _text(**changes) -> Callable[[dict], None]:
    def apply(cfg: dict) -> None:
        for key, value in changes.items():
            if value is _DELETE:
                del cfg["text_config"][key]
            else:
                cfg["text_config"][key] = value

    return apply


def _quant(**changes) -> Callable[[dict], None]:
    def apply(cfg: dict) -> None:
        cfg["quantization_config"].update(changes)

    return apply


_DELETE = object()

_BAD = [
    ("hidden_act", _text(hidden_act="gelu"), "text_config.hidden_act"),
    ("kv_heads", _text(num_key_value_heads=2), "text_config.num_key_value_heads"),
    ("missing_key", _text(hidden_size=_DELETE), "text_config.hidden_size"),
    ("not_multiple_of_32", _text(hidden_size=100), "text_config.hidden_size"),
    ("head_dim", _text(qk_nope_head_dim=400), "text_config.qk_nope_head_dim"),
    ("o_groups", _text(o_groups=3), "text_config.o_groups"),
    ("ratios_length", _text(compress_ratios=[0, 2, 2, 1, 1, 1, 0]), "text_config.compress_ratios"),
    ("ratio_value", _text(compress_ratios=[0, 4, 4, 1, 1, 1, 0, 0]), "text_config.compress_ratios"),
    ("dspark_ratio", _text(compress_ratios=[0, 2, 2, 1, 1, 1, 0, 2]), "text_config.compress_ratios"),
    ("layers_vs_ratios", _text(num_hidden_layers=5), "text_config.compress_ratios"),
    (
        "swa_source",
        _text(kv_source_layer_ids=[0, 1, 3], index_source_layer_ids=[0, 1, 3, 4]),
        "text_config.kv_source_layer_ids",
    ),
    ("swa_index_source", _text(index_source_layer_ids=[0, 1, 3, 4]), "text_config.index_source_layer_ids"),
    (
        "no_kv_source",
        _text(kv_source_layer_ids=[1], index_source_layer_ids=[1, 3, 4], candidate_source_layer_id=-1),
        "text_config.kv_source_layer_ids",
    ),
    ("kv_not_in_index", _text(index_source_layer_ids=[3, 4]), "text_config.index_source_layer_ids"),
    ("swa_after_compressed", _text(compress_ratios=[0, 2, 0, 1, 1, 1, 0, 0]), "text_config.compress_ratios"),
    ("candidate_not_kv", _text(candidate_source_layer_id=4), "text_config.candidate_source_layer_id"),
    ("candidate_capacity", _text(candidate_topk_blocks=1), "text_config.candidate_topk_blocks"),
    ("top_k", _text(num_experts_per_tok=9), "text_config.num_experts_per_tok"),
    ("shared_experts", _text(n_shared_experts=2), "text_config.n_shared_experts"),
    ("engram_layer_0", _text(engram_layer_ids=[0]), "text_config.engram_layer_ids"),
    ("engram_rows", _text(engram_num_embeddings=[290, 5]), "text_config.engram_num_embeddings"),
    ("engram_head_dim", _text(engram_head_dim=48), "text_config.engram_head_dim"),
    (
        "rope_type",
        _text(rope_scaling={"rope_type": "linear", "factor": 2}),
        "text_config.rope_scaling.rope_type",
    ),
    ("dspark_top_k", _text(dspark_num_experts_per_tok=5), "text_config.dspark_num_experts_per_tok"),
    ("scoring", _text(scoring_func="softmax"), "text_config.scoring_func"),
    ("quant_method", _quant(quant_method="gptq"), "quantization_config.quant_method"),
    ("block_size", _quant(weight_block_size=[128, 128]), "quantization_config.weight_block_size"),
    ("scale_fmt", _quant(scale_fmt="float32"), "quantization_config.scale_fmt"),
    ("expert_dtype", _quant(expert_dtype="fp8"), "quantization_config.expert_dtype"),
    ("activation_scheme", _quant(activation_scheme="static"), "quantization_config.activation_scheme"),
    ("model_type", lambda cfg: cfg.update(model_type="llama"), "model_type"),
]


@pytest.mark.parametrize("mutate,key", [pytest.param(m, k, id=i) for i, m, k in _BAD])
def test_validation_names_the_offending_key(tiny: dict, mutate, key: str) -> None:
    mutate(tiny)
    with pytest.raises(ConfigError) as info:
        V41Arch.from_config(tiny)
    assert info.value.key == key
    assert str(info.value).startswith(f"{key}:")


def test_deepseek_v4_fp8_quant_method_is_accepted(tiny: dict) -> None:
    tiny["quantization_config"]["quant_method"] = "deepseek_v4_fp8"
    assert V41Arch.from_config(tiny).num_layers == 6


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
