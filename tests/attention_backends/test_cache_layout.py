"""Cache specs and their bytes per token, for the real Flash config and the tiny one."""

from __future__ import annotations

import pytest

from deepinfer_vllm.attention_backends.cache_layout import bytes_per_token, model_caches
from deepinfer_vllm.configs import V41Arch
from deepinfer_vllm.tools.presets import flash_config, get_preset


def test_flash_global_kv_is_890_bytes_per_token():
    arch = V41Arch.from_config(flash_config())
    per_token = bytes_per_token(model_caches(arch), block_size=64)
    # docs/architecture.md, "Bytes per token", worked by hand: compressed 3 x 288 / 2 + 288 = 720 B,
    # index keys 3 x 68 / 2 + 68 = 170 B -> 890 B per token (the release's figure).
    assert per_token["compressed"] == 720
    assert per_token["index"] == 170
    assert per_token["global"] == 890
    # Window KV: 40 layers x 528 B per token (freed beyond the 128-token window).
    assert per_token["window"] == 40 * 528


def test_tiny_global_kv_is_534_bytes_per_token():
    arch = V41Arch.from_config(get_preset("tiny"))
    per_token = bytes_per_token(model_caches(arch), block_size=64)
    # docs/architecture.md, "Tiny checks", check 4: layer 1 (ratio 2) 288/2 + 68/2,
    # layer 3 (ratio 1) 288 + 68.
    assert per_token["global"] == 178 + 356


@pytest.mark.parametrize("block_size", [16, 64])
def test_specs_page_the_real_record_sizes(block_size):
    arch = V41Arch.from_config(get_preset("tiny"))
    pages = {d.name: d.spec(block_size).page_size_bytes for d in model_caches(arch)}
    assert pages["layers.0.attn.window_cache"] == block_size * 528
    assert pages["layers.1.attn.compressed_cache"] == block_size // 2 * 288
    assert pages["layers.1.attn.index_cache"] == block_size // 2 * 68
    assert pages["layers.3.attn.compressed_cache"] == block_size * 288
    assert pages["layers.3.attn.index_cache"] == block_size * 68
    assert pages["layers.1.attn.ring_cache"] == 4 * 2 * 512 * 4
    assert "layers.2.attn.compressed_cache" not in pages  # Reuse layers own no compressed cache


def test_backend_asks_for_a_block_outermost_layout():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from deepinfer_vllm.attention_backends.mla_swa import DeepInferV41Backend

    layouts = DeepInferV41Backend.supported_kv_cache_layouts()
    assert layouts and all(layout.is_block_outermost for layout in layouts)
    assert layouts[0] is KVCacheLayout.BLNHC
