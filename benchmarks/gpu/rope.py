"""Benchmark of ops/triton/rope.py: RoPE on the tail of every head (and the index query's MXFP4 round trip).

Shapes of one Flash-shaped layer: the attention query ``[T, 64, 512]`` (64 rotated), the index query
``[T, 64, 128]`` with its MXFP4 round trip, the key ``[T, 512]``; T = 8192 (prefill) and 64 (decode). Each as
the model calls it (in place: only the rotated tail moves, unless the round trip rewrites every entry) and
into a new tensor, beside the PyTorch reference (``apply_rope_tail``, then ``mxfp4_qdq``) measured in this
run. bytes = what the call must read and write.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s  # noqa: E402
from deepinfer_vllm.ops.rope import RopeTail, build_rope_cache  # noqa: E402
from deepinfer_vllm.ops.triton.rope import rope_tail  # noqa: E402

CALLS = [("query", (64, 512), None), ("index query", (64, 128), "mxfp4"), ("key", (512,), None)]
TOKENS = (8192, 64)
ROTARY = 64


def run(ceilings: Ceilings) -> list[Row]:
    cache = build_rope_cache(ROTARY, 65536, 10000.0).cuda()
    reference = RopeTail("cuda", torch.bfloat16).forward_native
    rows = []
    for t in TOKENS:
        for name, tail_shape, qdq in CALLS:
            x = torch.randn(t, *tail_shape, device="cuda").to(torch.bfloat16)
            pos = torch.randint(0, 65536, (t,), device="cuda")
            t_ref = time_s(lambda: reference(x, pos, cache, False, qdq))
            for in_place in (True, False):
                y = x.clone()
                seconds = time_s(lambda: rope_tail(y, pos, cache, False, qdq, in_place=in_place))
                heads = x.numel() // x.shape[-1]
                moved = heads * ROTARY * 2 * 2 if in_place and qdq is None else x.numel() * 2 * 2
                rows.append(
                    Row(
                        kernel=f"rope_tail {name}" + (" in place" if in_place else ""),
                        shape=f"{list(x.shape)} qdq={qdq}",
                        seconds=seconds,
                        bytes=moved,
                        baseline="reference",
                        baseline_seconds=t_ref,
                    )
                )
    return rows


if __name__ == "__main__":
    print_module(run)
