"""Benchmark of ops/triton/cache_store.py: quantise-and-store of cache records, and ratio-2 pooling.

Flash shapes: window KV (MXFP8, 512 dims, 528 B), compressed KV (NVFP4, 512 dims,
288 B) and index keys (MXFP4, 128 dims, 68 B) for 64 / 4096 / 65536 bf16 rows into
padded pages (64 records each) at random entries of one request's block table; pooling
of as many pairs of fp32 ``[u | g]`` rows (2 x 512 each, first rows from the ring) to
bf16, with the ring write. Bytes = inputs read + outputs written. Baselines: the
PyTorch references (``store_paged``; ``step_pair_rows``, ``pool_ratio2`` and
``ring_write_reference`` as the model calls them).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s  # noqa: E402
from deepinfer_vllm.ops.compressor import pool_ratio2, ring_write_reference, step_pair_rows  # noqa: E402
from deepinfer_vllm.ops.paged_records import RecordFormat, store_paged  # noqa: E402
from deepinfer_vllm.ops.triton.cache_store import pool_pairs, ring_write, store_records  # noqa: E402

CACHES = [("window KV", "mxfp8", 512), ("compressed KV", "nvfp4", 512), ("index keys", "mxfp4", 128)]
COUNTS = (64, 4096, 65536)
RECORDS_PER_PAGE = 64
OTHER_PAGE_BYTES = 4096  # pages of other caches packed beside this one (block stride > N * R)


def _store_rows(device: str) -> list[Row]:
    rows = []
    for label, fmt, dim in CACHES:
        rf = RecordFormat(fmt, dim)
        page = RECORDS_PER_PAGE * rf.record_bytes
        for n in COUNTS:
            num_blocks = -(-2 * n // RECORDS_PER_PAGE)
            buf = torch.zeros(num_blocks, page + OTHER_PAGE_BYTES, dtype=torch.uint8, device=device)
            cache = buf[:, :page].unflatten(1, (1, RECORDS_PER_PAGE, rf.record_bytes))
            table = torch.randperm(num_blocks, device=device).to(torch.int32).view(1, -1)
            entry = torch.randperm(num_blocks * RECORDS_PER_PAGE, device=device)[:n].to(torch.int32)
            req = torch.zeros_like(entry)
            x = torch.randn(n, dim, device=device, dtype=torch.bfloat16)
            t = time_s(lambda: store_records(cache, fmt, table, req, entry, x))
            t_ref = time_s(lambda: store_paged(cache, rf, table, req, entry, x), graph=False)
            rows.append(
                Row(
                    kernel=f"store_records {fmt}",
                    shape=f"{label} n={n} D={dim}",
                    seconds=t,
                    bytes=n * (2 * dim + 12 + rf.record_bytes),
                    baseline="torch ref",
                    baseline_seconds=t_ref,
                )
            )
    return rows


def _pool_rows(device: str, dim: int = 512) -> list[Row]:
    """``n`` decoding requests, each one token at an odd position whose pair's first row is in
    the ring (the decode case), then the ring write."""
    rows = []
    for n in COUNTS:
        u = torch.randn(n, dim, device=device)
        g = torch.randn(n, dim, device=device)
        ring = torch.randn(n, 4, 2 * dim, device=device)
        table = torch.randperm(n, device=device).to(torch.int32).view(n, 1)
        req = torch.arange(n, device=device)
        pos = 2 * torch.randint(0, 4096, (n,), device=device) + 1
        seq = pos + 1

        def kernels():
            pool_pairs(u, g, ring, table, req, pos, pos, torch.bfloat16)
            ring_write(ring, table, req, pos, seq, u, g)

        def reference():
            first = step_pair_rows(u, g, ring, table, req, pos, pos)
            pair_u = torch.stack([first[:, :dim], u], dim=1).flatten(0, 1)
            pair_g = torch.stack([first[:, dim:], g], dim=1).flatten(0, 1)
            pool_ratio2(pair_u, pair_g, torch.float32).to(torch.bfloat16)
            ring_write_reference(ring, table, req, pos, seq, u, g)

        t = time_s(kernels)
        t_ref = time_s(reference, graph=False)
        rows.append(
            Row(
                kernel="pool_pairs + ring_write bf16",
                shape=f"n={n} D={dim}",
                seconds=t,
                bytes=n * (3 * 2 * dim * 4 + dim * 2 + 40),
                baseline="torch ref",
                baseline_seconds=t_ref,
            )
        )
    return rows


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    return _store_rows("cuda") + _pool_rows("cuda")


if __name__ == "__main__":
    print_module(run)
