"""Mixture-of-experts references, and the grouped expert GEMM operator a layer builds.

Routing: fp32 logits, ``sqrt(softplus(logit))`` scores, selection on ``score + bias`` (the
image-token bias ``bias_vl`` for image rows) with a stable descending sort (ties: lower expert
index first), weights from the UNBIASED scores, renormalised and scaled.

Experts: clamped SwiGLU ``w2 . (silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` on dequantised
weights. Rounding points follow DeepInfer's expert pipeline (its GPU kernels round there):
  1. gate/up GEMM outputs are rounded to the activation dtype;
  2. SwiGLU runs in fp32 and, for routed experts, the routing weight is multiplied into the
     fp32 activation BEFORE the down projection (DeepInfer fuses the weight into its SwiGLU
     cast; vLLM's fused MoE applies it to the down-projection output instead). The product is
     rounded to the activation dtype (DeepInfer casts to MXFP8 there; the plain reference keeps
     the model dtype);
  3. each expert's down-projection output is rounded to the activation dtype;
  4. the routed outputs of a token and the shared expert output are summed in fp32 and the
     sum is rounded once to the activation dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import quant_gemm
from .dispatch import KernelOp
from .numerics import acc_dtype, gemm, matmul, pointwise
from .weight_gemm import ActivationsGemm

__all__ = [
    "AddShared",
    "ExpertGrouping",
    "ExpertSum",
    "GroupedExpertGemm",
    "Groups",
    "MoeRouter",
    "SwiGlu",
    "stable_topk_indices",
    "route_sqrtsoftplus",
    "sqrtsoftplus_select",
    "swiglu_clamped",
    "expert_mlp",
    "expert_choices",
    "expert_groups",
    "sum_in_expert_order",
    "moe_forward",
]


def stable_topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of each row, largest first; equal values keep
    ascending index order (stable descending sort). int64 ``[..., k]``."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return order[..., :k]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # GEMM of the given (already dequantised) operands, rounded once to x.dtype.
    return gemm(x, w)


def route_sqrtsoftplus(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
    bias_vl: torch.Tensor | None = None,
    is_image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sqrt-softplus score routing with bias-steered selection.

    Returns ``(topk_weights fp32 [T, k], topk_ids int64 [T, k])``.

    * logits ``x . gate_weight^T`` in fp32 (both operands upcast), scores ``sqrt(softplus)`` fp32;
    * selection key ``score + bias`` (``bias_vl`` for rows with ``is_image`` when ``bias_vl`` is
      given, else ``bias``); ``bias=None`` = 0;
      ids are ordered by decreasing key, ties -> lower expert index;
    * weights: unbiased scores of the chosen experts; with ``norm_topk_prob`` divided by their
      sum (+1e-20, as the DeepSeek gate kernel does), then times ``routed_scaling_factor``.
    """
    acc = acc_dtype(x.dtype)
    logits = matmul(x.to(acc), gate_weight.to(acc))
    return sqrtsoftplus_select(
        logits, bias, top_k, routed_scaling_factor, norm_topk_prob, bias_vl=bias_vl, is_image=is_image
    )


def sqrtsoftplus_select(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
    bias_vl: torch.Tensor | None = None,
    is_image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``route_sqrtsoftplus`` from its logits ``[T, E]`` (in the accumulation dtype) on."""
    acc = logits.dtype
    scores = pointwise(F.softplus, logits).sqrt()
    E = scores.shape[-1]
    if bias is None:
        bias = torch.zeros(E, dtype=acc, device=scores.device)
    key_bias = bias.to(acc).unsqueeze(0).expand_as(scores)
    if is_image is not None and bias_vl is not None:
        key_bias = torch.where(is_image.view(-1, 1).bool(), bias_vl.to(acc).unsqueeze(0), key_bias)
    # without bias_vl (checkpoint lacks it: no vision tower) every row uses ``bias``
    ids = stable_topk_indices(scores + key_bias, top_k)
    chosen = scores.gather(1, ids)
    if norm_topk_prob:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * routed_scaling_factor, ids


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` computed and RETURNED in fp32
    (callers round where the pipeline rounds). ``limit=None`` disables the clamp."""
    acc = acc_dtype(gate.dtype)
    g = gate.to(acc)
    u = up.to(acc)
    if limit is not None:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, min=-limit, max=limit)
    return pointwise(F.silu, g) * u


def expert_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """One clamped SwiGLU expert on dequantised weights (``w1, w3 [N, K]``, ``w2 [K', N]``).

    Rounding: gate/up GEMMs -> ``x.dtype``; SwiGLU in fp32, optionally times ``row_weight``
    (fp32 ``[T]``, the routing weight); rounded to ``x.dtype``; down GEMM -> ``x.dtype``.
    """
    act = swiglu_clamped(_linear(x, w1), _linear(x, w3), limit)
    if row_weight is not None:
        act = act * row_weight.to(act.dtype).unsqueeze(-1)
    return _linear(act.to(x.dtype), w2)


def expert_choices(
    topk_ids: torch.Tensor, experts: range
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Each expert of ``experts`` that some token chose, in ascending id order:
    ``(expert, choices, tokens)``, where ``choices`` index the flattened ``[T * k]``
    (token, slot) pairs that chose it and ``tokens`` are their rows. Ids outside
    ``experts`` (e.g. -1, or experts held elsewhere) are skipped."""
    T, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    flat_rows = torch.arange(T, device=topk_ids.device).repeat_interleave(k)
    live = (flat_ids >= experts.start) & (flat_ids < experts.stop)
    for e in torch.unique(flat_ids[live]).tolist():
        sel = (flat_ids == e).nonzero(as_tuple=True)[0]
        yield e, sel, flat_rows[sel]


def expert_groups(topk_ids: torch.Tensor, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of ``topk_ids [T, k]`` grouped by expert, with device ops only
    (no host synchronisation, so it can run inside a CUDA graph).

    Returns ``order [T * k]`` int64, the flattened pair indices sorted by expert (stable:
    ascending pair index within an expert; pairs whose expert is outside ``experts`` come
    last), and ``offsets [len(experts) + 1]`` int64: the pairs of expert
    ``experts.start + i`` are ``order[offsets[i]:offsets[i + 1]]``, and ``offsets[-1]`` is
    the number of pairs this rank computes. ``expert_choices`` is the same grouping
    expert by expert."""
    n = len(experts)
    local = topk_ids.reshape(-1) - experts.start
    key = torch.where((local >= 0) & (local < n), local, n)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(n + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.zeros(n + 1, dtype=torch.int64, device=key.device)
    torch.cumsum(counts[:n], 0, out=offsets[1:])
    return order, offsets


def sum_in_expert_order(y: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y [T, k, D]`` (one row per token and slot) rounded to ``dtype`` and summed over a
    token's slots in ascending expert id, from zero, in ``y``'s dtype: the order in which
    ``moe_forward`` adds expert outputs, so the sums agree bit for bit. Device ops only."""
    order = torch.sort(topk_ids, dim=-1, stable=True).indices
    picked = y.gather(1, order.unsqueeze(-1).expand_as(y)).to(dtype).to(y.dtype)
    out = torch.zeros(y.shape[0], y.shape[2], dtype=y.dtype, device=y.device)
    for j in range(y.shape[1]):
        out += picked[:, j]
    return out


def moe_forward(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts (``w1, w3 [E, N, K]``, ``w2 [E, K', N]``) plus optional shared expert.

    Rounding per the module docstring: per-expert outputs in ``x.dtype``, fp32 accumulation
    over the token's experts and the shared expert, one final rounding to ``x.dtype``.
    Ids outside ``[0, E)`` (e.g. -1) are skipped. Loops over the experts that got tokens.
    """
    T = x.shape[0]
    out_dim = w2.shape[1]
    acc = torch.zeros(T, out_dim, dtype=acc_dtype(x.dtype), device=x.device)
    flat_w = topk_weights.reshape(-1).to(acc.dtype)
    # One view per expert up front: under autograd (draft training) the stacks' gradient is
    # then one stack of the experts' gradients, not a zero-filled copy per expert used.
    w1s, w3s, w2s = w1.unbind(0), w3.unbind(0), w2.unbind(0)
    for e, sel, rows in expert_choices(topk_ids, range(w1.shape[0])):
        y = expert_mlp(x[rows], w1s[e], w3s[e], w2s[e], limit, row_weight=flat_w[sel])
        acc.index_add_(0, rows, y.to(acc.dtype))
    if shared is not None:
        s1, s3, s2 = shared
        acc += expert_mlp(x, s1, s3, s2, limit).to(acc.dtype)
    return acc.to(x.dtype)


class GroupedExpertGemm(ActivationsGemm):
    """The routed experts' grouped packed-E2M1 GEMM, ``grouped_fp4_gemm(x, offsets, weight,
    scale, out_dtype, rows)``: rows ``offsets[e]:offsets[e+1]`` of ``x`` (of ``x[rows]`` when
    ``rows`` is given: the kernels gather them as they load) times expert ``e``'s weight, zeros
    past ``offsets[-1]``. The reference (``ops.quant_gemm``, which reads the
    offsets on the host) or the Triton kernel (``ops/triton/moe_gemm.py``, no host
    synchronisation). Activations as ``DEEPINFER_GEMM_ACTIVATIONS`` says, read when built.
    ``zero_rest=False``: the rows past ``offsets[-1]`` are unspecified (the kernel leaves them
    unwritten; the reference zeros them), for callers that never read them. ``local_rows``: how many
    rows the caller expects before ``offsets[-1]`` (its estimate; the kernel picks its tiles by it
    instead of by R)."""

    name = "moe_grouped_gemm"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.moe_gemm"}

    def reads_tile_order(self, weight: torch.Tensor) -> bool:
        """Whether the chosen implementation stages this weight's ``x`` in ``quant_gemm.tile_order_columns``'s
        order (the Gluon kernel, bf16 activations): then the layer's producer of ``x`` writes it so and passes
        ``x_tile_ordered=True``, which saves the GEMM a rewrite of ``x``. Asked once, when the layer is
        built."""
        reads = getattr(self.kernels, "reads_tile_order", None) if self.backend == "triton" else None
        return self.act == "bf16" and bool(reads and reads(weight))

    def forward_native(
        self, x, offsets, weight, scale, out_dtype=None, rows=None, zero_rest=True, x_tile_ordered=False,
        local_rows=None,
    ):
        return quant_gemm.grouped_fp4_gemm(
            x, offsets, weight, scale, self.act, out_dtype, rows=rows, x_tile_ordered=x_tile_ordered
        )

    def forward_triton(
        self, x, offsets, weight, scale, out_dtype=None, rows=None, zero_rest=True, x_tile_ordered=False,
        local_rows=None,
    ):
        return self.kernels.grouped_fp4_gemm(
            x, offsets, weight, scale, self.act, out_dtype, rows=rows, zero_rest=zero_rest,
            x_tile_ordered=x_tile_ordered, local_rows=local_rows,
        )


# ---------------------------------------------------------------------------------------------
# Routing and grouping operators (the reference above, or ops/triton/routing.py)
# ---------------------------------------------------------------------------------------------


class Groups(NamedTuple):
    """(token, slot) pairs grouped by local expert: ``order`` and ``offsets`` as ``expert_groups``
    gives them, ``rows = order // k`` (each grouped pair's token), ``weights`` (the routing weights
    in grouped order) and ``position`` (the grouped row of each pair, the inverse of ``order``;
    None where the implementation did not form it)."""

    order: torch.Tensor
    offsets: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    position: torch.Tensor | None

    def in_pair_order(self, y: torch.Tensor) -> torch.Tensor:
        """Rows ``y`` in grouped order (a grouped GEMM's output) put back in (token, slot) order."""
        return torch.empty_like(y).index_copy_(0, self.order, y)

    def live(self, y: torch.Tensor) -> torch.Tensor:
        """``y`` in grouped order with the rows past ``offsets[-1]`` (other ranks' pairs) zero,
        whatever they held (no host synchronisation)."""
        grouped_row = torch.arange(y.shape[0], device=y.device).unsqueeze(-1)
        zero = torch.zeros((), dtype=y.dtype, device=y.device)
        return torch.where(grouped_row < self.offsets[-1:], y, zero)


class _Bf16Kernels(KernelOp):
    """A ``fused``-family operator whose kernels compute the fp32 islands of bf16 models: models of
    other dtypes (fp32, whose islands accumulate in fp64) keep the reference on every backend."""

    family = "fused"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.routing"}

    def _implementation(self, backend: str):
        if self.dtype != torch.bfloat16:
            return self.forward_native
        return super()._implementation(backend)


class MoeRouter(_Bf16Kernels):
    """``route_sqrtsoftplus`` with ``is_image = token_ids == image_token_id`` (no image rows when
    either is None): the reference, or the logits GEMM and one Triton kernel for the rest."""

    name = "moe_route"

    def forward_native(
        self, x, gate_weight, bias, top_k, routed_scaling_factor, norm_topk_prob=True, bias_vl=None,
        token_ids=None, image_token_id=None,
    ):
        is_image = None
        if token_ids is not None and image_token_id is not None:
            is_image = token_ids == image_token_id
        return route_sqrtsoftplus(
            x, gate_weight, bias, top_k, routed_scaling_factor, norm_topk_prob, bias_vl=bias_vl,
            is_image=is_image,
        )

    def forward_triton(
        self, x, gate_weight, bias, top_k, routed_scaling_factor, norm_topk_prob=True, bias_vl=None,
        token_ids=None, image_token_id=None,
    ):
        return self.kernels.route_sqrtsoftplus(
            x, gate_weight, bias, top_k, routed_scaling_factor, norm_topk_prob, bias_vl, token_ids,
            image_token_id,
        )


class ExpertGrouping(_Bf16Kernels):
    """``Groups`` of ``ids [T, k]`` over ``experts`` with ``weights [T, k]``: the reference
    (``expert_groups`` and two gathers), or the Triton counting sort (one launch up to the kernel's
    ``MAX_PAIRS`` pairs, two above; shapes decide: no host synchronisation), which also gives each
    pair's grouped row so the expert sum reads the grouped output in place."""

    name = "moe_expert_groups"

    def forward_native(self, ids: torch.Tensor, experts: range, weights: torch.Tensor) -> Groups:
        order, offsets = expert_groups(ids, experts)
        return Groups(order, offsets, order // ids.shape[1], weights.reshape(-1)[order], None)

    def forward_triton(self, ids: torch.Tensor, experts: range, weights: torch.Tensor) -> Groups:
        return Groups(*self.kernels.expert_groups(ids, experts, weights))


class ExpertSum(_Bf16Kernels):
    """A token's ``k`` expert outputs rounded to ``dtype`` and summed in ascending id:
    ``sum_in_expert_order(y.view(T, k, -1).to(acc_dtype(dtype)), ids, dtype)`` for rows ``y`` in
    pair order, or in grouped order when ``groups`` is given (the grouped GEMM's output, read in
    place by the kernel through ``groups.position``; the reference scatters it back first). With
    ``groups``, the rows past ``groups.offsets[-1]`` (other ranks' pairs) count as zero whatever
    they hold: the grouped GEMM need not write them (``zero_rest=False``), the kernel skips them."""

    name = "moe_expert_sum"

    def forward_native(
        self, y: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, groups: Groups | None = None
    ) -> torch.Tensor:
        if groups is not None:
            y = groups.in_pair_order(groups.live(y))
        return sum_in_expert_order(y.view(*ids.shape, -1).to(acc_dtype(dtype)), ids, dtype)

    def forward_triton(
        self, y: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, groups: Groups | None = None
    ) -> torch.Tensor:
        if groups is None:
            return self.kernels.expert_sum(y, ids, dtype)
        if groups.position is None:
            return self.kernels.expert_sum(groups.in_pair_order(groups.live(y)), ids, dtype)
        return self.kernels.expert_sum(y, ids, dtype, groups.position, groups.offsets[-1:])


class AddShared(_Bf16Kernels):
    """The MoE's last step, ``torch.add(routed, shared).to(dtype)``: the routed experts' sum (in the
    accumulation dtype, after the expert group's sum) plus the shared expert's output, rounded
    once; the reference, or one Triton pass for fp32 ``routed``, bf16 ``shared`` and ``dtype``."""

    name = "moe_add_shared"

    def forward_native(self, routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # the shared expert's output widened to ``routed``'s dtype inside the add (type promotion)
        return torch.add(routed, shared).to(dtype)

    def forward_triton(self, routed: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if (routed.dtype, shared.dtype, dtype) != (torch.float32, torch.bfloat16, torch.bfloat16):
            return self.forward_native(routed, shared, dtype)
        return self.kernels.add_shared(routed, shared)


class SwiGlu(_Bf16Kernels):
    """The experts' clamped SwiGLU, optionally times each row's routing weight, rounded once to
    ``out_dtype``: ``(swiglu_clamped(gate, up, limit) * row_weight[:, None]).to(out_dtype)`` (the
    weight cast to the fp32 activation's dtype first), or one Triton launch reading ``gate`` and
    ``up`` through their strides (``ops/triton/swiglu.py``: bit-exact on the GPU). Gate/up of
    dtypes other than bf16/fp16 (or of two dtypes), or other output dtypes, keep the reference.
    ``live_rows`` (a one-element integer tensor, e.g. a grouped GEMM's ``offsets[-1:]``): rows at or
    past it need not be computed and their output is unspecified (the kernel leaves them unwritten;
    the grouped GEMM that follows never reads them). ``tile_order``: the output's columns in the GPU
    GEMMs' staging order (``quant_gemm.to_tile_order``; ``GroupedExpertGemm.reads_tile_order``)."""

    name = "moe_swiglu"
    kernel_modules = {"triton": "deepinfer_vllm.ops.triton.swiglu"}

    def forward_native(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        limit: float | None,
        row_weight: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        live_rows: torch.Tensor | None = None,
        tile_order: bool = False,
    ) -> torch.Tensor:
        act = swiglu_clamped(gate, up, limit)
        if row_weight is not None:
            act = act * row_weight.to(act.dtype).unsqueeze(-1)
        act = act.to(out_dtype)
        return quant_gemm.to_tile_order(act) if tile_order else act

    def forward_triton(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        limit: float | None,
        row_weight: torch.Tensor | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        live_rows: torch.Tensor | None = None,
        tile_order: bool = False,
    ) -> torch.Tensor:
        k = self.kernels
        if gate.dtype != up.dtype or gate.dtype not in k.IN_DTYPES or out_dtype not in k.OUT_DTYPES:
            return self.forward_native(gate, up, limit, row_weight, out_dtype, tile_order=tile_order)
        return k.swiglu(gate, up, limit, row_weight, out_dtype, live_rows, tile_order)
