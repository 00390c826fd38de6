"""V4.1 mixture of experts (sqrt-softplus routing, clamped SwiGLU routed experts plus a shared
expert) with routed experts held as released (packed E2M1).

Routing is ``ops.moe.route_sqrtsoftplus`` on this rank's tokens (``ops.moe.MoeRouter``: the
reference, or one Triton kernel after the logits GEMM). The routed
experts are split over vLLM's expert group (``layers.parallel``): whole
experts with ``enable_expert_parallel``, otherwise a slice of every expert's
intermediate dimension. Tokens of other data-parallel ranks are gathered, each
rank adds what its experts give every token, and one all-reduce in the
accumulation dtype sums the ranks. Rounding follows ``ops.moe.moe_forward``
(each expert's output rounded to the activation dtype, the token's experts
and the shared expert summed in the accumulation dtype, one final rounding),
so one rank computes exactly what the reference computes.

Two ways to run the routed experts, with the same rounding points: expert
by expert (the reference: each expert's rows found on the host), and grouped
(``ops.moe.ExpertGrouping``: ``expert_groups`` sorts the (token, choice) pairs by expert on
the device, or one Triton launch counting-sorts them, and one grouped GEMM per projection runs
every local expert, with no host synchronisation; the Triton kernel on CUDA for bf16 models). The grouped way
runs where the grouped GEMM operator, built with the layer, got the Triton kernel
(``ops.dispatch``). Sums over a token's experts run in ascending expert order in
both (``ops.moe.sum_in_expert_order``; ``ops.moe.ExpertSum``'s kernel reads the grouped GEMM's
output in place).

vLLM's FusedMoE has no CPU method for these formats, and its all-to-all
needs collectives vLLM's CPU communicator lacks, so the MoE is ours; its
collectives (all-gather, all-reduce) work on gloo and NCCL alike.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import ColumnParallelLinear

from deepinfer_vllm import envs
from deepinfer_vllm.model_executor.layers.linear import V41RowParallelLinear
from deepinfer_vllm.model_executor.layers.parallel import ParallelLayout, TokenExchange
from deepinfer_vllm.model_executor.layers.params import built_for, held, ue8m0_dtype
from deepinfer_vllm.ops.eplb import initial_placement, logical_to_physical
from deepinfer_vllm.ops.moe import (
    AddShared,
    ExpertGrouping,
    ExpertSum,
    GroupedExpertGemm,
    MoeRouter,
    SwiGlu,
    expert_choices,
)
from deepinfer_vllm.ops.numerics import acc_dtype
from deepinfer_vllm.ops.shared_input import shared_inputs
from deepinfer_vllm.ops.weight_gemm import Fp4RowsGemm

_PROJECTIONS = ("w1", "w2", "w3")


class Gate(nn.Module):
    """Router weight (bf16) and its fp32 selection biases, replicated."""

    def __init__(self, n_experts: int, hidden: int):
        super().__init__()
        self.weight = held(n_experts, hidden, dtype=torch.bfloat16)
        self.bias = held(n_experts, dtype=torch.float32)
        self.bias_vl = held(n_experts, dtype=torch.float32)


class SharedExpert(nn.Module):
    """The shared expert: ``w1``/``w3`` column-parallel, ``w2`` row-parallel (FP8 32x32)."""

    def __init__(self, hidden: int, inter: int, quant_config, prefix: str):
        super().__init__()
        for name in ("w1", "w3"):
            setattr(
                self,
                name,
                ColumnParallelLinear(
                    hidden,
                    inter,
                    bias=False,
                    quant_config=quant_config,
                    prefix=f"{prefix}.{name}",
                    return_bias=False,
                ),
            )
        self.w2 = V41RowParallelLinear(inter, hidden, quant_config=quant_config, prefix=f"{prefix}.w2")
        self.swiglu = SwiGlu(*built_for())

    def forward(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        with shared_inputs(x):  # w1 and w3 multiply x: a kernel's preparation of it is made once
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.swiglu(gate, up, limit, out_dtype=x.dtype))


class RoutedExperts(nn.Module):
    """This rank's routed experts, packed E2M1 (the checkpoint's int8 bytes) with their
    UE8M0 ``*_scale`` per 1x32: ``w13`` ``[E_local, 2 * inter_local, hidden / 2]`` (the
    checkpoint's ``w1`` rows, then ``w3``'s: gate and up in one GEMM) and ``w2``
    ``[E_local, hidden, inter_local / 2]``.

    With expert load balancing (``redundant`` >= 0 passed, expert parallelism on) the rows are
    *physical slots*: ``n_experts + redundant`` of them over the expert group, ``local`` the
    consecutive slots of this rank, each holding the logical expert ``physical_to_logical`` names
    (vLLM's initial placement until a rebalance). The layer reads the maps ``logical_to_physical_map``
    ``[n_experts, replicas]`` and ``logical_replica_count`` ``[n_experts]`` and counts where this
    rank's tokens go in ``expert_load_view`` ``[physical]``: tensors a balancer owns and hands over
    (``set_eplb_state``, vLLM's ``MixtureOfExperts`` interface)."""

    def __init__(
        self, n_experts: int, hidden: int, inter: int, layout: ParallelLayout, redundant: int | None = None
    ):
        super().__init__()
        self.layout = layout
        self.balanced = redundant is not None
        self.n_logical = n_experts
        self.n_physical = n_experts + (redundant or 0)
        if self.balanced:
            if not layout.expert_parallel or self.n_physical % layout.moe_size:
                raise ValueError(
                    f"expert load balancing needs expert parallelism with {n_experts} experts + "
                    f"{redundant} redundant split equally over {layout.moe_size} ranks"
                )
            per = self.n_physical // layout.moe_size
            self.local = range(layout.moe_rank * per, (layout.moe_rank + 1) * per)
        else:
            self.local = layout.local_experts(n_experts)
        self.col0, width = layout.expert_inter(inter)
        # Without expert parallelism over several ranks, each holds a slice of
        # every expert and partial down projections are summed before rounding.
        self.split = layout.moe_size > 1 and not layout.expert_parallel
        self.width = width
        n = len(self.local)
        scale_dtype = ue8m0_dtype()
        for name, (rows, cols) in {"w13": (2 * width, hidden), "w2": (hidden, width)}.items():
            setattr(self, name, held(n, rows, cols // 2, dtype=torch.int8))
            setattr(self, f"{name}_scale", held(n, rows, cols // 32, dtype=scale_dtype))
        device, dtype = built_for()
        self.expert_gemm = Fp4RowsGemm(device, dtype)
        self.grouped_gemm = GroupedExpertGemm(device, dtype)
        # The grouped path where its GEMM runs the kernel; expert by expert on the reference.
        self.grouped = self.grouped_gemm.backend == "triton"
        # Grouping and the sums over a token's experts (reference or Triton kernels, ops.moe).
        self.grouping = ExpertGrouping(device, dtype)
        self.expert_sum = ExpertSum(device, dtype)
        self.swiglu = SwiGlu(device, dtype)  # clamped SwiGLU times the routing weight, rounded once
        # Where the down projection's kernel stages its input in the GPU GEMMs' tile order, the SwiGLU writes
        # it so (one pass less over the activation): chosen once, from the weight this layer holds.
        self.act_tile_order = self.grouped and self.grouped_gemm.reads_tile_order(self.w2)
        if self.balanced:
            start = initial_placement(1, n_experts, self.n_physical)
            # Logical expert of each slot (the balancer keeps it current; loading reads it).
            self.physical_to_logical = start.phy_to_log[0].to(device)
            self.logical_to_physical_map = start.log_to_phys[0].to(device)
            self.logical_replica_count = start.replica_count[0].to(device)
            self.expert_load_view = torch.zeros(self.n_physical, dtype=torch.int64, device=device)
            # Replicas reduce in a fixed order under batch invariance: every (token, expert) pair
            # travels on its own through the group's sum and a token's pairs are summed after it,
            # in ascending logical id, whichever rank computed them.
            self.per_pair = envs.batch_invariant()
            # Only the first tensor-parallel rank of a data-parallel rank counts (its peers see the
            # same tokens), so the group's sum counts every token once.
            self.counts_tokens = layout.tp_rank == 0
        else:
            self.per_pair = self.split

    # --------------------------------------------------- load balancing (vLLM's interface)
    def set_eplb_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        """Read the maps and count into a balancer's tensors (views of them: its updates are seen)."""
        if not self.balanced:
            raise RuntimeError("this MoE layer was built without expert load balancing")
        self.expert_load_view = expert_load_view[moe_layer_idx]
        self.logical_to_physical_map = logical_to_physical_map[moe_layer_idx]
        self.logical_replica_count = logical_replica_count[moe_layer_idx]

    def get_expert_weights(self) -> list[torch.Tensor]:
        """This rank's slot tensors, each ``[local slots, -1]`` over the parameters' storage (what a
        rebalance moves)."""
        n = len(self.local)
        return [getattr(self, name).data.view(n, -1) for name in ("w13", "w13_scale", "w2", "w2_scale")]

    def to_physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Physical slots of routed logical ``ids [T, k]`` (-1 stays -1); device ops only."""
        return logical_to_physical(ids, self.logical_to_physical_map, self.logical_replica_count)

    def record_load(self, slots: torch.Tensor) -> None:
        """Count this rank's own (token, expert) pairs per physical slot, on the device."""
        if not self.counts_tokens:
            return
        flat = slots.reshape(-1)
        valid = (flat >= 0).to(self.expert_load_view.dtype)
        self.expert_load_view[: self.n_physical].scatter_add_(0, flat.clamp(min=0), valid)

    def param_name(self, proj: str, kind: str) -> str:
        """The parameter holding checkpoint tensor ``experts.E.{proj}.{kind}``."""
        name = "w2" if proj == "w2" else "w13"
        return name if kind == "weight" else f"{name}_scale"

    def load_expert(self, proj: str, kind: str, expert: int, loaded: torch.Tensor) -> bool:
        """Copy this rank's part of checkpoint tensor ``experts.{expert}.{proj}.{kind}``;
        False when the expert lives on another rank. With load balancing every local slot
        holding the expert gets a copy."""
        if self.balanced:
            held_by = self.physical_to_logical[self.local.start : self.local.stop].tolist()
            rows = [j for j, e in enumerate(held_by) if e == expert]
        else:
            rows = [expert - self.local.start] if expert in self.local else []
        if rows and kind == "scale" and self.grouped:
            self.grouped_gemm.check_scales(loaded, f"experts.{expert}.{proj}.scale")
        per_byte = 2 if kind == "weight" else 32  # columns per stored element
        for row in rows:
            dest = getattr(self, self.param_name(proj, kind)).data[row]
            if proj == "w2":  # split along the input (intermediate) columns
                src = loaded.narrow(1, self.col0 // per_byte, dest.shape[1])
            else:
                dest = dest[: self.width] if proj == "w1" else dest[self.width :]
                src = loaded.narrow(0, self.col0, self.width)
            dest.copy_(src.view(dest.dtype) if src.element_size() == 1 else src)
        return bool(rows)

    def _expert(self, i: int, x: torch.Tensor, row_w: torch.Tensor, limit: float, out_dtype) -> torch.Tensor:
        gate, up = self.expert_gemm(x, self.w13[i], self.w13_scale[i]).split(self.width, dim=-1)
        act = self.swiglu(gate, up, limit, row_w, x.dtype)
        return self.expert_gemm(act, self.w2[i], self.w2_scale[i], out_dtype)

    def partial(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        limit: float,
        grouped: bool | None = None,
        order_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What this rank's experts contribute, in the accumulation dtype; ``ids`` are the
        (physical) experts or slots of every (token, choice), ``order_ids`` the logical ids whose
        ascending order sums a token's experts (default ``ids``).

        Whole experts: ``[N, hidden]``, each expert's output rounded and summed
        over the token's experts (ascending ids). Split experts: the unrounded
        partial down projection of every (token, choice) ``[N * k, hidden]``,
        to be summed over the ranks and then ``combine``d. ``per_pair`` (batch-invariant
        load balancing): every (token, choice) rounded, ``[N * k, hidden]``, zero where another
        rank computes it, also ``combine``d after the sum. ``grouped`` picks the
        grouped path (default: ``self.grouped``, chosen when the layer was built).
        """
        if grouped is None:
            grouped = self.grouped
        if grouped:
            return self._partial_grouped(x, weights, ids, limit, order_ids)
        acc = acc_dtype(x.dtype)
        flat_w = weights.reshape(-1).to(acc)
        rows_out = ids.numel() if self.per_pair else ids.shape[0]
        out = torch.zeros(rows_out, self.w2.shape[1], dtype=acc, device=x.device)
        for e, sel, rows in expert_choices(ids, self.local):
            i = e - self.local.start
            if self.split:
                out[sel] = self._expert(i, x[rows], flat_w[sel], limit, acc)
            elif self.per_pair:
                out[sel] = self._expert(i, x[rows], flat_w[sel], limit, x.dtype).to(acc)
            else:
                out.index_add_(0, rows, self._expert(i, x[rows], flat_w[sel], limit, x.dtype).to(acc))
        return out

    def _partial_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float, order_ids=None
    ):
        """``partial`` with every local expert in one grouped GEMM per projection."""
        acc = acc_dtype(x.dtype)
        groups = self.grouping(ids, self.local, weights)
        gemm = self.grouped_gemm
        # Pairs of other ranks' experts sit past offsets[-1]. Nothing reads them but the pair-order
        # paths (split experts, per-pair outputs), which need them zero: the gate/up GEMM leaves
        # them unwritten, the activation uncomputed (the down projection reads no row past
        # offsets[-1]), the down projection zero only for those paths (the expert sum skips them).
        # The kernels pick their tiles for the rows this rank's experts expect (routing spread evenly), not for
        # all the pairs.
        local_rows = -(-groups.rows.shape[0] * len(self.local) // self.n_physical)
        gate_up = gemm(
            x, groups.offsets, self.w13, self.w13_scale, x.dtype, rows=groups.rows, zero_rest=False,
            local_rows=local_rows,
        )
        gate, up = gate_up.split(self.width, dim=-1)
        tiled = self.act_tile_order
        act = self.swiglu(gate, up, limit, groups.weights, x.dtype, groups.offsets[-1:], tile_order=tiled)
        pair_order = self.split or self.per_pair
        down_dtype = acc if self.split else x.dtype
        down = gemm(
            act, groups.offsets, self.w2, self.w2_scale, down_dtype, zero_rest=pair_order,
            x_tile_ordered=tiled, local_rows=local_rows,
        )
        if pair_order:
            per_pair = groups.in_pair_order(down)
            return per_pair if self.split else per_pair.to(acc)
        order_ids = ids if order_ids is None else order_ids
        return self.expert_sum(down, order_ids, x.dtype, groups)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """The routed experts' sum for this rank's tokens ``x`` routed to logical ``ids [T, k]`` with
        ``weights``, in the accumulation dtype: every data-parallel rank's tokens gathered, each
        rank's (local slots') contribution, one sum over the expert group, this rank's rows."""
        ex = TokenExchange(self.layout, x.shape[0], x.device)
        ids_all = ex.gather(ids, fill=-1)
        slots_all = ids_all
        if self.balanced:
            # Every rank maps the same gathered ids with the same map: each pair has one slot.
            slots_all = self.to_physical(ids_all)
            self.record_load(ex.own(slots_all))
        routed = ex.reduce(
            self.partial(ex.gather(x), ex.gather(weights), slots_all, limit, order_ids=ids_all)
        )
        if self.per_pair:
            routed = self.combine(routed, ids_all, x.dtype)
        return ex.own(routed)

    def combine(self, summed: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Split experts (and ``per_pair``): round each (token, choice) to ``dtype`` and sum a
        token's choices in ascending (logical) expert order, as one rank would."""
        return self.expert_sum(summed, ids, dtype)


class V41MoE(nn.Module):
    """Sqrt-softplus routing with bias-steered top-k, clamped SwiGLU experts, a shared expert."""

    def __init__(
        self,
        hidden: int,
        inter: int,
        n_experts: int,
        top_k: int,
        routed_scaling_factor: float,
        norm_topk_prob: bool,
        swiglu_limit: float,
        image_token_id: int | None,
        quant_config,
        layout: ParallelLayout,
        prefix: str,
        redundant: int | None = None,
    ):
        super().__init__()
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.swiglu_limit = swiglu_limit
        self.image_token_id = image_token_id
        self.layout = layout
        self.gate = Gate(n_experts, hidden)
        self.router = MoeRouter(*built_for())
        self.experts = RoutedExperts(n_experts, hidden, inter, layout, redundant)
        self.shared_experts = SharedExpert(hidden, inter, quant_config, f"{prefix}.shared_experts")
        self.add_shared = AddShared(*built_for())

    @classmethod
    def from_arch(
        cls,
        arch,
        n_experts: int,
        top_k: int,
        quant_config,
        layout: ParallelLayout,
        prefix: str,
        redundant: int | None = None,
    ):
        """A block's MoE: the backbone's (``n_routed_experts``/``top_k``) or a DSpark stage's;
        ``redundant`` slots with expert load balancing (None: off)."""
        return cls(
            arch.hidden_size,
            arch.moe_intermediate_size,
            n_experts,
            top_k,
            arch.routed_scaling_factor,
            arch.norm_topk_prob,
            arch.swiglu_limit,
            arch.image_token_id,
            quant_config,
            layout,
            prefix=prefix,
            redundant=redundant,
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(
            x,
            self.gate.weight,
            self.gate.bias,
            self.top_k,
            self.routed_scaling_factor,
            self.norm_topk_prob,
            bias_vl=self.gate.bias_vl,
            token_ids=input_ids,
            image_token_id=self.image_token_id,
        )
        # The routed experts' gate/up GEMM and the shared expert's w1/w3 multiply x: one preparation of it
        with shared_inputs(x):
            routed = self.experts(x, weights, ids, self.swiglu_limit)
            shared = self.shared_experts(x, self.swiglu_limit)
        return self.add_shared(routed, shared, x.dtype)
