"""Benchmark of ops/triton/fp8_gemm.py: dense FP8 (e4m3, UE8M0 per 32x32) GEMM on Flash shapes.

Rows:
  * large M (8192) on (N, K) = (1792, 5120), (5120, 8192), (4608, 5120): act="bf16" and
    act="mxfp8" as chosen (from ``VENDOR_ROWS`` rows: the weight decoded to bf16, cuBLAS), and the
    Triton kernel forced by its tile; baseline ``torch._scaled_mm`` on the same
    shape (e4m3 operands, per-tensor fp32 scales, bf16 out), measured in this run: the
    "vs baseline" column is the fraction of _scaled_mm's rate (goal: >= 0.80).
  * decode M = 1, 64, 256 on the same shapes: bytes = weight + scales + x + out; % copy.
  * a tile sweep (act=bf16) on (5120, 8192) at M = 8192 and M = 1 (``GEMM_SWEEP=0`` skips it).
``--decode``: M = 1..64 only, the default (on sm90 the Gluon decode kernel, from ``fp8_gemm.WIDE_ROWS[0]`` rows the
wide kernel) beside the Triton kernel, the decode kernel's variants and the wide kernel at 16 rows on the same call,
and a plain reader of the same weight bytes (the ceiling).
``--mid``: M = 128, 256, 512 (large decode batches, above the Gluon decode kernel's 64 rows): the default (the wide
kernel in ``fp8_gemm.WIDE_ROWS``, else the decoded weight on cuBLAS from ``VENDOR_ROWS``), the decode kernel's
64-row tiles forced (each tile decodes the weights again; x rewritten in the tile order or gathered) and its
128-row tiles, the wide kernel, the Triton kernel, the weight decoded to bf16 and cuBLAS (decode included), and the
ceilings: a plain reader of the same weight bytes, cuBLAS's bf16 GEMM on the weight decoded before the timing (the
MMA work alone), and a reader of the bytes the wide kernel reads in its own pattern (``x`` again for every 128 output
columns, mostly from L2: 4 MB of ``x`` x 40 column tiles at 5120 x 8192 x 256, against 42 MB of weight).
The act="mxfp8" rows include the Triton activation quantiser (one extra launch).
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s  # noqa: E402
from deepinfer_vllm.ops import quant  # noqa: E402
from deepinfer_vllm.ops.triton.fp8_gemm import (  # noqa: E402
    _vendor_gemm,
    dense_kernel,
    fp8_block_gemm,
    pick_config,
    weight_bytes,
)

SHAPES = [(1792, 5120), (5120, 8192), (4608, 5120)]
DECODE_M = (1, 64, 256)
LARGE_M = 8192
ACTS = ["bf16", "mxfp8"]
SWEEP_LARGE = [
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=4),
    dict(BM=256, BN=128, BK=128, num_warps=8, num_stages=2),
    dict(BM=256, BN=64, BK=64, num_warps=4, num_stages=4),
]
SWEEP_DECODE = [  # M = 1
    dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=4, SPLIT=4),
    dict(BM=16, BN=128, BK=128, num_warps=8, num_stages=4, SPLIT=2),
    dict(BM=16, BN=128, BK=128, num_warps=8, num_stages=4, SPLIT=4),
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=6, SPLIT=4),
    dict(BM=16, BN=128, BK=256, num_warps=8, num_stages=3, SPLIT=2),
    dict(BM=16, BN=32, BK=256, num_warps=4, num_stages=4, SPLIT=4),
]


def weight(n: int, k: int, device: str = "cuda"):
    v, s = quant.quant_fp8_block(torch.randn(n, k, device=device) * 0.02)
    return v.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def _scaled_mm_seconds(m: int, n: int, k: int) -> float:
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return time_s(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))


def _cfg_name(cfg: dict) -> str:
    return "/".join(f"{k}{v}" for k, v in cfg.items())


def _large_rows() -> list[Row]:
    rows = []
    for n, k in SHAPES:
        w, s = weight(n, k)
        x = torch.randn(LARGE_M, k, device="cuda").to(torch.bfloat16)
        t_ref = _scaled_mm_seconds(LARGE_M, n, k)
        for act in ACTS:
            t = time_s(lambda: fp8_block_gemm(x, w, s, act))  # from VENDOR_ROWS: decoded weight on cuBLAS
            rows.append(
                Row(
                    kernel=f"fp8_block_gemm act={act}",
                    shape=f"M={LARGE_M} N={n} K={k}",
                    seconds=t,
                    bytes=LARGE_M * k * 2 + n * k + LARGE_M * n * 2,
                    flops=2 * LARGE_M * n * k,
                    baseline="_scaled_mm",
                    baseline_seconds=t_ref,
                )
            )
        t_tri = time_s(lambda: fp8_block_gemm(x, w, s, config=SWEEP_LARGE[0]))
        rows.append(
            Row(
                kernel="Triton kernel act=bf16",
                shape=f"M={LARGE_M} N={n} K={k} ({_cfg_name(SWEEP_LARGE[0])})",
                seconds=t_tri,
                bytes=LARGE_M * k * 2 + n * k + LARGE_M * n * 2,
                flops=2 * LARGE_M * n * k,
                baseline="_scaled_mm",
                baseline_seconds=t_ref,
            )
        )
    return rows


def _decode_rows() -> list[Row]:
    rows = []
    for n, k in SHAPES:
        w, s = weight(n, k)
        for m in DECODE_M:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            for act in ACTS:
                t = time_s(lambda: fp8_block_gemm(x, w, s, act))
                rows.append(
                    Row(
                        kernel=f"fp8_block_gemm act={act}",
                        shape=f"M={m} N={n} K={k} ({_cfg_name(pick_config(m, n, k))})",
                        seconds=t,
                        bytes=n * k + n * k // 1024 + m * k * 2 + m * n * 2,
                        flops=2 * m * n * k,
                    )
                )
    return rows


def _sweep_rows() -> list[Row]:
    rows = []
    n, k = 5120, 8192
    w, s = weight(n, k)
    for m, configs in ((LARGE_M, SWEEP_LARGE), (1, SWEEP_DECODE)):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        t_ref = _scaled_mm_seconds(m, n, k)
        for act in ACTS[:1]:
            for cfg in configs:
                try:
                    t = time_s(lambda: fp8_block_gemm(x, w, s, act, config=cfg))
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"# sweep {act} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                rows.append(
                    Row(
                        kernel=f"sweep act={act}",
                        shape=f"M={m} N={n} K={k} {_cfg_name(cfg)}",
                        seconds=t,
                        bytes=n * k + m * k * 2 + m * n * 2,
                        flops=2 * m * n * k,
                        baseline="_scaled_mm",
                        baseline_seconds=t_ref,
                    )
                )
    return rows


@triton.jit
def _read_words(w_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """XOR of ``BLOCK`` words of the weight: a plain reader of its bytes."""
    c = tl.program_id(0)
    i = c * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + c, tl.xor_sum(tl.load(w_ptr + i, mask=i < n_words, other=0), 0))


def _read_launcher(w: torch.Tensor, s: torch.Tensor):
    """The weight's and scales' bytes read once by 16 KB programs (their sum as one buffer)."""
    words = torch.cat([w.view(torch.uint8).flatten(), s.view(torch.uint8).flatten()]).view(torch.int32)
    block = 4096
    grid = (triton.cdiv(words.numel(), block),)
    out = torch.empty(grid[0], dtype=torch.int32, device=w.device)
    return lambda: _read_words[grid](words, out, words.numel(), BLOCK=block, num_warps=4)


@triton.jit
def _read_as_wide(x_ptr, w_ptr, s_ptr, out_ptr, M, stride_x, stride_w, stride_s, k_tiles, per_split,
                  BM: tl.constexpr, KW: tl.constexpr):
    """The bytes one program of the wide kernel (``fp8_gemm_wide_gluon``) reads, in its order and nothing else: per
    K tile of 128 columns its ``BM`` rows of ``x`` (bf16, ``KW = 64`` words a row) and its 128 weight rows (e4m3, 32
    words a row) with their scale words; XOR-reduced into one word (kept, so nothing is dropped as dead)."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    wrows = pid_n * 128 + tl.arange(0, 128)
    acc = tl.zeros([BM, KW], tl.int32)
    wacc = tl.zeros([128, KW // 2], tl.int32)
    sacc = tl.zeros([128 // 32], tl.int32)
    for kt in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_tiles)):
        xw = kt * KW + tl.arange(0, KW)
        acc ^= tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + xw[None, :], mask=(rows < M)[:, None], other=0)
        ww = kt * (KW // 2) + tl.arange(0, KW // 2)
        wacc ^= tl.load(w_ptr + wrows.to(tl.int64)[:, None] * stride_w + ww[None, :])
        # one scale byte per 32x32 block: the 4 of this K tile are one word of each of the 4 scale rows
        sacc ^= tl.load(s_ptr + (pid_n * 4 + tl.arange(0, 4)) * stride_s + kt)
    flat = tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(tl.xor_sum(wacc, 1), 0) ^ tl.xor_sum(sacc, 0)
    tl.store(out_ptr + (pid_k * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n, flat)


def _read_as_wide_launcher(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor):
    """(a launcher, the buffer of one word per program it writes): ``_read_as_wide`` on the grid of the wide
    kernel's default config for this call (its ``BM`` rows a program, its K split): the ceiling of a kernel
    that reads ``x`` again for every 128 output columns, as the wide kernel does (from L2 after the first
    time)."""
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config

    (m, _), (n, k) = x.shape, w.shape
    cfg = gluon_fp8_wide_config(m, n, k)
    bm = 64 * cfg["WGS"]
    k_tiles = k // 128
    split = cfg["SPLIT"]
    per_split = triton.cdiv(k_tiles, split)  # as ``splitk.split_k``: the last split may be shorter
    split = triton.cdiv(k_tiles, per_split)
    xi, wi, si = x.view(torch.int32), w.view(torch.uint8).view(torch.int32), s.view(torch.uint8).view(torch.int32)
    grid = (n // 128, triton.cdiv(m, bm), split)
    out = torch.empty(grid[0] * grid[1] * grid[2], dtype=torch.int32, device=x.device)
    return lambda: _read_as_wide[grid](
        xi, wi, si, out, m, xi.stride(0), wi.stride(0), si.stride(0), k_tiles, per_split, BM=bm, KW=64, num_warps=8
    ), out


DECODE_ONLY_M = (1, 8, 16, 32, 64)
DECODE_ONLY_SHAPES = SHAPES + [(1024 * 8, 512)]  # + the grouped output projection's whole weight


def run_decode(ceilings: Ceilings):
    """Decode (M <= 64): the default (the Gluon kernel on sm90) beside the Triton kernel and Gluon variants on
    the same call, and a plain reader of the same weight bytes. A generator: rows print as measured."""
    from deepinfer_vllm.ops.triton.fp8_gemm_gluon import gluon_fp8_config
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config

    torch.manual_seed(0)
    for n, k in DECODE_ONLY_SHAPES:
        w, s = weight(n, k)
        nbytes_w = n * k + n * k // 1024
        for m in DECODE_ONLY_M:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            nbytes = nbytes_w + m * k * 2 + m * n * 2
            base = gluon_fp8_config(m, n, k)
            wide_default = dense_kernel(x, *weight_bytes(w, s), torch.bfloat16) == "wide"
            variants = [("default", None), ("triton", pick_config(m, n, k))]
            if base.get("WS"):  # the warp-specialised kernel's ring depth; below, the kernel whose threads copy
                variants += [(f"gluon WS NS={ns}", dict(base, NS=ns)) for ns in (3, 6)]
                base = {key: v for key, v in base.items() if key not in ("WS", "MAXNREG", "LOAD_REGS")}
            variants += [("gluon async", dict(base, ASYNC=True)), ("gluon sync", dict(base, ASYNC=False))]
            variants += [(f"gluon async NS={ns}", dict(base, NS=ns, ASYNC=True)) for ns in (2, 3, 4)
                         if ns != base["NS"]]
            variants += [(f"gluon async WG={3 - base['WG']}", dict(base, WG=3 - base["WG"], NS=3, ASYNC=True))]
            if m >= 16 and not wide_default:  # the wide kernel with one warpgroup where it is not the default
                variants += [("wide", gluon_fp8_wide_config(m, n, k))]
            for label, cfg in variants:
                t = time_s(lambda cfg=cfg: fp8_block_gemm(x, w, s, "bf16", config=cfg))  # noqa: B023
                yield Row(
                    kernel=f"fp8_block_gemm {label}",
                    shape=f"M={m} N={n} K={k} ({_cfg_name(cfg) if cfg else _default_kernel(x, w, s)})",
                    seconds=t,
                    bytes=nbytes,
                    flops=2 * m * n * k,
                )
        t = time_s(_read_launcher(w, s))
        yield Row(kernel="read weight", shape=f"N={n} K={k}", seconds=t, bytes=nbytes_w)


MID_M = (128, 256, 512)


def _default_kernel(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> str:
    """The kernel (and its tiles) ``fp8_block_gemm`` picks for the bf16 call ``x @ w`` (``fp8_gemm.dense_kernel``)."""
    from deepinfer_vllm.ops.triton.fp8_gemm_gluon import gluon_fp8_config
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config

    m, (n, k) = x.shape[0], w.shape
    kernel = dense_kernel(x, *weight_bytes(w, s), torch.bfloat16)
    if kernel == "vendor":
        return "decoded + cuBLAS"
    configs = {"wide": gluon_fp8_wide_config, "gluon": gluon_fp8_config, "triton": pick_config}
    return f"{kernel} {_cfg_name(configs[kernel](m, n, k))}"


def run_mid(ceilings: Ceilings):
    """M = 128..512 (module docstring). A generator: rows print as measured."""
    from deepinfer_vllm.ops.triton.fp8_gemm_wide_gluon import gluon_fp8_wide_config, gluon_fp8_wide_gemm

    torch.manual_seed(0)
    for n, k in SHAPES:
        w, s = weight(n, k)
        nbytes_w = n * k + n * k // 1024
        for m in MID_M:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            wu, su = w.view(torch.uint8), s.view(torch.uint8)
            w_bf16 = quant.dequant_fp8_block(wu, su, dtype=torch.bfloat16)
            g64 = dict(BT=64, WG=2, NS=3)
            variants = [
                ("default", lambda: fp8_block_gemm(x, w, s, "bf16")),
                ("gluon BT=64 x tiled", lambda: fp8_block_gemm(x, w, s, config=dict(g64, X_TILED=True))),
                ("gluon BT=64 x gathered", lambda: fp8_block_gemm(x, w, s, config=dict(g64, X_TILED=False))),
                ("gluon BT=128", lambda: fp8_block_gemm(x, w, s, config=dict(BT=128, WG=2, NS=2))),
                ("gluon wide", lambda: gluon_fp8_wide_gemm(x, wu, su, out)),
                ("triton", lambda: fp8_block_gemm(x, w, s, config=pick_config(m, n, k))),
                ("decoded bf16 + cuBLAS", lambda: _vendor_gemm(x, wu, su, out, 1)),
                # the two ceilings of the wide kernel: the MMA work alone (cuBLAS, bf16, the weight decoded before
                # the timing) and the bytes it reads in its own pattern alone (``x`` again per 128 columns)
                ("cuBLAS bf16 (weight decoded before)", lambda: torch.mm(x, w_bf16.T, out=out)),
                ("read as the wide kernel", _read_as_wide_launcher(x, w, s)[0]),
            ]
            ref = _vendor_gemm(x, wu, su, torch.empty_like(out), 1).float()
            got = gluon_fp8_wide_gemm(x, wu, su, torch.empty_like(out)).float()
            print(f"# wide M={m} N={n} K={k} {gluon_fp8_wide_config(m, n, k)}: max |wide - cuBLAS| "
                  f"{(got - ref).abs().max().item():.3g} of max |out| {ref.abs().max().item():.3g}", flush=True)
            for label, fn in variants:
                cfg = f" ({_default_kernel(x, w, s)})" if label == "default" else ""
                yield Row(
                    kernel=f"fp8_block_gemm {label}",
                    shape=f"M={m} N={n} K={k}{cfg}",
                    seconds=time_s(fn),
                    bytes=nbytes_w + m * k * 2 + m * n * 2,
                    flops=2 * m * n * k,
                )
        t = time_s(_read_launcher(w, s))
        yield Row(kernel="read weight", shape=f"N={n} K={k}", seconds=t, bytes=nbytes_w)
    # the attention's grouped output projection: 8 groups of 1024 output columns, K = 512 a group
    groups, n, k = 8, 8192, 512
    w, s = weight(n, k)
    for m in MID_M:
        x = torch.randn(m, groups * k, device="cuda").to(torch.bfloat16)
        variants = [
            ("default", lambda: fp8_block_gemm(x, w, s, groups=groups)),
            ("triton", lambda: fp8_block_gemm(x, w, s, groups=groups, config=pick_config(m, n, k))),
        ]
        for label, fn in variants:
            yield Row(
                kernel=f"fp8_block_gemm grouped {label}",
                shape=f"M={m} N={n} K={groups}x{k}",
                seconds=time_s(fn),
                bytes=n * k + n * k // 1024 + m * groups * k * 2 + m * n * 2,
                flops=2 * m * n * k,
            )


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    rows = _large_rows() + _decode_rows()
    if os.environ.get("GEMM_SWEEP", "1") == "1":
        rows += _sweep_rows()
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    print_module(run_decode if "--decode" in args else run_mid if "--mid" in args else run)
