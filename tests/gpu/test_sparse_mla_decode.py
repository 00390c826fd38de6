"""Sparse MLA decode kernel vs the paged PyTorch reference (``ops/paged_attention.py``).

Caches hold real records (``paged_records.write_records``) in shuffled, block-outermost
packed pages (window + compressed cache side by side in one buffer per block, plus
padding), every slot that was never written holds NaN bytes, and block-table entries
no valid key needs point at a page of NaN bytes. Tokens have ragged positions (partial
windows), some a raised ``window_lo``, top-k lists with -1 holes, fewer valid entries than
K, K below the visible count; several tokens per request (consecutive positions).
Pass criterion: per-token relative L2 error ``||out - ref|| / ||ref||`` <= 1e-2 (bf16) /
2e-5 (fp32), tokens whose reference is zero (no valid key) are exactly zero, and the
poisoned output buffer's padding heads are untouched.

Under TRITON_INTERPRET=1 (small shapes only) three things are weaker than on the GPU:
e4m3 NaN codes decode as +-480 there (so NaN garbage reaching a product is only caught
on the GPU), fp32 -> bf16 casts truncate (bf16 errors ~3x the GPU's), and bf16 dots
run in fp32 (the interpreter cannot multiply bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from conftest import INTERPRET, poison_, shapes
from deepinfer_vllm.ops.paged_attention import paged_sparse_attention
from deepinfer_vllm.ops.paged_records import RecordFormat, write_records
from deepinfer_vllm.ops.triton.sparse_mla_decode import DecodeConfig, default_config, sparse_mla_decode
from deepinfer_vllm.ops.triton.sparse_mla_decode_gluon import gluon_decode_supported

NAN_BYTE = 0xFF  # e4m3 NaN value code, UE8M0 NaN scale, e2m1 pairs of -6 with NaN e4m3 scales


@dataclass
class Case:
    q: torch.Tensor
    args: dict
    buf: torch.Tensor  # the packed page buffer both caches are views of


def _topk_rows(g, visible: torch.Tensor, K: int) -> torch.Tensor:
    """Per token: a random subset of [0, visible), index-sorted, -1 fill, then some -1 holes."""
    rows = []
    for v in visible.tolist():
        n = min(K, v)
        if n and torch.rand((), generator=g) < 0.3:
            n = int(torch.randint(0, n + 1, (), generator=g))  # fewer valid than possible
        chosen = torch.randperm(v, generator=g)[:n].sort().values if v else torch.empty(0, dtype=torch.long)
        row = torch.full((K,), -1, dtype=torch.long)
        row[:n] = chosen
        holes = torch.rand(K, generator=g) < 0.1
        row[holes] = -1
        rows.append(row)
    return torch.stack(rows)


def make_case(
    device,
    *,
    tokens_per_req: list[int],
    H: int,
    D: int,
    W: int,
    K: int,
    ratio: int | None,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    raise_lo: bool = True,
    sink_scale: float = 1.0,
    q_scale: float = 1.0,
    max_len: int | None = None,
) -> Case:
    """Indices come from a CPU generator; the caches and latents are built on ``device``."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    R = len(tokens_per_req)
    # Context of each request; its tokens are its last positions (spec-decode verification).
    max_len = max_len or 3 * W + 4 * block_size
    ctx = [int(torch.randint(n, max_len, (), generator=g)) + 1 for n in tokens_per_req]
    ctx[0] = tokens_per_req[0]  # a request at the very start: partial windows
    if R > 1:
        ctx[-1] = max_len  # and one at the longest context
    positions = torch.cat([torch.arange(L - n, L) for n, L in zip(tokens_per_req, ctx)])
    token_req = torch.cat([torch.full((n,), r) for r, n in enumerate(tokens_per_req)])
    T = positions.numel()
    window_lo = torch.zeros(T, dtype=torch.long)
    if raise_lo:
        pick = torch.rand(T, generator=g) < 0.25
        back = torch.randint(0, W + 2, (int(pick.sum()),), generator=g)
        window_lo[pick] = (positions[pick] - back).clamp_min(0)
        window_lo[-1] = positions[-1] + 1  # no window key at all

    w_fmt = RecordFormat("mxfp8", D)
    c_fmt = RecordFormat("nvfp4", D)
    n_c = block_size // (ratio or 1)
    w_page = block_size * w_fmt.record_bytes
    c_page = n_c * c_fmt.record_bytes
    pad = 48
    blocks_per_req = -(-max(ctx) // block_size) + 1
    num_blocks = 2 * R * blocks_per_req + 1
    garbage_block = 0  # also where a masked-but-dereferenced address would land
    buf = torch.full((num_blocks, w_page + c_page + pad), NAN_BYTE, dtype=torch.uint8, device=device)
    window_cache = buf[:, :w_page].unflatten(1, (1, block_size, w_fmt.record_bytes))
    comp_cache = buf[:, w_page : w_page + c_page].unflatten(1, (1, n_c, c_fmt.record_bytes))
    assert window_cache.stride(0) > block_size * w_fmt.record_bytes

    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    w_bt = torch.full((R, blocks_per_req + 3), garbage_block, dtype=torch.long)
    c_bt = torch.full((R, blocks_per_req + 3), garbage_block, dtype=torch.long)
    w_bt[:, :blocks_per_req] = perm[: R * blocks_per_req].view(R, -1)
    c_bt[:, :blocks_per_req] = perm[R * blocks_per_req : 2 * R * blocks_per_req].view(R, -1)

    lo_eff = torch.maximum(window_lo, positions - (W - 1)).clamp_min(0)
    for r, L in enumerate(ctx):
        first = int(lo_eff[token_req == r].min())
        # window records only where some token can see them; blocks nobody needs -> garbage page
        pos = torch.arange(first, L)
        lat = torch.randn(pos.numel(), D, generator=gd, device=device) * 2
        blocks, offsets = w_bt[r, pos // block_size].to(device), (pos % block_size).to(device)
        write_records(window_cache, w_fmt, blocks, offsets, lat)
        needed = torch.zeros(blocks_per_req + 3, dtype=torch.bool)
        needed[pos // block_size] = True
        w_bt[r, ~needed] = garbage_block
        if ratio:
            first_pos = torch.arange(L // ratio) * ratio
            write_records(comp_cache, c_fmt, c_bt[r, first_pos // block_size].to(device),
                          ((first_pos % block_size) // ratio).to(device),
                          torch.randn(first_pos.numel(), D, generator=gd, device=device) * 2)

    args = dict(
        window_cache=window_cache, window_block_table=w_bt.int(), window_block_size=block_size,
        positions=positions, window_lo=window_lo, token_req=token_req, window=W,
        sink=(torch.randn(H, generator=g) * sink_scale).float(), scale=D**-0.5,
    )
    if ratio:
        visible = (positions + 1) // ratio
        args.update(comp_cache=comp_cache, comp_block_table=c_bt, comp_block_size=block_size,
                    comp_ratio=ratio, topk=_topk_rows(g, visible, K))
    q = (torch.randn(T, H, D, generator=g) * q_scale).to(dtype)
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return Case(q.to(device), args, buf)


def _check(case: Case, config: DecodeConfig | None = None):
    q = case.q
    T, H, D = q.shape
    ref = paged_sparse_attention(q, **case.args).float()
    # poisoned buffer with two extra heads that must stay untouched
    big = poison_(torch.empty(T, H + 2, D, dtype=q.dtype, device=q.device))
    out = sparse_mla_decode(q, **case.args, config=config, out=big[:, :H])
    assert out.data_ptr() == big.data_ptr()
    assert torch.isnan(big[:, H:].float()).all(), "kernel wrote outside its heads"
    out = out.float()
    assert torch.isfinite(out).all(), "output not fully written / NaN leaked from a masked key"
    tol = 1e-2 if q.dtype == torch.bfloat16 else 2e-5
    ref_norm = ref.flatten(1).norm(dim=1)
    err = (out - ref).flatten(1).norm(dim=1)
    zero = ref_norm == 0
    assert torch.equal(out[zero], ref[zero]), "a token without valid keys must return zeros"
    rel = err[~zero] / ref_norm[~zero]
    assert rel.numel() == 0 or rel.max() <= tol, f"max rel err {rel.max():.3g} > {tol}"
    return out


SMALL = [
    # (tokens_per_req, H, D, W, K, ratio, block_size, max_len)
    ([1, 2, 3], 4, 64, 8, 4, 2, 16, None),
    ([2, 1], 4, 128, 8, 16, 1, 16, None),
    ([1, 1, 2], 4, 64, 8, 0, None, 8, None),
    ([3, 1], 20, 64, 24, 40, 2, 32, None),
    ([1, 2], 64, 512, 128, 512, 2, 64, 700),  # Flash heads/dims/window/top-k
]
LARGE = [
    ([1], 64, 512, 128, 512, 2, 64, 4096),  # batch 1: flash-decoding splits + combine
    ([1] * 16, 64, 512, 128, 512, 1, 64, 4096),
    ([1] * 64, 64, 512, 128, 512, 2, 64, None),
    ([2] * 32, 64, 512, 128, 512, 1, 64, None),
    ([1] * 256, 64, 512, 128, 512, 2, 256, None),
    ([1] * 7 + [3] * 5, 4, 512, 128, 512, 1, 64, None),  # tiny-model heads
    ([1] * 100, 64, 512, 128, 0, None, 64, None),  # window-only layer
    ([4] * 3, 64, 192, 128, 300, 2, 32, None),  # D, K not powers of two
    ([1] * 8, 100, 512, 128, 512, 2, 64, None),  # two head blocks, the second partial
    ([1, 2, 1], 64, 512, 128, 512, 1, 64, 131072),  # 131072 compressed positions
    ([1, 1], 64, 512, 128, 512, 2, 64, 262144),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", shapes(SMALL, LARGE))
def test_matches_reference(device, shape, dtype):
    """The Triton kernel (the Gluon one has its own test below)."""
    tpr, H, D, W, K, ratio, bs, max_len = shape
    case = make_case(device, tokens_per_req=tpr, H=H, D=D, W=W, K=K, ratio=ratio, block_size=bs,
                     dtype=dtype, seed=len(tpr) * 1000 + H + D + (ratio or 0), max_len=max_len)
    _check(case, DecodeConfig(gluon=False) if dtype == torch.bfloat16 else None)


def _gluon_ok(device) -> bool:
    return (device.type == "cuda" and gluon_decode_supported(torch.empty(1, 1, 512, dtype=torch.bfloat16,
                                                                         device=device), []))


GLUON_SHAPES = [s for s in SMALL + LARGE if s[2] == 512]


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run in Triton's interpreter")
@pytest.mark.parametrize("shape", GLUON_SHAPES)
def test_gluon_matches_reference(device, shape):
    """The warp-specialised sm90 kernel (bf16, D = 512) on every D = 512 shape: batch 1 with
    flash-decoding splits, ragged windows and top-k lists, window-only layers, 100 heads (a
    partial second head block), 131072-262144 compressed positions."""
    if not _gluon_ok(device):
        pytest.skip("needs an sm90 GPU and Triton's Gluon")
    tpr, H, D, W, K, ratio, bs, max_len = shape
    case = make_case(device, tokens_per_req=tpr, H=H, D=D, W=W, K=K, ratio=ratio, block_size=bs,
                     dtype=torch.bfloat16, seed=len(tpr) * 1000 + H + D + (ratio or 0) + 1, max_len=max_len)
    _check(case, DecodeConfig(gluon=True))


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run in Triton's interpreter")
@pytest.mark.parametrize("splits", [1, 2, 3, 40])
@pytest.mark.parametrize("ratio", [1, 2, None])
def test_gluon_splits_and_agreement(device, splits, ratio):
    """Every split count (tile ranges that start in the window, in the compressed tiles,
    empty ones) gives the reference's result, and the two kernels agree closely: they build
    identical bf16 tiles, only the summation order differs."""
    if not _gluon_ok(device):
        pytest.skip("needs an sm90 GPU and Triton's Gluon")
    case = make_case(device, tokens_per_req=[1, 2, 3, 1] * 3, H=64, D=512, W=128, K=512 if ratio else 0,
                     ratio=ratio, block_size=64, dtype=torch.bfloat16, seed=40 + splits, max_len=3000)
    out = _check(case, DecodeConfig(gluon=True, num_splits=splits))
    tri = sparse_mla_decode(case.q, **case.args, config=DecodeConfig(gluon=False)).float()
    norm = tri.flatten(1).norm(dim=1).clamp_min(1e-30)
    assert ((out - tri).flatten(1).norm(dim=1) / norm).max() <= 5e-3


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run in Triton's interpreter")
@pytest.mark.parametrize("q_rows", ["token-contiguous", "strided"])
@pytest.mark.parametrize("programs", [1, 3, 7])
@pytest.mark.parametrize("splits", [1, 3, 40])
def test_gluon_persistent_programs(device, programs, splits, q_rows):
    """Fewer persistent CTAs than work items: each CTA runs many items back to back (Q
    copies behind the item before, tile buffers and barriers carried across items), items
    without tiles among them (split ranges inside skipped window tiles), two head blocks.
    Q's token rows contiguous (copied by TMA) or every other token of a bigger tensor (by
    cp.async). An item's result does not depend on which CTA ran it: bit-identical to one
    CTA per SM."""
    if not _gluon_ok(device):
        pytest.skip("needs an sm90 GPU and Triton's Gluon")
    case = make_case(device, tokens_per_req=[1, 2, 1, 3], H=100, D=512, W=128, K=512, ratio=2, block_size=64,
                     dtype=torch.bfloat16, seed=70 + splits, max_len=2000)
    if q_rows == "strided":
        wide = torch.full((2 * case.q.shape[0], *case.q.shape[1:]), float("nan"), dtype=case.q.dtype, device=device)
        wide[::2] = case.q
        case.q = wide[::2]
    out = _check(case, DecodeConfig(gluon=True, num_splits=splits, programs=programs))
    one_per_sm = sparse_mla_decode(case.q, **case.args, config=DecodeConfig(gluon=True, num_splits=splits))
    assert torch.equal(out, one_per_sm.float())


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run in Triton's interpreter")
def test_gluon_invalid_keys_never_read(device):
    """As ``test_invalid_keys_never_read`` for the Gluon kernel: bytes no valid key owns (NaN
    codes included) change nothing, bit for bit."""
    if not _gluon_ok(device):
        pytest.skip("needs an sm90 GPU and Triton's Gluon")
    case = make_case(device, tokens_per_req=[2, 1, 1], H=64, D=512, W=128, K=128, ratio=2, block_size=64,
                     dtype=torch.bfloat16, seed=5, max_len=900)
    config = DecodeConfig(gluon=True)
    out = sparse_mla_decode(case.q, **case.args, config=config)
    _scramble_unowned_bytes(case)
    assert torch.equal(sparse_mla_decode(case.q, **case.args, config=config), out)


@pytest.mark.skipif(INTERPRET, reason="Gluon kernels do not run in Triton's interpreter")
def test_gluon_refuses_what_it_cannot_run(device):
    """``gluon=True`` on inputs the kernel does not take is an error, not a silent fallback."""
    case = make_case(device, tokens_per_req=[1], H=4, D=64, W=8, K=4, ratio=2, block_size=8,
                     dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="gluon=True"):
        sparse_mla_decode(case.q, **case.args, config=DecodeConfig(gluon=True))


_T = dict(gluon=False)  # these are the Triton kernel's launch options
CONFIGS = [
    DecodeConfig(block_n=16, num_warps=4, num_splits=1, **_T),
    DecodeConfig(block_n=32, num_splits=2, **_T),
    DecodeConfig(block_n=16, num_splits=3, **_T),
    DecodeConfig(num_splits=40, **_T),  # clamped to the number of tiles
    DecodeConfig(split_s=False, **_T),
    DecodeConfig(lazy_rescale=False, **_T),
    DecodeConfig(fast_fp4=False, **_T),
    DecodeConfig(num_stages=1, **_T),
    DecodeConfig(block_h=16, **_T),  # four head blocks per token on the GPU
    DecodeConfig(num_stages=2, **_T),
    DecodeConfig(prefetch=0, **_T),
    DecodeConfig(prefetch=2, **_T),
    DecodeConfig(prefetch=3, **_T),
    DecodeConfig(prefetch=2, num_stages=1, **_T),
    DecodeConfig(prefetch=3, block_n=16, num_splits=3, **_T),  # split tile ranges + prefetch
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_configs(device, config, dtype):
    """Every launch option computes the same operator: flash-decoding splits (partials +
    combine), tile sizes, the S-split / lazy-rescale / fast-FP4 switches, the
    prefetch pipelines."""
    big = device.type == "cuda"
    case = make_case(device, tokens_per_req=[1, 2] * (8 if big else 1), H=64 if big else 4,
                     D=512 if big else 64, W=128 if big else 24, K=512 if big else 40, ratio=2,
                     block_size=64 if big else 16, dtype=dtype, seed=7)
    if big and dtype == torch.float32:
        # the fp32 (FMA) path only compiles in reasonable time with small tiles
        config = replace(config, block_n=16, block_h=16, num_warps=8, num_stages=1)
    _check(case, config)


@pytest.mark.skipif(INTERPRET, reason="the PTX FP4 decoder only runs on the GPU")
@pytest.mark.parametrize("ratio", [1, 2])
def test_fast_fp4_is_exact(device, ratio):
    """The PTX NVFP4 decoder and the portable one build identical tiles, so the outputs
    agree bit for bit."""
    case = make_case(device, tokens_per_req=[1, 3, 2], H=64, D=512, W=128, K=512, ratio=ratio,
                     block_size=64, dtype=torch.bfloat16, seed=21, max_len=5000)
    fast = sparse_mla_decode(case.q, **case.args, config=DecodeConfig(fast_fp4=True, gluon=False))
    slow = sparse_mla_decode(case.q, **case.args, config=DecodeConfig(fast_fp4=False, gluon=False))
    assert torch.equal(fast, slow)
    # the prefetch pipeline reorders loads only: same tiles, same arithmetic, same bits
    for prefetch in (0, 2, 3):
        config = DecodeConfig(prefetch=prefetch, gluon=False)
        assert torch.equal(sparse_mla_decode(case.q, **case.args, config=config), fast)


@pytest.mark.parametrize("sink_scale", [0.0, 30.0])
def test_sink_extremes(device, sink_scale):
    """A sink far above (or equal to) the logits: weights shrink but stay well defined."""
    case = make_case(device, tokens_per_req=[2, 1], H=4, D=64, W=8, K=8, ratio=1, block_size=8,
                     dtype=torch.float32, seed=11, sink_scale=sink_scale)
    if sink_scale:
        case.args["sink"] = case.args["sink"].abs() + 20.0
    _check(case)
    case.args["sink"] = torch.full_like(case.args["sink"], -1e4)  # sink negligible
    _check(case)


def test_peaky_softmax_bf16(device):
    """Large logits (sharp softmax) in bf16: the online rescaling stays accurate."""
    case = make_case(device, tokens_per_req=[2, 2], H=16, D=64, W=16, K=16, ratio=2, block_size=16,
                     dtype=torch.bfloat16, seed=3, q_scale=6.0)
    _check(case)


def _valid_record_bytes(case: Case) -> torch.Tensor:
    """Mask over the page buffer: the bytes of every record some token may read."""
    a = case.args
    D = case.q.shape[-1]
    keep = torch.zeros_like(case.buf, dtype=torch.bool)
    bs, W = a["window_block_size"], a["window"]
    pos, req = a["positions"].long().cpu(), a["token_req"].long().cpu()
    lo = a["window_lo"].long().cpu().clamp_min(0)

    def mark(cache, blocks, offsets, vb, sb):
        n = cache.shape[-2]
        base = (cache.data_ptr() - case.buf.data_ptr())  # byte offset of the cache inside a page
        for b, o in zip(blocks.tolist(), offsets.tolist()):
            keep[b, base + o * vb : base + (o + 1) * vb] = True
            keep[b, base + n * vb + o * sb : base + n * vb + (o + 1) * sb] = True

    w_bt = a["window_block_table"].long().cpu()
    for t in range(pos.numel()):
        kp = torch.arange(pos[t] - W + 1, pos[t] + 1)
        kp = kp[kp >= lo[t]]
        mark(a["window_cache"], w_bt[req[t], kp // bs], kp % bs, D, D // 32)
        if "topk" in a:
            e = a["topk"][t].long().cpu()
            e = e[e >= 0]
            r = a["comp_ratio"]
            first = e * r
            c_bt = a["comp_block_table"].long().cpu()
            mark(a["comp_cache"], c_bt[req[t], first // a["comp_block_size"]],
                 (first % a["comp_block_size"]) // r, D // 2, D // 16)
    return keep


def _scramble_unowned_bytes(case: Case) -> None:
    """Rewrite every page byte no valid key owns with random bytes (NaN codes included)."""
    keep = _valid_record_bytes(case).to(case.buf.device)
    noise = torch.randint(0, 256, case.buf.shape, dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(9))
    noise[:, ::7] = 0x7F  # NaN e4m3 codes
    case.buf.copy_(torch.where(keep, case.buf, noise.to(case.buf.device)))


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("ratio", [None, 2])
def test_invalid_keys_never_read(device, ratio, prefetch):
    """Rewriting every byte no valid key owns (random bytes, NaN codes included) changes
    nothing, bit for bit: masked keys are never read, or read and fully neutralised."""
    case = make_case(device, tokens_per_req=[2, 1, 1], H=4, D=64, W=8, K=8, ratio=ratio, block_size=8,
                     dtype=torch.float32, seed=5)
    config = replace(default_config(case.q.dtype), prefetch=prefetch, block_n=16)
    out = sparse_mla_decode(case.q, **case.args, config=config)
    _scramble_unowned_bytes(case)
    assert torch.equal(sparse_mla_decode(case.q, **case.args, config=config), out)


def test_rejects_bad_inputs(device):
    case = make_case(device, tokens_per_req=[1], H=4, D=64, W=8, K=4, ratio=2, block_size=8,
                     dtype=torch.float32, seed=1)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        sparse_mla_decode(case.q.half(), **case.args)
    bad = dict(case.args, window_block_size=16)
    with pytest.raises(ValueError, match="records per page"):
        sparse_mla_decode(case.q, **bad)
    bad = dict(case.args, topk=case.args["topk"][:, :2].float())
    with pytest.raises(TypeError, match="topk"):
        sparse_mla_decode(case.q, **bad)
    bad = dict(case.args, comp_cache=None)
    with pytest.raises(ValueError, match="topk needs"):
        sparse_mla_decode(case.q, **bad)
    with pytest.raises(ValueError, match="multiple of 64"):
        sparse_mla_decode(case.q[..., :32], **case.args)
