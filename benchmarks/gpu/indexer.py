"""Benchmark of ops/triton/indexer.py and ops/triton/topk.py: lightning-indexer scores over the
paged MXFP4 index cache, top-k selection, candidate blocks, and the reindex (sparse) path.

Flash shapes: 32 index heads x 128 dims, ratio 2, vLLM blocks of 64 tokens (32 records of
68 B per page, pages padded by 4 KiB of other caches), one query token per request (decode).

* scores: batch 64 / 128 / 256 x context 8192 / 32768 / 131072 keys. Bytes = 68 per key per
  query + q + w + fp32 scores written; FLOPs = 2 * 32 * 128 per key per query. Baseline: the
  PyTorch paged reference where affordable (batch 64 x 8192).
* selection: k = 512 over N = 8192 / 32768 / 131072 x T = 64 / 256, and k = 2048 over 16384
  blocks, on bf16-valued scores. Bytes = fp32 scores read + indices written. Baseline:
  ``torch.topk(sorted=False)`` (neither tie-stable nor index-ordered, so it does less).
* candidate path: block scores + top-2048 blocks of 131072 scores, then the reindex layer's
  sparse scores over the 2048 x 8 kept entries and its top-512 (mapped back).

Rows ``index_scores_paged [variant]`` time other decode modes / pipelines / launch shapes of the
scores kernel at batch 128 x 32768 and 256 x 131072 (``SCORE_VARIANTS``, to pick the default). ``python benchmarks/gpu/indexer.py --sweep``
prints a wider sweep (scores modes x block_n x warps x tiles; top-k digit width x chunk);
``--timeline`` prints where a launch's time goes between its programs (``timeline``);
``--digits`` times top-k's radix digit widths at every selection shape (``digit_sweep``);
``--read-ceiling`` times the indexer against a kernel that only reads the same bytes (``read_ceiling``);
``--ab FILE`` times the Gluon kernel against another copy of its file, in one process (``ab``).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.gpu.common import HEADER, Ceilings, Row, measure_ceilings, time_s  # noqa: E402
from deepinfer_vllm.ops import paged_indexer as ref  # noqa: E402
from deepinfer_vllm.ops.triton.indexer import index_scores_paged, index_scores_paged_sparse  # noqa: E402
from deepinfer_vllm.ops.triton.topk import block_scores, candidate_blocks, topk_indices  # noqa: E402

H, D, REC = 32, 128, 68
RATIO, BLOCK = 2, 64
PAGE_N = BLOCK // RATIO
OTHER_PAGE_BYTES = 4096
BATCHES = (64, 128, 256)
CONTEXTS = (8192, 32768, 131072)
TOPK_CASES = [(T, N, 512) for N in (8192, 32768, 131072) for T in (64, 256)]
TOPK_CASES += [(64, 16384, 2048), (256, 16384, 2048)]
CAND = dict(N=131072, keep=2048, k=512, T=(64, 256), B=128)
BASELINE_SHAPE = (64, 8192)
DEVICE = "cuda"


def make_cache(n_req: int, entries: int, device: str | None = None):
    """Random MXFP4 records (scales 2^-3 .. 2^1) for ``n_req`` requests, pages shuffled."""
    device = device or DEVICE
    pages = -(-entries // PAGE_N)
    num_blocks = n_req * pages
    stride = PAGE_N * REC + OTHER_PAGE_BYTES
    buf = torch.randint(0, 256, (num_blocks, stride), dtype=torch.uint8, device=device)
    buf[:, PAGE_N * 64 : PAGE_N * REC] = torch.randint(
        124, 129, (num_blocks, PAGE_N * 4), dtype=torch.uint8, device=device
    )
    cache = buf.view(-1).as_strided((num_blocks, 1, PAGE_N, REC), (stride, PAGE_N * REC, REC, 1))
    bt = torch.randperm(num_blocks, device=device).view(n_req, pages).to(torch.int32)
    return cache, bt


def decode_inputs(B: int, ctx: int):
    """One decode token per request over ``ctx`` keys: ``(cache, bt, q, w, req, vis)``."""
    cache, bt = make_cache(B, ctx)
    q, w = make_queries(B)
    return cache, bt, q, w, torch.arange(B, device=DEVICE), torch.full((B,), ctx, device=DEVICE)


def kept_blocks(B: int, ctx: int, kb: int) -> torch.Tensor:
    """A different ascending set of ``kb`` candidate blocks of 8 entries per token, ``[B, kb]``."""
    kept = torch.stack([torch.randperm(ctx // 8, device=DEVICE)[:kb] for _ in range(B)])
    return torch.sort(kept, dim=1).values.to(torch.int32)


def make_queries(T: int, device: str | None = None):
    from deepinfer_vllm.ops import quant

    device = device or DEVICE
    q = quant.mxfp4_qdq(torch.randn(T, H, D, device=device)).to(torch.bfloat16)
    w = torch.randn(T, H, device=device).to(torch.bfloat16)
    return q, w


# Scores variants timed at VARIANT_SHAPES (kwargs of index_scores_paged): the default is the
# Gluon kernel on fp8 wgmma (mode 5: cp.async ring of 4 stages, program length from
# ``indexer_gluon.program_tiles``) on sm90.
SCORE_VARIANTS = [
    ("mode 3 tl fp16", dict(mode=3)),
    ("gluon stages=3", dict(stages=3)),
    ("gluon stages=6", dict(stages=6)),
    ("gluon tiles=64", dict(tiles=64)),
    ("gluon tiles=256 (power-of-two rule)", dict(tiles=256)),
]
VARIANT_SHAPES = ((128, 32768), (256, 131072))


def _score_rows(variants: bool = True) -> list[Row]:
    rows = []
    for ctx in CONTEXTS:
        cache, bt = make_cache(max(BATCHES), ctx)
        for B in BATCHES:
            req = torch.arange(B, device=DEVICE)
            vis = torch.full((B,), ctx, device=DEVICE)
            q, w = make_queries(B)
            nbytes = B * ctx * (REC + 4) + q.numel() * 2 + w.numel() * 2
            flops = 2 * H * D * B * ctx
            t = time_s(lambda: index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK, max_visible=ctx))
            t_ref, base = float("nan"), ""
            if (B, ctx) == BASELINE_SHAPE:
                t_ref = time_s(lambda: ref.index_scores_paged(q, w, cache, bt[:B], req, vis, RATIO, BLOCK,
                                                              max_visible=ctx), warmup=1, rep=3, graph=False)
                base = "torch paged ref"
            rows.append(Row("index_scores_paged", f"decode B={B} ctx={ctx}", t, nbytes, flops, base, t_ref))
            if variants and (B, ctx) in VARIANT_SHAPES:
                for name, kw in SCORE_VARIANTS:
                    try:
                        tv = time_s(lambda: index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK,
                                                               max_visible=ctx, **kw))
                    except Exception as exc:  # a variant this Triton cannot compile
                        print(f"variant {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                        continue
                    rows.append(Row(f"index_scores_paged [{name}]", f"decode B={B} ctx={ctx}", tv, nbytes,
                                    flops))
        del cache, bt
    return rows


def _bf16_scores(T: int, N: int) -> torch.Tensor:
    return (torch.randn(T, N, device=DEVICE) * 4).to(torch.bfloat16).float()


def _topk_rows() -> list[Row]:
    # Top-k variants timed next to the default (``run``), at the shapes where the choice matters.
    # "reg" = rows (or block maxima + the entries of the top-k blocks) in registers, "stream" = the
    # chunked passes over memory (the previous default).
    variants = {
        (64, 8192, 512): [("stream", dict(method="stream"))],
        (256, 32768, 512): [("stream", dict(method="stream")), ("reg s1=4", dict(method="reg", s1=4))],
        (64, 131072, 512): [
            ("stream", dict(method="stream")),
            ("reg s1=8", dict(method="reg", s1=8)),
            ("reg s1=32", dict(method="reg", s1=32)),
            ("reg dbits=4", dict(method="reg", dbits=4)),
            ("reg dbits=6", dict(method="reg", dbits=6)),
        ],
        (256, 131072, 512): [
            ("reg s1=32", dict(method="reg", s1=32)),
            ("reg dbits=4", dict(method="reg", dbits=4)),
        ],
        (64, 16384, 2048): [("stream", dict(method="stream")), ("reg s1=2", dict(method="reg", s1=2))],
        (256, 16384, 2048): [
            ("reg s1=2", dict(method="reg", s1=2)),
            ("reg dbits=4", dict(method="reg", dbits=4)),
            ("reg dbits=6", dict(method="reg", dbits=6)),
            ("reg warps=8", dict(method="reg", num_warps=8)),
        ],
    }

    def _time_variant(name, fn):
        try:
            return time_s(fn)
        except Exception as exc:  # a variant this Triton cannot compile: report, keep the run going
            print(f"top-k variant {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    rows = []
    for T, N, k in TOPK_CASES:
        s = _bf16_scores(T, N)
        t = time_s(lambda: topk_indices(s, k))
        t_ref = time_s(lambda: torch.topk(s, k, dim=1, sorted=False))
        rows.append(Row("topk_indices", f"T={T} N={N} k={k}", t, T * N * 4 + T * k * 4, 0.0,
                        "torch.topk", t_ref))
        for name, kw in variants.get((T, N, k), []):
            tv = _time_variant(name, lambda: topk_indices(s, k, **kw))
            if tv is not None:
                rows.append(Row(f"topk_indices [{name}]", f"T={T} N={N} k={k}", tv,
                                T * N * 4 + T * k * 4, 0.0, "torch.topk", t_ref))
    return rows


def _candidate_rows() -> list[Row]:
    cand_variants = [("reg s1=2", dict(method="reg", s1=2)), ("reg dbits=6", dict(method="reg", dbits=6))]
    mapped_variants = [("reg s1=4", dict(method="reg", s1=4)), ("stream", dict(method="stream"))]

    def _time_variant(name, fn):
        try:
            return time_s(fn)
        except Exception as exc:  # a variant this Triton cannot compile: report, keep the run going
            print(f"top-k variant {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    rows = []
    N, kb, k = CAND["N"], CAND["keep"], CAND["k"]
    for T in CAND["T"]:
        s = _bf16_scores(T, N)
        vis = torch.full((T,), N, device=DEVICE)
        t = time_s(lambda: candidate_blocks(s, vis, 8, kb))
        t_bs = time_s(lambda: block_scores(s, vis, 8))
        bs = block_scores(s, vis, 8)
        # Baseline: our block maxima, then torch.topk over them (not tie-stable).
        t_ref = t_bs + time_s(lambda: torch.topk(bs, kb, dim=1, sorted=False))
        rows.append(Row("candidate_blocks", f"T={T} N={N} keep={kb}x8", t, T * N * 4 + T * kb * 4, 0.0,
                        "block max + torch.topk", t_ref))
        for name, kw in cand_variants:
            tv = _time_variant(name, lambda: candidate_blocks(s, vis, 8, kb, **kw))
            if tv is not None:
                rows.append(Row(f"candidate_blocks [{name}]", f"T={T} N={N} keep={kb}x8", tv,
                                T * N * 4 + T * kb * 4, 0.0, "block max + torch.topk", t_ref))
        rows.append(Row("  block_scores", f"T={T} N={N}", t_bs, T * N * 4 + T * N // 8 * 4))
    ctx, B = N, CAND["B"]
    cache, bt, q, w, req, vis = decode_inputs(B, ctx)
    kept = torch.sort(torch.randperm(ctx // 8, device=DEVICE)[:kb].repeat(B, 1), dim=1).values.to(torch.int32)
    nkeys = kb * 8
    t = time_s(lambda: index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept, 8))
    rows.append(Row("index_scores_paged_sparse", f"reindex B={B} ctx={ctx} keys={nkeys}", t,
                    B * nkeys * (REC + 4) + B * kb * 4, 2 * H * D * B * nkeys))
    tv = _time_variant("stages=4", lambda: index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept,
                                                                      8, stages=4))
    if tv is not None:  # the dense rows' ring depth, against the candidate path's default of 3
        rows.append(Row("index_scores_paged_sparse [stages=4]", f"reindex B={B} ctx={ctx} keys={nkeys}", tv,
                        B * nkeys * (REC + 4) + B * kb * 4, 2 * H * D * B * nkeys))
    compact = index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept, 8)
    t = time_s(lambda: topk_indices(compact, k, index_map=kept, map_block=8))
    t_ref = time_s(lambda: torch.topk(compact, k, dim=1, sorted=False))
    rows.append(Row("topk_indices (mapped)", f"reindex B={B} N={nkeys} k={k}", t,
                    B * nkeys * 4 + B * k * 4, 0.0, "torch.topk", t_ref))
    for name, kw in mapped_variants:
        tv = _time_variant(name, lambda: topk_indices(compact, k, index_map=kept, map_block=8, **kw))
        if tv is not None:
            rows.append(Row(f"topk_indices (mapped) [{name}]", f"reindex B={B} N={nkeys} k={k}", tv,
                            B * nkeys * 4 + B * k * 4, 0.0, "torch.topk", t_ref))
    return rows


def run(ceilings: Ceilings) -> list[Row]:
    torch.manual_seed(0)
    return _score_rows() + _topk_rows() + _candidate_rows()


def sweep() -> None:
    """Scores launch parameters and top-k digit widths on one decode shape each (not in ``run``)."""
    B, ctx = 128, 32768
    cache, bt, q, w, req, vis = decode_inputs(B, ctx)
    for mode in (3,):
        for pf in (0, 1, 2):
            for bn, nw in [(64, 4), (128, 4), (128, 8), (256, 8)]:
                for tiles in (2, 4, 8):
                    try:
                        t = time_s(lambda: index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK,
                                                              max_visible=ctx, mode=mode, prefetch=pf,
                                                              block_n=bn, num_warps=nw, tiles=tiles))
                    except Exception as exc:
                        print(f"mode={mode} prefetch={pf} bn={bn} nw={nw} tiles={tiles}: {type(exc).__name__}")
                        continue
                    print(f"scores mode={mode} prefetch={pf} bn={bn} nw={nw} tiles={tiles}: {t * 1e6:.1f} us "
                          f"{B * ctx * REC / t / 1e12:.2f} TB/s (keys only)")
    for T, N, k in [(64, 131072, 512), (256, 32768, 512), (256, 16384, 2048)]:
        s = _bf16_scores(T, N)
        for dbits in (4, 6, 8):
            for block in (1024, 2048, 4096):
                t = time_s(lambda: topk_indices(s, k, dbits=dbits, block=block))
                print(f"topk T={T} N={N} k={k} dbits={dbits} block={block}: {t * 1e6:.1f} us")


def digit_sweep(widths=(4, 5, 6, 7, 8)) -> None:
    """Top-k radix digit width at every selection shape of the indexer path (dense top-k at
    T = 16 / 64 / 256, k = 512 / 2048, N = 8192..131072 bf16-valued scores, two fp32 rows,
    candidate blocks and the mapped reindex top-k). Prints µs per width and whether every width
    selected the same indices (run 12 chose the default from it)."""
    def line(name, fn):
        outs, ts = [], []
        for d in widths:
            outs.append(fn(d).clone())
            ts.append(time_s(lambda: fn(d)))
        same = all(torch.equal(o, outs[0]) for o in outs)
        print(f"{name:34s} " + " ".join(f"{t * 1e6:8.1f}" for t in ts) + f"  {same}", flush=True)

    print(f"{'shape':34s} " + " ".join(f"{'dbits=' + str(d):>8s}" for d in widths) + "  same")
    for N in (8192, 16384, 32768, 65536, 131072):
        for T in (16, 64, 256):
            for k in (512, 2048):
                if k * 4 <= N:
                    s = _bf16_scores(T, N)
                    line(f"topk T={T} N={N} k={k}", lambda d: topk_indices(s, k, dbits=d))
    for T, N in ((64, 32768), (256, 131072)):
        s = torch.randn(T, N, device=DEVICE)
        line(f"topk fp32 T={T} N={N} k=512", lambda d: topk_indices(s, 512, dbits=d))
    N, kb, k = CAND["N"], CAND["keep"], CAND["k"]
    for T in CAND["T"]:
        s = _bf16_scores(T, N)
        vis = torch.full((T,), N, device=DEVICE)
        line(f"candidate_blocks T={T} N={N}", lambda d: candidate_blocks(s, vis, 8, kb, dbits=d))
    cache, bt, q, w, req, vis = decode_inputs(CAND["B"], N)
    kept = kept_blocks(CAND["B"], N, kb)
    compact = index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept, 8)
    line(f"mapped B={CAND['B']} N={kb * 8} k={k}",
         lambda d: topk_indices(compact, k, index_map=kept, map_block=8, dbits=d))


TIMELINE_SHAPES = ((64, 8192), (256, 8192), (128, 32768), (256, 131072))


def timeline(shapes=TIMELINE_SHAPES) -> None:
    """Where a launch's time goes between programs (mode 5, default program length): every
    program's start, first-tile and end times from the global ns timer (a debug build of the
    kernel), per shape: the span, the first wave's start spread, the programs' median length
    and prologue, how busy the resident-CTA slots are, and the tail (SMs idle before the end).
    Eager launches after a warm-up; the stamps are stores, so compare these shapes with each
    other, not with the graph-timed table."""
    import deepinfer_vllm.ops.triton.indexer as ix
    import deepinfer_vllm.ops.triton.indexer_gluon as ig

    plain = ix.gluon_index_scores
    print(f"{'shape':>18s} {'tiles':>5s} {'progs':>6s} {'span us':>8s} {'start spread':>12s} "
          f"{'prog med':>8s} {'prologue':>8s} {'busy':>5s} {'SM end min/med/max (us)':>24s}")
    for B, ctx in shapes:
        cache, bt, q, w, req, vis = decode_inputs(B, ctx)
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK, max_visible=ctx)  # compiles, counts CTAs
        slots = sms * max(ig._CTAS_PER_SM.values())
        row_tiles = -(-ctx // 64)
        stamps = torch.zeros(B * row_tiles, 4, dtype=torch.int64, device=DEVICE)  # room for 1-tile programs
        ix.gluon_index_scores = lambda *a, **k: plain(*a, **{**k, "timeline": stamps})
        try:
            for _ in range(3):  # the last launch's stamps are kept
                index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK, max_visible=ctx)
            torch.cuda.synchronize()
        finally:
            ix.gluon_index_scores = plain
        st = stamps[stamps[:, 2] != 0].double()  # the launch's programs: rows 0 .. grid size - 1
        progs = st.shape[0]
        tiles = -(-row_tiles // (progs // B))
        t0 = st[:, 0].min()
        start, first, end = st[:, 0] - t0, st[:, 1] - t0, st[:, 2] - t0
        span = end.max().item()
        sm = st[:, 3].long()
        sm_end = torch.stack([end[sm == i].max() for i in sm.unique()])
        busy = (end - start).sum().item() / (span * slots)
        first_wave = start.sort().values[: min(progs, slots)]
        print(f"{f'B={B} x {ctx}':>18s} {tiles:5d} {progs:6d} {span / 1e3:8.1f} "
              f"{(first_wave[-1] - first_wave[0]).item() / 1e3:10.1f}us "
              f"{(end - start).median().item() / 1e3:7.1f}u {(first - start).median().item() / 1e3:7.2f}u "
              f"{busy:5.2f} {sm_end.min().item() / 1e3:8.1f}/{sm_end.median().item() / 1e3:.1f}/"
              f"{sm_end.max().item() / 1e3:.1f}")
        del cache, bt


def _copy_seconds(nbytes: int) -> float:
    """Seconds for a contiguous device copy that reads and writes ``nbytes`` in all."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_s(lambda: dst.copy_(src))


def read_ceiling() -> None:
    """The indexer against a kernel that only reads the same bytes (``read_ceiling.py``): dense
    rows' whole pages, and the candidate path's kept blocks. Rates count record bytes. For dense
    rows also a torch copy of as many bytes in one contiguous buffer (half of them read, half
    written, as the 1 GiB copy ceiling counts them): what a kernel of that size reaches when its
    access pattern is the easiest one."""
    from benchmarks.gpu.read_ceiling import read_blocks, read_pages

    copy = measure_ceilings().copy_bytes_per_s
    print(f"{'shape':>34s} {'indexer us':>10s} {'reader us':>9s} {'reader % copy':>13s} {'reader / indexer':>16s}"
          f" {'torch copy % copy':>17s}")

    def line(name, rec_bytes, t_idx, t_read, extra=""):
        print(f"{name:>34s} {t_idx * 1e6:10.1f} {t_read * 1e6:9.1f} {rec_bytes / t_read / copy:12.0%} "
              f"{t_read / t_idx:16.2f}{extra}")

    for B, ctx in TIMELINE_SHAPES:
        cache, bt, q, w, req, vis = decode_inputs(B, ctx)
        t_idx = time_s(lambda: index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK, max_visible=ctx))
        t_read = time_s(read_pages(cache, bt, PAGE_N, REC))
        del cache, bt
        n = B * ctx * REC
        line(f"B={B} x {ctx}", n, t_idx, t_read, f" {n / _copy_seconds(n) / copy:17.0%}")
    ctx, kb = CAND["N"], CAND["keep"]
    for B in (64, 128, 256):
        cache, bt, q, w, req, vis = decode_inputs(B, ctx)
        kept = kept_blocks(B, ctx, kb)
        t_idx = time_s(lambda: index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept, 8))
        line(f"reindex B={B} {kb} x 8 of {ctx}", B * kb * 8 * REC, t_idx,
             time_s(read_blocks(cache, bt, req, kept, PAGE_N)))
        del cache, bt


def ab(path: str) -> list[tuple[str, float, float, bool]]:
    """Same-process A/B of the Gluon scores kernel against another copy of its file (for
    instance ``git show other-branch:deepinfer_vllm/ops/triton/indexer_gluon.py > /tmp/b.py``):
    best of two alternating rounds each, after L2 flushes. Rows ``(shape, this, other, same
    scores)``."""
    import importlib.util

    import deepinfer_vllm.ops.triton.indexer as ix

    spec = importlib.util.spec_from_file_location("indexer_gluon_b", path)
    other = importlib.util.module_from_spec(spec)
    sys.modules["indexer_gluon_b"] = other
    spec.loader.exec_module(other)
    mine = ix.gluon_index_scores
    cases = [(f"B={B} x {ctx}", B, ctx, None) for B, ctx in TIMELINE_SHAPES]
    cases.append((f"reindex B={CAND['B']} {CAND['keep']} x 8", CAND["B"], CAND["N"], CAND["keep"]))
    rows = []
    for name, B, ctx, kb in cases:
        cache, bt, q, w, req, vis = decode_inputs(B, ctx)
        if kb is None:
            def run():
                return index_scores_paged(q, w, cache, bt, req, vis, RATIO, BLOCK, max_visible=ctx)
        else:
            kept = kept_blocks(B, ctx, kb)

            def run():
                return index_scores_paged_sparse(q, w, cache, bt, req, vis, RATIO, BLOCK, kept, 8)
        best, outs = {"this": float("inf"), "other": float("inf")}, {}
        for _ in range(2):
            for side, fn in (("this", mine), ("other", other.gluon_index_scores)):
                ix.gluon_index_scores = fn
                try:
                    outs[side] = run().clone()
                    best[side] = min(best[side], time_s(run))
                finally:
                    ix.gluon_index_scores = mine
        rows.append((name, best["this"], best["other"], torch.equal(outs["this"], outs["other"])))
        del cache, bt
    return rows


if __name__ == "__main__":
    if "--ab" in sys.argv:  # --ab FILE: this Gluon kernel against another copy of its file
        print(f"{'shape':28s} {'this us':>9s} {'other us':>9s} {'this/other':>10s} {'same scores':>11s}")
        for name, mine_t, other_t, same in ab(sys.argv[sys.argv.index("--ab") + 1]):
            print(f"{name:28s} {mine_t * 1e6:9.1f} {other_t * 1e6:9.1f} {mine_t / other_t:10.3f} {str(same):>11s}")
        sys.exit()
    if "--read-ceiling" in sys.argv:
        read_ceiling()
        sys.exit()
    if "--sweep" in sys.argv:
        sweep()
        sys.exit()
    if "--timeline" in sys.argv:
        timeline()
        sys.exit()
    if "--digits" in sys.argv:
        digit_sweep()
        sys.exit()
    c = measure_ceilings()
    print(f"copy ceiling {c.copy_bytes_per_s / 1e12:.2f} TB/s")
    print("  ".join(HEADER))
    for row in run(c):
        print("  ".join(row.cells(c)))

