"""Offline tokenizers and the random-weight checkpoint maker (presets, determinism, CLI)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
import torch

from deepinfer_vllm.configs import ConfigError, V41Arch
from deepinfer_vllm.configs import checkpoint as ckpt
from deepinfer_vllm.ops.engram import compressed_vocab_from_tokenizer
from deepinfer_vllm.tools.make_checkpoint import main, make_checkpoint, random_tensors, resolve_config
from deepinfer_vllm.tools.presets import PRESETS, WEIGHT_PRESETS, get_preset
from deepinfer_vllm.tools.tokenizer_builder import (
    CHAT_TOKENS,
    build_v41_tokenizer,
    build_wordlevel_tokenizer,
)

SENTENCES = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, the model answered 17 questions; it was right about 12 of them!",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Unicode survives: naïve café, 東京, emoji 🚀.",
]


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def v41_tokenizer():
    start = time.perf_counter()
    tok = build_v41_tokenizer(129280)
    return tok, time.perf_counter() - start


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- tokenizer


def test_v41_tokenizer_layout(v41_tokenizer) -> None:
    tok, seconds = v41_tokenizer
    assert seconds < 10
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    expected = {
        0: "<｜begin▁of▁sentence｜>",
        1: "<｜end▁of▁sentence｜>",
        2: "<｜▁pad▁｜>",
        129264: "<｜deepseek_image｜>",
        128799: "<｜place▁holder▁no▁799｜>",
    }
    for token_id, text in expected.items():
        assert tok.decode([token_id], skip_special_tokens=False) == text
        assert tok.token_to_id(text) == token_id
    for text in CHAT_TOKENS:  # every V4.1 string is one id
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=False) == text
    prompt = "<｜User｜>Hi<｜Assistant｜><think>"
    assert tok.encode(prompt, add_special_tokens=False).ids[0] == tok.token_to_id("<｜User｜>")
    dsml = '<｜DSML｜ invoke name="f">x</｜DSML｜ invoke>'
    assert tok.decode(tok.encode(dsml).ids, skip_special_tokens=True) == dsml


def test_v41_tokenizer_round_trips_english(v41_tokenizer) -> None:
    tok, _ = v41_tokenizer
    ids = tok.encode("Hello, my name is").ids
    assert ids[0] == 0  # BOS from the post-processor
    assert 3 <= len(ids) <= 8
    for text in SENTENCES:
        enc = tok.encode(text)
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
        assert max(enc.ids) < 129280


def test_small_vocab_keeps_every_special_token() -> None:
    tok = build_v41_tokenizer(2048)
    assert tok.get_vocab_size(with_added_tokens=True) == 2048
    for text in CHAT_TOKENS + ("<｜deepseek_image｜>",):
        assert tok.token_to_id(text) is not None
    assert tok.decode(tok.encode("Hello, my name is").ids, skip_special_tokens=True) == "Hello, my name is"


def test_wordlevel_tokenizer_has_no_chat_tokens() -> None:
    tok = build_wordlevel_tokenizer(129280)
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    assert tok.token_to_id("<｜User｜>") is None and tok.token_to_id("<think>") is None
    assert [tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>")] == [0, 1, 2]
    ids = tok.encode("Hello, my name is").ids
    assert len(ids) == 5 and tok.token_to_id("<unk>") not in ids


def test_autotokenizer_loads_the_checkpoint_tokenizer(tiny_dir: Path, v41_tokenizer) -> None:
    from transformers import AutoTokenizer

    tok, _ = v41_tokenizer
    auto = AutoTokenizer.from_pretrained(tiny_dir)
    assert auto.is_fast and len(auto) == 129280
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert auto.model_max_length == 4096
    for text in SENTENCES:
        ids = auto(text).input_ids
        assert ids == tok.encode(text).ids
        assert auto.decode(ids, skip_special_tokens=True) == text
    assert auto.convert_ids_to_tokens(129264) == "<｜deepseek_image｜>"


# --------------------------------------------------------------------------- maker


def test_tiny_checkpoint_is_complete_and_valid(tiny_dir: Path) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg.pop("transformers_version")
    # The released nesting, with the tokenizer-derived Engram class count filled in.
    assert set(cfg) >= {"text_config", "vision_config", "quantization_config", "architectures"}
    assert "hidden_size" not in cfg
    tokenizer = __import__("tokenizers").Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    _, classes = compressed_vocab_from_tokenizer(tokenizer)
    assert cfg["text_config"]["engram_compressed_vocab_size"] == classes
    assert cfg["text_config"]["engram_num_embeddings"] == [290]
    expected = dict(
        get_preset("tiny"),
        text_config=dict(get_preset("tiny")["text_config"], engram_compressed_vocab_size=classes),
    )
    assert cfg == expected
    arch = V41Arch.from_config(cfg)
    ckpt.validate_checkpoint_index(arch, ckpt.read_safetensors_index(tiny_dir))
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)


def test_same_seed_gives_identical_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_checkpoint(tmp_path / "again", preset="tiny", seed=0)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha(again / name) == _sha(tiny_dir / name), name


def test_seed_changes_every_random_tensor() -> None:
    arch = V41Arch.from_config(resolve_config("tiny", include_vision=False, include_dspark=False))
    a, b = random_tensors(arch, seed=0), random_tensors(arch, seed=1)
    assert a.keys() == b.keys()
    for name in (
        "embed.weight",
        "layers.0.attn.wq_a.weight",
        "layers.0.ffn.experts.0.w1.weight",
        "layers.1.engram.embed.weight",
        "layers.2.hc_ffn_fn",
    ):
        assert not torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert torch.equal(a["norm.weight"], b["norm.weight"])  # norms are ones


def test_small_preset_builds_and_validates(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, preset="small", seed=3)
    cfg = json.loads((path / "config.json").read_text())
    arch = V41Arch.from_config(cfg)
    found = ckpt.read_safetensors_index(path)
    ckpt.validate_checkpoint_index(arch, found)
    assert found == {n: (s.shape, s.dtype) for n, s in ckpt.expected_tensors(arch).items()}
    # Dimensions tiny does not exercise.
    assert (arch.hidden_size, arch.num_heads, arch.o_groups, arch.num_dspark_layers) == (256, 8, 4, 1)
    assert found["layers.0.attn.wo_a.weight"] == ((512, 1024), "F8_E4M3")
    assert found["layers.1.engram.embed.weight"] == ((660, 64), "F8_E4M3")
    assert found["layers.1.engram.wkv.weight"] == ((1280, 384), "F8_E4M3")
    assert found["mtp.0.confidence_head.proj.weight"] == ((1, 288), "F32")  # one stage owns both ends
    assert found["mtp.0.main_proj.weight"] == ((256, 768), "F8_E4M3")
    assert found["aligner.w1.weight"] == ((256, 864), "BF16")
    assert [r.layer_id for r in arch.roles if r.uses_candidates] == [7]


def test_presets_validate() -> None:
    for name in WEIGHT_PRESETS:
        arch = V41Arch.from_config(PRESETS[name])
        assert arch.engram_layer_ids == (1,), name
    assert V41Arch.from_config(PRESETS["flash"]).engram_layer_ids == (1, 14)


def test_flash_preset_writes_its_config_only(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config_only"):
        make_checkpoint(tmp_path / "w", preset="flash")
    out = make_checkpoint(tmp_path / "c", preset="flash", config_only=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json"]
    written = json.loads((out / "config.json").read_text())
    assert written["text_config"]["engram_num_embeddings"] == [384006168, 384016682]
    assert V41Arch.from_config(written).n_routed_experts == 384


def test_inconsistent_engram_rows_are_rejected() -> None:
    cfg = get_preset("tiny")
    cfg["text_config"]["engram_num_embeddings"] = [300]
    with pytest.raises(ConfigError, match=r"^text_config\.engram_num_embeddings"):
        resolve_config(config=cfg)


def test_cli_config_file_text_only_wordlevel(tmp_path: Path) -> None:
    cfg = get_preset("tiny")
    cfg["text_config"]["sliding_window"] = 16
    (tmp_path / "in.json").write_text(json.dumps(cfg))
    out = tmp_path / "ckpt"
    argv = [
        "--config",
        str(tmp_path / "in.json"),
        "--out",
        str(out),
        "--seed",
        "7",
        "--tokenizer",
        "wordlevel",
        "--no-vision",
        "--no-dspark",
    ]
    assert main(argv) == 0
    written = json.loads((out / "config.json").read_text())
    assert written["text_config"]["sliding_window"] == 16
    assert written["vision_config"]["num_hidden_layers"] == 0
    assert written["text_config"]["num_nextn_predict_layers"] == 0
    assert written["text_config"]["compress_ratios"] == [0, 2, 2, 1, 1, 1]
    found = ckpt.read_safetensors_index(out)
    assert not any(n.startswith(("vision.", "aligner.", "image_", "mtp.")) for n in found)
    ckpt.validate_checkpoint_index(V41Arch.from_config(written), found)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    assert tokenizer["model"]["type"] == "WordLevel"
    assert "<｜User｜>" not in tokenizer["model"]["vocab"]
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(out)  # loads without any chat token
    assert auto.convert_tokens_to_ids("<pad>") == 2
