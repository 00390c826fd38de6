"""The routing / grouping kernels (``ops/triton/routing.py``) against their references
(``ops.moe``), on the CPU under Triton's interpreter, small shapes.

Ids, grouping (order, offsets, rows, weights, positions) and expert sums are compared bit for bit.
Scores: the interpreter has no libdevice, so its ``exp``/``log1p`` differ from torch's CPU ones in
the last ulps; ids are compared on logits without near-ties, weights to 1e-6 relative there, and
bit for bit (against torch's CUDA summation order, emulated) where ``softplus`` is the identity
(logits above 20: the scores are then correctly rounded square roots on both sides). Ties are
tested with exactly equal scores. ``tests/gpu/test_routing.py`` checks bit-exactness on the GPU.

The kernels run under the interpreter in a subprocess (``tests/ops/interpreted.py``).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_vllm.ops import moe
from tests.ops.interpreted import INTERPRETED, interpreted_module, rerun_interpreted


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreted run")
def test_kernels_interpreted():
    rerun_interpreted(__file__)


@pytest.fixture(scope="module")
def R():
    return interpreted_module("deepinfer_vllm.ops.triton.routing")


def _separated_logits(T: int, E: int, seed: int, lo: float = -4.0, hi: float = 8.0) -> torch.Tensor:
    """Rows of distinct logits on a grid of spacing (hi - lo) / E, shuffled per row."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.linspace(lo, hi, E)
    return torch.stack([grid[torch.randperm(E, generator=g)] for _ in range(T)])


def _min_gap(keys: torch.Tensor, k: int) -> float:
    """The smallest gap between consecutive keys among each row's top k + 1 (what decides ids)."""
    s = keys.sort(dim=-1, descending=True).values[:, : k + 1]
    return float((s[:, :-1] - s[:, 1:]).min())


def _cuda_order_sum(chosen: torch.Tensor) -> torch.Tensor:
    """torch's CUDA sum of each short fp32 row (``[T, k]``, k < 32): last_pow2(k) lanes, lane t
    adding elements t and t + lanes, then the warp's shuffle tree (the kernel's TREE_DESCENDING)."""
    from deepinfer_vllm.ops.triton.routing import TREE_DESCENDING

    k = chosen.shape[1]
    lanes = 1 << (k.bit_length() - 1)
    v = [chosen[:, t] + (chosen[:, t + lanes] if t + lanes < k else 0.0) for t in range(lanes)]
    offs = [lanes >> (j + 1) for j in range(lanes.bit_length() - 1)]
    for off in offs if TREE_DESCENDING else reversed(offs):
        v = [v[t] + v[(t + off) % lanes] for t in range(lanes)]
    return v[0].unsqueeze(-1)


@pytest.mark.parametrize("T", [1, 7, 64])
@pytest.mark.parametrize("E,k", [(384, 6), (128, 3)])
def test_route_matches_reference(R, T, E, k):
    logits = _separated_logits(T, E, seed=T + E)
    g = torch.Generator().manual_seed(1)
    bias = (torch.rand(E, generator=g) - 0.5) * 0.02
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    assert _min_gap(scores + bias, k) > 1e-5  # no near-ties: the ulps of exp/log1p cannot reorder
    w, ids = R.route_from_logits(logits, bias, k, 1.5, True)
    rw, rids = moe.sqrtsoftplus_select(logits, bias, k, 1.5, True)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (T, k)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=0)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("k", [6, 3, 1])
def test_weights_bit_exact_where_softplus_is_exact(R, norm, k):
    # Logits above softplus's threshold: scores sqrt(l), correctly rounded by both.
    T, E = 7, 64
    logits = _separated_logits(T, E, seed=3, lo=20.5, hi=90.0)
    bias = torch.linspace(-0.3, 0.3, E)
    w, ids = R.route_from_logits(logits, bias, k, 2.5, norm)
    rw, rids = moe.sqrtsoftplus_select(logits, bias, k, 2.5, norm)
    assert torch.equal(ids, rids)
    chosen = torch.sqrt(logits).gather(1, ids)
    if norm:
        chosen = chosen / (_cuda_order_sum(chosen) + 1e-20)
    assert torch.equal(w, chosen * 2.5)
    if not norm:
        assert torch.equal(w, rw)


def test_ties_go_to_the_lower_expert(R):
    g = torch.Generator().manual_seed(5)
    T, E, k = 9, 48, 6
    logits = torch.randint(21, 24, (T, E), generator=g).float()  # many exactly equal scores
    logits[0] = 22.0  # a row of one value: the biased experts 40.. and among them the lowest
    bias = torch.zeros(E)
    bias[40:] = float(torch.sqrt(torch.tensor(22.0)) - torch.sqrt(torch.tensor(21.0)))  # more ties via bias
    w, ids = R.route_from_logits(logits, bias, k, 1.0, True)
    _, rids = moe.sqrtsoftplus_select(logits, bias, k, 1.0, True)
    assert torch.equal(ids, rids)
    assert ids[0].tolist() == list(range(40, 40 + k))
    chosen = torch.sqrt(logits).gather(1, ids)
    assert torch.equal(w, chosen / (_cuda_order_sum(chosen) + 1e-20))


@pytest.mark.parametrize("image_token_id", [9, None])
def test_image_rows_use_bias_vl(R, image_token_id):
    T, E, k = 7, 40, 4
    logits = _separated_logits(T, E, seed=6)
    g = torch.Generator().manual_seed(7)
    bias = torch.rand(E, generator=g) * 3  # large: steers the choice away from the scores' top
    bias_vl = torch.rand(E, generator=g) * 3
    tokens = torch.tensor([5, 9, 5, 1, 9, 9, 2])
    is_image = None if image_token_id is None else tokens == image_token_id
    scores = torch.sqrt(torch.nn.functional.softplus(logits))
    key_bias = bias.expand(T, E) if is_image is None else torch.where(is_image[:, None], bias_vl, bias)
    assert _min_gap(scores + key_bias, k) > 1e-5
    w, ids = R.route_from_logits(logits, bias, k, 1.5, True, bias_vl, tokens, image_token_id)
    rw, rids = moe.sqrtsoftplus_select(logits, bias, k, 1.5, True, bias_vl, is_image)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=0)
    if image_token_id is not None:  # the branch matters for these rows
        _, plain = moe.sqrtsoftplus_select(logits, bias, k, 1.5, True)
        assert not torch.equal(ids[is_image], plain[is_image])


def test_route_with_the_gemm_and_no_bias(R):
    # bf16 operands whose products and sums are exact in fp32: every GEMM gives the same logits
    g = torch.Generator().manual_seed(8)
    T, H, E, k = 7, 64, 32, 6
    x = (torch.randint(-4, 5, (T, H), generator=g).float() / 4).bfloat16()
    w = (torch.randint(-4, 5, (E, H), generator=g).float() / 8).bfloat16()
    got_w, got = R.route_sqrtsoftplus(x, w, None, k, 1.5)
    ref_w, ref = moe.route_sqrtsoftplus(x, w, None, k, 1.5)
    scores = torch.sqrt(torch.nn.functional.softplus(R.router_logits(x, w)))
    keys = scores.sort(-1, descending=True).values
    margin = keys[:, k - 1] - keys[:, k]
    exact = (margin == 0) | (margin > 1e-5)  # tie (decided by index) or clearly separated
    assert exact.all()
    assert torch.equal(got, ref)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=0)


# (684, 6) and (1371, 6): 4104 and 8226 pairs, above MAX_PAIRS (super-block counts first; 8226 is 9
# super-blocks, the last one partial, and 129 placing programs, the last one partial too)
@pytest.mark.parametrize("T,k", [(1, 6), (7, 6), (64, 6), (5, 3), (400, 5), (682, 6), (684, 6), (1371, 6)])
@pytest.mark.parametrize("experts", [range(0, 12), range(3, 9)], ids=["all", "slice"])
def test_expert_groups_bit_exact(R, T, k, experts):
    g = torch.Generator().manual_seed(T * k)
    ids = torch.randint(-1, 12, (T, k), generator=g)  # -1: padding; ids outside `experts` go last
    weights = torch.rand(T, k, generator=g)
    order, offsets, rows, pw, position = R.expert_groups(ids, experts, weights)
    ref_order, ref_offsets = moe.expert_groups(ids, experts)
    assert torch.equal(order, ref_order) and torch.equal(offsets, ref_offsets)
    assert torch.equal(rows, ref_order // k)
    assert torch.equal(pw, weights.reshape(-1)[ref_order])
    inverse = torch.empty_like(ref_order).index_copy_(0, ref_order, torch.arange(T * k))
    assert torch.equal(position.long(), inverse)


def test_expert_groups_above_the_bound_reads_super_block_counts(R, monkeypatch):
    """Above MAX_PAIRS the placing programs take the totals and earlier counts from the first launch's rows;
    with every pair on one expert (the largest counts) and the bound lowered so a small case crosses it, the
    order is still the stable one."""
    k, T = 4, 700
    ids = torch.full((T, k), 2, dtype=torch.int64)
    ids[::7, 1] = 5
    ids[3, :] = -1
    assert T * k < R.MAX_PAIRS
    want, want_offsets = moe.expert_groups(ids, range(0, 8))
    monkeypatch.setattr(R, "MAX_PAIRS", 64)
    order, offsets, rows, _, position = R.expert_groups(ids, range(0, 8), torch.ones(T, k))
    assert torch.equal(order, want) and torch.equal(offsets, want_offsets)
    assert torch.equal(rows, want // k) and torch.equal(position[want].long(), torch.arange(T * k))


def _tied_ids(T: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(20, generator=g)[:k] for _ in range(T)])
    ids[0, 0] = ids[0, k - 1] = -1  # repeated ids: slot order breaks the tie
    return ids


@pytest.mark.parametrize("T,k,D", [(1, 6, 40), (7, 6, 1100), (5, 3, 33)])
def test_expert_sum_pair_order(R, T, k, D):
    ids = _tied_ids(T, k, seed=D)
    g = torch.Generator().manual_seed(2)
    y = torch.randn(T * k, D, generator=g) * 100
    for dtype in (torch.bfloat16, torch.float32):
        want = moe.sum_in_expert_order(y.view(T, k, D), ids, dtype)
        assert torch.equal(R.expert_sum(y, ids, dtype), want)


@pytest.mark.parametrize("T,k", [(1, 6), (7, 6), (64, 6)])
def test_expert_sum_reads_grouped_rows(R, T, k):
    ids = _tied_ids(T, k, seed=T)
    D = 48
    order, _, _, _, position = R.expert_groups(ids, range(2, 15), torch.ones(T, k))
    g = torch.Generator().manual_seed(3)
    down = torch.randn(T * k, D, generator=g).bfloat16()  # grouped order, as the GEMM leaves it
    per_pair = torch.empty_like(down).index_copy_(0, order, down)
    want = moe.sum_in_expert_order(per_pair.view(T, k, D).float(), ids, torch.bfloat16)
    assert torch.equal(R.expert_sum(down, ids, torch.bfloat16, position), want)


@pytest.mark.parametrize("T,k", [(7, 6), (64, 6)])
def test_expert_sum_skips_rows_past_live(R, T, k):
    """``live``: grouped rows at or past it (other ranks' pairs) are read as zero, whatever they
    hold (here NaN): the same bits as the sum over rows zeroed there."""
    ids = _tied_ids(T, k, seed=T + 1)
    D = 40
    order, offsets, _, _, position = R.expert_groups(ids, range(2, 15), torch.ones(T, k))
    live = int(offsets[-1])
    assert 0 < live < T * k
    g = torch.Generator().manual_seed(4)
    down = torch.randn(T * k, D, generator=g).bfloat16()
    down[live:] = 0
    want = R.expert_sum(down, ids, torch.bfloat16, position)
    down[live:] = float("nan")
    assert torch.equal(R.expert_sum(down, ids, torch.bfloat16, position, offsets[-1:]), want)
    with pytest.raises(ValueError, match="needs position"):
        R.expert_sum(down, ids, torch.bfloat16, None, offsets[-1:])


# ----------------------------------------------------------------------- the operators


def _ops(monkeypatch, backend: str, dtype: torch.dtype):
    monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return moe.MoeRouter("cpu", dtype), moe.ExpertGrouping("cpu", dtype), moe.ExpertSum("cpu", dtype)


def test_operators_pick_the_kernels_for_bf16_only(R, monkeypatch):
    for op in _ops(monkeypatch, "triton", torch.bfloat16):
        assert op.backend == "triton" and op._forward.__func__ is type(op).forward_triton
    for op in _ops(monkeypatch, "triton", torch.float32):  # fp32 models: fp64 islands, the reference
        assert op._forward.__func__ is type(op).forward_native
    for op in _ops(monkeypatch, "torch", torch.bfloat16):
        assert op._forward.__func__ is type(op).forward_native


def test_operators_agree_with_the_reference(R, monkeypatch):
    tri = _ops(monkeypatch, "triton", torch.bfloat16)
    ref = _ops(monkeypatch, "torch", torch.bfloat16)
    g = torch.Generator().manual_seed(9)
    T, H, E, k = 7, 64, 32, 6
    x = (torch.randint(-4, 5, (T, H), generator=g).float() / 4).bfloat16()
    w = (torch.randint(-4, 5, (E, H), generator=g).float() / 8).bfloat16()
    bias, bias_vl = torch.zeros(E), torch.full((E,), 0.5)
    bias_vl[:6] = -5.0  # image rows avoid experts 0..5
    tokens = torch.tensor([3, 7, 7, 1, 0, 7, 2])
    args = (x, w, bias, k, 1.5, True, bias_vl, tokens, 7)
    (tw, tids), (rw, rids) = tri[0](*args), ref[0](*args)
    assert torch.equal(tids, rids) and (tids[tokens == 7] >= 6).all()
    torch.testing.assert_close(tw, rw, rtol=1e-6, atol=0)
    tg, rg = tri[1](rids, range(8, 24), rw), ref[1](rids, range(8, 24), rw)
    assert rg.position is None and tg.position is not None
    for a, b in zip(tg[:4], rg[:4]):
        assert torch.equal(a, b)
    down = torch.randn(T * k, 40, generator=g).bfloat16()
    live = int(rg.offsets[-1])
    assert 0 < live < T * k  # some pairs are another rank's: their grouped rows count as zero
    zeroed = down.clone()
    zeroed[live:] = 0
    want = ref[2](zeroed, rids, torch.bfloat16, rg)
    down[live:] = float("nan")  # what a grouped GEMM with zero_rest=False may leave there
    assert torch.equal(tri[2](down, rids, torch.bfloat16, tg), want)
    assert torch.equal(ref[2](down, rids, torch.bfloat16, rg), want)
    summed = torch.randn(T * k, 40, generator=g)
    assert torch.equal(tri[2](summed, rids, torch.bfloat16), ref[2](summed, rids, torch.bfloat16))


def test_grouping_above_the_bound_in_the_layer_op(R, monkeypatch):
    tri = _ops(monkeypatch, "triton", torch.bfloat16)
    g = torch.Generator().manual_seed(10)
    T, k = R.MAX_PAIRS // 8 + 1, 8
    ids = torch.randint(0, 24, (T, k), generator=g)  # experts 16..23 are another rank's
    groups = tri[1](ids, range(0, 16), torch.rand(T, k, generator=g))
    order, _ = moe.expert_groups(ids, range(0, 16))
    assert torch.equal(groups.order, order)  # the reference's grouping, from the kernels
    # with each pair's grouped row, so the sum reads the grouped rows in place
    assert groups.position.dtype == torch.int32
    assert torch.equal(groups.position[order].long(), torch.arange(T * k))
    down = torch.randn(T * k, 8, generator=g).bfloat16()
    down[int(groups.offsets[-1]) :] = 0  # another rank's pairs
    per_pair = torch.empty_like(down).index_copy_(0, order, down)
    want = moe.sum_in_expert_order(per_pair.view(T, k, 8).float(), ids, torch.bfloat16)
    down[int(groups.offsets[-1]) :] = float("nan")  # never read
    assert torch.equal(tri[2](down, ids, torch.bfloat16, groups), want)


# ----------------------------------------------------------------------- the layer


@pytest.mark.parametrize(
    "layout_kw",
    [{}, {"tp_size": 2, "tp_rank": 1, "expert_parallel": True}, {"dp_size": 2, "dp_rank": 0}],
    ids=["one-rank", "expert-parallel", "split"],
)
def test_layer_grouped_path_equals_the_reference_ops(R, monkeypatch, layout_kw):
    from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout
    from deepinfer_vllm.model_executor.layers.v41_moe import RoutedExperts
    from deepinfer_vllm.ops import quant

    hidden, inter, experts, k, T = 64, 64, 8, 3, 7
    layout = ParallelLayout(**layout_kw)
    mods = {}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for backend in ("triton", "torch"):
            monkeypatch.setenv("DEEPINFER_FUSED_KERNELS", backend)
            monkeypatch.setenv("TRITON_INTERPRET", "1")
            mods[backend] = RoutedExperts(experts, hidden, inter, layout)
    finally:
        torch.set_default_dtype(previous)
    assert mods["triton"].grouping.backend == "triton" and mods["torch"].grouping.backend == "torch"
    g = torch.Generator().manual_seed(11)
    for name in ("w13", "w2"):
        w = getattr(mods["torch"], name)
        full = torch.randn(w.shape[0], w.shape[1], 2 * w.shape[2], generator=g) * 0.2
        packed, scale = quant.quant_fp4_rows(full)
        for mod in mods.values():
            getattr(mod, name).data.copy_(packed.view(torch.int8))
            getattr(mod, f"{name}_scale").data.copy_(scale)
    x = torch.randn(T, hidden, generator=g).bfloat16()
    gate = torch.randn(experts, hidden, generator=g).bfloat16()
    weights, ids = moe.route_sqrtsoftplus(x, gate, None, k, 1.5)
    ids[3, 1] = -1
    got = mods["triton"].partial(x, weights, ids, limit=2.0, grouped=True)
    want = mods["torch"].partial(x, weights, ids, limit=2.0, grouped=True)
    assert torch.equal(got, want)
    if mods["torch"].split:
        combined = mods["triton"].combine(got, ids, x.dtype)
        assert torch.equal(combined, mods["torch"].combine(want, ids, x.dtype))


@pytest.mark.parametrize("shape", [(1, 40), (7, 1100), (3, 2049)])
def test_add_shared_rounds_once(R, shape):
    """The MoE's last step equals ``torch.add(routed, shared).to(bf16)`` bit for bit: sums that
    land half-way between bf16 values (ties to even), signed zeros, infinities; NaN stays NaN
    (its bits are the platform's: torch's CPU cast keeps the sign and payload, CUDA's does not)."""
    g = torch.Generator().manual_seed(shape[1])
    routed = torch.randn(shape, generator=g) * 100
    shared = (torch.randn(shape, generator=g) * 100).bfloat16()
    flat, sh = routed.view(-1), shared.view(-1)
    # half-way sums: a bf16 value plus half its last place, both parities of the last bit
    base = torch.tensor([1.0, 1.0078125, -3.0, 3.015625])
    flat[: base.numel()] = base + base.abs() * 2.0**-9 - sh[: base.numel()].float()
    flat[4:8] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
    sh[4:8] = torch.tensor([-0.0, -0.0, -1.0, 2.0], dtype=torch.bfloat16)
    # the NaN CUDA's arithmetic gives (all payload bits set): rounding it by bits carries into the sign
    flat[8:9] = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    want = torch.add(routed, shared).to(torch.bfloat16)
    got = R.add_shared(routed, shared)
    assert got.dtype == torch.bfloat16
    nan = want.isnan()
    assert nan.sum() == 2 and torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    with pytest.raises(ValueError, match="fp32 routed and bf16 shared"):
        R.add_shared(routed.bfloat16(), shared)
