"""Benchmark of ops/triton/stored_gemm.py: bf16 x times a stored bf16 / fp32 weight, fp32 out.

Shapes of the release: the compressor's fp32 ``wkv`` / ``wgate`` ``[512, 5120]``, the
router's bf16 ``[384, 5120]`` and the indexer's bf16 ``weights_proj`` ``[64, 5120]``. Rows: a plain
reader of the weight's bytes (the ceiling); decode M = 1, 2, 16, 64, 256 and prefill M = 8192, each beside
today's path, ``torch.matmul`` of the fp32-widened operands (cuBLAS SIMT sgemm; the widening
included, as ``ops.weight_gemm.gemm_stored`` does it), measured in this run. bytes = weight +
x + out; "% copy" is against the device-to-device copy rate. At M <= ``GEMV_ROWS`` (the CUDA-core
path) the tensor-core kernel on the same call follows; at M >= ``VENDOR_ROWS`` (cuBLAS on the weight's bf16
parts) the Triton tensor-core kernel on the same call follows; at ``SPLIT_M`` rows the tensor-core kernel at
K splits of 1-8 beside its default (16 for these shapes: at 256 rows the fp32 partials, 16 x 256 x 512 x 4
bytes, outweigh the compressor's 10.5 MB weight); for the fp32 weight between those, the same tiles on 8
warps (the configuration before the fifteenth session: two MMA layouts for the three dots).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s  # noqa: E402
from benchmarks.gpu.fp8_gemm import _read_launcher  # noqa: E402
from deepinfer_vllm.ops.triton.stored_gemm import (  # noqa: E402
    GEMV_ROWS,
    VENDOR_ROWS,
    stored_config,
    stored_gemm,
)

SHAPES = [(512, 5120, torch.float32), (384, 5120, torch.bfloat16), (64, 5120, torch.bfloat16)]
DECODE_M = (1, 2, 16, 64, 256)
LARGE_M = 8192
SPLIT_M = (64, 256)  # decode sizes also timed at other K splits (the default: 16, partials of up to 8 MB)


def _cfg_name(cfg: dict) -> str:
    return "/".join(f"{k}{v}" for k, v in cfg.items())


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    rows = []
    for n, k, dtype in SHAPES:
        w = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
        nbytes = n * k * w.element_size()
        read = _read_launcher(w, torch.zeros(4, dtype=torch.uint8, device="cuda"))
        t_read = time_s(read)
        rows.append(Row(kernel="read weight", shape=f"N={n} K={k} {dtype}", seconds=t_read, bytes=nbytes))
        for m in (*DECODE_M, LARGE_M):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            t_ref = time_s(lambda: x.float() @ w.float().t())
            t = time_s(lambda: stored_gemm(x, w, torch.float32))
            cfg = stored_config(m, n, k, dtype == torch.float32)
            if m >= VENDOR_ROWS:
                cfg = {"cuBLAS": "bf16x3" if dtype == torch.float32 else "bf16"}
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
            others = []
            if m <= GEMV_ROWS or m >= VENDOR_ROWS:  # the Triton tensor-core kernel on the same call
                tc = stored_config(max(m, GEMV_ROWS + 1), n, k, dtype == torch.float32)
                others.append(("tensor cores", tc))
            elif m in SPLIT_M:  # its K split: the default's against fewer (less fp32 partial traffic)
                others += [(f"split {sp}", dict(cfg, SPLIT=sp)) for sp in (1, 2, 4, 8) if sp != cfg["SPLIT"]]
            if dtype == torch.float32 and GEMV_ROWS < m < VENDOR_ROWS and cfg["num_warps"] == 4:
                # the fourteenth session's configuration: 8 warps, two MMA layouts for the three dots
                others.append(("8 warps", dict(cfg, num_warps=8)))
            for label, tc in others:
                t_tc = time_s(lambda tc=tc: stored_gemm(x, w, torch.float32, config=tc))  # noqa: B023
                rows.append(
                    Row(
                        kernel=f"{label} W={str(dtype).removeprefix('torch.')}",
                        shape=f"M={m} N={n} K={k} ({_cfg_name(tc)})",
                        seconds=t_tc,
                        bytes=n * k * w.element_size() + m * k * 2 + m * n * 4,
                        flops=2 * m * n * k,
                        baseline="fp32 matmul",
                        baseline_seconds=t_ref,
                    )
                )
    return rows


if __name__ == "__main__":
    print_module(run)
