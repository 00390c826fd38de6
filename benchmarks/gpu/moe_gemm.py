"""Benchmark of ops/triton/moe_gemm.py: the routed experts' grouped E2M1 GEMM, one EP=8 rank.

384 experts, EP=8: 48 local experts. Tokens route top-6 uniformly at random over the 384;
the rows on this rank are those sent to a local expert, grouped by expert. Both expert
GEMMs: w13 (N = 2 * 2304 = 4608, K = 5120) and w2 (N = 5120, K = 2304).
  * decode, 1 / 64 / 256 tokens: bytes = packed E2M1 + scales of the experts actually
    touched (+ x, out); % copy is the ratio to copy bandwidth (goal: >= 70%).
  * prefill, 8192 tokens (about 6144 rows here): FLOPs 2 * rows * N * K against the fp8 and
    bf16 matmul ceilings of the run.
  * a tile sweep (act=bf16) on w13 at 1, 64 and 8192 tokens (``GEMM_SWEEP=0`` skips it).
act="mxfp8" rows include the Triton activation quantiser.

``python benchmarks/gpu/moe_gemm.py --decode``: the decode rows of issue 34 only: at 1 / 4 / 16 / 64 /
256 tokens, w13 and w2, ``grouped_fp4_gemm`` (both acts) beside a plain reader of the same expert bytes
(``read experts``: one program per 16 KB of each touched expert's packed weight and scales,
XOR-reduced), the Triton kernel, the Gluon cp.async kernel (``gluon cp.async``: the decode default before the
warp-specialised one), three warp-specialised variants (ring depth, registers at launch / the producer's) and the
default with the other K splits of 1, 2, 4 and 8 up to 16 tokens (``split N``; one split means no separate reduction
launch, which at one token may outweigh the programs it leaves idle).
Same timing as every row (CUDA graph, L2 flushed before each call), same byte count, % of copy.
``--decode --ab FILE``: also the Gluon wrapper of another copy of ``moe_gemm_gluon.py`` (for
instance
``git show REV:deepinfer_vllm/ops/triton/moe_gemm_gluon.py > build/diag/moe_gemm_gluon_b.py``) on the same
inputs and its own default config, act=bf16 (``gluon other``), with the largest difference of the two outputs
relative to the output's largest value.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, print_module, time_s
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.triton.moe_gemm import grouped_fp4_gemm, moe_config
from deepinfer_vllm.ops.triton.moe_gemm_gluon import gluon_config

EXPERTS, LOCAL, TOP_K = 384, 48, 6
GEMMS = [("w13", 4608, 5120), ("w2", 5120, 2304)]
DECODE_TOKENS = (1, 64, 256)
PREFILL_TOKENS = 8192
ACTS = ["bf16", "mxfp8"]
SWEEP_DECODE = [
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, SPLIT=1),
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, SPLIT=2),
    dict(BM=16, BN=32, BK=128, num_warps=4, num_stages=4, SPLIT=1),
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=6, SPLIT=1),
    dict(BM=16, BN=128, BK=128, num_warps=8, num_stages=3, SPLIT=1),
    dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=3, SPLIT=2),
    # one row tile per program (GRID_M >= the row-tile bound): the persistent loop's balance A/B
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4, SPLIT=1, GRID_M=64),
]
SWEEP_PREFILL = [
    dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3),
    dict(BM=256, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=4),
    dict(BM=128, BN=128, BK=64, num_warps=4, num_stages=4),
    # the Gluon kernel as chosen at prefill
    dict(BT=64, NS=3, MAXNREG=168, SPLIT=1),
]


def experts(n: int, k: int, device: str = "cuda"):
    v, s = quant.quant_fp4_rows(torch.randn(LOCAL, n, k, device=device) * 0.02)
    return v.view(torch.int8), s.view(torch.float8_e8m0fnu)


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, int, int]:
    """Offsets ``[LOCAL + 1]`` of the rows this rank gets, rows, experts touched. For 1 token the
    first seed with at least one local row is taken (a token without one does no work)."""
    while True:
        g = torch.Generator().manual_seed(seed)
        picks = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
        local = picks[picks < LOCAL]
        if local.numel():
            break
        seed += 1
    counts = torch.bincount(local, minlength=LOCAL)
    offs = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    return offs.cuda(), int(local.numel()), int((counts > 0).sum())


def _cfg_name(cfg: dict) -> str:
    return "/".join(f"{k}{v}" for k, v in cfg.items())


def _rows(tokens: int, acts, configs=(None,), label: str = "") -> list[Row]:
    rows = []
    offs, r, touched = routing(tokens, seed=tokens)
    for name, n, k in GEMMS if not configs[0] else GEMMS[:1]:
        w, s = experts(n, k)
        x = torch.randn(r, k, device="cuda").to(torch.bfloat16)
        expert_bytes = touched * (n * k // 2 + n * k // 32)
        for act in acts:
            for cfg in configs:
                try:
                    t = time_s(lambda: grouped_fp4_gemm(x, offs, w, s, act, config=cfg))
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"# sweep {act} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                rows.append(
                    Row(
                        kernel=f"{label}grouped_fp4_gemm {name} act={act}",
                        shape=f"T={tokens} rows={r} experts={touched}/{LOCAL}"
                        + (f" {_cfg_name(cfg)}" if cfg else ""),
                        seconds=t,
                        bytes=expert_bytes + r * k * 2 + r * n * 2,
                        flops=2 * r * n * k,
                    )
                )
    return rows


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    rows = []
    for tokens in DECODE_TOKENS + (PREFILL_TOKENS,):
        rows += _rows(tokens, ACTS)
    if os.environ.get("GEMM_SWEEP", "1") == "1":
        rows += _rows(1, ACTS[:1], SWEEP_DECODE, "sweep ")
        rows += _rows(64, ACTS[:1], SWEEP_DECODE, "sweep ")
        rows += _rows(PREFILL_TOKENS, ACTS[:1], SWEEP_PREFILL, "sweep ")
    return rows


DECODE_ROWS_TOKENS = (1, 4, 16, 64, 256)


@triton.jit
def _read_experts(w_ptr, s_ptr, ids_ptr, out_ptr, WN, SN, BLOCK: tl.constexpr):
    """XOR of ``BLOCK`` words of expert ``ids[j]``'s packed weight (and of its scales)."""
    c = tl.program_id(0)
    j = tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    i = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.xor_sum(tl.load(w_ptr + e * WN + i, mask=i < WN, other=0), 0)
    v ^= tl.xor_sum(tl.load(s_ptr + e * SN + i, mask=i < SN, other=0), 0)
    tl.store(out_ptr + j * tl.num_programs(0) + c, v)


def _read_launcher(w: torch.Tensor, s: torch.Tensor, offs: torch.Tensor):
    """A plain reader of the packed weight and scale bytes of the experts with rows."""
    wi = w.view(torch.int32).reshape(w.shape[0], -1)
    si = s.view(torch.uint8).reshape(s.shape[0], -1).view(torch.int32)
    ids = torch.nonzero(torch.diff(offs.long()) > 0).flatten().to(torch.int32)
    block = 4096  # 16 KB per program
    grid = (triton.cdiv(wi.shape[1], block), ids.numel())
    out = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=w.device)
    return lambda: _read_experts[grid](wi, si, ids, out, wi.shape[1], si.shape[1], BLOCK=block, num_warps=4)


def run_decode(ceilings: Ceilings):
    """Decode: the grouped kernel (both acts) and the plain reader of the same bytes. A generator:
    each row is printed as soon as it is measured."""
    torch.manual_seed(0)
    other = _load_other(sys.argv[sys.argv.index("--ab") + 1]) if "--ab" in sys.argv else None
    for name, n, k in GEMMS:
        w, s = experts(n, k)
        for tokens in DECODE_ROWS_TOKENS:
            offs, r, touched = routing(tokens, seed=tokens)
            x = torch.randn(r, k, device="cuda").to(torch.bfloat16)
            nbytes = touched * (n * k // 2 + n * k // 32) + r * k * 2 + r * n * 2
            shape = f"T={tokens} rows={r} experts={touched}/{LOCAL}"
            for act in ACTS:
                t = time_s(lambda act=act: grouped_fp4_gemm(x, offs, w, s, act))  # noqa: B023 - called at once
                yield Row(
                    kernel=f"grouped_fp4_gemm {name} act={act}",
                    shape=shape,
                    seconds=t,
                    bytes=nbytes,
                    flops=2 * r * n * k,
                )
            # the same call on the Triton kernel (design 2) and on Gluon ring depths, act=bf16
            base = gluon_config(r, LOCAL, n, k)
            variants = [("triton", moe_config(r, LOCAL, n, k))]
            # the cp.async kernel (every warp copies and decodes; the default before the warp-specialised one)
            variants += [("gluon cp.async NS=3 maxnreg=96", dict(base, WS=False, NS=3, MAXNREG=96))]
            ws = ((3, 64, 40), (6, 64, 40), (4, 80, 40))
            variants += [(f"gluon WS NS={ns} maxnreg={m}/{lr}", dict(base, WS=True, NS=ns, MAXNREG=m, LOAD_REGS=lr))
                         for ns, m, lr in ws]
            # the default's K split against fewer (one launch less without the separate reduction) and more
            if tokens <= 16:
                variants += [(f"split {sp}", dict(base, SPLIT=sp)) for sp in (1, 2, 4, 8) if sp != base["SPLIT"]]
            for label, cfg in variants:
                t = time_s(lambda cfg=cfg: grouped_fp4_gemm(x, offs, w, s, "bf16", config=cfg))  # noqa: B023
                yield Row(
                    kernel=f"grouped_fp4_gemm {name} act=bf16 {label}",
                    shape=shape,
                    seconds=t,
                    bytes=nbytes,
                    flops=2 * r * n * k,
                )
            if other is not None:
                mine = grouped_fp4_gemm(x, offs, w, s, "bf16", torch.float32)
                theirs = _other_call(other, x, offs, w, s)
                yield Row(
                    kernel=f"grouped_fp4_gemm {name} act=bf16 gluon other ({_rel_diff(mine, theirs):.1e})",
                    shape=shape,
                    seconds=time_s(lambda: _other_call(other, x, offs, w, s)),  # noqa: B023 - called at once
                    bytes=nbytes,
                    flops=2 * r * n * k,
                )
            t = time_s(_read_launcher(w, s, offs))
            yield Row(kernel=f"read experts {name}", shape=shape, seconds=t, bytes=nbytes)


def _load_other(path: str):
    """Another copy of ``moe_gemm_gluon.py`` as a module of its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_gemm_gluon_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _other_call(other, x, offs, w, s) -> torch.Tensor:
    """The other copy's kernel on the checked arguments ``grouped_fp4_gemm`` would give it, act=bf16, fp32
    out."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    return other.gluon_grouped_fp4_gemm(x, offs, w.view(torch.uint8), s.view(torch.uint8), out)


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


if __name__ == "__main__":
    print_module(run_decode if "--decode" in sys.argv[1:] else run)
