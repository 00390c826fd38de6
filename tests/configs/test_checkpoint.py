"""The released checkpoint format: expected tensors (tiny and Flash shapes from the
spec), header validation errors, sharded headers and the dequantising iterator."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_vllm.configs import ConfigError, V41Arch
from deepinfer_vllm.configs import checkpoint as ckpt
from deepinfer_vllm.configs.checkpoint import CheckpointFormatError
from deepinfer_vllm.tools.make_checkpoint import make_checkpoint
from deepinfer_vllm.tools.presets import get_preset

F8, E8, I8, BF, F32 = "F8_E4M3", "F8_E8M0", "I8", "BF16", "F32"


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_arch(tiny_dir: Path) -> V41Arch:
    return V41Arch.from_config(json.loads((tiny_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def tiny_found(tiny_dir: Path) -> dict:
    return ckpt.read_safetensors_index(tiny_dir)


@pytest.fixture(scope="module")
def tiny_tensors(tiny_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(tiny_dir / "model.safetensors"))


# --------------------------------------------------------------------------- expected tensors


def test_header_equals_expected_tensors(tiny_arch: V41Arch, tiny_found: dict) -> None:
    expected = {name: (spec.shape, spec.dtype) for name, spec in ckpt.expected_tensors(tiny_arch).items()}
    assert tiny_found == expected
    ckpt.validate_checkpoint_index(tiny_arch, tiny_found)


# The tiny checkpoint's shapes, written out by hand (docs/architecture.md, "Tiny tensor shapes").
TINY_SHAPES = {
    "embed.weight": ([129280, 128], BF),
    "head.weight": ([129280, 128], BF),
    "norm.weight": ([128], BF),
    "layers.4.attn_norm.weight": ([128], BF),
    "layers.0.hc_attn_fn": ([24, 512], F32),
    "layers.0.hc_ffn_base": ([24], F32),
    "layers.5.hc_attn_scale": ([3], F32),
    "layers.0.attn.wq_a.weight": ([64, 128], F8),
    "layers.0.attn.wq_a.scale": ([2, 4], E8),
    "layers.0.attn.q_norm.weight": ([64], BF),
    "layers.0.attn.wq_b.weight": ([2048, 64], F8),
    "layers.0.attn.wq_b.scale": ([64, 2], E8),
    "layers.2.attn.wkv.weight": ([512, 128], F8),
    "layers.2.attn.wkv.scale": ([16, 4], E8),
    "layers.2.attn.kv_norm.weight": ([512], BF),
    "layers.3.attn.wo_a.weight": ([128, 1024], F8),
    "layers.3.attn.wo_a.scale": ([4, 32], E8),
    "layers.3.attn.wo_b.weight": ([128, 128], F8),
    "layers.3.attn.wo_b.scale": ([4, 4], E8),
    "layers.0.attn.attn_sink": ([4], F32),
    "layers.1.attn.compressor.wkv.weight": ([512, 128], F32),
    "layers.1.attn.compressor.wgate.weight": ([512, 128], F32),
    "layers.3.attn.compressor.wkv.weight": ([512, 128], F32),
    "layers.1.attn.compressor.norm.weight": ([512], BF),
    "layers.3.attn.compressor.norm.weight": ([512], BF),
    "layers.1.attn.indexer.wk.weight": ([128, 512], BF),
    "layers.3.attn.indexer.k_norm.weight": ([128], BF),
    "layers.4.attn.indexer.wq_b.weight": ([512, 64], F8),
    "layers.4.attn.indexer.wq_b.scale": ([16, 2], E8),
    "layers.1.attn.indexer.weights_proj.weight": ([4, 128], BF),
    "layers.2.ffn.gate.weight": ([8, 128], BF),
    "layers.2.ffn.gate.bias": ([8], F32),
    "layers.2.ffn.gate.bias_vl": ([8], F32),
    "layers.5.ffn.experts.7.w1.weight": ([64, 64], I8),
    "layers.5.ffn.experts.7.w1.scale": ([64, 4], E8),
    "layers.5.ffn.experts.0.w3.weight": ([64, 64], I8),
    "layers.0.ffn.experts.3.w2.weight": ([128, 32], I8),
    "layers.0.ffn.experts.3.w2.scale": ([128, 2], E8),
    "layers.0.ffn.shared_experts.w1.weight": ([64, 128], F8),
    "layers.0.ffn.shared_experts.w1.scale": ([2, 4], E8),
    "layers.0.ffn.shared_experts.w2.weight": ([128, 64], F8),
    "layers.0.ffn.shared_experts.w2.scale": ([4, 2], E8),
    "layers.1.engram.embed.weight": ([290, 32], F8),
    "layers.1.engram.embed.scale": ([290, 1], E8),
    "layers.1.engram.wkv.weight": ([640, 128], F8),
    "layers.1.engram.wkv.scale": ([20, 4], E8),
    "layers.1.engram.q_weight": ([4, 128], BF),
    "layers.1.engram.k_weight": ([4, 128], BF),
    "mtp.0.ffn.gate.weight": ([4, 128], BF),
    "mtp.1.ffn.experts.3.w2.weight": ([128, 32], I8),
    "mtp.0.attn.wq_b.scale": ([64, 2], E8),
    "mtp.0.main_proj.weight": ([128, 384], F8),
    "mtp.0.main_proj.scale": ([4, 12], E8),
    "mtp.0.main_norm.weight": ([128], BF),
    "mtp.1.norm.weight": ([128], BF),
    "mtp.1.markov_head.embed.weight": ([129280, 16], BF),
    "mtp.1.markov_head.head.weight": ([129280, 16], BF),
    "mtp.1.confidence_head.proj.weight": ([1, 144], F32),
    "vision.patch_embed.proj.weight": ([64, 588], BF),
    "vision.patch_embed.proj.bias": ([64], BF),
    "vision.blocks.0.norm1.weight": ([64], F32),
    "vision.blocks.0.norm2.weight": ([64], F32),
    "vision.norm.weight": ([64], F32),
    "vision.blocks.0.attn.wqkv.weight": ([192, 64], BF),
    "vision.blocks.0.attn.wqkv.bias": ([192], BF),
    "vision.blocks.0.attn.wo.weight": ([64, 64], BF),
    "vision.blocks.0.attn.wo.bias": ([64], BF),
    "vision.blocks.0.mlp.w1.weight": ([256, 64], BF),
    "vision.blocks.0.mlp.w2.weight": ([64, 128], BF),
    "aligner.w1.weight": ([128, 576], BF),
    "aligner.w1.bias": ([128], BF),
    "aligner.w2.weight": ([128, 128], BF),
    "aligner.w2.bias": ([128], BF),
    "image_start": ([128], BF),
    "image_end": ([128], BF),
    "image_newline": ([128], BF),
}

TINY_ABSENT = [
    "layers.0.attn.compressor.wkv.weight",  # SWA-only
    "layers.2.attn.compressor.wkv.weight",  # reuse
    "layers.2.attn.indexer.wq_b.weight",
    "layers.3.attn.compressor.wgate.weight",  # ratio 1: no gate
    "layers.4.attn.indexer.wk.weight",  # reindex: keys of layer 3
    "layers.4.attn.compressor.norm.weight",
    "layers.5.attn.indexer.wq_b.weight",  # reuse
    "layers.0.engram.embed.weight",
    "layers.0.ffn.experts.8.w1.weight",
    "mtp.0.ffn.experts.4.w1.weight",
    "mtp.0.attn.compressor.wkv.weight",
    "mtp.0.markov_head.embed.weight",
    "mtp.1.main_proj.weight",
    "mtp.0.embed.weight",
    "hc_head_fn",
    "image_pad",
]


def test_tiny_shapes_match_spec_18_4(tiny_found: dict) -> None:
    for name, (shape, dtype) in TINY_SHAPES.items():
        assert name in tiny_found, name
        assert tiny_found[name] == (tuple(shape), dtype), name
    for name in TINY_ABSENT:
        assert name not in tiny_found, name
    assert sum(".experts." in n and n.endswith(".weight") for n in tiny_found) == 6 * 8 * 3 + 2 * 4 * 3


def _flash() -> dict:
    """Flash's dimensions ("Text config", "Vision config") on top of the tiny preset's key set."""
    cfg = get_preset("tiny")
    cfg["text_config"].update(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=64,
        q_lora_rank=1280,
        o_lora_rank=1024,
        o_groups=8,
        moe_intermediate_size=2304,
        n_routed_experts=384,
        num_experts_per_tok=6,
        compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        kv_source_layer_ids=[2, 8, 14, 20],
        index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        index_n_heads=32,
        index_topk=512,
        candidate_source_layer_id=20,
        candidate_topk_blocks=2048,
        candidate_block_size=8,
        engram_layer_ids=[1, 14],
        engram_num_embeddings=[384006168, 384016682],
        engram_max_ngram_size=4,
        engram_vocab_size=16000000,
        engram_n_heads=8,
        engram_head_dim=256,
        num_nextn_predict_layers=3,
        dspark_target_layer_ids=[37, 38, 39],
        dspark_markov_rank=256,
        dspark_n_routed_experts=128,
        dspark_num_experts_per_tok=3,
        sliding_window=128,
        max_position_embeddings=1048576,
    )
    cfg["vision_config"].update(
        num_hidden_layers=32,
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=2816,
        max_image_tokens=1024,
        min_pixels=295936,
    )
    return cfg


# Flash shapes: docs/architecture.md, "Attention parameters", "Mixture of experts", "Checkpoint tensors".
FLASH_SHAPES = {
    "layers.0.hc_attn_fn": ([24, 20480], F32),
    "layers.0.attn.wq_a.scale": ([40, 160], E8),
    "layers.0.attn.wq_b.weight": ([32768, 1280], F8),
    "layers.0.attn.wq_b.scale": ([1024, 40], E8),
    "layers.0.attn.wkv.scale": ([16, 160], E8),
    "layers.0.attn.wo_a.weight": ([8192, 4096], F8),
    "layers.0.attn.wo_a.scale": ([256, 128], E8),
    "layers.0.attn.wo_b.scale": ([160, 256], E8),
    "layers.0.attn.attn_sink": ([64], F32),
    "layers.8.attn.compressor.wgate.weight": ([512, 5120], F32),
    "layers.20.attn.indexer.wk.weight": ([128, 512], BF),
    "layers.36.attn.indexer.wq_b.weight": ([4096, 1280], F8),
    "layers.36.attn.indexer.wq_b.scale": ([128, 40], E8),
    "layers.24.attn.indexer.weights_proj.weight": ([32, 5120], BF),
    "layers.0.ffn.gate.weight": ([384, 5120], BF),
    "layers.39.ffn.experts.383.w1.weight": ([2304, 2560], I8),
    "layers.39.ffn.experts.383.w1.scale": ([2304, 160], E8),
    "layers.0.ffn.experts.0.w2.weight": ([5120, 1152], I8),
    "layers.0.ffn.experts.0.w2.scale": ([5120, 72], E8),
    "layers.0.ffn.shared_experts.w1.scale": ([72, 160], E8),
    "layers.0.ffn.shared_experts.w2.scale": ([160, 72], E8),
    "layers.1.engram.embed.weight": ([384006168, 256], F8),
    "layers.1.engram.embed.scale": ([384006168, 8], E8),
    "layers.14.engram.embed.weight": ([384016682, 256], F8),
    "layers.1.engram.wkv.weight": ([25600, 6144], F8),
    "layers.1.engram.wkv.scale": ([800, 192], E8),
    "layers.14.engram.q_weight": ([4, 5120], BF),
    "mtp.2.ffn.gate.weight": ([128, 5120], BF),
    "mtp.0.main_proj.weight": ([5120, 15360], F8),
    "mtp.2.markov_head.head.weight": ([129280, 256], BF),
    "mtp.2.confidence_head.proj.weight": ([1, 5376], F32),
    "vision.patch_embed.proj.weight": ([1024, 588], BF),
    "vision.blocks.31.attn.wqkv.weight": ([3072, 1024], BF),
    "vision.blocks.31.mlp.w1.weight": ([5632, 1024], BF),
    "vision.blocks.31.mlp.w2.weight": ([1024, 2816], BF),
    "aligner.w1.weight": ([5120, 9216], BF),
    "image_newline": ([5120], BF),
}


def test_flash_shapes_match_spec_12() -> None:
    specs = ckpt.expected_tensors(V41Arch.from_config(_flash()))
    for name, (shape, dtype) in FLASH_SHAPES.items():
        assert (specs[name].shape, specs[name].dtype) == (tuple(shape), dtype), name
    for absent in (
        "layers.20.attn.compressor.wgate.weight",
        "layers.24.attn.indexer.wk.weight",
        "layers.25.attn.indexer.wq_b.weight",
        "layers.1.attn.compressor.wkv.weight",
        "mtp.0.markov_head.embed.weight",
        "mtp.2.main_proj.weight",
    ):
        assert absent not in specs, absent
    compressors = sorted(int(n.split(".")[1]) for n in specs if n.endswith("compressor.wkv.weight"))
    assert compressors == [2, 8, 14, 20]


def test_optional_groups_can_be_left_out(tiny_arch: V41Arch) -> None:
    text_only = ckpt.expected_tensors(tiny_arch, include_vision=False, include_dspark=False)
    assert not any(n.startswith(("vision.", "aligner.", "image_", "mtp.")) for n in text_only)
    full = ckpt.expected_tensors(tiny_arch)
    assert set(text_only) < set(full)


# --------------------------------------------------------------------------- validation


def _validate_error(arch: V41Arch, found: dict) -> str:
    """The error message, plus every problem beyond the 20 the message shows."""
    with pytest.raises(CheckpointFormatError) as info:
        ckpt.validate_checkpoint_index(arch, found)
    return str(info.value) + "\n" + "\n".join(info.value.problems)


def test_missing_tensor_is_named(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = dict(tiny_found)
    del found["layers.3.attn.indexer.wk.weight"]
    msg = _validate_error(tiny_arch, found)
    assert "missing tensor 'layers.3.attn.indexer.wk.weight'" in msg and "[128, 512] BF16" in msg


def test_wrong_shape_is_named(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = dict(tiny_found)
    found["layers.0.attn.wq_b.scale"] = ((64, 3), E8)
    msg = _validate_error(tiny_arch, found)
    assert "'layers.0.attn.wq_b.scale' has shape [64, 3]" in msg and "[64, 2] F8_E8M0" in msg


def test_wrong_dtype_is_named(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = dict(tiny_found)
    found["layers.0.attn.wq_a.weight"] = ((64, 128), BF)
    found["layers.2.hc_ffn_fn"] = ((24, 512), BF)
    msg = _validate_error(tiny_arch, found)
    assert "'layers.0.attn.wq_a.weight' has dtype BF16, expected [64, 128] F8_E4M3" in msg
    assert "'layers.2.hc_ffn_fn' has dtype BF16" in msg


def test_unknown_tensor_is_named(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = dict(tiny_found)
    found["layers.2.attn.compressor.wkv.weight"] = ((512, 128), F32)
    msg = _validate_error(tiny_arch, found)
    assert "unknown tensor 'layers.2.attn.compressor.wkv.weight'" in msg


def test_partial_optional_group_is_an_error(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = {n: v for n, v in tiny_found.items() if n != "mtp.1.norm.weight"}
    assert "missing tensor 'mtp.1.norm.weight'" in _validate_error(tiny_arch, found)
    # Without any vision / DSpark tensor the groups are simply absent.
    text_only = {
        n: v for n, v in tiny_found.items() if not n.startswith(("vision.", "aligner.", "image_", "mtp."))
    }
    ckpt.validate_checkpoint_index(tiny_arch, text_only)
    with pytest.raises(CheckpointFormatError, match="missing tensor 'vision.norm.weight'"):
        ckpt.validate_checkpoint_index(tiny_arch, text_only, include_vision=True)


def test_tolerated_variants(tiny_arch: V41Arch, tiny_found: dict) -> None:
    found = {f"model.{n}": v for n, v in tiny_found.items()}  # DeepInfer accepts the prefix
    found["image_pad"] = ((128,), BF)  # unused by every implementation
    found["model.layers.1.attn.compressor.wkv.weight"] = ((512, 128), BF)  # DeepInfer's dtype
    found["model.head.weight"] = ((129280, 128), F32)  # NeMo's dtype
    ckpt.validate_checkpoint_index(tiny_arch, found)


def test_bad_config_value(tiny_dir: Path, tiny_found: dict) -> None:
    cfg = json.loads((tiny_dir / "config.json").read_text())
    bad = copy.deepcopy(cfg)
    bad["text_config"]["index_source_layer_ids"] = [3, 4]
    with pytest.raises(ConfigError, match=r"^text_config\.index_source_layer_ids"):
        V41Arch.from_config(bad)
    # A valid but different config does not fit the stored tensors.
    other = copy.deepcopy(cfg)
    other["text_config"]["q_lora_rank"] = 96
    msg = _validate_error(V41Arch.from_config(other), tiny_found)
    assert "'layers.0.attn.wq_a.weight' has shape [64, 128], expected [96, 128] F8_E4M3" in msg


def test_sharded_checkpoint_headers(tiny_arch: V41Arch, tiny_tensors: dict, tmp_path: Path) -> None:
    names = sorted(tiny_tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    tensors = dict(tiny_tensors)
    tensors["layers.4.attn.attn_sink"] = tensors["layers.4.attn.attn_sink"].to(torch.bfloat16)
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / shard))
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    found = ckpt.read_safetensors_index(tmp_path)
    assert set(found) == set(names)
    assert found["layers.4.attn.attn_sink"] == ((4,), BF)
    assert "'layers.4.attn.attn_sink' has dtype BF16, expected [4] F32" in _validate_error(tiny_arch, found)

    weight_map["layers.0.norm_extra"] = "model-00001-of-00002.safetensors"
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointFormatError, match="layers.0.norm_extra"):
        ckpt.read_safetensors_index(tmp_path)


# --------------------------------------------------------------------------- iter_dequantized


def _ref_fp8_block(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent decode: torch's own e4m3 conversion times 2^(byte-127) per 32x32 tile."""
    exp = s.view(torch.uint8).to(torch.float64) - 127
    tile = torch.pow(2.0, exp).repeat_interleave(32, 0).repeat_interleave(32, 1)
    return (w.to(torch.float64) * tile[: w.shape[0], : w.shape[1]]).float()


_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _ref_fp4_rows(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Independent decode: nibble table (low nibble = even column) times 2^(byte-127) per 1x32."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)
    values = torch.tensor(_E2M1, dtype=torch.float64)[codes]
    scale = torch.pow(2.0, s.view(torch.uint8).to(torch.float64) - 127).repeat_interleave(32, -1)
    return (values * scale).float()


@pytest.fixture(scope="module")
def dequantized(tiny_arch: V41Arch, tiny_tensors: dict) -> dict[str, torch.Tensor]:
    items = list(tiny_tensors.items())
    random.Random(0).shuffle(items)  # scales may arrive before their weights
    return dict(ckpt.iter_dequantized(tiny_arch, items, torch.float32))


def test_fp8_dequantisation(dequantized: dict, tiny_tensors: dict) -> None:
    name = "layers.0.attn.wq_b.weight"
    ref = _ref_fp8_block(tiny_tensors[name], tiny_tensors["layers.0.attn.wq_b.scale"])
    assert dequantized[name].dtype == torch.float32 and dequantized[name].shape == (2048, 64)
    assert torch.equal(dequantized[name], ref)
    assert "layers.0.attn.wq_b.scale" not in dequantized


def test_fp4_dequantisation(dequantized: dict, tiny_tensors: dict) -> None:
    name = "layers.1.ffn.experts.3.w2.weight"
    ref = _ref_fp4_rows(tiny_tensors[name], tiny_tensors["layers.1.ffn.experts.3.w2.scale"])
    assert dequantized[name].shape == (128, 64)
    assert torch.equal(dequantized[name], ref)


def test_engram_table_stays_encoded(dequantized: dict, tiny_tensors: dict) -> None:
    codes = dequantized["layers.1.engram.embed.weight"]
    scale = dequantized["layers.1.engram.embed.scale"]
    assert codes.dtype == torch.uint8 and scale.dtype == torch.uint8
    assert torch.equal(codes, tiny_tensors["layers.1.engram.embed.weight"].view(torch.uint8))
    assert torch.equal(scale, tiny_tensors["layers.1.engram.embed.scale"].view(torch.uint8))


def test_every_tensor_is_yielded_once(dequantized: dict, tiny_arch: V41Arch) -> None:
    specs = ckpt.expected_tensors(tiny_arch)
    wanted = {n for n, s in specs.items() if s.dtype != E8} | {"layers.1.engram.embed.scale"}
    assert set(dequantized) == wanted


def test_fp32_islands_keep_fp32(tiny_arch: V41Arch, tiny_tensors: dict) -> None:
    names = [
        "layers.0.hc_attn_fn",
        "layers.0.hc_ffn_scale",
        "layers.0.attn.attn_sink",
        "layers.0.ffn.gate.bias",
        "layers.0.ffn.gate.bias_vl",
        "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.compressor.wgate.weight",
        "mtp.1.confidence_head.proj.weight",
        "embed.weight",
        "layers.0.attn_norm.weight",
        "vision.norm.weight",
        "layers.0.attn.wkv.weight",
        "layers.0.attn.wkv.scale",
    ]
    out = dict(ckpt.iter_dequantized(tiny_arch, [(n, tiny_tensors[n]) for n in names], torch.bfloat16))
    for name in names[:8]:
        assert out[name].dtype == torch.float32, name
        assert torch.equal(out[name], tiny_tensors[name].float()), name
    for name in (
        "embed.weight",
        "layers.0.attn_norm.weight",
        "vision.norm.weight",
        "layers.0.attn.wkv.weight",
    ):
        assert out[name].dtype == torch.bfloat16, name


def test_orphans_and_unknown_names_raise(tiny_arch: V41Arch, tiny_tensors: dict) -> None:
    with pytest.raises(CheckpointFormatError, match=r"layers\.0\.attn\.wo_b\.weight"):
        list(
            ckpt.iter_dequantized(
                tiny_arch, [("layers.0.attn.wo_b.weight", tiny_tensors["layers.0.attn.wo_b.weight"])]
            )
        )
    with pytest.raises(CheckpointFormatError, match=r"layers\.0\.ffn\.experts\.1\.w1\.scale"):
        scale = tiny_tensors["layers.0.ffn.experts.1.w1.scale"]
        list(ckpt.iter_dequantized(tiny_arch, [("layers.0.ffn.experts.1.w1.scale", scale)]))
    with pytest.raises(CheckpointFormatError, match="unknown tensor 'layers.0.bogus'"):
        list(ckpt.iter_dequantized(tiny_arch, [("layers.0.bogus", torch.zeros(1))]))


def test_random_weights_are_scaled_by_fan_in(dequantized: dict) -> None:
    """std ~ 1/sqrt(fan_in) after quantisation keeps activations O(1) (maker hygiene)."""
    for name, fan_in in (
        ("layers.0.attn.wq_b.weight", 64),
        ("layers.0.attn.wo_a.weight", 1024),
        ("layers.2.ffn.experts.5.w1.weight", 128),
        ("layers.2.ffn.experts.5.w2.weight", 64),
        ("layers.1.engram.wkv.weight", 128),
    ):
        std = dequantized[name].std().item()
        assert abs(std * fan_in**0.5 - 1.0) < 0.15, (name, std)
    assert abs(dequantized["embed.weight"].std().item() - 1.0) < 0.05
    assert dequantized["layers.0.attn.attn_sink"].abs().max() < 0.1
    scales = dequantized["layers.3.hc_attn_scale"]
    assert ((scales >= 0.1) & (scales <= 1.0)).all()
    bias = dequantized["layers.3.ffn.gate.bias"]
    assert 0 < bias.abs().max() < 0.5 and not torch.equal(bias, dequantized["layers.3.ffn.gate.bias_vl"])
