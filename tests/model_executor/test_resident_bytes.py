"""Weights stay resident in their released formats: resident bytes per component against
the checkpoint's bytes for the same tensors, read from the safetensors headers."""

from __future__ import annotations

import pytest
import torch
from v41_harness import PagedHarness

from deepinfer_vllm.configs.checkpoint import read_safetensors_index
from deepinfer_vllm.model_executor.resident_bytes import component_of, weight_bytes

BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}


def _header_bytes(model_dir: str) -> dict[str, int]:
    """Checkpoint bytes per component, from the headers alone (no model involved)."""
    out: dict[str, int] = {}
    for name, (shape, dtype) in read_safetensors_index(model_dir).items():
        n = BYTES[dtype]
        for s in shape:
            n *= s
        comp = component_of(name)
        out[comp] = out.get(comp, 0) + n
    return out


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> str:
    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    return str(make_checkpoint(tmp_path_factory.mktemp("small"), preset="small", seed=1))


@pytest.mark.parametrize("which", ["tiny", "small"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_bytes_match_the_checkpoint(which, dtype, tiny_checkpoint, small_checkpoint):
    path = tiny_checkpoint if which == "tiny" else small_checkpoint
    model = PagedHarness(path, dtype=dtype).model
    rows = weight_bytes(model)
    header = _header_bytes(path)
    print({c: r for c, r in rows.items() if r["resident"] or r["checkpoint"]})
    # One rank holds every backbone tensor: the checkpoint side is the header's bytes.
    for comp in ("experts", "engram", "dense", "embedding_head"):
        assert rows[comp]["checkpoint"] == header[comp], comp
        assert rows[comp]["resident"] == header[comp], comp
    # DSpark and vision tensors are validated, not held.
    assert header["dspark"] > 0 and header["vision"] > 0
    assert rows["dspark"]["resident"] == rows["vision"]["resident"] == 0
    assert not [n for n, _ in model.named_parameters() if n.startswith(("mtp.", "vision.", "aligner."))]
    total = rows["total"]
    assert total["resident"] / total["checkpoint"] <= 1.05, total


def test_rope_tables_follow_max_model_len(tiny_checkpoint):
    model = PagedHarness(tiny_checkpoint, dtype="float32").model
    ropes = {b.data_ptr(): b for n, b in model.named_buffers() if n.endswith("rope_cache")}
    assert len(ropes) == 2  # main and compressed, shared by every layer
    assert all(b.shape == (1024, model.arch.rope_dim) for b in ropes.values())  # harness max_model_len


def test_widened_weights_would_be_caught(tiny_checkpoint):
    """The comparison is not vacuous: a weight held in fp32 shows up as a ratio above 1."""
    model = PagedHarness(tiny_checkpoint, dtype="float32").model
    norm = model.layers[0].attn_norm
    norm.weight.data = norm.weight.data.float()
    rows = weight_bytes(model)
    assert rows["dense"]["resident"] > rows["dense"]["checkpoint"]
    norm.weight.data = norm.weight.data.to(torch.bfloat16)
