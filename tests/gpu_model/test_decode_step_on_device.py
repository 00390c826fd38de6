"""The bf16 decode step on the GPU is device-clean: with the attention and GEMM kernels
(``DEEPINFER_ATTENTION_KERNELS`` / ``DEEPINFER_GEMM_KERNELS`` = triton) nothing in the
model's forward or logits waits for the host (``torch.cuda.set_sync_debug_mode("error")``
raises on any synchronising call), and the step captures into a CUDA graph whose replays
give the eager step's logits bit for bit, on the captured inputs and on the next step's
inputs copied into the same buffers.

The host part of a step (block tables, metadata) is what vLLM's runner does before the
forward; ``PagedHarness.prepare`` does it here, outside the checked region. Python ints of
the metadata are baked into a graph, so the graph's step uses the static bound vLLM's
builder gives a captured batch: ``max_seq_len`` = ``max_model_len``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from v41_harness import PagedHarness

from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention

# One xdist group per preset (run.sh runs ``--dist loadgroup``): both tests of a preset share
# the Triton kernels its first test compiles.
PRESETS = [pytest.param(p, marks=pytest.mark.xdist_group(f"decode-{p}")) for p in ("tiny", "small")]


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "triton")
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "triton")


def _prefilled(checkpoint: str) -> tuple[PagedHarness, list[int]]:
    harness = PagedHarness(checkpoint, dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(3, 120000, (n,), generator=g).tolist() for n in (61, 23))
    logits = harness.step([("a", a), ("b", b)])
    # One eager decode step first: lazy set-up (device constants, Triton compilation).
    nxt = [int(logits[60].argmax()), int(logits[-1].argmax())]
    logits = harness.step([("a", [nxt[0]]), ("b", [nxt[1]])])
    return harness, logits.argmax(-1).tolist()


def _bounded(prepared: tuple, harness: PagedHarness) -> tuple:
    ids, positions, metadata = prepared
    bound = harness.cfg.model_config.max_model_len
    for meta in metadata.values():
        meta.max_seq_len = bound
    return ids, positions, metadata


def _copy_into(static: tuple, new: tuple) -> None:
    """New step inputs into the captured step's buffers (vLLM's runner does the same)."""
    static[0].copy_(new[0])
    static[1].copy_(new[1])
    for name, meta in static[2].items():
        for f in dataclasses.fields(meta):
            value = getattr(meta, f.name)
            if isinstance(value, torch.Tensor):
                value.copy_(getattr(new[2][name], f.name))


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_never_waits_for_the_host(preset, request):
    harness, nxt = _prefilled(request.getfixturevalue(f"{preset}_checkpoint"))
    assert {m.attention_backend for m in harness.model.modules() if isinstance(m, V41Attention)} == {"triton"}
    prepared = harness.prepare([("a", [nxt[0]]), ("b", [nxt[1]])])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = harness.run(prepared)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_step_replays_in_a_cuda_graph_bit_identical(preset, request):
    harness, nxt = _prefilled(request.getfixturevalue(f"{preset}_checkpoint"))
    width = harness.cfg.model_config.max_model_len // harness.block_size
    static = _bounded(harness.prepare([("a", [nxt[0]]), ("b", [nxt[1]])], table_width=width), harness)
    eager = harness.run(static).clone()  # writes this step's records; replays rewrite the same bytes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        harness.run(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = harness.run(static)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

    step2 = eager.argmax(-1).tolist()
    new = _bounded(harness.prepare([("a", [step2[0]]), ("b", [step2[1]])], table_width=width), harness)
    eager2 = harness.run(new).clone()
    _copy_into(static, new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager2)
    assert not torch.equal(eager2, eager)
