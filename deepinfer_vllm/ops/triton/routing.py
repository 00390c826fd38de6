"""MoE routing and expert grouping: the reference's chains of small ops in a few launches.

References (``ops.moe``): ``route_sqrtsoftplus``, ``expert_groups`` (with the gathers the layer
does around it) and ``sum_in_expert_order``. Eagerly the reference issues three sorts and about
forty elementwise launches per layer step; here:

* ``route_sqrtsoftplus``: the fp32 logits GEMM (``router_logits``: ``stored_gemm``, bf16 tensor
  cores with exact products, one or two launches), then one program per token
  that forms ``sqrt(softplus(l))``, adds the selection bias (``bias_vl`` on image tokens, decided
  from the token ids in the kernel), picks the top ``k`` by repeated arg-max (ties: lower expert
  first, the reference's stable descending sort) and normalises the chosen unbiased scores;
* ``expert_groups``: one launch counting-sorts the ``T * k`` (token, slot) pairs by local expert:
  every program histograms all pairs' experts (exclusive cumulative sum: the offsets) and those of
  the pairs before its chunk, and places its chunk's pairs stably (rank among the chunk's earlier
  pairs of the same expert); no program waits for another. It writes, besides
  ``order`` and ``offsets``, the gathered token rows, the routing weights in grouped order and
  each pair's grouped row (the inverse permutation). Above ``MAX_PAIRS`` pairs (a bound on
  shapes, decided on the host; prefill) a first launch histograms each super-block of ``_SUPER``
  pairs and the placing programs add those rows instead of histogramming every pair (at 8192
  Flash tokens this replaces torch's radix sort, scatters and gathers: 8 + ~6 launches);
* ``expert_sum``: per token, its ``k`` rows (optionally fetched through the inverse permutation,
  so the grouped GEMM's output is read in place, with no scatter) rounded to the model dtype and
  summed in ascending expert id in fp32, from zero, as the reference does.

Numerics (bit-exact with the CUDA reference given the same logits, ``tests/gpu/test_routing.py``):
  * ``softplus(l) = l if l > 20 else log1p(exp(l))`` as torch's CUDA kernel (beta 1, threshold 20),
    with libdevice's ``exp`` / ``log1p`` (the CUDA math library's ``expf`` / ``log1pf``, which torch
    calls) and the IEEE ``sqrt``; kernels launch with ``enable_reflect_ftz=False`` (torch does not
    flush subnormals) and ``enable_fp_fusion=False``;
  * the normalising sum of the ``k`` chosen scores follows torch's CUDA reduction of a short row:
    ``last_pow2(k)`` lanes, lane ``t`` adding elements ``t`` and ``t + lanes``, then a shuffle tree
    (offsets decreasing from torch 2.10 on, increasing before: pytorch/pytorch#164790);
    division and scaling are single IEEE operations, like torch's;
  * under ``TRITON_INTERPRET=1`` libdevice is unavailable: numpy's ``exp`` and a ``log1p`` built
    from ``log`` (accurate to a few ulp) stand in, so CPU tests compare scores with a tolerance and
    ids on logits without near-ties.
Grouping and the expert sum are integer work and exact copies/adds: bit-exact everywhere.
No kernel reads device values on the host: capturable in a CUDA graph.
"""

from __future__ import annotations

import os
import torch
import triton
import triton.language as tl

from deepinfer_vllm.ops.triton.indexer import _round_bf16
from deepinfer_vllm.ops.triton.pdl import grid_wait, pdl_args
from deepinfer_vllm.ops.triton.stored_gemm import stored_gemm

__all__ = ["MAX_PAIRS", "add_shared", "expert_groups", "expert_sum", "route_sqrtsoftplus", "router_logits"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LAUNCH = {} if _INTERPRET else dict(enable_fp_fusion=False, enable_reflect_ftz=False)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


# torch >= 2.10 reduces a warp's lanes with decreasing shuffle offsets (pytorch/pytorch#164790).
TREE_DESCENDING = _torch_version() >= (2, 10)
# Pairs (tokens x top-k) up to which ``expert_groups`` counting-sorts in one launch (every program histograms
# all pairs); above, a first launch counts each super-block of ``_SUPER`` pairs.
MAX_PAIRS = 4096
_CHUNK = 64  # pairs placed per program (a [CHUNK, CHUNK] comparison; H200: 64 beat 128, 256)
_SUPER = 1024
_GROUP_WARPS = 4


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``x . weight^T`` (the router's logits): bf16 ``x`` on the tensor cores with exact
    products (``stored_gemm``; the sum's order differs from the reference's fp32 GEMM), else the
    upcast GEMM as the reference computes it."""
    if x.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype in (torch.bfloat16, torch.float32):
        return stored_gemm(x, weight.contiguous(), torch.float32)
    return torch.matmul(x.float(), weight.float().t())


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------

if _INTERPRET:

    @triton.jit
    def _exp(a):
        return tl.exp(a)

    @triton.jit
    def _log1p(a):
        # log(u) * a / (u - 1) with u = 1 + a: a few ulp (numpy has no log1p here).
        u = 1.0 + a
        return tl.where(u == 1.0, a, tl.log(u) * (a / (u - 1.0)))

else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(a):
        return libdevice.exp(a)

    @triton.jit
    def _log1p(a):
        return libdevice.log1p(a)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    bias_vl_ptr,
    tokens_ptr,
    w_out_ptr,
    id_out_ptr,
    E,
    stride_l,
    image_token_id,
    eps,
    scale,
    K: tl.constexpr,
    KP: tl.constexpr,
    EP: tl.constexpr,
    LANES: tl.constexpr,
    LOG_LANES: tl.constexpr,
    HAS_VL: tl.constexpr,
    NORM: tl.constexpr,
    DESC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``pid``: scores, the top ``K`` of score + bias (stable), normalised weights."""
    grid_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    valid = e < E
    logit = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=0.0)
    soft = tl.where(logit > 20.0, logit, _log1p(_exp(tl.minimum(logit, 20.0))))  # (no overflow)
    score = tl.sqrt_rn(soft)
    b = tl.load(bias_ptr + e, mask=valid, other=0.0)
    if HAS_VL:
        image = tl.load(tokens_ptr + t) == image_token_id
        b = tl.where(image, tl.load(bias_vl_ptr + e, mask=valid, other=0.0), b)
    key = score + b
    avail = valid
    slot = tl.arange(0, KP)
    lane = tl.arange(0, LANES)
    ids = tl.zeros([KP], dtype=tl.int64)
    chosen = tl.zeros([KP], dtype=tl.float32)
    lanes = tl.zeros([LANES], dtype=tl.float32)
    for i in tl.static_range(K):
        top = tl.max(tl.where(avail, key, float("-inf")), axis=0)
        pick = tl.min(tl.where(avail & (key == top), e, EP), axis=0)
        avail = avail & (e != pick)
        s = tl.sum(tl.where(e == pick, score, 0.0), axis=0)  # one nonzero term: exact
        ids = tl.where(slot == i, pick.to(tl.int64), ids)
        chosen = tl.where(slot == i, s, chosen)
        lanes = tl.where(lane == i % LANES, lanes + s, lanes)
    if NORM:
        # torch's warp tree over its LANES lanes (only lane 0's value is kept).
        for j in tl.static_range(LOG_LANES):
            if DESC:
                lanes = lanes + tl.gather(lanes, (lane + (LANES >> (j + 1))) % LANES, 0)
            else:
                lanes = lanes + tl.gather(lanes, (lane + (1 << j)) % LANES, 0)
        total = tl.sum(tl.where(lane == 0, lanes, 0.0), axis=0)
        chosen = tl.div_rn(chosen, total + eps)
    w = chosen * scale
    tl.store(w_out_ptr + t * K + slot, w, mask=slot < K)
    tl.store(id_out_ptr + t * K + slot, ids, mask=slot < K)


def _last_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def route_sqrtsoftplus(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
    bias_vl: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    image_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.moe.route_sqrtsoftplus`` with ``is_image = token_ids == image_token_id`` (bias_vl
    applies where all three are given): ``(weights fp32 [T, k], ids int64 [T, k])``."""
    return route_from_logits(
        router_logits(x, gate_weight), bias, top_k, routed_scaling_factor, norm_topk_prob,
        bias_vl, token_ids, image_token_id,
    )


def route_from_logits(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
    bias_vl: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    image_token_id: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing from fp32 ``logits [T, E]`` (``ops.moe.sqrtsoftplus_select``), one launch."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(-1) != 1:
        got = f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}"
        raise ValueError(f"logits must be fp32 [T, E] with unit column stride, got {got}")
    T, E = logits.shape
    if not 1 <= top_k <= min(E, 31):
        # (k < 32 keeps torch's reduction of the chosen scores within one warp: see the module doc)
        raise ValueError(f"top_k {top_k} out of range for {E} experts (at most 31)")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    if bias is None:  # the reference's zero bias (score + 0 is the score)
        bias = torch.zeros(E, dtype=torch.float32, device=logits.device)
    has_vl = bias_vl is not None and token_ids is not None and image_token_id is not None
    lanes = _last_pow2(top_k)
    _route_kernel[(T,)](
        logits, bias.float(), bias_vl.float() if has_vl else bias, token_ids.reshape(-1) if has_vl else ids,
        weights, ids, E, logits.stride(0), image_token_id if has_vl else 0, 1e-20, routed_scaling_factor,
        K=top_k, KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(E), LANES=lanes,
        LOG_LANES=lanes.bit_length() - 1, HAS_VL=has_vl, NORM=norm_topk_prob, DESC=TREE_DESCENDING,
        num_warps=4, **_LAUNCH,
        **pdl_args(logits.device),
    )
    return weights, ids


# ---------------------------------------------------------------------------
# Grouping
# ---------------------------------------------------------------------------


@triton.jit
def _pair_keys(ids_ptr, p, live, start, n, TRASH: tl.constexpr):
    """Local expert of pairs ``p`` (``n``: outside the local range; ``TRASH``: past the end)."""
    local = tl.load(ids_ptr + p, mask=live, other=0) - start
    key = tl.where((local >= 0) & (local < n), local, n).to(tl.int32)
    return tl.where(live, key, TRASH)


@triton.jit
def _super_counts_kernel(
    ids_ptr, counts_ptr, P, start, n, NB: tl.constexpr, SUPER: tl.constexpr, PDL: tl.constexpr
):
    """Pairs per key in super-block ``pid`` (pairs ``pid * SUPER ...``): row ``pid`` of ``counts [*, NB]``."""
    grid_wait(PDL)
    p = tl.program_id(0) * SUPER + tl.arange(0, SUPER)
    live = p < P
    keys = _pair_keys(ids_ptr, p, live, start, n, NB - 1)
    tl.store(counts_ptr + tl.program_id(0) * NB + tl.arange(0, NB), tl.histogram(keys, NB, mask=live))


@triton.jit
def _groups_kernel(
    ids_ptr,
    w_ptr,
    order_ptr,
    offsets_ptr,
    rows_ptr,
    pw_ptr,
    pos_ptr,
    counts_ptr,
    P,
    start,
    n,
    K: tl.constexpr,
    NB: tl.constexpr,
    PB: tl.constexpr,
    CHUNK: tl.constexpr,
    SUPER: tl.constexpr,
    COUNTED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Counting sort of the pairs by local expert, stable by pair index: program ``pid`` places
    pairs ``pid * CHUNK ...`` at ``offsets[e]`` + (earlier pairs of ``e``) + (earlier in chunk).
    ``COUNTED``: the per-key totals and the earlier pairs come from ``_super_counts_kernel``'s rows
    (those of the super-blocks before this chunk's, plus a histogram of its super-block's pairs
    before the chunk); else every program histograms all ``P <= PB`` pairs itself."""
    grid_wait(PDL)
    TRASH: tl.constexpr = NB - 1
    c0 = tl.program_id(0) * CHUNK
    if COUNTED:
        sb = c0 // SUPER
        counts = tl.zeros([NB], tl.int32)
        earlier = tl.zeros([NB], tl.int32)
        cols = tl.arange(0, NB)
        for r0 in range(0, tl.cdiv(P, SUPER), 16):
            r = r0 + tl.arange(0, 16)
            rows = (r * SUPER < P)[:, None]
            tile = tl.load(counts_ptr + r[:, None] * NB + cols[None, :], mask=rows, other=0)
            counts += tl.sum(tile, 0)
            earlier += tl.sum(tl.where((r < sb)[:, None], tile, 0), 0)
        q = sb * SUPER + tl.arange(0, SUPER)
        before = q < c0
        earlier += tl.histogram(_pair_keys(ids_ptr, q, before, start, n, TRASH), NB, mask=before)
    else:
        q = tl.arange(0, PB)
        keys = _pair_keys(ids_ptr, q, q < P, start, n, TRASH)
        counts = tl.histogram(keys, NB, mask=q < P)
        earlier = tl.histogram(keys, NB, mask=q < c0)
    starts = tl.cumsum(counts, 0) - counts
    if tl.program_id(0) == 0:
        b = tl.arange(0, NB)
        tl.store(offsets_ptr + b, starts.to(tl.int64), mask=b <= n)
    base = starts + earlier  # + the earlier chunks' pairs per expert
    c = tl.arange(0, CHUNK)
    p = c0 + c
    live = p < P
    key = _pair_keys(ids_ptr, p, live, start, n, TRASH)
    same_earlier = (c[None, :] < c[:, None]) & (key[None, :] == key[:, None])
    dest = tl.gather(base, key, 0) + tl.sum(same_earlier.to(tl.int32), axis=1)
    tl.store(order_ptr + dest, p.to(tl.int64), mask=live)
    tl.store(rows_ptr + dest, (p // K).to(tl.int64), mask=live)
    tl.store(pw_ptr + dest, tl.load(w_ptr + p, mask=live, other=0.0), mask=live)
    tl.store(pos_ptr + p, dest, mask=live)


def expert_groups(ids: torch.Tensor, experts: range, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ops.moe.expert_groups(ids, experts)`` and what goes with it: ``(order, offsets, rows, weights,
    position)`` as ``ops.moe.Groups`` describes them (``position`` int32). One launch up to
    ``MAX_PAIRS`` pairs, two above (per-super-block counts first); any ``T`` (shapes alone decide: no
    host synchronisation)."""
    T, k = ids.shape
    P = T * k
    n = len(experts)
    dev = ids.device
    order = torch.empty(P, dtype=torch.int64, device=dev)
    offsets = torch.empty(n + 1, dtype=torch.int64, device=dev)
    rows = torch.empty(P, dtype=torch.int64, device=dev)
    pw = torch.empty(P, dtype=weights.dtype, device=dev)
    pos = torch.empty(P, dtype=torch.int32, device=dev)
    if P == 0:
        offsets.zero_()
        return order, offsets, rows, pw, pos
    ids = ids.contiguous()
    nb = triton.next_power_of_2(n + 2)
    counted = P > MAX_PAIRS
    counts = pos  # unused unless counted
    if counted:
        counts = torch.empty(triton.cdiv(P, _SUPER), nb, dtype=torch.int32, device=dev)
        _super_counts_kernel[(counts.shape[0],)](
            ids, counts, P, experts.start, n, NB=nb, SUPER=_SUPER, num_warps=_GROUP_WARPS, **pdl_args(dev)
        )
    _groups_kernel[(triton.cdiv(P, _CHUNK),)](
        ids, weights.contiguous(), order, offsets, rows, pw, pos, counts, P, experts.start, n,
        K=k, NB=nb, PB=1 if counted else triton.next_power_of_2(P), CHUNK=_CHUNK, SUPER=_SUPER,
        COUNTED=counted,
        num_warps=_GROUP_WARPS,
        **pdl_args(dev),
    )
    return order, offsets, rows, pw, pos


# ---------------------------------------------------------------------------
# Sum of a token's expert outputs
# ---------------------------------------------------------------------------


@triton.jit
def _expert_sum_kernel(
    y_ptr,
    pos_ptr,
    live_ptr,
    ids_ptr,
    out_ptr,
    D,
    stride_y,
    stride_o,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_POS: tl.constexpr,
    HAS_LIVE: tl.constexpr,  # grouped rows at or past live_ptr[0] are read as zero
    ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``pid(0)``, columns block ``pid(1)``: its rows summed in ascending (id, slot)."""
    grid_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    slot = tl.arange(0, KP)
    ids = tl.load(ids_ptr + t * K + slot, mask=slot < K, other=0)
    # slot i comes before slot j: smaller id, or the same id in an earlier slot (a stable sort)
    i, j = ids[None, :], ids[:, None]
    before = (i < j) | ((i == j) & (slot[None, :] < slot[:, None]))
    rank = tl.sum((before & (slot[None, :] < K)).to(tl.int32), axis=1)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_LIVE:
        live = tl.load(live_ptr).to(tl.int64)
    for r in tl.static_range(K):
        j = tl.sum(tl.where((rank == r) & (slot < K), slot, 0), axis=0)
        row = t * K + j
        if HAS_POS:
            row = tl.load(pos_ptr + row).to(tl.int64)
        m = dm
        if HAS_LIVE:
            # read as +0.0, as a zeroed row would be (a [BLOCK_D] mask: the interpreter wants one)
            m = dm & ((d * 0 + row) < live)
        v = tl.load(y_ptr + row * stride_y + d, mask=m, other=0.0).to(tl.float32)
        if ROUND_BF16:
            v = _round_bf16(v)
        acc += v
    tl.store(out_ptr + t * stride_o + d, acc, mask=dm)


def expert_sum(
    y: torch.Tensor,
    ids: torch.Tensor,
    dtype: torch.dtype,
    position: torch.Tensor | None = None,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ops.moe.sum_in_expert_order(y.view(T, k, -1).float(), ids, dtype)`` (fp32 ``[T, D]``) for
    ``y [T * k, D]`` in pair order, or in grouped order with ``position`` (pair -> row of ``y``).
    ``y`` is fp32 or bf16; ``dtype`` bf16 (each row rounded to it) or fp32 (unrounded). ``live``
    (with ``position``; a one-element integer tensor): rows of ``y`` at or past it are read as zero
    (never loaded)."""
    if live is not None and position is None:
        raise ValueError("expert_sum: live bounds grouped rows; it needs position")
    T, k = ids.shape
    if y.dim() != 2 or y.shape[0] < T * k or y.stride(-1) != 1:
        raise ValueError(f"y must be [>= {T * k}, D] with unit column stride, got {tuple(y.shape)}")
    if dtype not in (torch.bfloat16, torch.float32) or y.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"expert_sum handles bf16/fp32, got y {y.dtype}, dtype {dtype}")
    D = y.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=y.device)
    if T == 0 or D == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(D))
    _expert_sum_kernel[(T, triton.cdiv(D, block_d))](
        y,
        position if position is not None else ids,
        live if live is not None else ids,
        ids.contiguous(),
        out,
        D,
        y.stride(0),
        out.stride(0),
        K=k,
        KP=triton.next_power_of_2(k),
        BLOCK_D=block_d,
        HAS_POS=position is not None,
        HAS_LIVE=live is not None,
        ROUND_BF16=dtype == torch.bfloat16 and y.dtype == torch.float32,
        num_warps=4,
        **pdl_args(y.device),
    )
    return out


@triton.jit
def _add_shared_kernel(r_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out = round_bf16(r + float(s))`` on one block of the flattened rows."""
    grid_wait(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(r_ptr + i, mask=m, other=0.0) + tl.load(s_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, _round_bf16(v).to(tl.bfloat16), mask=m)


def add_shared(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """The MoE's output ``torch.add(routed, shared).to(torch.bfloat16)`` bit for bit, in one pass:
    fp32 ``routed`` (the experts' sum) plus the bf16 ``shared`` expert's output, rounded once (an
    fp32 add and a cast wrote and read the fp32 sum once more: 154 + 57 us at 8192 Flash tokens on
    the H200)."""
    if routed.dtype != torch.float32 or shared.dtype != torch.bfloat16 or routed.shape != shared.shape:
        raise ValueError(
            f"add_shared takes fp32 routed and bf16 shared of one shape, got {routed.dtype} "
            f"{tuple(routed.shape)} and {shared.dtype} {tuple(shared.shape)}"
        )
    routed, shared = routed.contiguous(), shared.contiguous()
    out = torch.empty(routed.shape, dtype=torch.bfloat16, device=routed.device)
    n = routed.numel()
    if n:
        block = 2048
        _add_shared_kernel[(triton.cdiv(n, block),)](
            routed, shared, out, n, BLOCK=block, num_warps=4, **pdl_args(routed.device)
        )
    return out
