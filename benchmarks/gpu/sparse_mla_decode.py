"""Sparse MLA decode attention on Flash shapes (H=64, D=512, W=128, top-k 512).

Per token: 128 window keys (MXFP8, 528 B) + 512 compressed keys (NVFP4, 288 B),
64 heads attending all of them: FLOPs = 4 * H * D * keys (QK^T and PV), bytes =
the records read + q + out (+ the top-k indices). Contexts are long
(8192 positions) so the gathered records come from a cache much larger than L2.
The baseline is the PyTorch paged reference (gather + dequantise + einsum), timed
on the smaller batches. A row's shape says which ceiling bounds it: its arithmetic
intensity against the ridge point (bf16 matmul rate / copy bandwidth) measured in
this run. Every main row is timed twice: the default kernel (the warp-specialised
Gluon kernel on sm90) and the Triton kernel (``gluon=False``). After them, a sweep
of the Triton kernel's launch configs at 128 tokens (ratio 2), and both kernels at
64 tokens with and without flash-decoding splits. ``--timing`` prints instead where a tile's
cycles go inside the Gluon kernel (its producer, softmax and PV warpgroups); ``--splits`` where
small (split) batches spend their time (decode kernel vs merge); ``--ab FILE`` this Gluon kernel
against another copy of its file, in one process; ``--gemm-ceiling`` what cuBLAS gets from the
same two matmuls as dense bf16 batched matmuls (``gemm_ceiling``).
"""

from __future__ import annotations

import os
import sys

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import Ceilings, Row, time_s  # noqa: E402
from deepinfer_vllm.ops.paged_attention import paged_sparse_attention  # noqa: E402
from deepinfer_vllm.ops.paged_records import RecordFormat, write_records  # noqa: E402
from deepinfer_vllm.ops.triton.sparse_mla_decode import DecodeConfig, sparse_mla_decode  # noqa: E402

H, D, W, K = 64, 512, 128, 512
BLOCK_SIZE = 64
CONTEXT = 8192
BASELINE_MAX_TOKENS = 64


def make_inputs(num_reqs: int, tokens_per_req: int, ratio: int, device: str = "cuda", seed: int = 0):
    """Paged caches (window + compressed pages of a block side by side) with real records
    at every slot the tokens read; the last ``tokens_per_req`` positions of each request."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w_fmt, c_fmt = RecordFormat("mxfp8", D), RecordFormat("nvfp4", D)
    n_c = BLOCK_SIZE // ratio
    w_page, c_page = BLOCK_SIZE * w_fmt.record_bytes, n_c * c_fmt.record_bytes
    per_req = CONTEXT // BLOCK_SIZE
    num_blocks = num_reqs * per_req
    buf = torch.zeros(num_blocks, w_page + c_page + 256, dtype=torch.uint8, device=device)
    window_cache = buf[:, :w_page].unflatten(1, (1, BLOCK_SIZE, w_fmt.record_bytes))
    comp_cache = buf[:, w_page : w_page + c_page].unflatten(1, (1, n_c, c_fmt.record_bytes))
    perm = torch.randperm(num_blocks, generator=g).to(device)
    w_bt = perm.view(num_reqs, per_req).int()
    c_bt = torch.roll(perm, 1).view(num_reqs, per_req).int()

    positions = (CONTEXT - tokens_per_req + torch.arange(tokens_per_req)).repeat(num_reqs).to(device)
    token_req = torch.arange(num_reqs).repeat_interleave(tokens_per_req).to(device)
    T = positions.numel()
    # window records: the last W + tokens_per_req positions of every request
    span = torch.arange(CONTEXT - W - tokens_per_req, CONTEXT, device=device)
    req = torch.arange(num_reqs, device=device).repeat_interleave(span.numel())
    pos = span.repeat(num_reqs)
    write_records(window_cache, w_fmt, w_bt.long()[req, pos // BLOCK_SIZE], pos % BLOCK_SIZE,
                  torch.randn(pos.numel(), D, device=device))
    # top-k: K distinct visible entries per token, ascending; write those records
    visible = (CONTEXT - tokens_per_req + 1) // ratio
    topk = torch.rand(T, visible, generator=g).argsort(dim=1)[:, :K].sort(dim=1).values.to(device)
    first = topk * ratio
    tr = token_req.view(-1, 1).expand_as(first)
    write_records(comp_cache, c_fmt, c_bt.long()[tr, first // BLOCK_SIZE].flatten(),
                  ((first % BLOCK_SIZE) // ratio).flatten(), torch.randn(first.numel(), D, device=device))
    q = torch.randn(T, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
    args = dict(
        window_cache=window_cache, window_block_table=w_bt, window_block_size=BLOCK_SIZE,
        positions=positions, window_lo=torch.zeros_like(positions), token_req=token_req, window=W,
        sink=torch.randn(H, generator=g).to(device), scale=D**-0.5,
        comp_cache=comp_cache, comp_block_table=c_bt, comp_block_size=BLOCK_SIZE, comp_ratio=ratio,
        topk=topk.int(),
    )
    return q, args


def _traffic(T: int) -> tuple[float, float]:
    keys = W + K
    flops = 4.0 * H * D * keys * T
    records = W * (D + D // 32) + K * (D // 2 + D // 16)
    index = K * 4  # top-k entries (block-table words are L1/L2 hits: not counted)
    qo = 2 * H * D * 2
    return flops, float(T * (records + index + qo))


def _bound(flops: float, nbytes: float, tokens: int, c: Ceilings) -> str:
    """Compute- or memory-bound by arithmetic intensity vs the ridge point; below 64
    tokens there is too little work per call for either ceiling (latency-bound)."""
    ridge = c.bf16_flops_per_s / c.copy_bytes_per_s
    kind = "compute" if flops / nbytes > ridge else "memory"
    return f"{kind}-bound" if tokens >= 64 else f"latency-bound, {kind} by intensity"


def _row(label: str, q, args, c: Ceilings, ref: torch.Tensor, config: DecodeConfig | None = None,
         baseline: bool = False) -> Row:
    """Time one launch config; its output must match ``ref`` (the paged reference)."""
    T = q.shape[0]
    out = torch.empty_like(q)
    seconds = time_s(lambda: sparse_mla_decode(q, **args, config=config, out=out))
    flops, nbytes = _traffic(T)
    row = Row(
        kernel="sparse_mla_decode",
        shape=f"{label} [{_bound(flops, nbytes, T, c)}]",
        seconds=seconds, bytes=nbytes, flops=flops,
    )
    rel = ((out.float() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item()
    row.extra["max_rel_err"] = rel
    if not rel <= 1e-2:
        raise AssertionError(f"{label}: kernel disagrees with the reference (rel err {rel:.3g})")
    if baseline:
        row.baseline = "paged torch ref"
        row.baseline_seconds = time_s(lambda: paged_sparse_attention(q, **args), warmup=2, rep=5, graph=False)
    return row


def run(ceilings: Ceilings) -> list[Row]:
    rows: list[Row] = []

    def inputs(num_reqs: int, tokens_per_req: int, ratio: int):
        q, args = make_inputs(num_reqs, tokens_per_req, ratio)
        return q, args, paged_sparse_attention(q, **args).float()

    triton = DecodeConfig(gluon=False)
    for ratio in (2, 1):
        for batch in (1, 16, 64, 128, 256):
            q, args, ref = inputs(batch, 1, ratio)
            # default: the warp-specialised Gluon kernel on sm90; the Triton kernel beside it
            rows.append(_row(f"T={batch} (1/req) r={ratio}", q, args, ceilings, ref,
                             baseline=batch <= BASELINE_MAX_TOKENS))
            rows.append(_row(f"T={batch} (1/req) r={ratio} triton kernel", q, args, ceilings, ref,
                             config=triton))
            del q, args, ref
        q, args, ref = inputs(64, 2, ratio)
        rows.append(_row(f"T=128 (64 req x 2) r={ratio}", q, args, ceilings, ref))
        rows.append(_row(f"T=128 (64 req x 2) r={ratio} triton kernel", q, args, ceilings, ref,
                         config=triton))
        del q, args, ref
    # Triton kernel launch-config sweep (its defaults first): num_stages=3, prefetch=1 measured best.
    sweep = [
        DecodeConfig(gluon=False),
        DecodeConfig(num_stages=2, gluon=False),
        DecodeConfig(num_stages=1, gluon=False),
        DecodeConfig(prefetch=0, gluon=False),
        DecodeConfig(prefetch=2, gluon=False),
        DecodeConfig(prefetch=3, gluon=False),
        DecodeConfig(prefetch=3, num_stages=1, gluon=False),
        DecodeConfig(fast_fp4=False, gluon=False),
    ]
    q, args, ref = inputs(128, 1, 2)
    for cfg in sweep:
        rows.append(_row(f"T=128 r=2 {_describe(cfg)}", q, args, ceilings, ref, config=cfg))
    del q, args, ref
    q, args, ref = inputs(64, 1, 2)
    # flash-decoding splits at 64 tokens (64 programs would leave half the SMs idle)
    for cfg in (DecodeConfig(num_splits=1), DecodeConfig(num_splits=2), DecodeConfig(num_splits=4),
                DecodeConfig(num_splits=1, gluon=False), DecodeConfig(num_splits=2, gluon=False)):
        rows.append(_row(f"T=64 r=2 {_describe(cfg)}", q, args, ceilings, ref, config=cfg))
    return rows


def _describe(cfg: DecodeConfig) -> str:
    base = DecodeConfig()
    diff = [f"{k}={getattr(cfg, k)}" for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(base, k)]
    return "cfg(" + (", ".join(diff) or "default") + ")"


def tile_timing(num_reqs: int = 256, ratio: int = 2, reps: int = 3) -> dict[str, float]:
    """Median SM cycles of the Gluon kernel's stages, from its ``%clock64`` stamps
    (``gluon_decode(timing=...)``; see its docstring for the events). Per tile: tiles 3-6 of
    every item, the steady state between the window tiles and the last tile. Per item: the
    items a program takes after its first (where one item's end meets the next one's start),
    and a program's first. The stamps are stores that change the schedule: they locate where
    time goes, but two kernel variants are compared by their untimed times (``run``)."""
    import deepinfer_vllm.ops.triton.sparse_mla_decode as smd

    q, args = make_inputs(num_reqs, 1, ratio)
    tiles = -(-W // 64) + -(-K // 64)
    stamps = torch.zeros(q.shape[0], 16, tiles, dtype=torch.int64, device=q.device)
    plain = smd.gluon_decode
    smd.gluon_decode = lambda *a, **k: plain(*a, timing=stamps, **k)
    try:
        for _ in range(reps):
            sparse_mla_decode(q, **args, config=DecodeConfig(gluon=True, num_splits=1))
        torch.cuda.synchronize()
    finally:
        smd.gluon_decode = plain
    b = stamps.double()
    j = torch.arange(3, 7)
    programs = min(q.shape[0], torch.cuda.get_device_properties(q.device).multi_processor_count)
    later = b[programs:]

    def med(x: torch.Tensor) -> float:
        return x.median().item() if x.numel() else float("nan")

    return {
        "tile period (softmax warpgroup)": med(b[:, 4, j + 1] - b[:, 4, j]),
        "S = QK^T": med(b[:, 5, j] - b[:, 4, j]),
        "softmax": med(b[:, 6, j] - b[:, 5, j]),
        "wait for the P buffer": med(b[:, 7, j] - b[:, 6, j]),
        "PV, first half": med(b[:, 8, j] - b[:, 7, j]),
        "wait for the next tile": med(b[:, 4, j + 1] - b[:, 8, j]),
        "PV, second half": med(b[:, 11, j] - b[:, 10, j]),
        "producer: wait for a free buffer": med(b[:, 2, j] - b[:, 0, j]),
        "producer: decode and store a tile": med(b[:, 1, j] - b[:, 2, j]),
        "item (a program's first)": med(b[:programs, 13, 0] - b[:programs, 12, 0]),
        "first item start -> its first tile ready": med(b[:programs, 4, 0] - b[:programs, 12, 0]),
        "item (after a program's first)": med(later[:, 13, 0] - later[:, 12, 0]),
        "item start -> its Q has landed": med(later[:, 9, 0] - later[:, 12, 0]),
        "Q landed -> first tile ready": med(later[:, 4, 0] - later[:, 9, 0]),
        "epilogue (last PV -> item end)": med(later[:, 13, 0] - later[:, 8, -1]),
        "first items' start spread (global), ns": (b[:programs, 14, 0].max()
                                                     - b[:programs, 14, 0].min()).item(),
        "kernel span, first start -> last end (global), ns": (b[:, 15, 0].max() - b[:, 14, 0].min()).item(),
        "SM clock, GHz": med((later[:, 13, 0] - later[:, 12, 0]) / (later[:, 15, 0] - later[:, 14, 0])),
    }



SPLIT_SHAPES = ((1, 1), (4, 1), (16, 1), (32, 1), (64, 1), (32, 2))  # (requests, tokens each)


def split_costs(ratio: int = 2) -> list[tuple[str, float, float, float]]:
    """Where small (split) batches spend their time: the whole call, the decode kernel alone
    (the merge skipped) and the merge alone (after an L2 flush, so a bound: in the whole call
    the partials are L2-hot). Rows ``(shape, whole, decode, merge)`` in seconds."""
    import deepinfer_vllm.ops.triton.sparse_mla_decode as smd

    rows = []
    merge = smd._combine
    for num_reqs, per_req in SPLIT_SHAPES:
        q, args = make_inputs(num_reqs, per_req, ratio)
        out = torch.empty_like(q)
        call = lambda: sparse_mla_decode(q, **args, config=DecodeConfig(gluon=True), out=out)  # noqa: E731
        whole = time_s(call)
        merge_args: list = []
        smd._combine = lambda *a: merge_args.append(a)
        try:
            decode = time_s(call)
        finally:
            smd._combine = merge
        merged = time_s(lambda: merge(*merge_args[0])) if merge_args else float("nan")
        splits = merge_args[0][4] if merge_args else 1
        rows.append((f"T={q.shape[0]} ({num_reqs} x {per_req}), {splits} splits", whole, decode, merged))
    return rows


def ab(path: str, ratio: int = 2) -> list[tuple[str, float, float]]:
    """Same-process A/B of the Gluon kernel against another copy of its file (for instance
    ``git show other-branch:deepinfer_vllm/ops/triton/sparse_mla_decode_gluon.py > /tmp/b.py``),
    best of two rounds each, alternating, after L2 flushes. Rows ``(shape, this, other)``."""
    import importlib.util

    import deepinfer_vllm.ops.triton.sparse_mla_decode as smd

    spec = importlib.util.spec_from_file_location("decode_gluon_b", path)
    other = importlib.util.module_from_spec(spec)
    sys.modules["decode_gluon_b"] = other
    spec.loader.exec_module(other)
    mine = smd.gluon_decode
    rows = []
    for num_reqs, per_req in ((256, 1), (128, 1), (64, 2), (64, 1), (1, 1)):
        q, args = make_inputs(num_reqs, per_req, ratio)
        out = torch.empty_like(q)
        best = {"this": float("inf"), "other": float("inf")}
        for _ in range(2):
            for name, fn in (("this", mine), ("other", other.gluon_decode)):
                smd.gluon_decode = fn
                try:
                    best[name] = min(best[name], time_s(
                        lambda: sparse_mla_decode(q, **args, config=DecodeConfig(gluon=True), out=out)))
                finally:
                    smd.gluon_decode = mine
        rows.append((f"T={q.shape[0]} ({num_reqs} x {per_req})", best["this"], best["other"]))
    return rows


def gemm_ceiling(c: Ceilings, tokens=(64, 128, 256)) -> list[tuple[str, float, float]]:
    """The attention's two matmuls at its own shapes, dense bf16 through torch (cuBLAS), with no
    gather, decode or softmax: per token S = Q Kᵀ ([64, 512] x [512, 640]) and O = P K ([64, 640]
    x [640, 512]), as batched matmuls over the tokens, after an L2 flush. The same FLOPs as the
    kernel's rows. A dense bf16 K is 655 KB per token, three times the kernel's records, so with
    a K per token the matmuls read more than the kernel does; with one K for every token (batch
    stride 0) K stays in L2 and only the tensor cores' rate on these shapes is left. Rows
    ``(shape, seconds, fraction of the bf16 ceiling)``."""
    keys = W + K
    rows = []
    for T in tokens:
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        p = torch.randn(T, H, keys, device="cuda", dtype=torch.bfloat16)
        flops = 2 * T * H * keys * D
        for k_mode, kv in (("K per token", torch.randn(T, keys, D, device="cuda", dtype=torch.bfloat16)),
                           ("one K (L2)", torch.randn(1, keys, D, device="cuda", dtype=torch.bfloat16)
                            .expand(T, keys, D))):
            for name, fn, n in _attention_matmuls(q, p, kv, flops):
                t = time_s(fn)
                rows.append((f"T={T} {k_mode}: {name}", t, n / t / c.bf16_flops_per_s))
    return rows


def _attention_matmuls(q, p, kv, flops):
    """``(name, fn, FLOPs)`` of S = Q Kᵀ, O = P K and both, as batched bf16 matmuls."""
    return (("S = Q K^T", lambda: torch.bmm(q, kv.transpose(1, 2)), flops),
            ("O = P K", lambda: torch.bmm(p, kv), flops),
            ("both", lambda: (torch.bmm(q, kv.transpose(1, 2)), torch.bmm(p, kv)), 2 * flops))


if __name__ == "__main__":
    from benchmarks.gpu.common import HEADER, measure_ceilings

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    if "--timing" in sys.argv:  # per-stage cycles of the Gluon kernel instead of the table
        for name, value in tile_timing().items():
            unit = "" if "GHz" in name or "ns" in name else " cycles"
            print(f"{name:50s} {value:9.2f}" if "GHz" in name else f"{name:50s} {value:9.0f}{unit}")
        raise SystemExit(0)
    if "--splits" in sys.argv:  # small batches: whole call vs decode kernel vs merge
        print(f"{'shape':32s} {'whole us':>9s} {'decode':>9s} {'merge':>9s}")
        for name, whole, decode, merged in split_costs():
            print(f"{name:32s} {whole * 1e6:9.1f} {decode * 1e6:9.1f} {merged * 1e6:9.1f}")
        raise SystemExit(0)
    if "--gemm-ceiling" in sys.argv:  # the two matmuls alone, dense bf16 via torch
        c = measure_ceilings()
        print(f"bf16 ceiling {c.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
        print(f"{'matmuls':36s} {'us':>9s} {'% bf16':>7s}")
        for name, t, frac in gemm_ceiling(c):
            print(f"{name:36s} {t * 1e6:9.1f} {frac:7.0%}")
        raise SystemExit(0)
    if "--ab" in sys.argv:  # --ab FILE: this Gluon kernel against another copy of its file
        print(f"{'shape':24s} {'this us':>9s} {'other us':>9s} {'this/other':>10s}")
        for name, mine, theirs in ab(sys.argv[sys.argv.index("--ab") + 1]):
            print(f"{name:24s} {mine * 1e6:9.1f} {theirs * 1e6:9.1f} {mine / theirs:10.3f}")
        raise SystemExit(0)
    c = measure_ceilings()
    print(f"ceilings: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 {c.bf16_flops_per_s / 1e12:.0f} TFLOP/s")
    rows = run(c)
    print(" | ".join(HEADER + ["max rel err"]))
    for r in rows:
        print(" | ".join(r.cells(c) + [f"{r.extra.get('max_rel_err', float('nan')):.2e}"]))
