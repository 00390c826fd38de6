"""Run the tiny model through the harness on the Triton kernel path (subprocess of
``test_kernel_path_interpreted``; needs TRITON_INTERPRET=1 on a CPU).

usage: kernel_path_run.py CHECKPOINT OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from v41_harness import PagedHarness

from deepinfer_vllm.model_executor.layers.v41_attention import V41Attention
from deepinfer_vllm.ops import dispatch

# Chunk ends at odd positions split ratio-2 pairs; contexts pass the window (8) and the compressed entries the
# index's top-k (4). (Prompts of 42 and 32 tokens ran the same paths in 1.6x the time: `make test` is near its limit.)
SCHEDULE = [("a", 0, 15), ("b", 0, 7), ("a", 15, 26), ("b", 7, 21), ("a", 26, 27), ("b", 21, 22), ("a", 27, 28)]


def prompts() -> dict[str, list[int]]:
    out = {}
    for rid, n, seed in (("a", 28, 11), ("b", 22, 12)):
        g = torch.Generator().manual_seed(seed)
        out[rid] = torch.randint(3, 120000, (n,), generator=g).tolist()
    return out


def main(checkpoint: str, out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.ops.interpreted import scan_builtins_once

    scan_builtins_once()  # the interpreter's builtins listed once (same kernels, ~25% less time)
    torch.set_num_threads(1)
    harness = PagedHarness(checkpoint, dtype="float32")
    p = prompts()
    logits = {"a": [], "b": []}
    # Two requests, interleaved prefill chunks that split ratio-2 pairs, then decode steps.
    for step in ([SCHEDULE[0], SCHEDULE[1]], [SCHEDULE[2], SCHEDULE[3]], [SCHEDULE[4], SCHEDULE[5]], [SCHEDULE[6]]):
        chunks = [(rid, p[rid][a:b]) for rid, a, b in step]
        out = harness.step(chunks)
        i = 0
        for rid, a, b in step:
            logits[rid].append(out[i : i + b - a])
            i += b - a
    used = {m.attention_backend for m in harness.model.modules() if isinstance(m, V41Attention)}
    fused = [key for key in dispatch.chosen() if key[0] == "fused"]
    torch.save({"used": sorted(used), "fused": fused, **{k: torch.cat(v) for k, v in logits.items()}}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
