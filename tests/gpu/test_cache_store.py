"""store_records and pool_pairs (ops/triton/cache_store.py) against their PyTorch references.

Both are claimed bit-exact: whole cache buffers (poisoned with random bytes,
pages padded and offset like vLLM's block-outermost packing) must come out
byte-identical to ``paged_records.store_paged``, and pooled rows
identical to ``pool_ratio2(...).to(dtype)`` computed on the same device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import INTERPRET, shapes
from deepinfer_vllm.ops import quant
from deepinfer_vllm.ops.compressor import pool_ratio2, ring_write_reference, step_pair_rows
from deepinfer_vllm.ops.numerics import acc_dtype
from deepinfer_vllm.ops.paged_records import RecordFormat, store_paged
from deepinfer_vllm.ops.triton.cache_store import pool_pairs, ring_write, store_records

# (format, record dims): the real Flash dims and a small non-power-of-two one.
FORMATS = [("mxfp8", 512), ("mxfp8", 96), ("nvfp4", 512), ("nvfp4", 48), ("mxfp4", 128), ("mxfp4", 32)]
BLOCK = {"mxfp8": 32, "nvfp4": 16, "mxfp4": 32}

_E4M3 = quant.e4m3_decode(torch.arange(127, dtype=torch.uint8))  # every positive e4m3 value
_E4M3_MIDS = (_E4M3[1:] + _E4M3[:-1]) / 2
_E2M1 = quant.E2M1_VALUES[:8]
_E2M1_MIDS = (_E2M1[1:] + _E2M1[:-1]) / 2


def _pick(values: torch.Tensor, shape, g) -> torch.Tensor:
    return values[torch.randint(0, values.numel(), shape, generator=g)]


def _signs(shape, g) -> torch.Tensor:
    return torch.randint(0, 2, shape, generator=g).float() * 2 - 1


def wide_inputs(n: int, dim: int, fmt: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[n, dim]`` rows whose quantisation blocks each take one of nine kinds.

    Magnitudes 1e-30..1e30 and per element spread, exact-zero blocks (with -0.0),
    exact rounding ties of the element grid (blocks pinned so the scale is known),
    their neighbours one ulp away, NVFP4 scale ties, +-inf, values near the fp32
    limits and fp32 subnormals: every branch of every encoder.
    """
    g = torch.Generator().manual_seed(seed)
    blk = BLOCK[fmt]
    nb = dim // blk
    shape = (n, nb, blk)
    sign = _signs(shape, g)
    k = torch.randint(-20, 21, (n, nb, 1), generator=g).float()
    randn = torch.randn(shape, generator=g)

    wide = randn * torch.exp2(torch.rand((n, nb, 1), generator=g) * 200 - 100)
    wide = wide * torch.exp2(-12 * torch.rand(shape, generator=g))
    zeros = torch.zeros(shape) * sign  # +-0.0
    # Ties: the block max pins the scale, every other element sits on a midpoint
    # (or grid point) of the element format after scaling.
    if fmt == "mxfp8":
        grid, pin = torch.cat([_E4M3_MIDS, _E4M3]), 448.0
    elif fmt == "mxfp4":
        grid, pin = torch.cat([_E2M1_MIDS, _E2M1]), 6.0
    else:
        grid, pin = torch.cat([_E2M1_MIDS, _E2M1]), None
    if pin is None:
        s0 = _pick(_E4M3[1:], (n, nb, 1), g)  # amax = 6 * s0 -> scale byte of s0
        ties = _pick(grid, shape, g) * s0 * sign
        ties[..., :1] = 6 * s0
    else:
        ties = _pick(grid, shape, g) * sign * torch.exp2(k)
        ties[..., :1] = pin * torch.exp2(k[..., :1])
    # NVFP4 (and harmlessly the others): amax * fp32(1/6) near an e4m3 midpoint.
    # amax one ulp below 6 * mid is where ``amax * fp32(1/6)`` and ``amax / 6`` part.
    mid = _pick(torch.cat([_E4M3_MIDS, _E4M3_MIDS[9::8].repeat(8)]), (n, nb, 1), g)
    scale_ties = _pick(_E2M1, shape, g) * sign * mid
    nudge = torch.randint(-1, 2, (n, nb, 1), generator=g, dtype=torch.int32)
    scale_ties[..., :1] = ((6 * mid).view(torch.int32) + nudge).view(torch.float32)
    infs = randn.clone()
    infs[..., 0] = float("inf") * sign[..., 0]
    extreme_mag = torch.tensor([3.0e38, 1e-40, 1.0, 1e-30])
    extreme = sign * _pick(extreme_mag, shape, g) * torch.rand(shape, generator=g).clamp_min(0.5)
    subnormal = sign * torch.rand(shape, generator=g) * 2.0**-126  # fp32 subnormals

    kinds = [wide, zeros, ties, None, scale_ties, infs, extreme, subnormal, randn]
    kind = torch.randint(0, len(kinds), (n, nb, 1), generator=g)
    out = torch.zeros(shape, dtype=dtype)
    for i, vals in enumerate(kinds):
        if vals is None:  # neighbours of ties: one ulp of ``dtype`` up or down
            t = ties.to(dtype)
            direction = torch.where(sign > 0, float("inf"), float("-inf")).to(dtype)
            vals = torch.nextafter(t, direction)
            vals[..., :1] = t[..., :1]
        out = torch.where(kind == i, vals.to(dtype), out)
    return out.flatten(1)


def _paged_buffer(num_blocks: int, n_per_page: int, record: int, seed: int):
    """Random bytes ``[num_blocks, stride]`` plus a function making the layer view.

    Pages of another cache surround the layer's page (block-outermost packing), so
    the view starts at an offset and its block stride exceeds ``N * R``.
    """
    g = torch.Generator().manual_seed(seed)
    lead, tail = 3 * record + 5, 2 * record + 11
    stride = lead + n_per_page * record + tail
    buf = torch.randint(0, 256, (num_blocks, stride), dtype=torch.uint8, generator=g)

    def view(b: torch.Tensor, four_d: bool) -> torch.Tensor:
        page = b[:, lead : lead + n_per_page * record]
        return page.unflatten(1, (1, n_per_page, record) if four_d else (n_per_page, record))

    return buf, view


def _addresses(n: int, num_blocks: int, n_per_page: int, seed: int, dtype: torch.dtype):
    """``(block_table, req, entry, keep)``: ``n`` distinct entries of requests whose tables
    share out a permutation of the blocks (two requests when the count is even), about 15% of
    the rows not kept."""
    g = torch.Generator().manual_seed(seed)
    reqs = 2 if num_blocks % 2 == 0 else 1
    table = torch.randperm(num_blocks, generator=g).view(reqs, -1).to(dtype)
    per_req = table.shape[1] * n_per_page
    flat = torch.randperm(reqs * per_req, generator=g)[:n]
    keep = torch.rand(n, generator=g) >= 0.15
    return table, (flat // per_req).to(dtype), (flat % per_req).to(dtype), keep


def _slot_addresses(slots: torch.Tensor, num_blocks: int):
    """Flat slots ``block * N + record`` (-1 skipped) as one request owning every block in order."""
    table = torch.arange(num_blocks, device=slots.device).view(1, -1)
    keep = slots >= 0
    return table, torch.zeros_like(slots), slots.clamp_min(0), keep


def _assert_coverage(fmt: str, x: torch.Tensor) -> None:
    """The inputs really reach the rare codes (checked on the reference encoders)."""
    values, scales = quant.quantize(fmt, x)
    if fmt == "mxfp8":
        codes = set(values.unique().tolist())
        want = {0, 0x80, 1, 7, 0x81, 0x7E, 0xFE}
    else:
        codes = set(quant.unpack_fp4(values).unique().tolist())
        want = set(range(16))
    assert want <= codes, sorted(want - codes)
    scale_codes = set(scales.unique().tolist())
    assert (0x7E in scale_codes and 1 in scale_codes) if fmt == "nvfp4" else (254 in scale_codes)


@pytest.mark.parametrize("n, n_per_page", shapes([(1, 4), (7, 4), (33, 8)], [(256, 16), (4096, 64)]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt, dim", FORMATS)
def test_store_records_bit_exact(device, fmt, dim, dtype, n, n_per_page):
    rf = RecordFormat(fmt, dim)
    seed = n * 1000 + dim + (dtype == torch.bfloat16)
    capacity = 2 * n + 3
    num_blocks = -(-capacity // n_per_page)
    buf, view = _paged_buffer(num_blocks, n_per_page, rf.record_bytes, seed)
    buf = buf.to(device)
    want = buf.clone()
    x = wide_inputs(n, dim, fmt, dtype, seed).to(device)
    if n >= 256:
        _assert_coverage(fmt, x.cpu())
    index_dtype = torch.int64 if fmt == "nvfp4" else torch.int32
    table, req, entry, keep = (t.to(device) for t in _addresses(n, num_blocks, n_per_page, seed, index_dtype))
    four_d = dtype == torch.bfloat16  # [B, 1, N, R] or [B, N, R]
    store_paged(view(want, four_d), rf, table, req, entry, x, keep)
    store_records(view(buf, four_d), fmt, table, req, entry, x, keep)
    if n > 1:  # every row kept: the same bytes without the mask
        buf2, want2 = buf.clone(), want.clone()
        store_paged(view(want2, four_d), rf, table, req, entry, x)
        store_records(view(buf2, four_d), fmt, table, req, entry, x)
        assert torch.equal(buf2, want2)
    if device.type == "cuda":
        torch.cuda.synchronize()
    diff = (buf != want).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}"


def test_store_records_nvfp4_reciprocal_scale_cases(device):
    """fp32 amax values whose scale byte depends on ``amax * fp32(1/6)`` vs ``amax / 6``
    (``0x3de3ffff`` .. ``0x44e3ffff``, one ulp below ``6 *`` an e4m3 midpoint), and
    values landing on e2m1 ties only through the rounded reciprocal ``fp32(1/s)``."""
    amax = torch.tensor([0x3DE3FFFF + (i << 23) for i in range(15)], dtype=torch.int32).view(torch.float32)
    g = torch.Generator().manual_seed(1)
    rows = _pick(_E2M1_MIDS, (15, 16), g) * amax[:, None] / 6 * _signs((15, 16), g)
    rows[:, 0] = amax
    s = _E4M3[1:64:3]  # scales s: block max 6 * s, others 1.25 * s etc.
    more = _pick(torch.cat([_E2M1_MIDS, _E2M1]), (s.numel(), 16), g) * s[:, None]
    more[:, 0] = 6 * s
    x = torch.cat([rows, more]).to(device)
    rf = RecordFormat("nvfp4", 16)
    buf, view = _paged_buffer(x.shape[0], 1, rf.record_bytes, 1)
    buf = buf.to(device)
    want = buf.clone()
    slots = torch.arange(x.shape[0], device=device).flip(0)
    addr = _slot_addresses(slots, x.shape[0])
    store_paged(view(want, False), rf, *addr[:3], x, addr[3])
    store_records(view(buf, False), rf, *addr[:3], x, addr[3])
    assert torch.equal(buf, want)


def test_store_records_strided_rows_and_all_skipped(device):
    fmt, dim = "nvfp4", 64
    rf = RecordFormat(fmt, dim)
    buf, view = _paged_buffer(3, 4, rf.record_bytes, 5)
    buf = buf.to(device)
    want = buf.clone()
    wide = wide_inputs(6, 2 * dim, fmt, torch.bfloat16, 5).to(device)
    x = wide[:, dim:]  # row stride 2 * dim
    table, req, entry, keep = _slot_addresses(torch.tensor([11, -1, 0, 5, 7, 2], device=device), 3)
    store_paged(view(want, True), rf, table, req, entry, x, keep)
    store_records(view(buf, True), rf, table, req, entry, x, keep)
    assert torch.equal(buf, want)
    untouched = buf.clone()
    store_records(view(buf, True), rf, table, req, entry, x, torch.zeros_like(keep))
    store_records(view(buf, True), rf, table, req[:0], entry[:0], x[:0], keep[:0])
    assert torch.equal(buf, untouched)


def test_store_records_rejects_bad_inputs(device):
    rf = RecordFormat("mxfp8", 64)
    cache = torch.zeros(2, 1, 4, rf.record_bytes, dtype=torch.uint8, device=device)
    x = torch.zeros(3, 64, device=device)
    table = torch.zeros(1, 2, dtype=torch.int32, device=device)
    idx = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="record"):
        store_records(cache, "nvfp4", table, idx, idx, x)
    with pytest.raises(TypeError, match="bf16 or fp32"):
        store_records(cache, rf, table, idx, idx, x.half())
    with pytest.raises(ValueError, match="entry must be"):
        store_records(cache, rf, table, idx, idx[:2], x)
    with pytest.raises(TypeError, match="req must be int32/int64"):
        store_records(cache, rf, table, idx.float(), idx, x)
    with pytest.raises(ValueError, match="keep must be bool"):
        store_records(cache, rf, table, idx, idx, x, idx)
    with pytest.raises(ValueError, match="block_table"):
        store_records(cache, rf, table[0], idx, idx, x)
    with pytest.raises(ValueError, match="multiple"):
        store_records(cache, "mxfp8", table, idx, idx, torch.zeros(3, 48, device=device))
    with pytest.raises(ValueError, match="unknown"):
        store_records(cache, "fp8", table, idx, idx, x)
    with pytest.raises(ValueError, match="contiguous"):
        store_records(cache.repeat(1, 1, 2, 1)[:, :, ::2], rf, table, idx, idx, x)


# ---------------------------------------------------------------------------
# pool_pairs
# ---------------------------------------------------------------------------


@pytest.fixture
def same_device_exp(monkeypatch):
    """Under the interpreter the kernel's exp is numpy's; make the reference use it too."""
    if INTERPRET:
        monkeypatch.setattr(torch, "exp", lambda t: torch.from_numpy(np.exp(t.contiguous().numpy())))


def _pair_rows(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[u | g]`` rows: gate gaps from 0 (equal) through the range where exp is
    subnormal (-87..-104) to where it underflows; u over 2**+-40 with exact zeros."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-40, 41, (2, n, dim), generator=g).float())
    u = torch.randn(2, n, dim, generator=g) * scale
    # exact bf16 rounding ties (a bf16 value plus half its ulp): v = u0 when e1 = 0
    b = u.to(torch.bfloat16).float()
    half_ulp = (b.abs().view(torch.int32) & 0x7F800000).view(torch.float32) * 2.0**-8
    u = torch.where(torch.rand(2, n, dim, generator=g) < 0.15, b + half_ulp, u)
    u = torch.where(torch.rand(2, n, dim, generator=g) < 0.1, 0.0, u)
    g0 = torch.randn(n, dim, generator=g) * 4
    gaps = torch.tensor([0.0, 0.5, 3.0, 20.0, 50.0, 88.0, 95.0, 103.0, 110.0, 1e4])
    gap = _pick(gaps, (n, dim), g) * (1 + 0.01 * torch.rand(n, dim, generator=g)) * _signs((n, dim), g)
    gap = torch.where(torch.rand(n, dim, generator=g) < 0.3, torch.randn(n, dim, generator=g) * 3, gap)
    g1 = g0 + gap
    first = torch.cat([u[0], g0], dim=1)
    second = torch.cat([u[1], g1], dim=1)
    return first, second


def _pool_reference(first: torch.Tensor, second: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = first.shape[1] // 2
    pair_u = torch.stack([first[:, :d], second[:, :d]], dim=1).flatten(0, 1)
    pair_g = torch.stack([first[:, d:], second[:, d:]], dim=1).flatten(0, 1)
    return pool_ratio2(pair_u, pair_g, acc_dtype(dtype)).to(dtype)


def _halves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = rows.shape[1] // 2
    return rows[:, :d], rows[:, d:]  # strided views of one buffer, as the kernels accept


def _in_step(first: torch.Tensor, second: torch.Tensor):
    """One request of ``2n`` tokens from position 0: token ``2j + 1`` closes ``(first[j], second[j])``."""
    n, w = first.shape
    rows = torch.stack([first, second], dim=1).reshape(2 * n, w)
    dev = rows.device
    ring = torch.full((2, 4, w), float("nan"), device=dev)  # never read
    table = torch.tensor([[1]], dtype=torch.int32, device=dev)
    req = torch.zeros(2 * n, dtype=torch.int64, device=dev)
    pos = torch.arange(2 * n, device=dev)
    ctx = torch.zeros(1, dtype=torch.int32, device=dev)
    return (*_halves(rows), ring, table, req, pos, ctx)


def _from_ring(first: torch.Tensor, second: torch.Tensor, seed: int, cap: int = 4):
    """``n`` requests of one token each at an odd position, the pair's first row in the ring."""
    n, w = first.shape
    g = torch.Generator().manual_seed(seed)
    dev = first.device
    table = torch.randperm(n + 2, generator=g)[:n].view(n, 1).to(torch.int32).to(dev)
    pos = (2 * torch.randint(0, 1000, (n,), generator=g) + 1).to(dev)
    ring = torch.full((n + 2, cap, w), float("nan"), device=dev)
    ring[table[:, 0].long(), (pos - 1) % cap] = first
    req = torch.arange(n, device=dev).to(torch.int32)
    u, gate = (h.contiguous() for h in _halves(second))
    return u, gate, ring, table, req, pos, pos.to(torch.int32)


@pytest.mark.parametrize("n", shapes([1, 5, 37], [4096, 16384]))
@pytest.mark.parametrize("dim", [512, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pool_pairs_bit_exact(device, same_device_exp, n, dim, dtype):
    """Both sources of a pair's first row (the step's previous row, the ring) give the
    reference's bits; every token gets an entry ``pos // 2`` and ``closes`` (odd positions)."""
    first, second = _pair_rows(n, dim, n + dim)
    first, second = first.to(device), second.to(device)
    want = _pool_reference(first, second, dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for step in (_in_step(first, second), _from_ring(first, second, n)):
        u, pos = step[0], step[5]
        got, entry, closes = pool_pairs(*step, dtype)
        assert got.dtype == dtype and got.shape == (u.shape[0], dim)
        assert torch.equal(entry, pos // 2) and torch.equal(closes, pos % 2 == 1)
        got = got[closes]
        diff = (got.view(bits) != want.view(bits)).nonzero()
        assert diff.numel() == 0, f"{diff.shape[0]} of {n * dim} differ, first at {diff[:5].tolist()}"
        # the reference's own gathering of the pairs agrees
        assert torch.equal(step_pair_rows(*step)[closes], first)


def test_ring_write_keeps_each_requests_last_rows(device):
    """Rows of each request's last ``capacity`` positions land at ``pos % capacity`` of its ring
    block, as the reference writes them; older rows of a long chunk and other blocks untouched."""
    g = torch.Generator().manual_seed(7)
    cap, w = 4, 48
    lens = [3, 9, 1]  # request 1's chunk is longer than the ring
    req = torch.cat([torch.full((k,), i) for i, k in enumerate(lens)])
    ctx = torch.tensor([5, 0, 12])
    pos = torch.cat([torch.arange(c, c + k) for c, k in zip(ctx.tolist(), lens)])
    seq = ctx + torch.tensor(lens)
    table = torch.tensor([[4, 0], [1, 0], [2, 0]], dtype=torch.int32)
    rows = torch.randn(req.numel(), w, generator=g)
    ring = torch.randn(6, cap, w, generator=g)
    want = ring.clone()
    ring_write_reference(want, table, req, pos, seq, *_halves(rows))
    args = [t.to(device) for t in (table, req, pos, seq)]
    got = ring.to(device)
    ring_write(got, *args, *_halves(rows.to(device)))
    assert torch.equal(got.cpu(), want)
    assert torch.equal(want[1, 1], rows[3 + 5])  # request 1 (rows 3..11), position 5: one of its last 4
    assert torch.equal(want[3], ring[3]) and torch.equal(want[5], ring[5])


def test_pool_pairs_strided_rows_and_errors(device, same_device_exp):
    first, second = _pair_rows(9, 64, 3)
    step = [t.to(device) for t in _in_step(first, second)]  # u, g: strided halves (row stride 256)
    got, _, closes = pool_pairs(*step, torch.bfloat16)
    want = _pool_reference(first, second, torch.bfloat16).to(device)
    assert torch.equal(got[closes].view(torch.int16), want.view(torch.int16))
    empty = [step[0][:0], step[1][:0], step[2], step[3], step[4][:0], step[5][:0], step[6]]
    assert pool_pairs(*empty, torch.bfloat16)[0].shape == (0, 64)
    with pytest.raises(TypeError, match="out_dtype"):
        pool_pairs(*step, torch.float16)
    with pytest.raises(ValueError, match="fp32"):
        pool_pairs(step[0].double(), *step[1:], torch.bfloat16)
    with pytest.raises(ValueError, match="ring"):
        pool_pairs(step[0], step[1], step[2][..., :32], *step[3:], torch.bfloat16)
    with pytest.raises(ValueError, match="pos must be"):
        pool_pairs(*step[:5], step[5][:3], step[6], torch.bfloat16)
