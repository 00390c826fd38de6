"""Engram rows in host memory on the GPU (``model_executor.engram_host``, ``uva`` transfer): the
tables are registered host memory, each step's rows are read through a device view of it on a
side stream, and the logits equal those of the rows in device memory bit for bit (fp32 and bf16,
prefill and decode); the decode step waits for nothing on the host and replays in a CUDA graph
bit-identical to eager. Never run yet (written without a GPU): the first run on the H200 host
checks the device view of registered memory and the side stream inside a graph.
"""

from __future__ import annotations

import pytest
import torch
from v41_harness import PagedHarness

PROMPTS = {
    "a": [(13 * i + 7) % 120000 + 3 for i in range(61)],
    "b": [(29 * i + 5) % 120000 + 3 for i in range(23)],
}


def _steps(harness: PagedHarness) -> list[torch.Tensor]:
    """A prefill of two requests, then three greedy decode steps."""
    out = [harness.step([("a", PROMPTS["a"]), ("b", PROMPTS["b"])])]
    nxt = [int(out[-1][60].argmax()), int(out[-1][-1].argmax())]
    for _ in range(3):
        out.append(harness.step([("a", [nxt[0]]), ("b", [nxt[1]])]))
        nxt = out[-1].argmax(-1).tolist()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_rows_give_the_device_rows_logits(tiny_checkpoint, dtype):
    on_device = PagedHarness(
        tiny_checkpoint, dtype=dtype, device="cuda", engram_config={"cpu_offload": False}
    )
    want = _steps(on_device)
    del on_device
    harness = PagedHarness(tiny_checkpoint, dtype=dtype, device="cuda", engram_config={"cpu_offload": True})
    model = harness.model
    assert model.engram_placement.host and model.engram_placement.transfer == "uva"
    table = model.layers[1].engram.embed
    assert (
        table.weight.device.type == "cpu" and table.host.weight.is_pinned() and table.host.scale.is_pinned()
    )
    got = _steps(harness)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}"
    assert model.engram_runtime.transfer.rows_moved > 0


def test_host_rows_decode_never_waits_and_replays_in_a_graph(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ATTENTION_KERNELS", "triton")
    monkeypatch.setenv("DEEPINFER_GEMM_KERNELS", "triton")
    harness = PagedHarness(
        tiny_checkpoint, dtype="bfloat16", device="cuda", engram_config={"cpu_offload": True}
    )
    logits = harness.step([("a", PROMPTS["a"]), ("b", PROMPTS["b"])])
    nxt = [int(logits[60].argmax()), int(logits[-1].argmax())]
    logits = harness.step([("a", [nxt[0]]), ("b", [nxt[1]])])  # lazy set-up, the device views
    nxt = logits.argmax(-1).tolist()
    width = harness.cfg.model_config.max_model_len // harness.block_size
    static = harness.prepare([("a", [nxt[0]]), ("b", [nxt[1]])], table_width=width)
    for meta in static[2].values():
        meta.max_seq_len = harness.cfg.model_config.max_model_len
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = harness.run(static).clone()
    finally:
        torch.cuda.set_sync_debug_mode("default")
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
