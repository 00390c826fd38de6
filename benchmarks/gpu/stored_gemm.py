"""Benchmark of ops/triton/stored_gemm.py: bf16 x times a stored bf16 / fp32 weight, fp32 out.

Shapes of the release: the compressor's fp32 ``wkv`` / ``wgate`` ``[512, 5120]`` and the
router's bf16 ``[384, 5120]``. Rows: decode M = 1, 64, 256 and prefill M = 8192, each beside
today's path, ``torch.matmul`` of the fp32-widened operands (cuBLAS SIMT sgemm; the widening
included, as ``ops.weight_gemm.gemm_stored`` does it), measured in this run. bytes = weight +
x + out; "% copy" is against the device-to-device copy rate.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s  # noqa: E402
from deepinfer_vllm.ops.triton.stored_gemm import stored_config, stored_gemm  # noqa: E402

SHAPES = [(512, 5120, torch.float32), (384, 5120, torch.bfloat16)]
DECODE_M = (1, 64, 256)
LARGE_M = 8192


def _cfg_name(cfg: dict) -> str:
    return "/".join(f"{k}{v}" for k, v in cfg.items())


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    rows = []
    for n, k, dtype in SHAPES:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
        for m in (*DECODE_M, LARGE_M):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t_ref = time_s(lambda: x.float() @ w.float().t())
            t = time_s(lambda: stored_gemm(x, w, torch.float32))
            cfg = stored_config(m, n, k, dtype == torch.float32)
            rows.append(
                Row(
                    kernel=f"stored_gemm W={str(dtype).removeprefix('torch.')}",
                    shape=f"M={m} N={n} K={k} ({_cfg_name(cfg)})",
                    seconds=t,
                    bytes=n * k * w.element_size() + m * k * 2 + m * n * 4,
                    flops=2 * m * n * k,
                    baseline="fp32 matmul",
                    baseline_seconds=t_ref,
                )
            )
    return rows


if __name__ == "__main__":
    print_module(run)
