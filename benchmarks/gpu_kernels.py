"""GPU kernel benchmark: every Triton kernel of V4.1 (attention path, FP8/FP4 weight GEMMs) on Flash shapes.

Run on the GPU host (no vLLM needed): ``python benchmarks/gpu_kernels.py``.
Prints the ceilings measured in this run (device copy bandwidth, bf16 and fp8
matmul through torch), then one table row per kernel and shape: time,
achieved bytes/s and FLOP/s, their ratio to the ceilings, and the speed-up
over the baseline (the PyTorch reference path, or ``torch.topk``).
``--only cache_store,indexer`` runs a subset; ``--markdown`` prints a
table for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu.common import HEADER, measure_ceilings  # noqa: E402

MODULES = ("cache_store", "indexer", "sparse_mla_decode", "fp8_gemm", "moe_gemm", "stored_gemm", "rope")


def _print_table(rows: list[list[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "|".join(" --- " for _ in HEADER) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    print("  ".join(h.ljust(w) for h, w in zip(HEADER, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MODULES))
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    c = measure_ceilings()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"ceilings (this run): copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 matmul {c.bf16_flops_per_s / 1e12:.0f} TFLOP/s, "
        f"fp8 matmul {c.fp8_flops_per_s / 1e12:.0f} TFLOP/s"
    )
    cells = []
    for name in args.only.split(","):
        t0 = time.time()
        mod = importlib.import_module(f"benchmarks.gpu.{name}")
        try:
            rows = mod.run(c)
        except Exception:  # noqa: BLE001 - report and go on with the other kernels
            traceback.print_exc()
            print(f"# {name}: FAILED", flush=True)
            continue
        cells += [r.cells(c) for r in rows]
        print(f"# {name}: {len(rows)} rows in {time.time() - t0:.0f} s", flush=True)
    _print_table(cells, args.markdown)


if __name__ == "__main__":
    main()
