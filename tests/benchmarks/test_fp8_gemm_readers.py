"""``benchmarks/gpu/fp8_gemm.py``'s reader in the wide kernel's pattern (a ceiling of ``--mid``): every program
reads exactly its rows of ``x``, its 128 weight rows and their scales over its K range. On the CPU under Triton's
interpreter (``tests/ops/interpreted.py``), against the XOR of the same words taken in torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_readers_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def bench():
    interpreted_module("triton")  # skips outside the interpreted run
    spec = importlib.util.spec_from_file_location("bench_fp8_gemm", ROOT / "benchmarks" / "gpu" / "fp8_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _xor(t: torch.Tensor) -> int:
    flat = t.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    out = 0
    for v in flat.tolist():
        out ^= v
    return out


@pytest.mark.parametrize("m, n, k", [(130, 256, 512), (40, 128, 2048), (40, 128, 1408)])
def test_read_as_wide_reads_each_programs_bytes(bench, m, n, k):
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config

    g = torch.Generator().manual_seed(m)
    x = torch.randint(-(2**15), 2**15, (m, k), generator=g, dtype=torch.int16).view(torch.bfloat16)
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 256, (n // 32, k // 32), generator=g, dtype=torch.uint8)
    cfg = gluon_fp8_wide_config(m, n, k)
    bm, k_tiles = 64 * cfg["WGS"], k // 128
    per = -(-k_tiles // cfg["SPLIT"]) * 128  # K columns a split (the last one shorter: 11 tiles in 4 splits)
    split = -(-k // per)
    assert split > 1 or k <= 512  # the other shapes split K
    run, got = bench._read_as_wide_launcher(x, w, s)
    run()
    n_tiles, m_tiles = n // 128, -(-m // bm)
    assert got.numel() == n_tiles * m_tiles * split
    xi, wi, si = x.view(torch.int16).to(torch.int32) & 0xFFFF, w.to(torch.int32), s.to(torch.int32)
    for pk in range(split):
        for pm in range(m_tiles):
            for pn in range(n_tiles):
                ks = slice(pk * per, (pk + 1) * per)
                xs = xi[pm * bm:(pm + 1) * bm, ks]
                ws = wi[pn * 128:(pn + 1) * 128, ks]
                ss = si[pn * 4:(pn + 1) * 4, pk * per // 32:(pk + 1) * per // 32]
                # bytes / halves packed into little-endian words, then XOR-ed
                xw = xs[:, 0::2] | (xs[:, 1::2] << 16)
                ww = ws[:, 0::4] | (ws[:, 1::4] << 8) | (ws[:, 2::4] << 16) | (ws[:, 3::4] << 24)
                sw = ss[:, 0::4] | (ss[:, 1::4] << 8) | (ss[:, 2::4] << 16) | (ss[:, 3::4] << 24)
                want = _xor(xw) ^ _xor(ww) ^ _xor(sw)
                assert int(got[(pk * m_tiles + pm) * n_tiles + pn]) & 0xFFFFFFFF == want, (pk, pm, pn)
