"""The CUDA path's wiring, run on a CPU: the model with every attention hot-path
operator and every fused per-token chain (mHC sites, RMSNorm, RoPE) on our Triton
kernels (under ``TRITON_INTERPRET=1``) agrees with the full-sequence reference.

The kernels themselves are checked against their references on an H200
(``tests/gpu``); this test checks the glue the GPU host cannot run (it has no
vLLM): slots, block tables, the compressor ring, candidate blocks, top-k
hand-over and the attention call. The kernel path accumulates attention in
fp32 where the fp32 reference uses fp64, so quantised caches may flip a bin
downstream; agreement is stated as fractions, not as one max error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def test_kernel_path_agrees_with_reference(tiny_checkpoint, tiny_reference, tmp_path):
    sys.path.insert(0, str(HERE))
    from kernel_path_run import prompts

    out = tmp_path / "logits.pt"
    env = dict(
        os.environ, TRITON_INTERPRET="1", DEEPINFER_ATTENTION_KERNELS="triton", DEEPINFER_FUSED_KERNELS="triton"
    )
    run = subprocess.run(
        [sys.executable, str(HERE / "kernel_path_run.py"), tiny_checkpoint, str(out)],
        env=env, cwd=HERE, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)
    assert got["used"] == ["triton"] and got["fused"] == [("fused", "triton", "cpu")]
    rows_agree, cos = [], []
    for rid, prompt in prompts().items():
        ref = tiny_reference.forward(prompt)
        kern = got[rid]
        assert kern.shape == ref.shape and torch.isfinite(kern).all()
        rows_agree.append((kern.argmax(-1) == ref.argmax(-1)).float())
        cos.append(torch.nn.functional.cosine_similarity(kern.double(), ref.double(), dim=-1))
    agree = torch.cat(rows_agree).mean().item()
    cos = torch.cat(cos)
    print(f"argmax agreement {agree:.3f}, cosine min {cos.min():.5f} median {cos.median():.6f}")
    assert agree >= 0.95
    assert cos.median() >= 0.9999
    assert (cos >= 0.99).float().mean() >= 0.95
